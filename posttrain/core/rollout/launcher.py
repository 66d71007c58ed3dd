"""Engine processes: command lines for real SGLang and for the local engine, readiness, restarts.

Real SGLang (GPU machines)::

    spec = SGLangSpec(model_path="/ckpt/Qwen3-1.7B", port=30001, tp_size=2, mem_fraction_static=0.7,
                      enable_memory_saver=True, extra={"attention_backend": "fa3"})
    server = ManagedServer(sglang_command(spec), f"http://127.0.0.1:30001").start()

``sglang_command`` builds ``python -m sglang.launch_server --model-path ... --host ... --port ...
--tp-size ... --dp-size ... --mem-fraction-static ... [--enable-memory-saver] --skip-server-warmup
--random-seed ...`` followed by every pass-through option (``extra``: ``{"foo_bar": v}`` becomes
``--foo-bar v``; ``True`` becomes a bare ``--foo-bar``; ``False``/``None`` are dropped).
:func:`sglang_options_from_argv` collects ``--sglang-foo-bar v`` style options from a command line.

:class:`ManagedServer` runs any such command, waits for ``GET /health_generate``, and
:meth:`ManagedServer.ensure_running` restarts a server whose process died or that failed
``max_failures`` health checks in a row. **Real SGLang is not exercised by this repository's tests**
(it needs GPUs and a multi-GB install); the tests check the command lines, and the readiness and
restart logic against the local engine server, which answers the same ``/health_generate``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.rollout.procs import http_ok, spawn, stop_process, wait_http_ok


@dataclass
class SGLangSpec:
    """What one SGLang server needs from the run config."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    enable_memory_saver: bool = False  # colocated with the trainer: weights/KV released while training
    random_seed: int | None = None
    base_gpu_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def sglang_spec_from_config(rollout: Any, resources: Any, model_path: str, port: int, engine_index: int = 0,
                            seed: int = 0, cli_options: dict[str, Any] | None = None) -> SGLangSpec:
    """The spec of engine ``engine_index`` from the run config's ``rollout`` and ``resources`` sections.

    ``tp_size`` is ``resources.gpus_per_engine``; the memory saver is on when trainer and engines are
    colocated; ``rollout.sglang`` and then ``cli_options`` (``--sglang-*`` from the command line) are passed
    through; each engine gets its own seed (``seed + engine_index x gpus_per_engine``, as slime does).
    """
    extra = {**dict(rollout.sglang), **(cli_options or {})}
    return SGLangSpec(model_path=str(model_path), port=port, tp_size=resources.gpus_per_engine, dp_size=1,
                      mem_fraction_static=rollout.mem_fraction_static, enable_memory_saver=resources.colocate,
                      random_seed=seed + engine_index * resources.gpus_per_engine, extra=extra)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def sglang_command(spec: SGLangSpec, python: str | None = None) -> list[str]:
    """The ``python -m sglang.launch_server`` argv for ``spec``."""
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(spec.model_path),
           "--host", spec.host, "--port", str(spec.port), "--tp-size", str(spec.tp_size),
           "--dp-size", str(spec.dp_size)]
    if spec.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    if spec.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if spec.random_seed is not None:
        cmd += ["--random-seed", str(spec.random_seed)]
    if spec.base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(spec.base_gpu_id)]
    cmd.append("--skip-server-warmup")
    reserved = {"model_path", "host", "port", "tp_size", "dp_size", "mem_fraction_static", "enable_memory_saver",
                "random_seed", "base_gpu_id"}
    for key, value in spec.extra.items():
        key = key.replace("-", "_")
        if key in reserved:
            raise ValueError(f"sglang option {key!r} is set from the run config; set it there instead")
        if value is None or value is False:
            continue
        if value is True:
            cmd.append(_flag(key))
        elif isinstance(value, (list, tuple)):
            cmd += [_flag(key), *map(str, value)]
        else:
            cmd += [_flag(key), str(value)]
    return cmd


def sglang_options_from_argv(argv: list[str], prefix: str = "--sglang-") -> tuple[dict[str, Any], list[str]]:
    """Split ``--sglang-foo-bar v`` / ``--sglang-flag`` options out of ``argv``.

    :returns: ``({"foo_bar": "v", "flag": True}, remaining_argv)``.
    """
    options: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(prefix):
            key, eq, value = arg[len(prefix):].partition("=")
            key = key.replace("-", "_")
            if eq:
                options[key] = value
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                options[key] = argv[i + 1]
                i += 1
            else:
                options[key] = True
        else:
            rest.append(arg)
        i += 1
    return options, rest


def local_engine_command(model_dir: str, port: int, host: str = "127.0.0.1", **options: Any) -> list[str]:
    """The ``rl-cli engine serve`` argv (run through this interpreter) for the embedded local engine."""
    cmd = [sys.executable, "-m", "posttrain.cli.main", "engine", "serve", str(model_dir), "--host", host,
           "--port", str(port)]
    for key, value in options.items():
        if value is True:
            cmd.append(_flag(key))
        elif value not in (None, False):
            cmd += [_flag(key), str(value)]
    return cmd


class ManagedServer:
    """A server process with readiness (``/health_generate``) and restart-on-failure."""

    def __init__(self, command: list[str], base_url: str, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 600.0, max_failures: int = 3,
                 health_timeout_s: float = 30.0):
        self.command, self.base_url = list(command), base_url.rstrip("/")
        self.log_path, self.env = log_path, env
        self.ready_timeout_s, self.max_failures, self.health_timeout_s = ready_timeout_s, max_failures, health_timeout_s
        self.proc: subprocess.Popen | None = None
        self.failures = 0
        self.restarts = 0

    def start(self, wait: bool = True) -> ManagedServer:
        self.proc = spawn(self.command, self.log_path, self.env)
        self.failures = 0
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> None:
        """Block until ``/health_generate`` answers 200; raise if the process exits or time runs out."""
        try:
            wait_http_ok(self.base_url + "/health_generate", self.ready_timeout_s, self.proc)
        except Exception:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        """One health check; counts consecutive failures."""
        ok = self.alive() and http_ok(self.base_url + "/health_generate", timeout=self.health_timeout_s)
        self.failures = 0 if ok else self.failures + 1
        return ok

    def ensure_running(self) -> bool:
        """Restart the server if its process died or it failed ``max_failures`` checks in a row.

        :returns: True when a restart happened (the caller re-syncs weights and re-registers it).
        """
        if self.alive() and (self.healthy() or self.failures < self.max_failures):
            return False
        self.stop()
        self.restarts += 1
        self.start(wait=True)
        return True

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def __enter__(self) -> ManagedServer:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
