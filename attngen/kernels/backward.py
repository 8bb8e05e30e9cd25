"""The backward kernel family (`bwd`): templates/kernels/backward.py.jinja, its tiles and launches.

Two launches a call: the preprocessing pass (each row's delta = dO·O - dLSE), then the gradients',
whose grid holds a dK/dV program per key block and key/value head (walking the query blocks that
see the key block: the forward's tile classes, transposed) and a dQ program per query block and
head (walking the forward's own block lists), so that neither kind's last wave leaves the GPU half
idle. The scores are recomputed from the saved LSE with the forward's score code.

Reading order: the tiles of a config, then `backward`, which the autograd Function calls.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .. import masks as masks_
from ..config import KernelConfig, block_d_for, shared_memory_limit
from .launch import (Launch, aligned, dims, dot_precision, ensure_allocator, maker, mask_args, module_for,
                     structure_args, tensor_args, tma_eligible)
from .forward import key_lists
from .topk import TopkTuning, any_tile, threshold_config

TEMPLATE = "backward"  # templates/kernels/backward.py.jinja
PREPROCESS_ROWS = 64  # query rows a preprocessing program takes


def tiles(config: KernelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """((BLOCK_M, BLOCK_N) of dK/dV, (BLOCK_M, BLOCK_N) of dQ). dK/dV keeps a key block of block_n
    rows in registers and streams query blocks of block_m; dQ the other way round, a query block of
    block_n rows against key blocks of block_m."""
    return (config.block_m, config.block_n), (config.block_n, config.block_m)


def topk_config(config: KernelConfig, forward: KernelConfig, device, head_dim: int,
                elem_bytes: int) -> tuple[KernelConfig, bool]:
    """(the config a top-k call's backward kernels run at, whether they compute the scores in the
    forward's orientation) for a call whose backward would run at `config` and whose forward ran at
    `forward`. Every score must come out bit for bit as the forward and the threshold kernels saw
    it. Where every kernel's score dot computes a score the same way at any tiles and in either
    orientation (topk.any_tile: Hopper's wgmma; both backward dots have block_n rows), the backward
    runs at `config`, like any other call, its block_m at least 32 (the narrowest tile that rule was
    checked for). Elsewhere both of its kernels run at the threshold kernels' config
    (topk.threshold_config), tiles of the forward's (block_m, block_n), queries first: the dK/dV
    programs transpose their scores through shared memory (a block_m x block_n fp32 tile), and as
    many pipeline stages come off as the device's shared memory needs (head_dim 256 does); where
    even one stage is too many, a ValueError says so."""
    if any_tile(forward.block_m, forward.num_warps, device) and any_tile(config.block_n, config.num_warps, device):
        if config.block_m < 32:
            config = replace(config, block_m=32)
        if config.block_m <= 128:
            return config, False
    own = threshold_config(forward, device, TopkTuning())
    limit = shared_memory_limit(device)
    if limit is not None:
        transposed = 4 * own.block_m * own.block_n  # the dK/dV programs' fp32 scores, whatever the stages
        own, _ = own.fit_shared_memory(head_dim, elem_bytes, limit - transposed, "bwd")
        need = own.shared_memory(head_dim, elem_bytes, "bwd") + transposed
        if need > limit:
            raise ValueError(f"a top-k call's backward at head_dim={head_dim} with {elem_bytes}-byte inputs needs "
                             f"about {need} bytes of shared memory at the threshold kernels' tiles {own}; "
                             f"this GPU has {limit}: use bfloat16 or float16 inputs")
    return own, True


def takes_tma(config: KernelConfig, fwd_orient: bool, *tensors) -> bool:
    """Whether a call's streamed tiles load through tensor descriptors: where its config says so,
    not for top-k calls at the threshold kernels' tiles (`fwd_orient`: plain calls at those 64x64
    tiles on 4 warps ran slower with it), and where the tensors' strides and base pointers fit
    (tma_eligible)."""
    return config.use_tma and not fwd_orient and tma_eligible(*tensors)


def dq_buffer(q) -> torch.Tensor:
    """The zeroed fp32 (B, Hq, Sq, D) buffer that dK/dV adds dQ's shares to when not deterministic."""
    return torch.zeros(q.shape, dtype=torch.float32, device=q.device)


def backward(q, k, v, out, lse, thr, dout, dlse, mask, shape, scale: float, config: KernelConfig,
             forward: KernelConfig | None = None, dropout_p: float = 0.0, seed: int = 0,
             deterministic: bool = True):
    """(dq, dk, dv) of one call from its forward's output, LSE (natural log, (B, Hq, Sq) fp32,
    contiguous) and top-k thresholds (`thr`: None, or the forward's 2 * B * H * Sq floats), the
    gradient of the output `dout` and of the LSE `dlse` (None where the LSE is not used).
    `forward`: the forward's config, for top-k calls (see topk_config); `dropout_p` and `seed`: the
    forward's dropout, which the kernels regenerate. `deterministic=False`: dK/dV adds dQ's shares
    with atomics and there are no dQ programs (bits may differ from run to run)."""
    if q.numel() == 0:  # no query (B, Hq or Sq is 0): no gradient reaches k and v
        return torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    plan = BackwardPlan(q, k, v, out, lse, thr, dout, mask, shape, scale, config, forward, dropout_p, deterministic)
    return plan.run(q, k, v, out, lse, thr, dout, dlse, seed)


class BackwardPlan:
    """The backward's two launches prepared once per call signature (and dO's strides): per call
    only q, k, v, the forward's output, LSE and thresholds, dO, dLSE, the dropout seed and the new
    dQ, dK, dV change, and they go straight to the prepared runners (`Launch.runner`). Built from
    one call's tensors, it keeps none of them. `backward` runs one for a single call."""

    def __init__(self, q, k, v, out, lse, thr, dout, mask, shape, scale: float, config: KernelConfig,
                 forward: KernelConfig | None = None, dropout_p: float = 0.0, deterministic: bool = True):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.deterministic = deterministic
        acc = None if deterministic else dq_buffer(q)
        fwd_orient = False
        if thr is not None:
            config, fwd_orient = topk_config(config, forward, q.device, shape.head_dim, q.element_size())
        preprocess, grads = backward_launches(q, k, v, out, lse, thr, dout, None, dq, dk, dv, mask, shape, scale,
                                              config, fwd_orient, dropout_p, dq_acc=acc)
        # variant 1 loads through tensor descriptors: where the strides fit, for calls whose base
        # pointers are aligned too (checked per call)
        self.tma = takes_tma(config, fwd_orient, q, k, v, dout)
        self.rows = shape.batch * shape.heads * shape.q_len
        self.new_dq, self.new_dk, self.new_dv = maker(dq), maker(dk), maker(dv)
        self.new_delta = maker(torch.empty(delta_size(self.rows, dropout_p), dtype=torch.float32, device=q.device))
        # dLSE (B, Hq, Sq) made contiguous, where given: these strides; else unused
        self.dlse_strides = (shape.heads * shape.q_len, shape.q_len)
        self.topk = thr is not None
        self._preprocess = preprocess.runner("O", "DO", "LSE", "DLSE", "DELTA", "seed", "stride_lb", "stride_lh",
                                             variants=[preprocess.options, dict(preprocess.options, HAS_DLSE=True)])
        self._grads = grads.runner("Q", "K", "V", "DO", "DELTA", "THR", "DQ", "DK", "DV", "DQ_ACC", "seed",
                                   variants=self._variants(grads))

    def _variants(self, launch: Launch) -> list[dict]:
        return [launch.options, dict(launch.options, USE_TMA=True)] if self.tma else [launch.options]

    def run(self, q, k, v, out, lse, thr, dout, dlse, seed: int = 0):
        dq, dk, dv = self.new_dq(), self.new_dk(), self.new_dv()
        delta = self.new_delta()
        if dlse is None:
            self._preprocess(out, dout, lse, delta, delta, seed, 0, 0)
        else:
            self._preprocess(out, dout, lse, dlse.contiguous(), delta, seed, *self.dlse_strides, variant=1)
        thr = thr if self.topk else delta
        variant = 0
        if self.tma and aligned(q, k, v, dout):
            variant = 1
            ensure_allocator()
        acc = delta if self.deterministic else dq_buffer(q)  # DQ_ACC: unused when deterministic
        self._grads(q, k, v, dout, delta, thr, dq, dk, dv, acc, seed, variant=variant)
        if not self.deterministic:
            dq.copy_(acc)
        return dq, dk, dv


def delta_size(rows: int, dropout_p: float) -> int:
    """Floats of the preprocessing's output for `rows` query rows: per row its delta and base-2 LSE,
    and under dropout its dropout key and multiplier."""
    return (4 if dropout_p > 0 else 2) * rows


def backward_launches(q, k, v, out, lse, thr, dout, dlse, dq, dk, dv, mask, shape, scale: float,
                      config: KernelConfig, fwd_orient: bool = False, dropout_p: float = 0.0,
                      seed: int = 0, dq_acc: torch.Tensor | None = None, use_tma: bool = False) -> list[Launch]:
    """The two launches of `backward`, in order: the preprocessing, then the gradients' (dK/dV and
    dQ programs, writing into dq, dk and dv); with `dq_acc` (dq_buffer's), dK/dV programs only,
    which add dQ into dq_acc atomically (the caller copies it into dq). `config`: a top-k call's
    (topk_config's), and `fwd_orient` its second part. `use_tma`: the streamed tiles load through
    tensor descriptors (the caller checked takes_tma and set Triton's allocator)."""
    bound = masks_.bind(mask, batch=shape.batch, heads=shape.heads, q_len=shape.q_len, kv_len=shape.kv_len,
                        device=q.device)
    module = module_for(TEMPLATE, mask)
    rows = shape.batch * shape.heads
    # each row's delta, its LSE in base 2 and, under dropout, its dropout key and multiplier
    delta = torch.empty(delta_size(rows * shape.q_len, dropout_p), dtype=torch.float32, device=q.device)

    has_dlse = dlse is not None
    dlse = dlse.contiguous() if has_dlse else delta
    preprocess = Launch(module.attention_bwd_preprocess, (math.ceil(shape.q_len / PREPROCESS_ROWS), rows),
                        dict(tensor_args("o", out, "bhmd"), **tensor_args("do", dout, "bhmd"), LSE=lse, DLSE=dlse,
                             DELTA=delta, seed=seed,
                             stride_lb=dlse.stride(0) if has_dlse else 0, stride_lh=dlse.stride(1) if has_dlse else 0,
                             heads=shape.heads, q_len=shape.q_len),
                        dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d_for(shape.head_dim), BLOCK_M=PREPROCESS_ROWS,
                             HAS_DLSE=has_dlse, DROPOUT=dropout_p > 0, num_warps=4))

    topk = thr is not None
    if fwd_orient:  # both kernels at the forward's (block_m, block_n), queries first
        (bm1, bn1), (bm2, bn2) = (config.block_m, config.block_n), (config.block_m, config.block_n)
    else:
        (bm1, bn1), (bm2, bn2) = tiles(config)
    call = dict(tensor_args("q", q, "bhmd"), **tensor_args("k", k, "bhnd"), **tensor_args("v", v, "bhnd"),
                **tensor_args("do", dout, "bhmd"), DELTA=delta, THR=thr if topk else delta,
                **dims(shape, scale), seed=seed, dropout_p=dropout_p, **mask_args(bound))
    options = dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d_for(shape.head_dim), DOT_PRECISION=dot_precision(q.dtype),
                   TOPK=topk, DROPOUT=dropout_p > 0, USE_TMA=use_tma, num_warps=config.num_warps,
                   num_stages=config.num_stages)

    # one launch: per key/value head, a program per key block (dK, dV), then one per query block of
    # each query head of its group (dQ; none when dQ is added atomically)
    by_key = masks_.block_structure(mask, shape.q_len, shape.kv_len, (bm1, bn1), batch=shape.batch,
                                    heads=shape.heads, device=q.device, bound=bound, by_key=True)
    by_query = by_key if dq_acc is not None else masks_.block_structure(
        mask, shape.q_len, shape.kv_len, (bm2, bn2), batch=shape.batch, heads=shape.heads, device=q.device,
        bound=bound)
    dq_programs = 0 if dq_acc is not None else shape.group * math.ceil(shape.q_len / bm2)
    grads = Launch(module.attention_bwd, (math.ceil(shape.kv_len / bn1) + dq_programs, shape.batch * shape.kv_heads),
                   dict(call, **tensor_args("dq", dq, "bhmd"), **tensor_args("dk", dk, "bhnd"),
                        **tensor_args("dv", dv, "bhnd"), DQ_ACC=dq_acc if dq_acc is not None else delta,
                        stride_accb=dq_acc.stride(0) if dq_acc is not None else 0,
                        stride_acch=dq_acc.stride(1) if dq_acc is not None else 0,
                        stride_accm=dq_acc.stride(2) if dq_acc is not None else 0,
                        **structure_args(by_key, "DKV_"), **structure_args(by_query, "DQ_")),
                   dict(options, BLOCK_M1=bm1, BLOCK_N1=bn1, BLOCK_M2=bm2, BLOCK_N2=bn2,
                        CONTIGUOUS1=by_key.contiguous, CONTIGUOUS2=by_query.contiguous, LISTS1=key_lists(by_key),
                        LISTS2=key_lists(by_query), FWD_ORIENT=fwd_orient,
                        DQ_ATOMIC=dq_acc is not None))
    return [preprocess, grads]
