"""The forward kernel on shapes, head dims, GQA, strides, LSE, empty rows, block skipping and every
switch of its template."""

import math

import pytest
import torch

import attngen
from attngen.config import KernelConfig
from attngen.kernels.forward import attention_forward
from helpers import DEVICE, DTYPES, assert_close, check_forward, rand_qkv
from masks_zoo import ZOO


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (100, 257), (257, 100)])
def test_head_dims(head_dim, mask, q_len, kv_len, dtype):
    check_forward(*rand_qkv(1, 2, 2, q_len, kv_len, head_dim, dtype), mask)


@pytest.mark.parametrize("head_dim", [24, 96, 200, 256])
def test_odd_and_large_head_dims(head_dim):
    check_forward(*rand_qkv(1, 1, 1, 33, 65, head_dim, torch.float16), "causal")


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("mask", [None, "causal", "alibi"])
def test_gqa_mqa(heads, kv_heads, mask):
    if mask == "alibi":  # depends on the query head: checks the head mapping
        mask = attngen.mask("alibi", slopes=torch.linspace(0.1, 1.0, heads, device=DEVICE))
    check_forward(*rand_qkv(2, heads, kv_heads, 50, 70, 32, torch.float16), mask)


def test_strided_inputs():
    """(B, S, H, D) tensors viewed as (B, H, S, D), and k / v sliced out of one packed tensor."""
    b, s, h, d = 2, 77, 4, 64
    q = torch.randn(b, s, h, d, device=DEVICE).half().transpose(1, 2)
    kv = torch.randn(b, s, 2, h, d, device=DEVICE).half()
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    out, _ = check_forward(q, k, v, "causal")
    assert out.stride() == q.stride()  # written in q's layout, nothing copied
    # a non-unit stride on the head dim too
    wide = torch.randn(b, h, s, 2 * d, device=DEVICE).half()
    check_forward(wide[..., ::2], wide[..., 1::2], wide[..., ::2], None)


def test_scale():
    q, k, v = rand_qkv(1, 2, 2, 40, 40, 32, torch.float32)
    check_forward(q, k, v, "causal", scale=0.3)
    a = attngen.attention(q, k, v, scale=1 / math.sqrt(32))
    b = attngen.attention(q, k, v)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_rows_give_zero_and_minus_inf(dtype):
    """Bottom-right causal with Sq > Sk: the first Sq - Sk queries see no key at all."""
    q, k, v = rand_qkv(1, 2, 2, 90, 40, 32, dtype)
    out, lse = check_forward(q, k, v, attngen.mask("causal", align="bottom_right"))
    assert (out[:, :, :50] == 0).all() and torch.isneginf(lse[:, :, :50]).all()
    assert torch.isfinite(lse[:, :, 50:]).all()


def test_lse_is_natural_log():
    q, k, v = rand_qkv(1, 1, 1, 5, 9, 16, torch.float32)
    _, lse = attngen.attention(q, k, v, return_lse=True)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 4.0
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=1e-5)


def test_single_query_decode():
    q, k, v = rand_qkv(3, 8, 2, 1, 300, 128, torch.float16)
    assert attngen.dispatch.choose(q, k, v).config.block_m == 16
    check_forward(q, k, v, attngen.mask("causal", align="bottom_right"))


def test_invisible_blocks_are_never_read(tmp_path):
    """Keys that no query can see are NaN: a kernel that visited their blocks would return NaN."""
    (tmp_path / "first_keys.yaml").write_text(
        "doc: only the first `limit` keys are visible\n"
        "params:\n  limit: {type: int, min: 0}\n"
        "expr: kv_idx < limit\n")
    attngen.register_template_dir(tmp_path)
    config = KernelConfig(32, 32, 4, 1)
    q, k, v = rand_qkv(1, 2, 2, 64, 250, 32, torch.float16)
    mask = attngen.mask("first_keys", limit=70)  # block 2 (keys 64..95) is partial; blocks 3.. are empty
    ref = attngen.reference.attention(q, k, v, mask)
    k[:, :, 96:] = float("nan")
    v[:, :, 96:] = float("nan")
    out = attention_forward(q, k, v, mask, config=config)[0]
    assert_close(out, ref, torch.float16)


@pytest.mark.parametrize("name", ["none", "causal", "document", "block_sparse&causal"])
def test_empty_query(name):
    q, k, v = rand_qkv(1, 2, 2, 0, 10, 16, torch.float16)
    if name == "block_sparse&causal":  # a layout with no query block (the generators want a length >= 1)
        empty = torch.zeros(1, 2, 0, 1, dtype=torch.bool, device=DEVICE)
        mask = attngen.block_sparse(empty, (64, 48)) & attngen.mask("causal")
    else:
        mask = ZOO[name](1, 2, 0, 10, DEVICE)
    assert attngen.attention(q, k, v, mask=mask).shape == (1, 2, 0, 16)
    assert attngen.attention(q, k, v, mask=mask, topk=3).shape == (1, 2, 0, 16)
    out, lse = attention_forward(q, k, v, mask, return_lse=True, config=KernelConfig(16, 16, 4, 1))
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)


@pytest.mark.parametrize("batch,heads,q_len", [(0, 2, 5), (1, 0, 5), (2, 2, 0)])
def test_empty_outputs(batch, heads, q_len):
    """No batch, no query head (0 is a multiple of the key/value heads) or no query: empty outputs,
    top-k and gradients included (k and v get zeros), whatever the mask (found by tests/test_fuzz.py)."""
    q, k, v = rand_qkv(batch, heads, 2, q_len, 10, 16, torch.float32)
    for mask in (None, "causal", ZOO["document"](batch, heads, q_len, 10, DEVICE)):
        for topk in (None, 3):
            out, lse = attngen.attention(q, k, v, mask=mask, topk=topk, return_lse=True)
            assert out.shape == q.shape and lse.shape == q.shape[:3]
    k.requires_grad_()
    out = attngen.attention(q, k, v, mask="causal", topk=3)
    (dk,) = torch.autograd.grad(out.sum(), k)
    assert torch.equal(dk, torch.zeros_like(k))


def test_an_invalid_config_is_refused_before_compiling():
    q, k, v = rand_qkv(1, 1, 1, 20, 20, 16, torch.float32)
    with pytest.raises(ValueError, match=r"invalid kernel config 48x16 w4 s1: block_m=48 must be a power of two"):
        attention_forward(q, k, v, config=KernelConfig(48, 16, 4, 1))
    with pytest.raises(ValueError, match=r"invalid kernel config 16x16 w4 s1 tma ws: warp_specialize is not supported"):
        attention_forward(q, k, v, config=KernelConfig(16, 16, 4, 1, use_tma=True, warp_specialize=True))


@pytest.mark.parametrize("config", [
    KernelConfig(16, 16, 1, 1),
    KernelConfig(32, 64, 2, 2),
    KernelConfig(64, 16, 4, 3, use_tma=True),
], ids=str)
@pytest.mark.parametrize("name", ["none", "causal", "(causal|chunked)&document&alibi&softcap"])
def test_configs(config, name):
    """Every switch of the kernel template (tile sizes, TMA) gives the same result."""
    q, k, v = rand_qkv(1, 2, 2, 100, 130, 80, torch.float16)
    check_forward(q, k, v, ZOO[name](1, 2, 100, 130, DEVICE), config)
