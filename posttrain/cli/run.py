"""``rl-cli run CONFIG [key=value ...]``: validate the config (every error at once), then train.

``--resume RUN_DIR`` continues a run from its latest checkpoint with the config it was started with
(overrides still apply). ``--smoke`` runs two steps: a quick check that every part starts and connects.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
import yaml

from posttrain.cli.console import console
from posttrain.cli.options import Disabled, PluginFiles, load
from posttrain.core.config import load_config


def run(config: Path = typer.Argument(None, help="run config (YAML); optional with --resume", show_default=False),
        overrides: list[str] = typer.Argument(None, help="dotted overrides: estimator.epsilon=1e-4",
                                              show_default=False),
        dry_run: bool = typer.Option(False, "--dry-run", help="validate and print the resolved config, run nothing"),
        run_dir: Path = typer.Option(None, "--run-dir", help="where the run writes (default runs/<name>-<time>)"),
        resume: Path = typer.Option(None, "--resume", help="continue the run in this directory", show_default=False),
        smoke: bool = typer.Option(False, "--smoke", help="two steps only, to check that everything connects"),
        plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """Validate CONFIG (every error at once), then train."""
    from posttrain.core.data import inspect_config_data
    from posttrain.core.errors import ConfigError, UsageError
    from posttrain.core.run_dir import RunDirectory

    plugins = load(plugin, disable)
    overrides = list(overrides or [])
    if config is None and resume is None:
        raise UsageError("give a CONFIG to run, or --resume RUN_DIR")
    if resume is not None:
        run = RunDirectory(resume)
        cfg = load_config(None, overrides, plugins, data=run.read_config())
        if smoke:  # two steps, in the mode's own terms
            cfg = load_config(None, overrides + list(cfg.mode.cls.smoke_overrides), plugins, data=run.read_config())
        run.base_dir = Path(config).parent if config else Path(".")
    else:
        dataset, data_errors = inspect_config_data(config, overrides, plugins=plugins) if dry_run else (None, [])
        try:
            cfg = load_config(config, overrides, plugins)
            if smoke:
                cfg = load_config(config, overrides + list(cfg.mode.cls.smoke_overrides), plugins)
        except ConfigError as exc:
            raise ConfigError(exc.errors + data_errors, exc.source) from None
        summary = dataset.summary() if dataset is not None else None
        if dry_run and not cfg.mode.cls.generates:  # a mode that reads its data its own way checks it so
            summary, data_errors = cfg.mode.create(plugins).inspect_data(cfg)
        if data_errors:
            raise ConfigError(data_errors, str(config))
    missing = cfg.missing_for_training()
    if missing and not dry_run:
        raise ConfigError(missing, str(config or resume))
    console.print(plugins.header())
    if dry_run:
        console.print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(), markup=False)
        if summary is not None:
            console.print(f"[green]data OK[/]: {summary}", highlight=False)
        console.print(f"[green]config OK[/]: {config}")
        for line in missing:
            console.print(f"[yellow]note[/]: {line}", highlight=False)
        return
    if resume is None:
        run = RunDirectory.create(run_dir, config.stem)
        run.base_dir = config.parent
        run.write_config(cfg.to_dict(), plugins)

    from posttrain.cli.live import LiveDisplay

    mode = cfg.mode.create(plugins)
    console.print(f"run directory: {run.path}")
    with LiveDisplay(mode.total_steps(cfg), console, columns=mode.columns) as display:
        asyncio.run(mode.run(cfg, plugins, run, resume=resume is not None, on_step=display.update))
    from posttrain.cli.plot_cmd import write_curves
    from posttrain.core.metrics import read_metrics

    rows = read_metrics(run.path)
    if rows:
        write_curves(rows, run.path / "curves.png", title=run.path.name)
        console.print(f"done: {len(rows)} steps; curves: {run.path / 'curves.png'}; "
                      f"metrics: {run.path / 'metrics.jsonl'}")
