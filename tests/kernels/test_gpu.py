"""On a CUDA device: bf16, realistic shapes for every mask, the compiled kernels' caches, and the
top-k parametrizations the CPU suite leaves to the GPU (skipped without CUDA)."""

import pytest
import torch
import triton
import triton.language as tl

import attngen
from attngen.checks import check_qkv
from attngen.config import KernelConfig
from attngen.kernels import forward
from attngen.kernels.launch import ensure_allocator, module_for, tma_eligible
from attngen.kernels.topk import Thresholds, TopkTuning, any_tile, threshold_config
from helpers import assert_close, check_forward, check_output, poisoned_like, rand_qkv
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
    check_output(out, q, k, v, mask, lse=lse, topk=topk)


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
    check_output(own, q, k, v, mask, topk=topk)


@triton.jit
def _score_tile(Q, K, S, kv_len, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                KEYS_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One ROWS x COLS tile of the fp32 scores S = Q K^T ((Sq, Sk), lengths multiples of the tile);
    KEYS_FIRST: the tile's rows are keys, computed as K Q^T, as the backward's dK/dV programs do."""
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    offs_d = tl.arange(0, HEAD_DIM)
    if KEYS_FIRST:
        k = tl.load(K + offs_r[:, None] * HEAD_DIM + offs_d[None, :])
        q = tl.load(Q + offs_c[:, None] * HEAD_DIM + offs_d[None, :])
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        tl.store(S + offs_c[None, :] * kv_len + offs_r[:, None], s_t)
    else:
        q = tl.load(Q + offs_r[:, None] * HEAD_DIM + offs_d[None, :])
        k = tl.load(K + offs_c[:, None] * HEAD_DIM + offs_d[None, :])
        tl.store(S + offs_r[:, None] * kv_len + offs_c[None, :], tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION))


@pytest.mark.parametrize("dtype,precision,head_dim", [
    (torch.bfloat16, "tf32", 128), (torch.bfloat16, "tf32", 64), (torch.float16, "tf32", 128),
    (torch.float32, "tf32", 128), (torch.float32, "ieee", 64), (torch.bfloat16, "tf32", 256)],
    ids=["bf16-128", "bf16-64", "fp16-128", "tf32-128", "fp32-64", "bf16-256"])
def test_scores_are_the_same_at_any_tile_and_orientation(dtype, precision, head_dim):
    """topk.any_tile's rule, on which a top-k call's kernels rely to keep the same keys (the
    threshold kernels at their own tiles, the backward at its own config, keys first): every dot
    of 64 or 128 rows on 4 or 8 warps, over 32 to 128 columns, queries or keys first, gives each
    score bit for bit as the threshold kernels' tiles do (64 queries x 64 keys, 4 warps)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("any_tile holds on Hopper only")
    assert any_tile(64, 4, torch.device("cuda")) and not any_tile(32, 4, torch.device("cuda"))
    g = torch.Generator().manual_seed(head_dim)
    q, k = (torch.randn(n, head_dim, generator=g).to("cuda", dtype) for n in (512, 768))

    def scores(rows, cols, warps, keys_first):
        s = torch.full((512, 768), float("nan"), device="cuda")
        grid = ((768 if keys_first else 512) // rows, (512 if keys_first else 768) // cols)
        _score_tile[grid](q, k, s, 768, head_dim, rows, cols, keys_first, precision, num_warps=warps)
        return s

    base = scores(64, 64, 4, False)
    assert not torch.isnan(base).any()
    differ = [(rows, cols, warps, keys_first, int((s.view(torch.int32) != base.view(torch.int32)).sum()))
              for rows in (64, 128) for cols in (32, 64, 128) for warps in (4, 8) for keys_first in (False, True)
              for s in [scores(rows, cols, warps, keys_first)]]
    assert [d for d in differ if d[-1]] == [], "tiles (rows, cols, warps, keys first, scores that differ)"


@pytest.mark.parametrize("density", [0.5, 0.1])
def test_block_sparse_realistic(density):
    """Random 128 x 128 layouts per head at the benchmark's shape, against batch 0's reference."""
    q, k, v = rand_qkv(4, 16, 16, 4096, 4096, 128, torch.bfloat16, device="cuda")
    layout = attngen.layouts.random(4096, 4096, (128, 128), density=density, seed=3, heads=16, device="cuda")
    out = attngen.attention(q, k, v, mask=attngen.block_sparse(layout, (128, 128)) & attngen.mask("causal"))
    ref = attngen.reference.attention(q[:1], k[:1], v[:1], mask=attngen.block_sparse(layout, (128, 128))
                                      & attngen.mask("causal"))
    assert_close(out[:1], ref, torch.bfloat16)
