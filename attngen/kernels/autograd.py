"""The autograd Function of attngen.attention: the forward family's kernels, then the backward
family's (attngen.kernels.backward) from what the forward saved."""

from __future__ import annotations

import torch

from ..checks import draw_seed
from ..config import KernelConfig
from ..expr import SCORE_NAME
from .backward import BackwardPlan
from .forward import Plan


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


class TrainPlan:
    """Everything of a call with gradients but the tensors, prepared once per call signature: the
    forward's Plan (the LSE kept) and the backward's BackwardPlan, one per layout of dO (made at
    the first backward that brings it). The dispatcher's fast path keeps one per signature."""

    def __init__(self, q, k, v, mask, shape, scale: float, topk: int, fwd_config: KernelConfig,
                 bwd_config: KernelConfig, dropout_p: float, deterministic: bool = True):
        # no query (B, Hq or Sq is 0): nothing to launch, and no gradient reaches k and v
        self.empty = q.numel() == 0
        self.plan = None if self.empty else Plan(q, k, v, mask, shape, scale, topk, True, fwd_config, dropout_p)
        self.lse_shape = (shape.batch, shape.heads, shape.q_len)
        self.mask = mask
        self.topk = bool(topk)  # topk as check_topk gives it: 0 when plain softmax
        self.dropout = dropout_p > 0
        self.call = (shape, scale, bwd_config, fwd_config, dropout_p, deterministic)
        self.backwards: dict[tuple, BackwardPlan] = {}  # dO's strides -> the prepared backward

    def forward(self, q, k, v, seed: int):
        """(output, LSE, the top-k thresholds or None) of one call."""
        if self.empty:
            return torch.empty_like(q), q.new_empty(self.lse_shape, dtype=torch.float32), None
        return self.plan.launch(q, k, v, seed)

    def backward(self, q, k, v, out, lse, thr, dout, dlse, seed: int):
        """(dQ, dK, dV) of one call."""
        if self.empty:
            return torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        plan = self.backwards.get(dout.stride())
        if plan is None:
            if len(self.backwards) >= 4:  # a caller whose dO changes layout every call: keep a few
                self.backwards.clear()
            shape, scale, bwd_config, fwd_config, dropout_p, deterministic = self.call
            plan = self.backwards[dout.stride()] = BackwardPlan(q, k, v, out, lse, thr, dout, self.mask, shape, scale,
                                                                bwd_config, fwd_config, dropout_p, deterministic)
        return plan.run(q, k, v, out, lse, thr, dout, dlse, seed)


class AttentionFunction(torch.autograd.Function):
    """Saves q, k, v, the output, the LSE and, for top-k, the thresholds; nothing (Sq, Sk)-sized.
    Runs a TrainPlan's launches."""

    @staticmethod
    def forward(ctx, q, k, v, plan: TrainPlan):
        seed = draw_seed() if plan.dropout else 0
        out, lse, thr = plan.forward(q, k, v, seed)
        ctx.save_for_backward(q, k, v, out, lse, thr)
        ctx.plan, ctx.seed = plan, seed
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, thr = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = ctx.plan.backward(q, k, v, out, lse, thr, dout, dlse, ctx.seed)
        return dq, dk, dv, None
