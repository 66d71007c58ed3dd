"""MkDocs hook: the generated parts of the site, from the code itself (never written by hand).

A page holds a marker on a line of its own and this hook replaces it when the site is built:

- ``<!-- generated: config -->``: every run-config key (type, default, help) from the dataclasses of
  ``posttrain/core/config.py``, the same rows as ``rl-cli config show`` (``posttrain.cli.config_cmd.sections``);
- ``<!-- generated: components -->``: every built-in component by kind, its docstring and the keys of its
  ``Config`` (the rows of ``rl-cli plugins show NAME``);
- ``<!-- generated: cli -->``: every ``rl-cli`` command with its arguments and options (from the Typer app);
- ``<!-- generated: include PATH -->``: a file of the repository (``bench/README.md``), with links into the
  repository made absolute to it on GitHub-less builds (plain text paths).

The hook reference is mkdocstrings' rendering of ``posttrain/core/hookspecs.py`` (``::: posttrain.core.hookspecs``).
"""

from __future__ import annotations

import html
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- generated: (\w+)(?: (\S+))? -->$", re.M)
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_CODE = re.compile(r"``(.+?)``")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs' signature)
    return MARKER.sub(lambda m: GENERATORS[m[1]](m[2]), markdown)


def cell(text: str) -> str:
    """A table cell from a help or type string: reST inline code as ``<code>``, the rest HTML-escaped
    (``<name>``, ``|`` and ``[low, high]`` stay text)."""
    text = _ROLE.sub(lambda m: f"``{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}``", text or "")
    out, pos = [], 0
    for m in _CODE.finditer(text):
        out.append(html.escape(text[pos:m.start()]))
        out.append(f"<code>{html.escape(m[1])}</code>")
        pos = m.end()
    out.append(html.escape(text[pos:]))
    return "".join(out).replace("|", "&#124;").replace("\n", " ")


def table(rows: list[dict[str, str]]) -> str:
    lines = ["| key | type | default | help |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| <code>{html.escape(r['name'])}</code> | <code>{cell(r['type'])}</code> | "
                     f"<code>{cell(r['default'])}</code> | {cell(r['help'])} |")
    return "\n".join(lines)


def config_reference(_arg: str | None) -> str:
    from posttrain.cli.config_cmd import TOP, sections

    parts = []
    for s in sections():
        title = "Top-level keys" if s.name == TOP else f"`{s.name}`"
        parts.append(f"## {title}\n\n{cell(s.summary)}\n\n{table(s.rows)}\n")
    return "\n".join(parts)


def docstring_markdown(doc: str) -> str:
    """A component docstring (reST-ish) as Markdown: roles become code, a paragraph's closing ``::`` a
    colon before its indented (code) block; outside code, ``<name>`` is escaped so it stays text."""
    doc = _ROLE.sub(lambda m: f"``{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}``", doc)
    out: list[str] = []
    for line in doc.splitlines():
        if line.rstrip().endswith("::"):
            line = line.rstrip()[:-1]
        if not line.startswith("    "):  # indented lines are code blocks: shown as written
            pieces = re.split(r"(`+[^`]*`+)", line)
            line = "".join(p if p.startswith("`") else re.sub(r"<(?=[A-Za-z/])", "&lt;", p) for p in pieces)
        out.append(line)
    return "\n".join(out)


def components_reference(_arg: str | None) -> str:
    from posttrain.core.plugins import load_plugins
    from posttrain.core.registry import KINDS
    from posttrain.core.schema import describe

    plugins = load_plugins(autoload=False)  # posttrain's own, whatever else is installed
    parts = []
    for plural, registry in plugins.registries().items():
        names = sorted(n for n in registry if registry.provider(n) and registry.provider(n).distribution == "posttrain")
        if not names:
            continue
        parts.append(f"## {KINDS[plural].capitalize()}s\n")
        for name in names:
            component = registry[name]
            doc = inspect.getdoc(component) or ""
            parts.append(f"### `{name}`\n\n{docstring_markdown(doc)}\n")
            config = getattr(component, "Config", None)
            rows = describe(config) if isinstance(config, type) else []
            parts.append(f"{table(rows)}\n" if rows else "No keys.\n")
    return "\n".join(parts)


def include(path: str | None) -> str:
    text = (ROOT / str(path)).read_text()
    # links relative to the included file would not resolve inside the site: keep their text only
    return re.sub(r"\[([^\]]+)\]\((?!https?://|#)[^)]+\)", r"`\1`", text)


def cli_reference(_arg: str | None) -> str:
    """Every ``rl-cli`` command, posttrain's own plugins' (``rl-cli engine serve``) included: usage, help,
    arguments and options."""
    import copy

    import typer

    from posttrain.cli.main import app as base
    from posttrain.core.plugins import load_plugins

    app = copy.copy(base)  # commands of plugins are added to a copy: the CLI's own app stays as it is
    app.registered_groups = list(base.registered_groups)
    app.registered_commands = list(base.registered_commands)
    load_plugins(autoload=False).pm.hook.posttrain_register_commands(app=app)

    # duck-typed: Typer ships its own copy of click (typer._click) since 0.2x

    root = typer.main.get_command(app)
    parts: list[str] = []

    def walk(command, path: list[str]) -> None:
        if hasattr(command, "commands"):
            for name in sorted(command.commands):
                walk(command.commands[name], [*path, name])
            return
        ctx = command.context_class(command, info_name=" ".join(path))
        usage = " ".join(command.collect_usage_pieces(ctx))
        parts.append(f"## `{' '.join(path)}`\n\n```\n{' '.join(path)} {usage}\n```\n\n"
                     f"{docstring_markdown(inspect.cleandoc(command.help or ''))}\n")
        rows = []
        for param in command.params:
            if getattr(param, "hidden", False) or param.name == "help":
                continue
            names = ", ".join(param.opts) if param.param_type_name == "option" else param.name.upper()
            rows.append(f"| <code>{html.escape(names)}</code> | {cell(getattr(param, 'help', '') or '')} |")
        if rows:
            parts.append("| argument / option | help |\n|---|---|\n" + "\n".join(rows) + "\n")

    walk(root, ["rl-cli"])
    return "\n".join(parts)


GENERATORS = {"config": config_reference, "components": components_reference, "include": include,
              "cli": cli_reference}
