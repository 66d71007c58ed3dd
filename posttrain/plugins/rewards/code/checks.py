"""Judging assert-style tests outside the sandbox: the program's values come out as plain data, and the
comparison runs here, in the trusted process, on values the program cannot dress up.

An assert test ``assert <expr>`` is split in three (:func:`split_assert`):

- **the skeleton**: literals, arithmetic, comparisons, boolean operators, subscripts, the plain type
  names (``int``, ``list`` ...) and a fixed set of builtins (``sorted``, ``abs``, ``isinstance``,
  ``reversed``, ``math.isclose`` ...), evaluated here by a small interpreter with size guards (``**``, ``*`` and
  ``<<`` cannot build huge values). Its constants never enter a sandbox.
- **reference leaves**: every maximal sub-expression outside the skeleton whose free names are all
  builtins or standard-library modules (``sum(range(5))``, ``math.factorial(5)``,
  ``list(map(str, [1, 2]))``): the expected side of the test. They cannot call anything the program
  defines, so they are evaluated without it, in a sandbox run of their own (``REFERENCE_HARNESS`` in the
  reward) in which the program never runs: a fresh interpreter, so a program that rebinds ``range``,
  ``builtins.map`` or ``math.factorial`` cannot change them. A separate run rather than evaluating them
  in the program's run before it starts, because what the program's process holds it can read (the
  harness's globals through ``sys._getframe``, its memory through ``/proc/self/mem``): the expected
  values, and the text that computes them, must never be there, as stdin/stdout tests never send
  their expected output.
- **program leaves**: the remaining maximal sub-expressions (calls of the program's functions, its
  names, comprehensions over them ...). Only their text enters the program's sandbox; the harness
  evaluates each after the program ran, in its namespace, except that every builtin and
  standard-library module the leaf's text names is pinned to a copy taken before the program ran
  (:attr:`Leaf.pinned`: the leaf is compiled as ``lambda map, math: <leaf>`` and called with those
  copies). So ``map(f, xs)`` in a test means the builtin ``map`` whatever the program did to
  ``map`` or ``builtins.map``; the program's own functions still see whatever it rebound (its
  business). Reference sub-expressions inside a program leaf (``f(range(3))``) are arguments of the
  program's code, evaluated there with the same pinned names.

Names in a test mean one thing: a name that is a builtin (``dir(builtins)``) always means the builtin,
and a standard-library module name used only as ``name.attr`` always means the module, even where the
program defines its own (a task whose function shadows a builtin name, say ``sum``, must name it
otherwise). Other names (``f``, ``Counter`` imported by the program) are the program's.

Leaf values cross the sandbox in a strict encoding of built-in types (:data:`ENCODER`: ``type(v) is
int`` etc., no subclasses, no custom objects), with two additions so that correct answers of another
built-in shape compare by value: a ``range`` travels as a range (range == range by value, at most
:data:`MAX_RANGE` items), and an iterator of a built-in type (``map``, ``filter``, ``zip``,
``reversed``, ``enumerate``, a generator, ``itertools`` objects, iterators over built-in containers) is
drawn out inside the sandbox and arrives as a list, so ``list(...)``, ``sorted(...)``, ``sum(...)`` and
``== [...]`` work on it. One leaf value holds at most :data:`MAX_ENCODED_ITEMS` elements (the items of
an iterator included, so an infinite one fails with that reason) and :data:`MAX_ENCODED_CHARS`
characters of strings and bytes; drawing an iterator runs under the test's timeout.

So ``assert f(1) == 2`` sends ``f(1)`` and never ``2``; an object whose ``__eq__`` is always true cannot
be encoded (the test fails), and a harness faked through ``sys._getframe`` can only report values of
program leaves, which are then compared here with values it never saw. What remains forgeable is what
a program leaf computes as a whole: a test whose verdict is made inside one program leaf
(``all(f(x) == g(x) for x in xs)``, a predicate of the program's output inside a comprehension) can be
reported true by a program that takes the harness over.
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
import sys
import types
from dataclasses import dataclass, field

MAX_ENCODED_ITEMS = 1_000_000  # elements of one leaf value, the items drawn from its iterators included
MAX_ENCODED_CHARS = 8_000_000  # characters of its strings plus bytes of its bytes
MAX_RANGE = 1_000_000  # items of a range a leaf may return (the skeleton may iterate it here)

# Runs inside the sandbox (part of both harnesses), before the program: the strict encoder of leaf values.
# Its builtins and the set of iterator types it accepts are taken when it is defined, so a program that
# rebinds ``type`` or ``builtins.iter`` later does not change what it reports.
ENCODER = f"_ENC_LIMITS = ({MAX_ENCODED_ITEMS}, {MAX_ENCODED_CHARS})\n" + r'''
def _encoder(limits, type=type, iter=iter, len=len, repr=repr, hasattr=hasattr, vars=vars, bool=bool, int=int,
             float=float, str=str, bytes=bytes, bytearray=bytearray, complex=complex, range=range, list=list,
             tuple=tuple, set=set, frozenset=frozenset, dict=dict, map=map, filter=filter, zip=zip,
             reversed=reversed, enumerate=enumerate, ValueError=ValueError, TypeError=TypeError):
    import itertools
    iters = {map, filter, zip, reversed, enumerate, type((lambda: (yield))()), type(iter(lambda: 0, 1))}
    iters |= {type(iter(c)) for c in ([], (), "", "\u00e9", b"", bytearray(), range(0), range(1 << 64), {}, set())}
    iters |= {type(iter({}.values())), type(iter({}.items())), type(reversed([])), type(reversed({}))}
    iters |= {t for t in vars(itertools).values() if type(t) is type and hasattr(t, "__next__")}
    tags = {list: "l", tuple: "t", set: "s", frozenset: "f"}
    inf, ninf = float("inf"), float("-inf")

    def enc(value):
        left = [limits[0], limits[1]]

        def walk(v, depth):
            if depth > 64:
                raise ValueError("value nested too deeply")
            left[0] -= 1
            if left[0] < 0:
                raise ValueError(f"value too large: more than {limits[0]} elements (an endless iterator?)")
            t = type(v)
            if v is None or t is bool or t is int:
                return v
            if t is str or t is bytes:
                left[1] -= len(v)
                if left[1] < 0:
                    raise ValueError(f"value too large: more than {limits[1]} characters")
                return v if t is str else {"b": v.hex()}
            if t is float:
                return v if v == v and v != inf and v != ninf else {"F": repr(v)}
            if type(t) is not type:  # a custom metaclass could make ``t in tags`` match
                raise TypeError(f"a {t.__name__} is not plain data")
            if t is range:
                return {"r": [v.start, v.stop, v.step]}
            if t in tags:
                return {tags[t]: [walk(x, depth + 1) for x in v]}
            if t is dict:
                return {"d": [[walk(k, depth + 1), walk(x, depth + 1)] for k, x in v.items()]}
            if t is complex:
                return {"c": [v.real, v.imag]}
            if t in iters:
                return {"i": [walk(x, depth + 1) for x in v]}
            raise TypeError(f"a {t.__name__} is not plain data")
        return walk(value, 0)
    return enc

_enc = _encoder(_ENC_LIMITS)
del _encoder
'''

_MAX_DEPTH = 64
_MAX_ITEMS = 10_000_000  # elements a skeleton may build from a leaf value (``[0] * n`` and the like)


def _decode_range(body) -> range:
    if not (isinstance(body, list) and len(body) == 3 and all(type(p) is int for p in body) and body[2]):
        raise ValueError(f"not an encoded range: {str(body)[:60]}")
    r = range(*body)
    try:
        n = len(r)
    except OverflowError:  # more than sys.maxsize items
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        raise ValueError(f"a range of more than {MAX_RANGE} items")
    return r


def decode(x, depth: int = 0):
    """The value encoded by the harness's ``_enc`` (an iterator's items as a list); ValueError otherwise
    (a forged report may still raise TypeError, unhashable set items, or OverflowError, a huge complex)."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if x is None or isinstance(x, (bool, int, str, float)):
        return x
    if isinstance(x, dict) and len(x) == 1:
        (tag, body), = x.items()
        if tag == "F" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "b" and isinstance(body, str):
            return bytes.fromhex(body)
        if tag == "c" and isinstance(body, list) and len(body) == 2 and all(isinstance(p, (int, float)) for p in body):
            return complex(*body)
        if tag == "r":
            return _decode_range(body)
        if isinstance(body, list):
            if tag in ("l", "t", "s", "f", "i"):
                items = [decode(v, depth + 1) for v in body]
                return {"l": list, "t": tuple, "s": set, "f": frozenset, "i": list}[tag](items)
            if tag == "d" and all(isinstance(p, list) and len(p) == 2 for p in body):
                return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    raise ValueError(f"not an encoded value: {str(x)[:60]}")


class _Leaf(ast.expr):
    """A placeholder in the skeleton for the value of program leaf (or, ``ref``, reference leaf) ``index``."""

    _fields = ("index", "ref")


# The interpreter's own builtins (functions and types); not what ``site`` or a notebook adds to the
# module in this process (``exit``, ``help``, ``display`` ...), which the sandboxed interpreter lacks.
_BUILTIN_NAMES = frozenset(n for n, v in vars(builtins).items() if not n.startswith("_") and (
    isinstance(v, type) or type(v) is types.BuiltinFunctionType)) | {"__import__", "Ellipsis", "NotImplemented"}
_STDLIB = frozenset(n for n in sys.stdlib_module_names if not n.startswith("_")) - _BUILTIN_NAMES
_TYPE_NAMES = {t.__name__: t for t in (int, float, str, bool, bytes, complex, list, tuple, dict, set, frozenset,
                                       range)}
_SAFE_CALLS = {"abs": abs, "round": round, "len": len, "sorted": sorted, "set": set, "frozenset": frozenset,
               "list": list, "tuple": tuple, "sum": sum, "min": min, "max": max, "all": all, "any": any,
               "bool": bool, "int": int, "float": float, "str": str, "isclose": math.isclose,
               "isinstance": isinstance, "type": lambda v: type(v), "reversed": reversed, "zip": zip,
               "enumerate": enumerate,
               "math.isclose": math.isclose, "math.fabs": math.fabs, "math.sqrt": math.sqrt}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitAnd: operator.and_,
           ast.BitOr: operator.or_, ast.BitXor: operator.xor}
_UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return None


@dataclass
class Leaf:
    """A sub-expression evaluated in a sandbox: its source, and the builtin and standard-library module
    names it uses, which the harness binds to pristine objects (``pinned``) or imports (``modules``)."""

    src: str
    pinned: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)

    def spec(self) -> dict:
        return {"src": self.src, "pinned": self.pinned, "modules": self.modules}


@dataclass
class AssertCheck:
    """One assert test: the skeleton (evaluated here), its program leaves (evaluated in the program's
    sandbox run) and its reference leaves (evaluated in a sandbox run without the program)."""

    source: str
    skeleton: ast.expr
    leaves: list[Leaf]
    refs: list[Leaf] = field(default_factory=list)

    def passes(self, values: list, refs: list | None = None) -> bool:
        """Whether the skeleton holds for these decoded leaf values (any error: it does not)."""
        refs = refs or []
        if len(values) != len(self.leaves) or len(refs) != len(self.refs):
            return False
        try:
            return bool(_eval(self.skeleton, values, refs))
        except Exception:  # a wrong type, a failed lookup, a guard: the test fails
            return False


def _targets(node: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _free_names(node: ast.AST, bound: frozenset[str] = frozenset()) -> set[str]:
    """Names ``node`` reads from outside itself (lambda parameters and comprehension targets excluded;
    a comprehension's first iterable is read in the enclosing scope, as Python does)."""
    if isinstance(node, ast.Name):
        return set() if node.id in bound else {node.id}
    if isinstance(node, ast.Lambda):
        a = node.args
        params = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None}
        out = set().union(*(_free_names(d, bound) for d in (*a.defaults, *a.kw_defaults) if d is not None))
        return out | _free_names(node.body, bound | params)
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        out: set[str] = set()
        inner = set(bound)
        for i, gen in enumerate(node.generators):
            out |= _free_names(gen.iter, bound if i == 0 else frozenset(inner))
            inner |= _targets(gen.target)
            for cond in gen.ifs:
                out |= _free_names(cond, frozenset(inner))
        results = (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,)
        return out.union(*(_free_names(e, frozenset(inner)) for e in results))
    return set().union(*(_free_names(c, bound) for c in ast.iter_child_nodes(node)))


def _module_names(tree: ast.AST) -> frozenset[str]:
    """Standard-library module names the test uses only as ``name.attr`` (so they mean the module)."""
    bases = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    names = [n for n in ast.walk(tree) if isinstance(n, ast.Name)]
    bare = {n.id for n in names if id(n) not in bases}
    return frozenset(n.id for n in names if n.id in _STDLIB and n.id not in bare)


def _parts(node: ast.expr) -> list[ast.expr] | None:
    """The sub-expressions of a node the skeleton interprets itself; None when it does not."""
    if isinstance(node, ast.Constant) or isinstance(node, ast.Name) and node.id in _TYPE_NAMES:
        return []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
        return list(node.elts)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return [*node.keys, *node.values]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return [node.operand]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return [node.left, node.right]
    if isinstance(node, ast.BoolOp):
        return list(node.values)
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        return [node.left, *node.comparators]
    if isinstance(node, ast.Subscript):
        sl = node.slice
        return [node.value, *([p for p in (sl.lower, sl.upper, sl.step) if p] if isinstance(sl, ast.Slice) else [sl])]
    if (isinstance(node, ast.Call) and _call_name(node.func) in _SAFE_CALLS
            and not any(isinstance(a, (ast.Starred, ast.Lambda, ast.GeneratorExp)) for a in node.args)
            and all(k.arg is not None and not isinstance(k.value, ast.Lambda) for k in node.keywords)):
        return [*node.args, *(k.value for k in node.keywords)]
    return None


def _pure(node: ast.expr) -> bool:
    """Whether the skeleton evaluates ``node`` entirely (no leaf in it)."""
    parts = _parts(node)
    return parts is not None and all(_pure(p) for p in parts)


def _replace(holder: ast.AST, parts: set[int], fn) -> None:
    """Replace, in place, the children of ``holder`` listed in ``parts`` (by id) with ``fn(child)``;
    a slice's and a keyword's children count as the holder's."""
    def sub(v):
        if id(v) in parts:
            return fn(v)
        if isinstance(v, (ast.Slice, ast.keyword)):
            _replace(v, parts, fn)
        return v
    for name, value in ast.iter_fields(holder):
        setattr(holder, name, [sub(v) for v in value] if isinstance(value, list) else sub(value))


def split_assert(source: str) -> AssertCheck:
    """Split a single ``assert`` statement; ValueError naming the problem otherwise."""
    try:
        tree = ast.parse(source.strip())
    except SyntaxError as exc:
        raise ValueError(f"code label: test {source!r} is not valid Python ({exc.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError(f"code label: test {source!r} is not a single assert statement")
    modules = _module_names(tree)
    known = _BUILTIN_NAMES | modules
    check = AssertCheck(source, tree.body[0].test, [], [])

    def leaf(node: ast.expr, free: set[str], ref: bool) -> ast.expr:
        out = check.refs if ref else check.leaves
        out.append(Leaf(ast.unparse(node), sorted(free & known), sorted(free & modules)))
        return _Leaf(index=len(out) - 1, ref=ref)

    def split(node: ast.expr) -> ast.expr:
        free = _free_names(node)
        if free <= known and not _pure(node):
            return leaf(node, free, ref=True)
        parts = _parts(node)
        if parts is None:
            return leaf(node, free, ref=False)
        _replace(node, {id(p) for p in parts}, split)
        return node

    check.skeleton = split(check.skeleton)
    return check


def _size(v) -> int:
    return len(v) if isinstance(v, (str, bytes, list, tuple)) else 1


def _binop(op: ast.operator, a, b):
    if isinstance(op, ast.Pow) and isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b > 4096:
        raise ValueError("power too large")
    if isinstance(op, ast.Mult) and isinstance(b, int) and _size(a) * abs(b) > _MAX_ITEMS:
        raise ValueError("product too large")
    if isinstance(op, ast.Mult) and isinstance(a, int) and _size(b) * abs(a) > _MAX_ITEMS:
        raise ValueError("product too large")
    if isinstance(op, ast.LShift) and isinstance(b, int) and b > 65536:
        raise ValueError("shift too large")
    return _BINOPS[type(op)](a, b)


def _eval(node: ast.expr, values: list, refs: list):
    if isinstance(node, _Leaf):
        return refs[node.index] if node.ref else values[node.index]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return _TYPE_NAMES[node.id]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_eval(e, values, refs) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {_eval(k, values, refs): _eval(v, values, refs) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_eval(node.operand, values, refs))
    if isinstance(node, ast.BinOp):
        return _binop(node.op, _eval(node.left, values, refs), _eval(node.right, values, refs))
    if isinstance(node, ast.BoolOp):
        result = None
        for v in node.values:
            result = _eval(v, values, refs)
            if isinstance(node.op, ast.And) and not result or isinstance(node.op, ast.Or) and result:
                return result
        return result
    if isinstance(node, ast.Compare):
        left = _eval(node.left, values, refs)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, values, refs)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Subscript):
        sl = node.slice
        key = (slice(*(None if p is None else _eval(p, values, refs) for p in (sl.lower, sl.upper, sl.step)))
               if isinstance(sl, ast.Slice) else _eval(sl, values, refs))
        return _eval(node.value, values, refs)[key]
    if isinstance(node, ast.Call):
        fn = _SAFE_CALLS[_call_name(node.func)]
        return fn(*[_eval(a, values, refs) for a in node.args],
                  **{k.arg: _eval(k.value, values, refs) for k in node.keywords})
    raise ValueError(f"unexpected skeleton node {type(node).__name__}")
