"""Typed configs as plain dataclasses, validated with every error collected.

Every component (estimator, loss, reward, generator, model spec, ...) carries a nested ``Config``
dataclass; the run config is a tree of such dataclasses. ``build(cls, mapping, where)`` turns a YAML
mapping into an instance and returns *all* problems at once, each prefixed with its dotted path::

    @dataclass
    class Config:
        epsilon: float = option(1e-6, gt=0, help="added to the group std before dividing")
        mode: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"

        def validate(self) -> list[str]:      # optional cross-field checks: "key: message"
            return []

Types understood: bool, int, float (ints and numeric strings such as ``"1e-6"`` accepted; NaN and
infinities never), str,
``Literal[...]``, ``X | None``, ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``, nested dataclasses, Any.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from posttrain.core.errors import did_you_mean

_NO = dataclasses.MISSING


def option(default: Any = _NO, *, default_factory: Any = _NO, help: str = "", ge: float | None = None,
           gt: float | None = None, le: float | None = None, lt: float | None = None) -> Any:
    """A dataclass field with a help text and numeric bounds (checked by :func:`build`)."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if default_factory is not _NO:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def build(cls: type, data: Any, where: str, context: Any = None) -> tuple[Any, list[str]]:
    """Instantiate dataclass ``cls`` from ``data``; return ``(instance or None, errors)``.

    A field whose metadata has ``parse`` is converted by ``parse(value, path, context)`` returning
    ``(value, errors)`` instead of by its annotation (the run config resolves components this way).
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        return None, [f"{where}: expected a mapping of {_names(cls)}, got {type(data).__name__}"]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    errors: list[str] = []
    for key in data:
        if key not in fields:
            errors.append(f"{_join(where, key)}: unknown key.{did_you_mean(key, fields)} Valid keys: {_names(cls)}")
    kwargs = {}
    for name, f in fields.items():
        path = _join(where, name)
        parse = f.metadata.get("parse")
        if name not in data:
            if parse and "parse_default" in f.metadata:  # e.g. a component section with a default name
                value, errs = parse(f.metadata["parse_default"], path, context)
                errors += errs
                if not errs:
                    kwargs[name] = value
            elif f.metadata.get("required") or (f.default is _NO and f.default_factory is _NO):
                errors.append(f"{path}: required key is missing")
            elif dataclasses.is_dataclass(hints[name]) and not parse:  # a section left out: built from {},
                value, errs = build(hints[name], {}, path, context)   # so its own defaulted components resolve
                errors += errs
                if not errs:
                    kwargs[name] = value
            continue
        value, errs = parse(data[name], path, context) if parse else coerce(data[name], hints[name], path, context)
        errs = errs or _bounds(value, f.metadata, path)
        errors += errs
        if not errs:
            kwargs[name] = value
    if errors:
        return None, errors
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        return None, [f"{where or cls.__name__}: {exc}"]
    check = getattr(obj, "validate", None)
    if callable(check):
        errors += [_join(where, e) for e in (check() or [])]
    return (None if errors else obj), errors


def coerce(value: Any, tp: Any, path: str, context: Any = None) -> tuple[Any, list[str]]:
    """Check ``value`` against annotation ``tp``; return ``(converted value, errors)``. ``context`` reaches
    the ``parse`` functions of nested dataclasses (component sections inside ``rollout``, ``trainer``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return value, []
    if origin in (Union, types.UnionType):
        return _coerce_union(value, args, path, context)
    if origin is Literal:
        if value in args:
            return value, []
        return None, [f"{path}: {value!r} is not one of {', '.join(repr(a) for a in args)}"
                      f".{did_you_mean(value, [str(a) for a in args])}"]
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, context)
    if origin in (list, tuple) or tp in (list, tuple):
        return _coerce_sequence(value, args[0] if args else Any, (origin or tp) is tuple, path)
    if origin is dict or tp is dict:
        return _coerce_mapping(value, args[1] if len(args) == 2 else Any, path)
    if tp is float:
        return _coerce_float(value, path)
    return _coerce_scalar(value, tp, path)


def _coerce_union(value: Any, args: tuple, path: str, context: Any) -> tuple[Any, list[str]]:
    """The first member of the union that takes ``value``; else the first member's errors, or for a string a
    ``Literal`` member's (``int | Literal["auto"]`` given ``"autp"``: not one of 'auto', did you mean)."""
    if value is None and type(None) in args:
        return None, []
    first: list[str] = []
    for arg in (a for a in args if a is not type(None)):
        out, errs = coerce(value, arg, path, context)
        if not errs:
            return out, []
        if isinstance(value, str) and typing.get_origin(arg) is Literal:
            return None, errs
        first = first or errs
    return None, first


def _coerce_sequence(value: Any, item: Any, as_tuple: bool, path: str) -> tuple[Any, list[str]]:
    if not isinstance(value, (list, tuple)):
        return None, [f"{path}: expected a list, got {_kind(value)}"]
    out, errors = [], []
    for i, v in enumerate(value):
        o, e = coerce(v, item, f"{path}.{i}")
        out.append(o)
        errors += e
    return (tuple(out) if as_tuple else out), errors


def _coerce_mapping(value: Any, item: Any, path: str) -> tuple[Any, list[str]]:
    if not isinstance(value, Mapping):
        return None, [f"{path}: expected a mapping, got {_kind(value)}"]
    out, errors = {}, []
    for k, v in value.items():
        out[k], e = coerce(v, item, f"{path}.{k}")
        errors += e
    return out, errors


def _coerce_float(value: Any, path: str) -> tuple[Any, list[str]]:
    """A finite float from a number or a numeric string (YAML reads ``1e-6``, without a dot, as a string)."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        return None, [f"{path}: expected a number, got {_kind(value)}"]
    if not math.isfinite(number):  # .nan, .inf, or 1e400 (a string that overflows to inf)
        return None, [f"{path}: expected a finite number, got {value!r}"]
    return number, []


def _coerce_scalar(value: Any, tp: Any, path: str) -> tuple[Any, list[str]]:
    """bool, int (not a bool), str, or any other class by ``isinstance``; other annotations pass unchecked."""
    if tp is bool:
        return (value, []) if isinstance(value, bool) else (None, [f"{path}: expected true or false, got {_kind(value)}"])
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, []
        return None, [f"{path}: expected an integer, got {_kind(value)}"]
    if tp is str:
        return (value, []) if isinstance(value, str) else (None, [f"{path}: expected a string, got {_kind(value)}"])
    if isinstance(tp, type):
        return (value, []) if isinstance(value, tp) else (None, [f"{path}: expected {tp.__name__}, got {_kind(value)}"])
    return value, []


def describe(cls: type) -> list[dict[str, str]]:
    """Rows ``{name, type, default, help}`` for ``rl-cli plugins show`` and generated docs."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return []
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.default is not _NO:
            default = repr(f.default)
        elif f.default_factory is not _NO:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        rows.append({"name": f.name, "type": type_name(hints[f.name]), "default": default,
                     "help": f.metadata.get("help", "")})
    return rows


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain YAML-able data (tuples become lists); an object with its own
    ``to_dict()`` (a selected component) gives that."""
    if callable(getattr(obj, "to_dict", None)) and not isinstance(obj, type):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _bounds(value: Any, meta: Mapping, path: str) -> list[str]:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return []
    checks = (("ge", lambda b: value >= b, ">="), ("gt", lambda b: value > b, ">"),
              ("le", lambda b: value <= b, "<="), ("lt", lambda b: value < b, "<"))
    return [f"{path}: {value!r} is out of range (must be {sign} {meta[k]})"
            for k, ok, sign in checks if meta.get(k) is not None and not ok(meta[k])]


def _names(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if f.init) or "(none)"


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else str(key)


def _kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r}" if not isinstance(value, (dict, list)) else type(value).__name__
