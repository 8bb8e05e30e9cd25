"""Mask and score templates, mask objects, and the block classification built from them.

A template is a small YAML file (`templates/masks/*.yaml`, or a folder of the user's):

    doc: what it does
    kind: mask            # or score: a modifier of the attention score
    params:               # optional
      window: {type: int, min: 1, doc: ...}
    expr: "abs(q_idx - kv_idx) < window"

Parameter types: `int` and `float` are run-time scalars (kernel arguments: a new value never
recompiles); `bool` and `choice` are static (Jinja variables inside `expr`, so they pick the
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
import math
import numbers
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from .expr import INDEX_NAMES, SCORE_NAME, Expr, ExprError, TensorRef
from .paths import data_dir
from .render import TemplateError, render_string

PARAM_TYPES = ("int", "float", "bool", "choice", "tensor")
TENSOR_DIMS = ("batch", "heads", "q_len", "kv_len")
BROADCAST_DIMS = ("batch", "heads")
TENSOR_DTYPES = ("int", "float", "bool")
_MISSING = object()


# ---------------------------------------------------------------------------------------
# templates
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: object = _MISSING
    doc: str = ""
    choices: tuple = ()
    min: float | None = None
    shape: tuple[str, ...] = ()
    dtype: str = "float"

    @property
    def static(self) -> bool:
        return self.type in ("bool", "choice")

    @property
    def required(self) -> bool:
        return self.default is _MISSING

    def describe(self) -> str:
        if self.type == "tensor":
            kind = f"{self.dtype} tensor of shape ({', '.join(self.shape)})"
        elif self.type == "choice":
            kind = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            kind = self.type + (f" >= {self.min:g}" if self.min is not None else "")
        default = "" if self.required else f", default {self.default!r}"
        return f"{self.name}: {kind}{default}"

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
        if self.min is not None and self.type in ("int", "float") and value < self.min:
            raise ValueError(f"{where} must be >= {self.min:g}, got {value!r}")
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


_EXPR_CACHE: dict[Path, dict] = {}


def _parse_param(path: Path, name: str, spec) -> Param:
    where = f"{path}: parameter {name!r}"
    if not isinstance(spec, dict) or spec.get("type") not in PARAM_TYPES:
        raise TemplateError(f"{where} needs a type, one of {', '.join(PARAM_TYPES)}")
    unknown = set(spec) - {"type", "default", "doc", "choices", "min", "shape", "dtype"}
    if unknown:
        raise TemplateError(f"{where} has unknown key(s) {', '.join(sorted(unknown))}")
    kind = spec["type"]
    param = Param(name=name, type=kind, default=spec.get("default", _MISSING), doc=str(spec.get("doc", "")),
                  choices=tuple(spec.get("choices", ())), min=spec.get("min"),
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
_user_dirs: list[Path] = []
_templates: dict[str, Template] | None = None


def register_template_dir(path) -> None:
    """Make the mask and score templates (`*.yaml`) in folder `path` available by name."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"register_template_dir: path {str(path)!r} is not a directory")
    global _templates
    if path not in _user_dirs:
        _user_dirs.append(path)
        _templates = None


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


def templates() -> dict[str, Template]:
    """Every known template by name. A name defined twice is an error naming both files."""
    global _templates
    dirs = template_dirs()
    if _templates is None or getattr(templates, "_dirs", None) != dirs:
        found: dict[str, Template] = {}
        for d in dirs:
            if not d.is_dir():
                raise ValueError(f"template folder {str(d)!r} (from {TEMPLATE_PATH_ENV}) does not exist")
            for path in sorted(d.glob("*.yaml")):
                if path.stem in found:
                    raise TemplateError(f"template {path.stem!r} is defined twice: {found[path.stem].path} and {path}")
                found[path.stem] = load_template(path)
        _templates = found
        _NAMED.clear()
        templates._dirs = dirs
    return _templates


def get_template(name: str) -> Template:
    known = templates()
    if name not in known:
        raise ValueError(f"unknown mask {name!r}; known: {', '.join(sorted(known))}")
    return known[name]


# ---------------------------------------------------------------------------------------
# mask objects
# ---------------------------------------------------------------------------------------
class Term:
    """One template with its parameter values."""

    def __init__(self, template: Template, values: dict, partial: bool = False):
        self.template = template
        checked = {}
        for name, value in values.items():
            if name not in template.params:
                known = ", ".join(template.params) or "none"
                raise TypeError(f"mask {template.name!r} has no parameter {name!r} (parameters: {known})")
            checked[name] = template.params[name].check(template.name, value)
        for param in template.params.values():
            if param.name not in checked:
                if not param.required:
                    checked[param.name] = param.default
                elif not (partial and not param.static):
                    raise TypeError(f"mask {template.name!r} is missing parameter {param.name!r} "
                                    f"({param.describe()})")
        self.values = checked
        self.static = {n: v for n, v in checked.items() if template.params[n].static}
        self.runtime = [p for p in template.params.values() if not p.static]

    @property
    def key(self):
        return (str(self.template.path), tuple(sorted(self.static.items())))

    @property
    def expr(self) -> Expr:
        return self.template.expression(self.static)

    def __repr__(self):
        shown = {n: ("<tensor>" if isinstance(v, torch.Tensor) else v) for n, v in self.values.items()}
        args = ", ".join(f"{n}={v!r}" for n, v in shown.items())
        return f"{self.template.name}({args})" if args else self.template.name

    def variant(self) -> str:
        """The name plus the parameters that change the kernel."""
        args = ", ".join(f"{n}={v!r}" for n, v in self.static.items())
        return f"{self.template.name}({args})" if args else self.template.name


class Mask:
    """A visibility predicate (terms combined with & and |) plus score modifiers."""

    def __init__(self, tree=None, mods: tuple = ()):
        self.tree = tree  # None (all visible), a Term, or (op, left, right)
        self.mods = tuple(mods)
        # computed once: the dispatcher reads these on every call (no cached_property: it locks on 3.11)
        terms = self.terms()
        self.key = (self._structure(tree), tuple(t.key for t in self.mods))  # equal keys render the same kernel
        scalars = tuple(t.values.get(p.name) for t in terms for p in t.runtime if p.type != "tensor")
        self.call_key = (self.key, scalars)  # plus the run-time scalars: equal keys launch identically
        self.has_tensors = any(p.type == "tensor" for t in terms for p in t.runtime)

    @staticmethod
    def _structure(node):
        if isinstance(node, Term):
            return node.key
        return None if node is None else (node[0], Mask._structure(node[1]), Mask._structure(node[2]))

    def _combine(self, other, op: str) -> "Mask":
        if not isinstance(other, Mask):
            return NotImplemented
        if op == "|" and (self.mods or other.mods):
            raise TypeError("score modifiers combine with masks by &, not |")
        if self.tree is None or other.tree is None:
            if op == "|" and (self.tree is not None or other.tree is not None):
                tree = None  # everything | anything is everything
            else:
                tree = self.tree if other.tree is None else other.tree
        else:
            tree = (op, self.tree, other.tree)
        return Mask(tree, self.mods + other.mods)

    def __and__(self, other):
        return self._combine(other, "&")

    def __or__(self, other):
        return self._combine(other, "|")

    def terms(self) -> list[Term]:
        """Every term in a fixed order: the predicate's, left to right, then the modifiers."""
        out = []

        def walk(node):
            if isinstance(node, Term):
                out.append(node)
            elif node is not None:
                walk(node[1])
                walk(node[2])

        walk(self.tree)
        return out + list(self.mods)

    def _text(self, fn) -> str:
        def walk(node, top=True):
            if isinstance(node, Term):
                return fn(node)
            inner = f"{walk(node[1], False)} {node[0]} {walk(node[2], False)}"
            return inner if top else f"({inner})"

        parts = [walk(self.tree)] if self.tree is not None else []
        parts += [fn(t) for t in self.mods]
        return " & ".join(parts) if parts else "none"

    def __repr__(self):
        return f"attngen.Mask({self._text(repr)})"

    @functools.cached_property
    def variant(self) -> str:
        """What the kernel is specialised for, e.g. `causal(align='bottom_right') & softcap`."""
        return self._text(Term.variant)

    def block_structure(self, q_len: int, kv_len: int, block_size: tuple[int, int], *,
                        batch: int = 1, heads: int = 1, device=None) -> "BlockStructure":
        """Classify (BLOCK_M x BLOCK_N) tiles as empty, partial or full, per batch and head."""
        return block_structure(self, q_len, kv_len, block_size, batch=batch, heads=heads, device=device)


_NAMED: dict[str, Mask] = {}


def mask(name: str, **params) -> Mask:
    """A mask (or score modifier) from the template `name` with its parameters."""
    if not isinstance(name, str):
        raise TypeError(f"mask name must be a str, got {type(name).__name__}")
    term = Term(get_template(name), params)
    return Mask(mods=(term,)) if term.template.kind == "score" else Mask(term)


def as_mask(value, argument: str = "mask") -> Mask | None:
    """`None`, a template name or a Mask, as given to attention(mask=...)."""
    if value is None or isinstance(value, Mask):
        return value
    if isinstance(value, str):
        # one Mask per name while the loaded templates stay the same (a reload empties _NAMED); this
        # is on every call's path, so it reads no environment variable
        named = _NAMED.get(value)
        if named is None or _templates is None:
            named = _NAMED[value] = mask(value)
        return named
    raise TypeError(f"{argument} must be None, a mask name or an attngen mask object, got {type(value).__name__}")


# ---------------------------------------------------------------------------------------
# binding to a call: kernel arguments and torch evaluation
# ---------------------------------------------------------------------------------------
@dataclass
class Bound:
    """A mask tied to one call's sizes: what the kernel and the reference need."""

    mask: Mask
    kernel_args: list  # run-time values, in the order of kernel_params()
    env: dict  # name -> value for torch evaluation, keyed like the rendered names


def _arg_names(index: int, param: Param) -> list[str]:
    if param.type == "tensor":
        return [f"T{index}_{param.name.upper()}"] + [f"t{index}_{param.name}_stride{d}" for d in range(len(param.shape))]
    return [f"t{index}_{param.name}"]


def kernel_params(m: Mask | None) -> list[str]:
    """The kernel arguments a mask needs, in order."""
    if m is None:
        return []
    return [n for i, t in enumerate(m.terms()) for p in t.runtime for n in _arg_names(i, p)]


def scalar_params(m: Mask | None) -> list[str]:
    """The run-time scalar arguments (never specialised by Triton: a new value never recompiles)."""
    if m is None:
        return []
    return [_arg_names(i, p)[0] for i, t in enumerate(m.terms()) for p in t.runtime if p.type != "tensor"]


def _renames(index: int, term: Term):
    rename, tensors = {}, {}
    for p in term.runtime:
        if p.type != "tensor":
            rename[p.name] = _arg_names(index, p)[0]
    for p in term.runtime:
        if p.type == "tensor":
            names = _arg_names(index, p)
            sizes = []
            for dim in p.shape:
                base, divisor = split_dim(dim)
                sizes.append(base if divisor is None else f"(({base} + {rename[divisor]} - 1) // {rename[divisor]})")
            tensors[p.name] = TensorRef(pointer=names[0], strides=tuple(names[1:]), sizes=tuple(sizes))
    return rename, tensors


def triton_sources(m: Mask | None) -> tuple[str | None, list[str]]:
    """(visibility expression or None, [score modifier expressions]) as Triton source."""
    if m is None:
        return None, []
    terms = m.terms()
    index = {id(t): i for i, t in enumerate(terms)}

    def walk(node):
        if isinstance(node, Term):
            return "(" + node.expr.to_triton(*_renames(index[id(node)], node)) + ")"
        return f"({walk(node[1])} {node[0]} {walk(node[2])})"

    visible = walk(m.tree) if m.tree is not None else None
    mods = [t.expr.to_triton(*_renames(index[id(t)], t)) for t in m.mods]
    return visible, mods


def bind(m: Mask | None, *, batch: int, heads: int, q_len: int, kv_len: int, device) -> Bound | None:
    """Check the mask's tensors against the call's sizes and collect the kernel arguments."""
    if m is None:
        return None
    sizes = {"batch": batch, "heads": heads, "q_len": q_len, "kv_len": kv_len}
    args, env = [], {}
    for i, term in enumerate(m.terms()):
        for p in term.runtime:
            value = term.values.get(p.name, _MISSING)
            if value is _MISSING:
                raise TypeError(f"mask {term.template.name!r} is missing parameter {p.name!r} ({p.describe()})")
            if p.type != "tensor":
                args.append(value)
                env[_arg_names(i, p)[0]] = value
                continue
            strides, expected = [], [dim_size(dim, sizes, term.values) for dim in p.shape]
            for d, (dim, n, want) in enumerate(zip(p.shape, value.shape, expected)):
                if n != want and not (n == 1 and dim in BROADCAST_DIMS):
                    broadcast = " (or 1)" if dim in BROADCAST_DIMS else ""
                    raise ValueError(f"mask {term.template.name!r} parameter {p.name!r}: dimension {d} ({dim}) "
                                     f"has size {n}, expected {want}{broadcast}; shape {tuple(value.shape)}")
                strides.append(0 if n == 1 and want != 1 else value.stride(d))
            if not same_device(value.device, device):
                raise ValueError(f"mask {term.template.name!r} parameter {p.name!r} is on {value.device}, "
                                 f"but q is on {device}")
            args += [value] + strides
            env[_arg_names(i, p)[0]] = value.expand(*expected)
    return Bound(m, args, env)


def same_device(a, b) -> bool:
    """`cuda` and `cuda:0` are the same device when 0 is the current one."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None or b.index is None):
        current = torch.cuda.current_device()
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def index_env(q_idx: torch.Tensor, kv_idx: torch.Tensor, *, q_len: int, kv_len: int, batch: int, heads: int,
              batches: int | None = None, head_count: int | None = None) -> dict:
    """The names a mask expression sees: b, h, q_idx, kv_idx as broadcastable (B, H, Q, K) tensors
    (b over `batches`, h over `head_count`: the call's sizes, or 1 where the mask is the same for all)."""
    device = q_idx.device
    nb = batch if batches is None else batches
    nh = heads if head_count is None else head_count
    return dict(b=torch.arange(nb, device=device).view(-1, 1, 1, 1), h=torch.arange(nh, device=device).view(1, -1, 1, 1),
                q_idx=q_idx.view(1, 1, -1, 1), kv_idx=kv_idx.view(1, 1, 1, -1), q_len=q_len, kv_len=kv_len,
                batch=batch, heads=heads)


def _term_env(index: int, term: Term, bound: Bound, base: dict, dtype=None) -> dict:
    env = dict(base)
    for p in term.runtime:
        value = bound.env[_arg_names(index, p)[0]]
        if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.to(dtype)
        env[p.name] = value
    return env


def predicate_fn(bound: Bound, node=_MISSING):
    """The mask's predicate (or the part `node` of its tree) as a function of an index environment.

    Every expression is looked up here, so the function itself is plain torch: FlexAttention can
    vmap and compile it as a mask_mod.
    """
    terms = bound.mask.terms()
    exprs = [t.expr for t in terms]
    position = {id(t): i for i, t in enumerate(terms)}

    def plan(n):  # the tree with each term replaced by its position in terms
        return position[id(n)] if isinstance(n, Term) else (n[0], plan(n[1]), plan(n[2]))

    tree = plan(bound.mask.tree if node is _MISSING else node)

    def visible(index_env: dict):
        def walk(n):
            if isinstance(n, int):
                return exprs[n].evaluate(_term_env(n, terms[n], bound, index_env, torch.float64))
            left, right = walk(n[1]), walk(n[2])
            return (left & right) if n[0] == "&" else (left | right)
        return walk(tree)

    return visible


def score_fn(bound: Bound):
    """The mask's score modifiers, in order, as a function (score, index environment) -> score;
    plain torch like predicate_fn (FlexAttention's score_mod)."""
    terms = bound.mask.terms()
    exprs = [t.expr for t in terms]
    first = len(terms) - len(bound.mask.mods)

    def apply(score: torch.Tensor, index_env: dict) -> torch.Tensor:
        for i in range(first, len(terms)):
            env = _term_env(i, terms[i], bound, index_env, score.dtype)
            env[SCORE_NAME] = score
            new = exprs[i].evaluate(env)
            score = new if isinstance(new, torch.Tensor) else torch.full_like(score, float(new))
        return score

    return apply


def evaluate_visible(bound: Bound, index_env: dict, node=_MISSING):
    """The mask's predicate (or the part `node` of its tree) evaluated with torch over `index_env`."""
    return predicate_fn(bound, node)(index_env)


def apply_score_mods(bound: Bound, score: torch.Tensor, index_env: dict) -> torch.Tensor:
    return score_fn(bound)(score, index_env)


def _tree_terms(node) -> list[Term]:
    if isinstance(node, Term):
        return [node]
    return [] if node is None else _tree_terms(node[1]) + _tree_terms(node[2])


def predicate_names(node) -> set[str]:
    """Index names a predicate (tree) depends on (tells whether blocks differ by batch or head)."""
    names = set()
    for t in _tree_terms(node):
        names |= t.expr.names
    return names


# ---------------------------------------------------------------------------------------
# block classification
# ---------------------------------------------------------------------------------------
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockStructure:
    """Per (batch, head, query block): the key blocks to visit, full ones apart from partial ones.

    Every tensor has a leading (B, H) of the call's sizes or 1 (the same for all).
    `full_idx[..., :full_num]` are the key blocks the mask shows entirely (no mask arithmetic);
    `partial_idx[..., :partial_num]` those it shows in part. Blocks in neither are skipped.
    """

    block_size: tuple[int, int]
    full_num: torch.Tensor  # (B, H, num_m) int32
    full_idx: torch.Tensor  # (B, H, num_m, num_n) int32
    partial_num: torch.Tensor
    partial_idx: torch.Tensor
    # every list is a run of consecutive blocks (causal, windows, chunks): the kernel then steps
    # through a range instead of reading indices. False when unknown (not checked, to avoid a sync)
    contiguous: bool = False

    @property
    def classes(self) -> torch.Tensor:
        """(B, H, num_m, num_n) int8: EMPTY, PARTIAL or FULL for every tile."""
        cols = torch.arange(self.full_idx.shape[-1], device=self.full_idx.device)
        out = torch.zeros(self.full_idx.shape, dtype=torch.int8, device=cols.device)
        for num, idx, value in ((self.partial_num, self.partial_idx, PARTIAL), (self.full_num, self.full_idx, FULL)):
            listed = torch.zeros_like(out, dtype=torch.bool).scatter_(-1, idx.long(), cols < num[..., None])
            out = torch.where(listed, value, out).to(torch.int8)
        return out


def _lists(selected: torch.Tensor):
    """(count, indices) with the selected blocks first, in ascending order."""
    num = selected.sum(-1, dtype=torch.int32)
    idx = torch.sort((~selected).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    return num, idx


def _runs(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """True where the first `num` indices of a row are consecutive."""
    step_ok = (idx[..., 1:] - idx[..., :-1]) == 1
    listed = torch.arange(1, idx.shape[-1], device=idx.device) < num[..., None]
    return (step_ok | ~listed).all()


def structure_from_classes(classes: torch.Tensor, block_size, check_contiguous: bool = False) -> BlockStructure:
    """The block lists of a class tensor; `check_contiguous` costs one device sync."""
    full_num, full_idx = _lists(classes == FULL)
    partial_num, partial_idx = _lists(classes == PARTIAL)
    contiguous = check_contiguous and bool(_runs(full_num, full_idx) & _runs(partial_num, partial_idx))
    return BlockStructure(tuple(block_size), full_num.contiguous(), full_idx.contiguous(),
                          partial_num.contiguous(), partial_idx.contiguous(), contiguous)


_CHUNK_ELEMENTS = 1 << 26  # cap on the (rows x keys) booleans evaluated at once
_STRUCTURE_CACHE: OrderedDict = OrderedDict()
_STRUCTURE_CACHE_SIZE = 64


def classify(bound: Bound | None, q_len: int, kv_len: int, block_size, *, batch: int, heads: int,
             device) -> torch.Tensor:
    """(B', H', num_m, num_n) int8 classes, B' = batch if the mask uses `b` else 1 (same for H').

    A tile the kernel must bounds-check (it reaches past kv_len) is never FULL.
    """
    bm, bn = block_size
    num_m, num_n = math.ceil(q_len / bm), math.ceil(kv_len / bn)
    if bound is None or bound.mask.tree is None:
        full_cols = (torch.arange(num_n * bn, device=device) < kv_len).view(num_n, bn).all(-1)
        classes = torch.where(full_cols, FULL, PARTIAL).to(torch.int8)
        return classes.expand(1, 1, num_m, num_n).contiguous()
    return _classify_node(bound, bound.mask.tree, q_len, kv_len, block_size, batch=batch, heads=heads, device=device)


def _classify_node(bound: Bound, node, q_len, kv_len, block_size, *, batch, heads, device) -> torch.Tensor:
    """Block layouts are read block by block; the rest of the tree is evaluated per position.

    Where a tree mixes the two, `&` takes the weaker class of its sides and `|` the stronger one
    (EMPTY < PARTIAL < FULL): never wrong, at worst a tile is visited that is in fact empty.
    """
    if isinstance(node, Term) and node.template.block_layout is not None:
        return _classify_layout(node, q_len, kv_len, block_size, device)
    if not any(t.template.block_layout is not None for t in _tree_terms(node)):
        return _classify_positions(bound, node, q_len, kv_len, block_size, batch=batch, heads=heads, device=device)
    sides = [_classify_node(bound, child, q_len, kv_len, block_size, batch=batch, heads=heads, device=device)
             for child in node[1:]]
    return (torch.minimum if node[0] == "&" else torch.maximum)(*sides)


def _classify_positions(bound: Bound, node, q_len, kv_len, block_size, *, batch, heads, device) -> torch.Tensor:
    """Evaluate the predicate `node` position by position, a band of query rows at a time."""
    bm, bn = block_size
    num_m, num_n = math.ceil(q_len / bm), math.ceil(kv_len / bn)
    kv = torch.arange(num_n * bn, device=device)
    kv_in = kv < kv_len
    names = predicate_names(node)
    nb = batch if "b" in names else 1
    nh = heads if "h" in names else 1
    rows = max(bm, (_CHUNK_ELEMENTS // max(1, nb * nh * num_n * bn)) // bm * bm)
    out = []
    for start in range(0, num_m * bm, rows):
        q = torch.arange(start, min(start + rows, num_m * bm), device=device)
        env = index_env(q, kv, q_len=q_len, kv_len=kv_len, batch=batch, heads=heads, batches=nb, head_count=nh)
        vis = evaluate_visible(bound, env, node)
        vis = torch.as_tensor(vis, device=device).expand(nb, nh, q.numel(), kv.numel())
        q_in = (q < q_len).view(1, 1, -1, 1)
        seen = vis & q_in & kv_in
        whole = (vis | ~q_in) & kv_in  # rows past q_len are never stored: they don't spoil a full tile
        tiles = (nb, nh, q.numel() // bm, bm, num_n, bn)
        any_ = seen.reshape(tiles).any(dim=5).any(dim=3)
        all_ = whole.reshape(tiles).all(dim=5).all(dim=3)
        out.append(torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8))
    return torch.cat(out, dim=2)


def _classify_layout(term: Term, q_len, kv_len, block_size, device) -> torch.Tensor:
    """Tile classes of a block layout, at a tile size that may differ from the layout's blocks."""
    shape = term.template.params[term.template.block_layout].shape
    layout_m, layout_n = (term.values[split_dim(d)[1]] for d in shape[2:])
    layout = term.values[term.template.block_layout].to(device=device, dtype=torch.bool)
    any_, all_ = _tiles_of_last_dim(layout.transpose(2, 3), layout.transpose(2, 3), layout_m, block_size[0], q_len,
                                    bounded=False)
    any_, all_ = _tiles_of_last_dim(any_.transpose(2, 3), all_.transpose(2, 3), layout_n, block_size[1], kv_len,
                                    bounded=True)
    return torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8).contiguous()


def _tiles_of_last_dim(any_, all_, block: int, tile: int, length: int, bounded: bool):
    """Regroup the last dim from layout blocks of `block` positions to tiles of `tile` positions.

    Both are cut into chunks of gcd(block, tile) positions, each inside one layout block; a tile
    is `any` if one of its chunks is, `all` if every chunk is. Positions past `length` count as
    nothing for `any`; for `all` they do not spoil a tile, unless `bounded` (keys: the kernel must
    bounds-check such a tile, so it is never FULL).
    """
    g = math.gcd(block, tile)
    chunks = math.ceil(length / tile) * (tile // g)

    def regroup(x):
        x = x.repeat_interleave(block // g, dim=-1)[..., :chunks]
        pad = chunks - x.shape[-1]
        return torch.cat([x, x.new_zeros(x.shape[:-1] + (pad,))], dim=-1) if pad > 0 else x

    start = torch.arange(chunks, device=any_.device) * g
    any_ = regroup(any_) & (start < length)
    all_ = regroup(all_) & (start + g <= length) if bounded else regroup(all_) | (start >= length)
    tiles = any_.shape[:-1] + (chunks * g // tile, tile // g)
    return any_.reshape(tiles).any(-1), all_.reshape(tiles).all(-1)


def block_structure(m: Mask | None, q_len: int, kv_len: int, block_size, *, batch: int = 1, heads: int = 1,
                    device=None, bound: Bound | None = None) -> BlockStructure:
    """The block structure of `m` for one call, cached.

    A mask with tensor parameters is cached while those very tensor objects live and are not
    modified in place (torch's version counter): a mask built once per batch and used by every
    layer classifies its blocks once. Changing a tensor through a path torch does not track
    (`.data`, DLPack or numpy aliases) is not seen: build a new mask instead.
    """
    if device is None:
        device = "cpu"
    device = torch.device(device)
    if bound is None:
        bound = bind(m, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, device=device)
    tensors = [v for t in m.terms() for v in t.values.values() if isinstance(v, torch.Tensor)] if m else []
    key = (None if m is None else m.call_key, tuple((id(t), t._version) for t in tensors), q_len, kv_len,
           tuple(block_size), batch, heads, device)
    hit = _STRUCTURE_CACHE.get(key)
    if hit is not None and all(ref() is t for ref, t in zip(hit[1], tensors)):
        _STRUCTURE_CACHE.move_to_end(key)
        return hit[0]
    classes = classify(bound, q_len, kv_len, block_size, batch=batch, heads=heads, device=device)
    # the run check costs a device sync: worth it once per shape, not once per new tensor
    result = structure_from_classes(classes, block_size, check_contiguous=not tensors)
    _STRUCTURE_CACHE[key] = (result, [weakref.ref(t) for t in tensors])
    if len(_STRUCTURE_CACHE) > _STRUCTURE_CACHE_SIZE:
        _STRUCTURE_CACHE.popitem(last=False)
    return result


# ---------------------------------------------------------------------------------------
# masks written as text (command line)
# ---------------------------------------------------------------------------------------
def parse_spec(text: str, *, partial: bool = False) -> Mask | None:
    """A mask from text such as `causal & sliding_window(window=256) & softcap(cap=30.0)`.

    `none` is no mask. With `partial`, run-time parameters may be left out (enough to render).
    """
    import ast

    text = text.strip()
    if text in ("", "none"):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"mask spec {text!r} is not valid: {e.msg}") from None

    def build(node) -> Mask:
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
            left, right = build(node.left), build(node.right)
            return left & right if isinstance(node.op, ast.BitAnd) else left | right
        if isinstance(node, ast.Name):
            name, kwargs = node.id, {}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
            name = node.func.id
            try:
                kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                raise ValueError(f"mask spec {text!r}: parameters must be literals (numbers, strings, booleans)") from None
        else:
            raise ValueError(f"mask spec {text!r}: expected name, name(param=value, ...), joined by & or |")
        term = Term(get_template(name), kwargs, partial=partial)
        return Mask(mods=(term,)) if term.template.kind == "score" else Mask(term)

    return build(tree)
