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

_REF_CACHE_SIZE = 4096  # tests whose reference values a CodeReward keeps
_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)

# The start of both harnesses (inside the sandbox): the encoder, the spec (read, then its file removed), a
# per-test timer with captured stdout, and reports: one JSON line per test after a per-run nonce. Functions
# defined after ``__builtins__`` is replaced take their builtins from that copy, and the library functions
# they call are taken before the program runs (json's C encoder, not ``json.dumps``, whose Python code
# reads ``builtins``), so the harness works the same whatever the program later does to ``builtins``.
_PRELUDE = ENCODER + r"""
import builtins, importlib, io, json, os, signal, sys, types
__builtins__ = dict(vars(builtins))
with open("tests.json") as f:
    _spec = json.load(f)
del f
os.remove("tests.json")
_out_fd = os.dup(1)
_StringIO, _setitimer, _write = io.StringIO, signal.setitimer, os.write
_c_encoder = json.encoder.c_make_encoder(None, None, json.encoder.encode_basestring_ascii, None, ": ", ", ",
                                         False, False, False)  # the C encoder: no Python code of json's runs

class _Timeout(BaseException):
    pass

def _alarm(signum, frame):
    raise _Timeout()

signal.signal(signal.SIGALRM, _alarm)

def _timed(fn, stdin_text):
    out, saved = _StringIO(), sys.stdout
    sys.stdin, sys.stdout = _StringIO(stdin_text), out
    _setitimer(signal.ITIMER_REAL, _spec["per_test_timeout"])
    try:
        value = fn()
    except SystemExit:
        value = None
    finally:
        _setitimer(signal.ITIMER_REAL, 0)
        sys.stdout = saved
    return out.getvalue(), value

def _send(report):
    _write(_out_fd, (_spec["nonce"] + "".join(_c_encoder(report, 0)) + "\n").encode())

def _why(exc):
    return "timeout" if isinstance(exc, _Timeout) else f"{type(exc).__name__}: {exc}"[:200]
"""

# Runs inside the sandbox with the solution: runs it once per stdin/stdout test (fresh globals each time),
# or once followed by each assert test's *program leaves* (checks.py). Before the solution runs it copies
# the builtins and imports (and copies) the standard-library modules the leaves name; each leaf is then
# compiled as ``lambda <those names>: <leaf>`` in the solution's globals and called with the copies, and
# its value encoded under the test's timer (drawing an iterator runs the solution's code). It only
# reports what the solution produced (captured output, or leaf values in a strict plain-data encoding);
# expected outputs, skeleton constants and reference leaves never enter this run, so a solution that
# takes this harness over can report values, never verdicts.
HARNESS = _PRELUDE + r"""
with open("solution.py") as f:
    _code = compile(f.read(), "solution.py", "exec")
del f
_pristine, _unusable = dict(vars(builtins)), {}
for _m in _spec.get("modules", []):
    try:
        _orig = importlib.import_module(_m)
        _pristine[_m] = types.ModuleType(_m)
        vars(_pristine[_m]).update(vars(_orig))
    except Exception as _exc:
        _unusable[_m] = _why(_exc)

def _norm(text):
    return "\n".join(line.rstrip() for line in str(text).strip().splitlines())

def _leaf(src, pinned, ns):
    for n in pinned:
        if n in _unusable:
            raise ImportError(_unusable[n])
    fn = eval(compile("lambda " + ", ".join(pinned) + ": (" + src + ")", "test", "eval"), ns)
    return _enc(fn(*[_pristine[n] for n in pinned]))

def _io_tests():
    for i, stdin in enumerate(_spec["tests"]):
        try:
            out = _timed(lambda: exec(_code, {"__name__": "__main__", "__builtins__": builtins}), stdin)[0]
            _send({"i": i, "out": _norm(out)[:1_000_000]})
        except BaseException as exc:
            _send({"i": i, "error": _why(exc)})

def _assert_tests():
    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        _timed(lambda: exec(_code, ns), "")
        loaded = None
    except BaseException as exc:
        loaded = _why(exc)
    for i, (leaves, pinned) in enumerate(zip(_spec["tests"], _spec["pinned"])):
        if loaded:
            _send({"i": i, "error": loaded})
            continue
        try:
            _send({"i": i, "values": _timed(lambda: [_leaf(*lp, ns) for lp in zip(leaves, pinned)], "")[1]})
        except BaseException as exc:
            _send({"i": i, "error": _why(exc)})

_io_tests() if _spec["kind"] == "io" else _assert_tests()
"""

# Runs inside a sandbox of its own, without the solution: each assert test's *reference leaves* (its
# expected side: only builtins and standard-library modules), in fresh globals per test.
REFERENCE_HARNESS = _PRELUDE + r"""
def _ref(leaf):
    env = {"__builtins__": dict(__builtins__)}
    for m in leaf["modules"]:
        env[m] = importlib.import_module(m)
    return _enc(eval(compile(leaf["src"], "test", "eval"), env))

for _i, _leaves in enumerate(_spec["tests"]):
    try:
        _send({"i": _i, "values": _timed(lambda: [_ref(leaf) for leaf in _leaves], "")[1]})
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
    ignored) or single ``assert`` statements. Either way the verdict is made here, outside the sandbox,
    on serialized outputs: expected outputs and assert comparisons never enter the program's sandbox.

    An assert is split (:mod:`posttrain.plugins.rewards.code.checks`): the parts that need the program
    (``f(5)``, ``map(f, xs)``) run after it, in its namespace; the expected side, every sub-expression
    of only builtins and standard-library modules (``sum(range(5))``, ``math.factorial(5)``), runs in a
    sandbox run of its own without the program (kept per test text, so the samples of one prompt pay
    for it once); literals, comparisons and a few builtins (``sorted``, ``isinstance`` ...) run here.
    Rules for test authors: a builtin name in a test always means the builtin, even inside the parts
    run beside the program and whatever the program rebinds (a task's function must not be named
    ``sum`` or ``map``), and a standard-library module name used as ``name.attr`` always means the
    module. Values cross as plain built-in data; a ``range`` compares as a range, and a built-in
    iterator (``map``, ``filter``, ``zip``, ``reversed``, a generator, ``itertools``) as the list of
    its items, drawn under the test's timeout: at most 1,000,000 elements and 8,000,000 characters per
    value, a range at most 1,000,000 items; past that the test fails with that reason. Each test has
    ``per_test_timeout``; the whole run ``timeout`` wall-clock seconds and ``cpu_seconds`` of CPU, in
    ``memory_mb`` of address space, as an unprivileged uid in bubblewrap namespaces: no network, no new
    processes, nothing of the host but a read-only interpreter (the expected sides' run has the same
    limits). Tests not reached count as failed.

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
        self._ref_cache: dict[str, list | str] = {}  # reference-leaf specs (JSON) -> encoded values or error
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
        from posttrain.plugins.rewards.code.sandbox import SandboxLimits

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
        limits = SandboxLimits(timeout=c.timeout, cpu_seconds=c.cpu_seconds, memory_mb=c.memory_mb,
                               os_sandbox=not c.insecure_no_os_sandbox)
        refs = self._references(checks, limits)
        if kind == "io":
            spec = {"kind": kind, "tests": [t["input"] for t in tests]}
        else:
            spec = {"kind": kind, "tests": [[leaf.src for leaf in ch.leaves] for ch in checks],
                    "pinned": [[leaf.pinned for leaf in ch.leaves] for ch in checks],
                    "modules": sorted({m for ch in checks for leaf in ch.leaves for m in leaf.modules})}
        result, reports = self._run(HARNESS, spec, limits, {"solution.py": code})
        failures = []
        for i in range(len(tests)):
            why = self._judge(kind, tests[i], checks[i] if checks else None, reports.get(i, []), refs.get(i))
            if why:
                failures.append(f"test {i}: {why}")
        passed = len(tests) - len(failures)
        reason = ""
        if failures:
            run = ("timed out after %gs; " % c.timeout if result.timed_out else
                   "output limit; " if result.output_limited else "")
            reason = f"{passed}/{len(tests)} passed; {run}{failures[0]}"
        return CodeVerdict(passed / len(tests), passed, len(tests), True, result.timed_out, reason)

    def _run(self, harness: str, spec: dict, limits, files: dict[str, str]):
        """One sandbox run of ``harness`` on ``spec``; the result and its reports by test index."""
        from posttrain.plugins.rewards.code.sandbox import run_python

        nonce = secrets.token_hex(8)
        spec = {**spec, "per_test_timeout": self.config.per_test_timeout, "nonce": nonce}
        result = run_python(harness, limits=limits, files={**files, "tests.json": json.dumps(spec)})
        reports: dict[int, list[dict]] = {}
        for line in result.stdout.splitlines():
            if not line.startswith(nonce):
                continue
            try:
                report = json.loads(line[len(nonce):])
                reports.setdefault(int(report["i"]), []).append(report)
            except Exception:  # malformed, a huge int, nested too deep: not a report
                continue
        return result, reports

    def _references(self, checks: list, limits) -> dict[int, list | str]:
        """The decoded reference-leaf values of each assert test that has any (or why they failed), from a
        sandbox run without the program; results are kept per test text, as the samples of one prompt
        share their tests (a timeout or a killed run is not kept)."""
        keys = {i: json.dumps([leaf.spec() for leaf in ch.refs]) for i, ch in enumerate(checks) if ch.refs}
        missing = sorted({k for k in keys.values() if k not in self._ref_cache})
        if missing:
            result, reports = self._run(REFERENCE_HARNESS, {"tests": [json.loads(k) for k in missing]}, limits, {})
            if len(self._ref_cache) + len(missing) > _REF_CACHE_SIZE:
                self._ref_cache.clear()
            for j, key in enumerate(missing):
                got = reports.get(j, [])
                if len(got) == 1 and isinstance(got[0].get("values"), list):
                    self._ref_cache[key] = got[0]["values"]
                elif len(got) == 1 and "error" in got[0] and got[0]["error"] != "timeout":
                    self._ref_cache[key] = str(got[0]["error"])[:200]
        out: dict[int, list | str] = {}
        for i, key in keys.items():
            raw = self._ref_cache.get(key, "no result (the run was killed or timed out)")
            try:
                out[i] = [decode(v) for v in raw] if isinstance(raw, list) else f"the test's expected side: {raw}"
            except (ValueError, TypeError, OverflowError) as exc:
                out[i] = f"the test's expected side: {exc}"
        return out

    @staticmethod
    def _judge(kind: str, test, check, reports: list[dict], refs: list | str | None = None) -> str:
        """Empty when the test passed, else why not. Exactly one report per test counts: a program that
        writes its own reports beside the harness's gets several, and fails."""
        if isinstance(refs, str):
            return refs
        if not reports:
            return "no result (the program was killed or exited first)"
        if len(reports) > 1:
            return "several results for one test (forged reports?)"
        report = reports[0]
        if "error" in report:
            return str(report["error"])[:200]
        if kind == "io":
            return "" if report.get("out") == _normalize_output(test["output"]) else "wrong output"
        raw = report.get("values")
        if not isinstance(raw, list):
            return "a report without values"
        try:
            values = [decode(v) for v in raw]
        except (ValueError, TypeError, OverflowError) as exc:
            return f"a value that is not plain data: {exc}"
        return "" if check.passes(values, refs) else "assertion failed"

    def check(self, sample: Sample) -> dict[str, float]:
        """Synchronous scoring (one sandbox run; two while the tests' expected sides are not kept yet)."""
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
