"""The decode kernel family (`decode`): templates/kernels/decode.py.jinja, its checks, plan and launch.

A decode call is a few new query tokens per sequence, q (B, Hq, Sq, D), against a KV cache:
- contiguous: k_cache, v_cache (B, Hkv, S, D), the layout of attngen.attention, any strides;
- paged (vLLM's and FlashInfer's NHD layout): k_cache, v_cache (num_pages, page_size, Hkv, D) and a
  block table (B, pages per sequence) of int32/int64 page numbers: key j of sequence b sits in row
  j % page_size of page block_table[b, j // page_size].
seq_lens (B,) int32/int64 holds every sequence's length, its Sq new tokens included (they are its
last Sq positions; default for a contiguous cache: S). The keys of a sequence are split across
programs (the split rule below), whose partial outputs a second small kernel joins.

Reading order: `check_decode` (the call's shape and layout), `split_count`, `decode_launches`,
`DecodePlan` (everything but the tensors, once per call signature), `decode_plan` and
`decode_forward` (an explicit config: the tuner and the tests).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import masks as masks_
from ..checks import Shape, check_flag, check_scale, interpreter_on
from ..config import KernelConfig, block_d_for
from ..dtypes import SUPPORTED as SUPPORTED_DTYPES
from .launch import Launch, dot_precision, maker, mask_args, module_for, tensor_args

TEMPLATE = "decode"  # templates/kernels/decode.py.jinja
MAX_ROWS = 128  # query rows one key/value head packs into a tile: group * Sq
SHORT_QUERY = 16  # attngen.attention runs a query of at most this many tokens through these kernels
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Cache:
    """How a call's cache is laid out: what the kernel needs besides the tensors."""
    paged: bool
    page_size: int  # rows per page (a contiguous cache: S, one "page" per sequence)
    n_pages: int  # pages in the cache (contiguous: B)
    capacity: int  # the most keys a sequence can have: S, or pages per sequence * page_size

    def row_strides(self, t: torch.Tensor) -> tuple[int, int, int, int]:
        """(page, row, head, d) strides of k_cache or v_cache."""
        if self.paged:
            return t.stride(0), t.stride(1), t.stride(2), t.stride(3)
        return t.stride(0), t.stride(2), t.stride(1), t.stride(3)


def _need_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_decode(q, k_cache, v_cache, seq_lens, block_table, *, kernel: bool = True) -> tuple[Shape, Cache]:
    """The call's Shape (kv_len: the cache's capacity) and Cache layout; clear errors for inputs that
    do not fit (sizes, dtypes, devices). The values of seq_lens and block_table are validate_values'.
    `kernel` False: CPU tensors stand for the shapes only (attngen.tools.cross_compile)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _need_tensor(name, t)
        if t.dim() != 4:
            want = "(num_pages, page_size, kv_heads, head_dim)" if block_table is not None and name != "q" else \
                "(batch, heads, seq_len, head_dim)"
            raise ValueError(f"{name} must have 4 dimensions {want}, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q and the cache must share one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must share one device")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)} but v_cache has {tuple(v_cache.shape)}")
    batch, heads, q_len, head_dim = q.shape
    if block_table is None:
        cache_batch, kv_heads, capacity, d = k_cache.shape
        if cache_batch != batch:
            raise ValueError(f"k_cache has batch {cache_batch} but q has {batch}; a contiguous cache is "
                             "(batch, kv_heads, seq_len, head_dim) (pass block_table for a paged one)")
        cache = Cache(False, capacity, batch, capacity)
    else:
        _need_tensor("block_table", block_table)
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch, pages per sequence) = ({batch}, ...), got "
                             f"{tuple(block_table.shape)}")
        if block_table.dtype not in INDEX_DTYPES:
            raise TypeError(f"block_table must hold int32 or int64 page numbers, got {block_table.dtype}")
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}")
        n_pages, page_size, kv_heads, d = k_cache.shape
        cache = Cache(True, page_size, n_pages, block_table.shape[1] * page_size)
        if seq_lens is None:
            raise ValueError("a paged cache needs seq_lens: the length of every sequence")
    if d != head_dim:
        raise ValueError(f"head dims differ: q {head_dim}, k_cache and v_cache {d}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q has {heads} heads, which is not a multiple of the cache's {kv_heads} key/value heads")
    if head_dim < 1 or head_dim > 256:
        raise ValueError(f"head dim {head_dim} must be 1..256")
    if q_len < 1:
        raise ValueError("q has no query tokens (Sq = 0); decode needs at least one new token per sequence")
    rows = heads // kv_heads * q_len
    if rows > MAX_ROWS:
        raise ValueError(f"decode packs the {heads // kv_heads} query heads of a key/value head times the {q_len} new "
                         f"tokens = {rows} rows into one tile, at most {MAX_ROWS}: use attngen.attention for longer "
                         "queries (prefill)")
    if cache.capacity < 1:
        raise ValueError("the cache holds no keys (its length or pages per sequence is 0)")
    if seq_lens is not None:
        _need_tensor("seq_lens", seq_lens)
        if seq_lens.shape != (batch,) or seq_lens.dtype not in INDEX_DTYPES:
            raise ValueError(f"seq_lens must be a ({batch},) int32 or int64 tensor (one length per sequence), got "
                             f"shape {tuple(seq_lens.shape)} dtype {seq_lens.dtype}")
        if seq_lens.device != q.device:
            raise ValueError(f"seq_lens is on {seq_lens.device} but q is on {q.device}")
    if kernel and q.device.type != "cuda" and not interpreter_on():
        raise ValueError("q is a CPU tensor; attngen kernels run on a CUDA device, or on the CPU under Triton's "
                         "interpreter (set TRITON_INTERPRET=1 before triton is imported)")
    return Shape(batch, heads, kv_heads, q_len, cache.capacity, head_dim), cache


def validate_values(seq_lens, block_table, shape: Shape, cache: Cache) -> None:
    """The checks that read the values of seq_lens and block_table (one device synchronisation):
    every length between Sq and the cache's capacity, every page a sequence uses a page of the cache."""
    lens = seq_lens.long()
    low, high = int(lens.min()), int(lens.max())
    if low < shape.q_len or high > cache.capacity:
        b = int(torch.argmin(lens)) if low < shape.q_len else int(torch.argmax(lens))
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} must be between the {shape.q_len} new tokens (they count "
                         f"in the length) and the cache's capacity {cache.capacity}")
    if block_table is not None:
        used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < (
            (lens + cache.page_size - 1) // cache.page_size)[:, None]
        bad = used & ((block_table < 0) | (block_table >= cache.n_pages))
        if bool(bad.any()):
            b, j = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the cache "
                             f"(0..{cache.n_pages - 1}), and sequence {b} of length {int(lens[b])} uses it")


_SM_COUNTS: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (4 under the interpreter: small grids for the CPU)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(index)
    if count is None:
        count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def pdl_available(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched as programmatic dependents (griddepcontrol):
    a CUDA device of compute capability 9.0 or later, not the interpreter."""
    return device.type == "cuda" and not interpreter_on() and torch.cuda.get_device_capability(device)[0] >= 9


def pairs_fill(shape: Shape, sms: int) -> bool:
    """Whether a call's (sequence, key/value head) pairs alone fill 80% of two program slots per SM:
    such calls are never split, and take the "decode_full" defaults (attngen.config.DEFAULTS)."""
    return shape.batch * shape.kv_heads >= 0.8 * 2 * sms


def default_table(shape: Shape, device: torch.device, paged: bool = False, mask=None) -> str:
    """The DEFAULTS key of a decode call's fallback config: "decode_full" (the pairs fill the GPU),
    else a split call's: "decode_paged" over a paged cache, "decode" over a contiguous one."""
    if pairs_fill(shape, sm_count(device)):
        return "decode_full"
    return "decode_paged" if paged else "decode"


def split_count(shape: Shape, cache: Cache, config: KernelConfig, sms: int) -> int:
    """The split rule: how many programs share each (sequence, key/value head)'s keys. Each program
    takes an equal share of the keys in whole tiles (at least config.block_m keys: the kernel's
    rule, over the cache's capacity here), and programs run in waves of two per SM, over a paged
    cache too (an H100, 2026-12-06: counting the three programs an SM that the paged 128-key
    kernel's registers allow gave 6 splits at batch 8 and 8k keys, 98.6 µs in a CUDA graph, against
    96.2 at 4 splits, SDPA's flash kernel 96.7 in both runs; at batch 1 and 64k keys 47 splits and
    32 took the same, 97.5 and 97.4); a count n costs its waves times its share (the busiest SM's
    keys), and the rule takes the cheapest, the fewest splits among those within 1% of it. No split
    when the (sequence, head) pairs alone fill 80% of two programs per SM. On an H200 (batch
    1, 64k keys, 8 heads, 128-key tiles, two programs per SM) the cost's order was the time's: 32
    splits 81.1 µs, 31 81.9, 29 82.7, 26 82.7, 24 84.4, 40 86.4, 36 88.2, 16 90.4; 33 splits, tied
    with 32 but with an empty split a head, took 83.9. The rule reads only sizes the host knows;
    each program then shares out its own sequence's length in the kernel, so lengths that change
    never change the grid."""
    programs, slots = shape.batch * shape.kv_heads, 2 * sms
    most = max(1, math.ceil(cache.capacity / max(config.block_m, config.block_n)))
    if pairs_fill(shape, sms) or most == 1:
        return 1
    tile = config.block_n
    fewest = math.ceil(config.block_m / tile) * tile

    def cost(n: int) -> int:
        share = max(math.ceil(math.ceil(cache.capacity / n) / tile) * tile, fewest)
        return math.ceil(programs * n / slots) * share

    costs = [cost(n) for n in range(1, most + 1)]
    cheapest = min(costs)
    return next(n for n, c in enumerate(costs, 1) if c <= 1.01 * cheapest)


def takes_short_query(shape: Shape, topk: int, dropout_p: float) -> bool:
    """Whether attngen.attention runs a call (that needs no gradients) through the decode kernels:
    a query of at most SHORT_QUERY tokens whose rows fit a tile, without top-k or dropout. They read
    K and V once per key/value head (the forward kernel: once per query head) and split the keys
    over enough programs to fill the GPU (the forward kernel: one program per head for such a query)."""
    return (0 < shape.q_len <= SHORT_QUERY and shape.group * shape.q_len <= MAX_ROWS and not topk
            and not dropout_p)


def combine_rows(shape: Shape) -> int:
    """ROWS of the combine kernel: a key/value head's real rows (group * Sq) as a power of two. The
    split kernel writes those rows only, and the combine reads them only (its tiles need no tl.dot,
    so no padding to 16: at Hq 32, Hkv 8 and one token, 4 rows instead of 16)."""
    return 1 << (shape.group * shape.q_len - 1).bit_length()


def rows_tile(shape: Shape) -> int:
    """BLOCK_M: the rows of a key/value head (group * Sq) as a power of two >= 16 (tl.dot's least)."""
    return max(16, combine_rows(shape))


def span(t: torch.Tensor) -> int:
    """How many elements from its first to its last element, and one: what an offset into `t` reaches."""
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) if t.numel() else 0


def decode_launches(q, k_cache, v_cache, block_table, lens, out, lse, bound, shape: Shape, cache: Cache,
                    scale: float, config: KernelConfig, splits: int, from_end: bool = True,
                    pdl: bool | None = None) -> list[Launch]:
    """The launches of one call: the split kernel, and with splits > 1 the combine kernel; the
    partial results go to scratch tensors made here (the plan makes its own per call). `from_end`:
    attngen.decode's positions (the new tokens at the sequence's end), else attngen.attention's.
    `pdl`: launch the combine kernel as a programmatic dependent of the split kernel (default:
    where the device has it, `pdl_available`)."""
    module = module_for(TEMPLATE, bound.mask if bound is not None else None)
    block_m, block_d = rows_tile(shape), block_d_for(shape.head_dim)
    split = splits > 1
    pdl = split and (pdl_available(q.device) if pdl is None else pdl)
    programs = shape.batch * shape.kv_heads
    part_o, part_lse = [new() for new in scratch(q.device, programs, splits, block_m, block_d)] if split else (out, out)
    kp, ks, kh, kd = cache.row_strides(k_cache)
    vp, vs, vh, vd = cache.row_strides(v_cache)
    lse_strides = dict(stride_lb=lse.stride(0), stride_lh=lse.stride(1)) if lse is not None else \
        dict(stride_lb=0, stride_lh=0)
    table = block_table if block_table is not None else lens
    args = dict(**tensor_args("q", q, "bhmd"), K=k_cache, stride_kp=kp, stride_ks=ks, stride_kh=kh, stride_kd=kd,
                V=v_cache, stride_vp=vp, stride_vs=vs, stride_vh=vh, stride_vd=vd, **tensor_args("o", out, "bhmd"),
                LSE=lse if lse is not None else out, **lse_strides, PART_O=part_o, PART_LSE=part_lse, TABLE=table,
                stride_tb=table.stride(0), stride_tp=table.stride(1) if table.dim() == 2 else 0, LENS=lens,
                batch=shape.batch, heads=shape.heads, q_len=shape.q_len, group=shape.group,
                n_pages=cache.n_pages, kv_cap=cache.capacity, min_split=config.block_m,
                sm_scale=scale, **mask_args(bound))
    options = dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=config.block_n,
                   PAGED=cache.paged, SPLIT=split, STORE_LSE=lse is not None, DOT_PRECISION=dot_precision(q.dtype),
                   FROM_END=from_end, PAGE_SIZE=cache.page_size if cache.paged else 1,
                   WHOLE_PAGES=cache.paged and cache.page_size % config.block_n == 0, PDL=pdl,
                   OFFSETS_32=cache.paged and all(span(t) <= 2 ** 31 for t in (k_cache, v_cache)),
                   num_warps=config.num_warps, num_stages=config.num_stages)
    launches = [Launch(module.decode_fwd, (splits, programs), args, options)]
    if split:
        combine = dict(PART_O=part_o, PART_LSE=part_lse, **tensor_args("o", out, "bhmd"),
                       LSE=lse if lse is not None else out, **lse_strides, heads=shape.heads, q_len=shape.q_len,
                       group=shape.group, n_splits=splits)
        rows = combine_rows(shape)
        columns, chunk = combine_tiles(rows, block_d, splits)
        launches.append(Launch(module.decode_combine, (programs, block_d // columns), combine,
                               dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d, BLOCK_M=block_m, ROWS=rows,
                                    STORE_LSE=lse is not None, CHUNK=chunk, COLUMNS=columns, PDL=pdl,
                                    launch_pdl=pdl, num_warps=4)))
    return launches


# partial-output elements a combine program reads at once: 16384 for a tile of at most 16 rows (one
# new token of up to 16 query heads: 255 registers a thread on sm_90, no spill), 4096 for larger
# tiles (16384 spills 600-1500 bytes a thread at 32 to 128 rows; attngen.tools.cross_compile)
COMBINE_ELEMENTS_16_ROWS = 16384
COMBINE_ELEMENTS = 4096


def combine_tiles(rows: int, block_d: int, splits: int) -> tuple[int, int]:
    """(COLUMNS, CHUNK) of the combine kernel for tiles of `rows` rows: a program joins 32 columns of
    the head dim (or all of a smaller one) and reads CHUNK splits of them at once: all of them where
    the element budget above allows (each round of loads waits for the one before: an H200 at batch
    1, 29 splits, took 7.9 µs in 8-split chunks, 5.0 in one, 4.6 with the LSEs and outputs loaded in
    one pass), and no more than the call has (a chunk of 32 for 4 splits took 5.9 µs against 3.6
    for 8: the masked-off splits cost too)."""
    columns = min(32, block_d)
    elements = COMBINE_ELEMENTS_16_ROWS if rows <= 16 else COMBINE_ELEMENTS
    most = max(1, elements // (rows * columns))
    return columns, min(1 << (most.bit_length() - 1), 1 << (splits - 1).bit_length())


def scratch(device, programs: int, splits: int, block_m: int, block_d: int):
    """Functions that make the split kernel's partial outputs and LSEs (fp32; every element is
    written before it is read), from prepared torch.empty_strided arguments (half of torch.empty's
    host time)."""
    rows = programs * splits * block_m
    return (functools.partial(torch.empty_strided, (rows, block_d), (block_d, 1), dtype=torch.float32, device=device),
            functools.partial(torch.empty_strided, (rows,), (1,), dtype=torch.float32, device=device))


def _outputs(q, shape: Shape, return_lse: bool):
    out = torch.empty_like(q)
    lse = torch.empty((shape.batch, shape.heads, shape.q_len), dtype=torch.float32, device=q.device) \
        if return_lse else None
    return out, lse


def full_lengths(shape: Shape, device) -> torch.Tensor:
    """seq_lens of a contiguous cache that is full: every sequence S long."""
    return torch.full((shape.batch,), shape.kv_len, dtype=torch.int32, device=device)


class DecodePlan:
    """Everything of a decode call but the tensors, prepared once per call signature: shapes, strides,
    dtypes, device, layout, mask (with its scalars and tensors), scale, return_lse. A call passes q,
    the caches, the block table and the lengths; new lengths or a new block table never rebuild it.
    `from_end` False: an attngen.attention call's positions (and mask sizes), not decode's."""

    def __init__(self, q, k_cache, v_cache, block_table, seq_lens, mask, shape: Shape, cache: Cache, scale: float,
                 return_lse: bool, config: KernelConfig, splits: int | None = None, from_end: bool = True,
                 pdl: bool | None = None):
        bound = masks_.bind(mask, batch=shape.batch, heads=shape.heads,
                            q_len=cache.capacity if from_end else shape.q_len, kv_len=cache.capacity, device=q.device)
        self.full = full_lengths(shape, q.device) if seq_lens is None else None
        lens = self.full if seq_lens is None else seq_lens
        out, lse = _outputs(q, shape, return_lse)
        self.splits = splits or split_count(shape, cache, config, sm_count(q.device))
        launches = decode_launches(q, k_cache, v_cache, block_table, lens, out, lse, bound, shape, cache, scale,
                                   config, self.splits, from_end, pdl)
        self.new_out = maker(out)
        self.new_lse = None if lse is None else maker(lse)
        self.new_part_o, self.new_part_lse = scratch(q.device, shape.batch * shape.kv_heads, self.splits,
                                                     rows_tile(shape), block_d_for(shape.head_dim))
        self.shape, self.cache = shape, cache
        self._split = launches[0].runner("Q", "K", "V", "O", "LSE", "PART_O", "PART_LSE", "TABLE", "LENS")
        self._combine = launches[1].runner("PART_O", "PART_LSE", "O", "LSE") if len(launches) > 1 else None

    def run(self, q, k_cache, v_cache, block_table, seq_lens, out=None, lse=None):
        if out is None:
            out = self.new_out()
            lse = self.new_lse() if self.new_lse is not None else None
        lens = self.full if seq_lens is None else seq_lens
        table = block_table if self.cache.paged else lens
        lse_arg = out if lse is None else lse
        if self._combine is None:
            self._split(q, k_cache, v_cache, out, lse_arg, out, out, table, lens)
        else:
            part_o, part_lse = self.new_part_o(), self.new_part_lse()
            self._split(q, k_cache, v_cache, out, lse_arg, part_o, part_lse, table, lens)
            self._combine(part_o, part_lse, out, lse_arg)
        return out, lse


class ShortQueryPlan:
    """An attngen.attention call with a short query (takes_short_query) on the decode kernels: k and
    v are a full contiguous cache, the positions and mask sizes attention's. Runs like forward.Plan."""

    def __init__(self, q, k, v, mask, shape: Shape, scale: float, return_lse: bool, config: KernelConfig):
        cache = Cache(False, shape.kv_len, shape.batch, shape.kv_len)
        self.plan = DecodePlan(q, k, v, None, None, mask, shape, cache, scale, return_lse, config, from_end=False)

    def run(self, q, k, v):
        return self.plan.run(q, k, v, None, None)


def decode_plan(q, k_cache, v_cache, seq_lens=None, *, block_table=None, mask=None, scale=None, return_lse=False,
                config: KernelConfig, splits: int | None = None, validate: bool = True) -> DecodePlan:
    """The checked DecodePlan of a call with an explicit config (decode_forward's first half): its
    run(q, k_cache, v_cache, block_table, seq_lens) launches the kernels and nothing else, as the
    tuner times them."""
    shape, cache = check_decode(q, k_cache, v_cache, seq_lens, block_table)
    check_flag("return_lse", return_lse)
    check_flag("validate", validate)
    problems = config.problems(shape.head_dim, q.element_size(), kernel="decode")
    if problems:
        raise ValueError(f"invalid kernel config {config}: {'; '.join(problems)}")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits must be a positive int or None, got {splits!r}")
    if validate and seq_lens is not None:
        validate_values(seq_lens, block_table, shape, cache)
    return DecodePlan(q, k_cache, v_cache, block_table, seq_lens, masks_.as_mask(mask), shape, cache,
                      check_scale(scale, shape.head_dim), return_lse, config, splits)


def decode_forward(q, k_cache, v_cache, seq_lens=None, *, block_table=None, mask=None, scale=None, return_lse=False,
                   config: KernelConfig, splits: int | None = None, validate: bool = True, out=None, lse=None):
    """Run the decode kernels with an explicit config (and, for tests, an explicit number of splits).
    Returns (output, lse or None). `out` (like q) and, with return_lse, `lse` ((B, Hq, Sq) fp32) may
    be given preallocated (tests poison them to catch unwritten elements)."""
    plan = decode_plan(q, k_cache, v_cache, seq_lens, block_table=block_table, mask=mask, scale=scale,
                       return_lse=return_lse, config=config, splits=splits, validate=validate)
    if out is None:
        return plan.run(q, k_cache, v_cache, block_table, seq_lens)
    if out.shape != q.shape or out.stride() != q.stride() or out.dtype != q.dtype or (
            return_lse and (lse is None or lse.shape != (plan.shape.batch, plan.shape.heads, plan.shape.q_len))):
        raise ValueError("out must be shaped, strided and typed like q, and lse (B, Hq, Sq) fp32 with return_lse")
    return plan.run(q, k_cache, v_cache, block_table, seq_lens, out, lse if return_lse else None)
