"""Hugging Face models on one GPU: tokens/s of a forward and of a training step under
attn_implementation "attngen", "sdpa" and "flex_attention", same weights, same inputs.

    python benchmarks/hf_models.py --out DIR/hf_models.json [--configs llama1b,gemma2] [--seq 4096] [--batch 1]
    python benchmarks/hf_models.py --smoke --out /tmp/hf_smoke.json     # tiny configs, CPU (interpreter) or GPU

Models are built from configs with random weights (nothing is downloaded), in bf16:
- llama1b: Llama-3.2-1B's shape (1.24B parameters: hidden 2048, 16 layers, 32 query and 8 key/value
  heads of 64, vocabulary 128256), causal.
- gemma2: Gemma-2-2B's shape (2.6B parameters: hidden 2304, 26 layers, 8 query and 4 key/value heads
  of 256, vocabulary 256000), every other layer a sliding window (1024 here instead of 4096, so that
  it matters at 4096 tokens), attention logits soft-capped at 50. SDPA cannot soft-cap: it is n/a.

Every implementation is first checked: its logits (no grad, eval mode) against the reference's
(sdpa; eager for gemma2), relative norm error; one that differs by more than --tolerance is not
timed. Then, in train mode (attention dropout 0): a forward is `model(ids)` under no_grad, a
training step is `model(ids, labels=ids).loss.backward()` (no optimizer; no KV cache either). Each is run --warmup
times, then timed --iters times with torch.cuda.synchronize() around each run; the median is
reported, as tokens/s = batch * seq / seconds. Peak memory is that of a training step. The JSON
(--out) is rewritten after every row; the table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # --smoke on a machine without CUDA: attngen under the interpreter

import transformers  # noqa: E402
import triton  # noqa: E402

import attngen  # noqa: E402
import attngen.integrations.transformers  # noqa: E402

CONFIGS = {
    "llama1b": ("LlamaForCausalLM", transformers.LlamaConfig, dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
    "gemma2": ("Gemma2ForCausalLM", transformers.Gemma2Config, dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, query_pre_attn_scalar=256, sliding_window=1024,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192)),
}
REFERENCE = {"llama1b": "sdpa", "gemma2": "eager"}
# --smoke: the same architectures, tiny (the window still shorter than the sequence)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=128)
SMOKE_EXTRA = {"gemma2": dict(query_pre_attn_scalar=16, sliding_window=8)}


def build(name: str, smoke: bool, device, dtype):
    class_name, config_class, kwargs = CONFIGS[name]
    if smoke:
        kwargs = {**kwargs, **SMOKE, **SMOKE_EXTRA.get(name, {})}
    config = config_class(**kwargs, attention_dropout=0.0)
    torch.manual_seed(0)
    model = getattr(transformers, class_name)._from_config(config, attn_implementation="eager", dtype=dtype)
    return model.to(device)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_seconds(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def logits_of(model, impl, ids):
    model.set_attn_implementation(impl)
    model.eval()
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def measure(model, impl, ids, reference, args) -> dict:
    """The row of one implementation: its logits' error, then forward and training-step times."""
    row = dict(impl=impl)
    try:
        error = float((logits_of(model, impl, ids) - reference).norm() / reference.norm())
        row["logits_rel_error"] = error
        if error > args.tolerance:
            row["skipped"] = f"logits differ from the reference's by {error:.2e} (over {args.tolerance:.0e})"
            return row
        model.train()

        def forward():
            with torch.no_grad():
                model(ids, use_cache=False)

        def train_step():
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids, use_cache=False).loss.backward()

        tokens = ids.numel()
        row["forward_s"] = median_seconds(forward, args.warmup, args.iters)
        row["forward_tokens_per_s"] = tokens / row["forward_s"]
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        row["train_step_s"] = median_seconds(train_step, args.warmup, args.iters)
        row["train_tokens_per_s"] = tokens / row["train_step_s"]
        if torch.cuda.is_available():
            row["train_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as e:  # an implementation that refuses the model (SDPA and soft capping): say so, go on
        row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        model.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def table(rows: list) -> str:
    lines = ["| config | attention | forward tok/s | train step tok/s | forward ms | train step ms | train peak GiB "
             "| logits rel. error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = f"{r['logits_rel_error']:.1e}" if "logits_rel_error" in r else "n/a"
        if "skipped" in r:
            lines.append(f"| {r['config']} | {r['impl']} | n/a | n/a | n/a | n/a | n/a | {err}: {r['skipped']} |")
            continue
        peak = f"{r['train_peak_gib']:.1f}" if "train_peak_gib" in r else "n/a"
        lines.append(f"| {r['config']} | {r['impl']} | {r['forward_tokens_per_s']:,.0f} | "
                     f"{r['train_tokens_per_s']:,.0f} | {r['forward_s'] * 1e3:.1f} | {r['train_step_s'] * 1e3:.1f} | "
                     f"{peak} | {err} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--configs", default="llama1b,gemma2", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--impls", default="attngen,sdpa,flex_attention")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default 4096; --smoke: 40)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 3; --smoke: 0)")
    p.add_argument("--iters", type=int, default=None, help="timed runs (default 10; --smoke: 1)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest relative logits error timed (default 5e-2 in bf16, 1e-4 in --smoke's fp32)")
    p.add_argument("--smoke", action="store_true", help="tiny configs in fp32: checks that the script runs")
    args = p.parse_args()
    smoke = args.smoke
    args.seq = args.seq or (40 if smoke else 4096)
    args.warmup = args.warmup if args.warmup is not None else (0 if smoke else 3)
    args.iters = args.iters or (1 if smoke else 10)
    args.tolerance = args.tolerance or (1e-4 if smoke else 5e-2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not smoke:
        p.error("without CUDA only --smoke runs")
    dtype = torch.float32 if smoke else torch.bfloat16

    attngen.integrations.transformers.register()
    env = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu",
               torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
               attngen=attngen.__version__, python=sys.version.split()[0], seq=args.seq, batch=args.batch,
               dtype=str(dtype).removeprefix("torch."), warmup=args.warmup, iters=args.iters, smoke=smoke)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            p.error(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
        model = build(name, smoke, device, dtype)
        params = sum(t.numel() for t in model.parameters())
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.seq), device=device,
                            generator=torch.Generator(device).manual_seed(1))
        reference = logits_of(model, REFERENCE[name], ids)
        for impl in args.impls.split(","):
            row = dict(config=name, params=params, reference=REFERENCE[name])
            row.update(measure(model, impl, ids, reference, args))
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps(dict(env=env, rows=rows), indent=1))
        del model, reference
    print(f"\n{env['date']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, transformers "
          f"{env['transformers']}, {env['dtype']}, batch {args.batch} x {args.seq} tokens\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
