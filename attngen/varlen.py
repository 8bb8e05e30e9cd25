"""Packed sequences without padding: attngen.varlen_attention on (total_tokens, heads, head_dim)
tensors with cumulative sequence lengths, the layout of FlashAttention's varlen API.

The packed tokens run as one batch of one long sequence (a view, no copy) under the
`sequence_keys` mask (a query sees only its own sequence's keys) and the user's mask counted in
each sequence's own positions (its `__local` form: q_idx, kv_idx, q_len and kv_len replaced by
gathers from per-query tensors, which a kernel loads once per query tile). So every kernel family,
mask, top-k and dropout works unchanged, and only the tiles a sequence covers are visited. Nothing
synchronises with the device: the per-query tensors come from cu_seqlens by device ops, and are
kept (with the block classification they lead to) while the same cu_seqlens tensors are passed
again, e.g. by every layer of a model.
"""

from __future__ import annotations

import weakref

import torch

from . import masks as masks_
from .api import attention
from .caches import BoundedCache

_MAX_DERIVED = 64
_DERIVED = BoundedCache("varlen.positions", _MAX_DERIVED)  # (cu_seqlens ids and versions, lengths) -> positions


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, mask=None,
                     scale=None, return_lse=False, topk=None, dropout_p=0.0, deterministic=True):
    """Attention of packed sequences: q (total_q, Hq, D), k and v (total_k, Hkv, D); sequence i
    is rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k
    and v (int32 or int64, length N + 1, starting at 0, non-decreasing: not checked, which would
    synchronise). max_seqlen_q/k are accepted for FlashAttention's signature and not needed.

    mask: as for attention(), counted inside each sequence (causal is each sequence's own causal
    mask; align="bottom_right" lines up the ends of a sequence's queries and keys, as
    FlashAttention's varlen causal does). Masks that read tensors over positions (document, keep,
    bias, block layouts) are refused: their positions would be the packed ones.
    Returns the output (total_q, Hq, D), and with return_lse the LSE (Hq, total_q). Rows past
    cu_seqlens_q[-1] get output 0. scale, topk, dropout_p, deterministic: as for attention().
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a (total_tokens, heads, head_dim) tensor, got {shape}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64) \
                or cu.numel() < 2:
            got = f"{cu.dtype} tensor of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"{name} must be a 1-d int32 or int64 tensor of N + 1 >= 2 offsets, got {got}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel() - 1} sequences but cu_seqlens_k has "
                         f"{cu_seqlens_k.numel() - 1}")
    positions = _positions(cu_seqlens_q, cu_seqlens_k, q.shape[0])
    m = _localized(mask, positions)
    packed = [t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v)]  # (1, H, total, D) views
    result = attention(*packed, mask=m, scale=scale, return_lse=return_lse, topk=topk, dropout_p=dropout_p,
                       deterministic=deterministic)
    if return_lse:
        out, lse = result
        return out[0].permute(1, 0, 2), lse[0]
    return result[0].permute(1, 0, 2)


def _positions(cu_q, cu_k, total_q: int) -> dict:
    """The LOCAL_PARAMS tensors, one value per query position (0 for the padding past
    cu_seqlens_q[-1], whose sequence has no keys): computed on the device, kept per cu_seqlens tensors."""
    compiling = torch.compiler.is_compiling()  # a traced graph computes them every call
    if not compiling:
        key = (id(cu_q), cu_q._version, id(cu_k), cu_k._version, total_q)
        hit = _DERIVED.get(key)
        if hit is not None and hit[0]() is cu_q and hit[1]() is cu_k:
            return hit[2]

    index = torch.arange(total_q, device=cu_q.device)
    starts_q = cu_q.to(torch.int64)
    seq = torch.searchsorted(starts_q, index, right=True) - 1
    inside = (index < starts_q[-1]) & (seq >= 0)
    seq = seq.clamp(0, starts_q.numel() - 2)

    def span(cu):
        """Where each query's sequence starts in this packing, and its length there (int32: half
        the registers of int64 in the kernel)."""
        cu = cu.to(torch.int64)
        start = cu.gather(0, seq)
        length = cu.gather(0, seq + 1) - start
        return torch.where(inside, start, 0).to(torch.int32), torch.where(inside, length, 0).to(torch.int32)

    (q_start, q_len), (kv_start, kv_len) = span(starts_q), span(cu_k)
    positions = dict(seq_q_start=q_start, seq_q_len=q_len, seq_kv_start=kv_start, seq_kv_len=kv_len)
    if not compiling:
        _DERIVED.put(key, (weakref.ref(cu_q), weakref.ref(cu_k), positions))
    return positions


def _localized(mask, positions: dict):
    """_localize, kept with the positions (per cu_seqlens) for a mask given by name or seen before:
    a repeated call builds no mask objects, and attention() then takes its fast path."""
    if torch.compiler.is_compiling() or isinstance(mask, masks_.TracedMask):
        return _localize(mask, positions)
    if isinstance(mask, masks_.Mask):  # the kept mask holds these tensors: their ids are not reused meanwhile
        key = (mask.call_key, tuple(id(t) for t in mask.spec_tensors))
    else:
        key = (mask, masks_.generation())  # a name: its template may be reloaded
    kept = positions.setdefault("masks", {})
    if key not in kept:
        if len(kept) >= _MAX_DERIVED:
            kept.clear()
        kept[key] = _localize(mask, positions)
    return kept[key]


def _localize(m, positions: dict):
    """The mask with every term in its __local form, which also hides the keys of other sequences;
    a mask without a predicate term (None, score modifiers) gets SEQUENCE_KEYS for that."""
    local = {name: positions[name] for name in masks_.LOCAL_PARAMS}
    keys = masks_.mask(masks_.SEQUENCE_KEYS, seq_kv_start=local["seq_kv_start"], seq_kv_len=local["seq_kv_len"])
    if m is None:
        return keys
    if isinstance(m, str) and torch.compiler.is_compiling():  # no template file may be read while dynamo traces
        if not m.isidentifier():
            raise ValueError(f"varlen_attention under torch.compile takes a template name or a mask object, not the "
                             f"spec {m!r}: build it with attngen.mask(...) & ...")
        m = masks_.TracedMask(("term", m, ()))
    elif isinstance(m, str):
        m = masks_.as_mask(m)
    tree = masks_.TracedMask.of(m).tree

    def build(node):
        if node[0] == "term":
            return masks_.mask(node[1] + masks_.LOCAL_SUFFIX, **dict(node[2]), **local)
        left, right = build(node[1]), build(node[2])
        return left & right if node[0] == "&" else left | right

    out = build(tree)
    return out if out.tree is not None else keys & out
