"""How `attngen bench` shows its results: the column definitions, the terminal table, Markdown,
JSON, CSV and the plot of time and memory against sequence length."""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass
from pathlib import Path

from .methods import METHODS, REFERENCE_SCORES
from .timing import BWD_FACTOR

DEFINITIONS = {
    "ms": "median milliseconds of one call (forward, or forward and backward with --bwd): triton.testing.do_bench "
          "on CUDA after a warm-up call (compilation is outside the numbers); on the CPU the median of 3 wall-clock "
          "runs, which says nothing about a GPU",
    "tflops": "counted FLOPs / time. FLOPs: 4*D per (query, key) pair the mask leaves visible, over every batch and "
              f"head (attngen.tools.timing); with --bwd {1 + BWD_FACTOR:g} times that (the backward counts {BWD_FACTOR:g} "
              "times the forward, FlashAttention's convention). The same count for every method: the work the mask "
              "asks for, not what a method computes",
    "peak_mib": "peak CUDA memory during one warm call above what was allocated before the method was set up (the "
                "inputs): the method's outputs (and gradients), its temporaries and what it prepares once (a boolean "
                "mask, out= buffers, a block mask); n/a on the CPU",
    "speedup": "naive's ms / this method's ms",
    "error": "max |out - ref| / max |ref| against the float64 reference (attngen.reference) on the same inputs; with "
             "--bwd the largest of that over the output and the gradients of q, k and v (reference: float64 autograd "
             "through attngen.reference). Measured on every batch and head, or on batch 0's first heads when all "
             f"would need more than 2^{REFERENCE_SCORES.bit_length() - 1} float64 scores",
}


@dataclass
class Row:
    method: str
    ms: float | None = None
    tflops: float | None = None
    peak_mib: float | None = None
    speedup: float | None = None
    error: float | None = None
    note: str = ""  # how the method ran it; for a row of n/a, "n/a: <reason>"


# What the table shows of each number; the JSON and CSV carry the same rounded values.
FORMATS = {"ms": ".4g", "tflops": ".4g", "peak_mib": ".1f", "speedup": ".2f", "error": ".1e"}


def shown(value: float | None, column: str) -> float | None:
    """`value` rounded to what the table shows."""
    return None if value is None else float(format(value, FORMATS[column]))


COLUMNS = [("method", "method"), ("ms", "ms"), ("tflops", "TFLOP/s"), ("peak_mib", "peak MiB"),
           ("speedup", "vs naive"), ("error", "max rel err"), ("note", "note")]


CASE_FIELDS = ("batch", "heads", "seq_len", "head_dim", "dtype", "mask", "direction")


def cell(row: Row, column: str) -> str:
    value = getattr(row, column)
    if column in ("method", "note"):
        return value
    if value is None:
        return "n/a"
    text = format(value, FORMATS[column])
    return text + "x" if column == "speedup" else text


def terminal_table(results) -> str:
    out = []
    for case, rows, notes, flops in results:
        lines = [[title for _, title in COLUMNS]] + [[cell(r, c) for c, _ in COLUMNS] for r in rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
        fmt = lambda line: "  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip()  # noqa: E731
        out += [f"{case.title()}: {flops:.4g} FLOPs counted", fmt(lines[0]), fmt(["-" * w for w in widths])]
        out += [fmt(line) for line in lines[1:]] + [f"  {n}" for n in notes] + [""]
    return "\n".join(out)


def markdown_table(results) -> str:
    out = []
    for case, rows, notes, flops in results:
        out += [f"**{case.title()}** ({flops:.4g} FLOPs counted)", "",
                "| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        out += ["| " + " | ".join(cell(r, c).replace("|", "\\|") for c, _ in COLUMNS) + " |" for r in rows]
        out += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    return "\n".join(out)


def as_json(results, env: dict) -> dict:
    cases = []
    for case, rows, notes, flops in results:
        cases.append(dict(**{f: getattr(case, f) for f in CASE_FIELDS}, flops=flops, notes=notes,
                          rows=[asdict(r) for r in rows]))
    return dict(env=env, definitions=DEFINITIONS, cases=cases)


def as_csv(results) -> str:
    buf = io.StringIO()
    names = [c for c, _ in COLUMNS]
    writer = csv.DictWriter(buf, fieldnames=list(CASE_FIELDS) + ["flops"] + names, lineterminator="\n")
    writer.writeheader()
    for case, rows, notes, flops in results:
        for r in rows:
            writer.writerow({**{f: getattr(case, f) for f in CASE_FIELDS}, "flops": flops, **asdict(r)})
    return buf.getvalue()


def plot(results, path: Path, env: dict) -> None:
    """Time and peak memory against sequence length, log axes, a line per method; one row of two
    panels per (dtype, mask, direction)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list] = {}
    for case, rows, _, _ in results:
        groups.setdefault((case.dtype, case.mask, case.direction), []).append((case, rows))
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 4.5 * len(groups)), squeeze=False)
    colors = {m: plt.get_cmap("tab10")(i) for i, m in enumerate(METHODS)}  # a method keeps its colour
    for (dtype, mask, direction), (ax_t, ax_m) in zip(groups, axes):
        cases = groups[(dtype, mask, direction)]
        first, seq_lens = cases[0][0], sorted({c.seq_len for c, _ in cases})
        for method in dict.fromkeys(r.method for _, rows in cases for r in rows):
            for ax, column in ((ax_t, "ms"), (ax_m, "peak_mib")):
                points = [(c.seq_len, getattr(r, column)) for c, rows in cases for r in rows
                          if r.method == method and getattr(r, column) is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", label=method, color=colors[method])
        for ax, label in ((ax_t, "median ms"), (ax_m, "peak MiB above the inputs")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(seq_lens, [str(n) for n in seq_lens])
            ax.minorticks_off()
            ax.set_xlim(seq_lens[0] / 1.3, seq_lens[-1] * 1.3)
            ax.set_xlabel("sequence length")
            ax.set_ylabel(label)
            ax.set_title(f"B={first.batch} H={first.heads} D={first.head_dim}, {dtype}, mask {mask}, {direction}",
                         fontsize=9)
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.set_yscale("log")
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "not measured (CPU)" if ax is ax_m else "n/a", ha="center",
                        transform=ax.transAxes)
    fig.suptitle(f"attngen bench on {env['device']}, torch {env['torch']}, {env['date']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)
