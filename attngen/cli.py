"""The attngen command line: `attngen <command> --help` for each command."""

from __future__ import annotations

import argparse
import sys

from . import masks as masks_


def _add_mask_option(parser: argparse.ArgumentParser):
    parser.add_argument("--mask", default="none", metavar="SPEC",
                        help="mask and score modifiers, e.g. 'causal', 'sliding_window(window=256) & softcap(cap=30.0)' "
                             "or 'none' (default); `attngen masks` lists the templates")


def cmd_render(args) -> int:
    from .kernels.forward import render_source
    from .render import source_path

    mask = masks_.parse_spec(args.mask, partial=True)
    source = render_source(mask)
    sys.stdout.write(source)
    print(f"# cached as {source_path(source)}", file=sys.stderr)
    return 0


def cmd_masks(args) -> int:
    for name, template in sorted(masks_.templates().items()):
        print(f"{name} ({template.kind}) - {template.path}")
        for line in template.doc.splitlines():
            print(f"    {line}")
        for param in template.params.values():
            print(f"    param {param.describe()}" + (f": {param.doc}" if param.doc else ""))
        print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attngen", description="Generate, tune and run Triton attention kernels.",
        epilog=f"Mask templates are read from the built-in folder, from {masks_.TEMPLATE_PATH_ENV} "
               "(folders separated by ':') and from every --template-dir.")
    parser.add_argument("--template-dir", action="append", default=[], metavar="DIR",
                        help="a folder of your own mask templates (*.yaml); may be repeated")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    render = sub.add_parser("render", help="print the exact kernel source a call with this mask runs",
                            description="Print the Triton source of the forward kernel for a mask variant "
                                        "(the file in the kernel cache is named on stderr).")
    _add_mask_option(render)
    render.set_defaults(run=cmd_render)

    masks = sub.add_parser("masks", help="list the mask and score templates with their parameters",
                           description="List every mask and score template attngen can see.")
    masks.set_defaults(run=cmd_masks)
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
