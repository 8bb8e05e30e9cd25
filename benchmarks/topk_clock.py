"""Where the top-k threshold kernel spends its time, read from the SM clock (CUDA only).

    python benchmarks/topk_clock.py [--shape 4,16,4096,128] [--topk 64,256] [--config 64x64x4x3t]

The rendered kernel is edited (textually; each edit asserts that its text is there once, so a
template change that moves it fails here instead of timing the wrong thing) to read %clock64 at
the borders of its phases, for every query tile a program takes, and to add the differences up
per program. Each reading waits on a value of the phase before it (a reduction of its result), so
a phase's own work is inside its interval; the compiler may still start the next phase's loads
early. The phases:
  sample      the sampled key blocks, their candidates kept in registers
  bracket     the bracket's search over the candidates
  capture     the pass over every key block: counts and captured scores
  select      the selection over the captured scores
  retries     the passes for rows whose bracket missed (0 when none did)
Cycles are summed over all programs and shown as shares of the whole; "ms" splits the shipped
kernel's median time (triton.testing.do_bench) by those shares. The instrumented kernel's own
time is shown too: the readings and their reductions cost a little.
"""

from __future__ import annotations

import argparse
import sys

import torch

import attngen
import attngen.kernels.forward as fwd
from attngen.render import load_module
from topk_configs import bench, parse_config, random_inputs  # benchmarks/ is on the path of its scripts

PHASES = ("sample", "bracket", "capture", "select", "retries")

CLOCK = '''

@triton.jit
def _clock(after):
    """%clock64, read once `after` (a value of the phase before) is known."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [after], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit(do_not_specialize=["batch", "heads", "q_len", "kv_len", "topk"'''

T = "        "  # the tile loop's body
EDITS = [
    ("\n\n@triton.jit(do_not_specialize=[\"batch\", \"heads\", \"q_len\", \"kv_len\", \"topk\"", CLOCK),
    ("    for tile in range(tl.program_id(0), n_m * n_bh, tl.num_programs(0)):\n",
     "    prof0 = 0.0\n    prof1 = 0.0\n    prof2 = 0.0\n    prof3 = 0.0\n    prof4 = 0.0\n    prof5 = 0.0\n"
     "    for tile in range(tl.program_id(0), n_m * n_bh, tl.num_programs(0)):\n" + T + "t_a = _clock(tile)\n"),
    (T + "    expect = topk * n_sampled / n_blocks.to(tl.float32)\n",
     T + "    t_s = _clock(tl.max(tl.max(c2, 1), 0).to(tl.int32, bitcast=True))\n"
     + T + "    prof0 += (t_s - t_a).to(tl.float32)\n" + T + "    expect = topk * n_sampled / n_blocks.to(tl.float32)\n"),
    (T + "# 3. capture:",
     T + "t_b = _clock(tl.max(lo, 0).to(tl.int32, bitcast=True))\n" + T + "prof1 += (t_b - t_a).to(tl.float32)\n"
     + T + "# 3. capture:"),
    (T + "# 4. select where",
     T + "t_c = _clock(tl.sum(n_in, 0))\n" + T + "prof2 += (t_c - t_b).to(tl.float32)\n" + T + "# 4. select where"),
    (T + "few = (ge_lo <= topk) & (lo == -FLT_MAX)",
     T + "t_d = _clock(tl.max(thr, 0).to(tl.int32, bitcast=True))\n" + T + "prof3 += (t_d - t_c).to(tl.float32)\n"
     + T + "few = (ge_lo <= topk) & (lo == -FLT_MAX)"),
    (T + "tl.store(THR + pid_bh * q_len + offs_m, thr, mask=valid)\n",
     T + "t_e = _clock(tl.max(thr, 0).to(tl.int32, bitcast=True))\n" + T + "prof4 += (t_e - t_d).to(tl.float32)\n"
     + T + "prof5 += (t_e - t_a).to(tl.float32)\n" + T + "tl.store(THR + pid_bh * q_len + offs_m, thr, mask=valid)\n"
     "    PROF = WORK + tl.program_id(0).to(tl.int64) * (BLOCK_M * (CAP_W + 3))\n"
     "    tl.store(PROF + 0, prof0)\n    tl.store(PROF + 1, prof1)\n    tl.store(PROF + 2, prof2)\n"
     "    tl.store(PROF + 3, prof3)\n    tl.store(PROF + 4, prof4)\n    tl.store(PROF + 5, prof5)\n"),
]


def instrumented(source: str) -> str:
    for old, new in EDITS:
        if source.count(old) != 1:
            raise SystemExit(f"expected the text once in the rendered kernel, found it {source.count(old)} times: "
                             f"{old!r}")
        source = source.replace(old, new)
    return source


def profile(thresholds: fwd.Thresholds, q, k) -> list[float]:
    """Cycles per phase (PHASES, then the whole tile loop), summed over the programs of one launch."""
    rows = torch.empty(thresholds.rows, dtype=torch.float32, device=q.device)
    work = torch.zeros(thresholds.work, dtype=torch.float32, device=q.device)
    kwargs = thresholds.tma if thresholds.tma is not None else thresholds.kwargs
    thresholds.kernel[thresholds.grid](q, k, rows, work, *q.stride(), *k.stride(), *thresholds.tail, **kwargs)
    torch.cuda.synchronize()
    per = work.view(thresholds.grid[0], -1)[:, :6].double().sum(0).tolist()
    p_sample, p_through_bracket, p_capture, p_select, p_retries, whole = per
    return [p_sample, p_through_bracket - p_sample, p_capture, p_select, p_retries, whole]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D")
    p.add_argument("--topk", default="64,256", help="comma-separated")
    p.add_argument("--config", default="64x64x4x3t", help="BLOCK_M x BLOCK_N x warps x stages; trailing t: TMA")
    args = p.parse_args()
    config = parse_config(args.config)
    q, k, v, shape, scale, env = random_inputs(args.shape, 2468)
    bound, structure = fwd.blocks(q, None, shape, config)
    module = load_module(instrumented(fwd.render_source(None)))
    print(f"{env}, config {args.config}")
    print("| k | kernel ms | instrumented ms | " + " | ".join(f"{name} share / ms" for name in PHASES) + " |")
    print("|---|---|---|" + "---|" * len(PHASES))
    for topk in (int(x) for x in args.topk.split(",")):
        ref = attngen.reference.attention(q[:1, :2], k[:1, :2], v[:1, :2], topk=topk)
        out = fwd.attention_forward(q, k, v, topk=topk, config=config)[0]
        error = float((out[:1, :2].double() - ref).norm() / ref.norm())
        if error > 1e-2:
            raise SystemExit(f"k={topk}: relative error {error:.1e} against the reference; not timing it")
        thresholds = fwd.Thresholds(q, k, bound, structure, shape, scale, topk, config)
        shipped = bench(lambda: thresholds.run(q, k))
        plain_kernel = thresholds.kernel
        thresholds.kernel = module.topk_threshold
        cycles = profile(thresholds, q, k)
        timed = bench(lambda: thresholds.run(q, k))
        thresholds.kernel = plain_kernel
        whole = cycles[-1]
        cells = " | ".join(f"{c / whole:.1%} / {shipped * c / whole:.3f}" for c in cycles[:-1])
        print(f"| {topk} | {shipped:.3f} | {timed:.3f} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
