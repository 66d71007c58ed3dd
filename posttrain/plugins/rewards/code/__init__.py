"""Model-written Python run against test cases in a sandboxed subprocess; score = fraction passed."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any

from posttrain import hookimpl, option
from posttrain.api import Component
from posttrain.core.types import Sample
from posttrain.plugins.rewards.code.checks import ENCODER, decode, split_assert

log = logging.getLogger("posttrain.rewards.code")

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

# Runs inside the sandbox, after the solution is written there: runs the solution once per stdin/stdout
# test (fresh globals each time), or once followed by each assert test's *leaves* (checks.py). It only
# reports what the solution produced (captured output, or leaf values in a strict plain-data encoding),
# one JSON line per test after a per-run nonce; expected outputs and the comparisons never enter the
# sandbox, so a solution that takes this harness over can report values, never verdicts.
HARNESS = ENCODER + r"""
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

def _timed(fn, stdin_text):
    out = io.StringIO()
    sys.stdin = io.StringIO(stdin_text)
    with contextlib.redirect_stdout(out):
        signal.setitimer(signal.ITIMER_REAL, _spec["per_test_timeout"])
        try:
            value = fn()
        except SystemExit:
            value = None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return out.getvalue(), value

def _send(report):
    os.write(_out_fd, (_spec["nonce"] + json.dumps(report) + "\n").encode())

def _why(exc):
    return "timeout" if isinstance(exc, _Timeout) else f"{type(exc).__name__}: {exc}"[:200]

_code = compile(_src, "solution.py", "exec")
if _spec["kind"] == "io":
    for _i, _stdin in enumerate(_spec["tests"]):
        try:
            _out = _timed(lambda: exec(_code, {"__name__": "__main__"}), _stdin)[0]
            _send({"i": _i, "out": _norm(_out)[:1_000_000]})
        except BaseException as _exc:
            _send({"i": _i, "error": _why(_exc)})
else:
    _ns = {"__name__": "__main__"}
    try:
        _timed(lambda: exec(_code, _ns), "")
        _loaded = None
    except BaseException as _exc:
        _loaded = _why(_exc)
    for _i, _leaves in enumerate(_spec["tests"]):
        if _loaded:
            _send({"i": _i, "error": _loaded})
            continue
        try:
            _vals = _timed(lambda: [eval(compile(s, "test", "eval"), _ns) for s in _leaves], "")[1]
            _send({"i": _i, "values": [_enc(v) for v in _vals]})
        except BaseException as _exc:
            _send({"i": _i, "error": _why(_exc)})
"""


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


@dataclass
class CodeVerdict:
    """The outcome of one sample: ``reason`` says why it is not 1.0 (empty when every test passed)."""

    score: float
    passed: int
    total: int
    compiled: bool
    timed_out: bool
    reason: str


class CodeReward(Component):
    """Fraction of test cases the response's Python passes, run in :mod:`posttrain.plugins.rewards.code.sandbox`.

    The program is the last fenced code block of the response (else the whole response, unless
    ``require_fence``). Tests come from the label (see :func:`parse_tests`): stdin/stdout pairs (the
    program runs once per test with fresh globals; outputs compared line by line, trailing spaces
    ignored) or single ``assert`` statements (run after the program, in its namespace). Either way the
    verdict is made here, outside the sandbox, on serialized outputs: expected outputs and assert
    comparisons never enter it (:mod:`posttrain.plugins.rewards.code.checks`). Each test has
    ``per_test_timeout``; the whole run ``timeout`` wall-clock seconds and ``cpu_seconds`` of CPU, in
    ``memory_mb`` of address space, as an unprivileged uid in bubblewrap namespaces: no network, no new
    processes, nothing of the host but a read-only interpreter. Tests not reached count as failed.

    Returns ``{"score": passed / total, "compiled": 0|1, "timed_out": 0|1}``; why a sample scored below
    1 is in ``sample.metadata["code_reason"]`` (and :meth:`verdict`). The sandbox runs in a thread, so
    many samples are checked at once (``async``; ``max_parallel`` bounds it). Without bubblewrap the
    reward refuses to start, unless ``insecure_no_os_sandbox`` is set.
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
        insecure_no_os_sandbox: bool = option(
            False, help="INSECURE: run programs without bubblewrap (host filesystem, this uid, network); "
                        "only for machines where bwrap cannot be installed")

    def __init__(self, config: Config | None = None):
        from posttrain.plugins.rewards.code.sandbox import check_os_sandbox

        super().__init__(config)
        self._slots: asyncio.Semaphore | None = None
        self._loop = None
        if self.config.insecure_no_os_sandbox:
            log.warning("code reward: insecure_no_os_sandbox is set: model-written programs run WITHOUT the OS "
                        "sandbox (only rlimits and a Python guard stand between them and this machine)")
        else:
            check_os_sandbox()  # fail at start, in one line, rather than score every sample 0

    @staticmethod
    def contract_cases() -> list[tuple[Sample, float]]:
        """Cases for the reward contract (``posttrain.testing.contracts.reward``)."""
        tests = [{"input": "1\n", "output": "2"}, {"input": "5\n", "output": "6"}]
        return [(Sample(prompt="add one", response="```python\nprint(int(input()) + 1)\n```", label=tests), 1.0),
                (Sample(prompt="add one", response="print(2)", label=tests), 0.5),
                (Sample(prompt="add one", response="import os\nos.fork()", label=tests[:1]), 0.0)]

    def verdict(self, sample: Sample) -> CodeVerdict:
        """Run the sample's program against its tests; the score and the reason for any failure."""
        from posttrain.plugins.rewards.code.sandbox import SandboxLimits, run_python

        c = self.config
        kind, tests = parse_tests(sample.label)
        checks = [split_assert(t) for t in tests] if kind == "assert" else []
        code = extract_code(sample.response, c.require_fence)
        if code is None or not code.strip():
            return CodeVerdict(0.0, 0, len(tests), False, False, "no code in the response")
        try:
            compile(code, "solution.py", "exec")
        except (SyntaxError, ValueError) as exc:
            return CodeVerdict(0.0, 0, len(tests), False, False, f"does not compile: {exc}")
        nonce = secrets.token_hex(8)
        sent = [t["input"] for t in tests] if kind == "io" else [ch.leaves for ch in checks]
        spec = {"kind": kind, "tests": sent, "per_test_timeout": c.per_test_timeout, "nonce": nonce}
        limits = SandboxLimits(timeout=c.timeout, cpu_seconds=c.cpu_seconds, memory_mb=c.memory_mb,
                               os_sandbox=not c.insecure_no_os_sandbox)
        result = run_python(HARNESS, limits=limits, files={"solution.py": code, "tests.json": json.dumps(spec)})
        reports: dict[int, list[dict]] = {}
        for line in result.stdout.splitlines():
            if not line.startswith(nonce):
                continue
            try:
                report = json.loads(line[len(nonce):])
                reports.setdefault(int(report["i"]), []).append(report)
            except Exception:  # malformed, a huge int, nested too deep: not a report
                continue
        failures = []
        for i in range(len(tests)):
            why = self._judge(kind, tests[i], checks[i] if checks else None, reports.get(i, []))
            if why:
                failures.append(f"test {i}: {why}")
        passed = len(tests) - len(failures)
        reason = ""
        if failures:
            run = ("timed out after %gs; " % c.timeout if result.timed_out else
                   "output limit; " if result.output_limited else "")
            reason = f"{passed}/{len(tests)} passed; {run}{failures[0]}"
        return CodeVerdict(passed / len(tests), passed, len(tests), True, result.timed_out, reason)

    @staticmethod
    def _judge(kind: str, test, check, reports: list[dict]) -> str:
        """Empty when the test passed, else why not. Exactly one report per test counts: a program that
        writes its own reports beside the harness's gets several, and fails."""
        if not reports:
            return "no result (the program was killed or exited first)"
        if len(reports) > 1:
            return "several results for one test (forged reports?)"
        report = reports[0]
        if "error" in report:
            return str(report["error"])[:200]
        if kind == "io":
            return "" if report.get("out") == _normalize_output(test["output"]) else "wrong output"
        try:
            raw = report["values"]
            values = [decode(v) for v in raw] if isinstance(raw, list) else None
        except (KeyError, ValueError, TypeError):
            return "a value that is not plain data"
        return "" if values is not None and check.passes(values) else "assertion failed"

    def check(self, sample: Sample) -> dict[str, float]:
        """Synchronous scoring (one sandbox run)."""
        v = self.verdict(sample)
        if v.reason:
            sample.metadata["code_reason"] = v.reason
        return {"score": v.score, "compiled": float(v.compiled), "timed_out": float(v.timed_out)}

    async def __call__(self, sample: Sample) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:
            self._slots, self._loop = asyncio.Semaphore(self.config.max_parallel), loop
        async with self._slots:
            return await asyncio.to_thread(self.check, sample)


@hookimpl
def posttrain_register_rewards(registry):
    registry.add(CodeReward)


@hookimpl
def posttrain_doctor_checks(run):
    """``rl-cli doctor``: the OS sandbox (bubblewrap) must work here unless every code reward opts out."""
    import shutil

    from posttrain.core.interfaces import Finding

    needs = [c for c in run.rewards if c.cls is CodeReward and not c.config.insecure_no_os_sandbox]
    path = shutil.which("bwrap")
    if not needs:
        return [Finding(True, "sandbox", f"bwrap {'at ' + path if path else 'not installed'} "
                                         "(no reward here needs it)", note=True)]
    from posttrain.plugins.rewards.code.sandbox import isolation

    reason = isolation()["reason"]
    return [Finding(reason is None, "sandbox", f"bwrap works at {path}" if reason is None else reason)]
