"""The autograd Function of attngen.attention: the forward family's kernels, then the backward
family's (attngen.kernels.backward) from what the forward saved."""

from __future__ import annotations

import torch

from ..expr import SCORE_NAME
from .backward import backward
from .forward import forward


def check_mask_grads(m) -> None:
    """Mask tensors get no gradient: a float one that requires grad is an error, not a silent zero."""
    if m is None:
        return
    for term in m.terms():
        for name, value in term.values.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise TypeError(f"mask {term.template.name!r} parameter {name!r} requires grad: attngen computes no "
                                "gradient for mask parameters (detach it, or use attngen.reference for such a model)")


def check_modifiers(m) -> None:
    """A score modifier without a derivative is an error before the forward runs."""
    if m is None:
        return
    try:
        for term in m.mods:
            term.expr.derivative(SCORE_NAME)  # cached on the expression: computed once per template
    except ValueError as e:
        raise ValueError(f"attngen cannot differentiate this mask's score modifiers: {e}") from None


class AttentionFunction(torch.autograd.Function):
    """Saves q, k, v, the output, the LSE and, for top-k, the thresholds; nothing (Sq, Sk)-sized."""

    @staticmethod
    def forward(ctx, q, k, v, mask, shape, scale, topk, fwd_config, bwd_config, dropout_p, seed):
        out, lse, thr = forward(q, k, v, mask, shape, scale, topk, True, fwd_config, dropout_p=dropout_p, seed=seed)
        ctx.save_for_backward(q, k, v, out, lse, thr)
        ctx.call = (mask, shape, scale, fwd_config, bwd_config, dropout_p, seed)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, thr = ctx.saved_tensors
        mask, shape, scale, fwd_config, bwd_config, dropout_p, seed = ctx.call
        if dout is None and dlse is None:
            return (None,) * 11
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward(q, k, v, out, lse, thr, dout, dlse, mask, shape, scale, bwd_config, fwd_config,
                              dropout_p, seed)
        return dq, dk, dv, None, None, None, None, None, None, None, None
