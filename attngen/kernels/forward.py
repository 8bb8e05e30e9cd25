"""The forward kernel family (`fwd`): templates/kernels/forward.py.jinja, its plan and launch.

Reading order: the launch of one call (`forward_launch`), the per-signature `Plan` of the
dispatcher's fast path, then `forward` and `attention_forward` (an explicit config), which the
tests, the tuner and the autograd Function call. Top-k calls run the threshold kernels of
attngen.kernels.topk first.
"""

from __future__ import annotations

import math

import torch

from .. import masks as masks_
from ..checks import check_dropout, check_flag, check_qkv, check_scale, check_topk, draw_seed
from ..config import KernelConfig, block_d_for
from .launch import (Launch, aligned, dims, dot_precision, ensure_allocator, launcher, maker, mask_args,
                     module_for, structure_args, tensor_args, tma_eligible)
from .topk import Thresholds, TopkTuning

TEMPLATE = "forward"  # templates/kernels/forward.py.jinja


def blocks(q, mask, shape, config: KernelConfig):
    """(bound mask, block structure) of one call, at the config's tile size."""
    bound = masks_.bind(mask, batch=shape.batch, heads=shape.heads, q_len=shape.q_len, kv_len=shape.kv_len,
                        device=q.device)
    structure = masks_.block_structure(mask, shape.q_len, shape.kv_len, (config.block_m, config.block_n),
                                       batch=shape.batch, heads=shape.heads, device=q.device, bound=bound)
    return bound, structure


def key_lists(structure: masks_.BlockStructure) -> int:
    """The block lists a kernel walks (the forward's LISTS, the backward's LISTS1 and LISTS2): 2
    (full, then partial), or 1 where no tile of the call is partial, so that the loop over partial
    blocks is not compiled (the dense forward fallback on sm_90: 144 B of spills fewer). triton 3.6
    warp-specializes a kernel's loop only where it is its one loop (a config's warp_specialize, which
    KernelConfig.problems refuses for the forward, would hold only at 1)."""
    return 2 if structure.partial else 1


def forward_launch(q, k, v, out, lse, thr, bound, structure: masks_.BlockStructure, shape, scale: float,
                   config: KernelConfig, use_tma: bool, dropout_p: float = 0.0, seed: int = 0) -> Launch:
    """The attention launch of one call on checked inputs and preallocated outputs. `lse` None: no
    LSE is stored; `thr` None: plain softmax, else the top-k thresholds and row maxima (2 * B * H *
    Sq floats, Thresholds.run); `dropout_p` > 0: dropout drawn from `seed`."""
    kernel = module_for(TEMPLATE, bound.mask if bound is not None else None).attention_fwd
    bm = structure.block_size[0]
    args = dict(tensor_args("q", q, "bhmd"), **tensor_args("k", k, "bhnd"), **tensor_args("v", v, "bhnd"),
                **tensor_args("o", out, "bhmd"), LSE=lse if lse is not None else out,
                stride_lb=lse.stride(0) if lse is not None else 0, stride_lh=lse.stride(1) if lse is not None else 0,
                THR=thr if thr is not None else out, **structure_args(structure), **dims(shape, scale),
                seed=seed, dropout_p=dropout_p, **mask_args(bound))
    lists = key_lists(structure)
    options = dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d_for(shape.head_dim), BLOCK_M=bm,
                   BLOCK_N=structure.block_size[1], DOT_PRECISION=dot_precision(q.dtype),
                   CONTIGUOUS=structure.contiguous, LISTS=lists, STORE_LSE=lse is not None, USE_TMA=use_tma,
                   WARP_SPECIALIZE=config.warp_specialize and lists == 1, TOPK=thr is not None,
                   DROPOUT=dropout_p > 0, num_warps=config.num_warps, num_stages=config.num_stages)
    return Launch(kernel, (math.ceil(shape.q_len / bm), shape.batch * shape.heads), args, options)


def _outputs(q, shape, return_lse: bool, out=None, lse=None):
    """The output (like q) and, with return_lse, the LSE ((B, Hq, Sq) fp32): those given, else new."""
    if out is None:
        out = torch.empty_like(q)
    if not return_lse:
        return out, None
    if lse is None:
        lse = torch.empty((shape.batch, shape.heads, shape.q_len), dtype=torch.float32, device=q.device)
    return out, lse


class Plan:
    """Everything of a launch but the tensors, prepared once per call signature (the dispatcher's fast path).

    A signature fixes shapes, strides, dtypes, device, mask (with its scalar values), scale, topk,
    dropout_p and return_lse; the output's strides follow from q's, so only q, k, v, out, lse (and
    the top-k thresholds and the dropout seed) change per call.
    """

    def __init__(self, q, k, v, mask, shape, scale: float, topk: int, return_lse: bool, config: KernelConfig,
                 dropout_p: float = 0.0, tuning: TopkTuning = TopkTuning()):
        bound, structure = blocks(q, mask, shape, config)
        out, lse = _outputs(q, shape, return_lse)
        self.new_out = maker(out)
        self.new_lse = None if lse is None else maker(lse)
        self.thresholds = Thresholds(q, k, bound, structure, shape, scale, topk, config, tuning) if topk else None
        launch = forward_launch(q, k, v, out, lse, out if topk else None, bound, structure, shape, scale, config,
                                False, dropout_p)
        self.dropout = dropout_p > 0
        # variant 1 loads through tensor descriptors: where the strides fit, for calls whose base
        # pointers are aligned too (checked per call)
        self.tma = config.use_tma and tma_eligible(q, k, v)
        variants = [launch.options, dict(launch.options, USE_TMA=True)] if self.tma else [launch.options]
        self._run = launch.runner("Q", "K", "V", "O", "LSE", "THR", "seed", variants=variants)

    def run(self, q, k, v):
        out, lse, _ = self.launch(q, k, v, draw_seed() if self.dropout else 0)
        return out, lse

    def launch(self, q, k, v, seed: int):
        """run with the dropout seed given (the autograd Function keeps it for the backward):
        (output, LSE or None, the top-k thresholds or None)."""
        out = self.new_out()
        lse = self.new_lse() if self.new_lse is not None else None
        thr = self.thresholds.run(q, k) if self.thresholds is not None else None
        variant = 0
        if self.tma and aligned(q, k, v):
            variant = 1
            ensure_allocator()
        self._run(q, k, v, out, out if lse is None else lse, out if thr is None else thr, seed, variant=variant)
        return out, lse, thr


def forward(q, k, v, mask, shape, scale: float, topk: int, return_lse: bool, config: KernelConfig, out=None,
            lse=None, tuning: TopkTuning = TopkTuning(), dropout_p: float = 0.0, seed: int = 0):
    """attention_forward on checked arguments (the dispatcher's fully checked path). Returns
    (output, lse or None, the top-k thresholds or None), the thresholds as Thresholds.run gives
    them (the backward needs them)."""
    bound, structure = blocks(q, mask, shape, config)
    out, lse = _outputs(q, shape, return_lse, out, lse)
    use_tma = config.use_tma and tma_eligible(q, k, v)
    thr = None
    if q.numel() > 0:  # else there is nothing to compute (B, Hq or Sq is 0), nor a tile to launch
        thr = Thresholds(q, k, bound, structure, shape, scale, topk, config, tuning).run(q, k) if topk else None
        if use_tma:
            ensure_allocator()
        forward_launch(q, k, v, out, lse, thr, bound, structure, shape, scale, config, use_tma, dropout_p, seed)()
    return out, lse, thr


def attention_forward(q, k, v, mask=None, *, scale=None, return_lse=False, topk=None, config: KernelConfig,
                      out=None, lse=None, tuning: TopkTuning | None = None):
    """Run the forward kernel with an explicit config. Returns (output, lse or None).

    `out` and `lse` may be given preallocated (tests poison them to catch unwritten elements);
    `tuning` sets the top-k threshold search's constants (default TopkTuning()).
    """
    shape = check_qkv(q, k, v, kernel=True)
    check_flag("return_lse", return_lse)
    problems = config.problems(shape.head_dim, q.element_size())
    if problems:
        raise ValueError(f"invalid kernel config {config}: {'; '.join(problems)}")
    return forward(q, k, v, masks_.as_mask(mask), shape, check_scale(scale, shape.head_dim),
                   check_topk(topk, shape.kv_len), return_lse, config, out, lse, tuning or TopkTuning())[:2]


def dropout_mask(q, k, dropout_p: float) -> torch.Tensor:
    """The dropout mask (B, Hq, Sq, Sk), True where a weight is kept, that attngen.attention(q, k, v,
    dropout_p=dropout_p) uses when torch's default generator is in the state it is in now (it draws
    the call's seed the same way). For tests of small shapes: restore the generator's state (or
    torch.manual_seed) between the call and this."""
    shape = check_qkv(q, k, k, kernel=True)
    dropout_p = check_dropout(dropout_p)
    keep = torch.empty((shape.batch, shape.heads, shape.q_len, shape.kv_len), dtype=torch.int8, device=q.device)
    block = 32
    grid = (math.ceil(shape.q_len / block), math.ceil(shape.kv_len / block), shape.batch * shape.heads)
    if keep.numel():
        launcher(module_for(TEMPLATE, None).dropout_keep_mask, grid)(keep, draw_seed(), dropout_p, shape.q_len,
                                                                     shape.kv_len, BLOCK_M=block, BLOCK_N=block)
    return keep.bool()
