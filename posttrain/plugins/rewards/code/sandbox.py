"""Running untrusted, model-written Python (the ``code`` reward's executor) in an OS-level sandbox.

The boundary is **bubblewrap** (``bwrap``), not Python: nothing here relies on the program cooperating.
Each run gets, from the kernel:

- **namespaces**: new user, PID, mount, network, IPC, UTS (and cgroup where the kernel has it). The
  network namespace has only its own loopback, so nothing on the host (its 127.0.0.1 included) or
  beyond is reachable. The program itself is pid 1 of its PID namespace (``--as-pid-1``): no helper
  process of bwrap's shares the namespace, so there is no other process inside whose memory the
  program could rewrite (and ``/proc`` is read-only besides), and its exit status is the kernel's
  report of its own exit, not a value relayed through a process it could reach. When pid 1 exits or is
  killed the kernel kills every process in the namespace, detached ones too; ``--disable-userns``
  forbids creating nested user namespaces.
- **containment** (:mod:`.containment`): the run's pid 1 is held by a pidfd and SIGKILLed when the run
  ends, however it ended, so nothing of a sandbox outlives its check, even a program that cleared its
  parent-death signal and left bwrap's session; where a cgroup can be made (root, or a delegated
  subtree) the whole chain runs in one, killed with ``cgroup.kill`` and bounded in resident memory
  (``memory_mb + work_mb``: anonymous, tmpfs, memfd and the kernel's inode memory together).
- **an unprivileged host uid**: the program runs as uid/gid 65534 (``nobody``) *on the host*, with no
  capabilities, not as a root mapped into a namespace. When the caller is root, a short root stage
  (``unshare --mount``, ``mount``, ``setpriv``) first makes the interpreter reachable for that uid (it
  may live under a 0700 ``/root``) and mounts ``/work`` with an inode limit, then drops to 65534 and
  starts ``bwrap``; otherwise ``bwrap`` runs as the caller, who is unprivileged already.
- **a minimal read-only filesystem**: ``/usr`` (with the ``/bin``, ``/lib`` links) and the interpreter's
  prefix, read-only, with every ``site-packages``/``dist-packages`` directory in them covered by an
  empty one; a fresh read-only ``/proc`` in which the host's load, memory and uptime files read empty;
  a minimal ``/dev``; no ``/etc``, ``/home``, ``/root``, ``/sys`` or host ``/tmp``; the root and
  ``/dev`` are remounted read-only. The only writable place is ``/work`` (the working directory): a
  private tmpfs of ``work_mb`` and (when root) at most ``work_files`` inodes.
- **rlimits** (``prlimit`` before the interpreter starts): address space, CPU seconds, processes,
  file size, open files, no core dumps; address space, CPU and core dumps also on the whole chain
  (the stages and bwrap) from its first process.
- **seccomp** (x86-64): unless ``allow_subprocess``, creating processes (``fork``, ``vfork``, ``clone``
  without ``CLONE_THREAD``) fails with EPERM, so memory cannot be multiplied by forking; always denied:
  ``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_open``/``pidfd_getfd``, ``memfd_create`` and
  ``memfd_secret`` (memory no rlimit counts), ``bpf``, ``perf_event_open``, ``userfaultfd``,
  ``io_uring``, key management, module and kexec loading, ``mount`` and the new mount API, ``unshare``,
  ``setns``, the x32 ABI. Other architectures run without it (``isolation()["seccomp"]`` is False) and
  rely on the process rlimit.
- **a scrubbed environment**: the whole chain (not only the program) starts from a fixed handful of
  variables, so no secret of the caller appears in any ``/proc/<pid>/environ`` inside.
- **a wall clock**: on ``timeout`` (or when stdout + stderr pass ``output_mb``) the run is SIGKILLed:
  its pid 1 (and with it the namespace), its cgroup and bwrap's process group.

The program sees the standard library only (``python -I -S``: no site-packages, no user site).

A Python audit-hook guard (no sockets, subprocesses, ``ctypes``, sub-interpreters, ``gc`` object walks,
writes outside the working directory) still runs first, as defence in depth only: its state lives in a closure, not in
module globals the program could rebind.

Without ``bwrap`` a run raises :class:`SandboxUnavailable` with a one-line install hint. The only weaker
mode is explicit: ``SandboxLimits(os_sandbox=False)`` (rlimits, process-group kill and the Python guard,
on the host filesystem as the caller's uid); callers must name it loudly.
"""

from __future__ import annotations

import functools
import os
import platform
import resource
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

from posttrain.plugins.rewards.code import containment
from posttrain.plugins.rewards.code.containment import JOIN_STAGE, Cgroup, NamespaceInit
from posttrain.plugins.rewards.code.containment import probe as probe_containment

SANDBOX_UID = 65534  # nobody / nogroup
WORK = "/work"
INSTALL_HINT = ("the code sandbox needs bubblewrap (`bwrap`), which is not installed: "
                "`apt-get install -y bubblewrap` (Debian/Ubuntu) or `dnf install -y bubblewrap` (Fedora/RHEL)")


class SandboxUnavailable(RuntimeError):
    """The OS sandbox cannot run on this machine (bwrap missing, or namespaces refused); one line."""


# Runs first inside the sandbox (trusted code): the guard, then the program as ``__main__``.
GUARD = r'''
def _install(allow_sub, root):
    import builtins, os, sys
    builtins.exit = builtins.quit = sys.exit  # -S skips site, which defines them
    block = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
             "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "sys.remote_exec",
             "os.setuid", "gc.get_objects", "gc.get_referrers", "gc.get_referents"}
    if not allow_sub:
        block |= {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                  "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn"}
    block = frozenset(block)
    subinterpreters = {"_xxsubinterpreters", "_xxinterpchannels", "_interpreters", "_interpchannels", "_interpqueues"}
    imports = frozenset({"ctypes", "_ctypes", "cffi"} | subinterpreters |
                        (set() if allow_sub else {"multiprocessing", "_posixsubprocess"}))
    paths = frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                       "os.symlink", "os.link", "shutil.rmtree", "shutil.move", "os.chdir", "os.chroot",
                       "os.rename", "os.replace"})
    wflags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    realpath, fsdecode, devnull, sep = os.path.realpath, os.fsdecode, os.devnull, os.sep

    def inside(path):
        if isinstance(path, int):
            return True
        try:
            real = realpath(fsdecode(path))
        except Exception:
            return False
        return real == root or real.startswith(root + sep) or real == devnull

    def guard(event, args):
        if event in block:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args and str(args[0]).split(".")[0] in imports:
            raise ImportError(f"sandbox: import of {args[0]} is not allowed")
        if event == "open" and len(args) >= 3:
            mode, flags = args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & wflags)
            if writing and not inside(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory is not allowed")
        elif event in paths:
            for a in args[:2]:
                if isinstance(a, (str, bytes, os.PathLike)) and not inside(a):
                    raise PermissionError(f"sandbox: {event} on {a!r} outside the working directory is not allowed")
    sys.addaudithook(guard)

_install(ALLOW_SUB, ROOT)
del _install
__file__ = MAIN
_code = compile(open(__file__).read(), __file__, "exec")
exec(_code, {"__name__": "__main__", "__file__": __file__, "__builtins__": __builtins__})
'''

# The root stage: a private mount namespace in which the interpreter prefix is bound onto a directory
# uid 65534 can reach (when $1 is not empty) and /work's tmpfs is mounted with its size and inode limits;
# then drop to that uid and exec the rest of the command line (bwrap).
_ROOT_STAGE = ('[ -z "$1" ] || mount --bind "$1" "$2" || exit 125; '
               'mount -t tmpfs -o "$4" tmpfs "$3" || exit 125; shift 4; exec "$@"')
# Host files of /proc that a PID namespace does not confine (the machine's load, memory, uptime): read empty.
_HIDDEN_PROC = ("loadavg", "meminfo", "stat", "uptime", "vmstat", "diskstats", "swaps", "zoneinfo")


@dataclass
class SandboxLimits:
    """Limits of one sandboxed run (each checked > 0: a bad value names its key)."""

    timeout: float = 10.0  # wall clock, seconds
    cpu_seconds: int = 10
    memory_mb: int = 1024  # address space per process; Python itself needs ~30 MB
    file_size_mb: int = 16
    open_files: int = 64
    processes: int = 32  # RLIMIT_NPROC (threads count too), per sandbox: its user namespace counts its own
    work_mb: int = 64  # the tmpfs /work
    work_files: int = 4096  # inodes of /work (files and directories), where the root stage mounts it
    output_mb: int = 16  # stdout + stderr kept; more kills the run
    allow_subprocess: bool = False  # lifts the seccomp fork rule and the guard's process rules
    python_guard: bool = True  # tests turn it off to check the OS layers alone
    os_sandbox: bool = True  # False: INSECURE (no namespaces, host filesystem, caller's uid)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise ValueError(f"SandboxLimits.{f.name}: expected true or false, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{f.name}: expected a number > 0, got {value!r}")


@dataclass
class SandboxResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    output_limited: bool = False  # killed for writing more than ``output_mb``

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_limited


# ---- seccomp: a classic-BPF filter written here (x86-64 numbers), handed to bwrap --seccomp ----------

_AUDIT_ARCH_X86_64 = 0xC000003E
_RET_ALLOW, _RET_KILL = 0x7FFF0000, 0x80000000
_EPERM, _ENOSYS = 0x00050000 | 1, 0x00050000 | 38
_CLONE_THREAD = 0x00010000
_X86_64 = {"fork": 57, "vfork": 58, "clone": 56, "clone3": 435}
_X86_64_DENIED = (101, 321, 298, 323, 425, 426, 427, 248, 249, 250, 246, 320, 175, 313, 176, 165, 166, 155,
                  272, 308, 135, 163, 167, 168, 169, 304,  # ptrace bpf perf_event_open userfaultfd io_uring*3
                  # add_key request_key keyctl kexec_load kexec_file_load (f)init/delete_module mount umount2
                  # pivot_root unshare setns personality acct swapon swapoff reboot open_by_handle_at
                  310, 311, 434, 438, 440, 319, 447, 428, 429, 430, 431, 432, 433, 442)
# process_vm_readv process_vm_writev pidfd_open pidfd_getfd process_madvise memfd_create memfd_secret
# open_tree move_mount fsopen fsconfig fsmount fspick mount_setattr


def seccomp_filter(allow_subprocess: bool) -> bytes | None:
    """The BPF program (``struct sock_filter[]``), or None on machines other than x86-64."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, JMP|JSET|K, RET|K
    prog: list[tuple] = [(LD, 4), (JEQ, _AUDIT_ARCH_X86_64, 0, "kill"), (LD, 0), (JGE, 0x40000000, "eperm", 0)]
    prog += [(JEQ, nr, "eperm", 0) for nr in _X86_64_DENIED]
    if not allow_subprocess:
        prog += [(JEQ, _X86_64["fork"], "eperm", 0), (JEQ, _X86_64["vfork"], "eperm", 0),
                 (JEQ, _X86_64["clone3"], "enosys", 0),  # its flags are in memory; glibc falls back to clone
                 (JEQ, _X86_64["clone"], 0, "allow"), (LD, 16), (JSET, _CLONE_THREAD, "allow", "eperm")]
    prog += [("allow", RET, _RET_ALLOW), ("eperm", RET, _EPERM), ("enosys", RET, _ENOSYS), ("kill", RET, _RET_KILL)]
    labels = {ins[0]: i for i, ins in enumerate(prog) if isinstance(ins[0], str)}
    out = b""
    for i, ins in enumerate(prog):
        code, k, *jumps = ins[1:] if isinstance(ins[0], str) else ins
        jt, jf = ((labels[j] - i - 1 if isinstance(j, str) else j) for j in (jumps or [0, 0]))
        out += struct.pack("=HBBI", code, jt, jf, k)
    return out


# ---- what this machine offers -------------------------------------------------------------------------

def _interpreter() -> tuple[str, str]:
    """(prefix, executable) of the base interpreter (a venv's base: the sandbox needs the stdlib only)."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if not (exe.startswith(prefix + os.sep) or exe.startswith("/usr/")):
        raise SandboxUnavailable(f"code sandbox: the interpreter {exe} is neither under {prefix} nor /usr")
    return prefix, exe


def _tools() -> dict[str, str]:
    names = ["bwrap", "prlimit"] + (["unshare", "setpriv", "mount"] if os.geteuid() == 0 else [])
    found = {n: shutil.which(n, path="/usr/bin:/bin:/usr/sbin:/sbin") or shutil.which(n) for n in names}
    if not found["bwrap"]:
        raise SandboxUnavailable(INSTALL_HINT)
    missing = [n for n, p in found.items() if not p]
    if missing:
        raise SandboxUnavailable(f"code sandbox: {', '.join(missing)} not found (Debian packages util-linux, mount)")
    return found


@functools.lru_cache(maxsize=1)
def _probe() -> str | None:
    """None when a trivial program runs in the full sandbox here, else the one-line reason."""
    try:
        r = _run("print('ok')", "", SandboxLimits(timeout=30, python_guard=False), {})
        if r.stdout != "ok\n" and containment.CGROUPS["enabled"]:  # a cgroup made but not joinable here:
            containment.CGROUPS["enabled"] = False  # runs go without (the pidfd still ends them)
            r = _run("print('ok')", "", SandboxLimits(timeout=30, python_guard=False), {})
    except SandboxUnavailable as exc:
        return str(exc)
    if r.stdout == "ok\n":
        return None
    last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
    return (f"code sandbox: bwrap cannot start here ({last}); it needs user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0)")


def check_os_sandbox() -> None:
    """Raise :class:`SandboxUnavailable` (one line) unless the OS sandbox works on this machine."""
    reason = _probe()
    if reason:
        raise SandboxUnavailable(reason)


def isolation() -> dict:
    """What a run gets on this machine (for logs, ``rl-cli`` diagnostics and tests)."""
    reason = _probe()
    return {"os_sandbox": reason is None, "reason": reason,
            "namespaces": ["user", "pid", "mount", "network", "ipc", "uts"] if reason is None else [],
            "host_uid": (SANDBOX_UID if os.geteuid() == 0 else os.geteuid()) if reason is None else None,
            "seccomp": reason is None and seccomp_filter(False) is not None,
            "rlimits": ["as", "cpu", "nproc", "fsize", "nofile", "core"], "python_guard": True,
            "containment": ({"pid1_pidfd": hasattr(os, "pidfd_open"), **probe_containment()} if reason is None else {}),
            "work_inode_limit": reason is None and os.geteuid() == 0}


# ---- one run ------------------------------------------------------------------------------------------

def _hidden_packages(prefix: str) -> list[str]:
    """Directories of third-party packages under the read-only binds: covered by an empty directory."""
    found = []
    for base in {prefix, "/usr", "/usr/local"}:
        for lib in ("lib", "lib64"):
            for d in sorted(Path(base, lib).glob("python3*/*-packages")):
                if d.name in ("site-packages", "dist-packages") and d.is_dir() and str(d) not in found:
                    found.append(str(d))
    return found


def _sandbox_argv(limits: SandboxLimits, host: str, fds: dict[str, int], seccomp_fd: int | None,
                  info_fd: int, cgroup_procs: list[str]) -> list[str]:
    """The whole chain: chain rlimits, the cgroup join, the root stage (when root), bwrap, prlimit, python."""
    tools = _tools()
    prefix, exe = _interpreter()
    root = os.geteuid() == 0
    argv = [tools["bwrap"], "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session", "--as-pid-1",
            "--info-fd", str(info_fd), "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for d in ("bin", "sbin", "lib", "lib32", "lib64"):  # merged-/usr links, or the directories themselves
        if os.path.islink("/" + d):
            argv += ["--symlink", os.readlink("/" + d), "/" + d]
        elif os.path.isdir("/" + d):
            argv += ["--ro-bind", "/" + d, "/" + d]
    if not prefix.startswith("/usr/"):
        argv += ["--ro-bind", os.path.join(host, "python") if root else prefix, prefix]
    for d in _hidden_packages(prefix):
        argv += ["--ro-bind", os.path.join(host, "empty.d"), d]
    argv += ["--proc", "/proc"]
    for name in _HIDDEN_PROC:
        if os.path.exists("/proc/" + name):
            argv += ["--ro-bind", os.path.join(host, "empty"), "/proc/" + name]
    argv += ["--dev", "/dev"]
    argv += (["--bind", os.path.join(host, "work"), WORK] if root else
             ["--size", str(limits.work_mb * 2**20), "--tmpfs", WORK])
    for name, fd in fds.items():
        argv += ["--perms", "0644", "--file", str(fd), f"{WORK}/{name}"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    argv += ["--remount-ro", "/dev", "--remount-ro", "/proc", "--remount-ro", "/", "--chdir", WORK, "--clearenv"]
    for key, value in _child_env(WORK).items():
        argv += ["--setenv", key, value]
    argv += ["--", tools["prlimit"], *_prlimit_args(limits), "--", exe, *_python_args(limits, WORK)]
    if root:  # drop to the sandbox uid on the host, after making the prefix reachable and mounting /work
        stage = [tools["setpriv"], f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--"]
        tmpfs = (f"size={limits.work_mb * 2**20},nr_inodes={limits.work_files},mode=0700,"
                 f"uid={SANDBOX_UID},gid={SANDBOX_UID}")
        argv = [tools["unshare"], "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _ROOT_STAGE, "sh",
                "" if prefix.startswith("/usr/") else prefix, os.path.join(host, "python"),
                os.path.join(host, "work"), tmpfs, *stage, *argv]
    if cgroup_procs:
        argv = ["/bin/sh", "-c", JOIN_STAGE, "sh", str(len(cgroup_procs)), *cgroup_procs, *argv]
    chain = [f"--{name}={value}" for name, _, value in _rlimit_pairs(limits) if name in ("as", "cpu", "core")]
    return [tools["prlimit"], *chain, "--", *argv]


def _child_env(work: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}


def _rlimit_pairs(limits: SandboxLimits) -> list[tuple[str, int, int]]:
    return [("as", resource.RLIMIT_AS, limits.memory_mb * 2**20), ("cpu", resource.RLIMIT_CPU, int(limits.cpu_seconds)),
            ("nproc", resource.RLIMIT_NPROC, int(limits.processes)),
            ("fsize", resource.RLIMIT_FSIZE, limits.file_size_mb * 2**20),
            ("nofile", resource.RLIMIT_NOFILE, int(limits.open_files)), ("core", resource.RLIMIT_CORE, 0)]


def _prlimit_args(limits: SandboxLimits) -> list[str]:
    return [f"--{name}={value}" for name, _, value in _rlimit_pairs(limits)]


def _python_args(limits: SandboxLimits, work: str) -> list[str]:
    main = f"{work}/main.py"
    if not limits.python_guard:
        return ["-I", "-S", "-c", f"import builtins, sys; builtins.exit = builtins.quit = sys.exit; "
                f"__file__ = {main!r}; exec(compile(open(__file__).read(), __file__, 'exec'))"]
    boot = GUARD.replace("ALLOW_SUB, ROOT", f"{limits.allow_subprocess!r}, {work!r}").replace("= MAIN", f"= {main!r}")
    return ["-I", "-S", "-c", boot]


def _insecure_popen_kwargs(limits: SandboxLimits, work: str) -> dict:
    """The ``os_sandbox=False`` mode: rlimits in ``preexec_fn`` (computed here: the child between fork and
    exec must not allocate when the parent has threads), the host's filesystem, the caller's uid."""
    pairs = [(what, value) for _, what, value in _rlimit_pairs(limits) if what != resource.RLIMIT_NPROC]
    setrlimit = resource.setrlimit

    def apply() -> None:
        for what, value in pairs:
            setrlimit(what, (value, value))
    return {"preexec_fn": apply, "cwd": work, "env": _child_env(work)}


@dataclass
class _Held:
    """What holds one run's processes: bwrap's process (its group), the namespace's pid 1, the cgroup."""

    proc: subprocess.Popen
    init: NamespaceInit | None = None
    cgroup: Cgroup | None = None
    escapees: bool = False  # the insecure mode: descendants may have left the group

    def kill(self) -> None:
        """SIGKILL everything of the run: pid 1 (its PID namespace dies with it), the cgroup, bwrap's
        process group; in the insecure mode also every descendant that left the group."""
        if self.init is not None:
            self.init.kill()
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.init is not None and self.init.pidfd is not None and self.init.wait_gone(1.0):
            try:  # bwrap reaps its child and exits: killed first, it would leave a zombie to the host's init
                self.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        descendants = []
        if self.escapees:
            import psutil
            try:
                descendants = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                pass
        if self.proc.poll() is None or self.escapees:  # a reaped pid must not be signalled (it may be reused)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in descendants:
            try:
                p.kill()
            except Exception:  # psutil.Error: already gone
                pass


def _collect(held: _Held, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, killing the run at ``deadline`` or past ``cap`` bytes."""
    proc = held.proc
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    timed_out = limited = killed = False
    total = 0
    while sel.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not killed:
            timed_out = killed = True
            held.kill()
            deadline = time.monotonic() + 5.0  # the pipes close once the namespace is gone
            continue
        if remaining <= 0:
            break  # something outlived the kill and holds a pipe open: stop reading
        for key, _ in sel.select(remaining):
            data = os.read(key.fd, 65536)
            if not data:
                sel.unregister(key.fd)
                continue
            keep = data[: max(0, cap - total)]
            bufs[key.fd] += keep
            total += len(data)
            if total > cap and not killed:
                limited = killed = True
                held.kill()
                deadline = time.monotonic() + 5.0
    sel.close()
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), timed_out, limited


def run_python(source: str, stdin: str = "", limits: SandboxLimits | None = None,
               files: dict[str, str] | None = None) -> SandboxResult:
    """Run ``source`` as ``__main__`` (``/work/main.py``) in the sandbox described in the module docstring.

    :param stdin: the program's standard input.
    :param files: extra files copied into ``/work`` first (``name -> text``; plain names only).
    Raises :class:`SandboxUnavailable` (one line) when the OS sandbox cannot run here.
    """
    limits = limits or SandboxLimits()
    for name in files or {}:
        if not isinstance(name, str) or not name or "/" in name or name in (".", "..", "main.py"):
            raise ValueError(f"run_python files: {name!r} is not a plain file name")
    if limits.os_sandbox:
        check_os_sandbox()
    return _run(source, stdin, limits, files or {})


def _run(source: str, stdin: str, limits: SandboxLimits, files: dict[str, str]) -> SandboxResult:
    host = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    start = time.perf_counter()
    opened: list[int] = []  # passed to the child, closed here afterwards
    stdin_f = held = cgroup = None
    try:
        inputs = {"main.py": source, **files}
        for name, text in inputs.items():
            Path(host, "in-" + name).write_text(text, encoding="utf-8")
        Path(host, "stdin").write_text(stdin, encoding="utf-8")
        stdin_f = open(Path(host, "stdin"), "rb")  # a file, not a pipe: nothing to feed while reading
        info_r = None
        if limits.os_sandbox:
            argv, kwargs, info_r, cgroup = _os_sandbox_launch(limits, host, inputs, opened)
        else:
            work = Path(host, "work")
            work.mkdir()
            for name, text in inputs.items():
                Path(work, name).write_text(text, encoding="utf-8")
            argv = [sys.executable, *_python_args(limits, str(work))]
            kwargs = _insecure_popen_kwargs(limits, str(work))
        proc = subprocess.Popen(argv, stdin=stdin_f, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, **kwargs)
        held = _Held(proc, cgroup=cgroup, escapees=not limits.os_sandbox)
        deadline = time.monotonic() + limits.timeout
        if info_r is not None:
            os.close(opened.pop())  # the info pipe's write end: bwrap holds it now
            held.init = NamespaceInit(info_r, deadline)
        out, err, timed_out, limited = _collect(held, deadline, limits.output_mb * 2**20)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            held.kill()
            proc.wait()
        return SandboxResult(proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                             timed_out, time.perf_counter() - start, limited)
    finally:
        _release(held, cgroup, stdin_f, opened, host)


def _os_sandbox_launch(limits: SandboxLimits, host: str, inputs: dict[str, str],
                       opened: list[int]) -> tuple[list[str], dict, int, Cgroup]:
    """The command line and Popen arguments of an OS-sandboxed run; the read end of bwrap's info pipe
    (its write end is the last of ``opened``) and the run's cgroup."""
    os.chmod(host, 0o711)  # uid 65534 passes through to the mount points, and reads nothing here
    for d in ("python", "work", "empty.d"):
        os.mkdir(Path(host, d), 0o755)
    Path(host, "empty").touch(0o644)
    fds = {}
    for name in inputs:
        fds[name] = os.open(Path(host, "in-" + name), os.O_RDONLY)
        opened.append(fds[name])
    bpf = seccomp_filter(limits.allow_subprocess)
    seccomp_fd = None
    if bpf is not None:
        Path(host, "seccomp.bpf").write_bytes(bpf)
        seccomp_fd = os.open(Path(host, "seccomp.bpf"), os.O_RDONLY)
        opened.append(seccomp_fd)
    cgroup = Cgroup.create((limits.memory_mb + limits.work_mb) * 2**20)
    info_r, info_w = os.pipe()
    opened.insert(0, info_r)
    opened.append(info_w)
    argv = _sandbox_argv(limits, host, fds, seccomp_fd, info_w, cgroup.procs)
    # the whole chain starts clean: bwrap's own environ would otherwise be readable from inside
    kwargs = {"env": {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"}, "cwd": "/",
              "pass_fds": tuple(fd for fd in opened if fd != info_r)}
    return argv, kwargs, info_r, cgroup


def _release(held: _Held | None, cgroup: Cgroup | None, stdin_f, opened: list[int], host: str) -> None:
    """End whatever is left of a run (always: a program may have outlived bwrap) and free its resources."""
    if held is not None:
        held.kill()
        if held.init is not None:
            held.init.wait_gone(1.0)
            held.init.close()
        if held.proc.poll() is None:
            held.proc.wait()
        for pipe in (held.proc.stdout, held.proc.stderr):
            if pipe is not None:
                pipe.close()
    if cgroup is not None:
        cgroup.kill()
        cgroup.remove()
    if stdin_f is not None:
        stdin_f.close()
    for fd in opened:
        os.close(fd)
    shutil.rmtree(host, ignore_errors=True)
