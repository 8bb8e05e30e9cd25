"""The runtime dispatcher: pick a kernel config for a call and run the forward kernel.

Where a config comes from, in order:
1. the registry of the current GPU (`tuned/<gpu>.yaml`): the user's registry first (or the one
   chosen by `use_registry` / ATTNGEN_REGISTRY), then the one shipped with attngen; the exact
   entry, else the nearest sequence bucket of the same variant, dtype, head dim and GQA group;
2. the per-architecture fallback table in attngen/config.py.
A short query (decoding) then gets a smaller BLOCK_M. The choice is cached per
(device, variant, dtype, head dim, sequence bucket, group, query rows), so a new sequence length
inside a bucket reuses the same compiled kernel.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import masks as masks_
from . import registry as registry_
from .checks import check_qkv, check_scale, check_topk, topk_pad
from .config import KernelConfig, arch_of, default_entry
from .kernels.forward import AttentionFunction, Plan, forward

log = logging.getLogger("attngen")
REGISTRY_ENV = "ATTNGEN_REGISTRY"
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Choice:
    config: KernelConfig
    source: str  # where the config came from, in words
    variant: str  # the registry's name of the kernel variant


_override: Path | None = None
_registries: dict[str, registry_.Registry] = {}
_choices: dict[tuple, Choice] = {}
_gpu_keys: dict[int, str] = {}
_plans: dict[tuple, Plan] = {}
_MAX_PLANS = 4096


def use_registry(path) -> None:
    """Read tuned configs from `path` (a folder of <gpu>.yaml, or one file) instead of the user registry.

    The registry shipped with attngen stays the fallback. `None` goes back to the default.
    """
    global _override
    if path is not None:
        path = Path(path).expanduser()
        if not path.exists():
            raise ValueError(f"use_registry: {str(path)!r} does not exist")
    _override = path
    _registries.clear()
    _choices.clear()
    _plans.clear()


def registry_paths() -> list[Path]:
    """The registry sources in lookup order."""
    first = _override or (Path(os.environ[REGISTRY_ENV]) if os.environ.get(REGISTRY_ENV) else registry_.user_dir())
    return [first, registry_.shipped_dir()]


def gpu_of(device: torch.device) -> str:
    """The registry key of a device: the normalised GPU name, or 'interpreter' for CPU tensors."""
    if device.type != "cuda":
        return registry_.INTERPRETER
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = _gpu_keys.get(index)
    if key is None:
        key = _gpu_keys[index] = registry_.gpu_key(torch.cuda.get_device_name(index))
    return key


def registry_for(gpu: str) -> registry_.Registry:
    reg = _registries.get(gpu)
    if reg is None:
        reg = _registries[gpu] = registry_.Registry.load(registry_paths(), gpu)
    return reg


def variant_of(mask: masks_.Mask | None, topk: int = 0) -> str:
    """The registry's name of a kernel variant: the mask's, plus `topk(<K rounded up to a power of two>)` for top-k."""
    base = mask.variant if mask is not None else "none"
    if not topk:
        return base
    return f"topk({topk_pad(topk)})" if mask is None else f"{base} & topk({topk_pad(topk)})"


def _choose(q, shape, mask: masks_.Mask | None, topk: int = 0) -> Choice:
    bucket = registry_.seq_bucket(shape.kv_len)
    rows = max(16, 1 << max(0, shape.q_len - 1).bit_length())
    cache_key = (q.device, q.dtype, shape.head_dim, bucket, shape.group, mask.key if mask is not None else None,
                 min(rows, 1 << 20), topk_pad(topk))
    choice = _choices.get(cache_key)
    if choice is not None:
        return choice
    gpu = gpu_of(q.device)
    variant = variant_of(mask, topk)
    key = registry_.EntryKey(variant=variant, direction="fwd", dtype=DTYPE_NAMES[q.dtype], head_dim=shape.head_dim,
                             seq_bucket=bucket, group=shape.group)
    found = registry_for(gpu).lookup(key)
    if found is not None:
        entry, reason = found
        config, source = entry.kernel_config(), f"registry: {reason}"
    else:
        arch = arch_of(q.device)
        config, row = default_entry(arch, shape.head_dim)
        source = f"no registry entry for {gpu}; {row}"
    if rows < config.block_m:  # a short query (decoding) fills a smaller tile
        config = replace(config, block_m=rows)
        source += f"; block_m cut to {rows} for q_len {shape.q_len}"
    choice = _choices[cache_key] = Choice(config, source, variant)
    log.debug("attngen: %s %s d%d s%d (bucket %d) group %d -> %s (%s)", variant, key.dtype, shape.head_dim,
              shape.kv_len, bucket, shape.group, config, source)
    return choice


def choose(q, k, v, mask=None, *, topk=None) -> Choice:
    """The config a call with these inputs would run, and where it came from."""
    shape = check_qkv(q, k, v, kernel=True)
    return _choose(q, shape, masks_.as_mask(mask), check_topk(topk, shape.kv_len))


def explain(q, k, v, mask=None, *, topk=None) -> str:
    """Says which config `attention(q, k, v, mask=mask, topk=topk)` would use, and why."""
    choice = choose(q, k, v, mask, topk=topk)
    return f"variant {choice.variant}; {q.dtype}; config {choice.config}; from {choice.source}"


def attention(q, k, v, mask=None, *, scale=None, return_lse=False, topk=None):
    """Attention of q (B, Hq, Sq, D) over k, v (B, Hkv, Sk, D) with an optional mask.

    mask: None, a template name ("causal") or a mask object (attngen.mask(...), combined with & |).
    scale: defaults to 1 / sqrt(D). Returns the output (q's dtype and shape), or (output, lse) with
    return_lse=True, lse being the natural-log log-sum-exp of every row, fp32, shape (B, Hq, Sq).
    topk: top-k softmax: each row's softmax runs over its `topk` largest scores among the keys the
    mask shows (every score equal to the topk-th largest is kept too); None or >= Sk: all of them.
    """
    m = masks_.as_mask(mask)
    tensors = isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    grad = torch.is_grad_enabled() and tensors and (q.requires_grad or k.requires_grad or v.requires_grad)
    if tensors and not grad and (m is None or not m.has_tensors):
        # fast path: one prepared launch per call signature
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, None if m is None else m.call_key, scale, return_lse, topk)
        plan = _plans.get(key)
        if plan is None:
            shape = check_qkv(q, k, v, kernel=True)
            if shape.q_len == 0:
                return _slow(q, k, v, m, scale, return_lse, topk, grad)
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            effective = check_topk(topk, shape.kv_len)
            plan = _plans[key] = Plan(q, k, v, m, shape, check_scale(scale, shape.head_dim), effective, return_lse,
                                      _choose(q, shape, m, effective).config)
        out, lse = plan.run(q, k, v)
        return (out, lse) if return_lse else out
    return _slow(q, k, v, m, scale, return_lse, topk, grad)


def _slow(q, k, v, m, scale, return_lse, topk, grad):
    """Every call checked in full: autograd, masks with tensor parameters, empty queries."""
    shape = check_qkv(q, k, v, kernel=True)
    topk = check_topk(topk, shape.kv_len)
    config = _choose(q, shape, m, topk).config
    scale = check_scale(scale, shape.head_dim)
    if grad:
        out, lse = AttentionFunction.apply(q, k, v, m, shape, scale, topk, return_lse, config)
    else:
        out, lse = forward(q, k, v, m, shape, scale, topk, return_lse, config)
    return (out, lse) if return_lse else out
