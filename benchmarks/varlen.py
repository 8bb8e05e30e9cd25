"""Packed sequences on one GPU: attngen.varlen_attention against FlashAttention-2's varlen kernel
(through torch's aten._flash_attention_forward, the kernel behind SDPA's flash backend) and
FlexAttention's document mask over the same packing, causal inside each sequence.

    python benchmarks/varlen.py --out DIR [--total 16384] [--docs 8] [--heads 16] [--head-dim 128]

Sequence lengths: --docs random lengths (seed 0) summing to --total. Every method's output is
first compared with per-sequence float32 SDPA (math backend); the forward, and the forward +
backward (autograd.grad of the output with a fixed random gradient), are then timed with
triton.testing.do_bench medians. attngen and FlexAttention reuse their block classification
(a model's layers share one packing): built once, outside the timing, as FlexAttention's
create_block_mask is. attngen runs twice: deterministic (its default) and deterministic=False, whose
dQ is added with atomics as FA2's backward adds it (torch's default). Writes varlen.json into --out
and prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import attngen
from attngen.tools.timing import kernel_times


def lengths(total: int, docs: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(total - 1, generator=g)[:docs - 1].add(1).tolist())
    edges = [0] + cuts + [total]
    return [b - a for a, b in zip(edges, edges[1:])]


def profile(fns: dict, q, k, v, cu, lens, device):
    """Where a forward's time goes: GPU kernel time per kernel (torch.profiler) against the wall
    time, for each method; and attngen's host time per call, and attngen.attention's on the same
    packing written as a document mask on (1, H, total, D), and plain causal over all of it."""
    import time

    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    document = attngen.mask("document", doc_ids=doc) & attngen.mask("causal")
    packed = [x.transpose(0, 1)[None] for x in (q, k, v)]
    sequences = attngen.mask("sequences", q_seq=doc, kv_seq=doc) & attngen.mask("causal")  # no __local terms
    contiguous = [x.contiguous() for x in packed]
    fns = dict(fns, attngen_document=lambda q, k, v: attngen.attention(*packed, mask=document),
               attngen_document_contiguous=lambda q, k, v: attngen.attention(*contiguous, mask=document),
               attngen_causal_all=lambda q, k, v: attngen.attention(*contiguous, mask="causal"),
               attngen_sequences_and_global_causal=lambda q, k, v: attngen.attention(*packed, mask=sequences))
    for name, fn in fns.items():
        kernels = kernel_times(lambda: fn(q, k, v), calls=5)
        start = time.perf_counter()
        for _ in range(20):
            fn(q, k, v)
        host = (time.perf_counter() - start) / 20 * 1e3
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 20 * 1e3
        print(f"-- {name}: host {host:.3f} ms/call, wall {wall:.3f} ms/call, GPU kernels {sum(kernels.values()):.3f} ms:")
        for key, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]:
            print(f"     {ms:8.3f} ms  {key[:90]}")
    print(attngen.explain(*packed, mask=document))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--total", type=int, default=16384)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--profile", action="store_true",
                        help="also print each method's forward GPU kernels (torch.profiler) and attngen's host time per call")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device, dtype = "cuda", torch.bfloat16
    lens = lengths(args.total, args.docs)
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    t, h, d = args.total, args.heads, args.head_dim
    q, k, v = (torch.randn(t, h, d, device=device, dtype=dtype) for _ in range(3))
    grad = torch.randn_like(q)
    max_len = max(lens)

    # the reference: one float32 SDPA call per sequence
    ref = torch.cat([F.scaled_dot_product_attention(*(x[a:b].float().transpose(0, 1) for x in (q, k, v)),
                                                    is_causal=True).transpose(0, 1)
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])

    def fa2(q, k, v):
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False)[0]

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    block_mask = create_block_mask(lambda b, hh, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi), 1, 1, t, t, device=device)
    flex = torch.compile(flex_attention)

    def flex_fn(q, k, v):
        return flex(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=block_mask)[0].transpose(0, 1)

    def attngen_fn(q, k, v):
        return attngen.varlen_attention(q, k, v, cu, cu, max_len, max_len, mask="causal")

    def attngen_atomic(q, k, v):  # FA2's backward adds dQ with atomics too (torch's default, non-deterministic)
        return attngen.varlen_attention(q, k, v, cu, cu, max_len, max_len, mask="causal", deterministic=False)

    rows = []
    for name, fn in (("FA2 varlen (aten)", fa2), ("FlexAttention document", flex_fn), ("attngen varlen", attngen_fn),
                     ("attngen varlen, deterministic=False", attngen_atomic)):
        row = {"method": name}
        try:
            out = fn(q, k, v)
            row["rel_error"] = float((out.float() - ref).norm() / ref.norm())
            row["fwd_ms"] = triton.testing.do_bench(lambda: fn(q, k, v), return_mode="median")
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

            def step():
                return torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), grad)

            step()
            row["fwd_bwd_ms"] = triton.testing.do_bench(step, return_mode="median")
        except Exception as e:  # a method that cannot run here is reported, not hidden
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)

    if args.profile:
        profile(dict(fa2=fa2, flex=flex_fn, attngen=attngen_fn), q, k, v, cu, lens, device)

    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, python=sys.version.split()[0], total=t, heads=h, head_dim=d, dtype="bf16",
                lengths=lens, mask="causal inside each sequence")
    (args.out / "varlen.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"varlen: total {t}, {len(lens)} sequences {lens}, H={h}, D={d}, bf16, causal in each")
    print(f"{'method':36s} {'rel err':>9s} {'fwd ms':>8s} {'fwd+bwd ms':>11s}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:36s} {r['error']}")
        else:
            print(f"{r['method']:36s} {r['rel_error']:9.2e} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
