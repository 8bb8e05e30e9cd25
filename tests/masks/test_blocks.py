"""Block classification: which tiles a mask shows fully, partly or not at all, and its cache."""

import math

import pytest
import torch

import attngen
from attngen import masks as masks_
from attngen.masks import blocks as blocks_
from helpers import DEVICE, assert_close, rand_qkv
from masks_zoo import ZOO


def test_causal_on_band_split():
    """Causal with square tiles: one partial (diagonal) block per query block, the rest full or skipped."""
    s = masks_.block_structure(masks_.mask("causal"), 256, 256, (64, 64), device=DEVICE)
    assert s.partial_num.flatten().tolist() == [1, 1, 1, 1]
    assert s.full_num.flatten().tolist() == [0, 1, 2, 3]
    assert s.partial_idx[0, 0, :, 0].tolist() == [0, 1, 2, 3]
    assert s.contiguous
    dense = masks_.block_structure(None, 100, 100, (64, 64), device=DEVICE)
    assert dense.full_num.flatten().tolist() == [1, 1] and dense.partial_num.flatten().tolist() == [1, 1]
    assert s.partial and dense.partial


def test_partial_says_whether_any_tile_is_partial():
    """`partial` is False only where checked: the forward then compiles one key loop (LISTS=1)."""
    assert not masks_.block_structure(None, 100, 128, (64, 64), device=DEVICE).partial  # ragged rows only
    assert masks_.block_structure(None, 128, 100, (64, 64), device=DEVICE).partial  # a ragged key block
    window = attngen.mask("sliding_window", window=64)  # causal: the diagonal tiles are partial
    assert window.block_structure(256, 256, (64, 64), device=DEVICE).partial
    ids = torch.zeros(1, 256, dtype=torch.int64, device=DEVICE)  # unchecked (a tensor mask): assumed partial
    assert attngen.mask("document", doc_ids=ids).block_structure(256, 256, (64, 64), device=DEVICE).partial
    classes = torch.tensor([[[[2, 0, 2], [0, 2, 2]]]], dtype=torch.int8)
    assert not blocks_.structure_from_classes(classes, (16, 16), check_contiguous=True).partial
    assert blocks_.structure_from_classes(classes, (16, 16)).partial


def brute_force_classes(m, b, h, sq, sk, bm, bn):
    """EMPTY / PARTIAL / FULL of every tile from the visibility of every position."""
    bound = masks_.bind(m, batch=b, heads=h, q_len=sq, kv_len=sk, device=DEVICE)
    env = dict(b=torch.arange(b).view(-1, 1, 1, 1), h=torch.arange(h).view(1, -1, 1, 1),
               q_idx=torch.arange(sq).view(1, 1, -1, 1), kv_idx=torch.arange(sk).view(1, 1, 1, -1),
               q_len=sq, kv_len=sk, batch=b, heads=h)
    visible = masks_.evaluate_visible(bound, env).expand(b, h, sq, sk).cpu()
    out = torch.zeros(b, h, math.ceil(sq / bm), math.ceil(sk / bn), dtype=torch.long)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            tile = visible[:, :, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].flatten(2)
            full = tile.all(-1) & ((j + 1) * bn <= sk)  # a tile past kv_len is bounds-checked, never FULL
            out[:, :, i, j] = torch.where(full, masks_.FULL, torch.where(tile.any(-1), masks_.PARTIAL, masks_.EMPTY))
    return out


@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "chunked", "prefix_lm", "block_sparse",
                                  "block_sparse&causal", "block_sparse_shared"])
def test_block_classes_match_brute_force(name):
    b, h, sq, sk, bm, bn = 2, 3, 130, 200, 32, 16
    m = masks_.as_mask(ZOO[name](b, h, sq, sk, DEVICE))
    classes = m.block_structure(sq, sk, (bm, bn), batch=b, heads=h, device=DEVICE).classes
    want = brute_force_classes(m, b, h, sq, sk, bm, bn)
    assert torch.equal(classes.expand(b, h, -1, -1).cpu().long(), want)
    assert want.unique().numel() >= 2  # tiles of more than one class


def test_lists_per_key_block_are_the_transposed_classes():
    """by_key: the query blocks that see each key block (a backward kernel's outer loop), the same tile classes,
    but for the ragged last query block (100 rows in 16-row blocks), whose full tiles become partial: the
    kernel loads a full tile's query rows without bounds checks."""
    m = masks_.as_mask(ZOO["sliding_window|prefix_lm"](1, 1, 100, 130, DEVICE))
    by_query = masks_.block_structure(m, 100, 130, (16, 32), device=DEVICE)
    by_key = masks_.block_structure(m, 100, 130, (16, 32), device=DEVICE, by_key=True)
    want = by_query.classes.transpose(-1, -2).clone()
    assert (want[..., -1] == blocks_.FULL).any()  # the prefix's keys: full tiles in the last query block
    want[..., -1] = want[..., -1].clamp(max=blocks_.PARTIAL)
    assert torch.equal(by_key.classes, want)
    assert by_key.full_num.shape[-1] == math.ceil(130 / 32)
    even = masks_.block_structure(m, 96, 130, (16, 32), device=DEVICE, by_key=True)  # no ragged block
    assert (even.classes[..., -1] == blocks_.FULL).any()


def test_structure_from_classes_lists_blocks_in_order():
    classes = torch.tensor([[[[2, 0, 1, 2], [0, 0, 0, 0]]]], dtype=torch.int8)
    s = blocks_.structure_from_classes(classes, (16, 16), check_contiguous=True)
    assert s.full_num.flatten().tolist() == [2, 0] and s.full_idx[0, 0, 0, :2].tolist() == [0, 3]
    assert s.partial_num.flatten().tolist() == [1, 0] and s.partial_idx[0, 0, 0, 0] == 2
    assert not s.contiguous  # full blocks 0 and 3 are not a run
    assert torch.equal(s.classes, classes)


def test_block_structure_is_cached_without_tensors():
    m = attngen.mask("sliding_window", window=64)
    a = m.block_structure(512, 512, (64, 64), device=DEVICE)
    assert m.block_structure(512, 512, (64, 64), device=DEVICE) is a
    assert attngen.mask("sliding_window", window=65).block_structure(512, 512, (64, 64), device=DEVICE) is not a
    assert a.contiguous


def test_block_structure_of_a_tensor_mask_follows_its_tensor():
    """Cached while the same tensor object is unchanged; an in-place change or a new tensor reclassifies."""
    ids = torch.zeros(1, 256, dtype=torch.int64, device=DEVICE)
    m = attngen.mask("document", doc_ids=ids)
    a = m.block_structure(256, 256, (64, 64), device=DEVICE)
    assert m.block_structure(256, 256, (64, 64), device=DEVICE) is a
    assert a.full_num.flatten().tolist() == [4, 4, 4, 4]
    ids[:, 128:] = 1  # two documents now: the cached structure must not be reused
    b = m.block_structure(256, 256, (64, 64), device=DEVICE)
    assert b is not a and b.full_num.flatten().tolist() == [2, 2, 2, 2]
    other = attngen.mask("document", doc_ids=ids.clone())
    assert other.block_structure(256, 256, (64, 64), device=DEVICE) is not b
    # the kernel sees an in-place change too
    q, k, v = rand_qkv(1, 2, 2, 200, 250, 16, torch.float16)
    ids = torch.zeros(1, 250, dtype=torch.int64, device=DEVICE)
    m = attngen.mask("document", doc_ids=ids)
    attngen.attention(q, k, v, mask=m)  # classified and cached with one document
    ids[:, 120:] = 1
    out = attngen.attention(q, k, v, mask=m)
    assert_close(out, attngen.reference.attention(q, k, v, mask=m), torch.float16)
