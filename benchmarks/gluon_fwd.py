"""A probe, not part of attngen: an attention forward for Hopper written in Gluon (triton 3.6's
explicit language: wgmma, TMA and mbarriers by hand), to find out whether it beats the Triton forward.

Why: the Triton forward waits for each wgmma right after issuing it (triton 3.6 keeps one in flight
only when its result is the next dot's accumulator; docs/journal/backward.md), and its automatic
warp specialization hung or returned wrong outputs (docs/journal/backward.md, runs 148-150). Gluon
issues the wgmmas asynchronously itself. In this kernel, the scores of key block j are computed
while P V of block j-1 runs, and the softmax of block j overlaps that P V (the order FlashAttention-3
calls intra-warpgroup pipelining). K and V come through a ring of STAGES shared-memory slots filled
by TMA.

Scope: bf16 or fp16, contiguous (B, H, S, D) inputs, dense or causal, S a multiple of BLOCK_M and
BLOCK_N (causal: BLOCK_M a multiple of BLOCK_N), D 64 or 128; output only (no LSE, no backward).

    python benchmarks/gluon_fwd.py --compile          # any machine: compile for sm_90, print usage
    python benchmarks/gluon_fwd.py --out DIR          # a Hopper GPU: check, then time A B B A

On the GPU each config is first checked in a process of its own (--check-only, --check-timeout), so
that a kernel that hangs costs its timeout and not the whole run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, row, slot, pred):
    """Start the TMA loads of one key block's K and V rows into ring slot `slot`."""
    mbarrier.expect(k_bar.index(slot), k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, 0], k_bar.index(slot), k_smem.index(slot), pred=pred)
    mbarrier.expect(v_bar.index(slot), v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, 0], v_bar.index(slot), v_smem.index(slot), pred=pred)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, offs_m, start_n, MASKED: gl.constexpr):
    """Online softmax of one block of scores (keys start_n on; MASKED: causal, each query row
    sees the keys up to its own index): (weights, rescale factor of earlier sums, m, l)."""
    if MASKED:
        cols = start_n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(gl.expand_dims(offs_m, 1) >= gl.expand_dims(cols, 0), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _step(j, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, row0, n_blocks, p, m_i, l_i, acc, s_init,
          offs_m, qk_scale, STAGES: gl.constexpr, MASKED: gl.constexpr):
    """Key block j: its scores and P V of block j - 1 in flight together, block j's softmax while
    P V runs, then block j - 1 + STAGES's loads into the freed ring slot."""
    BLOCK_N: gl.constexpr = s_init.shape[1]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    rows_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    slot = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(k_bar.index(slot), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_init, use_acc=False, is_async=True)
    mbarrier.wait(v_bar.index(prev), ((j - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok,))
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, j * BLOCK_N, MASKED)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
    nxt = j - 1 + STAGES
    _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, row0 + nxt * BLOCK_N, prev, nxt < n_blocks)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)
    return p, m_i, l_i, acc


@gluon.jit
def attention_fwd_gluon(q_desc, k_desc, v_desc, o_desc, seq_len, qk_scale,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    num_warps: gl.constexpr = gl.num_warps()
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # causal: the longest query blocks start first
    pid_bh = gl.program_id(1)
    row0 = pid_bh * seq_len  # this (batch, head)'s first row in the (B * H * S, D) views
    off_m = row0 + pid_m * BLOCK_M

    # wgmma accumulators: the scores (BLOCK_M x BLOCK_N) and the output (BLOCK_M x HEAD_DIM), rows
    # spread over the warps; the weights go into the second wgmma from registers
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)

    # the key blocks: causal, those left of the query block's first row (n_full), then those the
    # diagonal crosses (BLOCK_M is a multiple of BLOCK_N: BLOCK_M / BLOCK_N of them)
    if CAUSAL:
        n_full = pid_m * (BLOCK_M // BLOCK_N)
        n_blocks = n_full + BLOCK_M // BLOCK_N
    else:
        n_full = seq_len // BLOCK_N
        n_blocks = n_full
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [off_m, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, row0 + i * BLOCK_N, i, i < n_blocks)

    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, rows_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    # block 0: its scores, then its weights (masked where the query block is the first)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_init, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    if CAUSAL:
        if n_full == 0:
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, 0, True)
        else:
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, 0, False)
    else:
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, offs_m, 0, False)
    for j in range(1, n_full):
        p, m_i, l_i, acc = _step(j, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, row0, n_blocks, p, m_i,
                                 l_i, acc, s_init, offs_m, qk_scale, STAGES, False)
    if CAUSAL:
        for j in range(gl.maximum(n_full, 1), n_blocks):
            p, m_i, l_i, acc = _step(j, q_smem, k_smem, v_smem, k_bar, v_bar, k_desc, v_desc, row0, n_blocks, p,
                                     m_i, l_i, acc, s_init, offs_m, qk_scale, STAGES, True)
    # P V of the last block
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_bar.index(last), ((n_blocks - 1) // STAGES) & 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))
    out = acc / gl.expand_dims(gl.convert_layout(l_i, rows_o), 1)
    o_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], o_desc.layout)
    o_smem.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [off_m, 0], o_smem)
    tma.store_wait(0)


def descriptors(q, k, v, out, block_m: int, block_n: int):
    """TMA descriptors over the (B * H * S, D) views of contiguous (B, H, S, D) tensors."""
    d = q.shape[-1]
    gl_dtype = GL_DTYPES[q.dtype]
    rows_m = gl.NVMMASharedLayout.get_default_for([block_m, d], gl_dtype)
    rows_n = gl.NVMMASharedLayout.get_default_for([block_n, d], gl_dtype)
    flat = [t.reshape(-1, d) for t in (q, k, v, out)]
    return (TensorDescriptor(flat[0], list(flat[0].shape), list(flat[0].stride()), [block_m, d], rows_m),
            TensorDescriptor(flat[1], list(flat[1].shape), list(flat[1].stride()), [block_n, d], rows_n),
            TensorDescriptor(flat[2], list(flat[2].shape), list(flat[2].stride()), [block_n, d], rows_n),
            TensorDescriptor(flat[3], list(flat[3].shape), list(flat[3].stride()), [block_m, d], rows_m))


def check_inputs(q, k, v, block_m: int, block_n: int):
    if q.dtype not in GL_DTYPES or not (q.shape == k.shape == v.shape) or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must be bf16 or fp16 of one shape, got {q.dtype} {tuple(q.shape)}, "
                         f"{k.dtype} {tuple(k.shape)}, {v.dtype} {tuple(v.shape)}")
    if not all(t.is_contiguous() for t in (q, k, v)):
        raise ValueError("q, k, v must be contiguous")
    s, d = q.shape[2], q.shape[3]
    if s % block_m or s % block_n or d not in (64, 128):
        raise ValueError(f"S={s} must be a multiple of {block_m} and {block_n}, and D={d} 64 or 128")


def attention(q, k, v, block_m: int = 128, block_n: int = 128, stages: int = 2, num_warps: int = 8,
              causal: bool = False, out=None):
    """Softmax(q k^T / sqrt(D)) v for (B, H, S, D) inputs (causal: each query sees the keys up to its
    own index); into `out` when given (contiguous, like q)."""
    check_inputs(q, k, v, block_m, block_n)
    if causal and block_m % block_n:
        raise ValueError(f"causal needs block_m a multiple of block_n, got {block_m} and {block_n}")
    b, h, s, d = q.shape
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape {tuple(q.shape)}")
    grid = (s // block_m, b * h)
    attention_fwd_gluon[grid](*descriptors(q, k, v, out, block_m, block_n), s, d ** -0.5 * LOG2E,
                              block_m, block_n, d, stages, causal, num_warps=num_warps)
    return out


def compile_sm90(block_m: int, block_n: int, stages: int, num_warps: int, causal: bool, d: int = 128):
    """Compile the kernel for sm_90 on any machine (CPU tensors stand in for the GPU's); returns the
    compiled kernel and (registers, spill bytes, SASS instructions)."""
    from attngen.kernels.launch import Launch
    from attngen.tools.cross_compile import compile_launch, usage

    q = torch.empty(1, 2, 4 * block_m, d, dtype=torch.bfloat16)
    args = dict(zip(("q_desc", "k_desc", "v_desc", "o_desc"), descriptors(q, q, q, q, block_m, block_n)))
    args.update(seq_len=4 * block_m, qk_scale=0.1, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages,
                CAUSAL=causal)
    # num_warps: a launch option, which the kernel reads with gl.num_warps()
    compiled = compile_launch(Launch(attention_fwd_gluon, (1,), args, dict(num_warps=num_warps)))
    return compiled, usage(compiled)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile", action="store_true", help="only compile for sm_90 and print shared memory, "
                   "registers and spills of each config")
    p.add_argument("--configs", default="128x128x2x8,128x64x2x8,128x64x3x8",
                   help="BLOCK_M x BLOCK_N x STAGES x WARPS, comma-separated")
    p.add_argument("--cases", default="none,causal", help="none (dense), causal, or both")
    p.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D")
    p.add_argument("--out", default=".")
    p.add_argument("--check-only", action="store_true",
                   help="only check the gluon configs against float64 and exit 1 if one fails; the GPU run first "
                        "does this for each config in a process of its own, so that a kernel that hangs (a wrong "
                        "mbarrier phase) costs its timeout, not the run")
    p.add_argument("--check-timeout", type=float, default=120.0, help="seconds a --check-only process may take")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: Gluon kernels are compiled, Triton's interpreter does not run them")
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    cases = args.cases.split(",")
    if not set(cases) <= {"none", "causal"}:
        p.error(f"--cases must name none and/or causal, got {args.cases!r}")
    if args.compile:
        for case in cases:
            for bm, bn, st, w in configs:
                try:
                    compiled, (regs, spills, sass) = compile_sm90(bm, bn, st, w, case == "causal")
                    print(f"ok {case} {bm}x{bn} s{st} w{w}: shared {compiled.metadata.shared} B, {regs} registers, "
                          f"{spills} B spilled, {sass} SASS instructions")
                except Exception as e:  # report each config, go on
                    print(f"failed {case} {bm}x{bn} s{st} w{w}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return 0
    return run_gpu(args, configs, cases)


def isolated_check(args, config, case) -> str | None:
    """Check one config in a process of its own; None if it passed, else why not."""
    import subprocess

    cmd = [sys.executable, __file__, "--check-only", "--configs", "x".join(map(str, config)), "--cases", case,
           "--shape", args.shape]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.check_timeout)
    except subprocess.TimeoutExpired:
        return f"no result in {args.check_timeout:.0f} s (a hang?)"
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines()
        return f"exit {done.returncode}: {lines[-1][:200] if lines else ''}"
    return None


def run_gpu(args, configs, cases) -> int:
    import attngen
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, s, d = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    rows = []
    for case in cases:
        causal = case == "causal"
        ref = attngen.reference.attention(*(t[:1, :2].double() for t in (q, k, v)), mask="causal" if causal else None)
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)

        def cudnn(causal=causal):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        methods = {"sdpa_cudnn": cudnn,
                   "attngen": lambda causal=causal: attngen.attention(q, k, v, mask="causal" if causal else None)}
        gluon_configs = {f"gluon {bm}x{bn} s{st} w{w}": (bm, bn, st, w) for bm, bn, st, w in configs}
        for name, config in gluon_configs.items():
            methods[name] = lambda config=config, causal=causal: attention(q, k, v, *config, causal=causal)
        working, case_rows = {}, []
        for name, fn in methods.items():
            row = dict(case=case, method=name)
            if args.check_only and name not in gluon_configs:
                continue
            why = isolated_check(args, gluon_configs[name], case) if (
                name in gluon_configs and not args.check_only) else None
            if why is not None:
                row["skipped"] = why
                case_rows.append(row)
                continue
            try:
                if name in gluon_configs:  # into a poisoned output: the kernel must write every element
                    out = attention(q, k, v, *gluon_configs[name], causal=causal,
                                    out=torch.full_like(q, float("nan")))
                else:
                    out = fn()
                torch.cuda.synchronize()
                err = float((out[:1, :2].double() - ref).norm() / ref.norm())
                row["error"] = err
                if math.isfinite(err) and err <= 1e-2:
                    working[name] = fn
                else:
                    row["skipped"] = f"wrong output: relative error {err:.3g}"
            except Exception as e:  # a config that fails to compile or launch: say so, go on
                row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            case_rows.append(row)
        if args.check_only:
            for row in case_rows:
                print(json.dumps(row))
            if any("skipped" in row for row in case_rows):
                return 1
            continue
        times = {name: [] for name in working}
        for order in (list(working), list(reversed(working))):  # A B B A
            for name in order:
                times[name].append(float(triton.testing.do_bench(working[name], warmup=50, rep=300,
                                                                 return_mode="median")))
        for row in case_rows:
            if row["method"] in times:
                row["ms"] = times[row["method"]]
                row["tflops"] = flops / min(row["ms"]) / 1e9
        rows += case_rows
    if args.check_only:
        return 0
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               shape=dict(B=b, H=h, S=s, D=d), dtype="bf16")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gluon_fwd.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, bf16 B={b} H={h} S={s} D={d}, forward")
    print("| case | method | ms (A B B A order, 2 rounds) | TFLOP/s | max rel. error |")
    print("|---|---|---|---|---|")
    for row in rows:
        if "skipped" in row:
            print(f"| {row['case']} | {row['method']} | n/a | n/a | {row['skipped']} |")
        else:
            print(f"| {row['case']} | {row['method']} | {' / '.join(f'{t:.3f}' for t in row['ms'])} | "
                  f"{row['tflops']:.0f} | {row['error']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
