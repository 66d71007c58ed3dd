"""``rl-cli plugins``: what is installed, where it came from, what it takes, whether it keeps the contract."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import typer
from rich.table import Table

from posttrain.cli.console import console
from posttrain.cli.options import Disabled, PluginFiles, load
from posttrain.cli.text import plain, rich_text
from posttrain.core.errors import UsageError, unknown
from posttrain.core.registry import KINDS
from posttrain.core.schema import describe

app = typer.Typer(help="List, inspect and check plugins.", no_args_is_help=True)


def _rows(plugins, kind: str | None) -> list[dict[str, str]]:
    if kind is not None and kind not in KINDS.values() and kind not in KINDS:
        raise UsageError(unknown("plugin kind", kind, KINDS.values()))
    rows = []
    for plural, registry in plugins.registries().items():
        if kind and kind not in (plural, KINDS[plural]):
            continue
        for name in sorted(registry):
            info = registry.provider(name)
            rows.append({"kind": KINDS[plural], "name": name, "distribution": info.distribution if info else "",
                         "version": info.version if info else "", "module": info.module if info else "",
                         "summary": _summary(registry[name])})
    return rows


@app.command("list")
def list_(kind: str = typer.Option(None, "--kind", help="only this kind (estimator, reward, ...)"),
          as_json: bool = typer.Option(False, "--json", help="print JSON objects instead of a table"),
          plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """List every registered component with the distribution that provides it."""
    plugins = load(plugin, disable)
    rows = _rows(plugins, kind)
    if as_json:
        keys = ("kind", "name", "distribution", "version", "module", "summary")
        print(json.dumps([{k: r[k] for k in keys} for r in rows], indent=2))
        return
    table = Table("KIND", "NAME", "PROVIDED BY", "MODULE", "SUMMARY", box=None, pad_edge=False)
    for r in rows:
        by = f"{r['distribution']}=={r['version']}" if r["version"] else r["distribution"]
        table.add_row(r["kind"], r["name"], by, r["module"], rich_text(r["summary"]))
    console.print(table)


@app.command()
def show(name: str, plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """Show a component's docstring and its config fields (type, default, help)."""
    plugins = load(plugin, disable)
    found = [(plural, reg) for plural, reg in plugins.registries().items() if name in reg]
    if not found:
        from posttrain.cli.config_cmd import TOP, sections

        config_names = {s.name for s in sections()} | {r["name"] for s in sections() if s.name == TOP for r in s.rows}
        config_names |= {f"{s.name}.{r['name']}" for s in sections() for r in s.rows}
        if name in config_names or name in KINDS.values():  # a config section or key, or a kind: not a component
            what = f"`rl-cli plugins list --kind {name}`" if name in KINDS.values() else "`rl-cli plugins list`"
            raise UsageError(f"{name!r} is a run-config {'section' if '.' not in name else 'key'}, not a component: "
                             f"its keys are in `rl-cli config show {name.split('.')[0]}`; components: {what}")
        every = sorted({n for reg in plugins.registries().values() for n in reg})
        raise UsageError(unknown("component", name, every, " (see `rl-cli plugins list`)"))
    for plural, registry in found:
        component, info = registry[name], registry.provider(name)
        console.print(f"[bold]{name}[/]  ({KINDS[plural]}, from {info.provided_by if info else '?'}, "
                      f"{info.module if info else ''})", markup=True)
        console.print(rich_text(inspect.cleandoc(component.__doc__ or "(no docstring)")))
        fields = describe(getattr(component, "Config", None))
        table = Table("FIELD", "TYPE", "DEFAULT", "HELP", box=None, pad_edge=False, title_justify="left",
                      title="config" if fields else "config: (no options)")
        for f in fields:
            table.add_row(f["name"], rich_text(f["type"]), rich_text(f["default"]), rich_text(f["help"]))
        console.print(table)


@app.command()
def check(name: str, plugin: list[str] = PluginFiles, disable: list[str] = Disabled) -> None:
    """Run the contract tests of ``posttrain.testing`` on every component a plugin provides.

    NAME is a plugin (entry-point) name or a component name. Runs pytest in a fresh process, as a
    Ray worker would load the plugin. Exit code: pytest's.
    """
    plugins = load(plugin, disable)
    targets = [(plural, comp) for plural, reg in plugins.registries().items() for comp in reg
               if comp == name or (reg.provider(comp) and reg.provider(comp).name == name)]
    if not targets:
        raise UsageError(f"no plugin or component named {name!r} (see `rl-cli plugins list`)")
    from posttrain.testing import CONTRACTS

    lines = ["import pytest", "from posttrain.core.plugins import load_plugins", "import posttrain.testing as T",
             f"PLUGINS = load_plugins(plugin_files={[str(Path(p).resolve()) for p in plugin]!r})"]
    for plural, comp in targets:
        if plural not in CONTRACTS:
            console.print(f"{KINDS[plural]} {comp!r}: no contract suite for this kind yet; skipped")
            continue
        contract, fixture = CONTRACTS[plural]
        lines.append(textwrap.dedent(f"""
            class Test_{plural}_{_ident(comp)}(T.{contract}):
                @pytest.fixture
                def {fixture}(self):
                    cls = PLUGINS.{plural}[{comp!r}]
                    obj = cls(cls.Config())
                    if callable(getattr(obj, "bind", None)):  # built as a run builds it
                        obj.bind(PLUGINS)
                    return obj
            """))
    with tempfile.TemporaryDirectory() as tmp:
        test_file = Path(tmp) / "test_contract_check.py"
        test_file.write_text("\n".join(lines))
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                             cwd=tmp)
    raise typer.Exit(rc)


def _summary(component) -> str:
    doc = inspect.getdoc(component) or ""
    return plain(doc.strip().splitlines()[0]) if doc.strip() else ""


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)
