"""Search spaces (`search_spaces/*.yaml`): the values the tuner may try, and the static rules."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import yaml

from ..config import KernelConfig, block_d_for
from ..expr import Expr, ExprError
from ..paths import data_dir

TUNABLES = tuple(f.name for f in fields(KernelConfig))
REQUIRED = tuple(f.name for f in fields(KernelConfig) if f.default is MISSING)  # the ones without a default
CONSTRAINT_NAMES = set(TUNABLES) | {"head_dim", "block_d", "elem_bytes", "seq_len", "topk_pad"}


class SpaceError(ValueError):
    """A search-space file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Constraint:
    expr: Expr
    why: str


@dataclass(frozen=True)
class SearchSpace:
    path: Path
    kernel: str  # the kernel family it is for (attngen.families)
    values: dict  # arch -> {tunable: [values]}
    constraints: tuple[Constraint, ...]
    start: dict = field(default_factory=dict)  # arch -> (KernelConfig, ...): tried first by every new study

    def for_arch(self, arch: str) -> dict[str, list]:
        if arch not in self.values:
            raise SpaceError(f"{self.path}: no search space for architecture {arch!r} "
                             f"(has {', '.join(sorted(self.values))})")
        return self.values[arch]

    def size(self, arch: str) -> int:
        n = 1
        for values in self.for_arch(arch).values():
            n *= len(values)
        return n

    def violations(self, config: KernelConfig, *, head_dim: int, elem_bytes: int, seq_len: int,
                   topk_pad: int = 0) -> list[str]:
        """The `why` of every constraint the config breaks (topk_pad: K rounded up to a power of two, 0 without)."""
        env = dict(config.as_dict(), head_dim=head_dim, block_d=block_d_for(head_dim), elem_bytes=elem_bytes,
                   seq_len=seq_len, topk_pad=topk_pad)
        return [c.why for c in self.constraints if not bool(c.expr.evaluate(env))]


def load_space(path) -> SearchSpace:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpaceError(f"{path}: cannot read search space: {e}") from None
    if not isinstance(data, dict):
        raise SpaceError(f"{path}: a search space is a mapping with kernel, arch, constraints")
    unknown = set(data) - {"kernel", "arch", "constraints", "start"}
    if unknown:
        raise SpaceError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    for key in ("kernel", "arch"):
        if key not in data:
            raise SpaceError(f"{path}: missing {key!r}")
    if not isinstance(data["arch"], dict) or not data["arch"]:
        raise SpaceError(f"{path}: arch must map architecture names to tunable values")
    values = {}
    for arch, table in data["arch"].items():
        if not isinstance(table, dict) or set(table) != set(TUNABLES):
            raise SpaceError(f"{path}: arch {arch!r} must list exactly {', '.join(TUNABLES)}")
        for name, options in table.items():
            kind = bool if name in ("use_tma", "warp_specialize") else int
            if (not isinstance(options, list) or not options
                    or any(type(v) is not kind for v in options) or len(set(options)) != len(options)):
                raise SpaceError(f"{path}: arch {arch!r} {name} must be a list of distinct {kind.__name__} values, "
                                 f"got {options!r}")
        for value in table["block_m"] + table["block_n"]:
            if value < 16 or value & (value - 1):
                raise SpaceError(f"{path}: arch {arch!r}: block sizes must be powers of two >= 16, got {value}")
        values[arch] = {name: list(table[name]) for name in TUNABLES}
    constraints = []
    for i, item in enumerate(data.get("constraints") or []):
        if not isinstance(item, dict) or set(item) != {"expr", "why"}:
            raise SpaceError(f"{path}: constraint {i} must have exactly `expr` and `why`")
        try:
            constraints.append(Constraint(Expr(str(item["expr"]), CONSTRAINT_NAMES, {}), str(item["why"])))
        except ExprError as e:
            raise SpaceError(f"{path}: constraint {i}: {e}") from None
    return SearchSpace(path, str(data["kernel"]), values, tuple(constraints), _start_configs(path, data, values))


def _start_configs(path: Path, data: dict, values: dict) -> dict:
    """The `start` key: per architecture, configs (mappings of tunables; use_tma and
    warp_specialize may be left out: false) that every new study tries first. Each must lie inside
    its architecture's values."""
    start = data.get("start") or {}
    if not isinstance(start, dict):
        raise SpaceError(f"{path}: start must map architecture names to lists of configs")
    out = {}
    for arch, items in start.items():
        if arch not in values:
            raise SpaceError(f"{path}: start names architecture {arch!r}, which arch does not list")
        if not isinstance(items, list):
            raise SpaceError(f"{path}: start {arch!r} must be a list of configs")
        configs = []
        for i, item in enumerate(items):
            if not isinstance(item, dict) or not set(REQUIRED) <= set(item) <= set(TUNABLES):
                raise SpaceError(f"{path}: start {arch!r} config {i} must map {', '.join(REQUIRED)} (and "
                                 f"optionally {', '.join(n for n in TUNABLES if n not in REQUIRED)}), got {item!r}")
            config = KernelConfig(**item)
            outside = [n for n in TUNABLES if getattr(config, n) not in values[arch][n]]
            if outside:
                raise SpaceError(f"{path}: start {arch!r} config {i} has {', '.join(outside)} outside "
                                 f"the values arch {arch!r} lists")
            configs.append(config)
        out[arch] = tuple(configs)
    return out


def find_space(name_or_path: str, kernel: str) -> SearchSpace:
    """A space by file name in search_spaces/ (`forward_small`) or by path, for kernel family `kernel`."""
    shipped = data_dir("search_spaces") / f"{name_or_path}.yaml"
    space = load_space(shipped if shipped.is_file() else Path(name_or_path))
    if space.kernel != kernel:
        raise SpaceError(f"{space.path} is a space for {space.kernel!r} kernels, not {kernel!r}")
    return space
