"""Model-written Python run against test cases in a sandboxed subprocess; score = fraction passed."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from posttrain import hookimpl, option
from posttrain.core.types import Sample

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

# Runs inside the sandbox: executes the solution once per stdin/stdout test (fresh globals each time),
# or once followed by each assert statement. For stdin/stdout tests only the inputs enter the sandbox:
# the harness reports each captured output and the parent compares it with the expected one, so a
# program cannot pass by forging verdicts. Reports go to the real stdout prefixed with a per-run nonce
# (the solution's own prints are captured); tests.json is deleted before the solution runs.
HARNESS = r'''
import contextlib, io, json, os, signal, sys
with open("solution.py") as f:
    _src = f.read()
with open("tests.json") as f:
    _spec = json.load(f)
del f
os.remove("tests.json")
_out_fd = os.dup(1)

class _Timeout(BaseException):
    pass

def _alarm(signum, frame):
    raise _Timeout()

signal.signal(signal.SIGALRM, _alarm)

def _norm(text):
    return "\n".join(line.rstrip() for line in str(text).strip().splitlines())

def _run(code, stdin_text, ns):
    out = io.StringIO()
    sys.stdin = io.StringIO(stdin_text)
    with contextlib.redirect_stdout(out):
        signal.setitimer(signal.ITIMER_REAL, _spec["per_test_timeout"])
        try:
            exec(code, ns)
        except SystemExit:
            pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return out.getvalue()

def _send(i, ok, why="", out=None):
    line = json.dumps({"i": i, "ok": bool(ok), "why": why[:200], "out": out})
    os.write(_out_fd, (_spec["nonce"] + line + "\n").encode())

_code = compile(_src, "solution.py", "exec")
if _spec["kind"] == "io":
    for _i, _stdin in enumerate(_spec["tests"]):
        try:
            _send(_i, True, out=_norm(_run(_code, _stdin, {"__name__": "__main__"}))[:1_000_000])
        except _Timeout:
            _send(_i, False, "timeout")
        except BaseException as _exc:
            _send(_i, False, type(_exc).__name__)
else:
    _ns = {"__name__": "__main__"}
    try:
        _run(_code, "", _ns)
        _loaded = True
    except BaseException as _exc:
        _loaded = False
        _why = type(_exc).__name__
    for _i, _case in enumerate(_spec["tests"]):
        if not _loaded:
            _send(_i, False, _why)
            continue
        try:
            _run(compile(_case, "test", "exec"), "", _ns)
            _send(_i, True)
        except _Timeout:
            _send(_i, False, "timeout")
        except BaseException as _exc:
            _send(_i, False, type(_exc).__name__)
'''


def _normalize_output(text: str) -> str:
    """As the harness's ``_norm``: outer whitespace and trailing spaces per line ignored."""
    return "\n".join(line.rstrip() for line in str(text).strip().splitlines())


def extract_code(response: str, require_fence: bool = False) -> str | None:
    """The last fenced code block (```python ... ```), else the whole response unless ``require_fence``."""
    blocks = _FENCE.findall(response)
    if blocks:
        return blocks[-1]
    return None if require_fence else response


def parse_tests(label: Any) -> tuple[str, list]:
    """``("io", [{"input", "output"}, ...])`` or ``("assert", [statement, ...])`` from a label that is
    (or is the JSON text of) a list of ``{input, output}``, an APPS-style ``{"inputs": [...],
    "outputs": [...]}``, ``{"asserts": [...]}``, a list of assert statements, or a block of assert lines."""
    if isinstance(label, str):
        text = label.strip()
        try:
            label = json.loads(text)
        except json.JSONDecodeError:
            lines = [line for line in text.splitlines() if line.strip().startswith("assert")]
            if not lines:
                raise ValueError("code label: not JSON and no `assert` lines") from None
            return "assert", lines
    if isinstance(label, dict) and "inputs" in label and "outputs" in label:
        if len(label["inputs"]) != len(label["outputs"]):
            raise ValueError("code label: inputs and outputs differ in length")
        return "io", [{"input": str(i), "output": str(o)} for i, o in zip(label["inputs"], label["outputs"])]
    if isinstance(label, dict) and "asserts" in label:
        return "assert", [str(a) for a in label["asserts"]]
    if isinstance(label, list) and label and all(isinstance(t, dict) and "input" in t and "output" in t
                                                 for t in label):
        return "io", [{"input": str(t["input"]), "output": str(t["output"])} for t in label]
    if isinstance(label, list) and label and all(isinstance(t, str) for t in label):
        return "assert", label
    raise ValueError("code label: expected [{input, output}], {inputs, outputs}, {asserts} or assert lines")


class CodeReward:
    """Fraction of test cases the response's Python passes, run in :mod:`posttrain.plugins.rewards.code.sandbox`.

    The program is the last fenced code block of the response (else the whole response, unless
    ``require_fence``). Tests come from the label (see :func:`parse_tests`): stdin/stdout pairs (the
    program runs once per test with fresh globals; outputs compared line by line, trailing spaces
    ignored) or assert statements (run after the program, in its namespace). Each test has
    ``per_test_timeout``; the whole run ``timeout`` wall-clock seconds and ``cpu_seconds`` of CPU, in
    ``memory_mb`` of address space, without network, subprocesses or writes outside its temporary
    directory. Tests not reached before the timeout count as failed.

    Returns ``{"score": passed / total, "compiled": 0|1, "timed_out": 0|1}``. The sandbox runs in a
    thread, so many samples are checked at once (``async``; the runner's ``concurrency`` bounds it).
    """

    name = "code"
    scope = "sample"

    @dataclass
    class Config:
        timeout: float = option(10.0, gt=0.0, help="wall-clock seconds for all tests of one sample")
        per_test_timeout: float = option(4.0, gt=0.0, help="seconds per test case")
        cpu_seconds: int = option(10, ge=1)
        memory_mb: int = option(1024, ge=64, help="address-space limit of the program")
        require_fence: bool = option(False, help="score 0 unless the response has a ```python block")
        max_parallel: int = option(2, ge=1, help="sandboxes running at once (each uses a CPU core)")

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()
        self._slots: asyncio.Semaphore | None = None
        self._loop = None

    @staticmethod
    def contract_cases() -> list[tuple[Sample, float]]:
        """Cases for the reward contract (``posttrain.testing.contracts.reward``)."""
        tests = [{"input": "1\n", "output": "2"}, {"input": "5\n", "output": "6"}]
        return [(Sample(prompt="add one", response="```python\nprint(int(input()) + 1)\n```", label=tests), 1.0),
                (Sample(prompt="add one", response="print(2)", label=tests), 0.5),
                (Sample(prompt="add one", response="import os\nos.fork()", label=tests[:1]), 0.0)]

    def check(self, sample: Sample) -> dict[str, float]:
        """Synchronous scoring (one sandbox run)."""
        from posttrain.plugins.rewards.code.sandbox import SandboxLimits, run_python

        c = self.config
        kind, tests = parse_tests(sample.label)
        code = extract_code(sample.response, c.require_fence)
        if code is None or not code.strip():
            return {"score": 0.0, "compiled": 0.0, "timed_out": 0.0}
        try:
            compile(code, "solution.py", "exec")
        except (SyntaxError, ValueError):
            return {"score": 0.0, "compiled": 0.0, "timed_out": 0.0}
        nonce = secrets.token_hex(8)
        sent = [t["input"] for t in tests] if kind == "io" else tests
        spec = {"kind": kind, "tests": sent, "per_test_timeout": c.per_test_timeout, "nonce": nonce}
        limits = SandboxLimits(timeout=c.timeout, cpu_seconds=c.cpu_seconds, memory_mb=c.memory_mb)
        result = run_python(HARNESS, limits=limits, files={"solution.py": code, "tests.json": json.dumps(spec)})
        passed: set[int] = set()
        for line in result.stdout.splitlines():
            if not line.startswith(nonce):
                continue
            try:
                report = json.loads(line[len(nonce):])
                i = int(report["i"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            if not (0 <= i < len(tests)) or report.get("ok") is not True:
                continue
            if kind == "io" and report.get("out") != _normalize_output(tests[i]["output"]):
                continue
            passed.add(i)
        return {"score": len(passed) / len(tests), "compiled": 1.0, "timed_out": float(result.timed_out)}

    async def __call__(self, sample: Sample) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:
            self._slots, self._loop = asyncio.Semaphore(self.config.max_parallel), loop
        async with self._slots:
            return await asyncio.to_thread(self.check, sample)


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(CodeReward)
