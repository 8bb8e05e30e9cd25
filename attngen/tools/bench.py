"""`attngen bench`: every way to compute one attention, on the same inputs, in one table.

Methods (`--methods`; all by default), run in one process on the same random inputs:

    naive           torch: matmul, softmax, matmul (the mask a boolean tensor built once)
    naive_out       the same into buffers allocated once (matmul(out=), softmax(out=))
    compile         torch.compile(naive)
    sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math
                    F.scaled_dot_product_attention with that one backend forced
    flex            torch.compile(flex_attention), the mask a mask_mod and BlockMask, score
                    modifiers a score_mod
    attngen         attngen.attention through the dispatcher (the note says which config, from where)

Every mask is evaluated by the same torch code as the float64 reference (attngen.masks), so any
template runs in the torch methods. A method that cannot run a case (out of memory, no SDPA
form of the mask, a backend that refuses the shape) gets a row of n/a with the reason.

Columns (one definition each, also in the JSON's "definitions"):
"""

from __future__ import annotations

import csv
import datetime
import gc
import io
import json
import math
import os
import sys
import textwrap
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import masks as masks_
from .checks import interpreter_on
from .timing import attention_flops, median_ms
from .tune import DTYPES, comma_list

METHODS = ("naive", "naive_out", "compile", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex",
           "attngen")
BWD_FACTOR = 2.5  # backward FLOPs per forward FLOP (FlashAttention's convention: 5 matmuls against 2)
REFERENCE_SCORES = 1 << 29  # at most this many float64 scores in the reference (4 GiB a score-sized tensor)
DEFAULT_SHAPE = (4, 16, 4096, 128)
INTERPRET_SHAPE = (1, 2, 64, 32)

DEFINITIONS = {
    "ms": "median milliseconds of one call (forward, or forward and backward with --bwd): triton.testing.do_bench "
          "on CUDA after a warm-up call (compilation is outside the numbers); on the CPU the median of 3 wall-clock "
          "runs, which says nothing about a GPU",
    "tflops": "counted FLOPs / time. FLOPs: 4*D per (query, key) pair the mask leaves visible, over every batch and "
              f"head (attngen.timing); with --bwd {1 + BWD_FACTOR:g} times that (the backward counts {BWD_FACTOR:g} "
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
__doc__ += "".join(f"\n    {name}: {text}." for name, text in DEFINITIONS.items()) + "\n"


class Unsupported(Exception):
    """A method cannot run a case; the message says why (shown as the n/a reason)."""


# ---------------------------------------------------------------------------------------
# cases and their inputs
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: str  # a key of DTYPES
    mask: str  # the spec as given (`none`, `causal`, ...), or a label when mask_object is given
    bwd: bool = False
    mask_object: masks_.Mask | None = field(default=None, compare=False, repr=False)  # default: parsed from `mask`

    def __post_init__(self):
        if self.mask_object is None:
            object.__setattr__(self, "mask_object", parse_mask(self.mask))

    @property
    def direction(self) -> str:
        return "fwd+bwd" if self.bwd else "fwd"

    def title(self) -> str:
        return (f"B={self.batch} H={self.heads} S={self.seq_len} D={self.head_dim}, {self.dtype}, mask {self.mask}, "
                f"{'forward + backward' if self.bwd else 'forward'}")


@dataclass
class Inputs:
    """One case's tensors on the device, shared by every method."""

    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor | None  # the gradient of the output, with --bwd
    mask: masks_.Mask | None
    bound: masks_.Bound | None
    scale: float
    device: torch.device

    @property
    def sizes(self) -> dict:
        c = self.case
        return dict(q_len=c.seq_len, kv_len=c.seq_len, batch=c.batch, heads=c.heads)


def make_inputs(case: Case, device, seed: int = 0) -> Inputs:
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (case.batch, case.heads, case.seq_len, case.head_dim)

    def rand():  # random normal, never zeros; fp32 first so every dtype draws the same values
        return torch.randn(shape, device=device, generator=g).to(DTYPES[case.dtype]).requires_grad_(case.bwd)

    q, k, v = rand(), rand(), rand()
    dout = rand().detach() if case.bwd else None
    m = case.mask_object
    bound = masks_.bind(m, batch=case.batch, heads=case.heads, q_len=case.seq_len, kv_len=case.seq_len, device=device)
    return Inputs(case, q, k, v, dout, m, bound, 1.0 / math.sqrt(case.head_dim), device)


def reference_slice(case: Case) -> tuple[int, int]:
    """(batches, heads) the error is measured on: all, or batch 0's first heads when they do not fit."""
    if case.mask_object is not None and case.mask_object.has_tensors:
        return case.batch, case.heads  # tensor parameters are sized for the whole call
    per_head = case.seq_len * case.seq_len
    if case.batch * case.heads * per_head <= REFERENCE_SCORES:
        return case.batch, case.heads
    return 1, max(1, min(case.heads, REFERENCE_SCORES // per_head))


def reference_results(p: Inputs) -> list[torch.Tensor]:
    """[out] (and dq, dk, dv with --bwd) in float64 on the reference slice."""
    from .reference import attention as reference

    nb, nh = reference_slice(p.case)
    q, k, v = (t.detach()[:nb, :nh].to(torch.float64).requires_grad_(p.case.bwd) for t in (p.q, p.k, p.v))
    with torch.set_grad_enabled(p.case.bwd):
        out = reference(q, k, v, mask=p.mask, scale=p.scale)
        if not p.case.bwd:
            return [out]
        grads = torch.autograd.grad(out, (q, k, v), p.dout[:nb, :nh].to(torch.float64))
    return [out.detach()] + list(grads)


def max_rel_error(results, refs) -> float:
    """The largest max |x - ref| / max |ref| over the tensors compared (NaN when any result has one)."""
    worst = 0.0
    for x, ref in zip(results, refs):
        x = x[:ref.shape[0], :ref.shape[1]].detach().to(torch.float64)
        err = float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
        if math.isnan(err):
            return err
        worst = max(worst, err)
    return worst


# ---------------------------------------------------------------------------------------
# the mask in torch, for every method but attngen
# ---------------------------------------------------------------------------------------
def dense_visible(mask, *, batch: int, heads: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """The mask's boolean (B or 1, H or 1, Sq, Sk) tensor, True where a key is visible (B where the
    mask depends on `b`, else 1; the same for H)."""
    names = masks_.predicate_names(mask.tree)
    nb, nh = (batch if "b" in names else 1), (heads if "h" in names else 1)
    env = masks_.index_env(torch.arange(q_len, device=device), torch.arange(kv_len, device=device), q_len=q_len,
                           kv_len=kv_len, batch=batch, heads=heads, batches=nb, head_count=nh)
    bound = masks_.bind(mask, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, device=device)
    visible = torch.as_tensor(masks_.evaluate_visible(bound, env), device=device)
    return visible.expand(nb, nh, q_len, kv_len)


def torch_mods(p: Inputs) -> tuple[Callable | None, Callable | None]:
    """(mask_mod(b, h, q_idx, kv_idx), score_mod(score, b, h, q_idx, kv_idx)) as FlexAttention takes them.

    masks.predicate_fn and masks.score_fn: the reference's own torch evaluation, with every
    expression looked up before torch.compile traces the functions (it cannot trace the template
    cache). None where the mask has no predicate, or no score modifiers.
    """
    if p.mask is None:
        return None, None
    sizes = p.sizes
    visible = masks_.predicate_fn(p.bound) if p.mask.tree is not None else None
    mods = masks_.score_fn(p.bound) if p.mask.mods else None

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, **sizes))

    def score_mod(score, b, h, q_idx, kv_idx):
        return mods(score, dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, **sizes))

    return (mask_mod if visible is not None else None), (score_mod if mods is not None else None)


def _naive_parts(p: Inputs):
    """(hidden, mods): the positions to hide (a boolean tensor, built once) and a function applying
    the score modifiers to a (B, H, S, S) score, either None when the mask has none."""
    mask_mod, score_mod = torch_mods(p)
    hidden = ~dense_visible(p.mask, device=p.device, **p.sizes) if mask_mod is not None else None
    mods = None
    if score_mod is not None:
        positions = torch.arange(p.case.seq_len, device=p.device)
        ix = masks_.index_env(positions, positions, **p.sizes)
        b, h, q_idx, kv_idx = ix["b"], ix["h"], ix["q_idx"], ix["kv_idx"]
        mods = lambda score: score_mod(score, b, h, q_idx, kv_idx)  # noqa: E731
    return hidden, mods


def is_sdpa_causal(mask) -> bool:
    """The mask is exactly SDPA's is_causal=True (the built-in causal, aligned top left)."""
    term = mask.tree
    return (isinstance(term, masks_.Term) and not mask.mods and term.template.name == "causal"
            and term.template.path.parent == masks_.template_dirs()[0] and term.static == {"align": "top_left"})


def sdpa_kwargs(mask, *, batch: int, heads: int, q_len: int, kv_len: int, device) -> tuple[dict, str]:
    """The keyword arguments with which F.scaled_dot_product_attention computes exactly `mask`, and
    their description; raises Unsupported where SDPA has no form for it (score modifiers)."""
    if mask is None:
        return {}, "no mask"
    if mask.mods:
        names = ", ".join(t.template.name for t in mask.mods)
        raise Unsupported(f"SDPA has no form for score modifiers ({names})")
    if mask.tree is None:
        return {}, "no mask"
    if is_sdpa_causal(mask):
        return {"is_causal": True}, "is_causal=True"
    visible = dense_visible(mask, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, device=device)
    return {"attn_mask": visible}, f"boolean attn_mask of shape {tuple(visible.shape)}"


# ---------------------------------------------------------------------------------------
# the methods: each returns (a function computing the output, a note)
# ---------------------------------------------------------------------------------------
def naive_fn(p: Inputs) -> Callable:
    hidden, mods = _naive_parts(p)
    q, k, v, scale = p.q, p.k, p.v, p.scale

    def naive():
        score = torch.matmul(q, k.transpose(-1, -2)) * scale
        if mods is not None:
            score = mods(score)
        if hidden is not None:
            score = score.masked_fill(hidden, float("-inf"))
        return torch.matmul(torch.softmax(score, dim=-1), v)

    return naive


def build_naive(p: Inputs):
    return naive_fn(p), "scores in the input dtype"


def build_naive_out(p: Inputs):
    hidden, mods = _naive_parts(p)
    q, k, v, scale = p.q, p.k, p.v, p.scale
    c = p.case
    score = torch.empty(c.batch, c.heads, c.seq_len, c.seq_len, device=p.device, dtype=q.dtype)
    probs = torch.empty_like(score)
    out = torch.empty_like(q)

    def naive_out():
        torch.matmul(q, k.transpose(-1, -2), out=score)
        score.mul_(scale)
        if mods is not None:
            score.copy_(mods(score))
        if hidden is not None:
            score.masked_fill_(hidden, float("-inf"))
        torch.softmax(score, dim=-1, out=probs)
        return torch.matmul(probs, v, out=out)

    return naive_out, "score, probabilities and output in buffers allocated once"


def build_compile(p: Inputs):
    return torch.compile(naive_fn(p)), "torch.compile(naive), default mode"


def _sdpa(backend: str):
    def build(p: Inputs):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if p.device.type != "cuda" and backend in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            raise Unsupported("needs a CUDA device")
        if not hasattr(SDPBackend, backend):
            raise Unsupported(f"this torch has no SDPA backend {backend}")
        kwargs, how = sdpa_kwargs(p.mask, device=p.device, **p.sizes)
        chosen, q, k, v, scale = getattr(SDPBackend, backend), p.q, p.k, p.v, p.scale

        def sdpa():
            with sdpa_kernel(chosen):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, **kwargs)

        return sdpa, how
    return build


_FLEX = None


def build_flex(p: Inputs):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention)
    mask_mod, score_mod = torch_mods(p)
    block_mask, how = None, "dense"
    if mask_mod is not None:
        names = masks_.predicate_names(p.mask.tree)
        c = p.case
        block_mask = create_block_mask(mask_mod, c.batch if "b" in names else None,
                                       c.heads if "h" in names else None, c.seq_len, c.seq_len, device=p.device)
        sparsity = block_mask.sparsity()  # meaningless (negative) when S is below Flex's block size
        how = "block mask" + (f" {sparsity:.0f}% sparse" if 0 <= sparsity <= 100 else "")
    if score_mod is not None:
        how += ", score_mod"
    flex, q, k, v, scale = _FLEX, p.q, p.k, p.v, p.scale
    return (lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)), how


def build_attngen(p: Inputs):
    from . import dispatch

    if p.device.type == "cpu" and p.q.dtype == torch.bfloat16:
        raise Unsupported("bf16 is not run under Triton's interpreter (its bf16 tl.dot is wrong)")
    q, k, v, m, scale = p.q, p.k, p.v, p.mask, p.scale
    choice = dispatch.choose(q, k, v, m)
    c = choice.config
    config = (f"BLOCK {c.block_m}x{c.block_n}, warps {c.num_warps}, stages {c.num_stages}{', TMA' if c.use_tma else ''}"
              f"{', warp-specialized' if c.warp_specialize else ''}")
    return (lambda: dispatch.attention(q, k, v, mask=m, scale=scale)), f"{config} ({choice.source})"


BUILDERS: dict[str, Callable] = {
    "naive": build_naive,
    "naive_out": build_naive_out,
    "compile": build_compile,
    "sdpa_flash": _sdpa("FLASH_ATTENTION"),
    "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa_math": _sdpa("MATH"),
    "flex": build_flex,
    "attngen": build_attngen,
}
assert tuple(BUILDERS) == METHODS


def build(method: str, p: Inputs) -> tuple[Callable, str]:
    """A function running one step of `method` (the forward, or forward and backward with --bwd) and a note."""
    forward, note = BUILDERS[method](p)
    if not p.case.bwd:
        return forward, note
    q, k, v, dout = p.q, p.k, p.v, p.dout

    def step():
        out = forward()
        return [out, *torch.autograd.grad(out, (q, k, v), dout)]

    return step, note


# ---------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------
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


def parse_mask(text: str) -> masks_.Mask | None:
    """A mask from --mask; parameters the command line cannot give (tensors) are a clear error."""
    try:
        return masks_.parse_spec(text)
    except TypeError as e:
        partial = masks_.parse_spec(text, partial=True)
        tensors = [f"{t.template.name}'s {p.name} ({p.describe()})" for t in (partial.terms() if partial else [])
                   for p in t.runtime if p.type == "tensor" and p.name not in t.values]
        if tensors:
            raise ValueError(f"--mask {text!r} needs tensor parameter(s) {', '.join(tensors)}, which cannot be given "
                             "on the command line; call attngen.bench.run_cases from Python with a mask object") \
                from None
        raise TypeError(f"--mask {text!r}: {e}") from None
    except ValueError as e:
        raise ValueError(f"--mask {text!r}: {e}") from None


def parse_dtype(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
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

    from . import __version__

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
    from tqdm import tqdm

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

    with tqdm(total=len(cases) * len(methods), unit="run", dynamic_ncols=True, file=sys.stderr) as bar:
        results = run_cases(cases, methods, device, bar, after_case=write_files)
    for name in to_stdout:
        sys.stdout.write(renders[name](results))
    if not to_stdout:
        print(terminal_table(results))
    return 0
