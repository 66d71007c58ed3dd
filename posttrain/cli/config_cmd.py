"""``rl-cli config show [SECTION]``: every key of the run config with its type, default and help.

Generated from the dataclasses of :mod:`posttrain.core.config` (as ``rl-cli plugins show`` is from a
component's ``Config``), so it cannot drift from what ``load_config`` accepts. Component sections
(``estimator:``, ``rewards:``, ...) take the keys of the component they name: ``rl-cli plugins show NAME``.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field

import typer
from rich.table import Table

from posttrain.cli.console import console
from posttrain.cli.text import rich_text
from posttrain.core.errors import UsageError, unknown
from posttrain.core.registry import KINDS
from posttrain.core.schema import describe

app = typer.Typer(help="Show the run config's keys (type, default, help).", no_args_is_help=True)

TOP = "(top level)"


@dataclass
class Section:
    """One table of ``config show``: a dotted section name, its docstring summary, its rows."""

    name: str
    summary: str = ""
    rows: list[dict[str, str]] = field(default_factory=list)


def sections(cls: type | None = None, prefix: str = "") -> list[Section]:
    """Every section of ``cls`` (default: the whole ``RunConfig``), nested ones as ``a.b`` (``a.b[]`` for
    a list of them), in declaration order."""
    if cls is None:
        from posttrain.core.config import RunConfig

        cls = RunConfig
    hints = typing.get_type_hints(cls)
    here = Section(prefix or TOP, _summary(cls) if prefix else "")
    nested: list[Section] = []
    for row, f in zip(describe(cls), dataclasses.fields(cls)):
        tp = hints[f.name]
        item = _list_item(tp)
        kind = f.metadata.get("component")
        name = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(tp):
            nested += sections(tp, name)
        elif item is not None and dataclasses.is_dataclass(item):
            here.rows.append({**row, "type": f"list[{item.__name__}]", "default": row["default"],
                              "help": row["help"] + f" (keys: section {name}[])"})
            nested += sections(item, f"{name}[]")
        elif _optional_dataclass(tp) is not None:  # a section that may be left out (teacher:)
            here.rows.append({**row, "help": row["help"] + f" (keys: section {name})"})
            nested += sections(_optional_dataclass(tp), name)
        elif kind is not None:
            many = f.default_factory is list
            required = f.metadata.get("required", False)
            here.rows.append({"name": row["name"], "type": f"{'list of ' if many else ''}{KINDS[kind]} component",
                              "default": "(required)" if required else ("[]" if many else "None"),
                              "help": _component_help(f.metadata.get("help", ""), KINDS[kind])})
        else:
            here.rows.append(row)
    return ([here] if here.rows else []) + nested


def _component_help(text: str, kind: str) -> str:
    """A component key's help with where its choices and their keys are (once, if the help says it already)."""
    listing = f"`rl-cli plugins list --kind {kind}`"
    text = text.replace(f"; see {listing}", "").replace(f"see {listing}", "").rstrip("; ")
    return f"{text}; choices: {listing}, their keys: `rl-cli plugins show NAME`"


def _optional_dataclass(tp: typing.Any) -> typing.Any:
    """``X`` of an ``X | None`` annotation whose ``X`` is a dataclass, else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp) and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _list_item(tp: typing.Any) -> typing.Any:
    if typing.get_origin(tp) in (list, tuple) and typing.get_args(tp):
        return typing.get_args(tp)[0]
    return None


def _summary(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    # dataclasses without a docstring get a generated signature as __doc__: not worth showing
    return "" if not doc or doc.startswith(f"{cls.__name__}(") else doc.splitlines()[0]


@app.command()
def show(section: str = typer.Argument(None, help="only this section (data, rollout, trainer, eval, ...) and the "
                                                  "sections inside it", show_default=False)) -> None:
    """Every run-config key: type, default, help. Components' own keys: `rl-cli plugins show NAME`."""
    found = sections()
    if section is not None:
        section = section.strip(".")
        picked = [s for s in found if s.name == section or s.name.startswith((f"{section}.", f"{section}["))]
        top = next((s for s in found if s.name == TOP), Section(TOP))
        row = next((r for r in top.rows if r["name"] == section), None)
        if not picked and row is not None:  # a top-level key (seed) or a component section (estimator)
            picked = [Section(section, rows=[row])]
        if not picked:
            names = {s.name for s in found if s.name != TOP and "." not in s.name} | {r["name"] for r in top.rows}
            raise UsageError(unknown("config section", section, names))  # a section with its own rows: once
        found = picked
    for s in found:
        title = rich_text(f"{s.name}: {s.summary}" if s.summary else s.name)
        title.stylize("bold", 0, len(s.name))
        console.print(title)
        table = Table("KEY", "TYPE", "DEFAULT", "HELP", box=None, pad_edge=False)
        for r in s.rows:
            table.add_row(r["name"], rich_text(r["type"]), rich_text(r["default"]), rich_text(r["help"]))
        console.print(table)
        console.print()
