"""Rules the code base keeps: documented hooks, registered built-ins, no plugin names in the core."""

import ast
import inspect
import tomllib

from posttrain.core import hookspecs
from posttrain.core.plugins import load_plugins
from tests.conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_hook_is_documented_like_pytest():
    hooks = [getattr(hookspecs, n) for n in dir(hookspecs) if n.startswith("posttrain_")]
    assert len(hooks) >= 9
    for hook in hooks:
        doc = inspect.getdoc(hook) or ""
        assert ":param" in doc and "Fires" in doc, f"{hook.__name__} must document its arguments and when it fires"


def test_every_builtin_plugin_module_is_an_entry_point():
    declared = set(PYPROJECT["project"]["entry-points"]["posttrain"].values())
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts)
               for p in (ROOT / "posttrain" / "plugins").rglob("*.py") if not p.name.startswith("_")}
    assert modules == declared, f"not registered: {modules - declared}; missing files: {declared - modules}"


# strings that are plugin names but also protocol words the core must use, with why
PROTOCOL_WORDS = {"length": "SGLang's finish_reason type when max_new_tokens is hit"}


def test_no_plugin_name_appears_in_core():
    plugins = load_plugins(autoload=False)
    names = {n for reg in plugins.registries().values() for n in reg} - set(PROTOCOL_WORDS)
    offenders = []
    for path in (ROOT / "posttrain" / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, "the core dispatches through registries, never by plugin name:\n" + "\n".join(offenders)
