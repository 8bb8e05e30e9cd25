"""Every built-in mask and modifier, alone and combined, through the forward kernel against the float64 reference."""

import pytest
import torch

import attngen
from helpers import DEVICE, DTYPES, assert_close, check_forward, rand_qkv
from masks_zoo import ZOO

SEQ_LENS = [(1, 1), (7, 7), (100, 100), (257, 257), (100, 257), (257, 100), (1, 257)]

# fp32 at every length here; fp16 (and bf16) at every length on the GPU machine: under the interpreter
# every mask runs in fp16 once, in test_mask_public_api
DTYPE_PARAMS = [pytest.param(dtype, id=str(dtype), marks=() if dtype is torch.float32 else pytest.mark.gpu)
                for dtype in DTYPES]


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("q_len,kv_len", SEQ_LENS)
@pytest.mark.parametrize("name", list(ZOO))
def test_mask_matches_reference(name, q_len, kv_len, dtype):
    batch, heads, kv_heads, head_dim = 2, 2, 1, 32
    q, k, v = rand_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype)
    check_forward(q, k, v, ZOO[name](batch, heads, q_len, kv_len, DEVICE))


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


@pytest.mark.parametrize("cap", [1e4, 30.0, 0.5])
def test_softcap_is_exact_for_any_cap(cap):
    """tanh of score / cap: a large cap makes the argument tiny, where 2 * sigmoid(2x) - 1 lost
    digits to cancellation (relative error 3e-4 at cap 1e4, found by tests/test_fuzz.py)."""
    q, k, v = rand_qkv(1, 2, 1, 40, 70, 16, torch.float32)
    check_forward(q * 4, k * 4, v, attngen.mask("causal") & attngen.mask("softcap", cap=cap))
