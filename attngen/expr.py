"""The expression language of mask and score templates.

A template holds one Python-syntax expression over the index names (`b`, `h`, `q_idx`,
`kv_idx`, `q_len`, `kv_len`, `batch`, `heads`), `score` (score modifiers only) and the
template's own parameters. The expression is parsed once and then either

- rendered to Triton source (spliced into the kernel by Jinja), or
- evaluated with torch (the float64 reference and the block classification).

Both sides follow the same rules, so a mask means the same thing in the kernel and in the
reference:

- `and`, `or`, `not` are elementwise (`&`, `|`, `~`); `a if c else b` is `where(c, a, b)`;
  comparisons may be chained (`0 <= q_idx - kv_idx < window`).
- `//` and `%` on integers truncate toward zero (C and Triton semantics, not Python's floor).
- A tensor parameter is indexed with one index per declared dimension (`doc_ids[b, kv_idx]`);
  an index outside the tensor reads 0.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Callable

import torch

INDEX_NAMES = ("b", "h", "q_idx", "kv_idx", "q_len", "kv_len", "batch", "heads")
SCORE_NAME = "score"


def _ensure_tensor(x, like=None):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(like, torch.Tensor):
        return torch.tensor(x, device=like.device, dtype=torch.float64 if isinstance(x, float) else None)
    return torch.tensor(x, dtype=torch.float64 if isinstance(x, float) else None)


def _unary(fn_torch, fn_math):
    def apply(x):
        return fn_torch(x) if isinstance(x, torch.Tensor) else fn_math(x)
    return apply


def _binary(fn_torch):
    def apply(x, y):
        if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
            return fn_torch(torch.tensor(x), torch.tensor(y)).item()
        return fn_torch(_ensure_tensor(x, y), _ensure_tensor(y, x))
    return apply


def _where(cond, x, y):
    like = next((t for t in (cond, x, y) if isinstance(t, torch.Tensor)), None)
    return torch.where(_ensure_tensor(cond, like), _ensure_tensor(x, like), _ensure_tensor(y, like))


def _sigmoid_math(x):
    return 1.0 / (1.0 + math.exp(-x))


@dataclass(frozen=True)
class Function:
    triton: str  # name in the rendered kernel module (tl.* or a helper of common.py.jinja)
    torch: Callable


FUNCTIONS = {
    "where": Function("tl.where", _where),
    "minimum": Function("tl.minimum", _binary(torch.minimum)),
    "maximum": Function("tl.maximum", _binary(torch.maximum)),
    "abs": Function("tl.abs", _unary(torch.abs, abs)),
    "exp": Function("tl.exp", _unary(torch.exp, math.exp)),
    "log": Function("tl.log", _unary(torch.log, math.log)),
    "sqrt": Function("tl.sqrt", _unary(torch.sqrt, math.sqrt)),
    "sigmoid": Function("tl.sigmoid", _unary(torch.sigmoid, _sigmoid_math)),
    "tanh": Function("_tanh", _unary(torch.tanh, math.tanh)),
}


def _trunc_div(x, y):
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        x, y = _ensure_tensor(x, y), _ensure_tensor(y, x)
        if x.is_floating_point() or y.is_floating_point():
            return x / y
        return torch.div(x, y, rounding_mode="trunc")
    if isinstance(x, float) or isinstance(y, float):
        return x / y
    q = abs(x) // abs(y)
    return q if (x >= 0) == (y >= 0) else -q


def _trunc_mod(x, y):
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return torch.fmod(_ensure_tensor(x, y), _ensure_tensor(y, x))
    if isinstance(x, float) or isinstance(y, float):
        return math.fmod(x, y)
    return x - y * _trunc_div(x, y)


_BINOPS = {
    ast.Add: ("+", lambda x, y: x + y),
    ast.Sub: ("-", lambda x, y: x - y),
    ast.Mult: ("*", lambda x, y: x * y),
    ast.Div: ("/", lambda x, y: x / y),
    ast.FloorDiv: ("//", _trunc_div),
    ast.Mod: ("%", _trunc_mod),
    ast.BitAnd: ("&", lambda x, y: x & y),
    ast.BitOr: ("|", lambda x, y: x | y),
    ast.BitXor: ("^", lambda x, y: x ^ y),
}
_CMPOPS = {
    ast.Lt: ("<", lambda x, y: x < y),
    ast.LtE: ("<=", lambda x, y: x <= y),
    ast.Gt: (">", lambda x, y: x > y),
    ast.GtE: (">=", lambda x, y: x >= y),
    ast.Eq: ("==", lambda x, y: x == y),
    ast.NotEq: ("!=", lambda x, y: x != y),
}


def _invert(x):
    if isinstance(x, bool):
        return not x
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool:
        return ~x
    raise ValueError("~ / not applies to conditions only")


class ExprError(ValueError):
    """An expression that is not valid in the template language."""


@dataclass(frozen=True)
class TensorRef:
    """How the rendered kernel reaches one tensor parameter."""

    pointer: str  # kernel argument holding the base pointer
    strides: tuple[str, ...]  # kernel arguments holding the element strides, one per dim
    sizes: tuple[str, ...]  # kernel expressions giving the logical size of each dim


class Expr:
    """One parsed template expression."""

    def __init__(self, text: str, allowed: set[str], tensors: dict[str, int]):
        """`allowed`: names the expression may use; `tensors`: tensor parameter name -> ndim."""
        self.text = text.strip()
        try:
            tree = ast.parse(self.text, mode="eval")
        except SyntaxError as e:
            raise ExprError(f"syntax error in expression {self.text!r}: {e.msg} (column {e.offset})") from None
        self._tree = tree.body
        self._allowed = allowed
        self._tensors = tensors
        self.names: set[str] = set()
        self._check(self._tree)
        self._derivatives: dict[str, Expr] = {}

    # -- validation ---------------------------------------------------------------------
    def _check(self, node):
        if isinstance(node, ast.Name):
            if node.id not in self._allowed:
                raise ExprError(f"unknown name {node.id!r} in expression {self.text!r}; "
                                f"known: {', '.join(sorted(self._allowed))}")
            if node.id in self._tensors:
                raise ExprError(f"tensor parameter {node.id!r} must be indexed, e.g. {node.id}[q_idx]")
            self.names.add(node.id)
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (bool, int, float)):
                raise ExprError(f"constant {node.value!r} in expression {self.text!r}: only numbers and booleans")
        elif isinstance(node, ast.Subscript):
            name = node.value.id if isinstance(node.value, ast.Name) else None
            if name not in self._tensors:
                raise ExprError(f"only tensor parameters can be indexed (in {self.text!r})")
            indices = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if len(indices) != self._tensors[name]:
                raise ExprError(f"{name} has {self._tensors[name]} dimension(s) but is indexed with "
                                f"{len(indices)} in {self.text!r}")
            self.names.add(name)
            for index in indices:
                if isinstance(index, ast.Slice):
                    raise ExprError(f"slices are not supported (in {self.text!r})")
                self._check(index)
        elif isinstance(node, ast.Call):
            fname = node.func.id if isinstance(node.func, ast.Name) else None
            if fname not in FUNCTIONS or node.keywords:
                raise ExprError(f"unknown function {ast.unparse(node.func)!r} in {self.text!r}; "
                                f"known: {', '.join(sorted(FUNCTIONS))}")
            for arg in node.args:
                self._check(arg)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            self._check(node.left)
            self._check(node.right)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Invert, ast.Not)):
            self._check(node.operand)
        elif isinstance(node, ast.BoolOp):
            for value in node.values:
                self._check(value)
        elif isinstance(node, ast.Compare) and all(type(op) in _CMPOPS for op in node.ops):
            self._check(node.left)
            for comparator in node.comparators:
                self._check(comparator)
        elif isinstance(node, ast.IfExp):
            for part in (node.test, node.body, node.orelse):
                self._check(part)
        else:
            raise ExprError(f"{type(node).__name__} is not allowed in expression {self.text!r}")

    # -- Triton -------------------------------------------------------------------------
    def to_triton(self, rename: dict[str, str], tensors: dict[str, TensorRef]) -> str:
        """Triton source for the expression; `rename` maps scalar names to kernel names."""
        return self._triton(self._tree, rename, tensors)

    def _triton(self, node, rename, tensors) -> str:
        t = lambda n: self._triton(n, rename, tensors)  # noqa: E731
        if isinstance(node, ast.Name):
            return rename.get(node.id, node.id)
        if isinstance(node, ast.Constant):
            return repr(node.value)
        if isinstance(node, ast.Subscript):
            ref = tensors[node.value.id]
            indices = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            args = [ref.pointer] + [t(i) for i in indices] + list(ref.sizes) + list(ref.strides)
            return f"_load_param{len(indices)}({', '.join(args)})"
        if isinstance(node, ast.Call):
            return f"{FUNCTIONS[node.func.id].triton}({', '.join(t(a) for a in node.args)})"
        if isinstance(node, ast.BinOp):
            return f"({t(node.left)} {_BINOPS[type(node.op)][0]} {t(node.right)})"
        if isinstance(node, ast.UnaryOp):
            op = {ast.USub: "-", ast.UAdd: "+", ast.Invert: "~", ast.Not: "~"}[type(node.op)]
            return f"({op}{t(node.operand)})"
        if isinstance(node, ast.BoolOp):
            op = " & " if isinstance(node.op, ast.And) else " | "
            return "(" + op.join(t(v) for v in node.values) + ")"
        if isinstance(node, ast.Compare):
            return "(" + " & ".join(f"({t(a)} {_CMPOPS[type(op)][0]} {t(b)})"
                                    for a, op, b in self._pairs(node)) + ")"
        if isinstance(node, ast.IfExp):
            return f"tl.where({t(node.test)}, {t(node.body)}, {t(node.orelse)})"
        raise AssertionError(node)

    @staticmethod
    def _pairs(node: ast.Compare):
        operands = [node.left] + node.comparators
        return [(operands[i], op, operands[i + 1]) for i, op in enumerate(node.ops)]

    # -- substitution -------------------------------------------------------------------
    def substitute(self, replace: dict[str, str], tensors: dict[str, int]) -> "Expr":
        """The expression with each name of `replace` replaced by an expression (text) that may
        index the new tensor parameters `tensors` (name -> ndim): how a mask is evaluated in a
        sequence's own positions (attngen.varlen_attention)."""
        parsed = {name: ast.parse(text, mode="eval").body for name, text in replace.items()}

        class Replace(ast.NodeTransformer):
            def visit_Name(self, node):
                return parsed.get(node.id, node)

            def visit_Subscript(self, node):  # the tensor's own name stays
                node.slice = self.visit(node.slice)
                return node

        tree = Replace().visit(ast.parse(self.text, mode="eval").body)
        return Expr(ast.unparse(tree), self._allowed | set(tensors), {**self._tensors, **tensors})

    def joined(self, other: "Expr") -> "Expr":
        """`(other) & (this expression)`, over the names and tensors of both."""
        return Expr(f"({other.text}) & ({self.text})", self._allowed | other._allowed, {**self._tensors, **other._tensors})

    # -- derivative ---------------------------------------------------------------------
    def derivative(self, name: str) -> "Expr":
        """d(expression) / d(name) as an expression of the same language (where the expression
        branches, the derivative of the branch taken; integer operators and conditions have none).
        Raises ExprError where `name` enters something without a derivative (`//`, `%`, an index)."""
        if name not in self._derivatives:
            tree = _simplify(self._derive(self._tree, name))
            self._derivatives[name] = Expr(ast.unparse(tree), self._allowed, self._tensors)
        return self._derivatives[name]

    def _derive(self, node, x: str):
        d = lambda n: self._derive(n, x)  # noqa: E731
        if not _uses(node, x):
            return _num(0)
        if isinstance(node, ast.Name):
            return _num(1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            return ast.BinOp(d(node.left), node.op, d(node.right))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            return _add(_mul(d(node.left), node.right), _mul(node.left, d(node.right)))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and not _uses(node.right, x):
            return ast.BinOp(d(node.left), ast.Div(), node.right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            top = ast.BinOp(_mul(d(node.left), node.right), ast.Sub(), _mul(node.left, d(node.right)))
            return ast.BinOp(top, ast.Div(), _mul(node.right, node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return ast.UnaryOp(node.op, d(node.operand))
        if isinstance(node, ast.IfExp):
            return ast.IfExp(node.test, d(node.body), d(node.orelse))
        if isinstance(node, ast.Call):
            fname, args = node.func.id, node.args
            if fname == "where":
                return _call("where", args[0], d(args[1]), d(args[2]))
            if fname in ("minimum", "maximum"):
                pick = ast.Compare(args[0], [ast.LtE() if fname == "minimum" else ast.GtE()], [args[1]])
                return _call("where", pick, d(args[0]), d(args[1]))
            inner = d(args[0])
            outer = {
                "abs": lambda a: _call("where", ast.Compare(a, [ast.GtE()], [_num(0)]), _num(1), _num(-1)),
                "exp": lambda a: _call("exp", a),
                "log": lambda a: ast.BinOp(_num(1), ast.Div(), a),
                "sqrt": lambda a: ast.BinOp(_num(0.5), ast.Div(), _call("sqrt", a)),
                "sigmoid": lambda a: _mul(_call("sigmoid", a), ast.BinOp(_num(1), ast.Sub(), _call("sigmoid", a))),
                "tanh": lambda a: ast.BinOp(_num(1), ast.Sub(), _mul(_call("tanh", a), _call("tanh", a))),
            }.get(fname)
            if outer is not None:
                return _mul(outer(args[0]), inner)
        raise ExprError(f"{ast.unparse(node)!r} in {self.text!r} has no derivative with respect to {x!r}")

    # -- torch --------------------------------------------------------------------------
    def evaluate(self, env: dict):
        """Evaluate with torch: `env` maps every used name to a tensor, number or bool."""
        return self._eval(self._tree, env)

    def _eval(self, node, env):
        e = lambda n: self._eval(n, env)  # noqa: E731
        if isinstance(node, ast.Name):
            return env[node.id]
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Subscript):
            indices = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return gather(env[node.value.id], [e(i) for i in indices])
        if isinstance(node, ast.Call):
            return FUNCTIONS[node.func.id].torch(*[e(a) for a in node.args])
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)][1](e(node.left), e(node.right))
        if isinstance(node, ast.UnaryOp):
            value = e(node.operand)
            if isinstance(node.op, (ast.Invert, ast.Not)):
                return _invert(value)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BoolOp):
            result = e(node.values[0])
            for v in node.values[1:]:
                result = (result & e(v)) if isinstance(node.op, ast.And) else (result | e(v))
            return result
        if isinstance(node, ast.Compare):
            result = True
            for a, op, b in self._pairs(node):
                result = result & _CMPOPS[type(op)][1](e(a), e(b))
            return result
        if isinstance(node, ast.IfExp):
            return _where(e(node.test), e(node.body), e(node.orelse))
        raise AssertionError(node)


def gather(tensor: torch.Tensor, indices: list):
    """tensor[indices] with broadcasting index tensors; positions outside the tensor read 0."""
    like = next((i for i in indices if isinstance(i, torch.Tensor)), None)
    idx = [_ensure_tensor(i, like).to(device=tensor.device, dtype=torch.long) for i in indices]
    idx = torch.broadcast_tensors(*idx)
    inside = True  # combined out of place: FlexAttention vmaps this over its index tensors
    for i, size in zip(idx, tensor.shape):
        inside = inside & (i >= 0) & (i < size)
    clamped = [i.clamp(0, size - 1) for i, size in zip(idx, tensor.shape)]
    values = tensor[tuple(clamped)]
    return torch.where(inside, values, torch.zeros((), dtype=values.dtype, device=values.device))


# -- building derivative expressions -------------------------------------------------------
def _num(value):
    return ast.Constant(value)


def _is_num(node, value) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == value


def _call(name: str, *args):
    return ast.Call(ast.Name(name, ast.Load()), list(args), [])


def _add(a, b):
    return ast.BinOp(a, ast.Add(), b)


def _mul(a, b):
    return ast.BinOp(a, ast.Mult(), b)


def _uses(node, name: str) -> bool:
    """Whether `name` occurs in `node` outside the indices of tensor parameters."""
    if isinstance(node, ast.Subscript):
        return False
    if isinstance(node, ast.Name):
        return node.id == name
    return any(_uses(child, name) for child in ast.iter_child_nodes(node))


def _simplify(node):
    """Fold the zeros and ones a derivative leaves behind (0 + x, 1 * x, 0 * x, x - 0, where(c, 0, 0))."""
    for field, value in ast.iter_fields(node):
        if isinstance(value, ast.AST):
            setattr(node, field, _simplify(value))
        elif isinstance(value, list):
            setattr(node, field, [_simplify(v) if isinstance(v, ast.AST) else v for v in value])
    if isinstance(node, ast.BinOp):
        left, right = node.left, node.right
        if isinstance(node.op, ast.Add):
            if _is_num(left, 0):
                return right
            if _is_num(right, 0):
                return left
        if isinstance(node.op, ast.Sub) and _is_num(right, 0):
            return left
        if isinstance(node.op, ast.Sub) and _is_num(left, 0):
            return _simplify(ast.UnaryOp(ast.USub(), right))
        if isinstance(node.op, ast.Mult):
            if _is_num(left, 0) or _is_num(right, 0):
                return _num(0)
            if _is_num(left, 1):
                return right
            if _is_num(right, 1):
                return left
        if isinstance(node.op, ast.Div) and _is_num(left, 0):
            return _num(0)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and not isinstance(node.operand.value, bool):
        return _num(-node.operand.value)
    if isinstance(node, ast.IfExp) and ast.dump(node.body) == ast.dump(node.orelse):
        return node.body
    if isinstance(node, ast.Call) and node.func.id == "where" and ast.dump(node.args[1]) == ast.dump(node.args[2]):
        return node.args[1]
    return node
