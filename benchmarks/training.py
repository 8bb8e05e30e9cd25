"""Forward + backward on one GPU: attngen next to SDPA's cuDNN and flash backends, FlexAttention and
the straightforward torch code, over masks, top-k and dropout, in one run.

    python benchmarks/training.py --out DIR [--shape 4,16,4096,128] [--dtype bf16] [--cases none,causal,...] [--profile]

A step is the forward and the backward (torch.autograd.grad of the output with a fixed random
gradient) of one call. Every method's output and gradients are first compared with float64 autograd
through attngen.reference on batch 0, heads 0-1 (the largest of the four relative norm errors is
reported), then the step is timed with triton.testing.do_bench medians, and its peak memory above
the inputs is measured. TFLOP/s counts 3.5 x 4 * D FLOPs per visible (query, key) pair
(attngen.tools.timing, FlashAttention's convention); top-k counts the dense work (every score is
computed). FlexAttention is torch.compile(flex_attention) with a block mask built once, outside the
timing. Writes training.json and training.md into --out and prints the table last.

Cases: none, causal (SDPA cuDNN and flash, FlexAttention, attngen); window512 (causal sliding window
of 512), document (causal within 8 packed documents), prefix1024, sparse10 (a random 10% layout of
128 x 128 blocks) (FlexAttention, attngen); every case but top-k and dropout also runs attngen with
deterministic=False (dQ added atomically by the dK/dV programs); topk64, topk256 (torch with a bf16 and with an fp32
softmax, attngen); dropout (p = 0.1 against p = 0: SDPA flash and attngen).
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
from attngen.tools.timing import BWD_FACTOR, attention_flops, kernel_times

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ALL_CASES = "none,causal,window512,document,prefix1024,sparse10,topk64,topk256,dropout"


def case_masks(name, b, h, s, device):
    """(attngen mask, FlexAttention mask_mod or None, SDPA kwargs or None, topk) of a case."""
    if name == "none":
        return None, None, {}, None
    if name == "causal":
        return "causal", lambda b_, h_, q, kv: kv <= q, {"is_causal": True}, None
    if name == "window512":
        return (attngen.mask("sliding_window", window=512), lambda b_, h_, q, kv: (kv <= q) & (q - kv < 512), None,
                None)
    if name == "document":
        ids = (torch.arange(s, device=device) * 8 // s).expand(b, s).contiguous()  # 8 documents of s / 8
        return (attngen.mask("document", doc_ids=ids) & attngen.mask("causal"),
                lambda b_, h_, q, kv: (ids[0, q] == ids[0, kv]) & (kv <= q), None, None)
    if name == "prefix1024":
        return (attngen.mask("prefix_lm", prefix=1024), lambda b_, h_, q, kv: (kv <= q) | (kv < 1024), None, None)
    if name == "sparse10":
        layout = attngen.layouts.random(s, s, (128, 128), density=0.1, seed=7, heads=h, device=device)
        return (attngen.block_sparse(layout, (128, 128)),
                lambda b_, h_, q, kv: layout[0, h_, q // 128, kv // 128], None, None)
    if name.startswith("topk"):
        return None, None, None, int(name[4:])
    if "+topk" in name:  # a mask case and top-k (benchmarks/bwd_configs.py's, e.g. window512+topk64)
        base, topk = name.split("+topk")
        mask, mask_mod, _, _ = case_masks(base, b, h, s, device)
        return mask, mask_mod, None, int(topk)
    if name == "dropout":
        return None, None, None, None
    raise ValueError(f"unknown case {name!r}; known: {ALL_CASES}")


def torch_topk(q, k, v, topk, scale, fp32_softmax):
    """The straightforward top-k attention in torch: every score, torch.topk, a masked softmax."""
    score = torch.matmul(q, k.transpose(-1, -2)) * scale
    if fp32_softmax:
        score = score.float()
    threshold = score.topk(topk, dim=-1).values[..., -1:]
    score = score.masked_fill(score < threshold, float("-inf"))
    return torch.matmul(torch.softmax(score, dim=-1).to(v.dtype), v)


def methods(name, q, k, v, flex, scale):
    """method -> forward function of q, k, v for one case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    b, h, s, _ = q.shape
    mask, mask_mod, sdpa, topk = case_masks(name, b, h, s, q.device)
    out = {}
    if name == "dropout":
        def flash(q, k, v, p):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return {"sdpa_flash p=0": lambda q, k, v: flash(q, k, v, 0.0),
                "sdpa_flash p=0.1": lambda q, k, v: flash(q, k, v, 0.1),
                "attngen p=0": lambda q, k, v: attngen.attention(q, k, v),
                "attngen p=0.1": lambda q, k, v: attngen.attention(q, k, v, dropout_p=0.1)}
    if topk is not None:
        out["torch (bf16 softmax)"] = lambda q, k, v: torch_topk(q, k, v, topk, scale, False)
        out["torch (fp32 softmax)"] = lambda q, k, v: torch_topk(q, k, v, topk, scale, True)
        out["attngen"] = lambda q, k, v: attngen.attention(q, k, v, topk=topk)
        return out
    if sdpa is not None:
        for label, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
            def run(q, k, v, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, **sdpa)
            out[label] = run
    # one block mask for every batch (and head, but for the per-head layout), built compiled: the
    # (B, H, S, S) booleans of an eager build do not fit at S = 16384
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, h if name == "sparse10" else None,
                                                                 s, s, device=q.device, _compile=True)
    out["flex"] = lambda q, k, v: flex(q, k, v, block_mask=block_mask)
    out["attngen"] = lambda q, k, v: attngen.attention(q, k, v, mask=mask)
    out["attngen deterministic=False"] = lambda q, k, v: attngen.attention(q, k, v, mask=mask, deterministic=False)
    return out


def reference_output(name, q, k, v):
    """((q, k, v) of batch 0, heads 0-1 in float64, requiring grad; the float64 output on them)."""
    mask, _, _, topk = case_masks(name, 1, 2, q.shape[2], q.device)
    if name == "sparse10":  # the layout of heads 0-1
        layout = attngen.layouts.random(q.shape[2], q.shape[2], (128, 128), density=0.1, seed=7, heads=q.shape[1],
                                        device=q.device)[:, :2]
        mask = attngen.block_sparse(layout, (128, 128))
    inputs = tuple(t.detach()[:1, :2].double().requires_grad_() for t in (q, k, v))
    return inputs, attngen.reference.attention(*inputs, mask=mask, topk=topk)


def reference_grads(name, q, k, v, dout):
    """Float64 output and gradients on batch 0, heads 0-1."""
    inputs, out = reference_output(name, q, k, v)
    return [out.detach(), *torch.autograd.grad(out, inputs, dout[:1, :2].double())]


def step_of(fn, q, k, v, dout):
    def step():
        out = fn(q, k, v)
        return [out, *torch.autograd.grad(out, (q, k, v), dout)]
    return step


def write(out: Path, env: dict, rows: list, dtype: str, shape: tuple) -> None:
    b, h, s, d = shape
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    md = [f"{env['date']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, {dtype}, "
          f"B={b} H={h} S={s} D={d}, forward + backward", "",
          "| case | method | ms | TFLOP/s | peak MiB | max rel. error |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            md.append(f"| {r['case']} | {r['method']} | n/a | n/a | n/a | {r['skipped']} |")
        else:
            err = f"{r['error']:.1e}" if "error" in r else "(dropout: not compared)"
            md.append(f"| {r['case']} | {r['method']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['peak_mib']:.0f} | "
                      f"{err} |")
    (out / "training.md").write_text("\n".join(md) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--cases", default=ALL_CASES)
    p.add_argument("--out", default=".")
    p.add_argument("--methods", default=None,
                   help="only the methods whose name contains one of these comma-separated strings "
                        "(e.g. attngen,cudnn); every method when left out")
    p.add_argument("--profile", action="store_true",
                   help="also record the GPU time of every kernel of each method's step (torch.profiler; not the "
                        "torch top-k code, whose many small kernels say little) in each row, and print them")
    args = p.parse_args()
    b, h, s, d = (int(x) for x in args.shape.split(","))
    dtype = DTYPES[args.dtype]
    env = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, attngen=attngen.__version__, shape=dict(B=b, H=h, S=s, D=d),
               dtype=args.dtype)
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    g = torch.Generator(device="cuda").manual_seed(1234)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g).to(dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, s, d, device="cuda", generator=g).to(dtype)
    scale = d ** -0.5
    rows = []
    for name in args.cases.split(","):
        mask, _, _, topk = case_masks(name, b, h, s, "cuda")
        flops = attention_flops(mask, b, h, s, s, d, "cuda") * (1 + BWD_FACTOR)
        ref = None if name == "dropout" else reference_grads(name, q, k, v, dout)
        for method, fn in methods(name, q, k, v, flex, scale).items():
            if args.methods and not any(part in method for part in args.methods.split(",")):
                continue
            row = dict(case=name, method=method)
            try:
                step = step_of(fn, q, k, v, dout)
                results = step()
                if ref is not None:
                    row["error"] = max(float((x[:1, :2].double() - r).norm() / r.norm()) for x, r in zip(results, ref))
                del results
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                row["ms"] = float(triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median"))
                row["tflops"] = flops / row["ms"] / 1e9
                if args.profile and not method.startswith("torch"):
                    row["kernels_ms"] = kernel_times(step, calls=10)
            except Exception as e:  # a backend that refuses the case, out of memory: say so, go on
                row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            rows.append(row)
            print(json.dumps({key: value for key, value in row.items() if key != "kernels_ms"}), flush=True)
            for kernel, ms in sorted(row.get("kernels_ms", {}).items(), key=lambda kv: -kv[1])[:8]:
                print(f"    {ms:8.3f} ms  {kernel[:100]}", flush=True)
            torch.cuda.empty_cache()
        write(Path(args.out), env, rows, args.dtype, (b, h, s, d))  # after every case: a cut run keeps its rows
    print((Path(args.out) / "training.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
