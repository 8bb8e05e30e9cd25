"""Mask and score templates: the YAML files, their parameters, and where they are found.

A template is a small YAML file (`templates/masks/*.yaml`, or a folder of the user's):

    doc: what it does
    kind: mask            # or score: a modifier of the attention score
    params:               # optional
      window: {type: int, min: 1, doc: ...}
    expr: "abs(q_idx - kv_idx) < window"

Parameter types: `int` and `float` are run-time scalars (kernel arguments: a new value never
recompiles; `min` and `max` bound them, inclusive; a float must be finite); `bool` and `choice` are static (Jinja variables inside `expr`, so they pick the
kernel's structure); `tensor` has a `shape` made of `batch`, `heads`, `q_len`, `kv_len`
(a size of 1 broadcasts for `batch` and `heads`) or `q_len/P`, `kv_len/P` (the length divided
by the template's int parameter P, rounded up: one entry per block of P positions), and a
`dtype` of `int`, `float` or `bool`.

A template whose predicate is one value per (block_m x block_n) block of a tensor says so with
`block_layout: <tensor parameter>` (shape [batch, heads, q_len/block_m, kv_len/block_n]): its
tiles are then classified from the layout alone, without evaluating the expression per position.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from ..expr import INDEX_NAMES, SCORE_NAME, Expr, ExprError
from ..paths import data_dir
from ..render import TemplateError, render_string

PARAM_TYPES = ("int", "float", "bool", "choice", "tensor")
TENSOR_DIMS = ("batch", "heads", "q_len", "kv_len")
BROADCAST_DIMS = ("batch", "heads")
TENSOR_DTYPES = ("int", "float", "bool")
MISSING = object()  # a parameter without a default


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: object = MISSING
    doc: str = ""
    choices: tuple = ()
    min: float | None = None  # bounds of an int or float parameter (inclusive)
    max: float | None = None
    shape: tuple[str, ...] = ()
    dtype: str = "float"

    @property
    def static(self) -> bool:
        return self.type in ("bool", "choice")

    @property
    def required(self) -> bool:
        return self.default is MISSING

    def describe(self) -> str:
        if self.type == "tensor":
            kind = f"{self.dtype} tensor of shape ({', '.join(self.shape)})"
        elif self.type == "choice":
            kind = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            kind = self.type + self._bounds()
        default = "" if self.required else f", default {self.default!r}"
        return f"{self.name}: {kind}{default}"

    def _bounds(self) -> str:
        """" >= 1", " <= 8", " in [0.5, 2]" or ""."""
        if self.min is not None and self.max is not None:
            return f" in [{self.min:g}, {self.max:g}]"
        if self.min is not None:
            return f" >= {self.min:g}"
        return f" <= {self.max:g}" if self.max is not None else ""

    def check(self, template: str, value):
        """Check one value given by the user; returns it normalised."""
        where = f"mask {template!r} parameter {self.name!r}"
        if self.type == "int":
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{where} must be an int, got {type(value).__name__} {value!r}")
            value = int(value)
        elif self.type == "float":
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{where} must be a float, got {type(value).__name__} {value!r}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{where} must be a finite number, got {value!r}")
        elif self.type == "bool":
            if not isinstance(value, bool):
                raise TypeError(f"{where} must be a bool, got {type(value).__name__} {value!r}")
        elif self.type == "choice":
            if value not in self.choices:
                raise ValueError(f"{where} must be one of {', '.join(map(repr, self.choices))}, got {value!r}")
        elif self.type == "tensor":
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where} must be a torch.Tensor of shape ({', '.join(self.shape)}), "
                                f"got {type(value).__name__}")
            missing = len(self.shape) - value.dim()
            if 0 < missing and all(d in BROADCAST_DIMS for d in self.shape[:missing]):
                value = value.reshape((1,) * missing + tuple(value.shape))  # leading batch/heads broadcast
            if value.dim() != len(self.shape):
                raise ValueError(f"{where} must have {len(self.shape)} dimension(s) ({', '.join(self.shape)}), "
                                 f"got shape {tuple(value.shape)}")
            if _tensor_kind(value) != self.dtype:
                raise TypeError(f"{where} must be a {self.dtype} tensor, got {value.dtype}")
        if self.type in ("int", "float") and ((self.min is not None and value < self.min)
                                              or (self.max is not None and value > self.max)):
            raise ValueError(f"{where} must be{self._bounds()}, got {value!r}")
        return value


def _tensor_kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    if t.is_complex():
        return "complex"
    return "float" if t.is_floating_point() else "int"


def split_dim(dim: str) -> tuple[str, str | None]:
    """`q_len/block_m` -> ("q_len", "block_m"); `heads` -> ("heads", None)."""
    base, _, divisor = dim.partition("/")
    return base, (divisor or None)


def dim_size(dim: str, sizes: dict, values: dict) -> int:
    """The size a tensor dimension must have in one call (`values`: the term's parameter values)."""
    base, divisor = split_dim(dim)
    return sizes[base] if divisor is None else -(-sizes[base] // values[divisor])


@dataclass(frozen=True)
class Template:
    name: str
    path: Path
    kind: str  # "mask" or "score"
    doc: str
    params: dict[str, Param] = field(hash=False)
    expr_text: str
    expr_line: int  # line of `expr:` in the file, for error messages
    block_layout: str | None = None  # the tensor parameter that is the predicate, block by block

    def expression(self, static: dict) -> Expr:
        """Render the expression with the static parameters and parse it."""
        key = tuple(sorted(static.items()))
        cache = _EXPR_CACHE.setdefault(self.path, {})
        if key not in cache:
            text = render_string(self.expr_text, str(self.path), self.expr_line - 1, **static)
            names = set(INDEX_NAMES) | set(self.params) | ({SCORE_NAME} if self.kind == "score" else set())
            names -= {p.name for p in self.params.values() if p.static}
            tensors = {p.name: len(p.shape) for p in self.params.values() if p.type == "tensor"}
            try:
                cache[key] = Expr(text, names, tensors)
            except ExprError as e:
                raise TemplateError(f"{self.path}:{self.expr_line}: {e}") from None
        return cache[key]

    def check(self) -> None:
        """Render and parse the expression for every value of the static parameters, so that a
        broken template shows now and not at its first call; TemplateError names the first problem."""
        static = [p for p in self.params.values() if p.static]
        for values in itertools.product(*[(False, True) if p.type == "bool" else p.choices for p in static]):
            chosen = dict(zip((p.name for p in static), values))
            try:
                self.expression(chosen)
            except TemplateError as e:
                shown = ", ".join(f"{n}={v!r}" for n, v in chosen.items())
                raise TemplateError(f"{e} (with {shown})" if shown else str(e)) from None


_EXPR_CACHE: dict[Path, dict] = {}


def _parse_param(path: Path, name: str, spec) -> Param:
    where = f"{path}: parameter {name!r}"
    if not isinstance(spec, dict) or spec.get("type") not in PARAM_TYPES:
        raise TemplateError(f"{where} needs a type, one of {', '.join(PARAM_TYPES)}")
    unknown = set(spec) - {"type", "default", "doc", "choices", "min", "max", "shape", "dtype"}
    if unknown:
        raise TemplateError(f"{where} has unknown key(s) {', '.join(sorted(unknown))}")
    kind = spec["type"]
    for bound in ("min", "max"):
        value = spec.get(bound)
        if value is not None and (kind not in ("int", "float") or isinstance(value, bool)
                                  or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise TemplateError(f"{where}: `{bound}` is a finite number, for int and float parameters only")
    if spec.get("min") is not None and spec.get("max") is not None and spec["min"] > spec["max"]:
        raise TemplateError(f"{where}: min {spec['min']} is over max {spec['max']}")
    param = Param(name=name, type=kind, default=spec.get("default", MISSING), doc=str(spec.get("doc", "")),
                  choices=tuple(spec.get("choices", ())), min=spec.get("min"), max=spec.get("max"),
                  shape=tuple(spec.get("shape", ())), dtype=spec.get("dtype", "float"))
    if kind == "choice" and not param.choices:
        raise TemplateError(f"{where}: a choice needs `choices`")
    if kind == "tensor":
        if not param.shape or any(split_dim(d)[0] not in TENSOR_DIMS for d in param.shape) \
                or any(split_dim(d)[1] is not None and split_dim(d)[0] not in ("q_len", "kv_len") for d in param.shape):
            raise TemplateError(f"{where}: a tensor needs a `shape` made of {', '.join(TENSOR_DIMS)}, "
                                "q_len/P or kv_len/P (P an int parameter)")
        if param.dtype not in TENSOR_DTYPES:
            raise TemplateError(f"{where}: dtype must be one of {', '.join(TENSOR_DTYPES)}")
        if not param.required:
            raise TemplateError(f"{where}: a tensor parameter cannot have a default")
    if not param.required:
        try:
            param.check(path.stem, param.default)
        except (TypeError, ValueError) as e:
            raise TemplateError(f"{where}: bad default: {e}") from None
    return param


def load_template(path: Path) -> Template:
    """Read and check one template file."""
    path = Path(path)
    text = path.read_text()
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TemplateError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict) or "expr" not in data:
        raise TemplateError(f"{path}: a template is a mapping with at least `expr` (and `doc`, `kind`, `params`)")
    unknown = set(data) - {"doc", "kind", "params", "expr", "block_layout"}
    if unknown:
        raise TemplateError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    kind = data.get("kind", "mask")
    if kind not in ("mask", "score"):
        raise TemplateError(f"{path}: kind must be mask or score, got {kind!r}")
    expr_line = next(v.start_mark.line + 1 for k, v in node.value if k.value == "expr")
    raw_params = data.get("params") or {}
    if not isinstance(raw_params, dict):
        raise TemplateError(f"{path}: params must be a mapping of name -> spec")
    params = {}
    for name, spec in raw_params.items():
        if not str(name).isidentifier() or name in INDEX_NAMES or name == SCORE_NAME:
            raise TemplateError(f"{path}: bad parameter name {name!r}")
        params[name] = _parse_param(path, name, spec)
    for param in params.values():
        for divisor in (split_dim(d)[1] for d in param.shape):
            if divisor is not None and (divisor not in params or params[divisor].type != "int"
                                        or params[divisor].min is None or params[divisor].min < 1):
                raise TemplateError(f"{path}: parameter {param.name!r}: the size of a dimension divides by "
                                    f"{divisor!r}, which must be an int parameter with min >= 1")
    layout = data.get("block_layout")
    if layout is not None:
        shape = params[layout].shape if layout in params and params[layout].type == "tensor" else ()
        if len(shape) != 4 or shape[:2] != ("batch", "heads") or split_dim(shape[2])[0] != "q_len" \
                or split_dim(shape[3])[0] != "kv_len" or None in (split_dim(shape[2])[1], split_dim(shape[3])[1]):
            raise TemplateError(f"{path}: block_layout must name a tensor parameter of shape "
                                "[batch, heads, q_len/<int param>, kv_len/<int param>]")
        if kind != "mask":
            raise TemplateError(f"{path}: block_layout is for masks, not score modifiers")
    template = Template(name=path.stem, path=path, kind=kind, doc=str(data.get("doc", "")).strip(),
                        params=params, expr_text=str(data["expr"]), expr_line=expr_line, block_layout=layout)
    return template


# ---------------------------------------------------------------------------------------
# where templates come from
# ---------------------------------------------------------------------------------------
TEMPLATE_PATH_ENV = "ATTNGEN_TEMPLATE_PATH"
_user_dirs: list[Path] = []  # folders given to register_template_dir, in order


@dataclass
class _Loaded:
    """The templates read from `dirs`; `generation` counts the reloads, so that caches of objects
    built from templates (mask objects by name) know when they are stale."""
    dirs: tuple | None = None
    by_name: dict | None = None
    generation: int = 0


_loaded = _Loaded()


def register_template_dir(path) -> None:
    """Make the mask and score templates (`*.yaml`) in folder `path` available by name."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"register_template_dir: path {str(path)!r} is not a directory")
    if path not in _user_dirs:
        _user_dirs.append(path)
        _invalidate()


def _invalidate() -> None:
    _loaded.by_name = None
    _loaded.generation += 1


def registered_dirs() -> list[Path]:
    """The folders given to register_template_dir (a copy)."""
    return list(_user_dirs)


def set_registered_dirs(dirs: list[Path]) -> None:
    """Replace the registered folders (tests restore them with this)."""
    if list(dirs) != _user_dirs:
        _user_dirs[:] = dirs
        _invalidate()


def template_dirs() -> list[Path]:
    """The builtin folder, then ATTNGEN_TEMPLATE_PATH's folders, then registered ones."""
    return list(_template_dirs(os.environ.get(TEMPLATE_PATH_ENV, ""), tuple(_user_dirs)))


@functools.lru_cache(maxsize=16)
def _template_dirs(env: str, registered: tuple) -> tuple:
    dirs = [data_dir("templates") / "masks"]
    for d in [Path(p).expanduser().resolve() for p in env.split(os.pathsep) if p] + list(registered):
        if d not in dirs:
            dirs.append(d)
    return tuple(dirs)


def _template_files(dirs) -> list[Path]:
    """The template files of `dirs`, folder by folder, each folder's in name order."""
    files = []
    for d in dirs:
        if not d.is_dir():
            raise ValueError(f"template folder {str(d)!r} (from {TEMPLATE_PATH_ENV}) does not exist")
        files += sorted(d.glob("*.yaml"))
    return files


def _duplicate(path: Path, first: Path) -> TemplateError:
    return TemplateError(f"template {path.stem!r} is defined twice: {first} and {path}")


def templates() -> dict[str, Template]:
    """Every known template by name, read again whenever the folders change. A name defined twice
    is an error naming both files."""
    dirs = tuple(template_dirs())
    if _loaded.by_name is None or _loaded.dirs != dirs:
        found: dict[str, Template] = {}
        for path in _template_files(dirs):
            if path.stem in found:
                raise _duplicate(path, found[path.stem].path)
            found[path.stem] = load_template(path)
        _loaded.by_name, _loaded.dirs = found, dirs
        _loaded.generation += 1
    return _loaded.by_name


@dataclass(frozen=True)
class Checked:
    """One template file as `attngen masks` lists it: the template, or why it cannot be used."""
    path: Path
    template: Template | None
    error: str | None

    @property
    def name(self) -> str:
        return self.path.stem


def check_all() -> list[Checked]:
    """Every template file of every folder, loaded and checked one by one (`Template.check`): a
    broken file is reported with its error instead of stopping at the first."""
    out, first = [], {}
    for path in _template_files(template_dirs()):
        try:
            if path.stem in first:
                raise _duplicate(path, first[path.stem])
            first[path.stem] = path
            template = load_template(path)
            template.check()
            out.append(Checked(path, template, None))
        except (TemplateError, OSError, UnicodeDecodeError) as e:
            out.append(Checked(path, None, str(e)))
    return out


def generation() -> int:
    """How many times the templates were (re)loaded: a cache of objects built from them is stale
    when this changed."""
    return _loaded.generation


def get_template(name: str) -> Template:
    known = templates()
    if name.endswith(LOCAL_SUFFIX) and name[:-len(LOCAL_SUFFIX)] in known:
        return local_template(known[name[:-len(LOCAL_SUFFIX)]])
    if name not in known:
        raise ValueError(f"unknown mask {name!r}; known: {', '.join(sorted(known))}")
    return known[name]


# -- a template in the positions of one packed sequence (attngen.varlen_attention) -------------
LOCAL_SUFFIX = "__local"  # `causal__local` is `causal` counted inside each sequence
SEQUENCE_KEYS = "sequence_keys"  # the template of a query's own sequence's keys, which a local mask also requires
# The per-query tensors (shape (q_len,)) a local template takes: where the query's sequence starts
# among the packed queries and among the packed keys, and its lengths there; each replaces an index
# name. All are gathered at q_idx, so a query-tile kernel loads them once, outside its key loop
# (gathers at kv_idx ran in every masked tile and made the sm_90 forward spill: docs/varlen.md).
LOCAL_PARAMS = {
    "seq_q_start": ("q_idx", "q_idx - seq_q_start[q_idx]"),
    "seq_q_len": ("q_len", "seq_q_len[q_idx]"),
    "seq_kv_start": ("kv_idx", "kv_idx - seq_kv_start[q_idx]"),
    "seq_kv_len": ("kv_len", "seq_kv_len[q_idx]"),
}


@dataclass(frozen=True)
class LocalTemplate(Template):
    """`base` with q_idx, kv_idx, q_len and kv_len counted inside each packed sequence: the same
    expression with those names replaced by gathers from the LOCAL_PARAMS tensors (at q_idx). A
    mask also hides the keys outside the query's sequence (SEQUENCE_KEYS, in the same term, so
    that the kernel gathers each tensor once): kv_idx - seq_kv_start[q_idx] is then the position
    of every key it shows. A score modifier is evaluated everywhere; only its visible scores count."""

    base: Template | None = None

    def expression(self, static: dict) -> Expr:
        key = tuple(sorted(static.items()))
        cache = _EXPR_CACHE.setdefault(self.path, {})
        if key not in cache:
            local = self.base.expression(static).substitute(dict(LOCAL_PARAMS.values()),
                                                            {name: 1 for name in LOCAL_PARAMS})
            if self.kind == "mask":
                local = local.joined(get_template(SEQUENCE_KEYS).expression({}))
            cache[key] = local
        return cache[key]


@functools.lru_cache(maxsize=None)
def local_template(base: Template) -> LocalTemplate:
    """`base` counted in each sequence's own positions; an error for a template that reads a
    tensor laid out over the packed positions or a block layout (they have no per-sequence meaning)."""
    if base.block_layout is not None or any(split_dim(d)[0] in ("q_len", "kv_len")
                                            for p in base.params.values() for d in p.shape):
        raise ValueError(f"mask {base.name!r} reads a tensor laid out over the query or key positions, which has no "
                         "meaning inside each packed sequence; varlen_attention takes masks of positions (causal, "
                         "sliding_window, chunked, prefix_lm, softcap, alibi, ...)")
    params = dict(base.params)
    for name, (replaced, _) in LOCAL_PARAMS.items():
        params[name] = Param(name, "tensor", doc=f"per query: gives {replaced} inside its sequence", shape=("q_len",),
                             dtype="int")
    return LocalTemplate(base.name + LOCAL_SUFFIX, Path(f"{base.path}#local"), base.kind, base.doc, params,
                         base.expr_text, base.expr_line, None, base)
