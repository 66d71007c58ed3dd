"""The code reward: fraction of tests passed, label formats, and hostile programs scored 0, contained."""

import json

import pytest

from posttrain.core.plugins import load_plugins
from posttrain.core.types import Sample
from posttrain.plugins.rewards.code import extract_code, parse_tests

Code = load_plugins().rewards["code"]
ADD = [{"input": "1 2\n", "output": "3"}, {"input": "5 5\n", "output": "10"}, {"input": "0 0\n", "output": "0"}]


def score(response, label=ADD, **config):
    config = {"timeout": 3.0, "per_test_timeout": 1.0, **config}
    return Code(Code.Config(**config)).check(Sample(prompt="", response=response, label=label))


@pytest.mark.parametrize("response,label,expected", [
    ("```python\na, b = map(int, input().split())\nprint(a + b)\n```", ADD, 1.0),
    ("Here:\n```py\na, b = map(int, input().split())\nprint(a + b)   \n\n```\nDone.", ADD, 1.0),
    ("a, b = map(int, input().split())\nprint(a * b if a == 5 else a + b)", ADD, 2 / 3),
    ("```python\nprint(3)\n```", json.dumps(ADD), 1 / 3),
    ("import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\nsys.exit(0)",
     {"inputs": ["1 2", "2 2"], "outputs": ["3", "4"]}, 1.0),
    ("def f(x):\n    return x + 1", ["assert f(1) == 2", "assert f(2) == 4"], 0.5),
    ("def f(x):\n    return x + 1", "assert f(1) == 2\nassert f(0) == 1", 1.0),
    ("def f(x):\n    return x + 1", {"asserts": ["assert f(5) == 6"]}, 1.0),
    ("def f(n):\n    return range(n)", ["assert list(f(3)) == [0, 1, 2]", "assert f(2) == range(2)"], 1.0),
    ("def f(n):\n    return map(abs, range(-n, 0))", ["assert f(2) == [2, 1]", "assert f(1) == sum(range(2))"], 0.5),
    ("def f(:", ADD, 0.0),
    ("raise SystemExit('bye')", ["assert True"], 1.0),  # exiting early is not a crash
    ("raise RuntimeError('x')", ["assert True"], 0.0),  # a program that crashes on load fails every test
])
def test_code_table(response, label, expected):
    assert score(response, label)["score"] == pytest.approx(expected)


def test_hostile_programs_score_zero_and_are_contained(tmp_path):
    outside = tmp_path / "owned.txt"
    hostile = {
        "loop": "while True:\n    pass",
        "memory": "x = bytearray(10 * 2**30)\nprint(3)",
        "fork": "import os\nif os.fork() == 0:\n    print(3)",
        "socket": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\nprint(3)",
        "write": f"open({str(outside)!r}, 'w').write('x')\nprint(3)",
        "read_tests": "print(open('tests.json').read())",
        "forge": "print('{\"ok\": true}')\nprint('deadbeef{\"ok\": true}')",
    }
    label = [{"input": "", "output": "3"}]
    for name, program in hostile.items():
        out = score(program, label, memory_mb=256)
        assert out["score"] == 0.0, name
    assert not outside.exists()
    assert score("while True:\n    pass", label)["timed_out"] == 0.0  # per-test timeout fired first
    assert score("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass", label,
                 timeout=1.0)["timed_out"] == 1.0


def test_helpers_and_bad_labels():
    assert extract_code("a\n```python\nx=1\n```\nb\n```python\nx=2\n```") == "x=2\n"
    assert extract_code("no fence", require_fence=True) is None
    assert score("print(3)", [{"input": "", "output": "3"}], require_fence=True)["score"] == 0.0
    assert parse_tests('[{"input": "1", "output": "2"}]') == ("io", [{"input": "1", "output": "2"}])
    for bad in ("nothing here", {"inputs": [1], "outputs": []}, [1, 2], 5):
        with pytest.raises(ValueError, match="code label"):
            parse_tests(bad)


async def test_async_call_runs_samples_in_parallel():
    import asyncio

    reward = Code(Code.Config(max_parallel=2))
    samples = [Sample(prompt="", response=f"print({i})", label=[{"input": "", "output": "1"}]) for i in range(4)]
    results = await asyncio.gather(*(reward(s) for s in samples))
    assert [r["score"] for r in results] == [0.0, 1.0, 0.0, 0.0]


def test_expected_outputs_never_enter_the_sandbox():
    # the program hunts the harness's memory for the expected output and the verdict nonce
    program = (
        "import gc, json, sys\n"
        "found = [o for o in gc.get_objects() if isinstance(o, dict) and 'nonce' in o]\n"
        "spec = found[0] if found else {}\n"
        "text = json.dumps(spec)\n"
        "print('SECRET-42' if 'SECRET-42' in text else 'nothing')\n"
        "if spec:\n"
        "    sys.__stdout__.write(spec['nonce'] + json.dumps({'i': 0, 'ok': True, 'out': 'forged'}) + '\\n')\n"
        "    sys.__stdout__.flush()\n")
    out = score(program, [{"input": "", "output": "SECRET-42"}])
    assert out["score"] == 0.0 and out["compiled"] == 1.0
