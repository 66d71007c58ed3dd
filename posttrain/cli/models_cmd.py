"""``rl-cli models``: model-spec families and presets, checkpoint conversion, conversion verification, and
the export of a run's checkpoint as an HF checkpoint (``rl-cli models export RUN_DIR [--step N] OUT``).

``--tp N`` / ``--ep M`` (more than one rank) re-launch the command under ``torchrun --nproc_per_node N*M``
(gloo on CPU, NCCL on GPUs; the M data-parallel replicas hold M expert shards); rank 0 reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import typer
from rich.table import Table

from posttrain.cli.console import console
from posttrain.cli.options import Disabled, PluginFiles, load
from posttrain.core.errors import UsageError, unknown

# Megatron announces on import that Apex / Transformer Engine are absent: noise for a CLI user.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|transformer_engine|full scope is deprecated).*")

app = typer.Typer(help="Model specs: list families and presets, convert and verify checkpoints, export a run's.",
                  no_args_is_help=True)

SpecOption = typer.Option(None, "--spec", help="model spec name (default: chosen by config.json's model_type)")
TPOption = typer.Option(1, "--tp", min=1, help="tensor-parallel size (N > 1 runs N processes)")
EPOption = typer.Option(1, "--ep", min=1, help="expert-parallel size of MoE specs (runs tp*ep processes)")
PPOption = typer.Option(1, "--pp", min=1, help="pipeline-parallel size (runs tp*ep*pp processes)")


def _spec(plugins, name: str | None, hf_dir: str | None, dtype: str, path: str | None = None):
    from posttrain.core.model_spec import read_hf_config, spec_for_model_type

    if dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(unknown("--dtype", dtype, ["float32", "bfloat16", "float16"]))
    registry = plugins.registry("model")
    if name is not None:
        if name not in registry:
            raise UsageError(unknown("model spec", name, list(registry), " (see `rl-cli models list`)"))
        cls = registry[name]
    else:
        hf = read_hf_config(hf_dir)
        if "model_type" not in hf:
            raise UsageError(f"{hf_dir}/config.json: no `model_type`; pass --spec")
        cls = spec_for_model_type(registry, hf["model_type"])
    return cls(cls.Config(path=path, dtype=dtype))


def _relaunch(ranks: int, result_file: str) -> int:
    """Run this very command under torchrun with ``ranks`` processes; rank 0 writes ``result_file``."""
    argv = [a for a in sys.argv[1:]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(_free_port()), "-m", "posttrain.cli.main", *argv, "--result-file", result_file]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:  # a rank's one-line user error is the useful part of torchrun's report
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        if errors:
            raise UsageError(errors[0].removeprefix("error:").strip())
    return proc.returncode


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
          plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """Model-spec families (with the HF model_type each accepts) and their preset shapes (MoE: FFN is
    experts x width / experts per token, PARAMS total / active per token)."""
    from posttrain.core.model_spec import presets_table

    plugins = load(plugin, disable)
    registry = plugins.registry("model")
    specs = [registry[n] for n in sorted(registry)]
    rows = presets_table(specs)
    for r in rows:
        r["model_types"] = ",".join(registry[r["family"]].model_types)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table("FAMILY", "HF MODEL_TYPE", "PRESET", "LAYERS", "HIDDEN", "HEADS/KV", "FFN", "VOCAB", "PARAMS",
                  box=None, pad_edge=False)
    for r in rows:  # MoE: FFN is experts x width / top-k, PARAMS total / active
        ffn = r["experts"].replace(" top-", "/") if r["experts"] else str(r["ffn"])
        params = _human(r["params"]) + (f"/{_human(r['active_params'])}" if r["experts"] else "")
        table.add_row(r["family"], r["model_types"], r["preset"], str(r["layers"]), str(r["hidden"]),
                      f"{r['heads']}/{r['kv_heads']}", ffn, str(r["vocab"]), params)
    from rich.console import Console
    from rich.measure import Measurement

    # rich gives a pipe 80 columns: print the table at its natural width rather than cut names and sizes
    natural = Measurement.get(console, console.options.update(max_width=1000), table).maximum
    Console(highlight=False, width=max(console.width, natural)).print(table)


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


@app.command()
def verify(hf_dir: str = typer.Argument(..., help="HF checkpoint directory"), tp: int = TPOption,
           ep: int = EPOption, pp: int = PPOption, spec: str = SpecOption, tolerance: float = typer.Option(1e-4, "--tolerance", help="max |logit diff|"),
           dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16"),
           attention: str = typer.Option("auto", "--attention", help="core attention: auto | sdpa | local | te"),
           seq_len: int = typer.Option(16, "--seq-len", min=2),
           result_file: str = typer.Option(None, "--result-file", hidden=True),
           plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """Load HF_DIR into Megatron, compare logits with transformers on the same tokens: PASS or FAIL (exit 1)."""
    if not Path(hf_dir, "config.json").is_file():
        raise UsageError(f"{hf_dir}: not an HF checkpoint directory (no config.json)")
    if tp * ep * pp > 1 and not _in_torchrun():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            rc = _relaunch(tp * ep * pp, str(out))
            if not out.is_file():
                raise UsageError(f"verify under torchrun (tp={tp} ep={ep} pp={pp}) failed with exit code {rc}; run "
                                 f"it with `torchrun --nproc_per_node {tp * ep * pp} -m posttrain.cli.main ...` to see why")
            _report(json.loads(out.read_text()), tp, ep, pp)
        return
    plugins = load(plugin, disable)
    model_spec = _spec(plugins, spec, hf_dir, dtype, path=hf_dir)
    if ep > 1 and not hasattr(model_spec, "num_experts"):
        raise UsageError(f"--ep {ep}: spec {model_spec.name!r} has no experts")
    result = _backend(plugins).verify_hf(model_spec, hf_dir, tp=tp, ep=ep, pp=pp, tolerance=tolerance,
                                         seq_len=seq_len, attention=attention)
    if result is None:  # not the reporting rank
        return
    result["spec"] = model_spec.name
    if result_file:
        Path(result_file).write_text(json.dumps(result))
        return
    _report(result, tp, ep, pp)


def _backend(plugins, name: str | None = None):
    """The trainer backend ``name`` (default: the default one, ``is_default``), built with its defaults: what
    converts and verifies checkpoints for ``models verify`` and ``models convert``."""
    registry = plugins.registry("trainer")
    name = name or registry.default_name()
    if name is None:
        raise UsageError(f"no default trainer backend among {sorted(registry)}")
    cls = registry.get_or_raise(name)
    return cls(cls.Config())


def _report(result: dict, tp: int, ep: int = 1, pp: int = 1) -> None:
    verdict = "[bold green]PASS[/]" if result["passed"] else "[bold red]FAIL[/]"
    console.print(f"spec {result['spec']}  tp={tp}{f'  ep={ep}' if ep > 1 else ''}{f'  pp={pp}' if pp > 1 else ''}  max |logit diff| = {result['max_abs_diff']:.3e}  "
                  f"(tolerance {result['tolerance']:.0e})  HF->Megatron->HF: "
                  f"{'exact' if result['round_trip_exact'] else 'MISMATCH ' + ', '.join(result['round_trip_mismatches'][:3])}"
                  f"  {verdict}")
    if not result["passed"]:
        raise typer.Exit(1)


@app.command()
def convert(src: str = typer.Argument(..., help="HF directory (--to megatron) or Megatron directory (--to hf)"),
            out: str = typer.Argument(..., help="output directory"),
            to: str = typer.Option(..., "--to", help="a trainer backend's format (megatron) | hf"), tp: int = TPOption,
            spec: str = SpecOption, dtype: str = typer.Option(None, "--dtype", help="parameter dtype (default: the checkpoint's)"),
            result_file: str = typer.Option(None, "--result-file", hidden=True),
            plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """Convert HF safetensors to a trainer backend's checkpoint (megatron: a torch_dist dist-checkpoint) or back."""
    plugins = load(plugin, disable)
    trainers = plugins.registry("trainer")
    if to != "hf" and to not in trainers:
        raise UsageError(unknown("--to target", to, [*trainers, "hf"]))
    if not Path(src).is_dir():
        raise UsageError(f"{src}: no such directory")
    if tp > 1 and not _in_torchrun():
        with tempfile.TemporaryDirectory() as tmp:
            rc = _relaunch(tp, str(Path(tmp) / "result.json"))
            if rc:
                raise UsageError(f"convert under torchrun (tp={tp}) failed with exit code {rc}")
        console.print(f"wrote {out}")
        return
    from posttrain.core.model_spec import read_hf_config

    backend = _backend(plugins, None if to == "hf" else to)
    if to != "hf":
        hf = read_hf_config(src)
        model_spec = _spec(plugins, spec, src, dtype or _dtype_of(hf), path=src)
        report = backend.checkpoint_from_hf(model_spec, src, out, tp=tp)
    else:
        meta = backend.checkpoint_meta(src)
        model_spec = _spec(plugins, spec or meta["spec"], None, dtype or meta["dtype"])
        report = backend.checkpoint_to_hf(model_spec, src, out, meta["hf_config"], tp=tp)
    if report and not result_file:
        console.print(f"wrote {out} ({model_spec.name}, {backend.name + ' checkpoint' if to != 'hf' else 'HF safetensors'})")


def _dtype_of(hf: dict) -> str:
    value = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    return value if value in ("float32", "bfloat16", "float16") else "float32"


@app.command()
def export(run_dir: Path = typer.Argument(..., help="a run directory (rl-cli run's)", show_default=False),
           out: Path = typer.Argument(..., help="the HF directory to write", show_default=False),
           step: int = typer.Option(None, "--step", min=1, show_default=False,
                                    help="the checkpoint written after this many steps (default: the latest)"),
           plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """The policy of one of a run's checkpoints as an HF checkpoint (config.json, safetensors, tokenizer):
    what ``transformers`` loads, ``rl-cli engine serve`` serves and a next run takes as ``model.path``.

    The trainer is built from the run's ``config.yaml`` as the run built it (its ranks too, in processes
    of this machine), loads the checkpoint and writes what a finished run writes to ``RUN_DIR/hf-final``.
    """
    from posttrain.core.config import load_config
    from posttrain.core.executors import EXECUTORS
    from posttrain.core.run_dir import RunDirectory

    plugins = load(plugin, disable)
    run = RunDirectory(run_dir)
    ckpt = run.checkpoint_after(step)
    if not (run.path / "config.yaml").is_file():
        raise UsageError(f"{run.path}: no config.yaml there (not a run directory of rl-cli run)")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out}: exists and is not empty; give a new directory")
    cfg = load_config(None, data=run.read_config(), plugins=plugins)
    executor = EXECUTORS["local"](cfg, **plugins.load_args)
    try:
        with tempfile.TemporaryDirectory() as logs:
            trainer = executor.trainer(logs)
            try:
                trainer.load(str(ckpt / "trainer"))
                trainer.save_hf(str(out))
            finally:
                trainer.close()
    finally:
        executor.close()
    console.print(f"wrote {out} (HF checkpoint of {ckpt}, {run.checkpoint_step(ckpt)} steps)", soft_wrap=True,
                  markup=False)
