"""Top-k softmax's threshold kernels (templates/kernels/topk.py.jinja): sizing and launch.

Each row's threshold, its topk-th largest score, is found by counting, not sorting:
`topk_bracket` samples the row and brackets the threshold, `topk_capture` stores each row's
scores inside its bracket, `topk_select` finds the exact threshold among them, and
`topk_threshold` retries the rows the bracket missed. The forward kernel then runs the softmax
over the scores at or above the threshold. docs/topk.md explains the algorithm and the constants
of `TopkTuning`; tests and benchmarks pass their own instance.

Reading order: the tunables, the sizes of one call (computed once per plan), then `Thresholds`,
the launches of one call signature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import masks as masks_
from ..checks import interpreter_on
from ..config import KernelConfig, block_d_for
from .launch import Launch, aligned, dims, dot_precision, ensure_allocator, mask_args, module_for, qk_args, \
    structure_args, tma_eligible

CALL_TENSORS = ("Q", "K", "LO", "HI", "AREA", "COUNTS", "FLAGS", "THR", "MAXES", "WORK")  # new every call
REGISTERS_PER_SM = 65536  # 32-bit registers of an SM, Ampere (sm_80) to Hopper (sm_90) alike


@dataclass(frozen=True)
class TopkTuning:
    """The constants of the top-k threshold search (docs/topk.md says what each one trades off)."""

    margin: float = 5.5  # standard deviations of the sampled count either side of the bracket
    sample: int = 1024  # scores a row samples at least ...
    sample_share: float = 1 / 8  # ... doubled while under this share of the row
    candidates: float = 0.75  # lo's rank may reach this share of the sample's candidates (3 a column)
    hi_share: float = 0.01  # a hi end only where its rank is at least this share of the sampled scores
    group_values: int = 32  # scores per thread a selection holds in registers
    grid: int = 4  # points per counting round of a search
    rounds: int = 1  # a selection's counting rounds before its exact search
    select_warps: int = 1  # warps of a topk_select program
    area_floats: int = 256 << 20  # floats of capture area at a time (1 GiB); more tiles run in chunks
    sm_warps: int = 12  # topk_threshold's warps an SM (sets its register cap)
    bracket_sm_warps: int = 12
    select_sm_warps: int = 16
    capture_stages: int = 2  # topk_capture's pipeline stages and programs an SM ...
    capture_programs: int = 3
    dense_capture_stages: int = 4  # ... and where the bracket captures more than dense_capture of a row
    dense_capture_programs: int = 2
    dense_capture: float = 0.06
    threshold_tile: tuple[int, int, int] = (64, 4, 3)  # Hopper: (BLOCK_M, warps, stages) of the threshold kernels

    def rank_max(self, block_n: int) -> int:
        """The deepest rank among a sample's candidates (3 a column of a key block) that lo may take."""
        return int(self.candidates * 3 * block_n)


# ---------------------------------------------------------------------------------------
# the sizes of one call
# ---------------------------------------------------------------------------------------
def bracket_ranks(topk: int, kv_len: int, block_n: int, sample_w: int,
                  tuning: TopkTuning) -> tuple[float, int, int] | None:
    """(f, rank_lo, rank_hi) of a sample of sample_w scores as topk_bracket computes them (f: the
    sampled share of the key blocks; rank_hi 0: no hi end), or None where the sample covers the row
    whole."""
    n_blocks = math.ceil(kv_len / block_n)
    stride = max(math.ceil(n_blocks / (sample_w // block_n)), 1)
    if stride == 1:
        return None
    f = math.ceil(n_blocks / stride) / n_blocks
    expect = topk * f
    spread = tuning.margin * math.sqrt(expect * (1 - f))  # drawn without replacement
    rank_hi = math.floor(expect - spread - 1)
    if rank_hi < tuning.hi_share * f * n_blocks * block_n:
        rank_hi = 0
    return f, math.ceil(expect + spread + 2), rank_hi


@dataclass(frozen=True)
class TopkSizes:
    """The sample and capture sizes of rows of kv_len keys (powers of two: few compiled variants)."""

    sample_w: int  # scores a row samples
    cap_w: int  # scores a row's capture area holds
    captured: float  # scores a row is expected to capture
    has_hi: bool  # the longest rows' bracket has a hi end

    @property
    def captures(self) -> tuple[tuple[bool, bool], ...]:
        """topk_capture's launches a chunk, as (HAS_HI, ALL_TILES): one with the count above hi for
        every tile where the longest rows' bracket has a hi end (a tile without one is still right
        there, its count above +inf being 0), else one for the tiles without a hi end, then one for
        those with. A launch that finds no tile of its kind still starts a program a tile."""
        return ((True, True),) if self.has_hi else ((False, False), (True, False))


def topk_sizes(topk: int, kv_len: int, block_n: int, tuning: TopkTuning) -> TopkSizes:
    """The sample is tuning.sample scores, doubled while under tuning.sample_share of the row, then
    halved while the bracket's lo end would rank beyond tuning.candidates of the sample's candidates.

    A row whose key blocks all fit in the sample is captured whole. Otherwise the capture area
    holds the scores in the bracket: about (rank_lo - rank_hi) / f of them, where f is the sampled
    share of the key blocks (smallest for the longest rows), plus tuning.margin standard deviations,
    rounded up to a power of two. A row whose scores overflow the area costs its tile a retry.
    """
    sample_w = max(tuning.sample, block_n)
    while sample_w < tuning.sample_share * kv_len:
        sample_w *= 2
    ranks = bracket_ranks(topk, kv_len, block_n, sample_w, tuning)
    while sample_w > block_n and ranks is not None and ranks[1] > tuning.rank_max(block_n):
        sample_w //= 2
        ranks = bracket_ranks(topk, kv_len, block_n, sample_w, tuning)
    if ranks is None:
        return TopkSizes(sample_w, _pow2(min(sample_w, math.ceil(kv_len / block_n) * block_n)), kv_len, False)
    f, rank_lo, rank_hi = ranks
    inside = (rank_lo - rank_hi) / f
    return TopkSizes(sample_w, _pow2(inside + tuning.margin * math.sqrt(rank_lo - rank_hi) / f), inside,
                     rank_hi >= 1)


def capture_setup(sizes: TopkSizes, kv_len: int, tuning: TopkTuning) -> tuple[int, int]:
    """topk_capture's (pipeline stages, programs an SM): the dense ones where the bracket is
    expected to capture more than tuning.dense_capture of a row's keys."""
    if sizes.captured > tuning.dense_capture * kv_len:
        return tuning.dense_capture_stages, tuning.dense_capture_programs
    return tuning.capture_stages, tuning.capture_programs


def chunk_tiles(n_tiles: int, fit: int, resident: int) -> int:
    """Query tiles a chunk of topk_capture and topk_select takes: all of them where `fit` (the
    tiles whose capture areas fit in tuning.area_floats) are all; else `fit`, or `resident` (the
    capture programs that run at once) where fit is under 2 of them: a program runs its tile's
    whole key loop, so a chunk of 1.3 waves takes about as long as 2, while chunks of more waves
    lose little to their last one."""
    if n_tiles <= fit:
        return n_tiles
    return resident if resident <= fit < 2 * resident else max(fit, 1)


def group_rows(width: int, block_m: int, num_warps: int, tuning: TopkTuning) -> int:
    """Rows a selection holds in registers at once: tuning.group_values scores per thread."""
    return max(1, min(block_m, tuning.group_values * 32 * num_warps // width))


def select_rows(width: int, block_m: int, tuning: TopkTuning) -> int:
    """Rows of a topk_select program: tuning.group_values scores per thread, at least
    tuning.select_warps rows."""
    return min(block_m, max(tuning.select_warps, group_rows(width, block_m, tuning.select_warps, tuning)))


def _pow2(x: float) -> int:
    return max(16, 1 << (math.ceil(x) - 1).bit_length())


def register_cap(num_warps: int, sm_warps: int) -> int | None:
    """A top-k kernel's register cap a thread at num_warps warps, sm_warps warps per SM (8-aligned,
    None where the register file holds them at 255). The top-k kernels are latency-bound (dependent
    counting steps, scattered stores), so each runs a set number of warps per SM."""
    per_sm = max(1, sm_warps // num_warps)
    cap = REGISTERS_PER_SM // (per_sm * num_warps * 32) // 8 * 8
    return cap if cap < 255 else None


def _programs(n_tiles: int, device, per_sm: int = 1) -> int:
    """Programs that run at once at per_sm an SM, at most n_tiles (a few under the interpreter)."""
    if device.type != "cuda":
        return min(n_tiles, 3)
    return min(n_tiles, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)


def any_tile(rows: int, warps: int, device) -> bool:
    """Whether a kernel whose score dot has `rows` rows in its first operand, on `warps` warps,
    computes every score bit for bit as any other such kernel does, whatever the tiles and whichever
    of q and k comes first: on Hopper, where such dots run as wgmma (64 or 128 rows, 4 or 8 warps).
    tests/kernels/test_gpu.py checks it there, for 32 to 128 columns, both orientations, every
    input dtype; the interpreter's numpy matmul sums in another order for another tile shape, and
    other GPUs were not checked."""
    return (device.type == "cuda" and not interpreter_on() and torch.cuda.get_device_capability(device)[0] == 9
            and rows in (64, 128) and warps in (4, 8))


def threshold_config(config: KernelConfig, device, tuning: TopkTuning) -> KernelConfig:
    """The config of a top-k call's threshold kernels when its attention kernel runs at `config`.

    Every kernel must compute every score bit for bit the same. Where the attention kernel's tiles
    allow that at any tiles (any_tile), for key blocks of 64, the threshold kernels run at
    tuning.threshold_tile and the attention kernel at the tiles it runs fastest at. Elsewhere both
    share the call's config."""
    if config.block_n == 64 and any_tile(config.block_m, config.num_warps, device):
        block_m, warps, stages = tuning.threshold_tile
        return KernelConfig(block_m, config.block_n, warps, stages, use_tma=config.use_tma)
    return config


# ---------------------------------------------------------------------------------------
# the launches of one call signature
# ---------------------------------------------------------------------------------------
class Thresholds:
    """The threshold launches of one call signature, for an attention launch at `config` over
    `structure`: topk_bracket, then topk_capture and topk_select for each chunk of query tiles,
    then topk_threshold for the tiles they flagged. They run at `own` (default threshold_config),
    over their own block structure where its tiles differ. The work buffers are allocated per call.
    `run(q, k)` returns each row's threshold, then each row's largest score (2 * B * H * Sq floats,
    the attention kernel's THR)."""

    def __init__(self, q, k, bound, structure: masks_.BlockStructure, shape, scale: float, topk: int,
                 config: KernelConfig, tuning: TopkTuning = TopkTuning(), own: KernelConfig | None = None):
        own = threshold_config(config, q.device, tuning) if own is None else own
        mask = bound.mask if bound is not None else None
        if own != config:
            structure = masks_.block_structure(mask, shape.q_len, shape.kv_len, (own.block_m, own.block_n),
                                               batch=shape.batch, heads=shape.heads, device=q.device, bound=bound)
        module = module_for("topk", mask)
        bm, bn = structure.block_size
        sizes = topk_sizes(topk, shape.kv_len, bn, tuning)
        stages, programs = capture_setup(sizes, shape.kv_len, tuning)
        self.bm, self.cap_w = bm, sizes.cap_w
        self.n_tiles = math.ceil(shape.q_len / bm) * shape.batch * shape.heads
        self.chunk = chunk_tiles(self.n_tiles, tuning.area_floats // (bm * sizes.cap_w),
                                 _programs(self.n_tiles, q.device, programs))
        self.group = select_rows(sizes.cap_w, bm, tuning)
        self.fallback_programs = _programs(self.n_tiles, q.device)
        self.rows = shape.batch * shape.heads * shape.q_len
        self.tma = own.use_tma and tma_eligible(q, k)
        cuda = q.device.type == "cuda"

        # compile options: those every kernel computes scores with, then each kernel's own
        shared = dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d_for(shape.head_dim), BLOCK_M=bm, BLOCK_N=bn,
                      DOT_PRECISION=dot_precision(q.dtype), CONTIGUOUS=structure.contiguous,
                      num_warps=own.num_warps, num_stages=own.num_stages)
        bracket = dict(shared, SAMPLE_W=sizes.sample_w, CAP_W=sizes.cap_w, RANK_MAX=tuning.rank_max(bn),
                       HI_SHARE=tuning.hi_share, GRID=tuning.grid)
        capture = dict(shared, CAP_W=sizes.cap_w, ASM_STORE=cuda, num_stages=stages)
        fallback = dict(shared, CAP_W=sizes.cap_w, CAP_GROUP=group_rows(sizes.cap_w, bm, own.num_warps, tuning),
                        GRID=tuning.grid, ROUNDS=tuning.rounds, ASM_STORE=cuda)
        select = dict(BLOCK_M=bm, CAP_W=sizes.cap_w, GROUP=self.group, GRID=tuning.grid, ROUNDS=tuning.rounds,
                      num_warps=tuning.select_warps)
        for kw, sm_warps in ((bracket, tuning.bracket_sm_warps), (capture, programs * own.num_warps),
                             (select, tuning.select_sm_warps), (fallback, tuning.sm_warps)):
            cap = register_cap(kw["num_warps"], sm_warps)
            if cap is not None:  # a launch option (the interpreter drops it)
                kw["maxnreg"] = cap

        # the launches, with empty stand-ins for the tensors of a call (run() passes them; a cached
        # plan holds no call's tensors)
        thr, lo, hi, area, counts, flags, work = self.buffers(q.device, empty=True)
        call = dict(qk_args(q, k), Q=q.new_empty(0), K=k.new_empty(0), **structure_args(structure),
                    **dims(shape, scale), **mask_args(bound))
        tiles = dict(LO=lo, HI=hi, COUNTS=counts, FLAGS=flags)
        # (launch, its compile options by use_tma, the per-call tensors it takes)
        self.launches: list[tuple[Launch, dict, tuple[str, ...]]] = []

        def add(kernel, grid, args, options, tma_switch=True):
            launch = Launch(kernel, grid, args, dict(options, USE_TMA=False) if tma_switch else options)
            with_tma = dict(options, USE_TMA=True) if tma_switch else options
            self.launches.append((launch, {False: launch.options, True: with_tma},
                                  tuple(n for n in CALL_TENSORS if n in launch.names)))

        add(module.topk_bracket, (self.n_tiles,), dict(call, LO=lo, HI=hi, topk=topk, margin=tuning.margin), bracket)
        for tile0 in range(0, self.n_tiles, self.chunk):
            n = min(self.chunk, self.n_tiles - tile0)
            for has_hi, all_tiles in sizes.captures:
                add(module.topk_capture, (n,), dict(call, **tiles, AREA=area, MAXES=thr, tile0=tile0),
                    dict(capture, HAS_HI=has_hi, ALL_TILES=all_tiles))
            add(module.topk_select, (n * bm // self.group,),
                dict(LO=lo, AREA=area, COUNTS=counts, THR=thr, FLAGS=flags, q_len=shape.q_len, tile0=tile0,
                     topk=topk), select, tma_switch=False)
        add(module.topk_threshold, (self.fallback_programs,), dict(call, **tiles, THR=thr, WORK=work, topk=topk),
            fallback)

    def buffers(self, device, empty: bool = False):
        """(thr, lo, hi, area, counts, flags, work) of one call (`empty`: zero-sized stand-ins): thr
        is the result, 2 * B * H * Sq floats (each row's threshold, then each row's largest score);
        lo, hi and counts (2 a row) are per row too, area per chunk of tiles."""
        n = (lambda size: 0) if empty else (lambda size: size)
        f32 = dict(dtype=torch.float32, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        return (torch.empty(n(2 * self.rows), **f32), torch.empty(n(self.rows), **f32),
                torch.empty(n(self.rows), **f32), torch.empty(n(self.chunk * self.bm * self.cap_w), **f32),
                torch.empty(n(self.rows * 2), **i32), torch.empty(n(self.n_tiles), **i32),
                torch.empty(n(self.fallback_programs * self.bm * (self.cap_w + 3)), **f32))

    def run(self, q, k):
        """Each query row's threshold, then each row's largest score (2 * B * H * Sq floats)."""
        thr, lo, hi, area, counts, flags, work = self.buffers(q.device)
        tensors = dict(Q=q, K=k, LO=lo, HI=hi, AREA=area, COUNTS=counts, FLAGS=flags, THR=thr, MAXES=thr[self.rows:],
                       WORK=work)
        use_tma = self.tma and aligned(q, k)
        if use_tma:
            ensure_allocator()
        for launch, options, names in self.launches:
            launch(options[use_tma], **{n: tensors[n] for n in names})
        return thr
