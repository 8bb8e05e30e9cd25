"""Forward attention on one GPU: attngen next to SDPA's backends and FlexAttention, in one run.

    python benchmarks/forward.py --out DIR [--shape 4,16,4096,128] [--seq-lens 1024,4096,16384]
                                 [--dtypes bf16,fp16] [--masks none,causal,sliding_window,document]

Every method is first checked against the float64 reference on the same random inputs; then it
is timed with triton.testing.do_bench (median of repeated runs after warm-up; the three inputs
together are larger than the L2 at the default shape). attngen runs through the dispatcher, so
it uses the tuned registry when one is there (the `config` column says which entry). TFLOP/s
counts 4 * D FLOPs per visible (query, key) pair (attngen.tools.timing), so a causal mask counts about
half the pairs of a dense one. Writes forward.json and forward.md into --out, prints the table last.
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
from attngen.tools.timing import attention_flops

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


def inputs(shape, dtype):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(1234)
    return [torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g) for _ in range(3)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D (default 4,16,4096,128)")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--masks", default="none,causal,sliding_window,document")
    p.add_argument("--seq-lens", help="sequence lengths to run instead of the shape's S, e.g. 1024,4096,16384")
    p.add_argument("--out", default=".", help="folder for forward.json and forward.md")
    p.add_argument("--tag", default="", help="suffix of the output files: forward<TAG>.json / .md")
    args = p.parse_args()

    b, h, s0, d = [int(x) for x in args.shape.split(",")]
    seq_lens = [int(x) for x in args.seq_lens.split(",")] if args.seq_lens else [s0]
    env = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, attngen=attngen.__version__, shape=dict(B=b, H=h, D=d, S=seq_lens))
    flex = torch.compile(__import__("torch.nn.attention.flex_attention", fromlist=["x"]).flex_attention)
    rows = []
    for s, dtype_name, mask_name in [(s, t, m) for s in seq_lens for t in args.dtypes.split(",")
                                     for m in args.masks.split(",")]:
        dtype = DTYPES[dtype_name]
        q, k, v = inputs((b, h, s, d), dtype)
        case = mask_cases(b, s, "cuda")[mask_name]
        # the error is measured on batch 0, heads 0-1 (the float64 reference of the whole call does not fit at 16K)
        ref = attngen.reference.attention(q[:1, :2], k[:1, :2], v[:1, :2], mask=mask_cases(1, s, "cuda")[mask_name][0])
        flops = attention_flops(case[0], b, h, s, s, d, "cuda")
        for method, fn in methods(q, k, v, case, flex).items():
            row = dict(seq_len=s, dtype=dtype_name, mask=mask_name, method=method)
            try:
                row["error"] = rel_error(fn()[:1, :2], ref)
                row["ms"] = time_ms(fn)
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as e:  # a backend that refuses the shape: say so, keep going
                row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            if method == "attngen":
                row["config"] = attngen.explain(q, k, v, mask=case[0])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ref, q, k, v
        torch.cuda.empty_cache()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"forward{args.tag}.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    md = [f"{env['date']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, B={b} H={h} D={d}", "",
          "| S | dtype | mask | method | ms | TFLOP/s | rel. error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['seq_len']} | {r['dtype']} | {r['mask']} | {r['method']} |"
        if "skipped" in r:
            md.append(f"{head} n/a | n/a | {r['skipped']} |")
        else:
            md.append(f"{head} {r['ms']:.3f} | {r['tflops']:.0f} | {r['error']:.1e} |")
    (out / f"forward{args.tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
