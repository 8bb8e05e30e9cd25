"""attngen.attention as PyTorch operators: torch.compile, torch.export and AOT autograd see one node.

`attngen::attention` and `attngen::attention_backward` are custom operators (torch.library) with
fake implementations (output shapes only) and the backward registered as the forward's autograd
formula, so dynamo puts a call into the graph instead of tracing attngen's Python (mask objects,
caches, the dispatcher). A mask crosses the operator boundary as its spec text and its tensors
(`Mask.spec`, `Mask.spec_tensors`); a dropout seed as a CPU tensor drawn from torch's generator
inside the graph, so a compiled model draws a new mask every step.

attngen.attention calls `attention` below while dynamo traces (torch.compiler.is_compiling());
eager calls keep the dispatcher's fast path, which costs less host time than an operator call.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from . import masks as masks_
from .caches import BoundedCache
from .checks import check_dropout, check_qkv, check_scale, check_topk
from .kernels.autograd import TrainPlan, check_mask_grads, check_modifiers

# call signature -> TrainPlan, for the operators' calls (masks with tensors in a smaller cache, as in api)
_plans = BoundedCache("ops.plans", 1024)
_tensor_plans = BoundedCache("ops.tensor_plans", 64)
dispatch.on_registry_change(_plans.clear)
dispatch.on_registry_change(_tensor_plans.clear)


def _mask(spec: str, tensors: list[Tensor]):
    """The Mask of a spec (a template name or `attngen.masks.parse_spec` text) and its tensors."""
    return masks_.parse_spec(spec, tensors=tensors) if tensors else masks_.as_mask(spec)


def _checked(q, k, v, spec, tensors, scale, topk):
    m = _mask(spec, tensors)
    shape = check_qkv(q, k, v, kernel=True)
    return m, shape, check_scale(scale, shape.head_dim), check_topk(topk, shape.kv_len)


def _seed(seed: Optional[Tensor]) -> int:
    return 0 if seed is None else int(seed.item())  # a CPU tensor: no device synchronisation


def _plan(q, k, v, spec: str, tensors: list[Tensor], scale, topk, dropout_p, deterministic: bool) -> TrainPlan:
    """The TrainPlan of an operator call, prepared once per call signature: the forward and the
    backward operator of one call find the same plan. A mask's tensors are part of the signature by
    their memory, layout and version (a compiled graph hands the operator a new tensor object for the
    same mask tensor every call; the plan holds the first, so its memory is not reused while it lives,
    and an in-place change through any alias moves the shared version)."""
    plans = _tensor_plans if tensors else _plans
    mask_key = tuple((t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device) for t in tensors)
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
           k.device, v.device, spec, mask_key, scale, topk, dropout_p, deterministic)
    plan = plans.get(key)
    if plan is None:
        m, shape, scale, topk = _checked(q, k, v, spec, tensors, scale, topk)
        dropout_p = check_dropout(dropout_p)
        generation = plans.generation  # read before the choice: a registry change meanwhile drops the plan
        configs = dispatch.train_configs(q, shape, m, topk, dropout_p, deterministic)
        plan = plans.put(key, TrainPlan(q, k, v, m, shape, scale, topk, *configs, dropout_p, deterministic), generation)
    return plan


@torch.library.custom_op("attngen::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, mask: str, mask_tensors: list[Tensor], scale: Optional[float],
                 topk: Optional[int], dropout_p: float, seed: Optional[Tensor],
                 deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(output, lse, top-k thresholds: empty without top-k) of attngen.attention."""
    plan = _plan(q, k, v, mask, mask_tensors, scale, topk, dropout_p, deterministic)
    out, lse, thr = plan.forward(q, k, v, _seed(seed))
    return out, lse, thr if thr is not None else q.new_empty(0, dtype=torch.float32)


@attention_op.register_fake
def _attention_fake(q, k, v, mask, mask_tensors, scale, topk, dropout_p, seed, deterministic):
    batch, heads, q_len, _ = q.shape
    thr = 2 * batch * heads * q_len if topk is not None and topk < k.shape[2] else 0  # as check_topk
    return (torch.empty_like(q), q.new_empty((batch, heads, q_len), dtype=torch.float32),
            q.new_empty((thr,), dtype=torch.float32))


@torch.library.custom_op("attngen::attention_backward", mutates_args=())
def attention_backward_op(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                          lse: Tensor, thr: Tensor, mask: str, mask_tensors: list[Tensor], scale: Optional[float],
                          topk: Optional[int], dropout_p: float, seed: Optional[Tensor],
                          deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attngen::attention from its saved outputs."""
    plan = _plan(q, k, v, mask, mask_tensors, scale, topk, dropout_p, deterministic)
    check_modifiers(plan.mask)
    return plan.backward(q, k, v, out, lse, thr if plan.topk else None, dout, dlse, _seed(seed))


@attention_backward_op.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse, thr, mask, mask_tensors, scale, topk, dropout_p, seed,
                             deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, mask_tensors, scale, topk, dropout_p, seed, deterministic = inputs
    out, lse, thr = output
    ctx.save_for_backward(q, k, v, out, lse, thr, seed, *mask_tensors)
    ctx.call = (mask, scale, topk, dropout_p, deterministic)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, dthr):
    q, k, v, out, lse, thr, seed, *mask_tensors = ctx.saved_tensors
    mask, scale, topk, dropout_p, deterministic = ctx.call
    no_grads = [None] * len(mask_tensors)  # the gradients' structure is that of the inputs
    if dout is None and dlse is None:
        return None, None, None, None, no_grads, None, None, None, None, None
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = attention_backward_op(dout, dlse, q, k, v, out, lse, thr, mask, mask_tensors, scale, topk,
                                       dropout_p, seed, deterministic)
    return dq, dk, dv, None, no_grads, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q, k, v, mask, *, scale, return_lse: bool, topk, dropout_p, deterministic: bool = True):
    """attngen.attention through the operator (what dynamo records). Reads no shape, so a
    dynamic sequence length stays symbolic."""
    if mask is None:
        spec, tensors = "none", []
    elif isinstance(mask, str):
        spec, tensors = mask, []
    elif isinstance(mask, masks_.Mask):
        spec, tensors = mask.spec, list(mask.spec_tensors)
        check_mask_grads(mask)
    elif isinstance(mask, masks_.TracedMask):
        spec, tensors = mask.spec()
        for value in tensors:
            if value.requires_grad:
                raise TypeError("a mask parameter requires grad: attngen computes no gradient for mask parameters "
                                "(detach it, or use attngen.reference for such a model)")
    else:
        raise TypeError(f"mask must be None, a mask name or an attngen mask object, got {type(mask).__name__}")
    dropout_p = check_dropout(dropout_p)
    seed = torch.randint(0, 2**31 - 1, (1,)) if dropout_p > 0 else None
    out, lse, _ = attention_op(q, k, v, spec, tensors, scale, topk, dropout_p, seed, deterministic)
    return (out, lse) if return_lse else out
