"""CPU overhead of one attngen.attention call against a raw launch of the same kernel.

    python benchmarks/overhead.py [--out DIR]

On a tiny shape (the GPU work takes a few microseconds) the host time per call is the overhead:
attngen.attention (input checks, the dispatcher's cached choice, the cached block structure,
output allocation, the launch) against `kernel[grid](*args)` with every argument prepared once,
and SDPA and compiled FlexAttention for reference. Each figure is the median over 7 rounds of
2000 back-to-back calls, timed on the host with a synchronize at the end of each round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attngen
from attngen import masks as masks_
from attngen.checks import check_qkv
from attngen.kernels.forward import blocks, launch_args, tma_eligible


def per_call_us(fn, calls=2000, rounds=7) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def raw_launch(q, k, v, mask):
    """The exact launch attngen.attention makes, with every argument prepared in advance."""
    shape = check_qkv(q, k, v, kernel=True)
    m = masks_.as_mask(mask)
    config = attngen.dispatch.choose(q, k, v, m).config
    bound, structure = blocks(q, m, shape, config)
    out = torch.empty_like(q)
    kernel, grid, args, kwargs = launch_args(q, k, v, out, None, bound, structure, shape, 1 / shape.head_dim ** 0.5,
                                             0, config, config.use_tma and tma_eligible(q, k, v))
    return lambda: kernel[grid](*args, **kwargs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rows = []
    for mask in (None, "causal"):
        block_mask = None if mask is None else create_block_mask(lambda b, h, i, j: j <= i, None, None, 128, 128)
        methods = {
            "attngen.attention": lambda: attngen.attention(q, k, v, mask=mask),
            "raw kernel launch": raw_launch(q, k, v, mask),
            "SDPA": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=mask is not None),
            "FlexAttention": lambda: flex(q, k, v, block_mask=block_mask),
        }
        for name, fn in methods.items():
            rows.append(dict(mask=mask or "none", method=name, us=per_call_us(fn)))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                                       rows=rows), indent=1))
    lines = ["| mask | method | µs per call |", "|---|---|---|"]
    lines += [f"| {r['mask']} | {r['method']} | {r['us']:.1f} |" for r in rows]
    for mask in ("none", "causal"):
        a = next(r["us"] for r in rows if r["mask"] == mask and r["method"] == "attngen.attention")
        b = next(r["us"] for r in rows if r["mask"] == mask and r["method"] == "raw kernel launch")
        lines.append(f"\n{mask}: attngen.attention costs {a - b:.1f} µs above the raw launch")
    (out / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
