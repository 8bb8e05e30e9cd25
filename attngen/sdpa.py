"""attngen behind PyTorch's SDPA signature: `scaled_dot_product_attention`, a drop-in for
torch.nn.functional.scaled_dot_product_attention, and `sdpa_override`, which routes a model's
existing SDPA calls to it without editing the model.

The semantics are torch's (its math backend on the CPU is the definition): batch dimensions
broadcast, a boolean attn_mask keeps where True, a float one is added to the scaled scores,
is_causal is the top-left causal mask (both apply when attn_mask is given too, as in torch 2.13;
torch 2.11 raises there),
enable_gqa lets key/value have fewer heads, a row with no visible key gives 0. Bad input raises
what torch raises (RuntimeError for mismatched tensors, TypeError for a non-tensor argument).
Unlike torch, the tensors must be float16, bfloat16 or float32 (attngen's kernels).
"""

from __future__ import annotations

import math

import torch
from torch.overrides import TorchFunctionMode

from .api import attention
from .dtypes import SUPPORTED as SUPPORTED_DTYPES
from .masks import mask as make_mask

_SDPA = torch.nn.functional.scaled_dot_product_attention


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention computed by attngen's kernels.

    query (..., L, E), key (..., S, E), value (..., S, Ev): the leading dimensions broadcast (with
    enable_gqa, the query's heads (dim -3) may be a multiple of the key's). attn_mask broadcasts to
    (..., L, S). Ev != E pads the narrower side with zeros (a copy); scale <= 0 negates or zeroes a
    copy of the query (attngen's kernels take a positive scale). Differentiable like attention().
    """
    for name, t in (("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask)):
        if not isinstance(t, torch.Tensor) and not (name == "attn_mask" and t is None):
            raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be Tensor, not {type(t).__name__}")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(f"Expected query, key, and value to have the same dtype, but got query.dtype: {query.dtype} "
                           f"key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"attngen's kernels take float16, bfloat16 or float32 tensors, got {query.dtype}")
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise RuntimeError("query, key and value must have at least 2 dimensions (..., seq_len, head_dim)")
    if query.size(-1) != key.size(-1):
        raise RuntimeError(f"query and key must have the same last dimension, got {query.size(-1)} and {key.size(-1)}")
    if key.size(-2) != value.size(-2):
        raise RuntimeError(f"key and value must have the same sequence length, got {key.size(-2)} and {value.size(-2)}")
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise RuntimeError(f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                           f"attn_mask.dtype: {attn_mask.dtype} and  query.dtype: {query.dtype} instead.")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise RuntimeError(f"dropout_p must be a float in [0, 1], got {dropout_p!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")

    length, kv_len, head_dim, v_dim = query.size(-2), key.size(-2), query.size(-1), value.size(-1)
    q, k, v = _broadcast(query, key, value, enable_gqa)
    out_shape = q.shape[:-1] + (v_dim,)
    if kv_len == 0 or dropout_p == 1.0:  # every weight gone: torch gives zeros
        return query.new_zeros(out_shape)
    q, k, v = (_four(t) for t in (q, k, v))  # (B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev)
    batch_shape = q.shape[:2]

    m = make_mask("causal") if is_causal else None
    if attn_mask is not None:
        full = attn_mask.expand(*batch_shape, length, kv_len)
        if attn_mask.dtype == torch.bool:
            m = _and(m, make_mask("keep", keep=full))
        else:  # -inf hides the key (also from the softmax's sum: a row with none left gives 0)
            m = _and(_and(m, make_mask("keep", keep=full != float("-inf"))), make_mask("bias", bias=full))

    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if scale <= 0:  # scale * q·k == |scale| * (-q)·k; scale 0: every score 0
        q = -q if scale < 0 else torch.zeros_like(q)
        scale = -scale if scale < 0 else 1.0
    if v_dim != head_dim:  # attngen's kernels take one head dim: zeros change neither scores nor outputs
        width = max(head_dim, v_dim)
        q, k, v = (torch.nn.functional.pad(t, (0, width - t.size(-1))) for t in (q, k, v))
    out = attention(q, k, v, mask=m, scale=scale, dropout_p=float(dropout_p))
    return out[..., :v_dim].reshape(out_shape)


def _and(a, b):
    return b if a is None else a & b


def _broadcast(query, key, value, enable_gqa: bool):
    """query, key and value with their leading dimensions broadcast (views)."""
    if enable_gqa and min(query.dim(), key.dim(), value.dim()) >= 3:
        heads, kv_heads = query.size(-3), key.size(-3)
        if value.size(-3) != kv_heads or kv_heads == 0 or heads % kv_heads:
            raise RuntimeError(f"Number of heads in key and value must divide the number of heads in query, got "
                               f"query {heads}, key {kv_heads}, value {value.size(-3)} heads")
        outer = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
        q = query.expand(*outer, *query.shape[-3:])
        k, v = (t.expand(*outer, *t.shape[-3:]) for t in (key, value))
    else:
        outer = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
        q, k, v = (t.expand(*outer, *t.shape[-2:]) for t in (query, key, value))
    return q, k, v


def _four(t):
    """t as (B, H, S, D): the leading dimensions flatten into B (all but the last) and H (the last)."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    return t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:])


class sdpa_override(TorchFunctionMode):
    """Within `with attngen.sdpa_override():`, calls of torch.nn.functional.scaled_dot_product_attention
    run attngen.scaled_dot_product_attention instead: a model's attention goes to attngen's kernels
    without editing the model. Other functions are untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _SDPA:
            return scaled_dot_product_attention(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
