"""Options several commands share, so they are spelled and documented once."""

from __future__ import annotations

import typer

PluginFiles = typer.Option([], "--plugin", help="load a single-file plugin (repeatable)", show_default=False)
Disabled = typer.Option([], "-p", "--disable-plugin",
                        help="as in pytest: `-p no:NAME` does not load plugin NAME, `-p NAME` loads it (an entry "
                             "point, even with autoload off, or an importable module); --disable-plugin NAME "
                             "disables", show_default=False)


def split_specs(values: list[str]) -> tuple[list[str], list[str]]:
    """``(enabled, disabled)`` from ``-p`` values: ``no:NAME`` disables NAME, a bare NAME loads it.
    (``--disable-plugin NAME`` arrives as ``no:NAME``: see :func:`_argv_disable_plugin`.)"""
    enabled = [v for v in values if not v.startswith("no:")]
    return enabled, [v[3:] for v in values if v.startswith("no:")]


def disabled_names(values: list[str]) -> list[str]:
    """The names ``-p no:NAME`` / ``--disable-plugin NAME`` disable."""
    return split_specs(values)[1]


def load(plugin_files: list[str], specs: list[str]):
    from posttrain.core.plugins import load_plugins

    enabled, disabled = split_specs(specs)
    plugins = load_plugins(plugin_files=plugin_files, disabled=disabled, enabled=enabled)
    from rich.markup import escape

    from posttrain.cli.console import err_console

    for failure in plugins.failures:
        err_console.print(f"[yellow]warning:[/] {escape(str(failure))}", highlight=False, soft_wrap=True)
    return plugins


def _argv_disable_plugin(argv: list[str]) -> list[str]:
    """``--disable-plugin NAME`` (or ``=NAME``) rewritten as ``-p no:NAME``: both share one option list,
    where a bare ``-p NAME`` means *load*."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--disable-plugin" and i + 1 < len(argv):
            out += ["-p", "no:" + argv[i + 1].removeprefix("no:")]
            i += 2
            continue
        if arg.startswith("--disable-plugin="):
            arg = "-p=no:" + arg.split("=", 1)[1].removeprefix("no:")
            out += ["-p", arg[3:]]
        else:
            out.append(arg)
        i += 1
    return out
