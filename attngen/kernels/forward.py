"""The forward attention kernel: rendering per mask variant, launch, autograd.

Reading order: the kernel (rendered from templates/attention_fwd.py.jinja), the launcher,
the autograd Function, then `attention_forward`, which the dispatcher calls.
"""

from __future__ import annotations

import math

import torch

from .. import masks as masks_
from ..checks import check_qkv, check_scale, check_topk, interpreter_on
from ..config import KernelConfig, block_d_for
from ..render import load_module, render

TEMPLATE = "attention_fwd.py.jinja"


# ---------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------
def render_source(mask: masks_.Mask | None) -> str:
    """The exact source of the forward kernel for `mask`'s variant."""
    visible, mods = masks_.triton_sources(mask)
    return render(TEMPLATE, variant=mask.variant if mask is not None else "none", visible=visible, mods=mods,
                  params=masks_.kernel_params(mask), scalars=masks_.scalar_params(mask))


_MODULES: dict = {}


def module_for(mask: masks_.Mask | None):
    """The rendered module of `mask`'s variant (attention_fwd, the top-k kernels): imported once per process."""
    key = None if mask is None else mask.key
    module = _MODULES.get(key)
    if module is None:
        module = _MODULES[key] = load_module(render_source(mask))
    return module


def kernel_for(mask: masks_.Mask | None):
    """The jitted attention kernel for `mask`'s variant."""
    return module_for(mask).attention_fwd


# ---------------------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------------------
def tma_eligible(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need a unit last stride and 16-byte aligned base and strides."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _ensure_allocator():
    """In-kernel tensor descriptors need scratch memory from a Triton allocator.

    Triton keeps the allocator in a ContextVar, so every thread needs its own: set one where the
    current thread has none (never replacing an allocator the user set).
    """
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        device = "cpu" if interpreter_on() else "cuda"
        _allocation.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))


def dot_precision(dtype: torch.dtype) -> str:
    if dtype is not torch.float32:
        return "tf32"  # fp16 / bf16 operands ignore it
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 and not interpreter_on() else "ieee"


# Top-k thresholds (the top-k kernels of the template): each row samples some of its scores
# (TOPK_SAMPLE below), and the bracket it then captures keeps TOPK_MARGIN standard deviations of the
# sampled count from the expected rank at either end, so that a row misses its bracket about once in
# 25 million (normal tails beyond 5.5 sigma). A sampled share f of the row holds topk * f of its topk
# largest scores on average, with variance topk * f * (1 - f) (drawn without replacement; taken as
# topk * f until 2026-12-02, which made the margin 6.35 standard deviations at f = 1/4: B=4 H=16
# S=4096 K=256 on the H200, 462 scores captured a row against 421 now, whole call 3.307 against
# 3.275 ms, run 67 in benchmarks/RESULTS.md). A miss costs its query tile more passes, which hold up
# the whole call (one missed row in 262,144 at margin 4 added 2.6 ms to a 11 ms call, H200
# 2026-11-30), and a call at B=4 H=16 S=16384 has a million rows. The capture area is sized by the
# same margin. The sample is every stride-th key block, not a random one: keys whose scores depend
# on their position (local attention) make the estimate worse and the retries more common.
TOPK_MARGIN = 5.5
# The sample's size: a larger one costs the bracket kernel more and leaves a narrower bracket, so
# fewer scores for the capture to store and the selection to search. TOPK_SAMPLE scores at least,
# doubled up to TOPK_SAMPLE_SHARE of the row. H200 run 57 in benchmarks/RESULTS.md (B=4 H=16
# D=128, whole call in ms, samples of 512 / 1024 / 2048): S=4096, K=64: 2.763 / 2.674 /
# 2.900; K=256: 3.676 / 3.553 / 391 (see TOPK_CANDIDATES); S=16384, K=64: 35.9 / 35.9 / 35.3;
# K=256: 39.5 / 38.0 / 37.0. A sample that expects few of the topk largest also leaves a count
# above the bracket's lo end with a long tail that the capture area misses (at S=16384 and K=64,
# 512 sampled scores expect 2, and 45 tiles in 16,384 overflowed, run 40); an eighth of the row
# expects topk / 8.
TOPK_SAMPLE = 1024
TOPK_SAMPLE_SHARE = 1 / 8
# The bracket's lo end is counted on the sample's candidates (the 3 largest sampled scores of each
# column of a key block): a sample is halved while lo's rank would be more than this share of them.
# Beyond them, lo is -FLT_MAX and the capture takes the whole row (S=4096, K=256, a sample of 2048:
# rank 193 of 192 candidates, every tile redone, 391 ms a call, run 57; K=1024, run 58: 6.8 ms
# with this rule, a sample of 256, against 414.7 without it). topk_bracket applies the same bound
# per query tile: a tile that sees fewer key blocks than the row (a causal or block-sparse mask)
# samples a larger share of them, and so samples every stride-th block for a larger stride where lo
# would rank past the bound (causal, S=4096, K=256: 964 tiles of 4096 captured their rows whole,
# overflowed and were redone, 50.6 ms a call, H200 run 61; 2.6 ms with the rule, run 62).
TOPK_CANDIDATES = 0.75
# The bracket's hi end, where the sampled count above it is at least TOPK_HI_SHARE of the sampled
# scores: a finite hi keeps about rank_hi / f scores a row out of the capture, but every tile with
# one runs the capture loop with the count above it (518 sm_90 instructions a block against 407;
# 747 against 436 before run 72). H200, B=4 H=16 K=256: at S=4096 (rank 24 of 1024 sampled scores,
# 2.3%) the hi end took 3.51 to 3.42 ms a call (run 62), and 3.306 to 3.163 (run 72); at S=16384
# (rank 1 of 2048, 0.05%) a call took 39.5 ms with it (run 69, after the margin's correction gave
# it that rank) and 35.9 without (run 59).
TOPK_HI_SHARE = 0.01
TOPK_GROUP_VALUES = 32  # scores per thread that a selection holds in registers (sets its rows per group)
# Points per counting round of a search (the bracket's two rounds over its sample's candidates, and
# a selection's rounds over the captured scores), and a selection's rounds before its exact search.
# H200 run 58, S=4096 (whole call in ms, K=64 / 256): 4 points and 1 round 2.605 / 3.403; 4 and
# 2: 2.623 / 3.439; 6 and 1: 2.652 / 3.490; 6 and 2: 2.675 / 3.551; 8 and 1: 2.696 / 3.667; run
# 59: 3 points, or no round, within 2% of 4 and 1 either way. Fewer points leave the bracket wider (183
# scores captured a row against 172 at 6 points, K=64), but every count costs a selection about
# as much as the exact search's steps do.
TOPK_GRID = 4
TOPK_ROUNDS = 1
# Warps of a topk_select program, and the fewest rows it takes. One warp a program: a row's counts
# need no shared memory or barrier, and the row's search is not done over again by every warp (H200
# run 52, B=4 H=16 S=4096: selection 0.596 / 0.985 ms at K=64 / 256 against 0.658 / 1.191 at 4 warps).
TOPK_SELECT_WARPS = 1
# The capture areas live in memory between topk_capture and topk_select; a call with more query
# tiles than this many floats of area hold runs them chunk by chunk. Every chunk's launches end on
# a partly idle GPU while their last programs finish: B=4 H=16 S=4096 K=256 (areas of 1024 scores
# a row, 1 GiB in all) on an H200, whole call 3.108 ms in 4 chunks (a budget of 256 MiB), 3.064 in
# 2, 3.016 in 1 (run 74 in benchmarks/RESULTS.md; capture kernel 1.511 / 1.426 / 1.368 ms). The
# peak memory above the inputs at that shape is then 1128 MiB (run 75), against 360 at 256 MiB
# and 10368 for the straightforward torch code.
TOPK_AREA_FLOATS = 256 << 20  # 1 GiB
# The top-k kernels are latency-bound (dependent counting steps, scattered stores, few warps to
# hide them): each runs a set number of warps per SM, with registers capped to fit (for the fused
# kernel, 3 programs of 4 warps at 168 registers a thread took 6-11% off the call against 2
# programs at 255, H200 2026-11-30, run 19 in benchmarks/RESULTS.md). TOPK_SM_WARPS sets the fused
# kernel's register cap (topk_threshold, which only retries the rows of flagged tiles now): it keeps
# the cap it was measured with, but its persistent grid is one program per SM, since few tiles are
# flagged and every program holds a work area.
TOPK_SM_WARPS = 12
TOPK_BRACKET_SM_WARPS = 12
TOPK_SELECT_SM_WARPS = 16
# topk_capture's pipeline stages and programs an SM (its own: the stages change how keys are
# loaded, not the scores). At 2 stages a program takes 55 KB of shared memory on sm_90, so 3 run on
# an SM; at 4 stages 88 KB, so 2. Where the bracket captures more than TOPK_DENSE_CAPTURE of a
# row's keys, 4 stages with 2 programs an SM are faster: H200 run 50 at B=4 H=16 D=128, S=4096,
# capture kernel at 2 / 4 stages (ms): K=64 (5% captured) 1.016 / 1.074, K=128 (8%) 1.330 / 1.273,
# K=256 (13%) 1.900 / 1.685, K=512 (18%) 3.119 / 2.318. (Not because the stores bound it: with
# every store predicated off the capture took 1.495 ms against 1.633 at K=256, run 71.)
TOPK_CAPTURE_STAGES = 2
TOPK_CAPTURE_PROGRAMS = 3
TOPK_DENSE_CAPTURE_STAGES = 4
TOPK_DENSE_CAPTURE_PROGRAMS = 2
TOPK_DENSE_CAPTURE = 0.06
REGISTERS_PER_SM = 65536  # 32-bit registers of an SM, Ampere (sm_80) to Hopper (sm_90) alike
# The threshold kernels' tiles on Hopper (BLOCK_M, warps, stages), whatever the attention kernel's:
# every score must come out of both bit for bit the same, and wgmma computes a score the same way
# for any number of rows and warps a tile (H200 run 41: thresholds from 128x64 tiles at 4 and 8
# warps and from 64x64 tiles at 2 stages equal those from 64x64 tiles at 4 warps and 3 stages on
# all 262,144 rows at S=4096). So the attention kernel may take the tiles it runs fastest at
# (128x64, 4 warps: 1.105 ms against 1.182 at K=64), and the threshold kernels keep theirs.
# Elsewhere both share the call's config: under the interpreter, numpy's matmul sums in another
# order for another tile shape, and other GPUs were not checked.
TOPK_THRESHOLD_TILE = (64, 4, 3)


def _rank_max(block_n: int) -> int:
    """The deepest rank among a sample's candidates (3 a column of a key block) that lo may take."""
    return int(TOPK_CANDIDATES * 3 * block_n)


def _bracket_ranks(topk: int, kv_len: int, block_n: int, sample_w: int) -> tuple[float, int, int] | None:
    """(f, rank_lo, rank_hi) of a sample of sample_w scores (as topk_bracket computes them; f: the
    sampled share of the key blocks), or None where the sample covers the row whole."""
    n_blocks = math.ceil(kv_len / block_n)
    stride = max(math.ceil(n_blocks / (sample_w // block_n)), 1)
    if stride == 1:
        return None
    f = math.ceil(n_blocks / stride) / n_blocks
    expect = topk * f
    spread = TOPK_MARGIN * math.sqrt(expect * (1 - f))  # drawn without replacement, as _sampled_count
    rank_hi = math.floor(expect - spread - 1)
    if rank_hi < TOPK_HI_SHARE * f * n_blocks * block_n:
        rank_hi = 0  # no hi end
    return f, math.ceil(expect + spread + 2), rank_hi


def _sampled(topk: int, kv_len: int, block_n: int) -> tuple[int, float, int]:
    """(SAMPLE_W, expected captures a row, CAP_W) of rows of kv_len keys (see topk_widths)."""
    sample_w = max(TOPK_SAMPLE, block_n)
    while sample_w < TOPK_SAMPLE_SHARE * kv_len:
        sample_w *= 2
    ranks = _bracket_ranks(topk, kv_len, block_n, sample_w)
    while sample_w > block_n and ranks is not None and ranks[1] > _rank_max(block_n):
        sample_w //= 2
        ranks = _bracket_ranks(topk, kv_len, block_n, sample_w)
    if ranks is None:
        return sample_w, kv_len, _pow2(min(sample_w, math.ceil(kv_len / block_n) * block_n))
    f, rank_lo, rank_hi = ranks
    inside = (rank_lo - rank_hi) / f
    return sample_w, inside, _pow2(inside + TOPK_MARGIN * math.sqrt(rank_lo - rank_hi) / f)


def topk_widths(topk: int, kv_len: int, block_n: int) -> tuple[int, int]:
    """(SAMPLE_W, CAP_W): scores per row in the sample and in the capture area.

    The sample is TOPK_SAMPLE scores, doubled while under TOPK_SAMPLE_SHARE of the row, then halved
    while the bracket's lo end would rank beyond TOPK_CANDIDATES of the sample's candidates (powers
    of two: few compiled variants).

    A row whose key blocks all fit in the sample is captured whole. Otherwise the capture area
    holds the scores in the bracket: about (rank_lo - rank_hi) / f of them, where f is the sampled
    share of the key blocks (smallest for the longest rows), plus TOPK_MARGIN standard deviations,
    rounded up to a power of two. A row whose scores overflow the area costs its query tile one
    more pass.
    """
    sample_w, _, cap_w = _sampled(topk, kv_len, block_n)
    return sample_w, cap_w


def capture_setup(topk: int, kv_len: int, block_n: int) -> tuple[int, int]:
    """topk_capture's (pipeline stages, programs an SM): the dense ones where the bracket is
    expected to capture more than TOPK_DENSE_CAPTURE of a row's keys."""
    if _sampled(topk, kv_len, block_n)[1] > TOPK_DENSE_CAPTURE * kv_len:
        return TOPK_DENSE_CAPTURE_STAGES, TOPK_DENSE_CAPTURE_PROGRAMS
    return TOPK_CAPTURE_STAGES, TOPK_CAPTURE_PROGRAMS


def capture_launches(topk: int, kv_len: int, block_n: int) -> tuple[tuple[bool, bool], ...]:
    """topk_capture's launches a chunk, as (HAS_HI, ALL_TILES): one with the count above hi for
    every tile where the bracket of a row of kv_len keys has a hi end (so every tile of a dense
    call has one; a tile without one is still right there, its count above +inf being 0), else one
    for the tiles without a hi end, then one for those with. A launch that finds no tile of its kind
    still starts a program a tile, each reading its rows' brackets: 9 to 30 us a launch (H200, 1024
    tiles of 64 rows). B=4 H=16 S=4096 K=256, whole call: 2.981 to 2.929 ms dense, 2.112 to 2.068
    causal, whose first tiles have no hi end (run 76 in benchmarks/RESULTS.md)."""
    sample_w = topk_widths(topk, kv_len, block_n)[0]
    ranks = _bracket_ranks(topk, kv_len, block_n, sample_w)
    if ranks is not None and ranks[2] >= 1:
        return ((True, True),)
    return ((False, False), (True, False))


def chunk_tiles(n_tiles: int, fit: int, resident: int) -> int:
    """Query tiles a chunk of topk_capture and topk_select takes: all of them where `fit` (the
    tiles whose capture areas TOPK_AREA_FLOATS holds) are all; else `fit`, or `resident` (the
    capture programs that run at once) where fit is under 2 of them: a program runs its tile's
    whole key loop, so a chunk of 1.3 waves takes about as long as 2 (B=4 H=16 S=16384 K=256 on an
    H200: capture kernel 18.96 ms at 512 tiles a chunk, run 50, and 15.76 at 396, run 49); chunks
    of more waves lose little to their last one (S=4096 K=64: 1.004 ms at 2048 tiles, run 47, and
    1.063 at 1980, run 49)."""
    if n_tiles <= fit:
        return n_tiles
    return resident if resident <= fit < 2 * resident else max(fit, 1)


def group_rows(width: int, block_m: int, num_warps: int) -> int:
    """Rows a selection holds in registers at once: TOPK_GROUP_VALUES scores per thread."""
    return max(1, min(block_m, TOPK_GROUP_VALUES * 32 * num_warps // width))


def select_rows(width: int, block_m: int) -> int:
    """Rows of a topk_select program: TOPK_GROUP_VALUES scores per thread, at least TOPK_SELECT_WARPS
    rows."""
    return min(block_m, max(TOPK_SELECT_WARPS, group_rows(width, block_m, TOPK_SELECT_WARPS)))


def _pow2(x: float) -> int:
    return max(16, 1 << (math.ceil(x) - 1).bit_length())


def register_cap(num_warps: int, sm_warps: int) -> int | None:
    """A top-k kernel's register cap a thread at num_warps warps, sm_warps warps per SM (8-aligned,
    None where the register file holds them at 255)."""
    per_sm = max(1, sm_warps // num_warps)
    cap = REGISTERS_PER_SM // (per_sm * num_warps * 32) // 8 * 8
    return cap if cap < 255 else None


def _programs(n_tiles: int, device, per_sm: int = 1) -> int:
    """Programs that run at once at per_sm an SM, at most n_tiles (a few under the interpreter):
    topk_threshold's persistent grid is one an SM."""
    if device.type != "cuda":
        return min(n_tiles, 3)
    return min(n_tiles, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)


def threshold_config(config: KernelConfig, device) -> KernelConfig:
    """The config of a top-k call's threshold kernels when its attention kernel runs at `config`:
    TOPK_THRESHOLD_TILE on Hopper for key blocks of 64 and wgmma tiles (64 or 128 rows, 4 or 8
    warps), the attention's own config otherwise."""
    if (device.type == "cuda" and not interpreter_on() and torch.cuda.get_device_capability(device)[0] == 9
            and config.block_n == 64 and config.block_m in (64, 128) and config.num_warps in (4, 8)):
        block_m, warps, stages = TOPK_THRESHOLD_TILE
        return KernelConfig(block_m, config.block_n, warps, stages, use_tma=config.use_tma)
    return config


def _strides3(t):  # (B, H, M[, N]) with 0 for a dimension shared by every batch or head
    return [0 if t.shape[i] == 1 else t.stride(i) for i in range(3)]


def shared_kwargs(q, shape, structure: masks_.BlockStructure, config: KernelConfig) -> dict:
    """The compile options that the attention kernel and the top-k kernels take alike from their
    config and block structure: top-k needs every kernel to compute every score the same way (head
    dim, dot precision, key blocks; tiles and warps as threshold_config allows), bit for bit."""
    bm, bn = structure.block_size
    return dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d_for(shape.head_dim), BLOCK_M=bm, BLOCK_N=bn,
                DOT_PRECISION=dot_precision(q.dtype), CONTIGUOUS=structure.contiguous,
                num_warps=config.num_warps, num_stages=config.num_stages)


def launch_args(q, k, v, out, lse, thr, bound, structure: masks_.BlockStructure, shape, scale: float,
                config: KernelConfig, use_tma: bool):
    """(kernel, grid, args, kwargs) of one attention launch on checked inputs and preallocated outputs.

    `thr`: None, or top-k thresholds and row maxima (2 * B * H * Sq floats) from Thresholds.run.
    """
    kernel = kernel_for(bound.mask if bound is not None else None)
    bm = structure.block_size[0]
    if use_tma:
        _ensure_allocator()
    lse_arg = lse if lse is not None else out
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    grid = (math.ceil(shape.q_len / bm), shape.batch * shape.heads)
    args = (q, k, v, out, lse_arg, thr if thr is not None else out,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse_strides, *structure_args(structure),
            shape.batch, shape.heads, shape.q_len, shape.kv_len, shape.group, scale,
            *(bound.kernel_args if bound is not None else ()))
    kwargs = dict(shared_kwargs(q, shape, structure, config), STORE_LSE=lse is not None, USE_TMA=use_tma,
                  WARP_SPECIALIZE=config.warp_specialize, TOPK=thr is not None)
    return kernel, grid, args, kwargs


class Thresholds:
    """The top-k threshold launches of one call signature (topk_bracket, then topk_capture and
    topk_select for each chunk of query tiles, then topk_threshold for the tiles they flagged; see
    the template) for an attention launch at `config` over `structure`. They run at
    threshold_config(config), over their own block structure where its tiles differ: either way,
    every kernel computes the same scores bit for bit. The work buffers are allocated per call."""

    def __init__(self, q, k, bound, structure: masks_.BlockStructure, shape, scale: float, topk: int,
                 config: KernelConfig):
        own = threshold_config(config, q.device)
        if own != config:
            structure = masks_.block_structure(bound.mask if bound is not None else None, shape.q_len,
                                               shape.kv_len, (own.block_m, own.block_n), batch=shape.batch,
                                               heads=shape.heads, device=q.device, bound=bound)
            config = own
        module = module_for(bound.mask if bound is not None else None)
        self.kernels = (module.topk_bracket, module.topk_capture, module.topk_select, module.topk_threshold)
        bm, bn = structure.block_size
        sample_w, cap_w = topk_widths(topk, shape.kv_len, bn)
        stages, programs = capture_setup(topk, shape.kv_len, bn)
        self.captures = capture_launches(topk, shape.kv_len, bn)
        self.bm, self.cap_w = bm, cap_w
        self.n_tiles = math.ceil(shape.q_len / bm) * shape.batch * shape.heads
        resident = _programs(self.n_tiles, q.device, programs)
        self.chunk = chunk_tiles(self.n_tiles, TOPK_AREA_FLOATS // (bm * cap_w), resident)
        self.group = select_rows(cap_w, bm)
        self.fallback_programs = _programs(self.n_tiles, q.device)
        self.rows = shape.batch * shape.heads * shape.q_len
        self.structure = structure_args(structure)
        self.dims = (shape.batch, shape.heads, shape.q_len, shape.kv_len, shape.group, scale)
        self.mask_args = bound.kernel_args if bound is not None else ()
        self.topk = topk
        cuda = q.device.type == "cuda"
        shared = shared_kwargs(q, shape, structure, config)
        bracket = dict(shared, SAMPLE_W=sample_w, CAP_W=cap_w, RANK_MAX=_rank_max(bn), HI_SHARE=TOPK_HI_SHARE,
                       GRID=TOPK_GRID)
        capture = dict(shared, CAP_W=cap_w, ASM_STORE=cuda, num_stages=stages)
        fallback = dict(shared, CAP_W=cap_w, CAP_GROUP=group_rows(cap_w, bm, config.num_warps), GRID=TOPK_GRID,
                        ROUNDS=TOPK_ROUNDS, ASM_STORE=cuda)
        select = dict(BLOCK_M=bm, CAP_W=cap_w, GROUP=self.group, GRID=TOPK_GRID, ROUNDS=TOPK_ROUNDS,
                      num_warps=TOPK_SELECT_WARPS)
        for kw, sm_warps in ((bracket, TOPK_BRACKET_SM_WARPS), (capture, programs * config.num_warps),
                             (select, TOPK_SELECT_SM_WARPS), (fallback, TOPK_SM_WARPS)):
            cap = register_cap(kw["num_warps"], sm_warps)
            if cap is not None:  # a launch option (the interpreter drops it)
                kw["maxnreg"] = cap
        self.select_kwargs = select
        self.kwargs = {use: [dict(kw, USE_TMA=use) for kw in (bracket, capture, fallback)] for use in (False, True)}
        self.tma = config.use_tma and tma_eligible(q, k)

    def launches(self, q, k, thr, lo, hi, area, counts, flags, work):
        """(kernel, grid, args, kwargs) of every launch of one call, in order."""
        bracket, capture, select, fallback = self.kernels
        use_tma = self.tma and (q.data_ptr() | k.data_ptr()) % 16 == 0
        kw_bracket, kw_capture, kw_fallback = self.kwargs[use_tma]
        qk = (*q.stride(), *k.stride(), *self.structure)
        q_len = self.dims[2]
        out = [(bracket, (self.n_tiles,), (q, k, lo, hi, *qk, *self.dims, self.topk, TOPK_MARGIN, *self.mask_args),
                kw_bracket)]
        for tile0 in range(0, self.n_tiles, self.chunk):
            n = min(self.chunk, self.n_tiles - tile0)
            for has_hi, all_tiles in self.captures:
                out.append((capture, (n,), (q, k, lo, hi, area, counts, flags, thr[self.rows:], *qk, *self.dims,
                                            tile0, *self.mask_args),
                            dict(kw_capture, HAS_HI=has_hi, ALL_TILES=all_tiles)))
            out.append((select, (n * self.bm // self.group,),
                        (lo, area, counts, thr, flags, q_len, tile0, self.topk), self.select_kwargs))
        out.append((fallback, (self.fallback_programs,),
                    (q, k, lo, hi, counts, thr, work, flags, *qk, *self.dims, self.topk, *self.mask_args), kw_fallback))
        return out

    def buffers(self, device):
        """(thr, lo, hi, area, counts, flags, work) of one call: thr is the result, 2 * B * H * Sq
        floats (each row's threshold, then each row's largest score); lo, hi and counts (2 a row)
        are per row too, area per chunk of tiles."""
        f32 = dict(dtype=torch.float32, device=device)
        return (torch.empty(2 * self.rows, **f32), torch.empty(self.rows, **f32), torch.empty(self.rows, **f32),
                torch.empty(self.chunk * self.bm * self.cap_w, **f32),
                torch.empty(self.rows * 2, dtype=torch.int32, device=device),
                torch.empty(self.n_tiles, dtype=torch.int32, device=device),
                torch.empty(self.fallback_programs * self.bm * (self.cap_w + 3), **f32))

    def run(self, q, k):
        """Each query row's threshold, then each row's largest score: 2 * B * H * Sq floats (the
        attention kernel's THR)."""
        buffers = self.buffers(q.device)
        if self.tma:
            _ensure_allocator()
        for kernel, grid, args, kwargs in self.launches(q, k, *buffers):
            kernel[grid](*args, **kwargs)
        return buffers[0]


def structure_args(structure: masks_.BlockStructure) -> tuple:
    """The block structure's kernel arguments: its four tensors, then their strides."""
    return (structure.full_num, structure.full_idx, structure.partial_num, structure.partial_idx,
            *_strides3(structure.full_num), *_strides3(structure.full_idx))


def blocks(q, mask, shape, config: KernelConfig):
    """(bound mask, block structure) of one call, at the config's tile size."""
    bound = masks_.bind(mask, batch=shape.batch, heads=shape.heads, q_len=shape.q_len, kv_len=shape.kv_len,
                        device=q.device)
    structure = masks_.block_structure(mask, shape.q_len, shape.kv_len, (config.block_m, config.block_n),
                                       batch=shape.batch, heads=shape.heads, device=q.device, bound=bound)
    return bound, structure


def launch(*args):
    """Launch the attention kernel (arguments as for launch_args)."""
    kernel, grid, args, kwargs = launch_args(*args)
    kernel[grid](*args, **kwargs)


class Plan:
    """Everything of a launch but the tensors, prepared once per call signature (the dispatcher's fast path).

    A signature fixes shapes, strides, dtypes, device, mask (with its scalar values), scale and
    return_lse; the output's strides follow from q's, so only q, k, v, out and lse change per call.
    """

    def __init__(self, q, k, v, mask, shape, scale: float, topk: int, return_lse: bool, config: KernelConfig):
        bound, structure = blocks(q, mask, shape, config)
        out = torch.empty_like(q)
        lse = torch.empty((shape.batch, shape.heads, shape.q_len), dtype=torch.float32, device=q.device)
        self.lse_shape = tuple(lse.shape) if return_lse else None
        self.thresholds = Thresholds(q, k, bound, structure, shape, scale, topk, config) if topk else None
        thr = lse if topk else None  # a stand-in: run() passes the thresholds of the call
        self.kernel, self.grid, args, self.plain = launch_args(q, k, v, out, lse if return_lse else None, thr, bound,
                                                               structure, shape, scale, config, False)
        self.tail = args[6:]
        self.tma = None
        if config.use_tma and tma_eligible(q, k, v):  # strides fit; base alignment is checked per call
            self.tma = dict(self.plain, USE_TMA=True)

    def run(self, q, k, v):
        out = torch.empty_like(q)
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        thr = self.thresholds.run(q, k) if self.thresholds is not None else out
        kwargs = self.plain
        if self.tma is not None and (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0:
            kwargs = self.tma
            _ensure_allocator()
        self.kernel[self.grid](q, k, v, out, out if lse is None else lse, thr, *self.tail, **kwargs)
        return out, lse


def attention_forward(q, k, v, mask=None, *, scale=None, return_lse=False, topk=None, config: KernelConfig,
                      out=None, lse=None):
    """Run the forward kernel with an explicit config. Returns (output, lse or None).

    `out` and `lse` may be given preallocated (tests poison them to catch unwritten elements).
    """
    shape = check_qkv(q, k, v, kernel=True)
    problems = config.problems(shape.head_dim, q.element_size())
    if problems:
        raise ValueError(f"invalid kernel config {config}: {'; '.join(problems)}")
    return forward(q, k, v, masks_.as_mask(mask), shape, check_scale(scale, shape.head_dim),
                   check_topk(topk, shape.kv_len), return_lse, config, out, lse)


def forward(q, k, v, mask, shape, scale: float, topk: int, return_lse: bool, config: KernelConfig, out=None,
            lse=None):
    """attention_forward on checked arguments (the dispatcher's fully checked path)."""
    bound, structure = blocks(q, mask, shape, config)
    if out is None:
        out = torch.empty_like(q)
    if return_lse and lse is None:
        lse = torch.empty((shape.batch, shape.heads, shape.q_len), dtype=torch.float32, device=q.device)
    if not return_lse:
        lse = None
    use_tma = config.use_tma and tma_eligible(q, k, v)
    if shape.q_len > 0:
        thr = Thresholds(q, k, bound, structure, shape, scale, topk, config).run(q, k) if topk else None
        launch(q, k, v, out, lse, thr, bound, structure, shape, scale, config, use_tma)
    return out, lse


# ---------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------
class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, shape, scale, topk, return_lse, config):
        return forward(q, k, v, mask, shape, scale, topk, return_lse, config)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("attngen has no backward kernel yet: attngen.attention is forward-only; "
                                  "call it under torch.no_grad() or use SDPA for training")
