"""attngen.attention: checks, the dispatcher's choice, and the launch, with a fast path for calls
whose signature was seen before."""

from __future__ import annotations

import torch

from . import dispatch
from . import masks as masks_
from . import ops
from .caches import BoundedCache
from .checks import check_dropout, check_flag, check_qkv, check_scale, check_topk, draw_seed
from .families import DECODE, FORWARD
from .kernels.autograd import AttentionFunction, TrainPlan, check_mask_grads, check_modifiers
from .kernels.decode import ShortQueryPlan, takes_short_query
from .kernels.forward import Plan, forward

_plans = BoundedCache("api.plans", 4096)  # call signature -> Plan
_tensor_plans = BoundedCache("api.tensor_plans", 64)  # the same, for masks with tensors
dispatch.on_registry_change(_plans.clear)  # a new registry may choose other configs
dispatch.on_registry_change(_tensor_plans.clear)


def attention(q, k, v, mask=None, *, scale=None, return_lse=False, topk=None, dropout_p=0.0, deterministic=True):
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
    deterministic: True (the default): two backward passes on the same inputs give the same bits.
    False: the dK/dV programs also add dQ's shares with atomics and no dQ programs run (two
    fewer matrix products a tile; on an H200 no faster, as the atomics cost as much: see
    benchmarks/RESULTS.md), and dQ's rounding varies from run to run; under
    torch.use_deterministic_algorithms(True) the deterministic kernels run instead, as torch's own
    operators with a deterministic alternative do.
    """
    if type(return_lse) is not bool:  # before the fast path: a plan keyed by True must not take 'yes'
        check_flag("return_lse", return_lse)
    if type(deterministic) is not bool:
        check_flag("deterministic", deterministic)
    if not deterministic and torch.are_deterministic_algorithms_enabled():
        deterministic = True
    if torch.compiler.is_compiling():  # torch.compile / export record the attngen::attention operator
        return ops.attention(q, k, v, mask, scale=scale, return_lse=return_lse, topk=topk, dropout_p=dropout_p,
                             deterministic=deterministic)
    m = masks_.as_mask(mask)
    tensors = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    grad = torch.is_grad_enabled() and tensors and (q.requires_grad or k.requires_grad or v.requires_grad)
    if tensors:
        # fast path: one prepared launch per call signature (with gradients: the forward's and the
        # backward's); a mask's tensors are part of it (by identity and version: the plan holds
        # them, so an id is not reused while it lives), in a smaller cache, as a new tensor per call
        # (an SDPA mask) would fill it with dead plans
        plans = _plans if m is None or not m.has_tensors else _tensor_plans
        mask_key = None if m is None else m.plan_key()
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, mask_key, scale, return_lse, topk, dropout_p, grad, deterministic)
        plan = plans.get(key)
        if plan is None:
            shape = check_qkv(q, k, v, kernel=True)
            if q.numel() == 0:  # nothing to compute (B, Hq or Sq is 0): no plan
                return _checked(q, k, v, m, scale, return_lse, topk, dropout_p, grad, deterministic)
            generation = plans.generation  # read before the choice: a registry change meanwhile drops the plan
            plan = plans.put(key, _plan(q, k, v, m, shape, scale, return_lse, topk, dropout_p, grad, deterministic),
                             generation)
        if not grad:
            out, lse = plan.run(q, k, v)
            return (out, lse) if return_lse else out
        if m is not None and m.has_tensors:
            check_mask_grads(m)  # a mask tensor may have started to require grad since the plan was made
        out, lse = AttentionFunction.apply(q, k, v, plan)
        return (out, lse) if return_lse else out
    return _checked(q, k, v, m, scale, return_lse, topk, dropout_p, grad, deterministic)


def _plan(q, k, v, m, shape, scale, return_lse, topk, dropout_p, grad=False, deterministic=True):
    """The prepared launches of a call: with gradients a TrainPlan (the forward and backward
    kernels); without, the decode kernels for a short query (kernels.decode.takes_short_query), the
    forward kernel otherwise."""
    topk, dropout_p, scale = check_topk(topk, shape.kv_len), check_dropout(dropout_p), check_scale(scale, shape.head_dim)
    if grad:
        return _train_plan(q, k, v, m, shape, scale, topk, dropout_p, deterministic)
    if takes_short_query(shape, topk, dropout_p):
        return ShortQueryPlan(q, k, v, m, shape, scale, return_lse, dispatch.choose_config(DECODE, q, shape, m).config)
    config = dispatch.choose_config(FORWARD, q, shape, m, topk, dropout_p > 0).config
    return Plan(q, k, v, m, shape, scale, topk, return_lse, config, dropout_p)


def _train_plan(q, k, v, m, shape, scale, topk, dropout_p, deterministic) -> TrainPlan:
    """The TrainPlan of a call with gradients (checked arguments)."""
    check_mask_grads(m)
    check_modifiers(m)
    configs = dispatch.train_configs(q, shape, m, topk, dropout_p, deterministic)
    return TrainPlan(q, k, v, m, shape, scale, topk, *configs, dropout_p, deterministic)


def _checked(q, k, v, m, scale, return_lse, topk, dropout_p, grad, deterministic):
    """Every call checked in full: autograd, empty outputs (a call without gradients on tensors that
    are not empty takes the fast path's plan)."""
    shape = check_qkv(q, k, v, kernel=True)
    topk = check_topk(topk, shape.kv_len)
    scale = check_scale(scale, shape.head_dim)
    dropout_p = check_dropout(dropout_p)
    if grad:
        out, lse = AttentionFunction.apply(q, k, v, _train_plan(q, k, v, m, shape, scale, topk, dropout_p,
                                                                deterministic))
    else:
        config = dispatch.choose_config(FORWARD, q, shape, m, topk, dropout_p > 0).config
        seed = draw_seed() if dropout_p > 0 else 0
        out, lse, _ = forward(q, k, v, m, shape, scale, topk, return_lse, config, dropout_p=dropout_p, seed=seed)
    return (out, lse) if return_lse else out
