"""`attngen profile`: one method of `attngen bench` under torch.profiler.

The method is built and run twice first (compilation, autotuning and caches stay out of the
profile), then `--steps` calls are recorded with CPU and CUDA activities and input shapes, and
`key_averages()` is printed sorted by CUDA time (CPU time on a machine without CUDA).
`--memory` also records allocations: a second table sorts the operators by the memory they
allocate, the CUDA peak of one call is printed, and a `--trace` then carries the memory events,
which Perfetto (ui.perfetto.dev) or chrome://tracing draw as a timeline.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from . import bench, methods

EXAMPLES = """\
examples:
  attngen profile --method naive --mask causal --dtype bf16
  attngen profile --method attngen --mask causal --dtype bf16 --trace attngen.json --memory
  attngen profile --method flex --bwd --row-limit 30
  attngen profile --method attngen --interpret     # no GPU: CPU activities only, under Triton's interpreter
"""


def add_arguments(parser) -> None:
    parser.add_argument("--method", default="attngen", help=f"one of {', '.join(methods.METHODS)} (default attngen)")
    bench.add_common_arguments(parser, many=False)
    parser.add_argument("--steps", type=int, default=5, help="calls recorded (default 5)")
    parser.add_argument("--row-limit", type=int, default=20, help="rows of each table (default 20)")
    parser.add_argument("--by-shape", action="store_true", help="one row per operator and input shapes")
    parser.add_argument("--trace", metavar="FILE.json", help="export a Chrome trace (open in ui.perfetto.dev)")
    parser.add_argument("--memory", action="store_true",
                        help="record allocations: a table by memory per operator, the peak, memory events in --trace")


def main(args) -> int:
    """Run `attngen profile` with parsed arguments (see attngen.cli)."""
    method = args.method
    if method not in methods.METHODS:
        raise ValueError(f"--method: unknown method {method!r}; valid: {', '.join(methods.METHODS)}")
    if args.steps < 1 or args.row_limit < 1:
        raise ValueError(f"--steps and --row-limit must be >= 1, got {args.steps} and {args.row_limit}")
    b, h, s, d = bench.parse_shape(args.shape, args.interpret)
    case = methods.Case(b, h, s, d, bench.parse_dtype(args.dtype), args.mask, args.bwd)
    device = bench.setup_device(args.interpret, "profile")
    cuda = device.type == "cuda"
    p = methods.make_inputs(case, device)
    try:
        fn, note = methods.build(method, p)
        for _ in range(2):  # warm-up: compilation and caches stay out of the profile
            fn()
    except Exception as e:
        raise ValueError(f"--method {method} cannot run {case.title()}: {bench.reason_of(e, [])}") from None
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=args.memory) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function(f"attngen bench step: {method}"):
                fn()
            if cuda:
                torch.cuda.synchronize()
    events = prof.key_averages(group_by_input_shape=args.by_shape)
    sort = "device_time_total" if cuda else "cpu_time_total"
    print(f"attngen profile: {method} ({note}), {case.title()}, {args.steps} call(s) after 2 warm-up calls; "
          f"sorted by {sort}")
    print(events.table(sort_by=sort, row_limit=args.row_limit))
    if args.memory:
        by_memory = "self_device_memory_usage" if cuda else "self_cpu_memory_usage"
        print(f"memory per operator, sorted by {by_memory}:")
        print(events.table(sort_by=by_memory, row_limit=args.row_limit))
        if cuda:
            print(f"peak CUDA memory while profiling: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB allocated "
                  f"(the inputs included)")
    if args.trace:
        prof.export_chrome_trace(str(Path(args.trace)))
        print(f"Chrome trace written to {args.trace}", file=sys.stderr)
    return 0
