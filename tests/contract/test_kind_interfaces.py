"""Every registered built-in satisfies its kind's typed interface (``posttrain.api.INTERFACES``), and every
registration hook names that type: a new kind, or a built-in that drifts from its kind's interface, fails here."""

import inspect

import pytest

from posttrain.api import INTERFACES
from posttrain.core import hookspecs
from posttrain.core.plugins import load_plugins
from posttrain.core.registry import KINDS

PLUGINS = load_plugins(autoload=False)
BUILT_INS = [(kind, name) for kind in KINDS for name, _ in sorted(PLUGINS.registry(kind).items())
             if PLUGINS.registry(kind).provider(name).distribution == "posttrain"]


def test_every_kind_has_an_interface_and_its_hook_names_it():
    assert set(INTERFACES) == set(KINDS)
    for kind, interface in INTERFACES.items():
        doc = inspect.getdoc(getattr(hookspecs, f"posttrain_register_{kind}")) or ""
        assert f"posttrain.api.{interface.__name__}" in doc, f"posttrain_register_{kind} must name its type"


def test_every_kind_has_a_built_in():
    assert {kind for kind, _ in BUILT_INS} == set(KINDS)


@pytest.mark.parametrize("kind,name", BUILT_INS, ids=[f"{k}:{n}" for k, n in BUILT_INS])
def test_built_in_satisfies_its_kind(kind, name):
    cls, interface = PLUGINS.registry(kind)[name], INTERFACES[kind]
    if getattr(interface, "_is_protocol", False):  # a call contract: checked on an instance built as a run builds it
        assert isinstance(cls(cls.Config()), interface), f"{kind} {name!r} does not implement {interface.__name__}"
    else:
        assert issubclass(cls, interface), f"{kind} {name!r} must subclass posttrain.api.{interface.__name__}"
    assert isinstance(cls.name, str) and cls.name == name
