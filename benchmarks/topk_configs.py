"""Top-k attention under chosen kernel configs: how tile shapes change the top-k pass.

    python benchmarks/topk_configs.py [--shape 4,16,4096,128] [--topk 64,256] [--configs BMxBNxWxS,...]

Each config is first checked against the float64 reference (batch 0, heads 0-1), then timed with
triton.testing.do_bench (median). A config that fails to compile or run says why.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

import attngen
from attngen.config import KernelConfig
from attngen.kernels.forward import attention_forward

DEFAULT_CONFIGS = "16x64x4x2,32x64x4x2,16x128x4x1,32x128x4x1,16x256x4x1,32x256x4x1,32x256x8x1,64x256x8x1,64x64x4x2"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D")
    p.add_argument("--topk", default="64,256")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="BLOCK_M x BLOCK_N x warps x stages, comma-separated")
    args = p.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(4321)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, "
          f"B={b} H={h} S={s} D={d}")
    print("| k | config | ms | rel. error |\n|---|---|---|---|")
    for topk in (int(x) for x in args.topk.split(",")):
        ref = attngen.reference.attention(q[:1, :2], k[:1, :2], v[:1, :2], topk=topk)
        for text in args.configs.split(","):
            bm, bn, warps, stages = (int(x) for x in text.split("x"))
            config = KernelConfig(bm, bn, warps, stages)
            run = lambda: attention_forward(q, k, v, topk=topk, config=config)[0]  # noqa: E731
            try:
                out = run()
                error = float((out[:1, :2].double() - ref).norm() / ref.norm())
                ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
                print(f"| {topk} | {text} | {ms:.3f} | {error:.1e} |", flush=True)
            except Exception as e:  # out of resources and the like
                print(f"| {topk} | {text} | n/a | {type(e).__name__}: {str(e).splitlines()[0][:80]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
