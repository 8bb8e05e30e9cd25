"""Kernel families: one small record each, which dispatch, tune, bench and explain look up.

A family is a kind of kernel with its own templates, search space and registry entries: the
forward kernel (`fwd`, top-k included), the backward kernels (`bwd`) and the decode kernels
(`decode`: split-KV over a KV cache). Adding one is adding a
record here (and its template, space, launcher and fallback row in attngen/config.py), not editing
the modules that use them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from . import masks as masks_
from . import reference
from .checks import check_qkv, check_scale, check_topk
from .config import KernelConfig, arch_of, default_config, default_entry
from .kernels.backward import BackwardPlan, backward
from .kernels.decode import decode_forward, decode_plan
from .kernels.decode import default_table as decode_default_table
from .kernels.forward import Plan, attention_forward, forward
from .tools.timing import BWD_FACTOR, attention_flops
from .tuning import registry as registry_


@dataclass(frozen=True)
class KernelFamily:
    name: str  # the registry's `kernel` key and `attngen tune --kernel NAME`
    # the kernels' revision: raised by a change to them that can change which config is fastest (their
    # loops, loads, what a tile holds). The tuner records it in each registry entry, and the
    # dispatcher ignores entries of another revision, whose timings were of another kernel.
    revision: int
    doc: str
    templates: tuple[str, ...]  # the kernel templates it renders (templates/kernels/<name>.py.jinja)
    space: str  # its default search space (search_spaces/<space>.yaml) ...
    topk_space: str  # ... and that of its top-k variants
    inputs: tuple[str, ...]  # the tensors a run takes: "q" (B, Hq, S, D) or "kv" (B, Hkv, S, D) each
    outputs: tuple[str, ...]  # the tensors a run returns, likewise
    run: Callable  # (*inputs, mask, *, topk, config) -> [outputs]
    reference: Callable  # (*inputs, mask, *, topk) -> [the outputs in float64, attngen.reference]
    flops: Callable  # (mask, batch, heads, q_len, kv_len, head_dim, device) -> FLOPs of one run
    fit: Callable  # (config, q_len) -> (config, note): the chosen config adapted to one call's shape
    # (config, why) -> (config, note): the config adapted to a call whose kernels hold more per tile
    # (why: "dropout", without top-k; "atomic dQ", deterministic=False)
    fit_wide: Callable = lambda config, why: (config, "")
    query_len: int | None = None  # the tuner's query length: None for Sq = Sk, else this many new tokens
    per_batch: bool = False  # registry entries per batch bucket (else one entry serves every batch)
    # (shape, device, paged, mask) -> the attngen.config.DEFAULTS key of a call's fallback config (None: the name)
    default_table: Callable | None = None
    # (*inputs, mask, *, topk, config) -> a function of the inputs that runs them (-> [outputs]) with
    # the host-side work that does not depend on the tensors done once, for the tuner to time; None:
    # `run` is timed as it is
    prepare: Callable | None = None

    def batch_bucket(self, batch: int) -> int:
        """The registry key's batch bucket of a call: 0 (any) unless the family tunes per batch."""
        return registry_.batch_bucket(batch) if self.per_batch and batch > 0 else 0

    def table(self, shape, device, paged: bool = False, mask=None) -> str:
        """The DEFAULTS key of a call's fallback config (paged: a decode call over a paged cache)."""
        return self.default_table(shape, device, paged, mask) if self.default_table is not None else self.name

    def default(self, arch: str, head_dim: int, table: str | None = None) -> tuple[KernelConfig, str]:
        """The fallback config where the registry has none (from DEFAULTS[table], by default the
        family's own), and where it comes from."""
        return default_entry(table or self.name, arch, head_dim)


def query_rows(q_len: int) -> int:
    """The query length rounded up to a power of two, at least 16: the rows a short query fills."""
    return max(16, 1 << max(0, q_len - 1).bit_length())


# ---------------------------------------------------------------------------------------
# fwd: the forward kernel (and its top-k threshold kernels)
# ---------------------------------------------------------------------------------------
def _forward_run(q, k, v, mask, *, topk, config):
    return [attention_forward(q, k, v, mask, topk=topk, config=config)[0]]


def _forward_prepare(q, k, v, mask, *, topk, config):
    """The dispatcher's prepared launch (kernels.forward.Plan) of the call, built once."""
    shape = check_qkv(q, k, v, kernel=True)
    plan = Plan(q, k, v, masks_.as_mask(mask), shape, check_scale(None, shape.head_dim), check_topk(topk, shape.kv_len),
                False, config)
    return lambda q, k, v: [plan.run(q, k, v)[0]]


def _forward_reference(q, k, v, mask, *, topk):
    return [reference.attention(q, k, v, mask, topk=topk)]


def _forward_fit(config: KernelConfig, q_len: int) -> tuple[KernelConfig, str]:
    """A short query (decoding) fills a smaller query tile."""
    rows = query_rows(q_len)
    if rows < config.block_m:
        return replace(config, block_m=rows), f"block_m cut to {rows} for q_len {q_len}"
    return config, ""


def _forward_table(shape, device, paged: bool, mask) -> str:
    """The DEFAULTS key of a forward call's fallback: "fwd_varlen" for packed sequences (a mask of
    attngen.varlen_attention: its terms read per-query tensors of the packing), else "fwd"."""
    if mask is not None and any(term.template.name == masks_.SEQUENCE_KEYS
                                or term.template.name.endswith(masks_.LOCAL_SUFFIX) for term in mask.terms()):
        return "fwd_varlen"
    return "fwd"


FORWARD = KernelFamily(
    name="fwd",
    revision=1,
    doc="forward attention (FlashAttention-2 online softmax), top-k softmax included",
    templates=("forward", "topk"),
    space="forward",
    topk_space="forward_topk",
    inputs=("q", "kv", "kv"),
    outputs=("q",),
    run=_forward_run,
    reference=_forward_reference,
    flops=attention_flops,
    fit=_forward_fit,
    default_table=_forward_table,
    prepare=_forward_prepare,
)


# ---------------------------------------------------------------------------------------
# bwd: the backward kernels; a run is the forward (at the forward's fallback config) and the backward
# ---------------------------------------------------------------------------------------
def _backward_run(q, k, v, dout, mask, *, topk, config, deterministic=True):
    shape = check_qkv(q, k, v, kernel=True)
    scale, topk = check_scale(None, shape.head_dim), check_topk(topk, shape.kv_len)
    fwd_config = default_config("fwd", arch_of(q.device), shape.head_dim)
    out, lse, thr = forward(q, k, v, mask, shape, scale, topk, True, fwd_config)
    return list(backward(q, k, v, out, lse, thr, dout, None, mask, shape, scale, config, fwd_config,
                         deterministic=deterministic))


def _backward_prepare(q, k, v, dout, mask, *, topk, config):
    """_backward_run's forward and backward as prepared launches (Plan, BackwardPlan), built once."""
    shape = check_qkv(q, k, v, kernel=True)
    scale, topk, mask = check_scale(None, shape.head_dim), check_topk(topk, shape.kv_len), masks_.as_mask(mask)
    fwd_config = default_config("fwd", arch_of(q.device), shape.head_dim)
    fwd = Plan(q, k, v, mask, shape, scale, topk, True, fwd_config)
    out, lse, thr = fwd.launch(q, k, v, 0)
    bwd = BackwardPlan(q, k, v, out, lse, thr, dout, mask, shape, scale, config, fwd_config)

    def run(q, k, v, dout):
        out, lse, thr = fwd.launch(q, k, v, 0)
        return list(bwd.run(q, k, v, out, lse, thr, dout, None))
    return run


def _backward_reference(q, k, v, dout, mask, *, topk):
    q, k, v = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out = reference.attention(q, k, v, mask, topk=topk)
        return list(torch.autograd.grad(out, (q, k, v), dout.to(torch.float64)))


def _backward_flops(mask, batch, heads, q_len, kv_len, head_dim, device) -> int:
    """The forward's FLOPs and the backward's (BWD_FACTOR times those): a run does both."""
    return int(attention_flops(mask, batch, heads, q_len, kv_len, head_dim, device) * (1 + BWD_FACTOR))


def _backward_table(shape, device, paged: bool, mask) -> str:
    """The DEFAULTS key of a backward call's fallback: "bwd_dense" for dense and causal calls (no
    mask, or `causal` alone without score modifiers), else "bwd"."""
    if mask is None or (not mask.mods and (mask.tree is None or (isinstance(mask.tree, masks_.Term)
                                                                 and mask.tree.template.name == "causal"))):
        return "bwd_dense"
    return "bwd"


def _backward_fit_wide(config: KernelConfig, why: str) -> tuple[KernelConfig, str]:
    """Under dropout the dK/dV programs need registers for the random bits, and with the atomic dQ
    (deterministic=False) for a dQ tile: on 4 warps they spill them (sm_90, D 128, 64 x 64 tiles:
    1100 and 888 bytes a thread, against 480 without either; attngen.tools.cross_compile), so it
    takes 8 warps, 128-key blocks and 3 stages (an H200, bf16, B=4 H=16 S=4096: p = 0.1, 6.53 ms
    against 7.24 at 64 x 64 on 4 warps; atomic dQ, 5.10 against 8.69; benchmarks/RESULTS.md)."""
    if config.num_warps < 8 and config.block_m <= 64:
        return replace(config, block_n=128, num_warps=8, num_stages=3), f"8 warps, 128-key blocks under {why}"
    return config, ""


BACKWARD = KernelFamily(
    name="bwd",
    revision=2,  # 2: the loads and loops of 1034859 and 38393c7 (2026-12-05 to 07)
    doc="backward attention (dQ, dK, dV; FlashAttention-2 structure, deterministic)",
    templates=("backward",),
    space="backward",
    topk_space="backward",
    inputs=("q", "kv", "kv", "q"),
    outputs=("q", "kv", "kv"),
    run=_backward_run,
    reference=_backward_reference,
    flops=_backward_flops,
    fit=lambda config, q_len: (config, ""),
    fit_wide=_backward_fit_wide,
    default_table=_backward_table,
    prepare=_backward_prepare,
)


# ---------------------------------------------------------------------------------------
# decode: split-KV attention of new tokens over a KV cache; the tuner runs a full contiguous cache
# ---------------------------------------------------------------------------------------
def _decode_run(q, k, v, mask, *, topk, config):
    return [decode_forward(q, k, v, mask=mask, config=config)[0]]


def _decode_prepare(q, k, v, mask, *, topk, config):
    """A full contiguous cache's plan, built once: building one takes longer on the host than a call's
    kernels take on the GPU, so timing _decode_run would time the host."""
    plan = decode_plan(q, k, v, mask=mask, config=config)
    return lambda q, k, v: [plan.run(q, k, v, None, None)[0]]


def _decode_reference(q, k, v, mask, *, topk):
    return [reference.decode(q, k, v, mask=mask)]


DECODE = KernelFamily(
    name="decode",
    revision=1,
    doc="decoding over a KV cache, contiguous or paged, its keys split across programs",
    templates=("decode",),
    space="decode",
    topk_space="decode",
    inputs=("q", "kv", "kv"),
    outputs=("q",),
    run=_decode_run,
    reference=_decode_reference,
    flops=attention_flops,
    fit=lambda config, q_len: (config, ""),
    query_len=1,
    per_batch=True,
    default_table=decode_default_table,
    prepare=_decode_prepare,
)

FAMILIES: dict[str, KernelFamily] = {family.name: family for family in (FORWARD, BACKWARD, DECODE)}


def family(name: str, option: str = "kernel") -> KernelFamily:
    """The family called `name`; a ValueError naming `option` and the known names otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"{option} must be one of {', '.join(FAMILIES)}, got {name!r}")
    return FAMILIES[name]
