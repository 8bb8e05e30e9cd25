"""Block layouts: the generators, block_sparse's argument checks, and a layout of the wrong size."""

import pytest
import torch

import attngen
from helpers import DEVICE, rand_qkv


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
    ragged = attngen.layouts.random(100, 130, (32, 16), density=0.5, seed=1)
    assert ragged.shape == (1, 1, 4, 9)  # lengths that are not block multiples round up


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
