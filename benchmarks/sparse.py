"""Block-sparse and top-k attention on one GPU, next to their baselines, in one run.

    python benchmarks/sparse.py --out DIR [--shape 4,16,128] [--seq-lens 4096,16384]
                                [--densities 1,0.5,0.25,0.1,0.05] [--topk 64,256] [--dtype bf16]

Block-sparse: a random layout of 128 x 128 blocks per head (each query block sees the given share
of key blocks), run by attngen.block_sparse through the dispatcher, next to the dense attngen
kernel and FlexAttention with the same block mask. TFLOP/s counts 4 * D FLOPs per visible pair.

Top-k: attngen.attention(..., topk=K) next to the straightforward torch code (scores, torch.topk,
mask, softmax, matmul), all at once and over 8 (batch, head) pairs at a time (the only way it runs
at S=16384); time and peak memory above the inputs. TFLOP/s counts the dense work
(4 * D per pair), as both methods must compute every score.

Every method is first checked against the float64 reference on batch 0, heads 0-1 (the reference
of the whole call does not fit), then timed with triton.testing.do_bench medians. Writes
sparse.json and sparse.md into --out and prints the table last.
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

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BLOCK = 128


def rel_error(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def time_ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def peak_mb(fn) -> float:
    """Peak memory of one call above what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def measure(row, fn, flops, ref_of):
    """Fill error, ms, TFLOP/s and peak memory of `row`; a method that fails says why."""
    try:
        row["error"] = ref_of(fn())
        row["ms"] = time_ms(fn)
        row["tflops"] = flops / row["ms"] / 1e9
        row["peak_mib"] = peak_mb(fn)
    except Exception as e:  # out of memory, a refused shape: say so and keep going
        row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def torch_topk(q, k, v, topk, scale):
    """The straightforward top-k attention: every score materialised."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    threshold = scores.topk(topk, dim=-1).values[..., -1:]
    scores = scores.masked_fill(scores < threshold, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def torch_topk_chunked(q, k, v, topk, scale, pairs=8):
    """torch_topk over `pairs` (batch, head) pairs at a time: the same code where all at once runs out."""
    b, h, s, d = q.shape
    flat = [t.reshape(b * h, 1, s, d) for t in (q, k, v)]
    outs = [torch_topk(*(t[i:i + pairs] for t in flat), topk, scale) for i in range(0, b * h, pairs)]
    return torch.cat(outs).reshape(b, h, s, d)


def block_sparse_rows(b, h, s, d, dtype, densities, flex):
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    rows = []
    dense_flops = 4 * d * b * h * s * s
    dense = dict(kind="block_sparse", seq_len=s, density=1.0, method="attngen dense", config=attngen.explain(q, k, v))
    ref_dense = attngen.reference.attention(q[:1, :2], k[:1, :2], v[:1, :2])
    rows.append(measure(dense, lambda: attngen.attention(q, k, v), dense_flops,
                        lambda out: rel_error(out[:1, :2], ref_dense)))
    del ref_dense
    for density in densities:
        layout = attngen.layouts.random(s, s, (BLOCK, BLOCK), density=density, seed=7, heads=h, device="cuda")
        mask = attngen.block_sparse(layout, (BLOCK, BLOCK))
        ref = attngen.reference.attention(q[:1, :2], k[:1, :2], v[:1, :2],
                                          mask=attngen.block_sparse(layout[:, :2], (BLOCK, BLOCK)))
        flops = 4 * d * b * int(layout.sum()) * BLOCK * BLOCK
        share = float(layout.float().mean())
        row = dict(kind="block_sparse", seq_len=s, density=share, method="attngen block_sparse",
                   config=attngen.explain(q, k, v, mask=mask))
        rows.append(measure(row, lambda: attngen.attention(q, k, v, mask=mask), flops,
                            lambda out: rel_error(out[:1, :2], ref)))
        lay = layout[0]
        block_mask = create_block_mask(lambda b_, h_, qi, ki: lay[h_, qi // BLOCK, ki // BLOCK], None, h, s, s,
                                       device="cuda", BLOCK_SIZE=BLOCK)
        rows.append(measure(dict(kind="block_sparse", seq_len=s, density=share, method="flex"),
                            lambda: flex(q, k, v, block_mask=block_mask), flops,
                            lambda out: rel_error(out[:1, :2], ref)))
        del ref, block_mask
        torch.cuda.empty_cache()
    return rows


def topk_rows(b, h, s, d, dtype, ks):
    g = torch.Generator(device="cuda").manual_seed(4321)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    scale = d ** -0.5
    flops = 4 * d * b * h * s * s
    rows = []
    for topk in ks:
        ref = attngen.reference.attention(q[:1, :2], k[:1, :2], v[:1, :2], topk=topk)
        check = lambda out: rel_error(out[:1, :2], ref)  # noqa: E731
        row = dict(kind="topk", seq_len=s, topk=topk, method="attngen", config=attngen.explain(q, k, v, topk=topk))
        rows.append(measure(row, lambda: attngen.attention(q, k, v, topk=topk), flops, check))
        rows.append(measure(dict(kind="topk", seq_len=s, topk=topk, method="torch (scores, topk, softmax)"),
                            lambda: torch_topk(q, k, v, topk, scale), flops, check))
        rows.append(measure(dict(kind="topk", seq_len=s, topk=topk, method="torch, 8 (batch, head) pairs at a time"),
                            lambda: torch_topk_chunked(q, k, v, topk, scale), flops, check))
        del ref
        torch.cuda.empty_cache()
    plain = dict(kind="topk", seq_len=s, topk=None, method="attngen (no top-k)")
    ref = attngen.reference.attention(q[:1, :2], k[:1, :2], v[:1, :2])
    rows.append(measure(plain, lambda: attngen.attention(q, k, v), flops, lambda out: rel_error(out[:1, :2], ref)))
    return rows


def markdown(env, rows) -> str:
    out = [f"{env['date']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['dtype']}, "
           f"B={env['B']} H={env['H']} D={env['D']}", "",
           "| kind | S | density / k | method | ms | TFLOP/s | peak MiB | rel. error |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        what = f"{r['density']:.3f}" if r["kind"] == "block_sparse" else str(r["topk"] or "-")
        head = f"| {r['kind']} | {r['seq_len']} | {what} | {r['method']} |"
        if "skipped" in r:
            out.append(f"{head} n/a | n/a | n/a | {r['skipped']} |")
        else:
            out.append(f"{head} {r['ms']:.3f} | {r['tflops']:.0f} | {r['peak_mib']:.0f} | {r['error']:.1e} |")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,128", help="B,H,D (default 4,16,128)")
    p.add_argument("--seq-lens", default="4096,16384")
    p.add_argument("--densities", default="1,0.5,0.25,0.1,0.05")
    p.add_argument("--topk", default="64,256", help="k values of the top-k runs ('' skips them)")
    p.add_argument("--topk-seq-lens", default="4096,16384")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--out", default=".")
    args = p.parse_args()
    b, h, d = (int(x) for x in args.shape.split(","))
    dtype = DTYPES[args.dtype]
    env = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, dtype=args.dtype, B=b, H=h, D=d)
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    rows = []
    densities = [float(x) for x in args.densities.split(",") if x]
    for s in (int(x) for x in args.seq_lens.split(",") if x):
        rows += block_sparse_rows(b, h, s, d, dtype, densities, flex)
    ks = [int(x) for x in args.topk.split(",") if x]
    if ks:
        for s in (int(x) for x in args.topk_seq_lens.split(",") if x):
            rows += topk_rows(b, h, s, d, dtype, ks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sparse.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    text = markdown(env, rows)
    (out / "sparse.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
