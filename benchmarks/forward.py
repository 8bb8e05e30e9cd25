"""Forward attention on one GPU: attngen next to SDPA's backends and FlexAttention, in one run.

    python benchmarks/forward.py --out DIR [--shape 4,16,4096,128] [--dtypes bf16,fp16]
                                 [--masks none,causal,sliding_window,document] [--sweep]

Every method is first checked against the float64 reference on the same random inputs; then it
is timed with triton.testing.do_bench (median of repeated runs after warm-up; the three inputs
together are larger than the L2). TFLOP/s counts 4 * D FLOPs per visible (query, key) pair, so
a causal mask counts about half the pairs of a dense one. --sweep also times a grid of kernel
configs (compiled first in parallel child processes, so a compiler crash costs only that config).
Writes forward.json and forward.md into --out and prints the tables last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import attngen
from attngen import masks as masks_
from attngen.config import KernelConfig
from attngen.kernels.forward import attention_forward

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def doc_ids(batch, seq, device):
    """Packed documents of random lengths between 256 and 2048 tokens (fixed seed)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.empty(batch, seq, dtype=torch.int64)
    for b in range(batch):
        pos, doc = 0, 0
        while pos < seq:
            n = int(torch.randint(256, 2049, (1,), generator=g))
            ids[b, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return ids.to(device)


def mask_cases(batch, seq, device):
    """name -> (attngen mask, FlexAttention mask_mod or None for dense, SDPA kwargs or None)."""
    ids = doc_ids(batch, seq, device)
    window = 1024
    return {
        "none": (None, None, {}),
        "causal": ("causal", lambda b, h, q, kv: kv <= q, {"is_causal": True}),
        "sliding_window": (attngen.mask("sliding_window", window=window),
                           lambda b, h, q, kv: (kv <= q) & (q - kv < window), None),
        "document": (attngen.mask("document", doc_ids=ids) & attngen.mask("causal"),
                     lambda b, h, q, kv: (ids[b, q] == ids[b, kv]) & (kv <= q), None),
    }


def visible_pairs(mask, batch, heads, q_len, kv_len, device) -> int:
    """Number of visible (query, key) pairs over all batches and heads (counted in query chunks)."""
    m = masks_.as_mask(mask)
    if m is None or m.tree is None:
        return batch * heads * q_len * kv_len
    bound = masks_.bind(m, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, device=device)
    total = 0
    for start in range(0, q_len, 512):
        q = torch.arange(start, min(q_len, start + 512), device=device)
        env = dict(b=torch.arange(batch, device=device).view(-1, 1, 1, 1),
                   h=torch.arange(heads, device=device).view(1, -1, 1, 1), q_idx=q.view(1, 1, -1, 1),
                   kv_idx=torch.arange(kv_len, device=device).view(1, 1, 1, -1), q_len=q_len, kv_len=kv_len,
                   batch=batch, heads=heads)
        total += int(masks_.evaluate_visible(bound, env).expand(batch, heads, q.numel(), kv_len).sum())
    return total


def rel_error(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def methods(q, k, v, case, flex):
    """name -> zero-argument function, for the methods that can run this case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask, mask_mod, sdpa_kwargs = case
    out = {"attngen": lambda: attngen.attention(q, k, v, mask=mask)}
    if sdpa_kwargs is not None:
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
            out[name] = run
    block_mask = None
    if mask_mod is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    out["flex"] = lambda: flex(q, k, v, block_mask=block_mask)
    return out


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


# ---------------------------------------------------------------------------------------
# config sweep: compile in child processes, then check and time here
# ---------------------------------------------------------------------------------------
def sweep_configs() -> list[KernelConfig]:
    """A small grid around what worked on Hopper (tiles 128x128 / 128x64, TMA, warp specialization)."""
    grid = [  # block_m, block_n, warps, stages, tma, ws
        (128, 128, 4, 2, True, False), (128, 128, 8, 2, True, False), (128, 128, 8, 3, True, False),
        (128, 64, 4, 2, True, False), (128, 64, 4, 3, True, False), (128, 64, 8, 2, True, False),
        (64, 64, 4, 3, True, False), (64, 128, 4, 2, True, False),
        (128, 128, 4, 2, False, False), (128, 64, 4, 2, False, False),
        (128, 128, 4, 2, True, True), (128, 64, 4, 2, True, True),
    ]
    return [KernelConfig(bm, bn, w, s, use_tma=t, warp_specialize=ws) for bm, bn, w, s, t, ws in grid]


def compile_one(spec: str) -> None:
    """Child process: run one config once so Triton's disk cache holds it."""
    s = json.loads(spec)
    q, k, v = inputs(s["shape"], DTYPES[s["dtype"]])
    case = mask_cases(s["shape"][0], s["shape"][2], "cuda")[s["mask"]]
    attention_forward(q, k, v, case[0], config=KernelConfig(**s["config"]))
    torch.cuda.synchronize()


def precompile(configs, shape, dtype, mask, jobs=8, timeout=300) -> dict:
    """config -> None if it compiled and ran, else the reason it did not."""
    def one(config):
        spec = json.dumps(dict(shape=shape, dtype=dtype, mask=mask, config=config.as_dict()))
        try:
            r = subprocess.run([sys.executable, __file__, "--compile-one", spec], capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            return config, f"compile timed out after {timeout}s"
        if r.returncode != 0:
            lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
            return config, f"exit {r.returncode}: {lines[-1][:160] if lines else ''}"
        return config, None

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        return dict(pool.map(one, configs))


def inputs(shape, dtype):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(1234)
    return [torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g) for _ in range(3)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D (default 4,16,4096,128)")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--masks", default="none,causal,sliding_window,document")
    p.add_argument("--sweep", action="store_true", help="also time a grid of kernel configs (bf16, none and causal)")
    p.add_argument("--out", default=".", help="folder for forward.json and forward.md")
    p.add_argument("--compile-one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.compile_one:
        compile_one(args.compile_one)
        return 0

    shape = [int(x) for x in args.shape.split(",")]
    b, h, s, d = shape
    env = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, attngen=attngen.__version__, shape=dict(B=b, H=h, S=s, D=d))
    flex = torch.compile(__import__("torch.nn.attention.flex_attention", fromlist=["x"]).flex_attention)
    rows, sweep_rows = [], []
    cases = mask_cases(b, s, "cuda")
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        q, k, v = inputs(shape, dtype)
        for mask_name in args.masks.split(","):
            case = cases[mask_name]
            ref = attngen.reference.attention(q, k, v, mask=case[0])
            flops = 4 * d * visible_pairs(case[0], b, h, s, s, "cuda")
            for method, fn in methods(q, k, v, case, flex).items():
                row = dict(dtype=dtype_name, mask=mask_name, method=method)
                try:
                    row["error"] = rel_error(fn(), ref)
                    row["ms"] = time_ms(fn)
                    row["tflops"] = flops / row["ms"] / 1e9
                except Exception as e:  # a backend that refuses the shape: say so, keep going
                    row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                if method == "attngen":
                    row["config"] = attngen.explain(q, k, v, mask=case[0])
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.sweep and dtype_name == "bf16" and mask_name in ("none", "causal"):
                configs = sweep_configs()
                status = precompile(configs, shape, dtype_name, mask_name)
                for config in configs:
                    row = dict(mask=mask_name, config=config.as_dict())
                    if status[config] is not None:
                        row["skipped"] = status[config]
                    else:
                        fn = lambda: attention_forward(q, k, v, case[0], config=config)[0]  # noqa: E731
                        row["error"] = rel_error(fn(), ref)
                        if row["error"] > 2e-2 or math.isnan(row["error"]):
                            row["skipped"] = f"wrong result (relative error {row['error']:.2e})"
                        else:
                            row["ms"] = time_ms(fn)
                            row["tflops"] = flops / row["ms"] / 1e9
                    sweep_rows.append(row)
                    print(json.dumps(row), flush=True)
            del ref
            torch.cuda.empty_cache()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "forward.json").write_text(json.dumps(dict(env=env, rows=rows, sweep=sweep_rows), indent=1))
    md = [f"{env['date']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, B={b} H={h} S={s} D={d}", "",
          "| dtype | mask | method | ms | TFLOP/s | rel. error |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            md.append(f"| {r['dtype']} | {r['mask']} | {r['method']} | n/a | n/a | {r['skipped']} |")
        else:
            md.append(f"| {r['dtype']} | {r['mask']} | {r['method']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                      f"{r['error']:.1e} |")
    if sweep_rows:
        md += ["", "| mask | BLOCK_M | BLOCK_N | warps | stages | TMA | WS | ms | TFLOP/s | note |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(sweep_rows, key=lambda r: (r["mask"], -r.get("tflops", 0))):
            c = r["config"]
            head = (f"| {r['mask']} | {c['block_m']} | {c['block_n']} | {c['num_warps']} | {c['num_stages']} | "
                    f"{c['use_tma']} | {c['warp_specialize']} |")
            if "skipped" in r:
                md.append(f"{head} n/a | n/a | {r['skipped']} |")
            else:
                md.append(f"{head} {r['ms']:.3f} | {r['tflops']:.0f} | |")
    (out / "forward.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
