"""Decoding on one GPU: attngen.decode (contiguous and paged caches) against SDPA's flash and
efficient backends, FlexAttention and, where its wheel is installed, FlashInfer's decode kernels.

    python benchmarks/decode.py --out DIR [--cases 1x65536,8x8192,64x2048] [--page 16] [--profile]

Shapes: bf16, Hq 32, Hkv 8, D 128, one new token per sequence, every sequence full (B x S keys).
`attngen.attention` is the same call through attngen.attention (a short query runs on the decode
kernels; before 2026-12-03 it ran the forward kernel: 201, 1380 and 260 µs on the three cases).
`attngen_nopdl`, `attngen_paged_nopdl`: attngen.decode's kernels with the combine kernel launched
after the split kernel instead of as its programmatic dependent (the A/B of that launch).
`attngen_paged_inorder`: the paged call on a pool whose pages lie in sequence order (block table
0, 1, 2, ...), against `attngen_paged`'s shuffled pool: what the scattered pages cost.
Every method's output is first compared with attngen.reference.decode (float64); then each is
timed three ways (K+V bytes per call, 256 MiB or more, exceed the L2):
- do_bench: triton.testing.do_bench's median; it zeroes a 256 MiB buffer before each call, so
  each call starts with the L2 full of dirty lines, written back while the call runs;
- clean: the median of 100 calls timed with CUDA events, each after a read of 256 MiB (the L2
  clean and holding none of the inputs; attngen.tools.timing.clean_ms);
- graph: 30 calls in turn over 3 input sets captured in one CUDA graph, as a decoding server
  runs its steps (attngen.tools.timing.graph_ms).
GB/s counts the K+V bytes a call must read; the copy row is a plain device copy of the same
bytes (read + write counted) in the same run, timed the same three ways; every "of copy" column
is against the fastest of the three (the H200's bandwidth: the goal is 80% of it). Also the host
time per call at a tiny shape (B 1, 256 keys): N calls back to back, the wall time before
synchronising divided by N (the GPU is not the bottleneck there). Writes decode.json into --out
and prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

import attngen
from attngen.tools.timing import clean_ms, graph_ms, kernel_times

HQ, HKV, D = 32, 8, 128
GRAPH_SETS = 3  # input sets the graph timing goes round (3 x 256 MiB or more: well over the L2)


def paged_copy(k, v, page: int, generator):
    """The cache as a shuffled pool of pages and a block table (int32)."""
    batch, kv_heads, length, d = k.shape
    per_seq = length // page
    order = torch.randperm(batch * per_seq, generator=generator).to(k.device).view(batch, per_seq)
    pool_k = torch.empty(batch * per_seq, page, kv_heads, d, dtype=k.dtype, device=k.device)
    pool_v = torch.empty_like(pool_k)
    pool_k[order.flatten()] = k.view(batch, kv_heads, per_seq, page, d).permute(0, 2, 3, 1, 4).reshape(-1, page,
                                                                                                      kv_heads, d)
    pool_v[order.flatten()] = v.view(batch, kv_heads, per_seq, page, d).permute(0, 2, 3, 1, 4).reshape(-1, page,
                                                                                                      kv_heads, d)
    return pool_k, pool_v, order.to(torch.int32)


def in_order(k, v, page: int):
    """The cache as a pool of pages in sequence order and its block table (0, 1, 2, ...)."""
    batch, kv_heads, length, d = k.shape
    pools = [t.view(batch, kv_heads, length // page, page, d).permute(0, 2, 3, 1, 4).reshape(-1, page, kv_heads, d)
             for t in (k, v)]
    table = torch.arange(batch * (length // page), dtype=torch.int32, device=k.device).view(batch, -1)
    return (*pools, table)


def case_inputs(batch: int, length: int, page: int, generator, device):
    """One case's fresh random bf16 q (B, Hq, 1, D), full contiguous caches k, v (B, Hkv, S, D), their
    lengths (int32) and the same caches as a shuffled page pool with its block table."""
    q = torch.randn(batch, HQ, 1, D, generator=generator).to(torch.bfloat16).to(device)
    k = torch.randn(batch, HKV, length, D, generator=generator).to(torch.bfloat16).to(device)
    v = torch.randn(batch, HKV, length, D, generator=generator).to(torch.bfloat16).to(device)
    lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    return (q, k, v, lens, *paged_copy(k, v, page, generator))


def methods(q, k, v, lens, pool_k, pool_v, table, page):
    """name -> a function of no arguments, or the reason it cannot run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}

    def sdpa(backend):
        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return run

    out["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    out["sdpa_efficient"] = sdpa(SDPBackend.EFFICIENT_ATTENTION)
    try:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        out["flex"] = lambda: flex(q, k, v, enable_gqa=True)
    except Exception as e:  # noqa: BLE001 - reported in the table
        out["flex"] = f"{type(e).__name__}: {e}"
    try:
        import flashinfer

        workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        batch = q.shape[0]
        indptr = torch.arange(0, batch + 1, device=q.device, dtype=torch.int32) * table.shape[1]
        last = torch.full((batch,), page, dtype=torch.int32, device=q.device)
        wrapper.plan(indptr, table.flatten(), last, HQ, HKV, D, page, data_type=q.dtype)
        q_flat = q[:, :, 0].contiguous()
        out["flashinfer_paged"] = lambda: wrapper.run(q_flat, (pool_k, pool_v)).view(q.shape)
    except Exception as e:  # noqa: BLE001 - not installed on the GPU machine, most likely
        out["flashinfer_paged"] = f"{type(e).__name__}: {str(e)[:80]}"
    out["attngen.attention"] = lambda: attngen.attention(q, k, v)  # a short query: the decode kernels too
    out["attngen"] = lambda: attngen.decode(q, k, v, lens, validate=False)
    out["attngen_paged"] = lambda: attngen.decode(q, pool_k, pool_v, lens, block_table=table, validate=False)
    order_k, order_v, order_table = in_order(k, v, page)
    out["attngen_paged_inorder"] = lambda: attngen.decode(q, order_k, order_v, lens, block_table=order_table,
                                                          validate=False)
    # the A/B of the combine's programmatic dependent launch: the same config and splits without it
    out["attngen_nopdl"] = without_pdl(q, k, v, lens, None)
    out["attngen_paged_nopdl"] = without_pdl(q, pool_k, pool_v, lens, table)
    return out


def without_pdl(q, k, v, lens, table):
    """attngen.decode's call with the combine kernel launched after the split kernel, not as its
    programmatic dependent."""
    from attngen.kernels.decode import DecodePlan, check_decode

    shape, cache = check_decode(q, k, v, lens, table)
    config = attngen.dispatch.choose_config(attngen.families.DECODE, q, shape, None, paged=cache.paged).config
    plan = DecodePlan(q, k, v, table, lens, None, shape, cache, D ** -0.5, False, config, pdl=False)
    return lambda: plan.run(q, k, v, table, lens)[0]


TIMINGS = ("do_bench", "clean", "graph")


def timings(fns: list) -> dict:
    """fns[0] timed the three ways (ms), the graph going round all of fns (one per input set)."""
    return dict(do_bench=triton.testing.do_bench(fns[0], return_mode="median"), clean=clean_ms(fns[0]),
                graph=graph_ms(fns))


def time_method(fns: list, ref, kv_bytes: int, copy_gbs: float) -> tuple[dict, tuple]:
    """One method on one case: fns[i] runs it on input set i (or is the reason it cannot run). Checks
    set 0's output against the float64 reference, then times it. Returns its json entry and its
    table row (after the case and method columns)."""
    if isinstance(fns[0], str):
        return dict(error=fns[0]), ("n/a", "", "", "", fns[0][:60])
    try:
        err = float((fns[0]().float() - ref).norm() / ref.norm())
        if not err < 2e-2:
            raise AssertionError(f"relative error {err:.2e} against the float64 reference")
        ms = timings(fns)
    except Exception as e:  # noqa: BLE001 - reported in the table
        why = f"{type(e).__name__}: {str(e)[:200]}"
        return dict(error=why), ("n/a", "", "", "", why[:60])
    result = dict(error_vs_ref=err)
    for how in TIMINGS:
        gbs = kv_bytes / ms[how] / 1e6
        result[how] = dict(ms=ms[how], gbs=gbs, of_copy=gbs / copy_gbs)
    return result, (*(f"{ms[how] * 1e3:.1f}" for how in TIMINGS),
                    " / ".join(f"{result[how]['of_copy']:.0%}" for how in TIMINGS), f"err {err:.1e}")


def host_time(device) -> dict:
    """µs of host time per call at a tiny shape, for attngen.decode and SDPA's flash backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, HQ, 1, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, HKV, 256, D, device=device, dtype=torch.bfloat16)
    lens = torch.full((1,), 256, dtype=torch.int32, device=device)
    fns = {"sdpa_flash": lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True),
           "attngen.decode": lambda: attngen.decode(q, k, k, lens, validate=False),
           "attngen.decode validate": lambda: attngen.decode(q, k, k, lens)}
    out = {}
    for name, fn in fns.items():
        context = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if name == "sdpa_flash" else None
        if context is not None:
            context.__enter__()
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        n = 2000
        start = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - start) / n * 1e6
        torch.cuda.synchronize()
        if context is not None:
            context.__exit__(None, None, None)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default="1x65536,8x8192,64x2048", help="BxS list")
    parser.add_argument("--page", type=int, default=16, help="rows per page of the paged cache (default 16)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the GPU time of each kernel of SDPA flash and attngen (torch.profiler) "
                             "next to the clean time, per case (a programmatic dependent's time, attngen's "
                             "combine on sm_90, includes its wait for the split kernel)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    results = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                   torch=torch.__version__, triton=triton.__version__, attngen=attngen.__version__,
                   shape=dict(heads=HQ, kv_heads=HKV, head_dim=D, q_len=1, dtype="bf16"), cases=[])
    rows, profiles = [], []
    for case in args.cases.split(","):
        batch, length = (int(x) for x in case.split("x"))
        sets = [case_inputs(batch, length, args.page, g, device) for _ in range(GRAPH_SETS)]
        q, k, v, lens, pool_k, pool_v, table = sets[0]
        kv_bytes = 2 * k.numel() * k.element_size()
        copies = [(torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device=device).normal_(),
                   torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device=device)) for _ in range(GRAPH_SETS)]
        copy_ms = timings([lambda dst=dst, src=src: dst.copy_(src) for src, dst in copies])
        copy_gbs = {how: 2 * kv_bytes / copy_ms[how] / 1e6 for how in TIMINGS}
        best = max(copy_gbs.values())
        ref = attngen.reference.decode(q, k, v, lens).float()
        entry = dict(batch=batch, length=length, kv_bytes=kv_bytes, copy_gbs=best,
                     copy={how: dict(ms=copy_ms[how], gbs=copy_gbs[how]) for how in TIMINGS}, methods={})
        rows.append((f"B{batch} S{length}", "copy (read+write)", *(f"{copy_ms[how] * 1e3:.1f}" for how in TIMINGS),
                     " / ".join(f"{copy_gbs[how]:.0f}" for how in TIMINGS) + " GB/s", ""))
        per_set = [methods(*inputs, args.page) for inputs in sets]
        for name in per_set[0]:
            entry["methods"][name], row = time_method([fns[name] for fns in per_set], ref, kv_bytes, best)
            rows.append((f"B{batch} S{length}", name, *row))
        if "clean" in entry["methods"].get("attngen", {}):
            from attngen.kernels.decode import DecodePlan, check_decode
            for key, (kk, vv, tt) in (("attngen", (k, v, None)), ("attngen_paged", (pool_k, pool_v, table))):
                shape, cache = check_decode(q, kk, vv, lens, tt)
                choice = attngen.dispatch.choose_config(attngen.families.DECODE, q, shape, None, paged=cache.paged)
                plan = DecodePlan(q, kk, vv, tt, lens, None, shape, cache, D ** -0.5, False, choice.config)
                entry[f"{key}_config"] = f"{choice.config} splits {plan.splits}"
                entry[f"{key}_source"] = choice.source
        if args.profile:
            entry["kernels_us"] = {}
            fns = methods(q, k, v, lens, pool_k, pool_v, table, args.page)
            for name in ("sdpa_flash", "attngen", "attngen_paged", "attngen_nopdl", "attngen_paged_nopdl"):
                if "clean" in entry["methods"].get(name, {}):
                    kernels = {key: ms * 1e3 for key, ms in kernel_times(fns[name]).items()}
                    entry["kernels_us"][name] = kernels
                    clean_us = entry["methods"][name]["clean"]["ms"] * 1e3
                    profiles.append(f"B{batch} S{length} {name}: clean {clean_us:.1f} µs, "
                                    f"kernels {sum(kernels.values()):.1f} µs: "
                                    + ", ".join(f"{key[:40]} {us:.1f}" for key, us in
                                                sorted(kernels.items(), key=lambda kv: -kv[1])))
        results["cases"].append(entry)
        (args.out / "decode.json").write_text(json.dumps(results, indent=1))
    results["host_us"] = host_time(device)
    (args.out / "decode.json").write_text(json.dumps(results, indent=1))
    header = ("case", "method", "do_bench µs", "clean µs", "graph µs", "of copy (do_bench / clean / graph)", "")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(x.ljust(w) for x, w in zip(r, widths)))
    for case in results["cases"]:
        if "attngen_config" in case:
            print(f"B{case['batch']} S{case['length']}: attngen {case['attngen_config']} ({case['attngen_source']}); "
                  f"paged {case['attngen_paged_config']}")
    for line in profiles:
        print(line)
    print("host µs per call (B1, 256 keys): " + ", ".join(f"{k} {v:.1f}" for k, v in results["host_us"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
