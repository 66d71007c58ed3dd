"""Named components per kind, with the provider of each, so errors and listings can name them."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.core.errors import PluginError, unknown
from posttrain.core.interfaces import Component

# registry attribute -> singular noun used in messages and in `rl-cli plugins list --kind`
KINDS: dict[str, str] = {
    "estimators": "estimator",
    "losses": "loss",
    "corrections": "correction",
    "rewards": "reward",
    "generators": "generator",
    "models": "model",
    "filters": "filter",
    "tools": "tool",
    "agents": "agent",
    "engines": "engine",
    "trainers": "trainer",
    "modes": "mode",
}


@dataclass(frozen=True)
class PluginInfo:
    """Where a plugin came from: ``rl-cli plugins list`` shows one row per component with this."""

    name: str  # entry-point name, or the file stem for --plugin files
    distribution: str  # distribution name, or "(file)" for --plugin files
    version: str
    module: str

    @property
    def provided_by(self) -> str:
        return f"{self.distribution}=={self.version}" if self.version else self.distribution


class Registry(Mapping[str, Any]):
    """``name -> component`` for one kind. Read it like a dict; plugins call :meth:`add`."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, Any] = {}
        self._providers: dict[str, PluginInfo] = {}
        self._current: PluginInfo | None = None  # set by load_plugins while a plugin's hook runs
        self.errors: list[str] = []
        self.note = ""  # appended to unknown-name messages (e.g. "plugin X failed to import")

    def default_name(self) -> str | None:
        """The component registered with ``is_default = True`` (a kind's built-in backend): what a run
        config that leaves the section out selects. None when there is none or several."""
        marked = [n for n, c in self._items.items() if getattr(c, "is_default", False)]
        return marked[0] if len(marked) == 1 else None

    def add(self, component: Any, name: str | None = None) -> Any:
        """Register ``component`` under ``name`` (default: its ``name`` attribute). Returns it.

        A plain function (e.g. an async generator function) is wrapped in a class with an empty
        ``Config`` so every component is built the same way: ``Component(Component.Config())``.
        """
        name = name or getattr(component, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"{self._who()}: {self.kind} {component!r} has no name; set a class attribute "
                              f"`name` or call registry.add(obj, name=...)")
        if inspect.isfunction(component) or inspect.iscoroutinefunction(component):
            component = _wrap_function(component, name)
        config = getattr(component, "Config", None)
        if config is not None and not dataclasses.is_dataclass(config):
            raise PluginError(f"{self._who()}: {self.kind} {name!r}: Config must be a dataclass")
        if name in self._items:
            self.errors.append(f"{self.kind} {name!r} is registered twice: by {_fmt(self._providers[name])} "
                               f"and by {_fmt(self._current)}")
            return component
        self._items[name] = component
        if self._current is not None:
            self._providers[name] = self._current
        return component

    def provider(self, name: str) -> PluginInfo | None:
        return self._providers.get(name)

    def get_or_raise(self, name: str) -> Any:
        """The component, or a :class:`PluginError` listing the valid names and a did-you-mean."""
        if name not in self._items:
            raise PluginError(self.unknown_message(name))
        return self._items[name]

    def unknown_message(self, name: str) -> str:
        return unknown(KINDS[self.kind], name, self._items,
                       f" (see `rl-cli plugins list --kind {KINDS[self.kind]}`).{self.note}")

    def __getitem__(self, name: str) -> Any:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._items)})"

    def _who(self) -> str:
        return _fmt(self._current) if self._current else "posttrain"


def _fmt(info: PluginInfo | None) -> str:
    return f"{info.provided_by} ({info.module})" if info else "(unknown provider)"


def _wrap_function(fn: Any, name: str) -> type:
    @dataclass
    class Config:
        pass

    async def acall(self, *args, **kwargs):
        return await fn(*args, **kwargs)

    def call(self, *args, **kwargs):
        return fn(*args, **kwargs)

    attrs = {"name": name, "Config": Config, "__doc__": fn.__doc__, "__module__": fn.__module__,
             "__call__": acall if inspect.iscoroutinefunction(fn) else call, "function": staticmethod(fn)}
    return type(f"{name}_function", (Component,), attrs)
