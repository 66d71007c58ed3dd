"""``rl-cli run CONFIG [key=value ...]``: validate the config, then run the loop."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from posttrain.cli.console import console
from posttrain.cli.options import Disabled, PluginFiles, load
from posttrain.core.config import load_config


def run(config: Path = typer.Argument(..., help="run config (YAML)", show_default=False),
        overrides: list[str] = typer.Argument(None, help="dotted overrides: estimator.epsilon=1e-4",
                                              show_default=False),
        dry_run: bool = typer.Option(False, "--dry-run", help="validate and print the resolved config, run nothing"),
        run_dir: Path = typer.Option(None, "--run-dir", help="where the run writes (default runs/<name>-<time>)"),
        plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """Validate CONFIG (every error at once), then train."""
    plugins = load(plugin, disable)
    from posttrain.core.data import inspect_config_data
    from posttrain.core.errors import ConfigError

    dataset, data_errors = inspect_config_data(config, overrides or []) if dry_run else (None, [])
    try:
        cfg = load_config(config, overrides or [], plugins)
    except ConfigError as exc:
        raise ConfigError(exc.errors + data_errors, exc.source) from None
    if data_errors:
        raise ConfigError(data_errors, str(config))
    console.print(plugins.header())
    if dry_run:
        console.print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(), markup=False)
        if dataset is not None:
            console.print(f"[green]data OK[/]: {dataset.summary()}", highlight=False)
        console.print(f"[green]config OK[/]: {config}")
        return
    from posttrain.core.errors import UsageError

    raise UsageError("training runs arrive with the loop (issue 7); use --dry-run to validate a config")
