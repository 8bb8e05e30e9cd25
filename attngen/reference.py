"""The definition of correct: attention in plain torch, exact in float64.

Tests and the tuner's correctness gate call this module and nothing else. It materialises the
(Sq, Sk) score matrix, so it is meant for checking, not for speed.
"""

from __future__ import annotations

import torch

from . import masks as masks_
from .checks import check_dropout, check_flag, check_qkv, check_scale, check_topk

# Largest relative norm error ||out - ref|| / ||ref|| a kernel may show, by input dtype. The tests
# and the tuner's correctness gate both use this table.
TOLERANCE = {
    torch.float32: 2e-5,
    torch.float16: 3e-3,
    torch.bfloat16: 2e-2,
}


def scores(q, k, mask=None, *, scale=None):
    """The (B, Hq, Sq, Sk) float64 scores that attention's softmax (and top-k) runs over: q·k times
    `scale`, the mask's score modifiers applied, -inf where the mask hides a key."""
    shape = check_qkv(q, k, k, kernel=False)
    scale = check_scale(scale, shape.head_dim)
    mask = masks_.as_mask(mask)
    bound = masks_.bind(mask, batch=shape.batch, heads=shape.heads, q_len=shape.q_len, kv_len=shape.kv_len,
                        device=q.device)
    q64, k64 = q.to(torch.float64), k.to(torch.float64)
    if shape.group != 1:  # GQA: each key/value head serves `group` query heads (q with no heads: 0)
        k64 = k64.repeat_interleave(shape.group, dim=1)
    score = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    if bound is not None:
        device = q.device
        env = masks_.index_env(torch.arange(shape.q_len, device=device), torch.arange(shape.kv_len, device=device),
                               q_len=shape.q_len, kv_len=shape.kv_len, batch=shape.batch, heads=shape.heads)
        if mask.mods:
            score = masks_.score_fn(bound)(score, env)
        if mask.tree is not None:
            visible = torch.as_tensor(masks_.evaluate_visible(bound, env), device=device)
            score = score.masked_fill(~visible.expand_as(score), float("-inf"))
    return score


def attention(q, k, v, mask=None, *, scale=None, return_lse=False, topk=None, dropout_p=0.0, dropout_mask=None):
    """Same signature as `attngen.attention`; computes in float64 and returns float64 tensors.

    A row whose every key the mask hides gets output 0 and LSE -inf. With `topk`, a row's softmax
    runs over the scores (after score modifiers) that are >= its topk-th largest visible score:
    the topk largest, and every other score equal to the topk-th (ties are all kept). A row that
    sees fewer than topk keys keeps them all. With `dropout_p` > 0, `dropout_mask` (bool, (B, Hq,
    Sq, Sk), True where a weight is kept; attngen.dropout_mask gives the one a call used) zeroes the
    dropped weights and the rest are scaled by 1 / (1 - dropout_p); the LSE is that of the weights
    before dropout.
    """
    shape = check_qkv(q, k, v, kernel=False)
    check_flag("return_lse", return_lse)
    topk = check_topk(topk, shape.kv_len)
    score = scores(q, k, mask, scale=scale)
    v64 = v.to(torch.float64)
    if shape.group != 1:  # as k in scores()
        v64 = v64.repeat_interleave(shape.group, dim=1)
    if topk:
        threshold = score.topk(topk, dim=-1).values[..., -1:]  # -inf where fewer than topk are visible
        score = score.masked_fill(score < threshold, float("-inf"))
    row_max = score.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)  # empty rows
    weights = torch.exp(score - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    dropout_p = check_dropout(dropout_p)
    if dropout_p > 0:
        if dropout_mask is None:
            raise ValueError("dropout_p > 0 needs the dropout_mask to apply (attngen.dropout_mask gives a call's)")
        weights = weights * dropout_mask.to(weights.device) / (1.0 - dropout_p)
    out = torch.matmul(weights, v64) / torch.where(total == 0, torch.ones_like(total), total)
    if not return_lse:
        return out
    lse = (row_max + torch.log(total)).squeeze(-1)  # log(0) = -inf for empty rows
    return out, lse


def dense_cache(cache: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """A paged cache (num_pages, page_size, Hkv, D) as the contiguous (B, Hkv, pages * page_size, D)
    one its block table describes: key j of sequence b is row j % page_size of page
    block_table[b, j // page_size]. Rows of pages that are not in the cache read 0."""
    n_pages = cache.shape[0]
    pages = block_table.long()
    valid = (pages >= 0) & (pages < n_pages)
    rows = cache[pages.clamp(0, n_pages - 1)] * valid[:, :, None, None, None]  # (B, P, page, Hkv, D)
    batch, per_seq = pages.shape
    return rows.reshape(batch, per_seq * page_size, *cache.shape[2:]).transpose(1, 2)


def decode(q, k_cache, v_cache, seq_lens=None, *, block_table=None, mask=None, scale=None, return_lse=False):
    """Same signature as `attngen.decode` (float64 results): the Sq new tokens of sequence b are its
    last Sq positions, seq_lens[b] - Sq + i, and the mask sees those positions with q_len = kv_len =
    seq_lens[b] (bottom-right alignment whatever the mask's); keys at positions >= seq_lens[b] are
    not in the sequence."""
    if block_table is not None:
        page_size = k_cache.shape[1]
        k_cache = dense_cache(k_cache, block_table, page_size)
        v_cache = dense_cache(v_cache, block_table, page_size)
    batch, heads, q_len, head_dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    scale = check_scale(scale, head_dim)
    lens = [capacity] * batch if seq_lens is None else [int(n) for n in seq_lens]
    mask = masks_.as_mask(mask)
    bound = masks_.bind(mask, batch=batch, heads=heads, q_len=capacity, kv_len=capacity, device=q.device)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, heads, q_len), float("-inf"), dtype=torch.float64, device=q.device)
    for b, length in enumerate(lens):
        k64 = k_cache[b, :, :length].to(torch.float64).repeat_interleave(group, dim=0)  # (Hq, L, D)
        v64 = v_cache[b, :, :length].to(torch.float64).repeat_interleave(group, dim=0)
        score = torch.matmul(q[b].to(torch.float64), k64.transpose(-1, -2)) * scale  # (Hq, Sq, L)
        if bound is not None:
            env = masks_.index_env(torch.arange(length - q_len, length, device=q.device),
                                   torch.arange(length, device=q.device), q_len=length, kv_len=length, batch=batch,
                                   heads=heads)
            full = score.expand(batch, *score.shape)  # every batch row: a mask's tensors index b
            if mask.mods:
                full = masks_.score_fn(bound)(full, env)
            if mask.tree is not None:
                visible = torch.as_tensor(masks_.evaluate_visible(bound, env), device=q.device)
                full = full.masked_fill(~visible.expand_as(full), float("-inf"))
            score = full[b]
        row_max = score.amax(dim=-1, keepdim=True)
        row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
        weights = torch.exp(score - row_max)
        total = weights.sum(dim=-1, keepdim=True)
        out[b] = torch.matmul(weights, v64) / torch.where(total == 0, torch.ones_like(total), total)
        lse[b] = (row_max + torch.log(total)).squeeze(-1)
    return (out, lse) if return_lse else out
