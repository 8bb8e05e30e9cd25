"""The methods `attngen bench` compares, each computing the same attention on the same inputs.

    naive           torch: matmul, softmax, matmul (the mask a boolean tensor built once)
    naive_out       the same into buffers allocated once (matmul(out=), softmax(out=))
    compile         torch.compile(naive)
    sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math
                    F.scaled_dot_product_attention with that one backend forced
    flex            torch.compile(flex_attention), the mask a mask_mod and BlockMask, score
                    modifiers a score_mod
    attngen         attngen.attention through the dispatcher (the note says which config, from where)

Every mask is evaluated by the same torch code as the float64 reference (attngen.masks), so any
template runs in the torch methods. A method that cannot run a case raises Unsupported (or fails)
and its row says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import masks as masks_
from ..dtypes import DTYPES

METHODS = ("naive", "naive_out", "compile", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex",
           "attngen")


REFERENCE_SCORES = 1 << 29  # at most this many float64 scores in the reference (4 GiB a score-sized tensor)


def parse_mask(text: str) -> masks_.Mask | None:
    """A mask from --mask; parameters the command line cannot give (tensors) are a clear error."""
    try:
        return masks_.parse_spec(text)
    except TypeError as e:
        partial = masks_.parse_spec(text, partial=True)
        tensors = [f"{t.template.name}'s {p.name} ({p.describe()})" for t in (partial.terms() if partial else [])
                   for p in t.runtime if p.type == "tensor" and p.name not in t.values]
        if tensors:
            raise ValueError(f"--mask {text!r} needs tensor parameter(s) {', '.join(tensors)}, which cannot be given "
                             "on the command line; call attngen.tools.bench.run_cases from Python with a mask object") \
                from None
        raise TypeError(f"--mask {text!r}: {e}") from None
    except ValueError as e:
        raise ValueError(f"--mask {text!r}: {e}") from None


class Unsupported(Exception):
    """A method cannot run a case; the message says why (shown as the n/a reason)."""


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: str  # a key of DTYPES
    mask: str  # the spec as given (`none`, `causal`, ...), or a label when mask_object is given
    bwd: bool = False
    mask_object: masks_.Mask | None = field(default=None, compare=False, repr=False)  # default: parsed from `mask`

    def __post_init__(self):
        if self.mask_object is None:
            object.__setattr__(self, "mask_object", parse_mask(self.mask))

    @property
    def direction(self) -> str:
        return "fwd+bwd" if self.bwd else "fwd"

    def title(self) -> str:
        return (f"B={self.batch} H={self.heads} S={self.seq_len} D={self.head_dim}, {self.dtype}, mask {self.mask}, "
                f"{'forward + backward' if self.bwd else 'forward'}")


@dataclass
class Inputs:
    """One case's tensors on the device, shared by every method."""

    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor | None  # the gradient of the output, with --bwd
    mask: masks_.Mask | None
    bound: masks_.Bound | None
    scale: float
    device: torch.device

    @property
    def sizes(self) -> dict:
        c = self.case
        return dict(q_len=c.seq_len, kv_len=c.seq_len, batch=c.batch, heads=c.heads)


def make_inputs(case: Case, device, seed: int = 0) -> Inputs:
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (case.batch, case.heads, case.seq_len, case.head_dim)

    def rand():  # random normal, never zeros; fp32 first so every dtype draws the same values
        return torch.randn(shape, device=device, generator=g).to(DTYPES[case.dtype]).requires_grad_(case.bwd)

    q, k, v = rand(), rand(), rand()
    dout = rand().detach() if case.bwd else None
    m = case.mask_object
    bound = masks_.bind(m, batch=case.batch, heads=case.heads, q_len=case.seq_len, kv_len=case.seq_len, device=device)
    return Inputs(case, q, k, v, dout, m, bound, 1.0 / math.sqrt(case.head_dim), device)


def reference_slice(case: Case) -> tuple[int, int]:
    """(batches, heads) the error is measured on: all, or batch 0's first heads when they do not fit."""
    if case.mask_object is not None and case.mask_object.has_tensors:
        return case.batch, case.heads  # tensor parameters are sized for the whole call
    per_head = case.seq_len * case.seq_len
    if case.batch * case.heads * per_head <= REFERENCE_SCORES:
        return case.batch, case.heads
    return 1, max(1, min(case.heads, REFERENCE_SCORES // per_head))


def reference_results(p: Inputs) -> list[torch.Tensor]:
    """[out] (and dq, dk, dv with --bwd) in float64 on the reference slice."""
    from ..reference import attention as reference

    nb, nh = reference_slice(p.case)
    q, k, v = (t.detach()[:nb, :nh].to(torch.float64).requires_grad_(p.case.bwd) for t in (p.q, p.k, p.v))
    with torch.set_grad_enabled(p.case.bwd):
        out = reference(q, k, v, mask=p.mask, scale=p.scale)
        if not p.case.bwd:
            return [out]
        grads = torch.autograd.grad(out, (q, k, v), p.dout[:nb, :nh].to(torch.float64))
    return [out.detach()] + list(grads)


def max_rel_error(results, refs) -> float:
    """The largest max |x - ref| / max |ref| over the tensors compared (NaN when any result has one)."""
    worst = 0.0
    for x, ref in zip(results, refs):
        x = x[:ref.shape[0], :ref.shape[1]].detach().to(torch.float64)
        err = float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
        if math.isnan(err):
            return err
        worst = max(worst, err)
    return worst


def dense_visible(mask, *, batch: int, heads: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """The mask's boolean (B or 1, H or 1, Sq, Sk) tensor, True where a key is visible (B where the
    mask depends on `b`, else 1; the same for H)."""
    names = masks_.predicate_names(mask.tree)
    nb, nh = (batch if "b" in names else 1), (heads if "h" in names else 1)
    env = masks_.index_env(torch.arange(q_len, device=device), torch.arange(kv_len, device=device), q_len=q_len,
                           kv_len=kv_len, batch=batch, heads=heads, batches=nb, head_count=nh)
    bound = masks_.bind(mask, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, device=device)
    visible = torch.as_tensor(masks_.evaluate_visible(bound, env), device=device)
    return visible.expand(nb, nh, q_len, kv_len)


def torch_mods(p: Inputs) -> tuple[Callable | None, Callable | None]:
    """(mask_mod(b, h, q_idx, kv_idx), score_mod(score, b, h, q_idx, kv_idx)) as FlexAttention takes them.

    masks.predicate_fn and masks.score_fn: the reference's own torch evaluation, with every
    expression looked up before torch.compile traces the functions (it cannot trace the template
    cache). None where the mask has no predicate, or no score modifiers.
    """
    if p.mask is None:
        return None, None
    sizes = p.sizes
    visible = masks_.predicate_fn(p.bound) if p.mask.tree is not None else None
    mods = masks_.score_fn(p.bound) if p.mask.mods else None

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, **sizes))

    def score_mod(score, b, h, q_idx, kv_idx):
        return mods(score, dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, **sizes))

    return (mask_mod if visible is not None else None), (score_mod if mods is not None else None)


def _naive_parts(p: Inputs):
    """(hidden, mods): the positions to hide (a boolean tensor, built once) and a function applying
    the score modifiers to a (B, H, S, S) score, either None when the mask has none."""
    mask_mod, score_mod = torch_mods(p)
    hidden = ~dense_visible(p.mask, device=p.device, **p.sizes) if mask_mod is not None else None
    mods = None
    if score_mod is not None:
        positions = torch.arange(p.case.seq_len, device=p.device)
        ix = masks_.index_env(positions, positions, **p.sizes)
        b, h, q_idx, kv_idx = ix["b"], ix["h"], ix["q_idx"], ix["kv_idx"]
        mods = lambda score: score_mod(score, b, h, q_idx, kv_idx)  # noqa: E731
    return hidden, mods


def is_sdpa_causal(mask) -> bool:
    """The mask is exactly SDPA's is_causal=True (the built-in causal, aligned top left)."""
    term = mask.tree
    return (isinstance(term, masks_.Term) and not mask.mods and term.template.name == "causal"
            and term.template.path.parent == masks_.template_dirs()[0] and term.static == {"align": "top_left"})


def sdpa_kwargs(mask, *, batch: int, heads: int, q_len: int, kv_len: int, device) -> tuple[dict, str]:
    """The keyword arguments with which F.scaled_dot_product_attention computes exactly `mask`, and
    their description; raises Unsupported where SDPA has no form for it (score modifiers)."""
    if mask is None:
        return {}, "no mask"
    if mask.mods:
        names = ", ".join(t.template.name for t in mask.mods)
        raise Unsupported(f"SDPA has no form for score modifiers ({names})")
    if mask.tree is None:
        return {}, "no mask"
    if is_sdpa_causal(mask):
        return {"is_causal": True}, "is_causal=True"
    visible = dense_visible(mask, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, device=device)
    return {"attn_mask": visible}, f"boolean attn_mask of shape {tuple(visible.shape)}"


def naive_fn(p: Inputs) -> Callable:
    hidden, mods = _naive_parts(p)
    q, k, v, scale = p.q, p.k, p.v, p.scale

    def naive():
        score = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mods is not None:
            score = mods(score)
        if hidden is not None:
            score = score.masked_fill(hidden, float("-inf"))
        return torch.matmul(torch.softmax(score, dim=-1), v)

    return naive


def build_naive(p: Inputs):
    return naive_fn(p), "scores in the input dtype"


def build_naive_out(p: Inputs):
    hidden, mods = _naive_parts(p)
    q, k, v, scale = p.q, p.k, p.v, p.scale
    c = p.case
    score = torch.empty(c.batch, c.heads, c.seq_len, c.seq_len, device=p.device, dtype=q.dtype)
    probs = torch.empty_like(score)
    out = torch.empty_like(q)

    def naive_out():
        torch.matmul(q, k.transpose(-1, -2), out=score)
        score.mul_(scale)
        if mods is not None:
            score.copy_(mods(score))
        if hidden is not None:
            score.masked_fill_(hidden, float("-inf"))
        torch.softmax(score, dim=-1, out=probs)
        return torch.matmul(probs, v, out=out)

    return naive_out, "score, probabilities and output in buffers allocated once"


def build_compile(p: Inputs):
    return torch.compile(naive_fn(p)), "torch.compile(naive), default mode"


def _sdpa(backend: str):
    def build(p: Inputs):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if p.device.type != "cuda" and backend in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            raise Unsupported("needs a CUDA device")
        if not hasattr(SDPBackend, backend):
            raise Unsupported(f"this torch has no SDPA backend {backend}")
        kwargs, how = sdpa_kwargs(p.mask, device=p.device, **p.sizes)
        chosen, q, k, v, scale = getattr(SDPBackend, backend), p.q, p.k, p.v, p.scale

        def sdpa():
            with sdpa_kernel(chosen):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, **kwargs)

        return sdpa, how
    return build


_FLEX = None


def build_flex(p: Inputs):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention)
    mask_mod, score_mod = torch_mods(p)
    block_mask, how = None, "dense"
    if mask_mod is not None:
        names = masks_.predicate_names(p.mask.tree)
        c = p.case
        block_mask = create_block_mask(mask_mod, c.batch if "b" in names else None,
                                       c.heads if "h" in names else None, c.seq_len, c.seq_len, device=p.device)
        sparsity = block_mask.sparsity()  # meaningless (negative) when S is below Flex's block size
        how = "block mask" + (f" {sparsity:.0f}% sparse" if 0 <= sparsity <= 100 else "")
    if score_mod is not None:
        how += ", score_mod"
    flex, q, k, v, scale = _FLEX, p.q, p.k, p.v, p.scale
    return (lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)), how


def build_attngen(p: Inputs):
    from .. import api, dispatch

    if p.device.type == "cpu" and p.q.dtype == torch.bfloat16:
        raise Unsupported("bf16 is not run under Triton's interpreter (its bf16 tl.dot is wrong)")
    q, k, v, m, scale = p.q, p.k, p.v, p.mask, p.scale
    choice = dispatch.choose(q, k, v, m)
    return (lambda: api.attention(q, k, v, mask=m, scale=scale)), f"{choice.config} ({choice.source})"


BUILDERS: dict[str, Callable] = {
    "naive": build_naive,
    "naive_out": build_naive_out,
    "compile": build_compile,
    "sdpa_flash": _sdpa("FLASH_ATTENTION"),
    "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa_math": _sdpa("MATH"),
    "flex": build_flex,
    "attngen": build_attngen,
}


assert tuple(BUILDERS) == METHODS


def build(method: str, p: Inputs) -> tuple[Callable, str]:
    """A function running one step of `method` (the forward, or forward and backward with --bwd) and a note."""
    forward, note = BUILDERS[method](p)
    if not p.case.bwd:
        return forward, note
    q, k, v, dout = p.q, p.k, p.v, p.dout

    def step():
        out = forward()
        return [out, *torch.autograd.grad(out, (q, k, v), dout)]

    return step, note
