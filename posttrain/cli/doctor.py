"""``rl-cli doctor CONFIG [key=value ...] [--engines]``: will this run start here? One line per finding.

Everything ``run --dry-run`` checks (the config, every error at once, and its data), then what needs the
machine: GPUs and their free memory for the placement (host memory on a CPU placement), free loopback
ports for the engines, router and weight group (external engines: that they answer), what plugins check
(``posttrain_doctor_checks``: the code reward's OS sandbox, ``bwrap``), installed torch / megatron-core / sglang-router / sglang against the
versions posttrain is tested with, and free disk for the run directory's checkpoints. ``--engines``
starts the run's engines (and router) and makes a weight round trip to each: new weights pushed the
way the run would push them (``rollout.weight_sync``), then every tensor's checksum read back.

Exit code 0 when nothing failed, 2 otherwise. Memory and disk figures are lower bounds (weights, grads
and Adam state; no activations), so a pass is necessary, not sufficient.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import typer

from posttrain.cli.console import console
from posttrain.cli.options import Disabled, PluginFiles, load
from posttrain.core.interfaces import Finding

GIB = 1 << 30
# bytes per parameter: training (weights, fp32 master, gradient, two Adam moments) and a saved checkpoint
TRAIN_BYTES, CKPT_BYTES = 16, 12
TESTED = ("torch", "megatron-core", "sglang-router", "sglang")


def doctor(config: Path = typer.Argument(..., help="run config (YAML)", show_default=False),
           overrides: list[str] = typer.Argument(None, help="dotted overrides, as for `run`", show_default=False),
           engines: bool = typer.Option(False, "--engines", help="start the engines and make a weight round trip"),
           run_dir: Path = typer.Option(Path("runs"), "--run-dir", help="where the run would write (disk check)"),
           plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """Check CONFIG and this machine for the run: one line per finding; exit 2 if any failed."""
    plugins = load(plugin, disable)
    findings, cfg = check_config(config, list(overrides or []), plugins)
    findings += check_versions(cfg, plugins)
    if cfg is not None:
        params = model_params(cfg, plugins, findings)
        findings += check_placement(cfg, plugins, params)
        findings += check_ports(cfg, plugins)
        findings += plugin_checks(cfg, plugins)
        findings += check_disk(cfg, params, run_dir)
        if engines:
            from posttrain.cli.doctor_engines import round_trip

            findings += round_trip(cfg, plugins)
    for f in findings:
        style = "" if f.ok or f.note else "[red]"
        console.print(f"{style}{f.line()}" + ("[/]" if style else ""), highlight=False, markup=bool(style),
                      soft_wrap=True)
    failed = sum(not f.ok and not f.note for f in findings)
    console.print(f"{len(findings)} checks, {failed} failed", highlight=False)
    if failed:
        raise typer.Exit(2)


def check_config(path: Path, overrides: list[str], plugins: Any) -> tuple[list[Finding], Any]:
    """What ``run --dry-run`` reports, as findings, and the config (None when it is invalid)."""
    from posttrain.core.config import load_config
    from posttrain.core.data import inspect_config_data
    from posttrain.core.errors import ConfigError

    dataset, data_errors = inspect_config_data(path, overrides)
    try:
        cfg = load_config(path, overrides, plugins)
    except ConfigError as exc:
        return [Finding(False, "config", e) for e in exc.errors + data_errors], None
    out = [Finding(False, "config", e) for e in data_errors + cfg.missing_for_training()]
    if not out:
        out.append(Finding(True, "config", f"{path} is valid"))
    if dataset is not None:
        out.append(Finding(True, "data", dataset.summary()))
    return out, cfg


def check_versions(cfg: Any, plugins: Any) -> list[Finding]:
    """Installed versions against the pins of posttrain's own requirements (its package metadata)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    pins = {}
    for text in metadata.requires("posttrain") or []:
        req = Requirement(text)
        if req.name in TESTED:
            pins[req.name] = req
    needs_sglang = cfg is not None and getattr(cfg.rollout.engine.cls, "name", "") == "sglang"
    out = []
    for name in TESTED:
        req = pins.get(name)
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            optional = name == "sglang" and not needs_sglang
            out.append(Finding(optional, f"version {name}", "not installed" + (
                " (only the sglang engine backend needs it)" if optional else f"; needs {req.specifier if req else ''}"),
                note=optional))
            continue
        spec = req.specifier if req else None
        base = version.split("+")[0]
        good = spec is None or spec.contains(base, prereleases=True)
        out.append(Finding(good, f"version {name}", f"{version}" + (f" (tested: {spec})" if spec else "")))
    return out


def model_params(cfg: Any, plugins: Any, findings: list[Finding]) -> int | None:
    from posttrain.core.model_spec import count_params

    try:
        hf = cfg.model.create(plugins).hf_config()
        return count_params(hf)
    except Exception as exc:  # a missing checkpoint directory, an unknown preset
        findings.append(Finding(False, "model", f"cannot read the model's shape: {exc}"))
        return None


def check_placement(cfg: Any, plugins: Any, params: int | None) -> list[Finding]:
    """GPUs the placement needs (trainer first, engines after it unless colocated) and their memory;
    host memory when the trainer runs on the CPU, or holds the trainer's state while colocated engines generate
    (``resources.offload_trainer``). A colocated GPU needs both sides' weights even then: the trainer's state is back
    on it when the engine's weights return for each update; the offload makes room for the KV cache, which this
    floor leaves out."""
    import psutil
    import torch

    from posttrain.core.rollout.backend import gpu_shortfall, placement_gpus

    r = cfg.resources
    backend = cfg.rollout.engine.create(plugins)
    need, engine_gpus = placement_gpus(r, backend)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = []
    weights = params or 0
    if need == 0:
        out.append(Finding(True, "gpus", "none needed (trainer and engines on the CPU)"))
        free = psutil.virtual_memory().available
        want = weights * TRAIN_BYTES
        out.append(Finding(free >= want, "memory", f"{free / GIB:.1f} GiB free on the host; the trainer needs "
                                                   f"at least {want / GIB:.2f} GiB ({weights:,} parameters)"))
        return out
    short = gpu_shortfall(r, backend, have)
    if short is not None:
        out.append(Finding(False, "gpus", short.removeprefix("resources: ")))
        return out
    out.append(Finding(True, "gpus", f"{need} needed, {have} present"))
    per_trainer = weights * TRAIN_BYTES / max(1, r.trainer_gpus_per_node)
    per_engine = weights * 2 / max(1, r.gpus_per_engine)
    for gpu in range(need):
        free, _ = torch.cuda.mem_get_info(gpu)
        want = (per_trainer if gpu < r.trainer_gpus_per_node else 0) + (per_engine if gpu in engine_gpus else 0)
        out.append(Finding(free >= want, f"gpu {gpu} memory", f"{free / GIB:.1f} GiB free; needs at least "
                                                             f"{want / GIB:.1f} GiB"))
    if r.colocate and r.offload_trainer:  # this node's ranks' state, pinned (what the backend moves, no gradients)
        per_param = cfg.trainer.backend.create(plugins).offloaded_bytes_per_parameter(cfg)
        free, want = psutil.virtual_memory().available, weights * per_param / r.trainer_nodes
        out.append(Finding(free >= want, "host memory", f"{free / GIB:.1f} GiB free; the offloaded trainer state "
                                                        f"needs at least {want / GIB:.1f} GiB"))
    return out


def check_ports(cfg: Any, plugins: Any) -> list[Finding]:
    """Loopback ports for every engine, the router (and its metrics) and the weight group; external
    engines must answer ``/health``."""
    from posttrain.core.rollout.procs import free_port, http_ok

    backend = cfg.rollout.engine.create(plugins)
    fixed = backend.urls()
    if fixed is not None:
        return [Finding(http_ok(u + "/health"), "engine", f"{u} {'answers' if http_ok(u + '/health') else 'does not answer'} /health")
                for u in fixed]
    want = cfg.resources.num_engines + (2 if cfg.rollout.use_router else 0) + 1
    try:
        ports = {free_port() for _ in range(want)}
    except OSError as exc:
        return [Finding(False, "ports", f"cannot bind a loopback port: {exc}")]
    return [Finding(len(ports) == want, "ports", f"{len(ports)} free loopback ports found, {want} needed")]


def plugin_checks(cfg: Any, plugins: Any) -> list[Finding]:
    """What plugins check for this run (``posttrain_doctor_checks``: the code reward's OS sandbox, ...)."""
    return [f for found in plugins.pm.hook.posttrain_doctor_checks(run=cfg, plugins=plugins) for f in found or []]


def check_disk(cfg: Any, params: int | None, run_dir: Path) -> list[Finding]:
    """Free space where the run writes: two HF copies of the weights, and the kept checkpoints (plus the
    one being written)."""
    weights = params or 0
    dtype_bytes = 4 if getattr(cfg.model.config, "dtype", "bfloat16") == "float32" else 2
    want = 2 * weights * dtype_bytes
    if cfg.checkpoint.interval:
        want += (cfg.checkpoint.keep + 1) * weights * CKPT_BYTES
    where = run_dir.resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if not weights:  # the spec could not say the model's size: nothing to compare with
        return [Finding(True, "disk", f"{_size(free)} free at {where} (the model's size is unknown: checkpoints "
                                      "not sized)", note=True)]
    return [Finding(free >= want, "disk", f"{_size(free)} free at {where}; the run's model copies and checkpoints "
                                          f"need at least {_size(want)}")]


def _size(n: float) -> str:
    """Bytes as ``12.3 GiB``, ``45.6 MiB`` or ``7.8 KiB``: never ``0.00 GiB`` for a small model."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= 0.1 * scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"
