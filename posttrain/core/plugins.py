"""Plugin discovery: built-ins and third-party plugins through one entry-point group, plus files.

``load_plugins()`` builds a fresh pluggy ``PluginManager`` (one per call: every process, Ray actor and
engine server builds its own), registers every module of the ``posttrain`` entry-point group, then
any ``--plugin path.py`` files, checks hook names, and asks every plugin to fill the registries.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pluggy

from posttrain.core import hookspecs
from posttrain.core.errors import PluginError, UsageError, unknown
from posttrain.core.interfaces import needs_of
from posttrain.core.registry import KINDS, PluginInfo, Registry

GROUP = "posttrain"
OWN_DISTRIBUTION = "posttrain"
ENV_DISABLE_AUTOLOAD = "POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "POSTTRAIN_PLUGINS"  # with autoload off: comma-separated entry-point names still to load


@dataclass
class LoadFailure:
    """A plugin whose module raised on import: reported once, the other plugins still load."""

    name: str
    distribution: str
    error: str

    def __str__(self) -> str:
        return (f"plugin {self.name!r} from {self.distribution} failed to import: {self.error} "
                f"(disable it with `-p no:{self.name}`)")


@dataclass
class Plugins:
    """What ``load_plugins()`` found. Each kind is a :class:`Registry` (``name -> component``)."""

    pm: pluggy.PluginManager
    estimators: Registry
    losses: Registry
    corrections: Registry
    rewards: Registry
    generators: Registry
    models: Registry
    filters: Registry
    tools: Registry
    agents: Registry
    engines: Registry
    trainers: Registry
    modes: Registry
    infos: dict[str, PluginInfo] = field(default_factory=dict)  # plugin name -> provenance
    failures: list[LoadFailure] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    enabled: list[str] = field(default_factory=list)
    plugin_files: list[str] = field(default_factory=list)

    @property
    def load_args(self) -> dict[str, list[str]]:
        """``load_plugins(**plugins.load_args)`` rebuilds the same plugin set in another process."""
        return {"plugin_files": list(self.plugin_files), "disabled": list(self.disabled),
                "enabled": list(self.enabled)}

    def registry(self, kind: str) -> Registry:
        """The registry for a plural kind name (``"estimators"``) or singular (``"estimator"``)."""
        plural = kind if kind in KINDS else {v: k for k, v in KINDS.items()}.get(kind)
        if plural is None:
            raise UsageError(f"unknown plugin kind {kind!r}. Valid: {', '.join(KINDS.values())}")
        return getattr(self, plural)

    def registries(self) -> dict[str, Registry]:
        return {kind: getattr(self, kind) for kind in KINDS}

    def header(self) -> str:
        """``plugins: posttrain-0.1.0, posttrain-example-0.1.0``: the line ``rl-cli run`` prints first."""
        dists = sorted({f"{i.distribution}-{i.version}" if i.version else i.distribution
                        for i in self.infos.values()})
        return "plugins: " + ", ".join(dists)


def load_plugins(plugin_files: tuple[str | os.PathLike, ...] | list = (), disabled: tuple[str, ...] | list = (),
                 autoload: bool = True, enabled: tuple[str, ...] | list = ()) -> Plugins:
    """Discover plugins and fill the registries.

    :param plugin_files: paths of single-file plugins (``--plugin my_reward.py``).
    :param disabled: plugin (entry-point) names not to load (``-p no:NAME``).
    :param enabled: plugins to load even with autoload off (``-p NAME``, as in pytest): an entry-point
        name, or else an importable module name registered as a plugin.
    :param autoload: load third-party entry points. ``POSTTRAIN_DISABLE_PLUGIN_AUTOLOAD=1`` turns it off
        too; posttrain's own built-ins always load, plus the names listed in ``POSTTRAIN_PLUGINS``.
    :raises PluginError: duplicate component names, misspelled hooks, a hook that raised, or a
        ``--plugin`` file that cannot be imported. A broken *installed* plugin is not an error: it is
        listed in ``Plugins.failures`` and the rest still load.
    """
    if os.environ.get(ENV_DISABLE_AUTOLOAD, "").strip() not in ("", "0"):
        autoload = False
    wanted = {n.strip() for n in os.environ.get(ENV_PLUGINS, "").split(",") if n.strip()} | set(enabled)
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in disabled:
        pm.set_blocked(name)
    infos: dict[str, PluginInfo] = {}
    failures: list[LoadFailure] = []

    for ep in _entry_points():
        dist = ep.dist.metadata["Name"] if ep.dist else "(unknown)"
        own = dist == OWN_DISTRIBUTION
        if pm.is_blocked(ep.name) or not (own or autoload or ep.name in wanted) or pm.get_plugin(ep.name):
            continue
        try:
            module = ep.load()
        except Exception as exc:  # a broken third-party plugin must not take the others down
            failures.append(LoadFailure(ep.name, dist, f"{type(exc).__name__}: {exc}"))
            continue
        pm.register(module, name=ep.name)
        infos[ep.name] = PluginInfo(ep.name, dist, ep.dist.version if ep.dist else "", ep.value)

    for name in enabled:  # -p NAME that is no entry point: a module on sys.path, as pytest's -p takes
        if pm.get_plugin(name) is None and not pm.is_blocked(name):
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                raise PluginError(f"-p {name}: no installed plugin or importable module of that name ({exc})") from None
            pm.register(module, name=name)
            infos[name] = PluginInfo(name, "(module)", "", name)

    for path in plugin_files:
        module = _import_file(Path(path))
        name = Path(path).stem
        if pm.is_blocked(name):
            continue
        if pm.get_plugin(name) is not None:
            raise PluginError(f"--plugin {path}: a plugin named {name!r} is already loaded; rename the file")
        pm.register(module, name=name)
        infos[name] = PluginInfo(name, "(file)", "", str(path))

    _check_hook_names(pm)

    registries = {kind: Registry(kind) for kind in KINDS}
    for kind, registry in registries.items():
        _fill(pm, f"posttrain_register_{kind}", registry, infos)
        # an unknown name may be due to a plugin that failed to load: say so where it is looked up
        registry.note = "".join(f" Note: {failure}." for failure in failures)
    errors = [e for r in registries.values() for e in r.errors]
    if errors:
        raise PluginError("\n".join(errors))
    for estimator in registries["estimators"].values():  # every one has ``needs``: older attributes translated
        needs_of(estimator)
    return Plugins(pm=pm, infos=infos, failures=failures, disabled=list(disabled), enabled=list(enabled),
                   plugin_files=[str(f) for f in plugin_files], **registries)


def _check_hook_names(pm: pluggy.PluginManager) -> None:
    """Misspelled hook names (pluggy's ``check_pending``), all reported, each with a did-you-mean."""
    hooks = sorted(n for n in dir(hookspecs) if n.startswith("posttrain_"))
    errors = []
    for name, hook in vars(pm.hook).items():
        if name.startswith("posttrain_") and not hook.has_spec():
            for impl in hook.get_hookimpls():
                errors.append(f"plugin {impl.plugin_name!r}: {unknown('hook', name, hooks)}")
    if errors:
        raise PluginError("\n".join(errors))
    pm.check_pending()


def _fill(pm: pluggy.PluginManager, hook_name: str, registry: Registry, infos: dict[str, PluginInfo]) -> None:
    """Call every implementation of a registration hook, recording which plugin added what."""
    hook = getattr(pm.hook, hook_name)
    for impl in reversed(hook.get_hookimpls()):  # registration order: built-ins first, files last
        registry._current = infos.get(impl.plugin_name, PluginInfo(impl.plugin_name, "(unknown)", "", ""))
        kwargs = {"registry": registry}
        try:
            impl.function(*[kwargs[a] for a in impl.argnames])
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(f"plugin {impl.plugin_name!r} failed in {hook_name}: "
                              f"{type(exc).__name__}: {exc}") from exc
    registry._current = None


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    eps = importlib.metadata.entry_points(group=GROUP)
    # posttrain's own first, so a third-party duplicate is reported as the second provider
    return sorted(eps, key=lambda ep: (ep.dist is None or ep.dist.metadata["Name"] != OWN_DISTRIBUTION))


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise PluginError(f"--plugin {path}: no such file")
    mod_name = f"posttrain_local_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # so dataclasses and pickling inside the file work
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise PluginError(f"--plugin {path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:
        tb = exc.__traceback__
        line = max((f.tb_lineno for f in _frames(tb) if f.tb_frame.f_code.co_filename == str(path)), default=None)
        raise PluginError(f"--plugin {path}{f':{line}' if line else ''}: {type(exc).__name__}: {exc}") from None
    return module


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next
