"""attngen.decode: attention of a few new tokens per sequence against a KV cache (contiguous or
paged), split over the keys; the dispatcher's choice and a plan per call signature, as attngen.attention."""

from __future__ import annotations

import torch

from . import dispatch
from . import masks as masks_
from .caches import BoundedCache
from .checks import check_flag, check_scale
from .families import DECODE
from .kernels.decode import DecodePlan, check_decode, validate_values

_plans = BoundedCache("decoding.plans", 256)  # call signature -> DecodePlan
dispatch.on_registry_change(_plans.clear)


def decode(q, k_cache, v_cache, seq_lens=None, *, block_table=None, mask=None, scale=None, return_lse=False,
           validate=True):
    """Attention of the Sq new tokens of each sequence, q (B, Hq, Sq, D), over its keys in a KV cache.

    k_cache, v_cache: contiguous (B, Hkv, S, D), or paged (num_pages, page_size, Hkv, D) with
    block_table (B, pages per sequence) int32/int64: key j of sequence b is row j % page_size of page
    block_table[b, j // page_size] (vLLM's and FlashInfer's layout).
    seq_lens: (B,) int32/int64, each sequence's length with its new tokens (written to the cache
    before the call): they are its last Sq positions. Default (contiguous only): S for every sequence.
    mask: as attngen.attention's. Masks see positions counted from the sequence's start: new token i
    of sequence b is at q_idx = seq_lens[b] - Sq + i, and q_len = kv_len = seq_lens[b], so causal
    (either alignment) lets it see itself and the keys before it. Mask tensors are sized for the
    cache's capacity (S, or pages per sequence * page_size).
    scale: default 1 / sqrt(D). return_lse: also return the natural-log LSE (B, Hq, Sq), fp32.
    validate: check that every length lies in [Sq, capacity] and that every page a sequence uses is
    a page of the cache (one device synchronisation); skipped while a CUDA graph is being captured.
    With validate=False, bad values give wrong results but never a read outside the cache.
    Lengths and block tables may change from call to call without recompiling. Inference only: no
    gradients (use attngen.attention to train).
    """
    check_flag("validate", validate)
    if type(return_lse) is not bool:
        check_flag("return_lse", return_lse)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError("attngen.decode has no backward: call it under torch.no_grad() or torch.inference_mode(), "
                         "or use attngen.attention to train")
    if scale is not None:
        check_scale(scale, 1)  # a bad type or value fails here, not as an unhashable cache key
    m = masks_.as_mask(mask)
    key = None
    if all(isinstance(t, torch.Tensor) for t in (q, k_cache, v_cache)) and all(
            t is None or isinstance(t, torch.Tensor) for t in (seq_lens, block_table)):
        # a plan per call signature; the index tensors' values change freely, their layout is part of it
        index = tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in (seq_lens, block_table))
        mask_key = None if m is None else m.plan_key()
        key = (q.shape, k_cache.shape, v_cache.shape, q.stride(), k_cache.stride(), v_cache.stride(), q.dtype,
               k_cache.dtype, v_cache.dtype, q.device, k_cache.device, v_cache.device, index, mask_key, scale,
               return_lse)
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        shape, cache = check_decode(q, k_cache, v_cache, seq_lens, block_table)
        generation = _plans.generation
        config = dispatch.choose_config(DECODE, q, shape, m, paged=cache.paged).config
        plan = DecodePlan(q, k_cache, v_cache, block_table, seq_lens, m, shape, cache,
                          check_scale(scale, shape.head_dim), return_lse, config)
        if key is not None:
            plan = _plans.put(key, plan, generation)
    if validate and seq_lens is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        validate_values(seq_lens, block_table, plan.shape, plan.cache)  # the plan's key fixes both
    out, lse = plan.run(q, k_cache, v_cache, block_table, seq_lens)
    return (out, lse) if return_lse else out
