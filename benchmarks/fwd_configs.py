"""The forward kernel under chosen configs, for training.py's mask cases: which fallback a mask should get.

    python benchmarks/fwd_configs.py [--shape 4,16,4096,128] [--masks document,sparse10] [--configs 128x64x4x2t,...]

A config is BLOCK_M x BLOCK_N x warps x stages, then `t` for tensor-descriptor loads and `w` for a
warp-specialized key loop (bwd_configs.parse_config). For each mask and config: the forward
checked against the float64 reference on batch 0, heads 0-1, then timed (triton.testing.do_bench
median) with its launch prepared once, as the tuner times it. The first line of each mask is the
sm90 fallback the dispatcher gives that mask. A config that fails to compile or run says why.
"""

from __future__ import annotations

import argparse
import sys

from bwd_configs import checked_ms, failure, inputs, parse_config
from training import case_masks, reference_output

import attngen
from attngen.families import FORWARD

DEFAULT_CONFIGS = "128x64x4x2t,64x64x4x2t,128x64x8x2t,64x128x4x2t,128x128x8x2t"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,4096,128")
    p.add_argument("--masks", default="document,sparse10,window512,prefix1024")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    args = p.parse_args()
    (b, h, s, d), (q, k, v, _) = inputs(args.shape)
    print("| mask | config | fwd ms | TFLOP/s | max rel. error |")
    print("|---|---|---|---|---|")
    for mask_name in args.masks.split(","):
        mask, _, _, topk = case_masks(mask_name, b, h, s, "cuda")
        if isinstance(mask, str):
            mask = attngen.masks.parse_spec(mask)
        refs = [reference_output(mask_name, q, k, v)[1].detach()]  # the output of batch 0, heads 0-1
        flops = FORWARD.flops(mask, b, h, s, s, d, "cuda")
        fallback = FORWARD.default("sm90", d, FORWARD.table(None, q.device, mask=mask))[0]
        for text in ["fallback", *args.configs.split(",")]:
            config = fallback if text == "fallback" else parse_config(text)
            label = f"fallback {fallback}" if text == "fallback" else text
            try:
                prepared = FORWARD.prepare(q, k, v, mask, topk=topk, config=config)
                error, ms = checked_ms(lambda: prepared(q, k, v), refs)
                print(f"| {mask_name} | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} | {error:.1e} |", flush=True)
            except Exception as e:  # out of resources and the like
                print(f"| {mask_name} | {label} | n/a | | {failure(e)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
