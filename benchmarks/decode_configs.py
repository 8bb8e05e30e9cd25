"""Decode kernel configs on one GPU, swept by hand: what each tile, warp, stage and split choice costs
for a contiguous and a paged cache, to set the decode family's defaults and search space from
measurements.

    python benchmarks/decode_configs.py --out DIR [--cases 1x65536,8x8192,64x2048] [--page 16] [--budget 240]
                                        [--layouts contiguous,paged] [--timing do_bench|clean|graph]
                                        [--configs 256x64x4x2,256x128x4x2]

Shapes as benchmarks/decode.py (bf16, Hq 32, Hkv 8, D 128, one new token, every sequence full). For
each case and layout, every config of the grid (block_n x num_warps x num_stages, or those of
--configs: block_m x block_n x num_warps x num_stages, at the split count the split rule gives, then
the best config again at other split counts) is first checked against
attngen.reference.decode (float64; a relative error over 2e-2 is reported and not timed), then
timed with triton.testing.do_bench medians, or as benchmarks/decode.py's other columns: `--timing
clean` (each call after a read that leaves the L2 clean) or `--timing graph` (calls in turn over
GRAPH_SETS input sets captured in one CUDA graph, as a decoding server runs its steps); with these
two, SDPA's flash backend on the contiguous cache is timed the same way in the same run as the
baseline. Stops starting new configs after --budget seconds. Writes
decode_configs.json into --out after each case and prints the best five per case and layout, and
the split rule's default config, last.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton

import attngen
from attngen.config import DEFAULTS, KernelConfig
from attngen.kernels.decode import DecodePlan, check_decode, sm_count, split_count

sys.path.insert(0, str(Path(__file__).parent))
from decode import D, GRAPH_SETS, HKV, HQ, case_inputs  # noqa: E402 - the same shapes and page pools

from attngen.tools.timing import clean_ms, graph_ms  # noqa: E402

GRID = dict(block_n=[16, 32, 64, 128], num_warps=[2, 4, 8], num_stages=[2, 3, 4])


def run_config(q, k, v, lens, table, config: KernelConfig, splits: int | None):
    """A function of no arguments running one decode call at `config` (and `splits`)."""
    shape, cache = check_decode(q, k, v, lens, table)
    plan = DecodePlan(q, k, v, table, lens, None, shape, cache, D ** -0.5, False, config, splits=splits)
    return plan, (lambda: plan.run(q, k, v, table, lens)[0])


def measure(fns: list, ref, timing: str) -> dict:
    """fns[i] runs one config on input set i; set 0's output is checked against the reference."""
    try:
        got = fns[0]().float()
        err = float((got - ref).norm() / ref.norm())
        if not err < 2e-2:
            return dict(error=f"relative error {err:.2e} against the float64 reference")
        if timing == "graph":
            ms = graph_ms(fns)
        elif timing == "clean":
            ms = clean_ms(fns[0])
        else:
            ms = triton.testing.do_bench(fns[0], return_mode="median")
        return dict(ms=ms, error_vs_ref=err)
    except Exception as e:  # noqa: BLE001 - a config that does not compile or launch is reported
        return dict(error=f"{type(e).__name__}: {str(e)[:160]}")


def sdpa_flash(q, k, v):
    """SDPA's flash backend on a contiguous cache, the baseline of the clean and graph timings."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default="1x65536,8x8192,64x2048", help="BxS list")
    parser.add_argument("--page", type=int, default=16, help="rows per page of the paged cache (default 16)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds after which no new config starts")
    parser.add_argument("--configs", help="block_m x block_n x num_warps x num_stages list instead of the grid")
    parser.add_argument("--layouts", default="contiguous,paged", help="which caches: contiguous, paged or both")
    parser.add_argument("--timing", choices=("do_bench", "clean", "graph"), default="do_bench",
                        help="do_bench medians (default), calls after a clean L2, or calls captured in a CUDA graph")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    begin = time.perf_counter()
    results = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                   torch=torch.__version__, triton=triton.__version__, page=args.page, timing=args.timing,
                   shape=dict(heads=HQ, kv_heads=HKV, head_dim=D, q_len=1, dtype="bf16"), cases=[])
    if args.configs:
        grid = [KernelConfig(*(int(x) for x in c.split("x"))) for c in args.configs.split(",")]
    else:
        grid = [KernelConfig(256, n, w, s) for n, w, s in itertools.product(*GRID.values())]
    layouts = args.layouts.split(",")
    for case in args.cases.split(","):
        batch, length = (int(x) for x in case.split("x"))
        sets = [case_inputs(batch, length, args.page, g, device)
                for _ in range(GRAPH_SETS if args.timing == "graph" else 1)]
        q, k, v, lens = sets[0][:4]
        ref = attngen.reference.decode(q, k, v, lens).float()
        kv_bytes = 2 * k.numel() * k.element_size()
        entry = dict(batch=batch, length=length, kv_bytes=kv_bytes, layouts={})
        results["cases"].append(entry)
        if args.timing != "do_bench":
            entry["sdpa_flash"] = measure([sdpa_flash(*inputs[:3]) for inputs in sets], ref, args.timing)
        for layout in layouts:
            caches = [(s[0], s[1], s[2], s[3], None) if layout == "contiguous" else (s[0], s[4], s[5], s[3], s[6])
                      for s in sets]
            rows = entry["layouts"][layout] = []

            def run(config, splits):
                plans = [run_config(*c, config, splits) for c in caches]
                rows.append(dict(config=str(config), block_n=config.block_n, num_warps=config.num_warps,
                                 num_stages=config.num_stages, splits=plans[0][0].splits,
                                 **measure([fn for _, fn in plans], ref, args.timing)))

            for config in grid:
                if time.perf_counter() - begin > args.budget:
                    break
                run(config, None)
            timed = [r for r in rows if "ms" in r]
            if timed and time.perf_counter() - begin <= args.budget:
                best = min(timed, key=lambda r: r["ms"])
                config = next(c for c in grid if str(c) == best["config"])
                for splits in sorted({max(1, best["splits"] // 2), best["splits"] * 2, best["splits"] * 4} - {best["splits"]}):
                    run(config, splits)
            for r in rows:
                if "ms" in r:
                    r["gbs"] = kv_bytes / r["ms"] / 1e6
        (args.out / "decode_configs.json").write_text(json.dumps(results, indent=1))
    print(f"decode configs, {results['gpu']}, torch {results['torch']}, triton {results['triton']}, "
          f"bf16 Hq {HQ} Hkv {HKV} D {D}, page {args.page}; µs ({args.timing}), GB/s of K+V")
    for entry in results["cases"]:
        flash = entry.get("sdpa_flash", {})
        if flash:
            print(f"B{entry['batch']} S{entry['length']} SDPA flash (contiguous): "
                  + (f"{flash['ms'] * 1e3:.1f} µs" if "ms" in flash else flash["error"][:80]))
        for layout, rows in entry["layouts"].items():
            timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
            failed = [r for r in rows if "error" in r]
            print(f"B{entry['batch']} S{entry['length']} {layout}: {len(timed)} timed, {len(failed)} failed"
                  + (f" (first: {failed[0]['config']}: {failed[0]['error'][:80]})" if failed else ""))
            for r in timed[:5]:
                print(f"   {r['config']:<60} splits {r['splits']:>3}  {r['ms'] * 1e3:7.1f} µs  {r['gbs']:5.0f} GB/s")
    print(f"the untuned defaults (attngen.config.DEFAULTS['decode']): {DEFAULTS['decode']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
