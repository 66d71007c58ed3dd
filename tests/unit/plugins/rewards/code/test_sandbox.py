"""The sandbox runs ordinary programs and enforces its limits; the insecure mode is explicit; a machine
without bubblewrap gets a one-line install hint. Escapes are in test_sandbox_escapes.py."""

import os
import tempfile
import time

import pytest

import posttrain.plugins.rewards.code.sandbox as sandbox
from posttrain.core.plugins import load_plugins
from posttrain.plugins.rewards.code.sandbox import SandboxLimits, SandboxUnavailable, isolation, run_python
from posttrain.core.types import Sample


def test_this_machine_has_the_os_sandbox():
    # CI installs bubblewrap (README's test command): a machine without it must fail here, not skip
    info = isolation()
    assert info["os_sandbox"], info["reason"]
    assert info["host_uid"] == 65534 or os.geteuid() != 0
    assert {"user", "pid", "mount", "network"} <= set(info["namespaces"])
    assert info["containment"]["pid1_pidfd"]  # every run's pid 1 is killed through a pidfd when its check ends
    assert info["work_inode_limit"] == (os.geteuid() == 0)


def test_a_normal_program_runs_with_stdin_files_and_a_private_workdir():
    made = []
    real_mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):  # the sandbox's own work dirs (other test processes make theirs)
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    tempfile.mkdtemp = recording_mkdtemp
    try:
        r = run_python("import os\nprint(input()[::-1])\nprint(os.getcwd())\nopen('x.txt', 'w').write('ok')\n"
                       "print(open('data.txt').read())\nprint(os.getuid())", stdin="abc\n", files={"data.txt": "given"})
    finally:
        tempfile.mkdtemp = real_mkdtemp
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == ["cba", "/work", "given", "65534"]
    mine = [d for d in made if os.path.basename(d).startswith("posttrain-sandbox-")]
    assert mine and not any(os.path.exists(d) for d in mine)  # made, then removed


def test_threads_and_exit_work():
    r = run_python("import threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
                   "exit(3)")
    assert r.returncode == 3 and r.stdout == "thread\n"


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.perf_counter()
    r = run_python("while True:\n    pass", limits=SandboxLimits(timeout=1.0))
    assert r.timed_out and not r.ok and time.perf_counter() - start < 4


def test_cpu_limit_kills_a_busy_program_that_ignores_signals():
    r = run_python("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
                   limits=SandboxLimits(timeout=10.0, cpu_seconds=1))
    assert not r.ok and not r.timed_out  # the hard CPU limit sends SIGKILL, before the 10 s wall clock


def test_output_flood_is_cut_and_killed():
    start = time.perf_counter()
    r = run_python("while True:\n    print('x' * 100000)", limits=SandboxLimits(timeout=20.0, output_mb=1))
    assert r.output_limited and not r.ok and len(r.stdout) <= 2**20 and time.perf_counter() - start < 5


def test_work_dir_is_bounded_and_the_rest_is_read_only():
    r = run_python("import os\nfor i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (2 << 20))",
                   limits=SandboxLimits(work_mb=8))
    assert not r.ok and "No space left on device" in r.stderr
    for path in ("/x", "/usr/x", "/dev/x"):
        r = run_python(f"open({path!r}, 'w')", limits=SandboxLimits(python_guard=False))
        assert "Read-only file system" in r.stderr, (path, r.stderr)


def test_bad_limits_name_the_key():
    with pytest.raises(ValueError, match="SandboxLimits.memory_mb"):
        SandboxLimits(memory_mb=0)
    with pytest.raises(ValueError, match="SandboxLimits.python_guard"):
        SandboxLimits(python_guard="yes")
    with pytest.raises(ValueError, match="run_python files"):
        run_python("pass", files={"../x": ""})


def test_without_bwrap_the_error_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda *a, **k: None)
    sandbox._probe.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap") as err:
            run_python("print(1)")
        assert "\n" not in str(err.value)
        code = load_plugins().rewards["code"]
        with pytest.raises(SandboxUnavailable, match="bubblewrap"):
            code()
        sample = Sample(prompt="", response="print(1)", label=[{"input": "", "output": "1"}])
        assert code(code.Config(insecure_no_os_sandbox=True)).check(sample)["score"] == 1.0  # explicit opt-out
    finally:
        monkeypatch.undo()
        sandbox._probe.cache_clear()


def test_the_insecure_mode_keeps_rlimits_and_the_python_guard(tmp_path):
    insecure = SandboxLimits(os_sandbox=False, timeout=3.0)
    assert run_python("print(6 * 7)", limits=insecure).stdout == "42\n"
    r = run_python("import socket\nsocket.socket().connect(('127.0.0.1', 9))", limits=insecure)
    assert not r.ok and "sandbox: socket" in r.stderr
    r = run_python(f"open({str(tmp_path / 'x')!r}, 'w')", limits=insecure)
    assert "sandbox: writing" in r.stderr and not (tmp_path / "x").exists()
    r = run_python("x = bytearray(10 * 2**30)", limits=SandboxLimits(os_sandbox=False, memory_mb=256))
    assert "MemoryError" in r.stderr


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3") or os.geteuid() != 0,
                    reason="needs root (to drop to uid 65534) and a system /usr/bin/python3")
def test_an_unprivileged_caller_and_a_usr_interpreter_get_the_same_sandbox():
    # the two other start paths: bwrap started by an unprivileged user (no root stage), and root with an
    # interpreter under /usr (setpriv only); sandbox.py and containment.py need only the standard library, so
    # the system Python loads them from a copy readable by uid 65534 (package files empty but for those two)
    import shutil
    import subprocess

    from posttrain.plugins.rewards.code import containment

    copy = tempfile.mkdtemp(prefix="posttrain-sandbox-copy-")
    try:
        os.chmod(copy, 0o755)
        package = copy
        for part in ("posttrain", "plugins", "rewards", "code"):
            package = os.path.join(package, part)
            os.mkdir(package)
            os.chmod(package, 0o755)
            open(os.path.join(package, "__init__.py"), "w").close()
        for module in (sandbox, containment):
            shutil.copy(module.__file__, package)
        script = (f"import sys\nsys.path.insert(0, {copy!r})\n"
                  "from posttrain.plugins.rewards.code import sandbox as sb\n"
                  "r = sb.run_python(\"import os\\nprint(os.getuid(), sorted(os.listdir('/')))\\nos.fork()\")\n"
                  "print(r.stdout.strip(), 'fork refused' if 'not allowed' in r.stderr else r.stderr)")
        for prefix in ([], ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]):
            out = subprocess.run([*prefix, "/usr/bin/python3", "-I", "-c", script], capture_output=True, text=True,
                                 cwd="/", timeout=60)
            uid, rest = out.stdout.split(" ", 1)
            assert uid == "65534" and rest.strip().endswith("fork refused"), (prefix, out.stdout, out.stderr)
            assert "'work'" in rest and "'usr'" in rest and not any(f"'{d}'" in rest for d in ("etc", "root", "home", "tmp"))
    finally:
        shutil.rmtree(copy, ignore_errors=True)
