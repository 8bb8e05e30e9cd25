"""Block-sparse masks through the forward kernel: tiles that differ from the layout's blocks,
empty rows of blocks, broadcast layouts, and in-place changes, against the float64 reference."""

import pytest
import torch

import attngen
from attngen import masks as masks_
from attngen.config import KernelConfig
from attngen.kernels.forward import attention_forward
from helpers import DEVICE, assert_close, check_forward, poisoned_like, rand_qkv
from masks_zoo import ZOO


@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "document", "chunked",
                                  "(causal|chunked)&document&alibi&softcap"])
def test_every_mask_converted_to_blocks(name):
    """A mask's own block structure, as a layout, joined to the mask changes nothing; alone it is a block mask."""
    b, h, sq, sk, blocks = 2, 2, 100, 130, (32, 16)
    q, k, v = rand_qkv(b, h, 1, sq, sk, 16, torch.float32)
    m = masks_.as_mask(ZOO[name](b, h, sq, sk, DEVICE))
    layout = m.block_structure(sq, sk, blocks, batch=b, heads=h, device=DEVICE).classes != masks_.EMPTY
    assert 0 < layout.float().mean() < 1
    joined = attngen.block_sparse(layout, blocks) & m
    out = attngen.attention(q, k, v, mask=joined)
    assert_close(out, attngen.reference.attention(q, k, v, mask=m), torch.float32)
    check_forward(q, k, v, attngen.block_sparse(layout, blocks))


@pytest.mark.parametrize("layout_block,tile", [((32, 32), (32, 32)), ((32, 32), (16, 64)), ((64, 16), (16, 32)),
                                               ((16, 16), (64, 32)), ((48, 40), (32, 16))], ids=str)
def test_tile_size_differs_from_layout_block(layout_block, tile):
    b, h, sq, sk = 1, 2, 110, 150
    q, k, v = rand_qkv(b, h, h, sq, sk, 32, torch.float32)
    layout = attngen.layouts.random(sq, sk, layout_block, density=0.4, seed=7, heads=h, device=DEVICE)
    check_forward(q, k, v, attngen.block_sparse(layout, layout_block), KernelConfig(tile[0], tile[1], 4, 1))


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (7, 7), (100, 257), (257, 100), (1, 257)])
def test_lengths_not_block_multiples(q_len, kv_len):
    q, k, v = rand_qkv(2, 2, 1, q_len, kv_len, 16, torch.float16)
    check_forward(q, k, v, ZOO["block_sparse&causal"](2, 2, q_len, kv_len, DEVICE), KernelConfig(32, 32, 4, 1))


def test_empty_rows_of_blocks_give_zero_and_hidden_blocks_are_never_read():
    b, h, sq, sk, bs = 1, 2, 96, 128, (32, 32)
    q, k, v = rand_qkv(b, h, h, sq, sk, 16, torch.float32)
    layout = torch.zeros(1, h, 3, 4, dtype=torch.bool, device=DEVICE)
    layout[:, :, 0, 0] = layout[:, 0, 2, 1] = layout[:, 1, 2, 3] = True  # query block 1 sees nothing
    k[:, :, 64:96] = float("nan")  # key block 2: no query block sees it
    v[:, :, 64:96] = float("nan")
    m = attngen.block_sparse(layout, bs)
    # tiles no larger than the layout's blocks: a key block no query block sees is never loaded (a larger
    # tile would load it with its neighbour, masked, as any partly visible tile; NaN there would spread)
    out, lse = poisoned_like(q)
    attention_forward(q, k, v, m, return_lse=True, config=KernelConfig(32, 32, 4, 1), out=out, lse=lse)
    assert not torch.isnan(out).any()
    assert (out[:, :, 32:64] == 0).all() and torch.isinf(lse[:, :, 32:64]).all()
    k2, v2 = k.nan_to_num(0.0), v.nan_to_num(0.0)
    assert_close(out, attngen.reference.attention(q, k2, v2, mask=m), torch.float32,
                 lse, attngen.reference.attention(q, k2, v2, mask=m, return_lse=True)[1])


def test_layout_broadcasts_over_batch_and_heads():
    b, h, sq, sk, bs = 2, 4, 64, 90, (16, 32)
    q, k, v = rand_qkv(b, h, 2, sq, sk, 16, torch.float32)
    per_head = attngen.layouts.random(sq, sk, bs, density=0.5, seed=1, heads=h, device=DEVICE)  # (1, H, ...)
    per_batch = attngen.layouts.random(sq, sk, bs, density=0.5, seed=2, batch=b, device=DEVICE)[:, :1]  # (B, 1, ...)
    shared = per_head[0, 0]  # (Sq blocks, Sk blocks)
    for layout in (per_head, per_batch, shared):
        check_forward(q, k, v, attngen.block_sparse(layout, bs))
    # the broadcast layout really is per head: heads differ
    out = attngen.attention(q, k, v, mask=attngen.block_sparse(per_head, bs))
    same = attngen.attention(q, k, v, mask=attngen.block_sparse(per_head[:, :1].expand(1, h, -1, -1), bs))
    assert not torch.allclose(out[:, 1:], same[:, 1:])


def test_changing_the_layout_in_place_is_seen():
    q, k, v = rand_qkv(1, 1, 1, 64, 60, 16, torch.float32)
    layout = torch.ones(1, 1, 2, 2, dtype=torch.bool, device=DEVICE)
    m = attngen.block_sparse(layout, (32, 32))
    first = attngen.attention(q, k, v, mask=m)
    layout[0, 0, 1, 0] = False
    second = attngen.attention(q, k, v, mask=m)
    assert_close(second, attngen.reference.attention(q, k, v, mask=m), torch.float32)
    assert not torch.allclose(first[:, :, 32:], second[:, :, 32:])
