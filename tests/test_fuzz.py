"""A seeded fuzz of attngen.attention: random shapes (0 and 1 included where legal), strides
(transposed, sliced, expanded with stride 0), dtypes, devices, masks and their combinations,
parameters at and beyond their bounds, topk, scale, return_lse, dropout, gradients, NaN and inf.

Every call either matches the float64 reference (attngen.reference) within the dtype's tolerance,
with NaN and inf exactly where the README's "NaN and inf" puts them, or, for a case made invalid
on purpose, raises a ValueError or TypeError whose message names what is wrong. Anything else
fails: another exception (a crash inside Triton), an invalid case that runs, a valid one that
raises, NaN where the reference is finite, a warning that reaches the caller.

    ATTNGEN_FUZZ_CASES=5000 pytest tests/test_fuzz.py -s     # more cases, and a summary of each chunk
    ATTNGEN_FUZZ_SEED=7 ...                                   # other cases (default 26)
    ATTNGEN_FUZZ_ONLY=123 ...                                 # case 123 alone (a failure names its case)
"""

import collections
import math
import os
import random
import traceback
import warnings
from dataclasses import dataclass, field

import pytest
import torch

import attngen
from attngen.checks import check_scale
from attngen.reference import TOLERANCE
from helpers import DEVICE, LSE_TOLERANCE, near_tie_rows

# 400 tiny calls take about half a minute under the interpreter; with CUDA most new variants compile
CASES = int(os.environ.get("ATTNGEN_FUZZ_CASES", "400" if DEVICE == "cpu" else "150"))
SEED = int(os.environ.get("ATTNGEN_FUZZ_SEED", "26"))
ONLY = os.environ.get("ATTNGEN_FUZZ_ONLY")
CHUNKS = 4  # the cases run as this many tests (pytest-xdist spreads them)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
GRAD_TOLERANCE = {dtype: 2 * tol for dtype, tol in TOLERANCE.items()}  # as tests/kernels/test_backward.py
M = attngen.mask


@dataclass
class Case:
    """One call: how to build its inputs (in the call, so that a mask's own errors count), what the
    error must mention where the case is invalid on purpose, and what it exercises."""

    index: int
    q: object
    k: object
    v: object
    mask: object  # a function () -> the mask argument
    kwargs: dict
    invalid: str | None = None  # a word the error message must contain
    nonfinite: str | None = None  # "qk" or "v": where NaN or inf was put
    grad: bool = False
    dropout_seed: int = 0
    notes: list = field(default_factory=list)

    def __str__(self):
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (self.q, self.k, self.v)]
        return (f"case {self.index} (ATTNGEN_FUZZ_SEED={SEED} ATTNGEN_FUZZ_ONLY={self.index}): shapes {shapes}, "
                f"{', '.join(self.notes)}; kwargs {self.kwargs}; invalid: {self.invalid}")


# ---------------------------------------------------------------------------------------
# generating a case
# ---------------------------------------------------------------------------------------
def layout_tensor(rng, gen, shape, dtype, device, note):
    """A tensor of `shape` (B, H, S, D) in a random memory layout: contiguous, (B, S, H, D)
    transposed, sliced (every other element of a dim, or an offset), or expanded with stride 0 over
    a dim of size > 1 (the same values repeated)."""
    kind = rng.choice(["contiguous", "contiguous", "transposed", "sliced", "expanded", "head_dim_stride"])
    b, h, s, d = shape

    def randn(*size):
        return torch.randn(*size, generator=gen).to(dtype).to(device)

    if kind == "transposed":
        t = randn(b, s, h, d).transpose(1, 2)
    elif kind == "sliced":
        dim = rng.randrange(4)
        big = list(shape)
        big[dim] = 2 * shape[dim] + 1
        t = randn(*big).narrow(dim, 1, 2 * shape[dim]).unflatten(dim, (shape[dim], 2)).select(dim + 1, 0)
    elif kind == "expanded" and any(n > 1 for n in shape[:3]):
        dim = rng.choice([i for i in range(3) if shape[i] > 1])
        small = list(shape)
        small[dim] = 1
        t = randn(*small).expand(*shape)
    elif kind == "head_dim_stride":
        t = randn(b, h, s, 2 * d)[..., ::2]
    else:
        kind = "contiguous"
        t = randn(*shape)
    assert t.shape == shape
    note.append(kind)
    return t


def mask_term(rng, gen, dims, device, fault: bool):
    """(a function building one predicate term, the word its error names: None unless `fault`,
    where the term is wrong on purpose)."""
    batch, heads, q_len, kv_len = dims
    kinds = ["causal", "causal_br", "sliding_window", "prefix_lm", "chunked", "document", "block_sparse"]
    kind = rng.choice(kinds[2:] if fault else kinds)
    if kind == "causal":
        return (lambda: "causal"), None
    if kind == "causal_br":
        return (lambda: M("causal", align="bottom_right")), None
    if kind in ("sliding_window", "prefix_lm", "chunked"):
        param, low = {"sliding_window": ("window", 1), "prefix_lm": ("prefix", 0), "chunked": ("chunk", 1)}[kind]
        value = rng.choice([low, low + 1, rng.randint(low, kv_len + 3), kv_len + 50])  # at and past the bounds
        extra = {}
        if kind == "sliding_window":
            extra = dict(two_sided=rng.random() < 0.3, align=rng.choice(["top_left", "bottom_right"]))
        if fault:
            value = rng.choice([low - 1, float(value) + 0.5, "3"])
        return (lambda: M(kind, **{param: value}, **extra)), (param if fault else None)
    if kind == "document":
        ids = torch.randint(0, 3, (batch, kv_len), generator=gen).sort(-1).values
        ids = rng.choice([ids, ids[:1], ids[0]]) if batch > 0 else ids  # (B, Sk), (1, Sk), (Sk,)
        if fault:
            ids = rng.choice([torch.zeros(batch, kv_len + 1, dtype=torch.int64), torch.zeros(batch, kv_len),
                              ids.to("meta")])
        return (lambda: M("document", doc_ids=ids if ids.is_meta else ids.to(device))), ("doc_ids" if fault else None)
    block_m, block_n = rng.choice([1, 2, 3, 8, 16]), rng.choice([1, 2, 5, 16])
    blocks = [rng.choice([batch, 1]), rng.choice([heads, 1]), math.ceil(q_len / block_m), math.ceil(kv_len / block_n)]
    if fault:
        blocks[3] += 1
    layout = torch.rand(blocks, generator=gen) < rng.choice([0.0, 0.3, 0.7, 1.0])
    return (lambda: attngen.block_sparse(layout.to(device), (block_m, block_n))), ("layout" if fault else None)


def score_term(rng, gen, heads, device, fault: bool):
    """(a function building one score modifier, the word its error names: None unless `fault`)."""
    if rng.random() < 0.5:
        slopes = torch.randn(heads + (2 if fault else 0), generator=gen)  # 1 would broadcast
        return (lambda: M("alibi", slopes=slopes.to(device))), ("slopes" if fault else None)
    # at the template's bound, and the usual range; cap=nan or inf: issue 26's "float parameters need
    # finite checks" (another change) decides them
    cap = rng.choice([0.0005, -1.0]) if fault else rng.choice([0.001, 0.5, 5.0, 1e4])
    return (lambda: M("softcap", cap=cap)), ("cap" if fault else None)


def random_mask(rng, gen, dims, device, notes, fault: bool):
    """None, a name, or a tree of 1-3 predicate terms (& and |) with 0-2 score modifiers; returns
    (a function building it, the word its error names: None unless `fault`, where exactly one
    thing in it is wrong on purpose)."""
    if fault and rng.random() < 0.25:
        notes.append("mask: unknown name, or not a mask")
        return rng.choice([((lambda: "no_such_mask"), "unknown mask"), ((lambda: 42), "mask")])
    choice = rng.random()
    if not fault and choice < 0.2:
        notes.append(f"mask {'None' if choice < 0.15 else repr('causal')}")
        return (lambda: None if choice < 0.15 else "causal"), None
    n_terms, n_mods = rng.choice([1, 1, 2, 3]), rng.choice([0, 0, 1, 2])
    bad = rng.randrange(n_terms + n_mods + 1) if fault else -1  # the wrong one; n_terms + n_mods: a | too many
    parts, word = [], None
    for i in range(n_terms + n_mods):
        make = mask_term if i < n_terms else score_term
        build, w = make(rng, gen, dims if i < n_terms else dims[1], device, i == bad)
        parts.append((build, rng.choice("&|") if i < n_terms else "&"))
        word = word or w
    if bad == n_terms + n_mods:  # a score modifier joined by |
        parts.append((score_term(rng, gen, dims[1], device, False)[0], "|"))
        word = "score modifiers combine"

    def build():
        m = attngen.masks.as_mask(parts[0][0]())
        for part, op in parts[1:]:
            term = attngen.masks.as_mask(part())
            m = (m & term) if op == "&" else (m | term)
        return m

    notes.append(f"mask of {len(parts)} terms")
    return build, word


def make_case(index: int) -> Case:
    rng = random.Random(f"{SEED}:{index}")
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    # at most one thing is wrong on purpose: the tensors, an argument, or the mask
    fault = rng.choices(["none", "tensors", "argument", "mask"], weights=[70, 12, 9, 9])[0]
    notes, invalid = [f"fault: {fault}"], None
    dtype = rng.choice(DTYPES)
    zero = [rng.random() < 0.07 for _ in range(3)]  # B, Hq, Sq of 0: an empty output (a fifth of the calls)
    batch = 0 if zero[0] else rng.choice([1, 1, 2, 3])
    kv_heads = rng.choice([1, 1, 2])
    heads = 0 if zero[1] else kv_heads * rng.choice([1, 1, 2, 3])
    q_len = 0 if zero[2] else rng.choice([1, 1, 2, rng.randint(3, 20), rng.randint(3, 20), 33])
    kv_len = rng.choice([1, 1, 2, rng.randint(3, 24), rng.randint(3, 24), 40])
    head_dim = rng.choice([1, 2, 3, 8, 16, 17, 32])
    shapes = [[batch, heads, q_len, head_dim], [batch, kv_heads, kv_len, head_dim], [batch, kv_heads, kv_len, head_dim]]
    wrong = rng.choice(["kv_heads", "heads", "kv_len", "head_dim0", "head_dim257", "v_head_dim", "batch", "rank",
                        "dtype_mismatch", "float64", "int", "not_tensor", "device"]) if fault == "tensors" else None
    if wrong == "kv_heads":
        shapes[1][1] = shapes[2][1] = 0
        invalid = "key/value heads"
    elif wrong == "heads":
        shapes[0][1], shapes[1][1], shapes[2][1] = 3, 2, 2
        invalid = "heads"
    elif wrong == "kv_len":
        shapes[1][2] = shapes[2][2] = 0
        invalid = "sequence length 0"
    elif wrong in ("head_dim0", "head_dim257"):
        for shape in shapes:
            shape[3] = 0 if wrong == "head_dim0" else 257
        invalid = "head dim"
    elif wrong == "v_head_dim":
        shapes[2][3] = head_dim + 1
        invalid = "head dims differ"
    elif wrong == "batch":
        shapes[1][0] = shapes[2][0] = batch + 1
        invalid = "batch"
    notes.append(str(dtype))
    q, k, v = (layout_tensor(rng, gen, torch.Size(shape), dtype, DEVICE, notes) for shape in shapes)
    if wrong == "rank":
        q, invalid = q.flatten(0, 1), "4 dimensions"
    elif wrong == "dtype_mismatch":
        k, invalid = k.to(torch.float32 if dtype != torch.float32 else torch.float16), "dtype"
    elif wrong in ("float64", "int"):
        q, k, v = (t.to(torch.float64 if wrong == "float64" else torch.int64) for t in (q, k, v))
        invalid = "dtype"
    elif wrong == "not_tensor":
        v, invalid = v.tolist(), "torch.Tensor"
    elif wrong == "device":  # the CPU against the GPU there; a meta tensor on a CPU machine
        k, invalid = k.to("cpu" if DEVICE == "cuda" else "meta"), "cpu" if DEVICE == "cuda" else "meta"
    if wrong:
        notes.append(f"wrong: {wrong}")

    # NaN and inf in valid inputs (the README's "NaN and inf")
    nonfinite = None
    if fault == "none" and rng.random() < 0.08 and q.numel() and k.numel():
        which = rng.choice(["q", "k", "v"])
        nonfinite = "v" if which == "v" else "qk"
        t = dict(q=q, k=k, v=v)[which].clone()  # an expanded tensor shares its elements: write to a copy
        t[tuple(rng.randrange(n) for n in t.shape)] = rng.choice([float("nan"), float("inf"), float("-inf")])
        q, k, v = (t if name == which else x for name, x in zip("qkv", (q, k, v)))
        notes.append(f"nonfinite in {which}")

    mask, mask_word = random_mask(rng, gen, (batch, heads, q_len, kv_len), DEVICE, notes, fault == "mask")
    kwargs = dict(return_lse=rng.random() < 0.5)  # return_lse="yes": issue 26's "boolean flags take bools" decides it
    if rng.random() < 0.6:
        kwargs["scale"] = rng.choice([rng.uniform(0.001, 3.0), 1e-3, 10.0])
    if rng.random() < 0.25:
        kwargs["topk"] = rng.choice([1, 2, rng.randint(1, kv_len + 2), kv_len, kv_len + 1])
    if rng.random() < 0.08:
        kwargs["dropout_p"] = rng.choice([0.0, 0.3, 0.9])
    if fault == "argument":
        invalid = rng.choice(["topk", "scale", "dropout_p"])
        kwargs[invalid] = rng.choice({"topk": [0, -1, 2.0, True, "3"],
                                      "scale": [0.0, -1.0, float("inf"), float("nan"), "x", True],
                                      "dropout_p": [1.0, -0.1, "x"]}[invalid])
    invalid = invalid or mask_word
    grad = fault == "none" and nonfinite is None and rng.random() < 0.12
    return Case(index, q, k, v, mask, kwargs, invalid, nonfinite, grad, rng.randrange(2**31), notes)


# ---------------------------------------------------------------------------------------
# running and checking a case
# ---------------------------------------------------------------------------------------
def call(case: Case, fn, q, k, v, mask):
    """fn(q, k, v, mask, **kwargs) with dropout's mask drawn from the case's seed (the reference
    takes the mask attngen's call used)."""
    kwargs = dict(case.kwargs)
    if fn is attngen.reference.attention and kwargs.get("dropout_p", 0) > 0:
        torch.manual_seed(case.dropout_seed)
        kwargs["dropout_mask"] = attngen.dropout_mask(case.q, case.k, kwargs["dropout_p"])
    torch.manual_seed(case.dropout_seed)
    out = fn(q, k, v, mask, **kwargs)
    return out if isinstance(out, tuple) else (out,)


def check_values(case: Case, pairs) -> list[str]:
    """Problems of each (name, got, reference, tolerance[, floor]): shape, NaN and inf, the finite
    values (relative error, over the reference's norm or `floor` where that is larger). The
    reference is first rounded to the result's dtype, as the best result could only be: a value
    under fp16's range (dropout keeping only a weight of 1e-9) is 0 there."""
    problems = []
    for name, g, w, tol, *floor in pairs:
        if g.shape != w.shape:
            problems.append(f"{name}: shape {tuple(g.shape)}, the reference's {tuple(w.shape)}")
            continue
        w = w.to(g.dtype).to(torch.float64)
        w_bad = ~torch.isfinite(w)
        if case.nonfinite == "v" and name == "out":  # NaN from v reaches at least the rows that see it
            if (~torch.isfinite(g) & ~w_bad).any():
                problems.append(f"{name}: not finite where the reference is finite")
            both = torch.isfinite(g) & ~w_bad
            g, w = g[both], w[both]
        else:
            for test in (torch.isnan, torch.isposinf, torch.isneginf):
                if not torch.equal(test(g), test(w)):
                    problems.append(f"{name}: {test.__name__} differs from the reference at "
                                    f"{(test(g) != test(w)).nonzero()[:4].tolist()}")
            g, w = g[~w_bad], w[~w_bad]
        err = (g.double() - w).norm().item() / max(w.norm().item(), *floor, 1e-300) if g.numel() else 0.0
        if err > tol:
            problems.append(f"{name}: relative error {err:.2e} over {tol:.1e}")
    return problems


def run_case(case: Case, outcomes: collections.Counter) -> list[str]:
    """Run one case; count its outcome; return its problems (none where it passes)."""
    q, k, v = case.q, case.k, case.v
    if case.grad:
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", append=True)  # every warning that no earlier filter stops
            mask = case.mask()
            got = call(case, attngen.attention, q, k, v, mask)
    except (ValueError, TypeError) as e:
        outcomes[f"{type(e).__name__} ({case.invalid or 'valid case!'})"] += 1
        if case.invalid is None:
            return [f"a valid case raised {type(e).__name__}: {e}"]
        if case.invalid.lower() not in str(e).lower():
            return [f"the error does not name {case.invalid!r}: {type(e).__name__}: {e}"]
        return []
    except Exception as e:  # noqa: BLE001: a crash is what the fuzz looks for
        outcomes[f"crash {type(e).__name__}"] += 1
        return [f"crashed: {''.join(traceback.format_exception(e))[-3000:]}"]
    if case.invalid is not None:
        outcomes["invalid case ran"] += 1
        return [f"ran, but the case is invalid ({case.invalid})"]
    outcomes["ran"] += 1
    if caught:
        return [f"warnings reached the caller: {[str(w.message) for w in caught]}"]
    topk = case.kwargs.get("topk")
    for feature, present in (("an empty output", case.q.numel() == 0), ("a mask", mask is not None),
                             ("top-k", topk is not None and topk < case.k.shape[2]),
                             ("dropout", case.kwargs.get("dropout_p", 0) > 0), ("gradients", case.grad),
                             ("NaN or inf", case.nonfinite is not None)):
        outcomes[f"ran with {feature}"] += present
    problems = []
    for name, t in zip(("out", "lse"), got):
        want = (case.q.shape, case.q.dtype) if name == "out" else (case.q.shape[:3], torch.float32)
        if (t.shape, t.dtype) != want or t.device != case.q.device:
            problems.append(f"{name}: {tuple(t.shape)} {t.dtype} on {t.device}, expected {want} on {case.q.device}")
    ref_inputs = [t.detach().to(torch.float64) for t in (case.q, case.k, case.v)]
    if case.grad:
        ref_inputs = [t.requires_grad_() for t in ref_inputs]
    with torch.enable_grad():
        want = call(case, attngen.reference.attention, *ref_inputs, mask)
    # top-k rows whose selection fp32 rounding may change
    rows = near_tie_rows(ref_inputs[0], ref_inputs[1], mask, topk, case.kwargs.get("scale"),
                         exact_ties=True, margin=1e-5)
    if topk is not None and topk < case.k.shape[2]:
        outcomes["top-k rows"] += rows.numel()
        outcomes["top-k rows left out (near ties)"] += int(rows.sum())
    pairs = [(name, g.detach()[~rows], w.detach()[~rows], tol) for name, g, w, tol
             in zip(("out", "lse"), got, want, (TOLERANCE[case.q.dtype], LSE_TOLERANCE))]
    if case.grad:
        dout = torch.randn(case.q.shape, generator=torch.Generator().manual_seed(case.index)).to(case.q.device)
        got_grads = torch.autograd.grad(got[0], (q, k, v), dout.to(case.q.dtype), allow_unused=True)
        want_grads = torch.autograd.grad(want[0], ref_inputs, dout.double(), allow_unused=True)
        # a gradient can cancel to ~0 (v's rows all equal, or one key: dq = dk = 0), where rounding
        # noise is all there is: errors are relative to at least a tenth of its size without
        # cancellation, in which dropout's 1 / (1 - p) scales dP (and its noise)
        scale = check_scale(case.kwargs.get("scale"), case.q.shape[-1])
        kept = 1.0 / (1.0 - case.kwargs.get("dropout_p", 0.0))
        size = [r.detach().abs().max().item() if r.numel() else 0.0 for r in ref_inputs]
        floors = [0.1 * dout.norm().item() * f
                  for f in (kept * scale * size[2] * size[1], kept * scale * size[2] * size[0], 1.0)]
        for name, g, w, t, r, floor in zip(("dq", "dk", "dv"), got_grads, want_grads, (q, k, v), ref_inputs, floors):
            g = torch.zeros_like(t) if g is None else g
            w = torch.zeros_like(r) if w is None else w
            if name == "dq":
                g, w = g[~rows], w[~rows]
            elif rows.any():
                continue  # a near tie's row reaches every key's gradient
            pairs.append((name, g, w, GRAD_TOLERANCE[case.q.dtype], floor))
    problems += check_values(case, pairs)
    return problems


def chunk_indices(chunk: int) -> list[int]:
    if ONLY is not None:
        return [int(ONLY)] if chunk == 0 else []
    return list(range(chunk, CASES, CHUNKS))


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_fuzz(chunk):
    outcomes, failures = collections.Counter(), []
    indices = chunk_indices(chunk)
    for index in indices:
        case = make_case(index)
        problems = run_case(case, outcomes)
        if problems:
            failures.append(f"{case}\n    " + "\n    ".join(problems))
    print(f"\nfuzz chunk {chunk}: {len(indices)} cases, seed {SEED}: {dict(sorted(outcomes.items()))}")
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:5])
