"""Block classification: which (BLOCK_M x BLOCK_N) tiles of a call a mask shows fully, partly or
not at all, as the per-query-block lists of key blocks the kernels visit.

Block layouts (`block_layout` templates) are classified from the layout alone; every other
predicate is evaluated position by position in torch, a band of query rows at a time.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ..caches import BoundedCache
from .binding import Bound, bind, evaluate_visible, index_env, is_term, predicate_names, tree_terms
from .template_files import split_dim


EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockStructure:
    """Per (batch, head, query block): the key blocks to visit, full ones apart from partial ones.

    Every tensor has a leading (B, H) of the call's sizes or 1 (the same for all).
    `full_idx[..., :full_num]` are the key blocks the mask shows entirely (no mask arithmetic);
    `partial_idx[..., :partial_num]` those it shows in part. Blocks in neither are skipped.
    """

    block_size: tuple[int, int]
    full_num: torch.Tensor  # (B, H, num_m) int32
    full_idx: torch.Tensor  # (B, H, num_m, num_n) int32
    partial_num: torch.Tensor
    partial_idx: torch.Tensor
    # every list is a run of consecutive blocks (causal, windows, chunks): the kernel then steps
    # through a range instead of reading indices. False when unknown (not checked, to avoid a sync):
    # the backward and top-k kernels then read each list's ends and step through the lists that are runs
    contiguous: bool = False
    # some tile is shown in part (or bounds-checked). False only where checked (as `contiguous` is): the
    # forward and backward kernels then compile no loop over the partial lists (kernels.forward.key_lists)
    partial: bool = True

    @property
    def classes(self) -> torch.Tensor:
        """(B, H, num_m, num_n) int8: EMPTY, PARTIAL or FULL for every tile."""
        cols = torch.arange(self.full_idx.shape[-1], device=self.full_idx.device)
        out = torch.zeros(self.full_idx.shape, dtype=torch.int8, device=cols.device)
        for num, idx, value in ((self.partial_num, self.partial_idx, PARTIAL), (self.full_num, self.full_idx, FULL)):
            listed = torch.zeros_like(out, dtype=torch.bool).scatter_(-1, idx.long(), cols < num[..., None])
            out = torch.where(listed, value, out).to(torch.int8)
        return out


def _lists(selected: torch.Tensor):
    """(count, indices) with the selected blocks first, in ascending order."""
    num = selected.sum(-1, dtype=torch.int32)
    idx = torch.sort((~selected).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    return num, idx


def _runs(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """True where the first `num` indices of a row are consecutive."""
    step_ok = (idx[..., 1:] - idx[..., :-1]) == 1
    listed = torch.arange(1, idx.shape[-1], device=idx.device) < num[..., None]
    return (step_ok | ~listed).all()


def structure_from_classes(classes: torch.Tensor, block_size, check_contiguous: bool = False) -> BlockStructure:
    """The block lists of a class tensor; `check_contiguous` (which also checks `partial`) costs one
    device sync."""
    full_num, full_idx = _lists(classes == FULL)
    partial_num, partial_idx = _lists(classes == PARTIAL)
    contiguous, partial = False, True
    if check_contiguous:
        runs = _runs(full_num, full_idx) & _runs(partial_num, partial_idx)
        contiguous, partial = torch.stack([runs, (partial_num > 0).any()]).tolist()
    return BlockStructure(tuple(block_size), full_num.contiguous(), full_idx.contiguous(),
                          partial_num.contiguous(), partial_idx.contiguous(), contiguous, partial)


_CHUNK_ELEMENTS = 1 << 26  # cap on the (rows x keys) booleans evaluated at once
_STRUCTURE_CACHE = BoundedCache("blocks.structures", 64)  # least recently used dropped first


def classify(bound: Bound | None, q_len: int, kv_len: int, block_size, *, batch: int, heads: int,
             device) -> torch.Tensor:
    """(B', H', num_m, num_n) int8 classes, B' = batch if the mask uses `b` else 1 (same for H').

    A tile the kernel must bounds-check (it reaches past kv_len) is never FULL.
    """
    bm, bn = block_size
    num_m, num_n = math.ceil(q_len / bm), math.ceil(kv_len / bn)
    if bound is None or bound.mask.tree is None:
        full_cols = (torch.arange(num_n * bn, device=device) < kv_len).view(num_n, bn).all(-1)
        classes = torch.where(full_cols, FULL, PARTIAL).to(torch.int8)
        return classes.expand(1, 1, num_m, num_n).contiguous()
    return _classify_node(bound, bound.mask.tree, q_len, kv_len, block_size, batch=batch, heads=heads, device=device)


def _classify_node(bound: Bound, node, q_len, kv_len, block_size, *, batch, heads, device) -> torch.Tensor:
    """Block layouts are read block by block; the rest of the tree is evaluated per position.

    Where a tree mixes the two, `&` takes the weaker class of its sides and `|` the stronger one
    (EMPTY < PARTIAL < FULL): never wrong, at worst a tile is visited that is in fact empty.
    """
    if is_term(node) and node.template.block_layout is not None:
        return _classify_layout(node, q_len, kv_len, block_size, device)
    if not any(t.template.block_layout is not None for t in tree_terms(node)):
        return _classify_positions(bound, node, q_len, kv_len, block_size, batch=batch, heads=heads, device=device)
    sides = [_classify_node(bound, child, q_len, kv_len, block_size, batch=batch, heads=heads, device=device)
             for child in node[1:]]
    return (torch.minimum if node[0] == "&" else torch.maximum)(*sides)


def _classify_positions(bound: Bound, node, q_len, kv_len, block_size, *, batch, heads, device) -> torch.Tensor:
    """Evaluate the predicate `node` position by position, a band of query rows at a time."""
    bm, bn = block_size
    num_m, num_n = math.ceil(q_len / bm), math.ceil(kv_len / bn)
    kv = torch.arange(num_n * bn, device=device)
    kv_in = kv < kv_len
    names = predicate_names(node)
    nb = batch if "b" in names else 1
    nh = heads if "h" in names else 1
    rows = max(bm, (_CHUNK_ELEMENTS // max(1, nb * nh * num_n * bn)) // bm * bm)
    out = []
    for start in range(0, num_m * bm, rows):
        q = torch.arange(start, min(start + rows, num_m * bm), device=device)
        env = index_env(q, kv, q_len=q_len, kv_len=kv_len, batch=batch, heads=heads, batches=nb, head_count=nh)
        vis = evaluate_visible(bound, env, node)
        vis = torch.as_tensor(vis, device=device).expand(nb, nh, q.numel(), kv.numel())
        q_in = (q < q_len).view(1, 1, -1, 1)
        seen = vis & q_in & kv_in
        whole = (vis | ~q_in) & kv_in  # rows past q_len are never stored: they don't spoil a full tile
        tiles = (nb, nh, q.numel() // bm, bm, num_n, bn)
        any_ = seen.reshape(tiles).any(dim=5).any(dim=3)
        all_ = whole.reshape(tiles).all(dim=5).all(dim=3)
        out.append(torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8))
    if not out:  # no query rows (an empty query): no tiles
        return torch.zeros((nb, nh, 0, num_n), dtype=torch.int8, device=device)
    return torch.cat(out, dim=2)


def _classify_layout(term, q_len, kv_len, block_size, device) -> torch.Tensor:
    """Tile classes of a block layout, at a tile size that may differ from the layout's blocks."""
    shape = term.template.params[term.template.block_layout].shape
    layout_m, layout_n = (term.values[split_dim(d)[1]] for d in shape[2:])
    layout = term.values[term.template.block_layout].to(device=device, dtype=torch.bool)
    any_, all_ = _tiles_of_last_dim(layout.transpose(2, 3), layout.transpose(2, 3), layout_m, block_size[0], q_len,
                                    bounded=False)
    any_, all_ = _tiles_of_last_dim(any_.transpose(2, 3), all_.transpose(2, 3), layout_n, block_size[1], kv_len,
                                    bounded=True)
    return torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8).contiguous()


def _tiles_of_last_dim(any_, all_, block: int, tile: int, length: int, bounded: bool):
    """Regroup the last dim from layout blocks of `block` positions to tiles of `tile` positions.

    Both are cut into chunks of gcd(block, tile) positions, each inside one layout block; a tile
    is `any` if one of its chunks is, `all` if every chunk is. Positions past `length` count as
    nothing for `any`; for `all` they do not spoil a tile, unless `bounded` (keys: the kernel must
    bounds-check such a tile, so it is never FULL).
    """
    g = math.gcd(block, tile)
    chunks = math.ceil(length / tile) * (tile // g)

    def regroup(x):
        x = x.repeat_interleave(block // g, dim=-1)[..., :chunks]
        pad = chunks - x.shape[-1]
        return torch.cat([x, x.new_zeros(x.shape[:-1] + (pad,))], dim=-1) if pad > 0 else x

    start = torch.arange(chunks, device=any_.device) * g
    any_ = regroup(any_) & (start < length)
    all_ = regroup(all_) & (start + g <= length) if bounded else regroup(all_) | (start >= length)
    tiles = any_.shape[:-1] + (chunks * g // tile, tile // g)
    return any_.reshape(tiles).any(-1), all_.reshape(tiles).all(-1)


def block_structure(m, q_len: int, kv_len: int, block_size, *, batch: int = 1, heads: int = 1,
                    device=None, bound: Bound | None = None, by_key: bool = False) -> BlockStructure:
    """The block structure of `m` for one call, cached.

    `by_key`: the lists per key block instead (the query blocks that see it, fully apart from in
    part), the transpose of the same tile classes: what a backward kernel walking the key blocks in
    its outer loop visits, exactly the tiles the forward visits. There the ragged last query block
    is never full, as the ragged last key block is never full by query: the kernel loads a full
    block's query rows without bounds checks.

    A mask with tensor parameters is cached while those very tensor objects live and are not
    modified in place (torch's version counter): a mask built once per batch and used by every
    layer classifies its blocks once. Changing a tensor through a path torch does not track
    (`.data`, DLPack or numpy aliases) is not seen: build a new mask instead.
    """
    if device is None:
        device = "cpu"
    device = torch.device(device)
    if bound is None:
        bound = bind(m, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, device=device)
    tensors = [v for t in m.terms() for v in t.values.values() if isinstance(v, torch.Tensor)] if m else []
    key = (None if m is None else m.call_key, tuple((id(t), t._version) for t in tensors), q_len, kv_len,
           tuple(block_size), batch, heads, device, by_key)
    hit = _STRUCTURE_CACHE.get(key)
    if hit is not None and all(ref() is t for ref, t in zip(hit[1], tensors)):
        _STRUCTURE_CACHE.touch(key)
        return hit[0]
    classes = classify(bound, q_len, kv_len, block_size, batch=batch, heads=heads, device=device)
    if by_key:
        if q_len % block_size[0]:  # the kernel bounds-checks the rows of the ragged last query block
            classes[..., -1, :] = classes[..., -1, :].clamp(max=PARTIAL)
        classes = classes.transpose(-1, -2)
    # the run check costs a device sync: worth it once per shape, not once per new tensor
    result = structure_from_classes(classes, block_size, check_contiguous=not tensors)
    _STRUCTURE_CACHE.put(key, (result, [weakref.ref(t) for t in tensors]))
    return result
