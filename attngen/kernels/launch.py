"""What every kernel family shares on the Python side.

- `render_kernel` / `module_for`: a kernel template (`templates/kernels/<name>.py.jinja`) rendered
  for a mask variant and imported from the kernel cache, once per process.
- The tensors' launch properties: TMA eligibility, Triton's allocator, the dot precision.
- Kernel arguments by name, in groups (`qk_args`, `structure_args`, `dims`, `mask_args`).
- `Launch`: one kernel launch prepared once, every argument named and checked against the
  kernel's signature; a call passes only what changes (the tensors).
- `launcher`: `kernel[grid]`, serialised under Triton's interpreter, which is not thread-safe.
- `DirectLaunch`: on CUDA, a runner's later calls launch the kernel Triton compiled for its first
  one straight through the kernel's launcher, without Triton's per-call argument binding and cache
  lookup, while the call specialises as that one did (`direct_launch(False)` turns it off).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from types import SimpleNamespace

import torch

from .. import masks as masks_
from ..caches import BoundedCache
from ..checks import interpreter_on
from ..paths import data_dir
from ..render import load_module, render


# ---------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------
def kernel_templates() -> list[str]:
    """The names of the kernel templates (`templates/kernels/<name>.py.jinja`)."""
    return sorted(p.name.removesuffix(".py.jinja") for p in (data_dir("templates") / "kernels").glob("*.py.jinja"))


def render_kernel(template: str, mask: masks_.Mask | None) -> str:
    """The exact source of kernel template `template` for `mask`'s variant."""
    visible, mods = masks_.triton_sources(mask)
    return render(f"kernels/{template}.py.jinja", variant=mask.variant if mask is not None else "none",
                  visible=visible, mods=mods, mod_grads=lambda: list(zip(mods, masks_.triton_score_grads(mask))),
                  mask_args="".join(f", {p}" for p in masks_.kernel_params(mask)),
                  no_specialize="".join(f', "{s}"' for s in masks_.scalar_params(mask)))


_MODULES = BoundedCache("launch.modules", 1024)  # (template, mask variant) -> rendered module


def module_for(template: str, mask: masks_.Mask | None):
    """The rendered module of `template` for `mask`'s variant, imported once per process."""
    key = (template, None if mask is None else mask.key)
    module = _MODULES.get(key)
    if module is None:
        module = _MODULES.put(key, load_module(render_kernel(template, mask)))
    return module


# ---------------------------------------------------------------------------------------
# launching
# ---------------------------------------------------------------------------------------
_INTERPRETER_LOCK = threading.Lock()
_INTERPRETER_WARNINGS = (("Conversion of an array with ndim > 0 to a scalar", DeprecationWarning),
                         ("All-NaN slice encountered", RuntimeWarning))


def launcher(kernel, grid: tuple):
    """`kernel[grid]`: a function that launches `kernel` on `grid`.

    Triton's interpreter runs a launch in global state (it patches triton.language and keeps the
    program id in one builder), so two threads launching at once under it fail ("Did you forget to
    add @triton.jit?") or compute wrong results: there, launches take turns. It computes with numpy,
    whose warnings about inf and NaN (IEEE arithmetic the kernels rely on: -inf scores of hidden
    keys, NaN inputs) and about its own scalar conversions are not the caller's: they are silenced.
    A compiled kernel launches as it is, without a lock.
    """
    launch = kernel[grid]
    if not interpreter_on():
        return launch
    import numpy as np

    def serialised(*args, **kwargs):
        with _INTERPRETER_LOCK, np.errstate(all="ignore"):
            quiet_interpreter()
            return launch(*args, **kwargs)

    return serialised


def quiet_interpreter() -> None:
    """Ignore, where Triton's interpreter raises them (nowhere else), numpy's warning about the
    1-element arrays Triton 3.6 converts to ints in loop bounds (deprecated since numpy 1.25) and
    np.nanmax's about rows that are all NaN (a NaN input's row). Checked before every interpreted
    launch: a `warnings.catch_warnings()` that closed since (pytest opens one per test) took the
    filters away; a filter the caller put in front of them still wins."""
    for message, category in _INTERPRETER_WARNINGS:
        if not any(f[0] == "ignore" and f[1] is not None and f[1].pattern == message and f[2] is category
                   for f in warnings.filters):
            warnings.filterwarnings("ignore", message=message, category=category,
                                    module=r"triton\.runtime\.interpreter")



# ---------------------------------------------------------------------------------------
# launch properties of the tensors
# ---------------------------------------------------------------------------------------
def maker(t: torch.Tensor):
    """A function of no arguments that makes a new uninitialised tensor shaped, strided and typed
    like `t`: torch.empty_strided with its arguments prepared (half of torch.empty_like's host time;
    a plan's call signature fixes what a call's outputs look like)."""
    return functools.partial(torch.empty_strided, t.shape, t.stride(), dtype=t.dtype, device=t.device)


def tma_eligible(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need a unit last stride and 16-byte aligned base and strides."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def aligned(*tensors: torch.Tensor) -> bool:
    """The per-call half of tma_eligible: 16-byte aligned base pointers (strides are fixed per plan)."""
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    return bits % 16 == 0


def ensure_allocator():
    """In-kernel tensor descriptors need scratch memory from a Triton allocator.

    Triton keeps the allocator in a ContextVar, so every thread needs its own: set one where the
    current thread has none (never replacing an allocator the user set).
    """
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        device = "cpu" if interpreter_on() else "cuda"
        _allocation.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))


def dot_precision(dtype: torch.dtype) -> str:
    if dtype is not torch.float32:
        return "tf32"  # fp16 / bf16 operands ignore it
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 and not interpreter_on() else "ieee"


# ---------------------------------------------------------------------------------------
# kernel arguments by name
# ---------------------------------------------------------------------------------------
def strides3(t: torch.Tensor) -> list[int]:
    """The strides of a (B, H, M[, N]) tensor's first three dims, 0 where the dim is shared (size 1)."""
    return [0 if t.shape[i] == 1 else t.stride(i) for i in range(3)]


def tensor_args(name: str, t: torch.Tensor, dims: str) -> dict:
    """{NAME: t, stride_<n><d>: ...} for a tensor whose dims are named by the letters of `dims`:
    tensor_args("q", q, "bhmd") gives Q, stride_qb, stride_qh, stride_qm, stride_qd."""
    keys = _tensor_keys(name, dims)
    out = dict(zip(keys[1:], t.stride()))
    out[keys[0]] = t
    return out


@functools.lru_cache(maxsize=256)
def _tensor_keys(name: str, dims: str) -> tuple[str, ...]:
    return (name.upper(), *(f"stride_{name}{letter}" for letter in dims))


def qk_args(q: torch.Tensor, k: torch.Tensor) -> dict:
    return {**tensor_args("q", q, "bhmd"), **tensor_args("k", k, "bhnd")}


def structure_args(structure: masks_.BlockStructure, prefix: str = "") -> dict:
    """The block structure's four tensors and their strides (counts: c, index lists: i), named
    FULL_NUM ... stride_im, or with a prefix (a kernel that walks two structures): "DQ_" gives
    DQ_FULL_NUM ... stride_dq_im."""
    sc, si = strides3(structure.full_num), strides3(structure.full_idx)
    s = f"stride_{prefix.lower()}"
    return {f"{prefix}FULL_NUM": structure.full_num, f"{prefix}FULL_IDX": structure.full_idx,
            f"{prefix}PART_NUM": structure.partial_num, f"{prefix}PART_IDX": structure.partial_idx,
            f"{s}cb": sc[0], f"{s}ch": sc[1], f"{s}cm": sc[2], f"{s}ib": si[0], f"{s}ih": si[1], f"{s}im": si[2]}


def dims(shape, scale: float) -> dict:
    """The call's sizes and softmax scale, run-time arguments of every kernel."""
    return dict(batch=shape.batch, heads=shape.heads, q_len=shape.q_len, kv_len=shape.kv_len, group=shape.group,
                sm_scale=scale)


def mask_args(bound: masks_.Bound | None) -> dict:
    """The mask's run-time parameters by their kernel argument names."""
    if bound is None:
        return {}
    return dict(zip(masks_.kernel_params(bound.mask), bound.kernel_args))


_NAMES = BoundedCache("launch.names", 1024)  # (kernel, compile-time names) -> run-time argument names, in order


def _run_time_names(kernel, options: dict) -> list[str]:
    """The kernel's arguments that `options` does not set, in signature order (cached: the checked
    path builds a Launch every call)."""
    key = (kernel, tuple(options))
    names = _NAMES.get(key)
    if names is None:
        names = _NAMES.put(key, [n for n in kernel.arg_names if n not in options])
    return names


class Launch:
    """One kernel launch prepared once: the kernel, its grid, every argument by name and the compile
    options. The names are checked against the kernel's signature when the launch is built, so a
    missing or misspelt argument fails here and not inside Triton."""

    def __init__(self, kernel, grid: tuple, args: dict, options: dict):
        names = _run_time_names(kernel, options)
        try:
            values = [args[n] for n in names]
        except KeyError:
            values = None
        if values is None or len(args) != len(names):  # every argument once, and nothing else
            missing = [n for n in names if n not in args]
            unknown = sorted(set(args) - set(names))
            raise TypeError(f"launch of {getattr(kernel, '__name__', kernel)}: missing arguments {missing}, "
                            f"unknown arguments {unknown}")
        self.kernel, self.grid, self.options = kernel, grid, options
        self.names, self.values = names, values
        self._launch = launcher(kernel, grid)

    def __call__(self, options: dict | None = None, **changed) -> None:
        """Launch, with the arguments in `changed` replaced and `options` instead of the built ones."""
        values = self.values
        if changed:
            values = [changed.get(n, v) for n, v in zip(self.names, values)]
        self._launch(*values, **(self.options if options is None else options))

    def runner(self, *names: str, variants: list[dict] | None = None):
        """A function run(*values, variant=0) that launches with those arguments replaced, in the
        order of `names`, and the compile options `variants[variant]` (default: this launch's
        options only): the per-call path, without a dict per call. It keeps no reference to the
        values of `names` this launch was built with (a cached plan holds no call's tensors).

        On CUDA the first launch of each variant keeps the kernel Triton compiled for it, and later
        calls go straight to it (`DirectLaunch`) where they specialise as that first call did; the
        values of `names` must keep their types and dtypes from call to call (a Plan's call
        signature fixes them), only what Triton specialises within those is checked per call."""
        slots = [self.names.index(n) for n in names]
        base = [None if i in slots else value for i, value in enumerate(self.values)]
        launch, kernel, grid, arg_names = self._launch, self.kernel, self.grid, self.names
        variants = [self.options] if variants is None else variants
        direct_ok = not interpreter_on() and triton_protocol() is not None
        directs: list[DirectLaunch | None] | None = [None] * len(variants) if direct_ok else None

        def run(*values, variant=0):
            if directs is not None and _direct_launch:
                direct = directs[variant]
                if direct is not None and direct(values):
                    return
            args = list(base)
            for slot, value in zip(slots, values):
                args[slot] = value
            options = variants[variant]
            compiled = launch(*args, **options)
            if directs is not None and _direct_launch and directs[variant] is None:
                directs[variant] = DirectLaunch.keep(kernel, compiled, grid, arg_names, args, slots, options)

        return run


# ---------------------------------------------------------------------------------------
# the direct launch of a compiled kernel
# ---------------------------------------------------------------------------------------
_direct_launch = os.environ.get("ATTNGEN_DIRECT_LAUNCH", "1") != "0"  # direct_launch() sets it


def direct_launch(enabled: bool | None = None) -> bool:
    """Whether runners launch compiled kernels directly (`DirectLaunch`); `enabled` sets it, for
    every runner at once (their next call), and the previous setting is returned. The environment
    variable ATTNGEN_DIRECT_LAUNCH=0 starts a process with it off."""
    global _direct_launch
    previous = _direct_launch
    if enabled is not None:
        if type(enabled) is not bool:
            raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
        _direct_launch = enabled
    return previous


_direct_launches = 0


def direct_launches() -> int:
    """How many launches went straight to a compiled kernel in this process (the tests check that
    the direct path is taken)."""
    return _direct_launches


@functools.cache
def triton_protocol() -> SimpleNamespace | None:
    """What DirectLaunch uses of Triton, whose launch protocol it follows: triton 3.6's; None under
    other versions, where every call launches through Triton. Imported by the first runner, not with
    attngen (the command line sets TRITON_INTERPRET before Triton is imported)."""
    import triton

    try:
        from triton import knobs
        from triton._C.libtriton import native_specialize_impl
        from triton.compiler import CompiledKernel, make_backend
        from triton.knobs import HookChain
    except ImportError:
        return None
    if triton.__version__.split(".")[:2] != ["3", "6"]:
        return None
    return SimpleNamespace(knobs=knobs, HookChain=HookChain, specialize=native_specialize_impl,
                           CompiledKernel=CompiledKernel, make_backend=make_backend)


def triton_is_plain(kernel) -> bool:
    """Nothing set in Triton that a launch of `kernel` must run or recompile for: launch hooks (a
    profiler's), pre-run hooks, debug mode, instrumentation."""
    protocol = triton_protocol()
    runtime, chain = protocol.knobs.runtime, protocol.HookChain
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return ((enter is None or (type(enter) is chain and not enter.calls))
            and (exit_ is None or (type(exit_) is chain and not exit_.calls))
            and not runtime.debug and not protocol.knobs.compilation.instrumentation_mode
            and not kernel.pre_run_hooks)


class DirectLaunch:
    """A compiled kernel launched straight through its launcher: the last step of Triton's
    JITFunction.run (triton 3.6, runtime/jit.py), `compiled.run(grid, stream, function, metadata,
    hooks, *every argument in signature order, constexprs included)`, without the steps before it
    (binding the arguments, their specialisation, the kernel cache's key and lookup), and where
    the kernel needs no scratch memory without the launcher object's own step either (its C
    function is called with the launcher's flags).

    A call may only go there if Triton would choose this same compiled kernel for it: `__call__`
    checks, and says False for the caller to take Triton's own path, where
    - a changing tensor is not 16-byte aligned (Triton specialises pointers on it; a kernel is
      only kept from a call whose changing tensors all were),
    - a changing int specialises otherwise (Triton's own rule, native_specialize_impl: the value 1,
      multiples of 16, i32 or i64; `do_not_specialize` arguments only by width),
    - the current CUDA device is another one, or Triton is not plain (`triton_is_plain`).
    Nothing else can change between calls of a runner: its other arguments and options are fixed.
    (JITFunction.run also checks that the globals the kernel read have not been reassigned since
    it compiled; a rendered kernel module never reassigns its globals.)
    """

    def __init__(self, kernel, compiled, grid: tuple, args: list, slots: list[int], tensors: list[int],
                 ints: list[tuple], backend, device: int):
        self.kernel, self.function = kernel, compiled.function
        self.metadata = compiled.packed_metadata
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        # Triton's launcher object (CudaLauncher) only allocates scratch memory, if the kernel needs
        # any, and calls its C function `launch`; without scratch, call that function directly, with
        # the launcher's flags and no scratch (about 0.6 µs less per call on a CPU of 2026)
        launcher = compiled.run
        raw = getattr(launcher, "launch", None)
        if raw is not None and getattr(launcher, "global_scratch_size", 1) == 0 and \
                getattr(launcher, "profile_scratch_size", 1) == 0:
            self.run = raw
            self.head = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, self.metadata)
        else:
            self.run, self.head = launcher, (self.metadata,)
        # tensors go to the launcher as their addresses: it takes an int as the address itself, where
        # a tensor costs it a call of data_ptr and a driver query (cuPointerGetAttribute) a launch;
        # the fixed ones stay referenced here
        self.fixed = [value for value in args if isinstance(value, torch.Tensor)]
        self.args = [value.data_ptr() if isinstance(value, torch.Tensor) else value for value in args]
        self.slots, self.tensors, self.ints = slots, tensors, ints
        self.backend, self.device, self.specialize = backend, device, triton_protocol().specialize
        self.get_device, self.get_stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream

    @classmethod
    def keep(cls, kernel, compiled, grid: tuple, names: list[str], args: list, slots: list[int],
             options: dict) -> "DirectLaunch | None":
        """The direct launch of `compiled`, which kernel[grid](*args, **options) just returned (`names`:
        the run-time argument names of `args`; `slots`: the positions in `args` that change per
        call), or None where later calls could not skip Triton's path: no compiled kernel came
        back, the grid is a function of the arguments, a changing value is neither a tensor nor an
        int, or a changing tensor is misaligned."""
        protocol = triton_protocol()
        if not isinstance(compiled, protocol.CompiledKernel) or callable(grid) or not triton_is_plain(kernel):
            return None
        changing = [args[slot] for slot in slots]
        if any(isinstance(value, torch.Tensor) and value.data_ptr() % 16 for value in changing):
            return None
        backend = protocol.make_backend(compiled.metadata.target)  # the one Triton's binder specialises with
        params = {p.name: p for p in kernel.params}
        tensors, ints = [], []
        for i, (name, value) in enumerate(zip((names[slot] for slot in slots), changing)):
            param = params[name]
            if isinstance(value, torch.Tensor):
                tensors.append(i)
            elif type(value) is int and not param.annotation_type:
                specialize, align = not param.do_not_specialize, not param.do_not_specialize_on_alignment
                ints.append((i, specialize, align, protocol.specialize(backend, value, False, specialize, align)))
            else:
                return None
        # every argument in signature order, as JITFunction.run passes them: the run-time ones, then
        # constexprs from the options or their defaults
        given = dict(zip(names, args), **options)
        full = [given[n] if n in given else kernel.signature.parameters[n].default for n in kernel.arg_names]
        positions = [kernel.arg_names.index(names[slot]) for slot in slots]
        for i in positions:
            full[i] = None  # it keeps no call's tensors
        return cls(kernel, compiled, grid, full, positions, tensors, ints, backend, torch._C._cuda_getDevice())

    def __call__(self, values) -> bool:
        """Launch with `values` in the changing slots, if the call specialises as the kept one did.
        Tensors go to the launcher as their addresses, as the fixed ones do."""
        args = self.args.copy()
        slots = self.slots
        bits = 0
        for i in self.tensors:
            address = values[i].data_ptr()
            bits |= address
            args[slots[i]] = address
        if bits % 16:
            return False
        for i, specialize, align, expected in self.ints:
            value = values[i]
            if self.specialize(self.backend, value, False, specialize, align) != expected:
                return False
            args[slots[i]] = value
        if not triton_is_plain(self.kernel):
            return False
        device = self.get_device()
        if device != self.device:
            return False
        # the launcher's arguments after the stream and function: the head above, then the launch
        # metadata and the enter and exit hooks (none: triton_is_plain), then the kernel's arguments
        self.run(*self.grid, self.get_stream(device), self.function, *self.head, None, None, None, *args)
        global _direct_launches
        _direct_launches += 1  # a module global: a class attribute written per call would cost microseconds
        return True
