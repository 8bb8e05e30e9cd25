"""Block-sparse masks: layouts, their block classes, and the kernel against the float64 reference."""

import pytest
import torch

import attngen
from attngen import masks as masks_
from attngen.config import KernelConfig
from attngen.kernels.forward import attention_forward
from conftest import DEVICE, assert_close, poisoned_like, rand_qkv
from masks_zoo import ZOO


def run(q, k, v, mask, config=None, dtype=torch.float32):
    out, lse = poisoned_like(q)
    config = config or attngen.dispatch.choose(q, k, v, mask).config
    attention_forward(q, k, v, mask, return_lse=True, config=config, out=out, lse=lse)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask, return_lse=True)
    assert_close(out, ref, dtype, lse, ref_lse)


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
    run(q, k, v, attngen.block_sparse(layout, blocks))


@pytest.mark.parametrize("layout_block,tile", [((32, 32), (32, 32)), ((32, 32), (16, 64)), ((64, 16), (16, 32)),
                                               ((16, 16), (64, 32)), ((48, 40), (32, 16))], ids=str)
def test_tile_size_differs_from_layout_block(layout_block, tile):
    b, h, sq, sk = 1, 2, 110, 150
    q, k, v = rand_qkv(b, h, h, sq, sk, 32, torch.float32)
    layout = attngen.layouts.random(sq, sk, layout_block, density=0.4, seed=7, heads=h, device=DEVICE)
    run(q, k, v, attngen.block_sparse(layout, layout_block), KernelConfig(tile[0], tile[1], 4, 1))


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (7, 7), (100, 257), (257, 100), (1, 257)])
def test_lengths_not_block_multiples(q_len, kv_len):
    q, k, v = rand_qkv(2, 2, 1, q_len, kv_len, 16, torch.float16)
    m = ZOO["block_sparse&causal"](2, 2, q_len, kv_len, DEVICE)
    out, lse = poisoned_like(q)
    attention_forward(q, k, v, m, return_lse=True, config=KernelConfig(32, 32, 4, 1), out=out, lse=lse)
    ref, ref_lse = attngen.reference.attention(q, k, v, m, return_lse=True)
    assert_close(out, ref, torch.float16, lse, ref_lse)


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
    b, h, sq, sk, bs = 2, 4, 64, 96, (16, 32)
    q, k, v = rand_qkv(b, h, 2, sq, sk, 16, torch.float32)
    per_head = attngen.layouts.random(sq, sk, bs, density=0.5, seed=1, heads=h, device=DEVICE)  # (1, H, ...)
    per_batch = attngen.layouts.random(sq, sk, bs, density=0.5, seed=2, batch=b, device=DEVICE)[:, :1]  # (B, 1, ...)
    shared = per_head[0, 0]  # (Sq blocks, Sk blocks)
    for layout in (per_head, per_batch, shared):
        run(q, k, v, attngen.block_sparse(layout, bs))
    # the broadcast layout really is per head: heads differ
    out = attngen.attention(q, k, v, mask=attngen.block_sparse(per_head, bs))
    same = attngen.attention(q, k, v, mask=attngen.block_sparse(per_head[:, :1].expand(1, h, -1, -1), bs))
    assert not torch.allclose(out[:, 1:], same[:, 1:])


def test_changing_the_layout_in_place_is_seen():
    q, k, v = rand_qkv(1, 1, 1, 64, 64, 16, torch.float32)
    layout = torch.ones(1, 1, 2, 2, dtype=torch.bool, device=DEVICE)
    m = attngen.block_sparse(layout, (32, 32))
    first = attngen.attention(q, k, v, mask=m)
    layout[0, 0, 1, 0] = False
    second = attngen.attention(q, k, v, mask=m)
    assert_close(second, attngen.reference.attention(q, k, v, mask=m), torch.float32)
    assert not torch.allclose(first[:, :, 32:], second[:, :, 32:])


def test_layout_generators():
    lg = attngen.layouts.local_global(512, 512, (64, 64), window=1, global_blocks=1)
    assert lg.shape == (1, 1, 8, 8) and lg.dtype == torch.bool
    assert lg[0, 0, 4].tolist() == [True, False, False, True, True, True, False, False]  # global 0, band 3..5
    assert lg[0, 0, 0].all() and lg[0, 0, :, 0].all()  # the global block sees and is seen by everything
    causal = attngen.layouts.local_global(512, 512, (64, 64), window=1, global_blocks=1, causal=True)
    assert not torch.triu(causal[0, 0].long(), 1).any()
    bigbird = attngen.layouts.local_global(512, 512, (64, 64), window=0, global_blocks=0, random_blocks=2,
                                           heads=3, seed=5)
    assert bigbird.shape == (1, 3, 8, 8) and (bigbird.sum(-1) >= 2).all() and (bigbird.sum(-1) <= 3).all()
    st = attngen.layouts.strided(8 * 16, 8 * 16, (16, 16), local=2, stride=3)
    assert st[0, 0, 7].tolist() == [False, True, False, False, True, False, True, True]  # local 6, 7; strided 4, 1
    rnd = attngen.layouts.random(1000, 1000, (100, 100), density=0.3, seed=3, batch=2, heads=2)
    assert rnd.shape == (2, 2, 10, 10) and (rnd.sum(-1) == 3).all()
    assert torch.equal(rnd, attngen.layouts.random(1000, 1000, (100, 100), density=0.3, seed=3, batch=2, heads=2))
    assert not torch.equal(rnd, attngen.layouts.random(1000, 1000, (100, 100), density=0.3, seed=4, batch=2, heads=2))


@pytest.mark.parametrize("call,message", [
    (lambda: attngen.block_sparse(torch.ones(1, 1, 2, 2), (32, 32)), "layout must be a bool tensor"),
    (lambda: attngen.block_sparse([[True]], (32, 32)), "layout must be a bool torch.Tensor"),
    (lambda: attngen.block_sparse(torch.ones(2, dtype=torch.bool), (32, 32)), "layout must have shape"),
    (lambda: attngen.block_sparse(torch.ones(2, 2, dtype=torch.bool), (0, 32)), "block_size must be a pair"),
    (lambda: attngen.block_sparse(torch.ones(2, 2, dtype=torch.bool), 32), "block_size must be a pair"),
    (lambda: attngen.layouts.random(64, 64, (16, 16), density=0), "density must be"),
    (lambda: attngen.layouts.local_global(64, 64, (16, 16), window=-1), "window must be an int >= 0"),
    (lambda: attngen.layouts.strided(0, 64, (16, 16)), "q_len must be a positive int"),
])
def test_errors_name_the_argument(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()


def test_layout_of_the_wrong_size_is_a_clear_error():
    q, k, v = rand_qkv(1, 1, 1, 100, 100, 16, torch.float32)
    m = attngen.block_sparse(torch.ones(1, 1, 3, 4, dtype=torch.bool, device=DEVICE), (32, 32))
    with pytest.raises(ValueError, match=r"parameter 'layout': dimension 2 \(q_len/block_m\) has size 3, expected 4"):
        attngen.attention(q, k, v, mask=m)
