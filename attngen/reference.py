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
