"""Options several commands share, so they are spelled and documented once."""

from __future__ import annotations

import typer

PluginFiles = typer.Option([], "--plugin", help="load a single-file plugin (repeatable)", show_default=False)
Disabled = typer.Option([], "-p", "--disable-plugin", help="do not load plugin NAME (also `-p no:NAME`)",
                        show_default=False)


def disabled_names(values: list[str]) -> list[str]:
    """``-p no:NAME`` and ``-p NAME`` both disable NAME, as in pytest."""
    return [v[3:] if v.startswith("no:") else v for v in values]


def load(plugin_files: list[str], disabled: list[str]):
    from posttrain.core.plugins import load_plugins

    plugins = load_plugins(plugin_files=plugin_files, disabled=disabled_names(disabled))
    from rich.markup import escape

    from posttrain.cli.console import err_console

    for failure in plugins.failures:
        err_console.print(f"[yellow]warning:[/] {escape(str(failure))}", highlight=False, soft_wrap=True)
    return plugins
