"""Block-sparse masks and the usual block layouts.

A layout is a bool tensor of shape (B or 1, H or 1, ceil(Sq / BM), ceil(Sk / BN)): entry
[b, h, i, j] says whether query block i of batch b, head h sees key block j. Block indices count
from the start of both sequences (when Sq != Sk the diagonal is top-left, as in SDPA's is_causal).

    layout = attngen.layouts.local_global(4096, 4096, (128, 128), window=2, global_blocks=1)
    mask = attngen.block_sparse(layout, block_size=(128, 128)) & attngen.mask("causal")
    out = attngen.attention(q, k, v, mask=mask)
"""

from __future__ import annotations

import math
import numbers

import torch

from ..checks import check_flag
from .objects import Mask, mask


def block_sparse(layout: torch.Tensor, block_size=(128, 128)) -> Mask:
    """A mask from a block layout (see the module doc); combines with other masks by & and |.

    The layout is read, not copied: changing it in place changes the mask (the dispatcher sees
    the change through torch's version counter).
    """
    bm, bn = _block_size(block_size)
    if not isinstance(layout, torch.Tensor):
        raise TypeError(f"layout must be a bool torch.Tensor, got {type(layout).__name__}")
    if layout.dtype != torch.bool:
        raise TypeError(f"layout must be a bool tensor, got {layout.dtype}; e.g. layout = density_map > 0.5")
    if not 2 <= layout.dim() <= 4:
        raise ValueError(f"layout must have shape (B or 1, H or 1, query blocks, key blocks) (leading dims "
                         f"may be left out), got shape {tuple(layout.shape)}")
    return mask("block_sparse", layout=layout, block_m=bm, block_n=bn)


def _block_size(block_size) -> tuple[int, int]:
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) and b >= 1 for b in block_size)):
        raise ValueError(f"block_size must be a pair of positive ints (query positions, key positions) per block, "
                         f"got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def _grid(q_len: int, kv_len: int, block_size, device):
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    bm, bn = _block_size(block_size)
    i = torch.arange(math.ceil(q_len / bm), device=device).view(-1, 1)
    j = torch.arange(math.ceil(kv_len / bn), device=device).view(1, -1)
    return i, j


def _count(name: str, value, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def local_global(q_len: int, kv_len: int, block_size=(128, 128), *, window: int = 1, global_blocks: int = 1,
                 random_blocks: int = 0, causal: bool = False, seed: int = 0, heads: int = 1,
                 device=None) -> torch.Tensor:
    """Longformer / BigBird: a band of key blocks around each query block, global blocks, random blocks.

    Query block i sees key blocks i - window .. i + window (.. i when `causal`); the first
    `global_blocks` key blocks are seen by every query block and the first `global_blocks` query
    blocks see every key block; with `random_blocks` > 0 each query block also sees that many key
    blocks drawn at random per head (BigBird), reproducibly from `seed`. `causal` then keeps
    only key blocks j <= i. Returns a (1, heads, Sq blocks, Sk blocks) bool tensor.
    """
    window, global_blocks = _count("window", window), _count("global_blocks", global_blocks)
    random_blocks, heads = _count("random_blocks", random_blocks), _count("heads", heads, 1)
    check_flag("causal", causal)
    i, j = _grid(q_len, kv_len, block_size, device)
    layout = ((j - i).abs() <= window) | (j < global_blocks) | (i < global_blocks)
    layout = layout.expand(1, heads, i.shape[0], j.shape[1])
    if random_blocks:
        layout = layout | _random_rows(heads, i.shape[0], j.shape[1], random_blocks, seed, layout.device)
    if causal:
        layout = layout & (j <= i)
    return layout.contiguous()


def strided(q_len: int, kv_len: int, block_size=(128, 128), *, local: int = 1, stride: int = 4,
            causal: bool = True, device=None) -> torch.Tensor:
    """Sparse Transformer's strided pattern, by blocks: query block i sees the `local` key blocks
    i - local + 1 .. i and every `stride`-th block before them (j with (i - j) % stride == 0);
    without `causal` the same pattern also looks ahead. Returns a (1, 1, Sq blocks, Sk blocks) bool tensor.
    """
    local, stride = _count("local", local, 1), _count("stride", stride, 1)
    check_flag("causal", causal)
    i, j = _grid(q_len, kv_len, block_size, device)
    offset = i - j if causal else (i - j).abs()
    layout = (offset >= 0) & ((offset < local) | (offset % stride == 0))
    return layout.view(1, 1, *layout.shape).contiguous()


def random(q_len: int, kv_len: int, block_size=(128, 128), *, density: float, seed: int = 0, batch: int = 1,
           heads: int = 1, device=None) -> torch.Tensor:
    """Random key blocks: each query block of each (batch, head) sees round(density x key blocks)
    of them (at least one), drawn reproducibly from `seed`. Returns a (batch, heads, ...) bool tensor.
    """
    if isinstance(density, bool) or not isinstance(density, numbers.Real) or not 0 < density <= 1:
        raise ValueError(f"density must be a number in (0, 1], got {density!r}")
    batch, heads = _count("batch", batch, 1), _count("heads", heads, 1)
    i, j = _grid(q_len, kv_len, block_size, device)
    per_row = max(1, round(density * j.shape[1]))
    rows = _random_rows(batch * heads, i.shape[0], j.shape[1], per_row, seed, i.device)
    return rows.view(batch, heads, i.shape[0], j.shape[1])


def _random_rows(planes: int, rows: int, cols: int, per_row: int, seed: int, device) -> torch.Tensor:
    """(1 or planes, planes, rows, cols) bool with `per_row` distinct random columns set in every row."""
    g = torch.Generator().manual_seed(_count("seed", seed))
    order = torch.rand(planes, rows, cols, generator=g).argsort(dim=-1)[..., :min(per_row, cols)]
    out = torch.zeros(planes, rows, cols, dtype=torch.bool).scatter_(-1, order, True)
    return out.view(1, planes, rows, cols).to(device)
