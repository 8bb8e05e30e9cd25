"""The public entry point: pick a kernel config for a call and run the forward kernel."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import masks as masks_
from .checks import check_qkv
from .config import KernelConfig, arch_of, default_config
from .kernels.forward import AttentionFunction, attention_forward


@dataclass(frozen=True)
class Choice:
    config: KernelConfig
    source: str  # where the config came from, in words


def choose(q, k, v, mask=None) -> Choice:
    """The config a call with these inputs would run, and why."""
    shape = check_qkv(q, k, v, kernel=True)
    arch = arch_of(q.device)
    config = default_config(arch, shape.head_dim)
    source = f"default config for {arch}, head dim <= {_bucket(arch, shape.head_dim)}"
    # a short query (decoding) fills a smaller tile; never below tl.dot's 16 rows
    rows = max(16, 1 << max(0, shape.q_len - 1).bit_length())
    if rows < config.block_m:
        config = replace(config, block_m=rows)
        source += f", block_m cut to {rows} for q_len {shape.q_len}"
    return Choice(config, source)


def _bucket(arch: str, head_dim: int) -> int:
    from .config import DEFAULTS

    return next(d for d, _ in DEFAULTS.get(arch, DEFAULTS["generic"]) if head_dim <= d)


def explain(q, k, v, mask=None) -> str:
    """Says which config `attention(q, k, v, mask=mask)` would use and where it came from."""
    m = masks_.as_mask(mask)
    choice = choose(q, k, v, m)
    variant = m.variant if m is not None else "none"
    return f"mask {variant}; {q.dtype}; config {choice.config}; from {choice.source}"


def attention(q, k, v, mask=None, *, scale=None, return_lse=False):
    """Attention of q (B, Hq, Sq, D) over k, v (B, Hkv, Sk, D) with an optional mask.

    mask: None, a template name ("causal") or a mask object (attngen.mask(...), combined with & |).
    scale: defaults to 1 / sqrt(D). Returns the output (q's dtype and shape), or (output, lse) with
    return_lse=True, lse being the natural-log log-sum-exp of every row, fp32, shape (B, Hq, Sq).
    """
    m = masks_.as_mask(mask)
    config = choose(q, k, v, m).config
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = AttentionFunction.apply(q, k, v, m, scale, return_lse, config)
    else:
        out, lse = attention_forward(q, k, v, m, scale=scale, return_lse=return_lse, config=config)
    return (out, lse) if return_lse else out
