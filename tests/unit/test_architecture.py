"""Rules the code base keeps: documented hooks, registered built-ins, no plugin names in the core, no function
longer than a reader follows in one sitting."""

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


def _plugin_modules():
    """Every built-in plugin: a module file in a kind's folder, or a package there (a backend), whose
    ``__init__`` is the entry module and whose other modules are its internals."""
    out = set()
    for kind in (ROOT / "posttrain" / "plugins").iterdir():
        if not kind.is_dir() or kind.name.startswith("_"):
            continue
        for entry in kind.iterdir():
            if entry.is_dir() and (entry / "__init__.py").exists():
                out.add(".".join(entry.relative_to(ROOT).parts))
            elif entry.suffix == ".py" and not entry.name.startswith("_"):
                out.add(".".join(entry.relative_to(ROOT).with_suffix("").parts))
    return out


def test_every_builtin_plugin_module_is_an_entry_point():
    declared = set(PYPROJECT["project"]["entry-points"]["posttrain"].values())
    modules = _plugin_modules()
    assert modules == declared, f"not registered: {modules - declared}; missing files: {declared - modules}"


def _module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in (ROOT / "posttrain").rglob("*.py")}


def _imports(name: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in module ``name``, at any depth (functions included) except under
    ``if TYPE_CHECKING:``; relative imports resolved, ``from pkg import sub`` taken as the submodule."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            out.extend((node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def _layer_offenders(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{MODULES[name].relative_to(ROOT)}:{line}: {target}" for name in sorted(MODULES) if name.startswith(layer)
            for line, target in _imports(name) if target.startswith(forbidden)]


def test_core_imports_neither_plugins_nor_testing():
    """Backends are plugins: core/ imports none (the loop reaches them through registries), and nothing of the
    contract kit (``posttrain.testing`` builds on core, not the other way round)."""
    offenders = _layer_offenders("posttrain.core", ("posttrain.plugins", "posttrain.testing"))
    assert not offenders, "\n".join(offenders)


def test_the_cli_imports_no_plugin():
    """A backend's commands and checks come from the backend (``posttrain_register_commands``,
    ``posttrain_doctor_checks``, the trainer-backend interface): the CLI imports no plugin module."""
    offenders = _layer_offenders("posttrain.cli", ("posttrain.plugins",))
    assert not offenders, "\n".join(offenders)


# import cycles allowed, each with why; drop an entry once its circle is gone
ALLOWED_CYCLES: set[frozenset[str]] = set()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_there_are_no_import_cycles():
    """No two posttrain modules import each other, directly or round a circle, even inside functions: a circle
    means two modules are one, or a third belongs under both. (A package importing its own submodules is no
    circle: a submodule's parent package is not counted as its import.)"""
    graph = {}
    for name in MODULES:
        targets = set()
        for _, target in _imports(name):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    cycles = [c for c in _cycles(graph) if frozenset(c) not in ALLOWED_CYCLES]
    report = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(report)


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _lines(paths):
    return sum(len(p.read_text().splitlines()) for p in paths)


def test_core_is_what_every_backend_shares():
    """The issue that moved the backends out set this bound: core/ under 40% of the package's lines."""
    package = list((ROOT / "posttrain").rglob("*.py"))
    core = list((ROOT / "posttrain" / "core").rglob("*.py"))
    assert _lines(core) < 0.4 * _lines(package), f"core/ has {_lines(core)} of {_lines(package)} lines"


FUNCTION_LINES = 80
# functions allowed past FUNCTION_LINES, "path:Class.function" -> why; an entry no longer needed fails the test
LONG_FUNCTIONS: dict[str, str] = {}


def _functions(node, prefix=""):
    """``(qualified name, def node)`` of every function under ``node``, methods and nested functions included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from _functions(child, f"{name}.")
        else:
            yield from _functions(child, prefix)


def _is_triton_kernel(fn):
    return any(ast.unparse(d.func if isinstance(d, ast.Call) else d) == "triton.jit" for d in fn.decorator_list)


def test_no_function_is_longer_than_a_reader_follows_in_one_sitting():
    """Every function in ``posttrain/`` is at most ``FUNCTION_LINES`` lines, ``def`` to last line (docstring and
    decorators' lines aside from the count's start), except Triton kernels (``@triton.jit``: one kernel is one
    launch, and its body is the unit that is tuned and read against its docstring) and ``LONG_FUNCTIONS``."""
    long, seen = [], set()
    for path in sorted((ROOT / "posttrain").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, fn in _functions(ast.parse(path.read_text())):
            size = fn.end_lineno - fn.lineno + 1
            if size <= FUNCTION_LINES or _is_triton_kernel(fn):
                continue
            if f"{rel}:{name}" in LONG_FUNCTIONS:
                seen.add(f"{rel}:{name}")
                continue
            long.append(f"{rel}:{fn.lineno}:{name} ({size} lines)")
    assert not long, f"functions over {FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(long)
    stale = set(LONG_FUNCTIONS) - seen
    assert not stale, f"LONG_FUNCTIONS entries no longer over {FUNCTION_LINES} lines (remove them): {sorted(stale)}"


def test_the_length_check_sees_methods_nested_functions_and_kernels():
    """The walk behind the length limit names methods and nested functions by their qualified names, and exempts
    exactly ``triton.jit`` kernels, with or without arguments."""
    tree = ast.parse("class A:\n    def f(self):\n        def g(): pass\n"
                     "@triton.jit\ndef k(): pass\n@triton.jit(do_not_specialize=['x'])\ndef k2(): pass\n"
                     "@functools.lru_cache\ndef h(): pass\n")
    found = dict(_functions(tree))
    assert sorted(found) == ["A.f", "A.f.g", "h", "k", "k2"]
    assert [n for n, fn in sorted(found.items()) if _is_triton_kernel(fn)] == ["k", "k2"]


# strings that are plugin names but also protocol words the core must use, with why
PROTOCOL_WORDS = {"length": "SGLang's finish_reason type when max_new_tokens is hit",
                  "local": "resources.executor's in-process executor (core's own, not the engine backend)"}


def test_no_plugin_name_appears_in_core():
    plugins = load_plugins(autoload=False)
    names = {n for reg in plugins.registries().values() for n in reg} - set(PROTOCOL_WORDS)
    offenders = []
    for path in (ROOT / "posttrain" / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not offenders, "the core dispatches through registries, never by plugin name:\n" + "\n".join(offenders)


def test_the_loop_imports_no_torch_before_the_engines_start():
    """The driver launches engines that wait for their checkpoint before it builds the trainer; importing
    ``core.loop`` without torch (0.9 s on a 2-core CPU) lets them start that much earlier (bench/RESULTS.md)."""
    import subprocess
    import sys

    code = ("import sys; import posttrain.core.loop\n"
            "print('HEAVY', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout[-500:] + out.stderr[-2000:]


# class names defined twice, each with why
ALLOWED_TWICE: dict[str, str] = {}


def test_every_class_name_is_defined_once():
    """One name per class across the package, so a name in a message, a doc or a traceback means one thing."""
    where: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(name)
    twice = {n: m for n, m in where.items() if len(m) > 1 and n not in ALLOWED_TWICE}
    assert not twice, twice
