"""The backward kernels under chosen configs: where the fallback configs of attngen/config.py come from.

    python benchmarks/bwd_configs.py [--shape 4,16,4096,128] [--masks none,causal] [--configs 32x128x4x3,...]

--masks takes benchmarks/training.py's case names (none, causal, window512, document, prefix1024,
sparse10, topk64, topk256; a mask case with top-k as `window512+topk64`): the same masks as there,
so the figures of both scripts compare. A
top-k case's backward runs at the config where attngen.kernels.backward.topk_config allows it (on
Hopper), and the config `threshold` times it at the threshold kernels' tiles in the forward's
orientation, the other choice of topk_config.

A config is BLOCK_M x BLOCK_N x warps x stages of the `bwd` family, a trailing `t` for
tensor-descriptor loads (dK/dV runs block_m x block_n tiles, dQ block_n x block_m;
attngen.kernels.backward.tiles). For each mask and config: the forward
at its fallback config and the backward at the config, checked against float64 autograd on batch
0, heads 0-1, then timed (triton.testing.do_bench median), with the forward alone timed once per
mask so that the backward's share is known. Both are timed as the tuner times them: launches
prepared once (attngen.families' `prepare`), so host work does not count where the kernels are
short (with --nondeterministic the backward's launches are built per call, host work included). A
config that fails to compile or run says why.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import torch
import triton

from training import case_masks, reference_grads

import attngen
from attngen.config import KernelConfig
from attngen.families import BACKWARD, FORWARD
from attngen.kernels import backward as backward_module
from attngen.kernels.topk import TopkTuning, threshold_config
from attngen.tools.timing import BWD_FACTOR

DEFAULT_CONFIGS = "32x128x4x3,32x128x4x2,64x128x8x2,32x64x4x3,64x64x4x2,16x128x4x3,64x128x4x2,32x128x8x3"


def parse_config(text: str) -> KernelConfig:
    """BLOCK_M x BLOCK_N x warps x stages, then `t` for tensor-descriptor (TMA) loads and `w` for a
    warp-specialized key loop (the forward's; with `t`): 64x64x4x2t, 128x128x4x2tw."""
    ws = text.endswith("tw")
    tma = ws or text.endswith("t")
    bm, bn, warps, stages = (int(x) for x in text.rstrip("tw").split("x"))
    return KernelConfig(bm, bn, warps, stages, use_tma=tma, warp_specialize=ws)


def inputs(shape: str, note: str = ""):
    """(B, H, S, D) and bf16 q, k, v, dout of the --shape text (a fixed seed), after a line naming the GPU,
    the versions, the shape and `note`."""
    b, h, s, d = (int(x) for x in shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(99)
    q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, "
          f"B={b} H={h} S={s} D={d}{note}")
    return (b, h, s, d), (q, k, v, dout)


def checked_ms(run, refs) -> tuple[float, float]:
    """(the largest relative error of run()'s outputs on batch 0, heads 0-1 against `refs`, float64;
    run's median ms)."""
    error = max(float((x[:1, :2].double() - r).norm() / r.norm()) for x, r in zip(run(), refs))
    return error, triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median")


def failure(e: Exception) -> str:
    """A table cell for a config that did not compile or run."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,4096,128")
    p.add_argument("--masks", default="none,causal")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--nondeterministic", action="store_true",
                   help="time the backward with deterministic=False (dQ added atomically by the dK/dV programs)")
    args = p.parse_args()
    (b, h, s, d), (q, k, v, dout) = inputs(args.shape, f", deterministic={not args.nondeterministic}")
    print("| mask | config | fwd+bwd ms | bwd ms (less the forward) | TFLOP/s fwd+bwd | max rel. error |")
    print("|---|---|---|---|---|---|")
    for mask_name in args.masks.split(","):
        mask, _, _, topk = case_masks(mask_name, b, h, s, "cuda")
        if mask_name == "dropout":
            raise SystemExit(f"--masks: {mask_name!r} is not a mask; expected one of none, causal, window512, "
                             "document, prefix1024, sparse10, topk64, topk256, or a mask case +topkK")
        if isinstance(mask, str):
            mask = attngen.masks.parse_spec(mask)
        refs = reference_grads(mask_name, q, k, v, dout)[1:]  # dQ, dK, dV of batch 0, heads 0-1
        flops = FORWARD.flops(mask, b, h, s, s, d, "cuda") * (1 + BWD_FACTOR)
        fwd_config = FORWARD.default("sm90", d)[0]
        fwd = FORWARD.prepare(q, k, v, mask, topk=topk, config=fwd_config)
        fwd_ms = triton.testing.do_bench(lambda: fwd(q, k, v), warmup=50, rep=200, return_mode="median")
        for text in args.configs.split(","):
            at_thresholds = text == "threshold"
            config = BACKWARD.default("sm90", d)[0] if at_thresholds else parse_config(text)
            # `threshold`: topk_config's other choice, for the call's plan (built in prepare)
            choice = mock.patch.object(backward_module, "topk_config", lambda c, f, device, *sizes: (
                threshold_config(f, device, TopkTuning()), True)) if at_thresholds else contextlib.nullcontext()
            try:
                if at_thresholds and (topk is None or args.nondeterministic):
                    raise ValueError("the config threshold is for top-k cases, deterministic")
                if args.nondeterministic:  # no prepared form: the launches are built per call
                    run = lambda: BACKWARD.run(q, k, v, dout, mask, topk=topk, config=config,  # noqa: E731
                                               deterministic=False)
                else:
                    with choice:
                        prepared = BACKWARD.prepare(q, k, v, dout, mask, topk=topk, config=config)
                    run = lambda: prepared(q, k, v, dout)  # noqa: E731
                error, ms = checked_ms(run, refs)
                print(f"| {mask_name} | {text} | {ms:.3f} | {ms - fwd_ms:.3f} | {flops / ms / 1e9:.0f} | {error:.1e} |",
                      flush=True)
            except Exception as e:  # out of resources and the like
                print(f"| {mask_name} | {text} | n/a | | | {failure(e)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
