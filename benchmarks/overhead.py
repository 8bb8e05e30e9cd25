"""CPU overhead of one attngen.attention call against a raw launch of the same kernel.

    python benchmarks/overhead.py [--out DIR]

On a tiny shape (the GPU work takes a few microseconds) the host time per call is the overhead:
attngen.attention (input checks, the dispatcher's cached choice, the cached block structure,
output allocation, the launch) against `kernel[grid](*args)` with every argument prepared once,
and SDPA and compiled FlexAttention for reference. Each figure is the median over 21 rounds of
1000 back-to-back calls, timed on the host with a synchronize at the end of each round; the
methods take turns within each round, and the overhead is the median of the per-round
differences between attngen.attention and the raw launch (the host's speed drifts between rounds).
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
from attngen.kernels.forward import blocks, forward_launch
from attngen.kernels.launch import tma_eligible


def per_call_us(methods: dict, calls=1000, rounds=21) -> dict:
    """name -> per-call µs of each round; the methods take turns within every round, so a slow
    stretch of the host hits all of them alike (compare them round by round)."""
    for fn in methods.values():
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return times


def raw_launch(q, k, v, mask):
    """The exact launch attngen.attention makes, with every argument prepared in advance."""
    shape = check_qkv(q, k, v, kernel=True)
    m = masks_.as_mask(mask)
    config = attngen.dispatch.choose(q, k, v, m).config
    bound, structure = blocks(q, m, shape, config)
    out = torch.empty_like(q)
    launch = forward_launch(q, k, v, out, None, None, bound, structure, shape, 1 / shape.head_dim ** 0.5, config,
                            config.use_tma and tma_eligible(q, k, v))
    kernel, values, options = launch.kernel[launch.grid], launch.values, launch.options
    return lambda: kernel(*values, **options)


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
        times = per_call_us(methods)
        for name, us in times.items():
            rows.append(dict(mask=mask or "none", method=name, us=statistics.median(us), rounds=us))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "rounds"}), flush=True)
        extra = [a - b for a, b in zip(times["attngen.attention"], times["raw kernel launch"])]
        rows.append(dict(mask=mask or "none", method="attngen.attention - raw launch, same round",
                         us=statistics.median(extra), low=min(extra), high=max(extra)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                                       rows=rows), indent=1))
    lines = ["| mask | method | µs per call |", "|---|---|---|"]
    lines += [f"| {r['mask']} | {r['method']} | {r['us']:.1f} |" for r in rows]
    for r in rows:
        if "low" in r:
            lines.append(f"\n{r['mask']}: attngen.attention costs {r['us']:.1f} µs above the raw launch (median of "
                         f"the per-round differences; {r['low']:.1f} to {r['high']:.1f} over the rounds)")
    (out / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
