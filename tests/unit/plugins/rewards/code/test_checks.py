"""Forged verdicts in assert tests: the expected side is computed where the program cannot reach it, the
builtins a test names mean the builtins, and correct answers that are ranges or iterators compare by value.

A forging program rebinds a builtin (or ``math.factorial``), in its globals or on the module, so that a
constant-returning function would pass; each must score 0, and the honest program 1.0 on the same tests.
"""

from __future__ import annotations

import json
import time

import pytest

from posttrain.core.plugins import load_plugins
from posttrain.core.types import Sample
from posttrain.plugins.rewards.code.checks import ENCODER, MAX_ENCODED_ITEMS, MAX_RANGE, decode, split_assert

Code = load_plugins().rewards["code"]
REWARD = Code(Code.Config(timeout=5.0, per_test_timeout=2.0, memory_mb=512))


def verdict(program: str, tests: list[str], reward=REWARD):
    return reward.verdict(Sample(prompt="", response=program, label=tests))


# ---- splitting and the encoding, in this process --------------------------------------------------------

@pytest.mark.parametrize("test,program,reference", [
    ("assert f(5) == sum(range(5))", [("f(5)", [])], [("sum(range(5))", [])]),
    ("assert f(5) == math.factorial(5)", [("f(5)", [])], [("math.factorial(5)", ["math"])]),
    ("assert list(map(f, [1, 2])) == [2, 3]", [("map(f, [1, 2])", [])], []),
    ("assert isinstance(f(5), int)", [("f(5)", [])], []),
    ("assert list(reversed(f(3))) == [1]", [("f(3)", [])], []),
    ("assert all(f(n) == math.factorial(n) for n in range(3))",
     [("all((f(n) == math.factorial(n) for n in range(3)))", ["math"])], []),
    ("assert [f(x) for x in range(3)] == [x * x for x in range(3)]",
     [("[f(x) for x in range(3)]", [])], [("[x * x for x in range(3)]", [])]),
    ("assert f(1) == 2", [("f(1)", [])], []),  # a literal never leaves the skeleton
    ("assert sorted(f(1)) == sorted([3, 1])", [("f(1)", [])], []),
    ("assert string.ascii_lowercase[:3] == f(3)", [("f(3)", [])], [("string.ascii_lowercase[:3]", ["string"])]),
    ("assert f(string) == 1", [("f(string)", [])], []),  # a bare module name is the program's
])
def test_split_sends_the_expected_side_to_reference_leaves(test, program, reference):
    check = split_assert(test)
    assert [(leaf.src, leaf.modules) for leaf in check.leaves] == program
    assert [(leaf.src, leaf.modules) for leaf in check.refs] == reference


def test_program_leaves_pin_the_builtins_and_modules_they_name():
    check = split_assert("assert all(isinstance(f(n), int) and f(n) < math.inf for n in range(3))")
    assert check.leaves[0].pinned == ["all", "int", "isinstance", "math", "range"]
    assert split_assert("assert [f(sum) for sum in xs] == []").leaves[0].pinned == []  # bound, not builtin


def test_decode_ranges_and_iterators():
    assert decode({"r": [0, 5, 1]}) == range(5) and decode({"r": [0, 5, 1]}) != [0, 1, 2, 3, 4]
    assert decode({"i": [1, {"i": [2]}]}) == [1, [2]]
    with pytest.raises(ValueError, match=f"more than {MAX_RANGE}"):
        decode({"r": [0, MAX_RANGE + 1, 1]})
    for bad in ({"r": [0, 5, 0]}, {"r": [0, 5]}, {"r": [0, 5, 1.0]}, {"r": [0, 5, True]}):
        with pytest.raises(ValueError, match="not an encoded range"):
            decode(bad)


def _encoder():
    space: dict = {}
    exec(ENCODER, space)
    return space["_enc"]


def test_the_encoder_draws_builtin_iterators_and_refuses_everything_else():
    import itertools

    enc = _encoder()
    assert enc(map(str, [1, 2])) == {"i": ["1", "2"]}
    assert enc((i for i in range(2))) == {"i": [0, 1]}
    assert enc(zip([1], "a")) == {"i": [{"t": [1, "a"]}]}
    assert enc(itertools.islice(itertools.count(), 2)) == {"i": [0, 1]}
    assert enc(range(2, 9, 3)) == {"r": [2, 9, 3]}
    with pytest.raises(ValueError, match=f"more than {MAX_ENCODED_ITEMS} elements"):
        enc(itertools.count())
    with pytest.raises(ValueError, match="characters"):
        enc(iter(["x" * 5_000_000, "y" * 5_000_000]))

    class Iter:
        def __iter__(self):
            return self

        def __next__(self):
            raise StopIteration

    class Meta(type):
        __eq__ = lambda cls, other: True  # noqa: E731
        __hash__ = lambda cls: hash(list)  # noqa: E731

    for value in (Iter(), type("L", (list,), {})(), Meta("X", (), {})()):
        with pytest.raises(TypeError, match="not plain data"):
            enc(value)


# ---- forging programs score 0, honest ones 1.0 ----------------------------------------------------------

FORGERIES = {
    # name: (tests, the honest program, the fake the forger binds, its constant-returning function)
    "range": (["assert f(5) == sum(range(5))", "assert all(f(n) == n * (n - 1) // 2 for n in range(1, 6))"],
              "def f(n):\n    return n * (n - 1) // 2", "lambda *a: [1]", "def f(n):\n    return 0"),
    "reversed": (["assert f('abc') == ''.join(reversed('abc'))", "assert list(reversed(f('ab'))) == ['a', 'b']"],
                 "def f(s):\n    return s[::-1]", "lambda s: iter('q')", "def f(s):\n    return 'q'"),
    "map": (["assert f([3]) == list(map(str, [3]))", "assert list(map(f, [1, 2])) == ['1', '2']"],
            "def f(x):\n    return [str(v) for v in x] if isinstance(x, list) else str(x)",
            "lambda *a: iter(['1', '2'])", "def f(x):\n    return ['1', '2']"),
    "isinstance": (["assert isinstance(f(5), int)", "assert all(isinstance(f(n), int) for n in range(3))"],
                   "def f(n):\n    return n", "lambda *a: True", "def f(n):\n    return 'x'"),
}


@pytest.mark.parametrize("how", ["global", "module"])
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_rebinding_a_builtin_does_not_forge_a_pass(name, how):
    tests, honest, fake, constant = FORGERIES[name]
    rebind = f"{name} = {fake}" if how == "global" else f"import builtins\nbuiltins.{name} = {fake}"
    forged = verdict(f"{rebind}\n{constant}", tests)
    assert forged.score == 0.0 and "assertion failed" in forged.reason, forged.reason
    assert verdict(f"{rebind}\n{honest}", tests).score == 1.0  # rebinding alone costs the honest nothing
    assert verdict(honest, tests).score == 1.0


@pytest.mark.parametrize("rebind", ["import math\nmath.factorial = lambda n: 0",
                                    "import types\nmath = types.SimpleNamespace(factorial=lambda n: 0)"])
def test_rebinding_math_factorial_does_not_forge_a_pass(rebind):
    tests = ["assert f(5) == math.factorial(5)", "assert all(f(n) == math.factorial(n) for n in range(5))"]
    forged = verdict(f"{rebind}\ndef f(n):\n    return 0", tests)
    assert forged.score == 0.0 and "assertion failed" in forged.reason, forged.reason
    honest = "import math as m\ndef f(n):\n    return m.prod(range(1, n + 1))"
    assert verdict(f"{honest}\n{rebind}", tests).score == 1.0


def test_a_builtin_name_in_a_test_means_the_builtin():
    program = "def sum(xs):\n    return 42\ndef f(n):\n    return 3"
    assert verdict(program, ["assert f(1) == sum([1, 2])", "assert sum([1, 2]) == 3"]).score == 1.0
    # what ``site`` adds to builtins here (``help``, ``exit``) the sandbox lacks: such names are the program's
    assert verdict("def help(x):\n    return x + 1", ["assert help(1) == 2"]).score == 1.0


# ---- correct answers of another built-in shape -----------------------------------------------------------

@pytest.mark.parametrize("program,tests", [
    ("def f(n):\n    return sum(range(n))", ["assert f(5) == sum(range(5))"]),
    ("def f(xs):\n    return map(str, xs)",
     ["assert list(f([1, 2])) == ['1', '2']", "assert f([1, 2]) == ['1', '2']", "assert sorted(f([2, 1])) == ['1', '2']"]),
    ("def f(xs):\n    return reversed(xs)",
     ["assert f([1, 2]) == [2, 1]", "assert list(f('ab')) == ['b', 'a']", "assert list(reversed(f([1, 2]))) == [1, 2]"]),
    ("def f(n):\n    return (i * i for i in range(n))", ["assert sum(f(4)) == 14", "assert list(f(3)) == [0, 1, 4]"]),
    ("def f(n):\n    return range(n)",
     ["assert f(3) == range(3)", "assert list(f(3)) == [0, 1, 2]", "assert sum(f(4)) == 6", "assert len(f(7)) == 7"]),
    ("def f(d):\n    return zip(d, filter(None, d.values()))", ["assert dict(f({'a': 1})) == {'a': 1}"]),
])
def test_correct_lazy_answers_score_one(program, tests):
    v = verdict(program, tests)
    assert v.score == 1.0, v.reason


def test_endless_or_huge_iterators_are_refused_with_a_reason_and_do_not_hang():
    cases = {
        "import itertools\ndef f():\n    return itertools.count()": f"more than {MAX_ENCODED_ITEMS} elements",
        "def f():\n    while True:\n        pass\n    yield 1": "timeout",
        "def f():\n    return ('x' * 10**6 for _ in range(100))": "characters",
        "def f():\n    return range(10**12)": f"a range of more than {MAX_RANGE} items",
    }
    for program, why in cases.items():
        start = time.monotonic()
        v = verdict(program, ["assert list(f()) == [1]"])
        assert v.score == 0.0 and why in v.reason, (program, v.reason)
        assert time.monotonic() - start < 8.0


# ---- where the expected side is computed ------------------------------------------------------------------

def test_the_expected_side_is_computed_in_a_run_without_the_program_and_kept(monkeypatch):
    import posttrain.plugins.rewards.code.sandbox as sandbox

    runs = []
    real = sandbox.run_python
    monkeypatch.setattr(sandbox, "run_python", lambda *a, **k: runs.append(k["files"]) or real(*a, **k))
    reward = Code(Code.Config(timeout=5.0, per_test_timeout=2.0))
    tests = ["assert f(5) == sum(range(987654, 987659))"]
    assert verdict("def f(n):\n    return 4938280", tests, reward).score == 1.0
    assert verdict("def f(n):\n    return 0", tests, reward).score == 0.0
    assert len(runs) == 3  # one reference run, kept for the second sample
    assert "solution.py" not in runs[0] and "987654" in runs[0]["tests.json"]
    assert all("987654" not in json.dumps(files) for files in runs[1:])
    assert json.loads(runs[1]["tests.json"])["tests"] == [["f(5)"]]


def test_a_broken_expected_side_fails_the_test_with_a_reason():
    v = verdict("def f(n):\n    return 1", ["assert f(1) == math.nosuch(1)", "assert f(1) == 1"])
    assert v.score == 0.5 and "the test's expected side: AttributeError" in v.reason, v.reason


def test_forged_reports_fail_the_test_without_breaking_the_reward():
    check = split_assert("assert f(1) == 1")
    for raw in ({"d": [[{"l": []}, 1]]}, {"s": [{"l": []}]}, {"c": [10**400, 0]}, {"r": [10**30, 0, -1]}):
        why = Code._judge("assert", None, check, [{"i": 0, "values": [raw]}])
        assert why.startswith("a value that is not plain data"), (raw, why)
    assert Code._judge("assert", None, check, [{"i": 0, "values": [1]}]) == ""
