"""Every built-in mask and modifier, alone and combined, against the float64 reference."""

import pytest
import torch

import attngen
from attngen.config import KernelConfig
from attngen.kernels.forward import attention_forward
from conftest import DEVICE, DTYPES, assert_close, poisoned_like, rand_qkv
from masks_zoo import ZOO

SEQ_LENS = [(1, 1), (7, 7), (100, 100), (257, 257), (100, 257), (257, 100), (1, 257)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q_len,kv_len", SEQ_LENS)
@pytest.mark.parametrize("name", list(ZOO))
def test_mask_matches_reference(name, q_len, kv_len, dtype):
    batch, heads, kv_heads, head_dim = 2, 2, 1, 32
    q, k, v = rand_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype)
    mask = ZOO[name](batch, heads, q_len, kv_len, DEVICE)
    out, lse = poisoned_like(q)
    config = attngen.dispatch.choose(q, k, v, mask).config
    attention_forward(q, k, v, mask, return_lse=True, config=config, out=out, lse=lse)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask, return_lse=True)
    assert_close(out, ref, dtype, lse, ref_lse)


@pytest.mark.parametrize("name", list(ZOO))
def test_mask_public_api(name):
    """attngen.attention itself, with the default config, on a ragged shape."""
    q, k, v = rand_qkv(1, 4, 2, 70, 90, 16, torch.float16)
    mask = ZOO[name](1, 4, 70, 90, DEVICE)
    out, lse = attngen.attention(q, k, v, mask=mask, return_lse=True)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask=mask, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 70)
    assert_close(out, ref, torch.float16, lse, ref_lse)


def test_masks_hide_what_they_should():
    """The reference itself: a few visibility facts written out by hand."""
    sq = sk = 6
    q = torch.zeros(1, 1, sq, 16)
    k = torch.zeros(1, 1, sk, 16)
    v = torch.eye(sk, 16).view(1, 1, sk, 16)  # output row i = the average of the visible key indices
    def weights(mask):
        return attngen.reference.attention(q, k, v, mask)[0, 0, :, :sk]
    causal = weights("causal")
    assert torch.allclose(causal[2], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0, 0, 0], dtype=torch.float64))
    window = weights(attngen.mask("sliding_window", window=2))
    assert torch.allclose(window[4], torch.tensor([0, 0, 0, .5, .5, 0], dtype=torch.float64))
    chunks = weights(attngen.mask("chunked", chunk=4))
    assert torch.allclose(chunks[5], torch.tensor([0, 0, 0, 0, .5, .5], dtype=torch.float64))
    prefix = weights(attngen.mask("prefix_lm", prefix=3))
    assert torch.allclose(prefix[0], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0, 0, 0], dtype=torch.float64))
    docs = weights(attngen.mask("document", doc_ids=torch.tensor([0, 0, 1, 1, 1, 2])))
    assert torch.allclose(docs[3], torch.tensor([0, 0, 1 / 3, 1 / 3, 1 / 3, 0], dtype=torch.float64))


@pytest.mark.parametrize("config", [
    KernelConfig(16, 16, 1, 1),
    KernelConfig(32, 64, 2, 2),
    KernelConfig(64, 16, 4, 3, use_tma=True),
    KernelConfig(16, 32, 4, 2, use_tma=True, warp_specialize=True),
], ids=str)
@pytest.mark.parametrize("name", ["none", "causal", "(causal|chunked)&document&alibi&softcap"])
def test_configs(config, name):
    """Every switch of the kernel template (tile sizes, TMA, warp specialization) gives the same result."""
    q, k, v = rand_qkv(1, 2, 2, 100, 130, 80, torch.float16)
    mask = ZOO[name](1, 2, 100, 130, DEVICE)
    out, lse = poisoned_like(q)
    attention_forward(q, k, v, mask, return_lse=True, config=config, out=out, lse=lse)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask, return_lse=True)
    assert_close(out, ref, torch.float16, lse, ref_lse)
