"""Judging assert-style tests outside the sandbox: the program's values come out as plain data, and the
comparison runs here, in the trusted process, on values the program cannot dress up.

An assert test ``assert <expr>`` is split in two (:func:`split_assert`):

- **leaves**: the smallest sub-expressions that need the program (calls of its functions, its names,
  comprehensions, lambdas, attribute access ...). Only their source text enters the sandbox; the harness
  evaluates each there and prints it in a strict encoding of built-in types (``type(v) is int`` etc.:
  no subclasses, no custom objects), see :data:`ENCODER`.
- **the skeleton**: everything else, evaluated here by a small interpreter of literals, arithmetic,
  comparisons, boolean operators, subscripts and a fixed set of builtins (``sorted``, ``abs``,
  ``math.isclose`` ...), with size guards (``**``, ``*`` and ``<<`` cannot build huge values).

So ``assert f(1) == 2`` sends ``f(1)`` and never ``2``; an object whose ``__eq__`` is always true cannot
be encoded (the test fails), and a harness faked through ``sys._getframe`` can only report values, which
are then compared here. What remains forgeable is what the program computes anyway: a leaf's value (so a
forged report is no better than returning that value) and sub-expressions that are leaves because they
are not plain skeleton (``[g(x) for x in xs]`` on the expected side runs in the sandbox, next to code that
may have replaced ``builtins``).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass

# Runs inside the sandbox (part of the harness): the strict encoder of leaf values.
ENCODER = r'''
def _enc(v, depth=0):
    if depth > 64:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        return v if v == v and v not in (float("inf"), float("-inf")) else {"F": repr(v)}
    tags = {list: "l", tuple: "t", set: "s", frozenset: "f"}
    if t in tags:
        return {tags[t]: [_enc(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[_enc(k, depth + 1), _enc(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"b": v.hex()}
    if t is complex:
        return {"c": [v.real, v.imag]}
    raise TypeError(f"a {t.__name__} is not plain data")
'''

_MAX_DEPTH = 64
_MAX_ITEMS = 10_000_000  # elements a skeleton may build from a leaf value (``[0] * n`` and the like)


def decode(x, depth: int = 0):
    """The value encoded by the harness's ``_enc``; ValueError on anything else."""
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x
    if isinstance(x, dict) and len(x) == 1:
        (tag, body), = x.items()
        if tag == "F" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "b" and isinstance(body, str):
            return bytes.fromhex(body)
        if tag == "c" and isinstance(body, list) and len(body) == 2 and all(isinstance(p, (int, float)) for p in body):
            return complex(*body)
        if isinstance(body, list):
            if tag in ("l", "t", "s", "f"):
                items = [decode(v, depth + 1) for v in body]
                return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](items)
            if tag == "d" and all(isinstance(p, list) and len(p) == 2 for p in body):
                return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    raise ValueError(f"not an encoded value: {str(x)[:60]}")


class _Leaf(ast.expr):
    """A placeholder in the skeleton for the value of leaf number ``index``."""

    _fields = ("index",)


_SAFE_CALLS = {"abs": abs, "round": round, "len": len, "sorted": sorted, "set": set, "frozenset": frozenset,
               "list": list, "tuple": tuple, "sum": sum, "min": min, "max": max, "all": all, "any": any,
               "bool": bool, "int": int, "float": float, "str": str, "isclose": math.isclose,
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
class AssertCheck:
    """One assert test: the skeleton (evaluated here) and its leaves (evaluated in the sandbox)."""

    source: str
    skeleton: ast.expr
    leaves: list[str]

    def passes(self, values: list) -> bool:
        """Whether the skeleton holds for these decoded leaf values (any error: it does not)."""
        if len(values) != len(self.leaves):
            return False
        try:
            return bool(_eval(self.skeleton, values))
        except Exception:  # a wrong type, a failed lookup, a guard: the test fails
            return False


def split_assert(source: str) -> AssertCheck:
    """Split a single ``assert`` statement; ValueError naming the problem otherwise."""
    try:
        tree = ast.parse(source.strip())
    except SyntaxError as exc:
        raise ValueError(f"code label: test {source!r} is not valid Python ({exc.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError(f"code label: test {source!r} is not a single assert statement")
    leaves: list[str] = []

    def leaf(node: ast.expr) -> ast.expr:
        leaves.append(ast.unparse(node))
        return _Leaf(index=len(leaves) - 1)

    def split(node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            return type(node)(elts=[split(e) for e in node.elts], ctx=ast.Load())
        if isinstance(node, ast.Dict) and None not in node.keys:
            return ast.Dict(keys=[split(k) for k in node.keys], values=[split(v) for v in node.values])
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return ast.UnaryOp(op=node.op, operand=split(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return ast.BinOp(left=split(node.left), op=node.op, right=split(node.right))
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(op=node.op, values=[split(v) for v in node.values])
        if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            return ast.Compare(left=split(node.left), ops=node.ops, comparators=[split(c) for c in node.comparators])
        if isinstance(node, ast.Subscript):
            sl = node.slice
            if isinstance(sl, ast.Slice):
                sl = ast.Slice(*(None if part is None else split(part) for part in (sl.lower, sl.upper, sl.step)))
            else:
                sl = split(sl)
            return ast.Subscript(value=split(node.value), slice=sl, ctx=ast.Load())
        if (isinstance(node, ast.Call) and _call_name(node.func) in _SAFE_CALLS
                and not any(isinstance(a, (ast.Starred, ast.Lambda, ast.GeneratorExp)) for a in node.args)
                and all(k.arg is not None and not isinstance(k.value, ast.Lambda) for k in node.keywords)):
            return ast.Call(func=node.func, args=[split(a) for a in node.args],
                            keywords=[ast.keyword(arg=k.arg, value=split(k.value)) for k in node.keywords])
        return leaf(node)

    return AssertCheck(source, split(tree.body[0].test), leaves)


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


def _eval(node: ast.expr, values: list):
    if isinstance(node, _Leaf):
        return values[node.index]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_eval(e, values) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {_eval(k, values): _eval(v, values) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_eval(node.operand, values))
    if isinstance(node, ast.BinOp):
        return _binop(node.op, _eval(node.left, values), _eval(node.right, values))
    if isinstance(node, ast.BoolOp):
        result = None
        for v in node.values:
            result = _eval(v, values)
            if isinstance(node.op, ast.And) and not result or isinstance(node.op, ast.Or) and result:
                return result
        return result
    if isinstance(node, ast.Compare):
        left = _eval(node.left, values)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, values)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Subscript):
        sl = node.slice
        key = (slice(*(None if p is None else _eval(p, values) for p in (sl.lower, sl.upper, sl.step)))
               if isinstance(sl, ast.Slice) else _eval(sl, values))
        return _eval(node.value, values)[key]
    if isinstance(node, ast.Call):
        fn = _SAFE_CALLS[_call_name(node.func)]
        return fn(*[_eval(a, values) for a in node.args], **{k.arg: _eval(k.value, values) for k in node.keywords})
    raise ValueError(f"unexpected skeleton node {type(node).__name__}")
