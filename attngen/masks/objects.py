"""Mask objects: templates with their parameter values, combined with `&` and `|`.

    window = attngen.mask("sliding_window", window=1024)
    m = (window & attngen.mask("document", doc_ids=ids)) & attngen.mask("softcap", cap=50.0)
    m = attngen.masks.parse_spec("sliding_window(window=1024) & softcap(cap=50.0)")  # the same, as text
"""

from __future__ import annotations

import ast
import functools

import torch

from ..caches import BoundedCache
from . import template_files as templates_
from .binding import is_term
from .blocks import BlockStructure, block_structure
from .template_files import MISSING, Template, get_template


class Term:
    """One template with its parameter values."""

    def __init__(self, template: Template, values: dict, partial: bool = False):
        self.template = template
        checked = {}
        for name, value in values.items():
            if name not in template.params:
                known = ", ".join(template.params) or "none"
                raise TypeError(f"mask {template.name!r} has no parameter {name!r} (parameters: {known})")
            checked[name] = template.params[name].check(template.name, value)
        for param in template.params.values():
            if param.name not in checked:
                if not param.required:
                    checked[param.name] = param.default
                elif not (partial and not param.static):
                    raise TypeError(f"mask {template.name!r} is missing parameter {param.name!r} "
                                    f"({param.describe()})")
        self.values = checked
        self.static = {n: v for n, v in checked.items() if template.params[n].static}
        self.runtime = [p for p in template.params.values() if not p.static]

    @property
    def key(self):
        return (str(self.template.path), tuple(sorted(self.static.items())))

    @property
    def expr(self) -> Expr:
        return self.template.expression(self.static)

    def __repr__(self):
        shown = {n: ("<tensor>" if isinstance(v, torch.Tensor) else v) for n, v in self.values.items()}
        args = ", ".join(f"{n}={v!r}" for n, v in shown.items())
        return f"{self.template.name}({args})" if args else self.template.name

    def variant(self) -> str:
        """The name plus the parameters that change the kernel."""
        args = ", ".join(f"{n}={v!r}" for n, v in self.static.items())
        return f"{self.template.name}({args})" if args else self.template.name


class Mask:
    """A visibility predicate (terms combined with & and |) plus score modifiers."""

    def __init__(self, tree=None, mods: tuple = ()):
        self.tree = tree  # None (all visible), a Term, or (op, left, right)
        self.mods = tuple(mods)
        # computed once: the dispatcher reads these on every call (no cached_property: it locks on 3.11)
        terms = self.terms()
        self.key = (self._structure(tree), tuple(t.key for t in self.mods))  # equal keys render the same kernel
        scalars = tuple(t.values.get(p.name) for t in terms for p in t.runtime if p.type != "tensor")
        self.call_key = (self.key, scalars)  # plus the run-time scalars: equal keys launch identically
        self.has_tensors = any(p.type == "tensor" for t in terms for p in t.runtime)
        # the mask as text plus its tensors (parse_spec(spec, tensors=...) rebuilds it): how a mask
        # reaches the attngen::attention operator under torch.compile; computed here, eagerly, so
        # that dynamo only reads two attributes
        tensors = []

        self.spec = self._text(lambda term: _spec_call(term.template.name, term.values.items(), tensors))
        self.spec_tensors = tuple(tensors)

    def plan_key(self):
        """call_key plus each tensor's identity and in-place version: a prepared launch that holds
        the tensors (so their ids are not reused while it lives) is keyed by it."""
        if not self.has_tensors:
            return self.call_key
        return self.call_key, tuple([(id(t), t._version) for t in self.spec_tensors])

    @staticmethod
    def _structure(node):
        if is_term(node):
            return node.key
        return None if node is None else (node[0], Mask._structure(node[1]), Mask._structure(node[2]))

    def _combine(self, other, op: str) -> "Mask":
        if not isinstance(other, Mask):
            return NotImplemented
        if op == "|" and (self.mods or other.mods):
            raise TypeError("score modifiers combine with masks by &, not |")
        if self.tree is None or other.tree is None:
            if op == "|" and (self.tree is not None or other.tree is not None):
                tree = None  # everything | anything is everything
            else:
                tree = self.tree if other.tree is None else other.tree
        else:
            tree = (op, self.tree, other.tree)
        return Mask(tree, self.mods + other.mods)

    def __and__(self, other):
        return self._combine(other, "&")

    def __or__(self, other):
        return self._combine(other, "|")

    def terms(self) -> list[Term]:
        """Every term in a fixed order: the predicate's, left to right, then the modifiers."""
        out = []

        def walk(node):
            if is_term(node):
                out.append(node)
            elif node is not None:
                walk(node[1])
                walk(node[2])

        walk(self.tree)
        return out + list(self.mods)

    def _text(self, fn) -> str:
        def walk(node, top=True):
            if is_term(node):
                return fn(node)
            inner = f"{walk(node[1], False)} {node[0]} {walk(node[2], False)}"
            return inner if top else f"({inner})"

        parts = [walk(self.tree, top=not self.mods)] if self.tree is not None else []  # `(a | b) & mod`
        parts += [fn(t) for t in self.mods]
        return " & ".join(parts) if parts else "none"

    def __repr__(self):
        return f"attngen.Mask({self._text(repr)})"

    @functools.cached_property
    def variant(self) -> str:
        """What the kernel is specialised for, e.g. `causal(align='bottom_right') & softcap`."""
        return self._text(Term.variant)

    def block_structure(self, q_len: int, kv_len: int, block_size: tuple[int, int], *,
                        batch: int = 1, heads: int = 1, device=None) -> "BlockStructure":
        """Classify (BLOCK_M x BLOCK_N) tiles as empty, partial or full, per batch and head."""
        return block_structure(self, q_len, kv_len, block_size, batch=batch, heads=heads, device=device)


class TracedMask:
    """A mask built while torch.compile traces a function (attngen.mask inside it): its terms'
    names and values only, combined with & and | like a Mask (a Mask built outside joins in).
    Template files cannot be read in a traced graph, so the attngen::attention operator checks the
    values and builds the Mask when it runs; `spec()` is the text it receives."""

    def __init__(self, tree):
        self.tree = tree  # ("term", name, ((param, value), ...)) or (op, left, right)

    @staticmethod
    def of(value):
        if isinstance(value, TracedMask):
            return value
        if not isinstance(value, Mask):
            return None
        nodes = [TracedMask._node(value.tree)] if value.tree is not None else []
        nodes += [("term", t.template.name, tuple(t.values.items())) for t in value.mods]
        tree = nodes[0]
        for node in nodes[1:]:
            tree = ("&", tree, node)
        return TracedMask(tree)

    @staticmethod
    def _node(node):
        if is_term(node):
            return ("term", node.template.name, tuple(node.values.items()))
        return (node[0], TracedMask._node(node[1]), TracedMask._node(node[2]))

    def _combine(self, other, op, swap=False):
        other = TracedMask.of(other)
        if other is None:
            return NotImplemented
        left, right = (other, self) if swap else (self, other)
        return TracedMask((op, left.tree, right.tree))

    def __and__(self, other):
        return self._combine(other, "&")

    def __or__(self, other):
        return self._combine(other, "|")

    def __rand__(self, other):
        return self._combine(other, "&", swap=True)

    def __ror__(self, other):
        return self._combine(other, "|", swap=True)

    def spec(self) -> tuple[str, list]:
        """(parse_spec text, its tensors)."""
        tensors = []

        def text(node):
            if node[0] == "term":
                return _spec_call(node[1], node[2], tensors)
            return f"({text(node[1])} {node[0]} {text(node[2])})"

        return text(self.tree), tensors


_TENSOR_PREFIX = "tensor_"  # parse_spec's placeholder of the i-th tensor: tensor_0, tensor_1, ...


def _spec_call(name: str, values, tensors: list) -> str:
    """`name(param=value, ...)` of a spec, each tensor written as the next placeholder (and
    appended to `tensors`)."""
    shown = []
    for param, value in values:
        if isinstance(value, torch.Tensor):
            shown.append(f"{param}={_TENSOR_PREFIX}{len(tensors)}")
            tensors.append(value)
        else:
            shown.append(f"{param}={value!r}")
    return f"{name}({', '.join(shown)})"
SPEC_SYNTAX = ("a template name, or name(param=value, ...), joined by & and |, e.g. "
               "'sliding_window(window=256) & softcap(cap=30.0)'")
_SPECS = BoundedCache("masks.specs", 1024)  # spec text -> (templates' generation, mask)


def mask(name: str, **params) -> Mask:
    """A mask (or score modifier) from the template `name` with its parameters."""
    if not isinstance(name, str):
        raise TypeError(f"mask name must be a str, got {type(name).__name__}")
    if torch.compiler.is_compiling():
        return TracedMask(("term", name, tuple(params.items())))
    term = Term(get_template(name), params)
    return Mask(mods=(term,)) if term.template.kind == "score" else Mask(term)


def as_mask(value, argument: str = "mask") -> Mask | None:
    """`None`, a mask spec (a template name, or the command line's syntax) or a Mask, as given to
    attention(mask=...)."""
    if value is None or isinstance(value, Mask):
        return value
    if isinstance(value, str):
        # one Mask per spec text while the loaded templates stay the same; this is on every call's path,
        # so it reads no environment variable (a change of ATTNGEN_TEMPLATE_PATH is seen by new specs)
        parsed = _SPECS.get(value)
        if parsed is None or parsed[0] != templates_.generation():
            m = parse_spec(value)  # first: it may load the templates, a new generation
            parsed = _SPECS.put(value, (templates_.generation(), m))
        return parsed[1]
    raise TypeError(f"{argument} must be None, a mask spec ({SPEC_SYNTAX}) or an attngen mask object, "
                    f"got {type(value).__name__}")


def parse_spec(text: str, *, partial: bool = False, tensors=()) -> Mask | None:
    """A mask from text such as `causal & sliding_window(window=256) & softcap(cap=30.0)`.

    `none` is no mask. With `partial`, run-time parameters may be left out (enough to render).
    `tensors`: the values of the placeholders tensor_0, tensor_1, ... (Mask.spec writes them).
    """
    text = text.strip()
    if text in ("", "none"):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"mask spec {text!r} is not valid ({e.msg}); write {SPEC_SYNTAX}") from None

    def build(node) -> Mask:
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
            left, right = build(node.left), build(node.right)
            return left & right if isinstance(node.op, ast.BitAnd) else left | right
        if isinstance(node, ast.Name):
            name, kwargs = node.id, {}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
            name, kwargs = node.func.id, {}
            for kw in node.keywords:
                try:
                    kwargs[kw.arg] = _spec_value(kw.value, tensors)
                except ValueError:
                    raise ValueError(f"mask spec {text!r}: parameter {kw.arg!r} of {name} must be a literal (a "
                                     "number, a quoted string, True or False)") from None
        else:
            raise ValueError(f"mask spec {text!r}: expected {SPEC_SYNTAX}")
        template = get_template(name)
        try:
            term = Term(template, kwargs, partial=partial)
        except TypeError as e:  # a missing, unknown or mistyped parameter: show how to write the term
            raise TypeError(f"{e}; {_usage(template)}") from None
        return Mask(mods=(term,)) if term.template.kind == "score" else Mask(term)

    return build(tree)


def _spec_value(node, tensors):
    """A parameter's value in a spec: a literal, or a tensor placeholder."""
    if isinstance(node, ast.Name) and node.id.startswith(_TENSOR_PREFIX) and node.id[len(_TENSOR_PREFIX):].isdigit():
        index = int(node.id[len(_TENSOR_PREFIX):])
        if index >= len(tensors):
            raise TypeError(f"mask spec names {node.id} but {len(tensors)} tensor(s) were given")
        return tensors[index]
    return ast.literal_eval(node)


def _usage(template: Template) -> str:
    """How to write `template` with its required parameters, e.g. `in a mask spec: sliding_window(window=...)`."""
    required = [p for p in template.params.values() if p.required]
    args = ", ".join(f"{p.name}=..." for p in required)
    if any(p.type == "tensor" for p in required):
        return f"tensor parameters cannot be given in a mask spec: use attngen.mask({template.name!r}, {args})"
    return f"in a mask spec: {template.name}({args})" if args else f"in a mask spec: {template.name}"
