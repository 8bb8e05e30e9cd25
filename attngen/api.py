"""attngen.attention: checks, the dispatcher's choice, and the launch, with a fast path for calls
whose signature was seen before."""

from __future__ import annotations

import torch

from . import dispatch
from . import masks as masks_
from .checks import check_dropout, check_flag, check_qkv, check_scale, check_topk, draw_seed
from .expr import SCORE_NAME
from .families import BACKWARD, FORWARD
from .kernels.autograd import AttentionFunction
from .kernels.forward import Plan, forward

_plans: dict[tuple, Plan] = {}
_MAX_PLANS = 4096
dispatch.on_registry_change(_plans.clear)  # a new registry may choose other configs


def attention(q, k, v, mask=None, *, scale=None, return_lse=False, topk=None, dropout_p=0.0):
    """Attention of q (B, Hq, Sq, D) over k, v (B, Hkv, Sk, D) with an optional mask.

    mask: None, a mask spec ("causal", "sliding_window(window=256) & softcap(cap=30.0)": the command
    line's syntax) or a mask object (attngen.mask(...), combined with & |).
    scale: defaults to 1 / sqrt(D). Returns the output (q's dtype and shape), or (output, lse) with
    return_lse=True, lse being the natural-log log-sum-exp of every row, fp32, shape (B, Hq, Sq).
    topk: top-k softmax: each row's softmax runs over its `topk` largest scores among the keys the
    mask shows (every score equal to the topk-th largest is kept too); None or >= Sk: all of them.
    dropout_p: drop each attention weight with this probability and scale the rest by 1 / (1 - p),
    as SDPA does (pass 0 outside training); the mask is drawn from torch's default generator.
    Differentiable: dQ, dK and dV come from attngen's backward kernels.
    """
    if type(return_lse) is not bool:  # before the fast path: a plan keyed by True must not take 'yes'
        check_flag("return_lse", return_lse)
    m = masks_.as_mask(mask)
    tensors = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    grad = torch.is_grad_enabled() and tensors and (q.requires_grad or k.requires_grad or v.requires_grad)
    if tensors and not grad and (m is None or not m.has_tensors):
        # fast path: one prepared launch per call signature
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, None if m is None else m.call_key, scale, return_lse, topk, dropout_p)
        plan = _plans.get(key)
        if plan is None:
            shape = check_qkv(q, k, v, kernel=True)
            if shape.q_len == 0:
                return _checked(q, k, v, m, scale, return_lse, topk, dropout_p, grad)
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            effective = check_topk(topk, shape.kv_len)
            config = dispatch.choose_config(FORWARD, q, shape, m, effective).config
            plan = _plans[key] = Plan(q, k, v, m, shape, check_scale(scale, shape.head_dim), effective, return_lse,
                                      config, check_dropout(dropout_p))
        out, lse = plan.run(q, k, v)
        return (out, lse) if return_lse else out
    return _checked(q, k, v, m, scale, return_lse, topk, dropout_p, grad)


def _checked(q, k, v, m, scale, return_lse, topk, dropout_p, grad):
    """Every call checked in full: autograd, masks with tensor parameters, empty queries."""
    shape = check_qkv(q, k, v, kernel=True)
    topk = check_topk(topk, shape.kv_len)
    config = dispatch.choose_config(FORWARD, q, shape, m, topk).config
    scale = check_scale(scale, shape.head_dim)
    dropout_p = check_dropout(dropout_p)
    seed = draw_seed() if dropout_p > 0 else 0
    if grad:
        _check_differentiable(m)
        bwd_config = dispatch.choose_config(BACKWARD, q, shape, m, topk).config
        out, lse = AttentionFunction.apply(q, k, v, m, shape, scale, topk, config, bwd_config, dropout_p, seed)
    else:
        out, lse, _ = forward(q, k, v, m, shape, scale, topk, return_lse, config, dropout_p=dropout_p, seed=seed)
    return (out, lse) if return_lse else out


def _check_differentiable(m) -> None:
    """Mask tensors get no gradient: a float one that requires grad is an error, not a silent zero;
    a score modifier without a derivative is an error before the forward runs."""
    if m is None:
        return
    for term in m.terms():
        for name, value in term.values.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise TypeError(f"mask {term.template.name!r} parameter {name!r} requires grad: attngen computes no "
                                "gradient for mask parameters (detach it, or use attngen.reference for such a model)")
    try:
        for term in m.mods:
            term.expr.derivative(SCORE_NAME)  # cached on the expression: computed once per template
    except ValueError as e:
        raise ValueError(f"attngen cannot differentiate this mask's score modifiers: {e}") from None
