"""`attngen bench`: every way to compute one attention, on the same inputs, in one table.

The methods are in attngen.tools.methods, the columns and output formats in attngen.tools.report.
Each case runs every method once (the warm-up: compilation stays out of the numbers), checks it
against the float64 reference, then measures its peak memory and its median time.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import textwrap
import warnings
from pathlib import Path

import torch

from ..argtypes import comma_list
from ..checks import interpreter_on
from .. import dtypes
from .methods import METHODS, Case, Unsupported, build, make_inputs, max_rel_error, parse_mask, reference_results
from .progress import progress_bar
from .report import DEFINITIONS, Row, as_csv, as_json, markdown_table, plot, shown, terminal_table
from .timing import BWD_FACTOR, attention_flops, median_ms

DEFAULT_SHAPE = (4, 16, 4096, 128)


INTERPRET_SHAPE = (1, 2, 64, 32)


def reason_of(e: BaseException, caught: list) -> str:
    """One line saying why a method failed (warnings caught during the call say why a backend refused)."""
    if isinstance(e, torch.OutOfMemoryError):
        return "out of memory"
    if isinstance(e, (Unsupported, NotImplementedError)):
        text = str(e)
    else:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        text = type(e).__name__ + (": " + lines[0] if lines else "")
        if text.endswith(":") and len(lines) > 1:
            text += " " + lines[1]
    why = list(dict.fromkeys(str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()))
    if why and "No viable backend" in text:  # SDPA's own warnings say what each backend refused
        text = "; ".join(why)
    return " ".join(text.split())[:240]


def _release():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure(method: str, p: Inputs, refs: list, flops: int) -> Row:
    """One row: build the method, run it once (warm-up: compilation), check it, measure memory and time."""
    cuda = p.device.type == "cuda"
    _release()
    base = torch.cuda.memory_allocated(p.device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(p.device)
    fn = result = None
    row = Row(method)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn, row.note = build(method, p)
                result = fn()
            except Exception as e:  # the method cannot run this case: say why, keep the table going
                return Row(method, note="n/a: " + reason_of(e, caught))
        outputs = result if isinstance(result, list) else [result]
        row.error = shown(max_rel_error(outputs, refs), "error")
        result = outputs = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(p.device)
            fn()
            torch.cuda.synchronize()
            row.peak_mib = shown((torch.cuda.max_memory_allocated(p.device) - base) / 2**20, "peak_mib")
        ms = median_ms(fn, p.device)
        row.ms = shown(ms, "ms")
        row.tflops = shown(flops / ms / 1e9, "tflops")
        return row
    except torch.OutOfMemoryError:
        return Row(method, note="n/a: out of memory")
    finally:
        fn = result = None
        _release()


def run_case(case: Case, methods: list[str], device, progress=None) -> tuple[list[Row], list[str], int]:
    """(rows, notes, counted FLOPs) of one case."""
    if any(m in ("compile", "flex") for m in methods):
        torch._dynamo.reset()  # each case compiles its own kernels, specialised to its shape
    p = make_inputs(case, device)
    refs = reference_results(p)
    flops = attention_flops(p.mask, case.batch, case.heads, case.seq_len, case.seq_len, case.head_dim, device)
    flops = int(flops * (1 + BWD_FACTOR)) if case.bwd else flops
    rows = []
    for method in methods:
        if progress is not None:
            progress.set_description(f"S={case.seq_len} {case.dtype} {case.mask} {case.direction}: {method}")
        rows.append(measure(method, p, refs, flops))
        if progress is not None:
            progress.update(1)
    notes = []
    naive = next((r for r in rows if r.method == "naive"), None)
    for r in rows:
        if naive is not None and naive.ms and r.ms:
            r.speedup = shown(naive.ms / r.ms, "speedup")
    if naive is None:
        notes.append("speedup: n/a, naive was not run (--methods)")
    elif naive.ms is None:
        notes.append("speedup: n/a, naive did not run (" + naive.note.removeprefix("n/a: ") + ")")
    if p.device.type != "cuda":
        notes.append("peak MiB: n/a on the CPU (measured with CUDA's allocator); ms: CPU wall clock, not GPU figures")
    return rows, notes, flops


EXAMPLES = """\
examples:
  attngen bench                                   # B=4 H=16 S=4096 D=128, fp16, dense, every method
  attngen bench --mask causal --dtype fp16,bf16 --bwd
  attngen bench --mask 'sliding_window(window=1024) & softcap(cap=30.0)' --methods naive,flex,attngen
  attngen bench --shape 1,16,4096,128 --seq-lens 1024,2048,4096,8192,16384 --mask causal --plot sweep.png
  attngen bench --markdown --json results.json --csv results.csv
  attngen bench --interpret                       # no GPU: tiny shape, attngen under Triton's interpreter

columns:
""" + "".join(textwrap.fill(f"{name}: {text}.", 100, initial_indent="  ", subsequent_indent="    ") + "\n"
              for name, text in DEFINITIONS.items())


def add_common_arguments(parser, *, many: bool) -> None:
    """Options shared by `attngen bench` and `attngen profile`."""
    if many:
        parser.add_argument("--mask", action="append", metavar="SPEC",
                            help="mask and score modifiers, e.g. causal or 'sliding_window(window=256) & "
                                 "softcap(cap=30.0)'; repeat for several (default none = dense)")
        parser.add_argument("--dtype", type=comma_list(str), default=["fp16"], metavar="DT,DT,...",
                            help="comma-separated, any of fp16, bf16, fp32 (default fp16)")
    else:
        parser.add_argument("--mask", default="none", metavar="SPEC",
                            help="mask and score modifiers, e.g. causal (default none = dense)")
        parser.add_argument("--dtype", default="fp16", help="fp16, bf16 or fp32 (default fp16)")
    parser.add_argument("--shape", metavar="B,H,S,D",
                        help="batch, heads, sequence length, head dim (default 4,16,4096,128; 1,2,64,32 with "
                             "--interpret)")
    parser.add_argument("--bwd", action="store_true", help="forward and backward (default: forward only)")
    parser.add_argument("--interpret", action="store_true",
                        help="no GPU: run on the CPU, attngen under Triton's interpreter (timings are CPU wall "
                             "clock and say nothing about a GPU)")


def add_arguments(parser) -> None:
    add_common_arguments(parser, many=True)
    parser.add_argument("--seq-lens", type=comma_list(int), metavar="S,S,...",
                        help="sweep the sequence length (overrides the S of --shape), e.g. 1024,2048,4096")
    parser.add_argument("--methods", type=comma_list(str), default=list(METHODS),
                        help=f"comma-separated, any of {', '.join(METHODS)} (default all)")
    parser.add_argument("--markdown", nargs="?", const="-", metavar="FILE",
                        help="Markdown tables into FILE, or instead of the terminal table without FILE")
    parser.add_argument("--json", metavar="FILE", help="the results as JSON into FILE ('-': stdout)")
    parser.add_argument("--csv", metavar="FILE", help="the results as CSV into FILE ('-': stdout)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="time and peak memory against sequence length, log axes (needs matplotlib: "
                             "pip install 'attngen[plot]')")


def setup_device(interpret: bool, command: str) -> torch.device:
    """The device to run on; under --interpret, Triton's interpreter switched on (before any kernel loads)."""
    if interpret:
        if "triton" in sys.modules and not interpreter_on() and "attngen.kernels.forward" in sys.modules:
            raise ValueError(f"--interpret needs TRITON_INTERPRET=1 before triton is imported; run `attngen "
                             f"{command} --interpret` in a process of its own")
        os.environ["TRITON_INTERPRET"] = "1"
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"no CUDA device found: run on a GPU, or pass --interpret to run `attngen {command}` on the "
                         "CPU (attngen under Triton's interpreter)")
    return torch.device("cuda")


def parse_shape(text: str | None, interpret: bool) -> tuple[int, int, int, int]:
    if text is None:
        return INTERPRET_SHAPE if interpret else DEFAULT_SHAPE
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"--shape must be four positive integers B,H,S,D, got {text!r}")
    return shape


def parse_dtype(name: str) -> str:
    dtypes.parse(name)
    return name


def cases_from_args(args) -> list[Case]:
    b, h, s, d = parse_shape(args.shape, args.interpret)
    if d > 256:
        raise ValueError(f"--shape: head dim {d} is over attngen's 256")
    seq_lens = args.seq_lens or [s]
    if min(seq_lens) < 1:
        raise ValueError(f"--seq-lens must be positive, got {seq_lens}")
    dtypes = [parse_dtype(x) for x in args.dtype]
    specs = args.mask or ["none"]
    for spec in specs:
        parse_mask(spec)  # a bad spec fails here, before any work
    return [Case(b, h, seq, d, dtype, spec, args.bwd) for seq in seq_lens for dtype in dtypes for spec in specs]


def check_methods(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise ValueError(f"--methods: unknown method(s) {', '.join(map(repr, unknown)) or '(none given)'}; valid: "
                         f"{', '.join(METHODS)}")
    return list(dict.fromkeys(names))


def environment(device: torch.device) -> dict:
    import triton

    from ..version import __version__

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    timing = ("triton.testing.do_bench median" if device.type == "cuda"
              else "CPU wall-clock median of 3 runs (not GPU figures)")
    return dict(date=datetime.date.today().isoformat(), device=name, torch=torch.__version__,
                triton=triton.__version__, attngen=__version__, timing=timing)


def run_cases(cases: list[Case], methods: list[str], device, progress=None, after_case=None) -> list[tuple]:
    """[(case, rows, notes, counted FLOPs)] for every case; the Python entry point of `attngen bench`.
    `after_case(results so far)` is called after each case."""
    device = torch.device(device)
    results = []
    for case in cases:
        results.append((case, *run_case(case, methods, device, progress)))
        if after_case is not None:
            after_case(results)
    return results


def main(args) -> int:
    """Run `attngen bench` with parsed arguments (see attngen.cli)."""
    methods = check_methods(args.methods)
    cases = cases_from_args(args)
    to_stdout = [name for name in ("markdown", "json", "csv") if getattr(args, name) == "-"]
    if len(to_stdout) > 1:
        raise ValueError(f"only one output can go to stdout, got --{' and --'.join(to_stdout)}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install matplotlib (or 'attngen[plot]')") from None
    device = setup_device(args.interpret, "bench")
    env = environment(device)
    print(f"attngen bench on {env['device']}: {len(cases)} case(s) x {len(methods)} method(s); timing: "
          f"{env['timing']}", file=sys.stderr)
    renders = {"markdown": markdown_table, "csv": as_csv,
               "json": lambda results: json.dumps(as_json(results, env), indent=1) + "\n"}

    def write_files(results):  # after every case: an interrupted run keeps what it measured
        for name, render in renders.items():
            target = getattr(args, name)
            if target and target != "-":
                Path(target).write_text(render(results))
        if args.plot:
            plot(results, Path(args.plot), env)

    with progress_bar(len(cases) * len(methods), "run") as bar:
        results = run_cases(cases, methods, device, bar, after_case=write_files)
    for name in to_stdout:
        sys.stdout.write(renders[name](results))
    if not to_stdout:
        print(terminal_table(results))
    return 0
