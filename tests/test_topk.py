"""Top-k softmax: the kernels against the float64 reference, the tie rule, and bad arguments.

The threshold kernels find a row's threshold one of three ways, and every test here runs all
three (the `path` fixture): "whole" (the row's key blocks all fit in the sample, which is then
exact), "sampled" (a small sample brackets the threshold and one capture pass finds it) and
"missed" (no margin around the sample's estimate, so rows miss their bracket: topk_select flags
their tiles, and topk_threshold redoes them with retries).
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import attngen
import attngen.kernels.forward as forward
from attngen.checks import check_qkv
from attngen.config import KernelConfig
from attngen.kernels.forward import attention_forward
from conftest import DEVICE, assert_close, poisoned_like, rand_qkv
from masks_zoo import ZOO


@pytest.fixture(params=["whole", "sampled", "missed"])
def path(request, monkeypatch):
    if request.param != "whole":
        monkeypatch.setattr(forward, "TOPK_SAMPLE", 32)  # two key blocks of 16
    if request.param == "missed":
        monkeypatch.setattr(forward, "TOPK_MARGIN", 0.0)
    return request.param


def check(q, k, v, mask, topk, config, dtype=torch.float32):
    out, lse = poisoned_like(q)
    attention_forward(q, k, v, mask, return_lse=True, topk=topk, config=config, out=out, lse=lse)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask, return_lse=True, topk=topk)
    assert_close(out, ref, dtype, lse, ref_lse)
    return out


@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("topk,config", [
    (1, KernelConfig(32, 32, 4, 1)),
    (8, KernelConfig(16, 16, 4, 1)),
    (8, KernelConfig(16, 16, 4, 1, use_tma=True)),  # both kernels load K through tensor descriptors
    (40, KernelConfig(32, 16, 4, 1)),  # causal: the first 40 rows see fewer than topk keys
    (64, KernelConfig(16, 32, 4, 1)),  # causal: the first 64 rows see fewer than topk keys
    (300, KernelConfig(16, 32, 4, 1)),  # more than Sk: every visible key
], ids=lambda x: str(x))
def test_topk_matches_reference(topk, config, mask, path):
    q, k, v = rand_qkv(1, 2, 1, 70, 90, 16, torch.float32)
    check(q, k, v, mask, topk, config)


def test_topk_with_ragged_lengths_gqa_and_fp16(path):
    q, k, v = rand_qkv(2, 4, 2, 37, 75, 24, torch.float16)
    check(q, k, v, "causal", 5, KernelConfig(16, 16, 4, 1), torch.float16)


@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("topk", [1, 7, 40])
def test_thresholds_are_exact_on_integer_scores(topk, mask, path):
    """Small integer q and k give exact scores with many ties: each row's threshold must keep exactly
    the scores >= its topk-th largest (all visible scores where it sees fewer)."""
    g = torch.Generator().manual_seed(topk)
    q = torch.randint(-2, 3, (1, 2, 50, 16), generator=g).float().to(DEVICE)
    k = torch.randint(-2, 3, (1, 2, 200, 16), generator=g).float().to(DEVICE)
    shape = check_qkv(q, k, k, kernel=True)
    config = KernelConfig(16, 16, 4, 1)
    bound, structure = forward.blocks(q, attngen.masks.as_mask(mask), shape, config)
    result = forward.Thresholds(q, k, bound, structure, shape, 1.0, topk, config).run(q, k)
    thr, row_max = result[:100].view(1, 2, 50, 1), result[100:].view(1, 2, 50)
    scores = q @ k.transpose(-1, -2)  # the kernel compares unscaled scores when no modifier runs
    visible = torch.ones(50, 200, dtype=torch.bool, device=DEVICE)
    if mask == "causal":
        visible = visible.tril()
    scores = scores.masked_fill(~visible, float("-inf"))
    kth = scores.topk(topk, dim=-1).values[..., -1:]
    assert torch.equal((scores >= thr) & visible, (scores >= kth) & visible)
    assert torch.equal(row_max, scores.amax(-1))  # what the attention kernel's softmax subtracts


@pytest.mark.parametrize("mask", [None, "causal"])
def test_topk_softmax_of_large_scores(mask, path):
    """Scores in the hundreds: the attention kernel's softmax subtracts each row's largest score,
    which the capture recorded, so nothing overflows (exp2 of an unshifted score would) or
    vanishes (a shift too far would leave the row's weights 0)."""
    q, k, v = rand_qkv(1, 2, 1, 40, 130, 16, torch.float32)
    check(q * 12, k * 12, v, mask, 6, KernelConfig(16, 16, 4, 1))


def test_selection_holds_as_little_of_a_row_as_it_needs():
    """topk_select searches the first quarter, half or three quarters of a capture area where its
    rows fit there (_select_fitted): query blocks that see 80, 192, 320 and 400 keys, captured whole
    in areas of 512, reach all four widths, and every threshold must keep exactly the scores >= the
    row's topk-th."""
    g = torch.Generator().manual_seed(11)
    q = torch.randint(-8, 9, (1, 1, 64, 16), generator=g).float().to(DEVICE)
    k = torch.randint(-8, 9, (1, 1, 400, 16), generator=g).float().to(DEVICE)
    layout = torch.zeros(1, 1, 4, 25, dtype=torch.bool)
    for block, seen in enumerate((5, 12, 20, 25)):  # key blocks of 16
        layout[..., block, :seen] = True
    mask = attngen.block_sparse(layout.to(DEVICE), block_size=(16, 16))
    shape = check_qkv(q, k, k, kernel=True)
    config = KernelConfig(16, 16, 4, 1)
    bound, structure = forward.blocks(q, mask, shape, config)
    thresholds = forward.Thresholds(q, k, bound, structure, shape, 1.0, 40, config)
    assert thresholds.cap_w == 512 and thresholds.group == 2
    buffers = thresholds.buffers(q.device)
    for kernel, grid, args, kwargs in thresholds.launches(q, k, *buffers):
        kernel[grid](*args, **kwargs)
    assert buffers[4][0::2].tolist() == [n for n in (80, 192, 320, 400) for _ in range(16)]  # captured
    assert int(buffers[5].sum()) == 0  # no retries: topk_select set every threshold
    visible = layout.repeat_interleave(16, 2).repeat_interleave(16, 3)[0, 0].to(DEVICE)
    scores = (q @ k.transpose(-1, -2)).view(64, 400).masked_fill(~visible, float("-inf"))
    kth = scores.topk(40, dim=-1).values[:, -1:]
    assert torch.equal((scores >= buffers[0][:64].view(64, 1)) & visible, (scores >= kth) & visible)


@pytest.mark.parametrize("mask", [None, "causal"])
def test_thresholds_at_tiles_of_their_own(mask, path, monkeypatch):
    """Threshold kernels at other tiles than the attention kernel's (threshold_config: on Hopper;
    forced here), over a block structure of their own: exact where every score comes out the same
    at both tiles, as integer-valued ones do under the interpreter."""
    monkeypatch.setattr(forward, "threshold_config", lambda config, device: KernelConfig(32, 16, 4, 1))
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-2, 3, (1, 2, 50, 16), generator=g).float().to(DEVICE)
    k = torch.randint(-2, 3, (1, 2, 200, 16), generator=g).float().to(DEVICE)
    v = torch.randn(1, 2, 200, 16, generator=g).to(DEVICE)
    config = KernelConfig(16, 16, 4, 1)
    shape = check_qkv(q, k, v, kernel=True)
    bound, structure = forward.blocks(q, attngen.masks.as_mask(mask), shape, config)
    thresholds = forward.Thresholds(q, k, bound, structure, shape, 1.0, 7, config)
    assert thresholds.bm == 32
    check(q, k, v, mask, 7, config)


@pytest.mark.parametrize("margin", [5.5, 0.0], ids=["margin", "no margin"])
@pytest.mark.parametrize("topk,mask,integer,block_n", [(8, None, False, 16), (20, "causal", False, 16),
                                                       (150, None, True, 64)],
                         ids=["k8", "k20 causal", "k150 ties"])
def test_bracket_from_the_sample_candidates(topk, mask, integer, block_n, margin, monkeypatch):
    """A sample of 8 key blocks (7 sampled over 25 blocks): a column samples more scores than the 3
    it keeps, so the bracket's ends come from bounds of the sampled counts; at K=150 (blocks of 64
    keys, enough candidates for its lo end) the hi end is finite. Without a margin, rows miss and
    retry."""
    monkeypatch.setattr(forward, "TOPK_SAMPLE", 8 * block_n)
    monkeypatch.setattr(forward, "TOPK_MARGIN", margin)
    assert forward.topk_widths(topk, 25 * block_n, block_n)[0] == 8 * block_n
    if topk == 150:
        assert forward._bracket_ranks(topk, 25 * block_n, block_n, 8 * block_n)[2] >= 1  # a finite hi end
    q, k, v = rand_qkv(1, 2, 1, 64, 25 * block_n, 16, torch.float32)
    if integer:  # scores of small integers: many ties
        q, k = q.round(), k.round()
    check(q, k, v, mask, topk, KernelConfig(16, block_n, 4, 1))


@pytest.mark.parametrize("share", [0.01, 0.05])
def test_bracket_hi_end_only_where_its_rank_is_a_share_of_the_sample(share, monkeypatch):
    """K=150 over 25 key blocks of 64, 7 of them sampled (448 scores): the hi end's rank, 10, is
    2.2% of the sample, so topk_bracket gives every row a finite hi at a share of 1% and none at
    5% (each such tile then runs the capture without the count above hi); the thresholds are
    exact either way."""
    monkeypatch.setattr(forward, "TOPK_SAMPLE", 8 * 64)
    monkeypatch.setattr(forward, "TOPK_HI_SHARE", share)
    rank_hi = forward._bracket_ranks(150, 25 * 64, 64, 8 * 64)[2]
    assert rank_hi == (10 if share == 0.01 else 0)
    q, k, v = rand_qkv(1, 2, 1, 64, 25 * 64, 16, torch.float32)
    config = KernelConfig(16, 64, 4, 1)
    shape = check_qkv(q, k, v, kernel=True)
    bound, structure = forward.blocks(q, None, shape, config)
    thresholds = forward.Thresholds(q, k, bound, structure, shape, 1.0, 150, config)
    buffers = thresholds.buffers(q.device)
    for kernel, grid, args, kwargs in thresholds.launches(q, k, *buffers):
        kernel[grid](*args, **kwargs)
    hi = buffers[2]
    assert bool(torch.isfinite(hi).all()) if rank_hi else bool((hi == float("inf")).all())
    check(q, k, v, None, 150, config)


@pytest.mark.parametrize("margin", [5.5, 0.0], ids=["margin", "no margin"])
def test_one_capture_launch_takes_tiles_with_and_without_a_hi_end(margin, monkeypatch):
    """K=80 over 16 key blocks of 32, 8 of them sampled: the full rows' bracket has a hi end (rank
    14), so the capture is one launch, with the count above hi, for every tile; under a causal mask
    the first query tiles see too few keys for a hi end (or are captured whole), and that launch
    takes them too. The thresholds are exact either way, and with no margin (rows that miss,
    retried) too."""
    monkeypatch.setattr(forward, "TOPK_SAMPLE", 8 * 32)
    monkeypatch.setattr(forward, "TOPK_MARGIN", margin)
    if margin:
        assert forward._bracket_ranks(80, 512, 32, 8 * 32)[2] == 14
        assert forward.capture_launches(8, 512, 32) == ((False, False), (True, False))  # no hi end at K=8
    assert forward.capture_launches(80, 512, 32) == ((True, True),)
    q, k, v = rand_qkv(1, 2, 1, 512, 512, 16, torch.float32)
    config = KernelConfig(16, 32, 4, 1)
    shape = check_qkv(q, k, v, kernel=True)
    bound, structure = forward.blocks(q, attngen.masks.as_mask("causal"), shape, config)
    thresholds = forward.Thresholds(q, k, bound, structure, shape, 1.0, 80, config)
    buffers = thresholds.buffers(q.device)
    launches = thresholds.launches(q, k, *buffers)
    assert [kw["ALL_TILES"] for kernel, _, _, kw in launches if kernel.fn.__name__ == "topk_capture"] == [True]
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)
    hi_tiles = torch.isfinite(buffers[2]).view(-1, 16).any(1)
    if margin:
        assert bool(hi_tiles.any()) and not bool(hi_tiles.all())
    check(q, k, v, "causal", 80, config)


def test_topk_after_score_modifiers_and_a_block_layout(path):
    """The k largest are taken among the visible, modified scores."""
    q, k, v = rand_qkv(1, 2, 2, 64, 80, 16, torch.float32)
    q = q * 3  # spread the scores so that the soft cap reorders nothing but still bends them
    check(q, k, v, ZOO["block_sparse|sliding_window&softcap"](1, 2, 64, 80, DEVICE), 6, KernelConfig(16, 16, 4, 1))


def test_ties_at_the_kth_score_are_all_kept(path):
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
    assert "variant causal(align='top_left') & topk(64)" in text
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


def test_selection_groups_fit_the_tile():
    # rows a selection holds in registers: a power of two, at least one, at most the tile's rows,
    # and about TOPK_GROUP_VALUES values a thread
    for width in (16, 128, 512, 1024, 4096):
        for block_m in (16, 64, 128):
            for warps in (4, 8):
                rows = forward.group_rows(width, block_m, warps)
                assert 1 <= rows <= block_m and rows & (rows - 1) == 0
                if 1 < rows < block_m:
                    assert rows * width == forward.TOPK_GROUP_VALUES * 32 * warps


def test_select_programs_fit_the_tile():
    # rows of a topk_select program: a power of two dividing the tile's rows, at least
    # TOPK_SELECT_WARPS where the tile has that many, and about TOPK_GROUP_VALUES values a thread
    for width in (16, 128, 512, 1024, 4096):
        for block_m in (16, 64, 128):
            rows = forward.select_rows(width, block_m)
            assert block_m % rows == 0 and rows & (rows - 1) == 0
            assert rows >= min(block_m, forward.TOPK_SELECT_WARPS)
            if forward.TOPK_SELECT_WARPS < rows < block_m:
                assert rows * width == forward.TOPK_GROUP_VALUES * 32 * forward.TOPK_SELECT_WARPS


@pytest.mark.parametrize("mask", [None, "causal"])
def test_capture_areas_in_chunks(mask, path, monkeypatch):
    """A call whose capture areas do not fit the area budget captures and selects chunk by chunk
    (3 query tiles a chunk here, the last chunk short); the flagged tiles of every chunk are redone."""
    config = KernelConfig(16, 16, 4, 1)
    q, k, v = rand_qkv(1, 2, 1, 64, 150, 16, torch.float32)  # 8 query tiles of 16 rows
    cap_w = forward.topk_widths(9, 150, 16)[1]
    monkeypatch.setattr(forward, "TOPK_AREA_FLOATS", 3 * 16 * cap_w)
    shape = check_qkv(q, k, v, kernel=True)
    bound, structure = forward.blocks(q, attngen.masks.as_mask(mask), shape, config)
    assert forward.Thresholds(q, k, bound, structure, shape, 1.0, 9, config).chunk == 3
    check(q, k, v, mask, 9, config)


def test_capture_setup_and_chunks():
    # the capture runs the dense setup (deeper pipeline, fewer programs an SM) where the bracket is
    # expected to take more than TOPK_DENSE_CAPTURE of a row's keys (B=4 H=16 D=128 on an H200:
    # 5% at K=64 and S=4096 or K=256 and S=16384, 13% at K=256 and S=4096)
    sparse = (forward.TOPK_CAPTURE_STAGES, forward.TOPK_CAPTURE_PROGRAMS)
    dense = (forward.TOPK_DENSE_CAPTURE_STAGES, forward.TOPK_DENSE_CAPTURE_PROGRAMS)
    assert forward.capture_setup(64, 4096, 64) == forward.capture_setup(256, 16384, 64) == sparse
    assert forward.capture_setup(256, 4096, 64) == forward.capture_setup(512, 4096, 64) == dense
    assert forward.capture_setup(8, 100, 16) == dense  # rows the sample covers whole: every score captured
    # a chunk takes every tile when all areas fit, else as many as fit, or one wave of programs
    # where that is under two
    assert forward.chunk_tiles(1000, 1000, 396) == forward.chunk_tiles(1000, 5000, 396) == 1000
    assert forward.chunk_tiles(16384, 512, 396) == 396
    assert forward.chunk_tiles(16384, 792, 396) == 792 and forward.chunk_tiles(4096, 2048, 396) == 2048
    assert forward.chunk_tiles(16384, 300, 396) == 300 and forward.chunk_tiles(10, 0, 3) == 1


@pytest.mark.parametrize("topk,area", [(40, None), (4, 64)], ids=["lo's rank", "a narrow area"])
def test_causal_tiles_sample_as_their_candidates_and_area_allow(topk, area, monkeypatch):
    """Under a causal mask a query tile sees fewer key blocks than the longest rows, which the sample
    is sized for (here 8 of 40 blocks of 16). K=40: tiles of 9, 11, 13 or 15 blocks, sampled every
    second block, would rank lo past their 48 candidates (lo = -FLT_MAX: the whole row captured; at
    B=4 H=16 S=4096 K=256 on an H200, 964 tiles overflowed and the call took 50.6 ms); they must
    sample sparser. An area of 64 (narrower than the sample): tiles of 5 to 8 blocks, which the
    sample would cover whole, must be sampled. The last row of every other tile must get a finite
    lo, of a covered one -FLT_MAX, and every threshold must keep exactly the row's topk largest."""
    monkeypatch.setattr(forward, "TOPK_SAMPLE", 32)
    sample_w, cap_w = forward.topk_widths(topk, 640, 16)
    if area is not None:
        cap_w = area
        monkeypatch.setattr(forward, "topk_widths", lambda topk, kv_len, block_n: (sample_w, area))
    assert sample_w == 128
    g = torch.Generator().manual_seed(topk)
    q = torch.randint(-3, 4, (1, 1, 640, 16), generator=g).float().to(DEVICE)
    k = torch.randint(-3, 4, (1, 1, 640, 16), generator=g).float().to(DEVICE)
    shape = check_qkv(q, k, k, kernel=True)
    config = KernelConfig(16, 16, 4, 1)
    bound, structure = forward.blocks(q, attngen.masks.as_mask("causal"), shape, config)
    thresholds = forward.Thresholds(q, k, bound, structure, shape, 1.0, topk, config)
    buffers = thresholds.buffers(q.device)
    for kernel, grid, args, kwargs in thresholds.launches(q, k, *buffers):
        kernel[grid](*args, **kwargs)
    lo = buffers[1][15::16]  # the last row of each query tile, which sees all of its key blocks
    covered = [blocks <= sample_w // 16 and blocks * 16 <= cap_w for blocks in range(1, 41)]
    assert [bool(x) for x in lo == -3.4028234663852886e38] == covered
    scores = (q @ k.transpose(-1, -2)).view(640, 640).masked_fill(
        ~torch.ones(640, 640, dtype=torch.bool, device=DEVICE).tril(), float("-inf"))
    kth = scores.topk(topk, dim=-1).values[:, -1:]
    visible = scores > float("-inf")
    assert torch.equal((scores >= buffers[0][:640].view(640, 1)) & visible, (scores >= kth) & visible)
    if area is None:
        assert int(buffers[5].sum()) == 0  # no tile needed retries (an area of 64 overflows on long rows)


def test_a_short_sample_is_doubled_to_an_eighth_of_the_row(path, monkeypatch):
    """K=8 over 800 keys: a sample of 32 scores (expecting 0.3 of the 8 largest) is doubled twice,
    to 128, an eighth of the row (expecting 1.3)."""
    if path == "whole":
        pytest.skip("the sample covers every row whole on this path")
    assert forward.topk_widths(8, 800, 16)[0] == 128
    q, k, v = rand_qkv(1, 2, 1, 48, 800, 16, torch.float32)
    check(q, k, v, None, 8, KernelConfig(16, 16, 4, 1))


_HELPERS = forward.module_for(None)  # the rendered template's selection helpers, called from a test kernel
_load_part, _count_group, _extremes, _search_start, _refine = (
    _HELPERS._load_part, _HELPERS._count_group, _HELPERS._extremes, _HELPERS._search_start, _HELPERS._refine)


@triton.jit
def _selection_probe(VALS, N, T, R, OUT, W: tl.constexpr, WIDTH: tl.constexpr, EXTRA: tl.constexpr,
                     GROUP: tl.constexpr, GRID: tl.constexpr):
    """Per row of VALS (GROUP rows of W, the first N[row] written), held as the selection holds
    them (its first WIDTH places, and EXTRA more as a second part): the count of values >= T[row],
    then the bracket (lo, hi, c_lo, c_hi) after one counting round for rank R[row]."""
    rows = tl.arange(0, GROUP)
    n = tl.load(N + rows)
    r = tl.load(R + rows)
    a = _load_part(VALS, W, 0, n, GROUP, 0, WIDTH)
    b = None if EXTRA == 0 else _load_part(VALS, W, 0, n, GROUP, WIDTH, EXTRA)
    tl.store(OUT + rows, _count_group(a, b, tl.load(T + rows)).to(tl.float32))
    bottom, top_up = _extremes(a, b, tl.full([GROUP], -3.4028234663852886e38, dtype=tl.float32))
    lo, hi, c_lo, c_hi, valid = _search_start(bottom, top_up, n, r)
    lo, hi, c_lo, c_hi = _refine(a, b, r, lo, hi, c_lo, c_hi, GRID)
    tl.store(OUT + GROUP + rows, lo)
    tl.store(OUT + 2 * GROUP + rows, hi)
    tl.store(OUT + 3 * GROUP + rows, c_lo.to(tl.float32))
    tl.store(OUT + 4 * GROUP + rows, c_hi.to(tl.float32))


@pytest.mark.skipif(DEVICE == "cuda", reason="a helper test: the interpreter runs it on any machine")
@pytest.mark.parametrize("stride,width,extra", [(256, 256, 0), (1024, 1024, 0), (1024, 512, 256), (512, 64, 0)])
def test_selection_counts_are_the_compares(stride, width, extra):
    # the selection counts values below a point by the sign of their difference (and two points a
    # sum), over a row held whole, in part, or in two parts (_select_fitted): the counts must equal
    # the float compares, at signed zeros, ties, extremes and -inf padding too
    group, grid = 4, 6
    g = torch.Generator().manual_seed(stride + width)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4028234663852886e38, -3.4028234663852886e38, 1e-45, -1e-45])
    vals = torch.full((group, stride), float("-inf"))
    width += extra  # the places held
    n = torch.tensor([width, width - 3, width // 2, 5], dtype=torch.int32)
    for row in range(group):
        x = torch.randint(-3, 4, (int(n[row]),), generator=g).float()  # many ties
        if row < 3:
            x[: len(special)] = special
        if row == 1:
            x = torch.randn(int(n[row]), generator=g) * 1e-38  # tiny, with denormal differences
        vals[row, : int(n[row])] = x
    thresholds = torch.tensor([0.0, -0.0, 1.0, 2.5])
    ranks = torch.tensor([1, int(n[1]) // 3, int(n[2]), 3], dtype=torch.int32)
    out = torch.full((5 * group,), float("nan"))
    _selection_probe[(1,)](vals, n, thresholds, ranks, out, W=stride, WIDTH=width - extra, EXTRA=extra, GROUP=group,
                           GRID=grid)
    counts, lo, hi, c_lo, c_hi = out.view(5, group)
    for row in range(group):
        written = vals[row, : int(n[row])]
        assert counts[row] == (written >= thresholds[row]).sum(), row
        assert c_lo[row] == (written >= lo[row]).sum() >= ranks[row] > (written >= hi[row]).sum() == c_hi[row], row
        assert lo[row] < hi[row]


def test_bracket_ranks_are_margin_standard_deviations_of_the_sampled_count():
    # a quarter of 4096 keys sampled, K=256: 64 expected, variance 256 * 1/4 * 3/4 = 48
    f, rank_lo, rank_hi = forward._bracket_ranks(256, 4096, 64, 1024)
    spread = forward.TOPK_MARGIN * 48 ** 0.5
    assert (f, rank_lo, rank_hi) == (0.25, math.ceil(64 + spread + 2), math.floor(64 - spread - 1)) == (0.25, 105, 24)
    # an eighth of 16384: a hi end of rank 1 (of 2048 sampled scores) would keep 8 scores a row out
    # of the capture and cost every score the count above it, so there is none
    assert forward._bracket_ranks(256, 16384, 64, 2048) == (0.125, 64, 0)


def test_capture_width_covers_the_bracket():
    # a row whose blocks all fit in the sample is captured whole
    assert forward.topk_widths(64, 300, 16) == (forward.TOPK_SAMPLE, 512)
    assert forward.topk_widths(8, 100, 32) == (forward.TOPK_SAMPLE, 128)
    for topk, kv_len in [(1, 4096), (64, 4096), (256, 4096), (64, 16384), (256, 16384), (1024, 16384)]:
        sample, cap = forward.topk_widths(topk, kv_len, 64)
        assert cap & (cap - 1) == 0 and sample & (sample - 1) == 0
        f, rank_lo, _ = forward._bracket_ranks(topk, kv_len, 64, sample)
        assert rank_lo <= forward.TOPK_CANDIDATES * 3 * 64  # lo's rank within the sample's candidates
        # at least TOPK_SAMPLE and an eighth of the row, unless lo's rank needs a smaller sample
        doubled = forward._bracket_ranks(topk, kv_len, 64, 2 * sample)
        halved = doubled is not None and doubled[1] > forward.TOPK_CANDIDATES * 3 * 64
        assert halved or (sample >= forward.TOPK_SAMPLE and sample >= kv_len / 8)
        assert sample == forward.TOPK_SAMPLE or sample / 2 < kv_len / 8  # and no larger
        assert cap >= 2 * topk  # the bracket's far end is well past the topk-th score
    assert forward.topk_widths(64, 4096, 64)[0] == 1024 and forward.topk_widths(64, 16384, 64)[0] == 2048
    assert forward.topk_widths(1024, 4096, 64)[0] == 256  # 1024 or 512: lo's rank past the candidates


def test_threshold_tiles(monkeypatch):
    # on Hopper, the threshold kernels run at TOPK_THRESHOLD_TILE for attention tiles whose scores
    # wgmma computes the same way (tests/test_gpu.py checks that on the GPU); anywhere else, and for
    # other tiles, at the attention's own config
    cuda = torch.device("cuda")
    monkeypatch.setattr(forward, "interpreter_on", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    block_m, warps, stages = forward.TOPK_THRESHOLD_TILE
    for tma in (False, True):
        for config in (KernelConfig(128, 64, 4, 2, tma), KernelConfig(128, 64, 8, 3, tma),
                       KernelConfig(64, 64, 4, 1, tma)):
            assert forward.threshold_config(config, cuda) == KernelConfig(block_m, 64, warps, stages, use_tma=tma)
    for config in (KernelConfig(128, 128, 4, 2), KernelConfig(64, 32, 4, 2), KernelConfig(32, 64, 4, 2),
                   KernelConfig(128, 64, 2, 2)):
        assert forward.threshold_config(config, cuda) == config
    config = KernelConfig(128, 64, 4, 2)
    assert forward.threshold_config(config, torch.device("cpu")) == config
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert forward.threshold_config(config, cuda) == config


SM90_SHARED = 233472  # shared memory of an sm_90 SM, of which each resident program reserves 1 KB
SM90_RESERVED = 1024


@pytest.mark.parametrize("config,topk", [("16 16 4 1 0", 64), ("64 64 4 3 1", 64), ("64 64 4 3 1", 256)],
                         ids=["16x16", "64x64 TMA", "64x64 TMA K=256"])
def test_threshold_kernels_compile_for_hopper(config, topk):
    """The interpreter runs code that a GPU compiler may refuse (an int8 dot over 16 keys did, and
    only the GPU run noticed): compile the threshold kernels for sm_90, as a CUDA launch would, in
    a child process, at the smallest key blocks and at the threshold tiles of sm_90: topk_bracket,
    topk_capture (without and with the count above hi at K=64, one launch for every tile at K=256,
    where the rows have a hi end), topk_select and topk_threshold."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(root / "tests" / "compile_hopper.py"), *config.split(), str(topk),
                             "4096"], capture_output=True, text=True, timeout=900, env=env)
    block_n, warps = (int(x) for x in config.split()[1:3])
    captures = forward.capture_launches(topk, 4096, block_n)
    assert len(captures) == (1 if topk == 256 else 2)
    assert result.returncode == 0 and result.stdout.count("ok") == 3 + len(captures), result.stderr[-4000:]
    # the captures leave room in an SM's shared memory for the programs an SM they are sized for
    # (compiled into one kernel, the two passes took 88 KB, room for 2 where 3 were meant to run)
    programs = forward.capture_setup(topk, 4096, block_n)[1]
    shared = [int(line.split()[2]) for line in result.stdout.splitlines() if line.startswith("ok topk_capture")]
    assert len(shared) == len(captures) and all(programs * (size + SM90_RESERVED) <= SM90_SHARED for size in shared)
    # so does the bracket, whose sampled blocks are loaded through a pipeline (66.5 KB at 3 stages)
    bracket = [int(line.split()[2]) for line in result.stdout.splitlines() if line.startswith("ok topk_bracket")]
    assert forward.TOPK_BRACKET_SM_WARPS // warps * (bracket[0] + SM90_RESERVED) <= SM90_SHARED, bracket
