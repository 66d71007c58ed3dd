"""The sandbox contains infinite loops, huge allocations, forks, sockets and writes outside its directory."""

import socket
import time

import psutil
import pytest

from posttrain.plugins.rewards.code.sandbox import SandboxLimits, isolation, run_python

NAMESPACES = isolation()["namespaces"]


def test_a_normal_program_runs_with_stdin_and_its_directory_is_removed():
    r = run_python("import os\nprint(input()[::-1])\nprint(os.getcwd())\nopen('x.txt', 'w').write('ok')",
                   stdin="abc\n")
    assert r.ok and r.stdout.splitlines()[0] == "cba"
    workdir = r.stdout.splitlines()[1]
    assert "posttrain-sandbox-" in workdir
    import os
    assert not os.path.exists(workdir)


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.perf_counter()
    r = run_python("while True:\n    pass", limits=SandboxLimits(timeout=1.0))
    assert r.timed_out and not r.ok and time.perf_counter() - start < 5


def test_cpu_limit_kills_a_busy_program_that_ignores_signals():
    r = run_python("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
                   limits=SandboxLimits(timeout=10.0, cpu_seconds=1))
    assert not r.ok and r.seconds < 8  # the hard CPU limit sends SIGKILL


def test_ten_gigabytes_cannot_be_allocated():
    r = run_python("x = bytearray(10 * 2**30)\nprint('allocated')", limits=SandboxLimits(memory_mb=256))
    assert not r.ok and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_fork_and_subprocess_are_refused():
    for program in ("import os\nos.fork()", "import subprocess\nsubprocess.run(['true'])",
                    "import os\nos.system('true')", "import multiprocessing",
                    "import ctypes\nctypes.CDLL(None).fork()"):
        r = run_python(program)
        assert not r.ok and ("sandbox:" in r.stderr), (program, r.stderr)


@pytest.mark.skipif(not NAMESPACES, reason="no PID namespaces on this machine")
def test_processes_that_escape_the_group_die_with_the_sandbox():
    token = f"posttrain-escapee-{time.time_ns()}"
    program = ("import subprocess, sys\n"
               f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{token}'],"
               " start_new_session=True)\nprint('spawned')")
    r = run_python(program, limits=SandboxLimits(allow_subprocess=True))
    assert r.ok and "spawned" in r.stdout

    def alive():
        return [p for p in psutil.process_iter(["cmdline"]) if token in (p.info["cmdline"] or [])]
    deadline = time.time() + 3
    while alive() and time.time() < deadline:
        time.sleep(0.05)
    assert not alive()


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    s.setblocking(False)
    yield s
    s.close()


def test_sockets_are_refused(listener):
    port = listener.getsockname()[1]
    r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    assert not r.ok and "sandbox: socket" in r.stderr
    with pytest.raises(BlockingIOError):
        listener.accept()


@pytest.mark.skipif(not NAMESPACES, reason="no network namespaces on this machine")
def test_network_namespace_alone_blocks_connections(listener):
    port = listener.getsockname()[1]
    r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
                   limits=SandboxLimits(python_guard=False))
    assert not r.ok and "connected" not in r.stdout and "unreachable" in r.stderr.lower()
    with pytest.raises(BlockingIOError):
        listener.accept()


def test_writes_outside_the_directory_are_refused(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    target = tmp_path / "escape.txt"
    for program in (f"open({str(target)!r}, 'w').write('x')",
                    f"import os\nos.remove({str(victim)!r})",
                    f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
                    f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
                    f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                    f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
                    "import os\nos.symlink('/etc/passwd', 'p')\nopen('p', 'a').write('x')"):
        r = run_python(program)
        assert not r.ok and "sandbox:" in r.stderr, (program, r.stderr)
    assert not target.exists() and victim.read_text() == "precious"


@pytest.mark.parametrize("namespaces", [True, False])
def test_children_die_on_timeout_with_and_without_namespaces(monkeypatch, namespaces):
    import posttrain.plugins.rewards.code.sandbox as sandbox

    if not namespaces:
        monkeypatch.setattr(sandbox, "namespace_prefix", lambda: ())
    elif not NAMESPACES:
        pytest.skip("no namespaces on this machine")
    token = f"posttrain-child-{time.time_ns()}"
    program = ("import subprocess, sys\n"
               f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{token}'])\n"
               "print('spawned', flush=True)\nwhile True:\n    pass")
    r = sandbox.run_python(program, limits=SandboxLimits(timeout=1.0, allow_subprocess=True))
    assert r.timed_out and "spawned" in r.stdout
    deadline = time.time() + 3
    while time.time() < deadline and any(token in (p.info["cmdline"] or [])
                                         for p in psutil.process_iter(["cmdline"])):
        time.sleep(0.05)
    assert not any(token in (p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


def test_the_python_guard_holds_without_namespaces(monkeypatch):
    import posttrain.plugins.rewards.code.sandbox as sandbox

    monkeypatch.setattr(sandbox, "namespace_prefix", lambda: ())
    assert sandbox.run_python("print(6 * 7)").stdout == "42\n"
    r = sandbox.run_python("import socket\nsocket.socket().connect(('127.0.0.1', 9))")
    assert not r.ok and "sandbox: socket" in r.stderr
