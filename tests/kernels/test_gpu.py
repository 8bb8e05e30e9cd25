"""On a CUDA device: bf16, realistic shapes for every mask, the compiled kernels' caches, and the
top-k parametrizations the CPU suite leaves to the GPU (skipped without CUDA)."""

import pytest
import torch

import attngen
from attngen.checks import check_qkv
from attngen.config import KernelConfig
from attngen.kernels import forward
from attngen.kernels.launch import ensure_allocator, module_for, tma_eligible
from attngen.kernels.topk import Thresholds, TopkTuning, threshold_config
from helpers import assert_close, check_forward, poisoned_like, rand_qkv
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
        check_forward(q, k, v, mask)


@pytest.mark.parametrize("head_dim", [128, 80])
def test_new_lengths_in_a_bucket_do_not_recompile(head_dim):
    """Sequence lengths are run-time arguments: lengths sharing a registry bucket share the compiled kernel."""
    kernel = module_for("forward", attngen.masks.as_mask("causal")).attention_fwd

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
def test_topk_thresholds_at_their_own_tiles(topk, config, mask):
    """On Hopper the threshold kernels run at their own tiles (threshold_config), whatever the
    attention kernel's: only right if both compute every score bit for bit the same, so that each
    row keeps the same keys as with thresholds found at the attention's tiles (equal outputs).
    One attention config a K: every config compiles the threshold kernels twice (about a minute)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the threshold kernels share the attention's tiles off Hopper")
    q, k, v = rand_qkv(2, 8, 2, 2000, 2000, 128, torch.bfloat16, device="cuda")
    assert threshold_config(config, q.device, TopkTuning()) != config
    shape = check_qkv(q, k, v, kernel=True)
    bound, structure = forward.blocks(q, attngen.masks.as_mask(mask), shape, config)
    scale = 128 ** -0.5

    def attention(own):
        thr = Thresholds(q, k, bound, structure, shape, scale, topk, config, own=own).run(q, k)
        out, lse = poisoned_like(q)
        use_tma = config.use_tma and tma_eligible(q, k, v)
        if use_tma:
            ensure_allocator()
        forward.forward_launch(q, k, v, out, lse, thr, bound, structure, shape, scale, config, use_tma)()
        return out

    own = attention(None)  # threshold_config's tiles
    shared = attention(config)  # the attention's own
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
