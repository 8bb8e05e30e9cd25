"""On a CUDA device: bf16 and realistic shapes for every mask (skipped without CUDA)."""

import pytest
import torch

import attngen
import attngen.kernels.forward as forward
from attngen.config import KernelConfig
from attngen.kernels.forward import attention_forward
from conftest import assert_close, poisoned_like, rand_qkv
from masks_zoo import ZOO

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(ZOO))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_realistic_shape(name, dtype):
    """B=4, H=16 (GQA 4:1 for half the masks), S=4096, D=128, through the public API."""
    batch, heads, seq, head_dim = 4, 16, 4096, 128
    kv_heads = 4 if len(name) % 2 else heads
    q, k, v = rand_qkv(batch, heads, kv_heads, seq, seq, head_dim, dtype, device="cuda")
    mask = ZOO[name](batch, heads, seq, seq, "cuda")
    out, lse = attngen.attention(q, k, v, mask=mask, return_lse=True)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask=mask, return_lse=True)
    assert_close(out, ref, dtype, lse, ref_lse)
    del ref, ref_lse
    torch.cuda.empty_cache()


@pytest.mark.parametrize("q_len,kv_len", [(1, 8192), (1000, 3000), (4097, 4097)])
def test_bf16_ragged(q_len, kv_len):
    q, k, v = rand_qkv(2, 8, 2, q_len, kv_len, 96, torch.bfloat16, device="cuda")
    for mask in (None, "causal", attngen.mask("causal", align="bottom_right")):
        out, lse = poisoned_like(q)
        config = attngen.dispatch.choose(q, k, v, mask).config
        attention_forward(q, k, v, mask, return_lse=True, config=config, out=out, lse=lse)
        ref, ref_lse = attngen.reference.attention(q, k, v, mask, return_lse=True)
        assert_close(out, ref, torch.bfloat16, lse, ref_lse)


@pytest.mark.parametrize("head_dim", [128, 80])
def test_new_lengths_in_a_bucket_do_not_recompile(head_dim):
    """Sequence lengths are run-time arguments: lengths sharing a registry bucket share the compiled kernel."""
    from attngen import masks as masks_
    from attngen.kernels.forward import kernel_for

    kernel = kernel_for(masks_.as_mask("causal"))

    def compiled():
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    q, k, v = rand_qkv(2, 4, 4, 1000, 1000, head_dim, torch.bfloat16, device="cuda")
    attngen.attention(q, k, v, mask="causal")
    before = compiled()
    for seq in (1001, 1017, 1023, 1024):
        q, k, v = rand_qkv(2, 4, 4, seq, seq, head_dim, torch.bfloat16, device="cuda")
        out = attngen.attention(q, k, v, mask="causal")
        assert_close(out, attngen.reference.attention(q, k, v, mask="causal"), torch.bfloat16)
    assert compiled() == before


@pytest.mark.parametrize("topk", [1, 64, 256, 1024])
@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_topk_realistic(topk, mask, dtype):
    """Top-k softmax through the public API at a training-like shape, from K=1 to the largest K."""
    q, k, v = rand_qkv(2, 8, 2, 2048, 2048, 128, dtype, device="cuda")
    out, lse = attngen.attention(q, k, v, mask=mask, topk=topk, return_lse=True)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask=mask, topk=topk, return_lse=True)
    assert_close(out, ref, dtype, lse, ref_lse)


@pytest.mark.parametrize("topk,config", [(64, KernelConfig(128, 64, 4, 2, use_tma=True)),
                                         (256, KernelConfig(128, 64, 8, 2))], ids=["64-128x64x4t", "256-128x64x8"])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_topk_thresholds_at_their_own_tiles(topk, config, mask, monkeypatch):
    """On Hopper the threshold kernels run at their own tiles (threshold_config), whatever the
    attention kernel's: only right if both compute every score bit for bit the same, so that each
    row keeps the same keys as with thresholds found at the attention's tiles (equal outputs).
    One attention config a K: every config compiles the threshold kernels twice (about a minute)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the threshold kernels share the attention's tiles off Hopper")
    q, k, v = rand_qkv(2, 8, 2, 2000, 2000, 128, torch.bfloat16, device="cuda")
    assert forward.threshold_config(config, q.device) != config
    own, _ = attention_forward(q, k, v, mask, topk=topk, config=config)
    with monkeypatch.context() as m:
        m.setattr(forward, "threshold_config", lambda config, device: config)
        shared, _ = attention_forward(q, k, v, mask, topk=topk, config=config)
    assert torch.equal(own, shared)
    assert_close(own, attngen.reference.attention(q, k, v, mask, topk=topk), torch.bfloat16)


@pytest.mark.parametrize("density", [0.5, 0.1])
def test_block_sparse_realistic(density):
    """Random 128 x 128 layouts per head at the benchmark's shape, against batch 0's reference."""
    q, k, v = rand_qkv(4, 16, 16, 4096, 4096, 128, torch.bfloat16, device="cuda")
    layout = attngen.layouts.random(4096, 4096, (128, 128), density=density, seed=3, heads=16, device="cuda")
    out = attngen.attention(q, k, v, mask=attngen.block_sparse(layout, (128, 128)) & attngen.mask("causal"))
    ref = attngen.reference.attention(q[:1], k[:1], v[:1], mask=attngen.block_sparse(layout, (128, 128))
                                      & attngen.mask("causal"))
    assert_close(out[:1], ref, torch.bfloat16)
