"""The forward kernel on shapes, head dims, GQA, strides, LSE, empty rows and block skipping."""

import math

import pytest
import torch

import attngen
from attngen import masks as masks_
from attngen.config import KernelConfig
from attngen.kernels.forward import attention_forward
from conftest import DEVICE, DTYPES, assert_close, poisoned_like, rand_qkv


def run(q, k, v, mask=None, config=None, **kwargs):
    """The kernel on poisoned outputs, checked against the reference."""
    config = config or attngen.dispatch.choose(q, k, v, mask).config
    out, lse = poisoned_like(q)
    attention_forward(q, k, v, mask, return_lse=True, config=config, out=out, lse=lse, **kwargs)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask, return_lse=True, **kwargs)
    assert_close(out, ref, q.dtype, lse, ref_lse)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (100, 257), (257, 100)])
def test_head_dims(head_dim, mask, q_len, kv_len, dtype):
    run(*rand_qkv(1, 2, 2, q_len, kv_len, head_dim, dtype), mask)


@pytest.mark.parametrize("head_dim", [24, 96, 200, 256])
def test_odd_and_large_head_dims(head_dim):
    run(*rand_qkv(1, 1, 1, 33, 65, head_dim, torch.float16), "causal")


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("mask", [None, "causal", "alibi"])
def test_gqa_mqa(heads, kv_heads, mask):
    if mask == "alibi":  # depends on the query head: checks the head mapping
        mask = attngen.mask("alibi", slopes=torch.linspace(0.1, 1.0, heads, device=DEVICE))
    run(*rand_qkv(2, heads, kv_heads, 50, 70, 32, torch.float16), mask)


def test_strided_inputs():
    """(B, S, H, D) tensors viewed as (B, H, S, D), and k / v sliced out of one packed tensor."""
    b, s, h, d = 2, 77, 4, 64
    q = torch.randn(b, s, h, d, device=DEVICE).half().transpose(1, 2)
    kv = torch.randn(b, s, 2, h, d, device=DEVICE).half()
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    out, _ = run(q, k, v, "causal")
    assert out.stride() == q.stride()  # written in q's layout, nothing copied
    # a non-unit stride on the head dim too
    wide = torch.randn(b, h, s, 2 * d, device=DEVICE).half()
    run(wide[..., ::2], wide[..., 1::2], wide[..., ::2], None)


def test_scale():
    q, k, v = rand_qkv(1, 2, 2, 40, 40, 32, torch.float32)
    run(q, k, v, "causal", scale=0.3)
    a = attngen.attention(q, k, v, scale=1 / math.sqrt(32))
    b = attngen.attention(q, k, v)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_rows_give_zero_and_minus_inf(dtype):
    """Bottom-right causal with Sq > Sk: the first Sq - Sk queries see no key at all."""
    q, k, v = rand_qkv(1, 2, 2, 90, 40, 32, dtype)
    out, lse = run(q, k, v, attngen.mask("causal", align="bottom_right"))
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
    run(q, k, v, attngen.mask("causal", align="bottom_right"))


def test_invisible_blocks_are_never_read(tmp_path):
    """Keys that no query can see are NaN: a kernel that visited their blocks would return NaN."""
    (tmp_path / "first_keys.yaml").write_text(
        "doc: only the first `limit` keys are visible\n"
        "params:\n  limit: {type: int, min: 0}\n"
        "expr: kv_idx < limit\n")
    attngen.register_template_dir(tmp_path)
    config = KernelConfig(32, 32, 4, 1)
    q, k, v = rand_qkv(1, 2, 2, 64, 256, 32, torch.float16)
    mask = attngen.mask("first_keys", limit=70)  # block 2 (keys 64..95) is partial; blocks 3.. are empty
    ref = attngen.reference.attention(q, k, v, mask)
    k[:, :, 96:] = float("nan")
    v[:, :, 96:] = float("nan")
    out = attention_forward(q, k, v, mask, config=config)[0]
    assert_close(out, ref, torch.float16)


def test_causal_on_band_split():
    """Causal with square tiles: one partial (diagonal) block per query block, the rest full or skipped."""
    s = masks_.block_structure(masks_.mask("causal"), 256, 256, (64, 64), device=DEVICE)
    assert s.partial_num.flatten().tolist() == [1, 1, 1, 1]
    assert s.full_num.flatten().tolist() == [0, 1, 2, 3]
    assert s.partial_idx[0, 0, :, 0].tolist() == [0, 1, 2, 3]
    assert s.contiguous
    dense = masks_.block_structure(None, 100, 100, (64, 64), device=DEVICE)
    assert dense.full_num.flatten().tolist() == [1, 1] and dense.partial_num.flatten().tolist() == [1, 1]


@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "chunked", "prefix_lm", "block_sparse",
                                  "block_sparse&causal", "block_sparse_shared"])
def test_block_classes_match_brute_force(name):
    from masks_zoo import ZOO

    b, h, sq, sk, bm, bn = 2, 3, 130, 200, 32, 16
    m = masks_.as_mask(ZOO[name](b, h, sq, sk, DEVICE))
    classes = m.block_structure(sq, sk, (bm, bn), batch=b, heads=h, device=DEVICE).classes
    q = torch.zeros(b, h, sq, 16, device=DEVICE)
    k = torch.zeros(b, 1, sk, 16, device=DEVICE)
    v = torch.eye(sk, 16, device=DEVICE).repeat(b, 1, 1, 1)[:, :, :sk]
    bound = masks_.bind(m, batch=b, heads=h, q_len=sq, kv_len=sk, device=DEVICE)
    env = dict(b=torch.arange(b).view(-1, 1, 1, 1), h=torch.arange(h).view(1, -1, 1, 1),
               q_idx=torch.arange(sq).view(1, 1, -1, 1), kv_idx=torch.arange(sk).view(1, 1, 1, -1),
               q_len=sq, kv_len=sk, batch=b, heads=h)
    visible = masks_.evaluate_visible(bound, env).expand(b, h, sq, sk).cpu()
    for i in range(math.ceil(sq / bm)):
        for j in range(math.ceil(sk / bn)):
            tile = visible[:, :, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            full = tile.flatten(2).all(-1) & ((j + 1) * bn <= sk)
            expect = torch.where(full, 2, torch.where(tile.flatten(2).any(-1), 1, 0))
            got = classes[:, :, i, j].expand(b, h).cpu().long()
            assert torch.equal(got, expect), (i, j)
    del q, k, v


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
    q, k, v = rand_qkv(1, 2, 2, 256, 256, 16, torch.float16)
    out = attngen.attention(q, k, v, mask=m)  # and the kernel sees the new documents
    assert_close(out, attngen.reference.attention(q, k, v, mask=m), torch.float16)
    other = attngen.mask("document", doc_ids=ids.clone())
    assert other.block_structure(256, 256, (64, 64), device=DEVICE) is not b


def test_empty_query():
    q, k, v = rand_qkv(1, 2, 2, 0, 10, 16, torch.float16)
    assert attngen.attention(q, k, v).shape == (1, 2, 0, 16)
