"""Dropout's cost: attngen.attention forward+backward at p=0 and at p (0.1) on one GPU, at chosen
backward configs, with each kernel's GPU time: how dropout generators and tiles were compared.

    python benchmarks/dropout.py [--shape 4,16,4096,128] [--p 0.1] [--bwd-configs 64x64x4x2,64x128x8x3]
                                 [--fwd-configs 128x64x4x2t,128x64x8x2t] [--no-rules] [--out DIR]

bf16, fresh torch.randn inputs and upstream gradient. A backward config (BLOCK_M x BLOCK_N x warps
x stages, a trailing `t` for tensor-descriptor loads) is set as the sm90 fallback of every
`bwd` table of attngen.config.DEFAULTS, and so is each forward config of --fwd-configs (every pair
of the two lists runs; without --fwd-configs the forward keeps its fallback); no registry is read, so the
fallbacks run, and the dispatcher's caches are cleared for each pair. `--no-rules` also turns off
the dispatcher's dropout rule (attngen.families.BACKWARD.fit_wide), so p=0 and p run at the very
same tiles. Each step is timed with triton.testing.do_bench medians, then profiled
(attngen.tools.timing.kernel_times). The dropout mask is checked against its reference elsewhere
(tests/kernels/test_backward.py); here only its time counts. Writes dropout.json into --out and
prints a table last. A/B of two generators: run it on the two trees.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton

import attngen
from attngen.config import DEFAULTS, default_config
from attngen.families import BACKWARD
from attngen.tools.timing import kernel_times
from bwd_configs import parse_config


def set_fallback(table: str, head_dim: int, config) -> None:
    """Make `config` the sm90 row of DEFAULTS[table] that serves `head_dim`."""
    rows = DEFAULTS[table]["sm90"]
    index = next(i for i, (max_d, _) in enumerate(rows) if head_dim <= max_d)
    rows[index] = (rows[index][0], config)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D")
    p.add_argument("--p", type=float, default=0.1, help="the dropout probability compared with 0")
    p.add_argument("--bwd-configs", default="64x64x4x2,64x128x8x3")
    p.add_argument("--fwd-configs", default="",
                   help="forward configs to pair with each backward config (default: the forward's fallback)")
    p.add_argument("--no-rules", action="store_true", help="no dropout rule: p runs at the same tiles as p=0")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split(","))
    if args.no_rules:
        object.__setattr__(BACKWARD, "fit_wide", lambda config, why: (config, ""))
    # no registry: its entries (tuned/h200.yaml has dense bf16 D 128 ones) would win over the configs set here
    attngen.dispatch.registry_paths = lambda: []
    g = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(b, h, s, d, device="cuda", generator=g).to(torch.bfloat16)
    rows = []
    bwd_tables = [name for name in DEFAULTS if name.startswith("bwd")]  # "bwd_dense" serves this dense call
    fwd_fallback = default_config("fwd", "sm90", d)
    fwd_texts = args.fwd_configs.split(",") if args.fwd_configs else [None]
    for fwd_text, text in ((f, b_) for f in fwd_texts for b_ in args.bwd_configs.split(",")):
        set_fallback("fwd", d, parse_config(fwd_text) if fwd_text else fwd_fallback)
        for table in bwd_tables:
            set_fallback(table, d, parse_config(text))
        attngen.dispatch.use_registry(None)  # clears the dispatcher's choices and the prepared plans
        for prob in (0.0, args.p):
            def step(prob=prob):
                out = attngen.attention(q, k, v, dropout_p=prob)
                return torch.autograd.grad(out, (q, k, v), dout)
            step()
            ms = float(triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median"))
            row = dict(fwd_config=fwd_text or "fallback", bwd_config=text, p=prob, ms=ms, kernels_ms=kernel_times(step, calls=10))
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, shape=dict(B=b, H=h, S=s, D=d), rules=not args.no_rules)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dropout.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1) + "\n")
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, bf16, B={b} H={h} S={s} D={d}, "
          f"dropout rules {'on' if env['rules'] else 'off'}")
    print("| forward config | backward config | p | ms | forward | dK/dV and dQ |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        kt = r["kernels_ms"]
        print(f"| {r['fwd_config']} | {r['bwd_config']} | {r['p']} | {r['ms']:.3f} | {kt.get('attention_fwd', 0):.3f} | "
              f"{kt.get('attention_bwd', 0):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
