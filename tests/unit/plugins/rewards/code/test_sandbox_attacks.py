"""Attacks on the sandbox's own machinery: its init, its lifetime, memory no rlimit counts, its inodes, its
exit status, what of the host it shows. Each runs with the Python guard off and reaches the kernel through
``ctypes``, as a program that has taken its interpreter over would; each asserts what the attack would have
changed (a process left alive, a forged status, a host file read), not only the program's exit.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import psutil
import pytest

from posttrain.plugins.rewards.code import containment, sandbox
from posttrain.plugins.rewards.code.sandbox import SandboxLimits, run_python

ATTACKER = SandboxLimits(python_guard=False, timeout=3.0)
LIBC = "import ctypes, os, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def token() -> str:
    return f"pt{time.time_ns() % 10**12}"  # a process name (comm holds 15 characters)


def named(name: str) -> str:
    """Program lines that name the process (PR_SET_NAME) and drop its parent-death signal (PR_SET_PDEATHSIG 0)."""
    return f"libc.prctl(15, ctypes.c_char_p({name!r}.encode()), 0, 0, 0)\nlibc.prctl(1, 0, 0, 0, 0)\n"


def alive(name: str) -> list:
    return [p for p in psutil.process_iter(["name", "status"])
            if p.info["name"] == name and p.info["status"] != psutil.STATUS_ZOMBIE]


def gone_within(name: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(name) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(name)


def test_the_program_is_pid_1_and_no_process_memory_can_be_written():
    program = LIBC + (
        "print(os.getpid(), sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
        "for path in ('/proc/1/mem', '/proc/self/mem'):\n"
        "    try:\n        os.open(path, os.O_RDWR)\n        print('opened', path)\n"
        "    except OSError as e:\n        print(path, e.errno)\n"
        "buf = ctypes.create_string_buffer(8)\n"
        "iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)\n"
        "for nr, args in ((311, (1, iov, 1, iov, 1, 0)), (310, (1, iov, 1, iov, 1, 0)), (434, (1, 0)),\n"
        "                 (438, (3, 0, 0))):\n"  # process_vm_writev/readv, pidfd_open, pidfd_getfd
        "    print(nr, libc.syscall(nr, *args), ctypes.get_errno())\n")
    r = run_python(program, limits=ATTACKER)
    lines = r.stdout.splitlines()
    assert lines[0] == "1 ['1']", r.stdout + r.stderr  # no bwrap helper shares the namespace
    assert lines[1:3] == [f"/proc/1/mem {errno.EROFS}", f"/proc/self/mem {errno.EROFS}"]
    assert lines[3:] == [f"{nr} -1 {errno.EPERM}" for nr in (311, 310, 434, 438)]


@pytest.mark.parametrize("who", ["pid 1, killed by the wall clock", "a child left behind by an exiting pid 1"])
def test_a_program_that_cuts_its_ties_does_not_outlive_its_check(who):
    name = token()
    hold = named(name) + "x = bytearray(200 * 2**20)\nx[::4096] = b'1' * len(x[::4096])\nwhile True:\n    time.sleep(1)\n"
    if who.startswith("pid 1"):
        program, limits = LIBC + hold, ATTACKER
    else:  # the child leaves the session too; its parent returns at once with status 0
        indented = "".join("    " + line + "\n" for line in hold.splitlines())
        program = LIBC + "if os.fork() == 0:\n    os.setsid()\n" + indented + "time.sleep(0.5)\nprint('left')\n"
        limits = SandboxLimits(python_guard=False, allow_subprocess=True, timeout=3.0)
    r = run_python(program, limits=limits)
    assert r.timed_out == who.startswith("pid 1") and (r.timed_out or r.stdout == "left\n"), r.stderr
    assert gone_within(name, 1.0), f"{who}: {alive(name)} outlived the check"


def test_memfd_is_refused_and_the_run_has_a_memory_cgroup_where_one_can_be_made():
    r = run_python("import os\ntry:\n    os.memfd_create('x')\nexcept OSError as e:\n    print(e.errno)", limits=ATTACKER)
    assert r.stdout == f"{errno.EPERM}\n", r.stdout + r.stderr
    if not containment.probe()["memory_cgroup"]:
        pytest.skip("no writable memory cgroup on this machine: the run is bounded by its rlimits alone")
    limits = SandboxLimits(python_guard=False, memory_mb=300, work_mb=20, timeout=5.0)
    seen: dict = {}
    t = threading.Thread(target=lambda: seen.update(r=run_python("import time\ntime.sleep(1.5)", limits=limits)))
    t.start()
    deadline = time.monotonic() + 4
    while not seen.get("limit") and time.monotonic() < deadline:
        for kind, key in (("", "memory.max"), ("memory", "memory.limit_in_bytes")):
            base = containment._cgroup_dir(kind)
            for d in base.glob(f"posttrain-sandbox-{os.getpid()}-*") if base else ():
                if (d / key).exists() and (d / "cgroup.procs").read_text().split():
                    seen["limit"] = int((d / key).read_text())
        time.sleep(0.05)
    t.join()
    assert seen.get("limit") == 320 * 2**20 and seen["r"].ok


@pytest.mark.skipif(os.geteuid() != 0, reason="the inode limit is mounted by the root stage")
def test_an_inode_flood_stops_at_work_files():
    program = ("import os\nn = 0\ntry:\n    while True:\n        open(f'f{n}', 'w').close()\n        n += 1\n"
               "except OSError as e:\n    print(n, e.errno)")
    r = run_python(program, limits=SandboxLimits(python_guard=False, work_files=300))
    made, err = map(int, r.stdout.split())
    assert made < 300 and err == errno.ENOSPC, r.stdout + r.stderr


def test_the_exit_status_is_the_programs_own_and_cannot_be_forged():
    assert run_python("raise SystemExit(3)", limits=ATTACKER).returncode == 3
    # bwrap's init used to relay the status over an eventfd: write "exited 0" to every descriptor, then hang
    forge = LIBC + ("import struct\nfor fd in range(3, 256):\n    try:\n        os.write(fd, struct.pack('Q', 1))\n"
                    "    except OSError:\n        pass\ntime.sleep(60)\n")
    r = run_python(forge, limits=SandboxLimits(python_guard=False, timeout=1.5))
    assert r.timed_out and r.returncode != 0 and not r.ok


def test_host_packages_and_the_hosts_load_and_memory_are_not_visible():
    prefix, _ = sandbox._interpreter()
    hidden = sandbox._hidden_packages(prefix)
    assert any(os.listdir(d) for d in hidden)  # on the host they hold packages (pip at least)
    program = ("import os\n"
               f"print(sum(len(os.listdir(d)) for d in {hidden!r}))\n"
               "print(repr(open('/proc/meminfo').read() + open('/proc/loadavg').read() + open('/proc/uptime').read()))")
    r = run_python(program, limits=ATTACKER)
    assert r.stdout.splitlines() == ["0", "''"], r.stdout + r.stderr
    assert Path("/proc/meminfo").read_text()  # the host's own view is untouched


def test_a_sub_interpreter_is_refused_by_the_guard_and_holds_nothing_of_the_os_layers():
    r = run_python("import _xxsubinterpreters")
    assert "sandbox: import of _xxsubinterpreters is not allowed" in r.stderr
    program = ("import _xxsubinterpreters as s\ni = s.create()\n"
               "s.run_string(i, 'try:\\n    open(\"/usr/x\", \"w\")\\nexcept OSError as e:\\n    print(\"write\", e.errno)')")
    r = run_python(program, limits=ATTACKER)
    assert r.stdout == f"write {errno.EROFS}\n", r.stdout + r.stderr


def test_a_cgroup_that_cannot_be_joined_here_is_left_out_not_fatal(monkeypatch):
    real = containment.Cgroup.create

    def unjoinable(memory_bytes):  # made, but the join stage's write fails (a cgroup this machine refuses)
        cg = real(memory_bytes)
        if containment.CGROUPS["enabled"]:
            cg.procs = ["/proc/version"]
        return cg

    monkeypatch.setattr(containment.Cgroup, "create", staticmethod(unjoinable))
    monkeypatch.setitem(containment.CGROUPS, "enabled", True)
    sandbox._probe.cache_clear()
    try:
        assert sandbox.isolation()["os_sandbox"] and not containment.CGROUPS["enabled"]
        r = run_python("print(6 * 7)", limits=ATTACKER)
        assert r.stdout == "42\n", r.stderr
    finally:
        sandbox._probe.cache_clear()
