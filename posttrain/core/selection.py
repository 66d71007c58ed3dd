"""A run config's component sections: ``component(kind)`` declares a field that selects registered plugins of one
kind by name (``estimator: {name: grpo, epsilon: 1.0e-6}``, ``rewards: [{name: ..., weight: ...}]``), and a
:class:`Selection` holds what was chosen: the name, the plugin's validated ``Config`` and, for rewards, a weight."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from posttrain.core.registry import KINDS
from posttrain.core.schema import build, to_dict


@dataclass
class Selection:
    """A run config's choice of a component: its registered name, its validated ``Config`` and, for rewards,
    a weight."""

    kind: str
    name: str
    config: Any
    weight: float = 1.0
    cls: Any = field(default=None, repr=False, compare=False)  # the registered class (this process's)

    def create(self, plugins: Any = None) -> Any:
        """An instance built the one way every component is built: ``Cls(Cls.Config(...))``; a component
        that needs other registries (a generator's tools) gets the run's plugin set by ``bind(plugins)``."""
        cls = plugins.registry(self.kind)[self.name] if plugins is not None else self.cls
        obj = cls(self.config)
        if plugins is not None and callable(getattr(obj, "bind", None)):
            obj.bind(plugins)
        return obj

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, **(to_dict(self.config) or {})}
        if self.kind == "rewards":
            out["weight"] = self.weight
        return out


def component(kind: str, *, many: bool = False, optional: bool = False, default: bool = False,
              help: str = "") -> Any:
    """A run-config field that selects components of ``kind`` from the plugin registries. ``default``: a
    section left out (or given without ``name:``) selects the component registered with
    ``is_default = True`` (the built-in backends; core names none)."""

    def parse(value: Any, path: str, plugins: Any) -> tuple[Any, list[str]]:
        if value is None and (optional or many):
            return ([] if many else None), []
        if many:
            if not isinstance(value, list):
                return None, [f"{path}: expected a list of {{name: ...}} entries, got {type(value).__name__}"]
            out, errors = [], []
            for i, item in enumerate(value):
                c, e = _parse_one(kind, item, f"{path}.{i}", plugins, weighted=kind == "rewards", default=False)
                out.append(c)
                errors += e
            return out, errors
        return _parse_one(kind, value, path, plugins, weighted=False, default=default)

    meta = {"parse": parse, "help": help, "component": kind, "required": not (optional or many or default)}
    if default:
        meta["parse_default"] = {}
    return field(default_factory=list if many else (lambda: None), metadata=meta)


def _parse_one(kind: str, value: Any, path: str, plugins: Any, weighted: bool,
               default: bool) -> tuple[Any, list[str]]:
    if isinstance(value, str):
        value = {"name": value}
    if isinstance(value, dict) and "name" not in value and default:
        name = plugins.registry(kind).default_name()
        if name is None:
            return None, [f"{path}.name: required (no {KINDS[kind]} is registered as the default)"]
        value = {"name": name, **value}
    if not isinstance(value, dict) or "name" not in value:
        return None, [f"{path}: expected a {KINDS[kind]} name or a mapping with `name:`"]
    rest = dict(value)
    name = rest.pop("name")
    weight = rest.pop("weight", 1.0) if weighted else 1.0
    registry = plugins.registry(kind)
    if name not in registry:
        return None, [f"{path}.name: {registry.unknown_message(name)}"]
    errors = []
    if weighted and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                     or not math.isfinite(weight)):
        errors.append(f"{path}.weight: expected a finite number, got {weight!r}")
    cls = registry[name]
    config, errs = build(getattr(cls, "Config", None) or _Empty, rest, path)
    return (None if errors + errs else Selection(kind, name, config, float(weight), cls)), errors + errs


@dataclass
class _Empty:
    pass
