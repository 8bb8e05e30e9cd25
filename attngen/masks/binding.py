"""A mask bound to one call: its kernel arguments, its Triton source, and its torch evaluation.

The same expression of every template renders to Triton here (`triton_sources`) and evaluates in
torch here (`predicate_fn`, `score_fn`), so the kernel, the reference and the block classification
always agree. A mask's predicate is a tree: a term, or `(op, left, right)` with op `&` or `|`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..expr import SCORE_NAME, TensorRef
from .template_files import BROADCAST_DIMS, MISSING, Param, dim_size, split_dim


def is_term(node) -> bool:
    """A leaf of a predicate tree (a template with its values), not an `(op, left, right)` node."""
    return node is not None and not isinstance(node, tuple)


@dataclass
class Bound:
    """A mask tied to one call's sizes: what the kernel and the reference need."""

    mask: object  # the attngen.masks.Mask
    kernel_args: list  # run-time values, in the order of kernel_params()
    env: dict  # name -> value for torch evaluation, keyed like the rendered names


def _arg_names(index: int, param: Param) -> list[str]:
    if param.type == "tensor":
        return [f"T{index}_{param.name.upper()}"] + [f"t{index}_{param.name}_stride{d}" for d in range(len(param.shape))]
    return [f"t{index}_{param.name}"]


def kernel_params(m) -> list[str]:
    """The kernel arguments a mask needs, in order."""
    if m is None:
        return []
    return [n for i, t in enumerate(m.terms()) for p in t.runtime for n in _arg_names(i, p)]


def scalar_params(m) -> list[str]:
    """The run-time scalar arguments (never specialised by Triton: a new value never recompiles)."""
    if m is None:
        return []
    return [_arg_names(i, p)[0] for i, t in enumerate(m.terms()) for p in t.runtime if p.type != "tensor"]


def _renames(index: int, term):
    rename, tensors = {}, {}
    for p in term.runtime:
        if p.type != "tensor":
            rename[p.name] = _arg_names(index, p)[0]
    for p in term.runtime:
        if p.type == "tensor":
            names = _arg_names(index, p)
            sizes = []
            for dim in p.shape:
                base, divisor = split_dim(dim)
                sizes.append(base if divisor is None else f"(({base} + {rename[divisor]} - 1) // {rename[divisor]})")
            tensors[p.name] = TensorRef(pointer=names[0], strides=tuple(names[1:]), sizes=tuple(sizes))
    return rename, tensors


def triton_sources(m) -> tuple[str | None, list[str]]:
    """(visibility expression or None, [score modifier expressions]) as Triton source."""
    if m is None:
        return None, []
    terms = m.terms()
    index = {id(t): i for i, t in enumerate(terms)}

    def walk(node):
        if is_term(node):
            return "(" + node.expr.to_triton(*_renames(index[id(node)], node)) + ")"
        return f"({walk(node[1])} {node[0]} {walk(node[2])})"

    visible = walk(m.tree) if m.tree is not None else None
    mods = [t.expr.to_triton(*_renames(index[id(t)], t)) for t in m.mods]
    return visible, mods


def triton_score_grads(m) -> list[str]:
    """The derivative of each score modifier with respect to `score`, as Triton source (the chain
    rule of the backward kernels): generated from the modifier's own expression. A modifier whose
    expression has no derivative raises ExprError naming it."""
    if m is None:
        return []
    terms = m.terms()
    index = {id(t): i for i, t in enumerate(terms)}
    return [t.expr.derivative(SCORE_NAME).to_triton(*_renames(index[id(t)], t)) for t in m.mods]


def bind(m, *, batch: int, heads: int, q_len: int, kv_len: int, device) -> Bound | None:
    """Check the mask's tensors against the call's sizes and collect the kernel arguments."""
    if m is None:
        return None
    sizes = {"batch": batch, "heads": heads, "q_len": q_len, "kv_len": kv_len}
    args, env = [], {}
    for i, term in enumerate(m.terms()):
        for p in term.runtime:
            value = term.values.get(p.name, MISSING)
            if value is MISSING:
                raise TypeError(f"mask {term.template.name!r} is missing parameter {p.name!r} ({p.describe()})")
            if p.type != "tensor":
                args.append(value)
                env[_arg_names(i, p)[0]] = value
                continue
            strides, expected = [], [dim_size(dim, sizes, term.values) for dim in p.shape]
            for d, (dim, n, want) in enumerate(zip(p.shape, value.shape, expected)):
                if n != want and not (n == 1 and dim in BROADCAST_DIMS):
                    broadcast = " (or 1)" if dim in BROADCAST_DIMS else ""
                    raise ValueError(f"mask {term.template.name!r} parameter {p.name!r}: dimension {d} ({dim}) "
                                     f"has size {n}, expected {want}{broadcast}; shape {tuple(value.shape)}")
                strides.append(0 if n == 1 and want != 1 else value.stride(d))
            if not same_device(value.device, device):
                raise ValueError(f"mask {term.template.name!r} parameter {p.name!r} is on {value.device}, "
                                 f"but q is on {device}")
            args += [value] + strides
            env[_arg_names(i, p)[0]] = value.expand(*expected)
    return Bound(m, args, env)


def same_device(a, b) -> bool:
    """`cuda` and `cuda:0` are the same device when 0 is the current one."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None or b.index is None):
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def index_env(q_idx: torch.Tensor, kv_idx: torch.Tensor, *, q_len: int, kv_len: int, batch: int, heads: int,
              batches: int | None = None, head_count: int | None = None) -> dict:
    """The names a mask expression sees: b, h, q_idx, kv_idx as broadcastable (B, H, Q, K) tensors
    (b over `batches`, h over `head_count`: the call's sizes, or 1 where the mask is the same for all)."""
    device = q_idx.device
    nb = batch if batches is None else batches
    nh = heads if head_count is None else head_count
    return dict(b=torch.arange(nb, device=device).view(-1, 1, 1, 1), h=torch.arange(nh, device=device).view(1, -1, 1, 1),
                q_idx=q_idx.view(1, 1, -1, 1), kv_idx=kv_idx.view(1, 1, 1, -1), q_len=q_len, kv_len=kv_len,
                batch=batch, heads=heads)


def _term_env(index: int, term, bound: Bound, base: dict, dtype=None) -> dict:
    env = dict(base)
    for p in term.runtime:
        value = bound.env[_arg_names(index, p)[0]]
        if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.to(dtype)
        env[p.name] = value
    return env


def predicate_fn(bound: Bound, node=MISSING):
    """The mask's predicate (or the part `node` of its tree) as a function of an index environment.

    Every expression is looked up here, so the function itself is plain torch: FlexAttention can
    vmap and compile it as a mask_mod.
    """
    terms = bound.mask.terms()
    exprs = [t.expr for t in terms]
    position = {id(t): i for i, t in enumerate(terms)}

    def plan(n):  # the tree with each term replaced by its position in terms
        return position[id(n)] if is_term(n) else (n[0], plan(n[1]), plan(n[2]))

    tree = plan(bound.mask.tree if node is MISSING else node)

    def visible(index_env: dict):
        def walk(n):
            if isinstance(n, int):
                return exprs[n].evaluate(_term_env(n, terms[n], bound, index_env, torch.float64))
            left, right = walk(n[1]), walk(n[2])
            return (left & right) if n[0] == "&" else (left | right)
        return walk(tree)

    return visible


def score_fn(bound: Bound):
    """The mask's score modifiers, in order, as a function (score, index environment) -> score;
    plain torch like predicate_fn (FlexAttention's score_mod)."""
    terms = bound.mask.terms()
    exprs = [t.expr for t in terms]
    first = len(terms) - len(bound.mask.mods)

    def apply(score: torch.Tensor, index_env: dict) -> torch.Tensor:
        for i in range(first, len(terms)):
            env = _term_env(i, terms[i], bound, index_env, score.dtype)
            env[SCORE_NAME] = score
            new = exprs[i].evaluate(env)
            score = new if isinstance(new, torch.Tensor) else torch.full_like(score, float(new))
        return score

    return apply


def evaluate_visible(bound: Bound, index_env: dict, node=MISSING):
    """The mask's predicate (or the part `node` of its tree) evaluated with torch over `index_env`."""
    return predicate_fn(bound, node)(index_env)


def tree_terms(node) -> list:
    if is_term(node):
        return [node]
    return [] if node is None else tree_terms(node[1]) + tree_terms(node[2])


def predicate_names(node) -> set[str]:
    """Index names a predicate (tree) depends on (tells whether blocks differ by batch or head)."""
    names = set()
    for t in tree_terms(node):
        names |= t.expr.names
    return names
