"""Top-k attention under chosen kernel configs and threshold-kernel settings: where the time goes.

    python benchmarks/topk_configs.py [--shape 4,16,4096,128] [--topk 64,256] [--mask causal]
                                      [--configs BMxBNxWxS,...] [--set sample=512,1024 ...]

`--set NAME=V1,V2` (repeatable) sweeps a field of attngen.kernels.topk.TopkTuning (sample, grid,
capture_programs, area_floats, ...; a tuple's values with colons, as in
threshold_tile=128:8:2,64:4:3): every combination of the values is run. For every
(k, combination, config) the output is first checked against the float64 reference (batch 0,
heads 0-1), then medians of triton.testing.do_bench: the threshold launches alone, each of their
kernels alone (launch_times), the attention kernel alone (with those thresholds), and the whole
call. The capture width follows from the sample (topk_sizes). A config is the attention
kernel's: the threshold kernels run at threshold_config(config) (on Hopper, their own tiles). A
config that fails to compile or run says why.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton

import dataclasses

import attngen
import attngen.kernels.forward as fwd
from attngen.checks import check_qkv
from attngen.config import KernelConfig
from attngen.kernels.forward import forward_launch
from attngen.kernels.topk import Thresholds, TopkTuning, topk_sizes

DEFAULT_CONFIGS = "128x64x4x2t,128x64x8x2t,128x128x8x2t,64x64x4x2t,64x64x4x3t"


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


KERNELS = ("topk_bracket", "topk_capture", "topk_select", "topk_threshold")


def launch_times(thresholds: Thresholds, q, k) -> tuple[dict[str, float], int, float]:
    """The median time of each kernel of a threshold call (the chunks of a kernel summed), each
    launch timed on its own after a whole call has filled the buffers, in the call's order (so
    topk_threshold sees the tiles topk_select flagged); the number of flagged tiles; and the
    scores in each row's bracket that the first capture pass counted, on average over the rows."""
    thr, lo, hi, area, counts, flags, work = thresholds.buffers(q.device)
    tensors = dict(Q=q, K=k, LO=lo, HI=hi, AREA=area, COUNTS=counts, FLAGS=flags, THR=thr,
                   MAXES=thr[thresholds.rows:], WORK=work)
    use_tma = thresholds.tma
    calls = [(launch.kernel.fn.__name__,
              lambda launch=launch, options=options, names=names: launch(options[use_tma],
                                                                         **{n: tensors[n] for n in names}))
             for launch, options, names in thresholds.launches]
    for _, call in calls:
        call()
    flagged = int(flags.sum())
    captured = float(counts[0::2].float().mean())
    times = dict.fromkeys(KERNELS, 0.0)
    for name, call in calls:
        times[name] += bench(call)
    return times, flagged, captured


def parse_value(text: str) -> int | float | tuple[int, ...]:
    """An integer, a float (margin=4.5), or a tuple of integers written with colons
    (threshold_tile=128:8:2)."""
    if ":" in text:
        return tuple(int(x) for x in text.split(":"))
    return float(text) if "." in text else int(text)


def parse_config(text: str) -> KernelConfig:
    """BLOCK_M x BLOCK_N x warps x stages, then t: with TMA, w: warp-specialized (e.g. 128x64x4x2t,
    128x128x8x2tw)."""
    flags = text[len(text.rstrip("tw")):]
    bm, bn, warps, stages = (int(x) for x in text.rstrip("tw").split("x"))
    return KernelConfig(bm, bn, warps, stages, use_tma="t" in flags, warp_specialize="w" in flags)


def random_inputs(shape_text: str, seed: int):
    """(q, k, v, checked shape, scale, a line naming GPU, versions and shape): fresh bf16 randn of B,H,S,D."""
    b, h, s, d = (int(x) for x in shape_text.split(","))
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    env = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, "
           f"B={b} H={h} S={s} D={d}")
    return q, k, v, check_qkv(q, k, v, kernel=True), d ** -0.5, env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D")
    p.add_argument("--topk", default="64,256")
    p.add_argument("--mask", default=None, help="a built-in mask name (causal, ...); none by default")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="BLOCK_M x BLOCK_N x warps x stages, comma-separated; then t: with TMA, w: warp-specialized")
    p.add_argument("--set", action="append", default=[], metavar="NAME=V1,V2",
                   help="a field of attngen.kernels.topk.TopkTuning and the values to sweep: integers, floats, "
                        "or tuples with colons (repeatable)")
    args = p.parse_args()
    sweeps = []
    fields = [f.name for f in dataclasses.fields(TopkTuning)]
    for text in args.set:
        name, _, values = text.partition("=")
        if name not in fields or not values:
            p.error(f"--set {text!r}: expected NAME=V1,V2 with NAME one of {', '.join(fields)}")
        sweeps.append((name, [parse_value(x) for x in values.split(",")]))
    q, k, v, shape, scale, env = random_inputs(args.shape, 4321)
    print(env + (f", mask {args.mask}" if args.mask else ", no mask"))
    print("| k | settings | config | capture | threshold ms | " + " | ".join(f"{name} ms" for name in KERNELS)
          + " | flagged tiles | captured a row | attention ms | total ms | rel. error |")
    print("|---|---|---|---|---|" + "---|" * len(KERNELS) + "---|---|---|---|---|")
    for topk in (int(x) for x in args.topk.split(",")):
        ref = attngen.reference.attention(q[:1, :2], k[:1, :2], v[:1, :2], mask=args.mask, topk=topk)
        for values in itertools.product(*(vals for _, vals in sweeps)):
            settings = " ".join(f"{name}={value}" for (name, _), value in zip(sweeps, values)) or "as shipped"
            tuning = TopkTuning(**{name: value for (name, _), value in zip(sweeps, values)})
            for text in args.configs.split(","):
                config = parse_config(text)
                cap = topk_sizes(topk, shape.kv_len, config.block_n, tuning).cap_w
                try:
                    run = lambda: fwd.attention_forward(q, k, v, args.mask, topk=topk, config=config,  # noqa: E731
                                                        tuning=tuning)[0]
                    out = run()
                    error = float((out[:1, :2].double() - ref).norm() / ref.norm())
                    bound, structure = fwd.blocks(q, attngen.masks.as_mask(args.mask), shape, config)
                    thresholds = Thresholds(q, k, bound, structure, shape, scale, topk, config, tuning)
                    thr = thresholds.run(q, k)
                    out = torch.empty_like(q)
                    attention = forward_launch(q, k, v, out, None, thr, bound, structure, shape, scale, config,
                                               config.use_tma)
                    t_thr = bench(lambda: thresholds.run(q, k))
                    t_att = bench(attention)
                    t_all = bench(run)
                    parts, flagged, captured = launch_times(thresholds, q, k)
                    cells = " | ".join(f"{parts[name]:.3f}" for name in KERNELS)
                    print(f"| {topk} | {settings} | {text} | {cap} | {t_thr:.3f} | {cells} | {flagged} | "
                          f"{captured:.0f} | {t_att:.3f} | {t_all:.3f} | {error:.1e} |", flush=True)
                except Exception as e:  # out of resources and the like
                    print(f"| {topk} | {settings} | {text} | {cap} | n/a | {' | ' * len(KERNELS)} | | | | "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:80]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
