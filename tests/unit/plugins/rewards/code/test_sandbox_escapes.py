"""Escapes from the code sandbox, each contained by the OS layer alone (``python_guard=False`` where the
guard would stop it first), and each scored 0 with a reason by the code reward, the test process unharmed.

The attacks are the ones a security probe found against the previous, Python-level sandbox, plus the
classic ones. Each asserts what the attack would have changed on the host, not only the program's exit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from posttrain.core.plugins import load_plugins
from posttrain.plugins.rewards.code.sandbox import SandboxLimits, run_python
from posttrain.core.types import Sample

OS_ONLY = SandboxLimits(python_guard=False, timeout=5.0)
SUBPROCESS = SandboxLimits(python_guard=False, allow_subprocess=True, timeout=2.0, processes=16)
Code = load_plugins().rewards["code"]
REWARD = Code(Code.Config(timeout=3.0, per_test_timeout=1.0, memory_mb=256))
OK = [{"input": "", "output": "ok"}]


def verdict(program: str, label=OK):
    return REWARD.verdict(Sample(prompt="", response=program, label=label))


def alive(token: str) -> list:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if token in (p.info["cmdline"] or []):
            found.append(p)
    return found


def gone(token: str, within: float = 2.0) -> bool:
    deadline = time.time() + within
    while alive(token) and time.time() < deadline:
        time.sleep(0.05)
    return not alive(token)


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    s.setblocking(False)
    yield s
    s.close()


# ---- the bypass the probe found, and the file system --------------------------------------------------

def test_rebinding_the_guards_settings_in_main_does_not_switch_it_off(tmp_path):
    target = tmp_path / "owned.txt"
    program = ("import sys\nsys.modules['__main__']._inside = lambda p: True\n"
               f"open({str(target)!r}, 'w').write('x')\nprint('ok')")
    r = run_python(program)
    assert "sandbox: writing" in r.stderr and "ok" not in r.stdout  # the guard still holds
    assert not run_python(program, limits=OS_ONLY).ok  # and without it the host path is not there
    v = verdict(program)
    assert v.score == 0.0 and "PermissionError" in v.reason
    assert not target.exists()


def test_writes_outside_through_dir_fd_fail(tmp_path):
    program = ("import os\nmade = []\n"
               f"for d in ('/', '/usr', '/proc', '/dev', '/tmp', {str(tmp_path)!r}):\n"
               "    try:\n"
               "        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)\n"
               "        os.close(os.open('pwned', os.O_WRONLY | os.O_CREAT, dir_fd=fd))\n"
               "        made.append(d)\n"
               "    except OSError:\n"
               "        pass\n"
               "print(made)")
    r = run_python(program)  # the guard does not see dir_fd: this is the OS layer alone
    assert r.stdout == "[]\n", r.stderr
    assert not (tmp_path / "pwned").exists() and not os.path.exists("/pwned") and not os.path.exists("/tmp/pwned")


def test_host_secrets_and_files_are_not_there(tmp_path):
    host_file = tmp_path / "host.txt"
    host_file.write_text("host data")
    program = ("import os\nseen = []\n"
               f"for p in ('/etc/shadow', '/etc/passwd', '/root/.bashrc', {str(host_file)!r}, '/sys/kernel/notes'):\n"
               "    try:\n"
               "        seen.append(open(p).read()[:20])\n"
               "    except OSError as e:\n"
               "        pass\n"
               "for d in ('/root', '/home', '/etc', '/sys', '/tmp'):\n"
               "    try:\n"
               "        seen.append(os.listdir(d))\n"
               "    except OSError:\n"
               "        pass\n"
               "print(json.dumps(seen))".replace("import os", "import json, os"))
    r = run_python(program, limits=OS_ONLY)
    seen = json.loads(r.stdout)
    # only the interpreter's directory is visible under /root (read-only); nothing else
    assert all(isinstance(x, list) and set(x) <= {".pyenv"} for x in seen), seen
    assert "host data" not in r.stdout
    v = verdict(program.replace("print(json.dumps(seen))", "print('ok' if any(x != ['.pyenv'] for x in seen) else 'no')"))
    assert v.score == 0.0 and v.reason == "0/1 passed; test 0: wrong output"


def test_the_parents_environment_cannot_be_read(monkeypatch):
    token = f"sk-secret-{time.time_ns()}"
    monkeypatch.setenv("POSTTRAIN_TEST_API_KEY", token)
    program = ("import os\nread = 0\ntext = repr(dict(os.environ))\n"
               "for pid in os.listdir('/proc'):\n"
               "    if pid.isdigit():\n"
               "        try:\n"
               "            text += open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace')\n"
               "            read += 1\n"
               "        except OSError:\n"
               "            pass\n"
               "print(read, text)")
    r = run_python(program, limits=OS_ONLY)
    assert int(r.stdout.split()[0]) == 1  # it read the environ of every process it can see: itself, pid 1
    assert token not in r.stdout and "POSTTRAIN_TEST_API_KEY" not in r.stdout


def test_the_host_proc_is_not_visible_and_namespaces_cannot_be_joined():
    program = ("import os, subprocess\n"
               "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
               "cmds = [open(f'/proc/{p}/cmdline', 'rb').read() for p in pids]\n"
               f"print(pids, os.path.exists('/proc/{os.getpid()}/ns/net'), any(b'pytest' in c for c in cmds))\n"
               "for cmd in (['unshare', '-U', '-r', 'true'], ['nsenter', '--net=/proc/1/ns/net', 'true']):\n"
               "    print(subprocess.run(cmd, capture_output=True).returncode)")
    r = run_python(program, limits=SUBPROCESS)
    lines = r.stdout.splitlines()
    pids = json.loads(lines[0].split("]")[0] + "]")
    assert max(pids) < 10 and lines[0].endswith("False False"), r.stdout
    assert lines[1:] == ["1", "1"], r.stdout + r.stderr  # no nested user namespace, no setns


# ---- network -----------------------------------------------------------------------------------------

def test_no_network_not_even_the_hosts_loopback(listener):
    port = listener.getsockname()[1]
    program = ("import socket\nprint([n for _, n in socket.if_nameindex()])\n"
               f"for addr in [('127.0.0.1', {port}), ('8.8.8.8', 53), ('10.0.0.1', 80)]:\n"
               "    try:\n"
               "        socket.create_connection(addr, timeout=1)\n"
               "        print('connected', addr)\n"
               "    except OSError as e:\n"
               "        print(type(e).__name__)")
    r = run_python(program, limits=OS_ONLY)
    assert r.stdout.splitlines()[0] == "['lo']" and "connected" not in r.stdout, r.stdout
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert run_python(program).stdout.count("PermissionError") == 3  # the guard refuses sockets first
    assert verdict(program.replace("print('connected', addr)", "print('ok')")).score == 0.0
    with pytest.raises(BlockingIOError):
        listener.accept()


# ---- processes and memory ----------------------------------------------------------------------------

def test_fork_is_refused_by_seccomp_without_the_guard():
    r = run_python("import os\nos.fork()", limits=OS_ONLY)
    assert "PermissionError" in r.stderr and "Operation not permitted" in r.stderr
    v = verdict("import os\nwhile True:\n    os.fork()\nprint('ok')")
    assert v.score == 0.0 and "not allowed" in v.reason


def test_fork_bomb_stops_at_the_process_limit_and_leaves_nothing():
    token = f"posttrain-bomb-{time.time_ns()}"
    program = ("import os, sys\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
               f"            os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])\n"
               "        n += 1\nexcept OSError as e:\n    print('stopped', n, e.errno, flush=True)\nwhile True:\n    pass")
    start = time.perf_counter()
    r = run_python(program, limits=SUBPROCESS)
    assert r.timed_out and time.perf_counter() - start < 6
    assert r.stdout.startswith("stopped") and int(r.stdout.split()[1]) < 16 and r.stdout.split()[2] == "11"
    assert gone(token)
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_ten_gigabytes_cannot_be_allocated():
    for program in ("x = bytearray(10 * 2**30)", "import mmap\nm = mmap.mmap(-1, 10 * 2**30)\nm[-1] = 1"):
        r = run_python(program + "\nprint('allocated')", limits=SandboxLimits(python_guard=False, memory_mb=256))
        assert "allocated" not in r.stdout and ("MemoryError" in r.stderr or "Cannot allocate" in r.stderr), r.stderr
    v = verdict("x = bytearray(10 * 2**30)\nprint('ok')")
    assert v.score == 0.0 and "MemoryError" in v.reason


def test_the_parent_cannot_be_killed():
    program = ("import os, signal\n"
               f"for pid in (os.getppid(), 1, -1, {os.getpid()}, {os.getppid()}):\n"
               "    try:\n"
               "        os.kill(pid, signal.SIGKILL)\n"
               "        print('sent', pid)\n"
               "    except OSError as e:\n"
               "        print(type(e).__name__)\n"
               "print('alive')")
    r = run_python(program, limits=OS_ONLY)
    # it is pid 1 of its namespace (its parent, pid 0, is outside): pid 1 ignores SIGKILL sent from inside, to
    # its group (0) or itself; kill(-1) finds no other process; the host's pids do not exist there
    assert r.stdout.splitlines() == ["sent 0", "sent 1"] + ["ProcessLookupError"] * 3 + ["alive"], r.stdout + r.stderr
    assert psutil.Process(os.getpid()).is_running() and psutil.pid_exists(os.getppid())
    assert verdict(program.replace("print('alive')", "print('ok')")).score == 0.0  # the guard refuses os.kill


@pytest.mark.parametrize("keep_running", [True, False])
def test_a_detached_grandchild_dies_with_the_sandbox(keep_running):
    token = f"posttrain-detached-{time.time_ns()}"
    program = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])\n"
               "    os._exit(0)\nos.wait()\nprint('spawned', flush=True)\n" + ("while True:\n    pass" if keep_running else ""))
    r = run_python(program, limits=SUBPROCESS)
    assert "spawned" in r.stdout and r.timed_out == keep_running
    assert gone(token)


def test_its_processes_run_as_an_unprivileged_host_uid_without_capabilities():
    token = f"posttrain-uid-{time.time_ns()}"
    program = ("import subprocess, sys, time\n"
               f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', {token!r}])\n"
               "time.sleep(1.5)\np.kill()")
    import threading
    result = {}
    t = threading.Thread(target=lambda: result.update(r=run_python(program, limits=SUBPROCESS)))
    t.start()
    deadline = time.time() + 5
    while not alive(token) and time.time() < deadline:
        time.sleep(0.05)
    [proc] = alive(token)
    status = open(f"/proc/{proc.pid}/status").read()
    t.join()
    expected = 65534 if os.geteuid() == 0 else os.geteuid()  # the host's view, not the namespace's
    assert f"Uid:\t{expected}\t{expected}\t{expected}\t{expected}" in status
    assert "CapEff:\t0000000000000000" in status and "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status


# ---- faking the tests --------------------------------------------------------------------------------

ASSERTS = ["assert f(1) == 987654", "assert f(2) == [3, 1]"]


def test_a_harness_faked_through_getframe_reports_values_not_verdicts():
    program = ("import os, sys\ng = sys._getframe(1).f_globals\n"
               "for i in range(len(g['_spec']['tests'])):\n"
               "    g['_send']({'i': i, 'ok': True, 'out': 'ok', 'values': [1]})\n"
               "os._exit(0)")
    v = verdict(program, ASSERTS)
    assert v.score == 0.0 and "assertion failed" in v.reason
    v = verdict(program.replace("os._exit(0)", "def f(x):\n    return 0"), ASSERTS)
    assert v.score == 0.0 and "several results" in v.reason  # its reports and the harness's: both rejected


def test_objects_that_equal_everything_are_not_plain_data():
    for body in ("class A:\n    __eq__ = lambda s, o: True\n    __hash__ = None\ndef f(x):\n    return A()",
                 "class I(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\ndef f(x):\n    return I(0)",
                 "class L(list):\n    __eq__ = lambda s, o: True\ndef f(x):\n    return L()"):
        v = verdict(body, ASSERTS)
        assert v.score == 0.0 and "not plain data" in v.reason, (body, v.reason)


def test_replacing_builtins_does_not_change_the_comparison():
    program = "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.sorted = lambda x: [1, 3]\ndef f(x):\n    return 7.0"
    v = verdict(program, ["assert abs(f(2) - 4.0) < 1e-9", "assert sorted(f(1)) == [1, 3]"])
    assert v.score == 0.0 and v.passed == 0


def test_expected_outputs_and_comparisons_never_enter_the_sandbox(monkeypatch):
    import posttrain.plugins.rewards.code.sandbox as sandbox

    sent = []
    real = sandbox.run_python
    monkeypatch.setattr(sandbox, "run_python", lambda *a, **k: sent.append(k["files"]) or real(*a, **k))
    program = "import sys, json\nprint(json.dumps(sys._getframe(1).f_globals['_spec']))"
    assert verdict(program, [{"input": "7", "output": "SECRET-42"}]).score == 0.0
    assert verdict("def f(x):\n    return 0", ["assert f(1) == 987654 and sorted(f(2)) == [3, 1]"]).score == 0.0
    text = json.dumps(sent)
    assert "SECRET-42" not in text and "987654" not in text and "[3, 1]" not in text
    assert json.loads(sent[1]["tests.json"])["tests"] == [["f(1)", "f(2)"]]  # only the leaves go in


def test_the_run_is_unharmed_after_the_attacks(listener):
    # after everything above in this process, honest programs still score and the host still works
    assert verdict("print('ok')").score == 1.0
    assert verdict("def f(x):\n    return 987654 if x == 1 else [3, 1]", ASSERTS).score == 1.0
    client = socket.create_connection(listener.getsockname(), timeout=2)
    client.close()
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).stdout == b"1\n"
