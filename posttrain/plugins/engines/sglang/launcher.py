"""Command lines for real SGLang servers (``python -m sglang.launch_server``).

::

    spec = SGLangSpec(model_path="/ckpt/Qwen3-1.7B", port=30001, tp_size=2, mem_fraction_static=0.7,
                      enable_memory_saver=True, extra={"attention_backend": "fa3"})
    server = ManagedServer(sglang_command(spec), f"http://127.0.0.1:30001").start()

``sglang_command`` builds ``python -m sglang.launch_server --model-path ... --host ... --port ...
--tp-size ... --dp-size ... --mem-fraction-static ... [--enable-memory-saver] --skip-server-warmup
--random-seed ...`` followed by every pass-through option (``extra``: ``{"foo_bar": v}`` becomes
``--foo-bar v``; ``True`` becomes a bare ``--foo-bar``; ``False``/``None`` are dropped).
:func:`sglang_options_from_argv` collects ``--sglang-foo-bar v`` style options from a command line.
**Real SGLang is not exercised by this repository's tests** (it needs GPUs and a multi-GB install); the
tests check the command lines; readiness and restarts (:class:`~posttrain.core.rollout.procs.ManagedServer`)
are tested against the local engine server, which answers the same ``/health_generate``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any



# options posttrain sets itself; the pass-through may not shadow them
RESERVED = frozenset({"model_path", "host", "port", "tp_size", "dp_size", "mem_fraction_static", "enable_memory_saver",
                      "random_seed", "base_gpu_id", "api_key"})


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


def sglang_spec_from_config(config: Any, resources: Any, model_path: str, port: int, engine_index: int = 0,
                            seed: int = 0, cli_options: dict[str, Any] | None = None) -> SGLangSpec:
    """The spec of engine ``engine_index`` from the ``sglang`` backend's config and ``resources``.

    ``tp_size`` is ``resources.gpus_per_engine``; the memory saver is on when trainer and engines are
    colocated; ``config.args`` and then ``cli_options`` (``--sglang-*`` from a command line) are passed
    through; each engine gets its own seed (``seed + engine_index x gpus_per_engine``, as slime does) and
    its first GPU (after the trainer's unless colocated).
    """
    from posttrain.core.rollout.backend import gpu_ids

    extra = {**dict(config.args), **(cli_options or {})}
    return SGLangSpec(model_path=str(model_path), port=port, tp_size=resources.gpus_per_engine, dp_size=1,
                      mem_fraction_static=config.mem_fraction_static, enable_memory_saver=resources.colocate,
                      random_seed=seed + engine_index * resources.gpus_per_engine,
                      base_gpu_id=gpu_ids(resources, engine_index)[0], extra=extra)


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
    for key, value in spec.extra.items():
        key = key.replace("-", "_")
        if key in RESERVED:
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
