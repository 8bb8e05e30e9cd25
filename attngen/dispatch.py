"""The dispatcher: which kernel config a call runs, and where it came from.

For a kernel family (attngen.families) and a call, in order:
1. the registry of the current GPU (`tuned/<gpu>.yaml`): the user's registry first (or the one
   chosen by `use_registry` / ATTNGEN_REGISTRY), then the one shipped with attngen; the exact
   entry, else the nearest sequence bucket of the same variant, dtype, head dim and GQA group;
   only entries tuned on the family's current kernel revision count (attngen.families);
2. the family's fallback row for the architecture (attngen/config.py, DEFAULTS);
then the family fits the config to the call (the forward family cuts BLOCK_M for a short query;
the backward takes wider tiles under dropout or the atomic dQ), and a config whose estimated shared
memory exceeds the device's at the call's element size (an fp32 call at a row chosen for 16-bit
inputs) runs with fewer pipeline stages.
Choices are cached per (family, device, dtype, head dim, sequence bucket, group, mask, query rows,
top-k bucket), so a new sequence length inside a bucket reuses the same compiled kernel.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import masks as masks_
from .caches import BoundedCache
from .checks import check_qkv, check_topk, topk_pad
from .config import KernelConfig, arch_of, shared_memory_limit
from .dtypes import NAMES as DTYPE_NAMES
from .families import BACKWARD, FORWARD, KernelFamily, family, query_rows
from .kernels.backward import topk_config
from .kernels.decode import takes_short_query
from .tuning import registry as registry_

log = logging.getLogger("attngen")
REGISTRY_ENV = "ATTNGEN_REGISTRY"


@dataclass(frozen=True)
class Choice:
    config: KernelConfig
    source: str  # where the config came from, in words
    variant: str  # the registry's name of the kernel variant
    kernel: str  # the kernel family


_override: Path | None = None
_registries = BoundedCache("dispatch.registries", 16)  # GPU key -> Registry
_choices = BoundedCache("dispatch.choices", 4096)  # see choose_config's cache_key
_gpu_keys: dict[int, str] = {}  # device index -> GPU key (one entry per GPU of the machine)
_smem_limits: dict[torch.device, int | None] = {}  # device -> its shared memory limit (smem_limit)
_listeners: list = []  # functions called when the registry changes (the plan cache of attngen.api)


def use_registry(path) -> None:
    """Read tuned configs from `path` (a folder of <gpu>.yaml, or one file) instead of the user registry.

    The registry shipped with attngen stays the fallback. `None` goes back to the default.
    """
    global _override
    _override = None if path is None else _existing(path, "use_registry")
    _registries.clear()
    _choices.clear()
    for listener in _listeners:
        listener()


def on_registry_change(callback) -> None:
    """Call `callback()` whenever use_registry changes the registry (caches of chosen configs drop)."""
    _listeners.append(callback)


def _existing(path, who: str) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"{who}: {str(path)!r} does not exist (a registry is a folder of <gpu>.yaml files or one "
                         "such file)")
    return path


def registry_paths() -> list[Path]:
    """The registry sources in lookup order. ATTNGEN_REGISTRY naming no file or folder is the same
    error as use_registry on that path (raised at the first lookup)."""
    if _override is not None:
        first = _override
    elif os.environ.get(REGISTRY_ENV):
        first = _existing(os.environ[REGISTRY_ENV], REGISTRY_ENV)
    else:
        first = registry_.user_dir()
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


def smem_limit(device: torch.device) -> int | None:
    """config.shared_memory_limit of a device, asked once."""
    if device not in _smem_limits:
        _smem_limits[device] = shared_memory_limit(device)
    return _smem_limits[device]


def registry_for(gpu: str) -> registry_.Registry:
    reg = _registries.get(gpu)
    if reg is None:
        generation = _registries.generation  # use_registry meanwhile: this one is not kept
        reg = _registries.put(gpu, registry_.Registry.load(registry_paths(), gpu), generation)
    return reg


def choose_config(family: KernelFamily, q: torch.Tensor, shape, mask: masks_.Mask | None, topk: int = 0,
                  dropout: bool = False, paged: bool = False, atomic_dq: bool = False) -> Choice:
    """The config `family` runs a call with (checked inputs; topk as check_topk returns it; dropout:
    whether the call drops weights, and atomic_dq whether its backward adds dQ atomically
    (deterministic=False), which some tiles cannot afford the registers for; paged: a
    decode call over a paged cache, which takes the defaults: the tuner times contiguous caches,
    and a paged cache's gathered rows want other tiles than a contiguous one's)."""
    bucket = registry_.seq_bucket(shape.kv_len)
    rows = min(query_rows(shape.q_len), 1 << 20)
    group = max(shape.group, 1)  # q with no heads (an empty call) runs nothing: any group will do
    batch = family.batch_bucket(shape.batch)
    # what makes the kernels hold more a tile (a top-k call's backward off Hopper runs at the threshold
    # kernels' tiles whatever the config: kernels.backward.topk_config)
    wide = "dropout" if dropout else "atomic dQ" if atomic_dq else ""
    table = family.table(shape, q.device, paged, mask)
    cache_key = (family.name, q.device, q.dtype, shape.head_dim, bucket, group,
                 mask.key if mask is not None else None, rows, topk_pad(topk), batch, wide, table, paged)
    choice = _choices.get(cache_key)
    if choice is not None:
        return choice
    generation = _choices.generation  # use_registry meanwhile: this choice is not kept
    gpu = gpu_of(q.device)
    variant = registry_.variant_of(mask, topk)
    key = registry_.EntryKey(variant=variant, kernel=family.name, dtype=DTYPE_NAMES[q.dtype],
                             head_dim=shape.head_dim, seq_bucket=bucket, group=group, batch_bucket=batch)
    registry = registry_for(gpu)
    found = None if paged else registry.lookup(key, family.revision)
    if found is not None:
        entry, reason = found
        config, source = entry.kernel_config(), f"registry: {reason}"
    else:
        config, row = family.default(arch_of(q.device), shape.head_dim, table)
        if paged:
            source = f"a paged cache takes the defaults (the registry's entries are tuned on contiguous caches); {row}"
        elif others := registry.other_revisions(key, family.revision):
            path, entry = others[0]
            source = (f"no registry entry for {gpu} of {family.name} kernel revision {family.revision}: "
                      f"{len(others)} of another revision (revision {entry.revision} in {path}) ignored, as "
                      f"their timings were of other kernels (`attngen tune --kernel {family.name}` retunes); {row}")
        else:
            source = f"no registry entry for {gpu}; {row}"
    config, note = family.fit(config, shape.q_len)
    if note:
        source += f"; {note}"
    if wide:
        config, note = family.fit_wide(config, wide)
        if note:
            source += f"; {note}"
    config, note = config.fit_shared_memory(shape.head_dim, q.element_size(), smem_limit(q.device), family.name)
    if note:
        source += f"; {note}"
    choice = _choices.put(cache_key, Choice(config, source, variant, family.name), generation)
    log.debug("attngen: %s %s %s d%d s%d (bucket %d) group %d -> %s (%s)", family.name, variant, key.dtype,
              shape.head_dim, shape.kv_len, bucket, group, config, source)
    return choice


def train_configs(q: torch.Tensor, shape, mask: masks_.Mask | None, topk: int, dropout_p: float,
                  deterministic: bool = True) -> tuple[KernelConfig, KernelConfig]:
    """(forward config, backward config) of a call with gradients (checked inputs), as
    attngen.kernels.autograd.TrainPlan takes them."""
    return (choose_config(FORWARD, q, shape, mask, topk, dropout_p > 0).config,
            choose_config(BACKWARD, q, shape, mask, topk, dropout_p > 0, atomic_dq=not deterministic).config)


def choose(q, k, v, mask=None, *, topk=None, kernel: str = "fwd") -> Choice:
    """The config a call with these inputs would run, and where it came from."""
    family_ = family(kernel)
    shape = check_qkv(q, k, v, kernel=True)
    return choose_config(family_, q, shape, masks_.as_mask(mask), check_topk(topk, shape.kv_len))


def explain(q, k, v, mask=None, *, topk=None) -> str:
    """Says which kernel and config `attention(q, k, v, mask=mask, topk=topk)` would use, and why;
    for inputs that require grad, the backward's too. A short query without gradients runs on the
    decode kernels (attngen.kernels.decode.takes_short_query)."""
    lines = []
    kernels = ("fwd", "bwd") if (q.requires_grad or k.requires_grad or v.requires_grad) else ("fwd",)
    if kernels == ("fwd",):
        shape = check_qkv(q, k, v, kernel=True)
        if takes_short_query(shape, check_topk(topk, shape.kv_len), 0.0):
            kernels = ("decode",)
    for kernel in kernels:
        choice = choose(q, k, v, mask, topk=topk, kernel=kernel)
        lines.append(f"{choice.kernel} kernel, variant {choice.variant}; {q.dtype}; config {choice.config}; "
                     f"from {choice.source}")
        if kernel == "bwd" and check_topk(topk, k.shape[-2]):
            config, fwd_orient = topk_config(choice.config, choose(q, k, v, mask, topk=topk).config, q.device,
                                             q.shape[-1], q.element_size())
            if fwd_orient:
                lines[-1] += (f"; a top-k call's backward runs at the threshold kernels' config {config}, the "
                              "scores computed queries first (kernels.backward.topk_config)")
            elif config != choice.config:
                lines[-1] += (f"; a top-k call's backward runs at {config}, tiles at least 32 queries wide "
                              "(kernels.backward.topk_config)")
    return "\n".join(lines)
