"""Top-k's sizing, computed once per call signature: the sample, the bracket's ranks, the capture
area, its chunks and setup, the selection's rows, register caps and the threshold kernels' tiles."""

import math

import pytest
import torch

from attngen.config import KernelConfig
from attngen.kernels import topk
from attngen.kernels.topk import TopkTuning

TUNING = TopkTuning()


def test_tuning_is_one_frozen_record():
    with pytest.raises(Exception):
        TUNING.margin = 1.0  # frozen: a test or benchmark passes its own instance
    assert TopkTuning(sample=32) != TUNING and TopkTuning(sample=32).margin == TUNING.margin
    assert TUNING.rank_max(64) == int(TUNING.candidates * 3 * 64)


def test_bracket_ranks_are_margin_standard_deviations_of_the_sampled_count():
    # a quarter of 4096 keys sampled, K=256: 64 expected, variance 256 * 1/4 * 3/4 = 48
    f, rank_lo, rank_hi = topk.bracket_ranks(256, 4096, 64, 1024, TUNING)
    spread = TUNING.margin * 48 ** 0.5
    assert (f, rank_lo, rank_hi) == (0.25, math.ceil(64 + spread + 2), math.floor(64 - spread - 1)) == (0.25, 105, 24)
    # an eighth of 16384: a hi end of rank 1 (of 2048 sampled scores) would keep 8 scores a row out
    # of the capture and cost every score the count above it, so there is none
    assert topk.bracket_ranks(256, 16384, 64, 2048, TUNING) == (0.125, 64, 0)
    assert topk.bracket_ranks(256, 1000, 64, 1024, TUNING) is None  # the sample covers the row whole
    narrow = TopkTuning(margin=1.0)
    assert topk.bracket_ranks(256, 4096, 64, 1024, narrow) == (0.25, math.ceil(66 + 48 ** 0.5),
                                                               math.floor(63 - 48 ** 0.5))


def test_capture_width_covers_the_bracket():
    # a row whose blocks all fit in the sample is captured whole
    assert topk.topk_sizes(64, 300, 16, TUNING) == topk.TopkSizes(TUNING.sample, 512, 300, False)
    assert topk.topk_sizes(8, 100, 32, TUNING).cap_w == 128
    for topk_, kv_len in [(1, 4096), (64, 4096), (256, 4096), (64, 16384), (256, 16384), (1024, 16384)]:
        sizes = topk.topk_sizes(topk_, kv_len, 64, TUNING)
        sample, cap = sizes.sample_w, sizes.cap_w
        assert cap & (cap - 1) == 0 and sample & (sample - 1) == 0
        f, rank_lo, rank_hi = topk.bracket_ranks(topk_, kv_len, 64, sample, TUNING)
        assert rank_lo <= TUNING.rank_max(64)  # lo's rank within the sample's candidates
        assert sizes.has_hi == (rank_hi >= 1)
        # at least TUNING.sample and an eighth of the row, unless lo's rank needs a smaller sample
        doubled = topk.bracket_ranks(topk_, kv_len, 64, 2 * sample, TUNING)
        halved = doubled is not None and doubled[1] > TUNING.rank_max(64)
        assert halved or (sample >= TUNING.sample and sample >= kv_len / 8)
        assert sample == TUNING.sample or sample / 2 < kv_len / 8  # and no larger
        assert cap >= 2 * topk_  # the bracket's far end is well past the topk-th score
    assert topk.topk_sizes(64, 4096, 64, TUNING).sample_w == 1024
    assert topk.topk_sizes(64, 16384, 64, TUNING).sample_w == 2048
    assert topk.topk_sizes(1024, 4096, 64, TUNING).sample_w == 256  # 1024 or 512: lo's rank past the candidates


def test_capture_launches_follow_the_hi_end():
    """One capture launch for every tile where the longest rows' bracket has a hi end, else one for
    the tiles without one and one for those with."""
    with_hi = topk.topk_sizes(256, 4096, 64, TUNING)
    assert with_hi.has_hi and with_hi.captures == ((True, True),)
    without = topk.topk_sizes(64, 4096, 64, TUNING)
    assert not without.has_hi and without.captures == ((False, False), (True, False))


def test_capture_setup_and_chunks():
    # the capture runs the dense setup (deeper pipeline, fewer programs an SM) where the bracket is
    # expected to take more than dense_capture of a row's keys (B=4 H=16 D=128 on an H200:
    # 5% at K=64 and S=4096 or K=256 and S=16384, 13% at K=256 and S=4096)
    sparse = (TUNING.capture_stages, TUNING.capture_programs)
    dense = (TUNING.dense_capture_stages, TUNING.dense_capture_programs)

    def setup(topk_, kv_len, block_n):
        return topk.capture_setup(topk.topk_sizes(topk_, kv_len, block_n, TUNING), kv_len, TUNING)

    assert setup(64, 4096, 64) == setup(256, 16384, 64) == sparse
    assert setup(256, 4096, 64) == setup(512, 4096, 64) == dense
    assert setup(8, 100, 16) == dense  # rows the sample covers whole: every score captured
    assert topk.capture_setup(topk.topk_sizes(64, 4096, 64, TUNING), 4096, TopkTuning(dense_capture=0.01)) == dense
    # a chunk takes every tile when all areas fit, else as many as fit, or one wave of programs
    # where that is under two
    assert topk.chunk_tiles(1000, 1000, 396) == topk.chunk_tiles(1000, 5000, 396) == 1000
    assert topk.chunk_tiles(16384, 512, 396) == 396
    assert topk.chunk_tiles(16384, 792, 396) == 792 and topk.chunk_tiles(4096, 2048, 396) == 2048
    assert topk.chunk_tiles(16384, 300, 396) == 300 and topk.chunk_tiles(10, 0, 3) == 1


def test_selection_groups_fit_the_tile():
    # rows a selection holds in registers: a power of two, at least one, at most the tile's rows,
    # and about group_values values a thread
    for width in (16, 128, 512, 1024, 4096):
        for block_m in (16, 64, 128):
            for warps in (4, 8):
                rows = topk.group_rows(width, block_m, warps, TUNING)
                assert 1 <= rows <= block_m and rows & (rows - 1) == 0
                if 1 < rows < block_m:
                    assert rows * width == TUNING.group_values * 32 * warps
    assert topk.group_rows(512, 64, 4, TopkTuning(group_values=64)) == 2 * topk.group_rows(512, 64, 4, TUNING)


def test_select_programs_fit_the_tile():
    # rows of a topk_select program: a power of two dividing the tile's rows, at least select_warps
    # where the tile has that many, and about group_values values a thread
    for tuning in (TUNING, TopkTuning(select_warps=4)):
        for width in (16, 128, 512, 1024, 4096):
            for block_m in (16, 64, 128):
                rows = topk.select_rows(width, block_m, tuning)
                assert block_m % rows == 0 and rows & (rows - 1) == 0
                assert rows >= min(block_m, tuning.select_warps)
                if tuning.select_warps < rows < block_m:
                    assert rows * width == tuning.group_values * 32 * tuning.select_warps


def test_register_caps():
    # 12 warps an SM at 4 warps a program: 3 programs of 128 threads share 65536 registers
    assert topk.register_cap(4, 12) == 65536 // (3 * 128) // 8 * 8 == 168
    assert topk.register_cap(4, 4) is None  # one program an SM: 512 a thread, over the 255 limit
    assert topk.register_cap(8, 16) == 65536 // (2 * 256) // 8 * 8 == 128
    assert topk.register_cap(8, 4) is None  # fewer warps an SM than a program has: one program


def test_threshold_tiles(monkeypatch):
    # on Hopper, the threshold kernels run at tuning.threshold_tile for attention tiles whose scores
    # wgmma computes the same way (tests/kernels/test_gpu.py checks that on the GPU); anywhere else,
    # and for other tiles, at the attention's own config
    cuda = torch.device("cuda")
    monkeypatch.setattr(topk, "interpreter_on", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for tuning in (TUNING, TopkTuning(threshold_tile=(128, 8, 2))):
        block_m, warps, stages = tuning.threshold_tile
        for tma in (False, True):
            for config in (KernelConfig(128, 64, 4, 2, tma), KernelConfig(128, 64, 8, 3, tma),
                           KernelConfig(64, 64, 4, 1, tma)):
                assert topk.threshold_config(config, cuda, tuning) == KernelConfig(block_m, 64, warps, stages,
                                                                                   use_tma=tma)
    for config in (KernelConfig(128, 128, 4, 2), KernelConfig(64, 32, 4, 2), KernelConfig(32, 64, 4, 2),
                   KernelConfig(128, 64, 2, 2)):
        assert topk.threshold_config(config, cuda, TUNING) == config
    config = KernelConfig(128, 64, 4, 2)
    assert topk.threshold_config(config, torch.device("cpu"), TUNING) == config
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert topk.threshold_config(config, cuda, TUNING) == config
