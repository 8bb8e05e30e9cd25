"""Top-k softmax: the kernel against the float64 reference, the tie rule, and bad arguments.

Triton's interpreter sorts slowly, so these shapes are small; every path of the kernel's top-k
merge (key block narrower than, as wide as, and wider than the top-k buffer) is covered.
"""

import pytest
import torch

import attngen
from attngen.config import KernelConfig
from attngen.kernels.forward import attention_forward
from conftest import DEVICE, assert_close, poisoned_like, rand_qkv
from masks_zoo import ZOO


def check(q, k, v, mask, topk, config, dtype=torch.float32):
    out, lse = poisoned_like(q)
    attention_forward(q, k, v, mask, return_lse=True, topk=topk, config=config, out=out, lse=lse)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask, return_lse=True, topk=topk)
    assert_close(out, ref, dtype, lse, ref_lse)
    return out


@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("topk,config", [
    (1, KernelConfig(32, 32, 4, 1)),  # block wider than the buffer
    (8, KernelConfig(16, 16, 4, 1)),
    (16, KernelConfig(16, 16, 4, 1)),  # as wide
    (64, KernelConfig(32, 16, 4, 1)),  # narrower
    (300, KernelConfig(16, 32, 4, 1)),  # more than Sk: every visible key
], ids=lambda x: str(x))
def test_topk_matches_reference(topk, config, mask):
    q, k, v = rand_qkv(1, 2, 1, 70, 90, 16, torch.float32)
    check(q, k, v, mask, topk, config)


def test_topk_with_ragged_lengths_gqa_and_fp16():
    q, k, v = rand_qkv(2, 4, 2, 37, 75, 24, torch.float16)
    check(q, k, v, "causal", 5, KernelConfig(16, 16, 4, 1), torch.float16)


def test_topk_after_score_modifiers_and_a_block_layout():
    """The k largest are taken among the visible, modified scores."""
    q, k, v = rand_qkv(1, 2, 2, 64, 80, 16, torch.float32)
    q = q * 3  # spread the scores so that the soft cap reorders nothing but still bends them
    check(q, k, v, ZOO["block_sparse|sliding_window&softcap"](1, 2, 64, 80, DEVICE), 6, KernelConfig(16, 16, 4, 1))


def test_ties_at_the_kth_score_are_all_kept():
    """Keys repeated three times give scores tied in threes; topk=4 keeps the top group and the whole next one."""
    sq, sk, d = 20, 48, 16
    q, base, _ = rand_qkv(1, 1, 1, sq, sk // 3, d, torch.float32)
    k = base.repeat_interleave(3, dim=2)  # every score value appears exactly 3 times in a row
    v = torch.eye(sk, device=DEVICE).view(1, 1, sk, sk)  # output row = the softmax weights themselves
    q = torch.nn.functional.pad(q, (0, sk - d))  # zero columns: the same scores at v's head dim
    k = torch.nn.functional.pad(k, (0, sk - d))
    weights = attngen.reference.attention(q, k, v, topk=4)[0, 0]
    assert ((weights > 0).sum(-1) == 6).all()  # 3 + 3: the 4th largest ties with the 5th and 6th
    out = check(q, k, v, None, 4, KernelConfig(16, 16, 4, 1))
    assert torch.equal(out[0, 0] > 0, weights > 0)


def test_topk_at_or_over_the_key_length_is_plain_softmax():
    q, k, v = rand_qkv(1, 2, 2, 30, 40, 16, torch.float32)
    plain = attngen.attention(q, k, v, mask="causal")
    assert torch.equal(attngen.attention(q, k, v, mask="causal", topk=40), plain)
    assert torch.equal(attngen.attention(q, k, v, mask="causal", topk=10_000), plain)
    assert "topk" not in attngen.explain(q, k, v, mask="causal", topk=40)


def test_dispatcher_names_the_topk_variant():
    q, k, v = rand_qkv(1, 2, 2, 30, 400, 16, torch.float32)
    text = attngen.explain(q, k, v, mask="causal", topk=40)
    assert "variant causal(align='top_left') & topk(64)" in text and "top-k buffer" in text
    out = attngen.attention(q, k, v, mask="causal", topk=40)
    assert_close(out, attngen.reference.attention(q, k, v, mask="causal", topk=40), torch.float32)


@pytest.mark.parametrize("topk,error,message", [
    (0, ValueError, "topk must be >= 1"),
    (-3, ValueError, "topk must be >= 1"),
    (2.5, TypeError, "topk must be an int or None"),
    (True, TypeError, "topk must be an int or None"),
    (1025, ValueError, "topk=1025 is over the supported 1024"),
])
def test_bad_topk(topk, error, message):
    q, k, v = rand_qkv(1, 1, 1, 8, 2000, 16, torch.float32)
    for fn in (attngen.attention, attngen.reference.attention):
        with pytest.raises(error, match=message):
            fn(q, k, v, topk=topk)
