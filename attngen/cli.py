"""The attngen command line: `attngen <command> --help` for each command."""

from __future__ import annotations

import argparse
import sys

from . import masks as masks_
from .version import __version__


def _add_mask_option(parser: argparse.ArgumentParser):
    parser.add_argument("--mask", default="none", metavar="SPEC",
                        help="mask and score modifiers, e.g. 'causal', 'sliding_window(window=256) & softcap(cap=30.0)' "
                             "or 'none' (default); `attngen masks` lists the templates")


def cmd_render(args) -> int:
    from .kernels.launch import kernel_templates, render_kernel
    from .render import source_path

    if args.template not in kernel_templates():
        raise ValueError(f"--template must be one of {', '.join(kernel_templates())}, got {args.template!r}")
    mask = masks_.parse_spec(args.mask, partial=True)
    source = render_kernel(args.template, mask)
    sys.stdout.write(source)
    print(f"# cached as {source_path(source)}", file=sys.stderr)
    return 0


def cmd_masks(args) -> int:
    from .masks.template_files import check_all

    checked = sorted(check_all(), key=lambda c: (c.name, str(c.path)))
    broken = [c for c in checked if c.error]
    for c in checked:
        error = c.error and c.error.replace("\n", "\n    ")  # an error names its file; a YAML one has lines
        if args.check:
            print(f"BROKEN {c.name}: {error}" if error else f"ok {c.name} - {c.path}")
            continue
        if error:
            print(f"{c.name} (BROKEN)\n    error: {error}\n")
            continue
        template = c.template
        print(f"{c.name} ({template.kind}) - {template.path}")
        for line in template.doc.splitlines():
            print(f"    {line}")
        for param in template.params.values():
            print(f"    param {param.describe()}" + (f": {param.doc}" if param.doc else ""))
        print()
    if broken:
        print(f"attngen masks: {len(broken)} of {len(checked)} templates are broken: "
              f"{', '.join(c.name for c in broken)}", file=sys.stderr)
    return 1 if broken and args.check else 0


def cmd_tune(args) -> int:
    from .tuning import tune

    tune.fill_defaults(args)
    return tune.main(args)


def cmd_bench(args) -> int:
    from .tools import bench

    return bench.main(args)


def cmd_profile(args) -> int:
    from .tools import profile

    return profile.main(args)


def cmd_registry(args) -> int:
    import warnings

    import torch

    from . import dispatch
    from .checks import interpreter_on
    from .tuning import registry

    if args.gpu:
        gpu = args.gpu
    elif torch.cuda.is_available() and not interpreter_on():
        gpu = dispatch.gpu_of(torch.device("cuda"))
    else:
        gpu = registry.INTERPRETER
    paths = dispatch.registry_paths()
    files = [registry.file_for(path, gpu) for path in paths]
    if not any(file.exists() for file in files):
        known = registry.gpus_in(paths)
        raise ValueError(f"no registry for gpu {gpu!r}: none of {', '.join(map(str, files))} exists; registries "
                         f"exist for {', '.join(known) if known else 'no gpu'} (--gpu KEY picks one; `attngen tune` "
                         "makes one for this machine)")
    with warnings.catch_warnings():
        if args.action == "list":  # the listing says what the warnings would
            warnings.simplefilter("ignore", registry.RegistryWarning)
        reg = registry.Registry.load(paths, gpu)
    from .families import FAMILIES

    def ignored(entry) -> bool:  # the dispatcher skips it: another revision's kernels, or no such family
        family = FAMILIES.get(entry.key.kernel)
        return family is None or entry.revision != family.revision

    if args.action == "list":
        for file in files:
            source = next((s for s in reg.sources if s.path == file), None)
            if source is not None:
                skipped = reg.skipped.get(file)
                count = len(source.entries)
                stale = sum(map(ignored, source.entries.values()))
                status = f"{count} entr{'y' if count == 1 else 'ies'}" + (
                    f" ({stale} of another kernel revision or family, which the dispatcher ignores)"
                    if stale else "") + (
                    f" (skipped invalid entries {', '.join(map(str, skipped))}; `attngen registry show` says why)"
                    if skipped else "")
            elif file in reg.unusable:
                status = f"unusable, ignored: {reg.unusable[file]}"
            else:
                status = "no file"
            print(f"{file}: {status}")
        return 1 if reg.unusable else 0
    rows = [("source", "variant", "kernel", "revision", "dtype", "D", "bucket", "group", "batch", "config", "ms",
             "TFLOP/s", "SDPA ms", "speedup", "trials", "date")]
    for path, e in reg.entries():
        config = e.kernel_config()  # as stored: the interpreter runs the tensor-descriptor path too
        revision = str(e.revision)
        if ignored(e):
            family = FAMILIES.get(e.key.kernel)
            revision += (f" (ignored: kernels at {family.revision})" if family is not None
                         else f" (ignored: no kernel family {e.key.kernel!r})")
        rows.append((str(path), e.key.variant, e.key.kernel, revision, e.key.dtype, e.key.head_dim, e.key.seq_bucket,
                     e.key.group, e.key.batch_bucket or "any", str(config), f"{e.ms:.4g}", f"{e.tflops:.4g}",
                     f"{e.sdpa_ms:.4g}" if e.sdpa_ms else "n/a", f"{e.sdpa_ms / e.ms:.2f}x" if e.sdpa_ms else "n/a",
                     e.trials, e.date))
    if len(rows) == 1:
        print(f"no registry entries for gpu {gpu!r} in {', '.join(map(str, paths))}")
        return 0
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attngen", description="Generate, tune and run Triton attention kernels.",
        epilog=f"Mask templates are read from the built-in folder, from {masks_.TEMPLATE_PATH_ENV} "
               "(folders separated by ':') and from every --template-dir.")
    parser.add_argument("--version", action="version", version=f"attngen {__version__}")
    parser.add_argument("--template-dir", action="append", default=[], metavar="DIR",
                        help="a folder of your own mask templates (*.yaml); may be repeated")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    render = sub.add_parser("render", help="print the exact kernel source a call with this mask runs",
                            description="Print the Triton source of a kernel template for a mask variant "
                                        "(the file in the kernel cache is named on stderr).")
    _add_mask_option(render)
    render.add_argument("--template", default="forward",
                        help="the kernel template (templates/kernels/NAME.py.jinja): forward (default) or topk, "
                             "the threshold kernels of top-k softmax")
    render.set_defaults(run=cmd_render)

    masks = sub.add_parser("masks", help="list the mask and score templates with their parameters",
                           description="List every mask and score template attngen can see, each checked (its "
                                       "expression rendered and parsed for every value of its static parameters): "
                                       "a broken template is listed with its error.")
    masks.add_argument("--check", action="store_true",
                       help="only check: one line per template (ok or BROKEN with the error); exit status 1 when "
                            "any is broken")
    masks.set_defaults(run=cmd_masks)

    from .tuning.tune import add_arguments

    tune = sub.add_parser("tune", help="search kernel configs with Optuna on this GPU and record the winners",
                          description="Tune the kernel for a mask over a matrix of dtypes, head dims and sequence "
                                      "lengths (one Optuna study each, resumed when run again), then write the "
                                      "winners to the registry and print a summary next to SDPA.")
    add_arguments(tune)
    tune.set_defaults(run=cmd_tune)

    from .tools import bench, profile

    bench_parser = sub.add_parser(
        "bench", help="time every way to compute attention (naive, torch.compile, SDPA, FlexAttention, attngen)",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=bench.EXAMPLES,
        description="Run naive torch attention, naive with out= buffers, torch.compile(naive), SDPA with each "
                    "backend forced, compiled FlexAttention and attngen on the same random inputs in one process, "
                    "and print one table per case: median ms, TFLOP/s, peak memory above the inputs, speedup over "
                    "naive and the max relative error against the float64 reference. A method that cannot run a "
                    "case shows n/a and why.")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=cmd_bench)

    profile_parser = sub.add_parser(
        "profile", help="run one method under torch.profiler and print its operator table",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=profile.EXAMPLES,
        description="Run one method of `attngen bench` (after a warm-up) under torch.profiler, with CPU and CUDA "
                    "activities and input shapes recorded, and print key_averages() sorted by CUDA time (CPU time "
                    "without CUDA).")
    profile.add_arguments(profile_parser)
    profile_parser.set_defaults(run=cmd_profile)

    reg = sub.add_parser("registry", help="show the tuned registry the dispatcher reads",
                         description="list: the registry files for a GPU in lookup order, each with its entry count "
                                     "(and how many of them the dispatcher ignores, being of another kernel "
                                     "revision), or why it is unusable (exit status 1 when one is); show: every "
                                     "entry (user registry first, then the shipped one) with the kernel revision it "
                                     "was tuned on; the dispatcher ignores entries of another revision than its "
                                     "kernels'. A GPU with no registry file at all is an error that names the GPUs "
                                     "that have one.")
    reg.add_argument("action", choices=["list", "show"])
    reg.add_argument("--gpu", help="GPU key, e.g. h200 (default: this machine's, or 'interpreter' without CUDA)")
    reg.set_defaults(run=cmd_registry)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for d in args.template_dir:
            masks_.register_template_dir(d)
        return args.run(args)
    except (ValueError, TypeError) as e:
        print(f"attngen {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a template error is the user's to fix: say it in one line
        from .render import TemplateError

        if isinstance(e, TemplateError):
            print(f"attngen {args.command}: template error: {e}", file=sys.stderr)
            return 2
        raise
