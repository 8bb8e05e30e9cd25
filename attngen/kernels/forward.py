"""The forward attention kernel: rendering per mask variant, launch, autograd.

Reading order: the kernel (rendered from templates/attention_fwd.py.jinja), the launcher,
the autograd Function, then `attention_forward`, which the dispatcher calls.
"""

from __future__ import annotations

import math

import torch

from .. import masks as masks_
from ..checks import check_qkv, check_scale, check_topk, interpreter_on, topk_pad
from ..config import KernelConfig, block_d_for
from ..render import load_module, render

TEMPLATE = "attention_fwd.py.jinja"


# ---------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------
def render_source(mask: masks_.Mask | None) -> str:
    """The exact source of the forward kernel for `mask`'s variant."""
    visible, mods = masks_.triton_sources(mask)
    return render(TEMPLATE, variant=mask.variant if mask is not None else "none", visible=visible, mods=mods,
                  params=masks_.kernel_params(mask), scalars=masks_.scalar_params(mask))


_KERNELS: dict = {}


def kernel_for(mask: masks_.Mask | None):
    """The jitted kernel for `mask`'s variant: rendered and imported once per process."""
    key = None if mask is None else mask.key
    fn = _KERNELS.get(key)
    if fn is None:
        fn = _KERNELS[key] = load_module(render_source(mask)).attention_fwd
    return fn


# ---------------------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------------------
def tma_eligible(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need a unit last stride and 16-byte aligned base and strides."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * size) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _ensure_allocator():
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


def launch_args(q, k, v, out, lse, bound, structure: masks_.BlockStructure, shape, scale: float, topk: int,
                config: KernelConfig, use_tma: bool):
    """(kernel, grid, args, kwargs) of one launch on checked inputs and preallocated outputs (topk 0: all)."""
    kernel = kernel_for(bound.mask if bound is not None else None)
    bm, bn = structure.block_size
    if use_tma:
        _ensure_allocator()
    cnt, idx = structure.full_num, structure.full_idx

    def strides3(t):  # (B, H, M[, N]) with 0 for a dimension shared by every batch or head
        return [0 if t.shape[i] == 1 else t.stride(i) for i in range(3)]

    lse_arg = lse if lse is not None else out
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    grid = (math.ceil(shape.q_len / bm), shape.batch * shape.heads)
    args = (q, k, v, out, lse_arg,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse_strides,
            structure.full_num, structure.full_idx, structure.partial_num, structure.partial_idx,
            *strides3(cnt), *strides3(idx),
            shape.batch, shape.heads, shape.q_len, shape.kv_len, shape.group, scale, topk,
            *(bound.kernel_args if bound is not None else ()))
    kwargs = dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d_for(shape.head_dim), BLOCK_M=bm, BLOCK_N=bn,
                  STORE_LSE=lse is not None, USE_TMA=use_tma, WARP_SPECIALIZE=config.warp_specialize,
                  DOT_PRECISION=dot_precision(q.dtype), CONTIGUOUS=structure.contiguous, TOPK_PAD=topk_pad(topk),
                  num_warps=config.num_warps, num_stages=config.num_stages)
    return kernel, grid, args, kwargs


def blocks(q, mask, shape, config: KernelConfig):
    """(bound mask, block structure) of one call, at the config's tile size."""
    bound = masks_.bind(mask, batch=shape.batch, heads=shape.heads, q_len=shape.q_len, kv_len=shape.kv_len,
                        device=q.device)
    structure = masks_.block_structure(mask, shape.q_len, shape.kv_len, (config.block_m, config.block_n),
                                       batch=shape.batch, heads=shape.heads, device=q.device, bound=bound)
    return bound, structure


def launch(*args):
    """Launch the kernel (arguments as for launch_args)."""
    kernel, grid, args, kwargs = launch_args(*args)
    kernel[grid](*args, **kwargs)


class Plan:
    """Everything of a launch but the tensors, prepared once per call signature (the dispatcher's fast path).

    A signature fixes shapes, strides, dtypes, device, mask (with its scalar values), scale and
    return_lse; the output's strides follow from q's, so only q, k, v, out and lse change per call.
    """

    def __init__(self, q, k, v, mask, shape, scale: float, topk: int, return_lse: bool, config: KernelConfig):
        bound, structure = blocks(q, mask, shape, config)
        out = torch.empty_like(q)
        lse = torch.empty((shape.batch, shape.heads, shape.q_len), dtype=torch.float32, device=q.device)
        self.lse_shape = tuple(lse.shape) if return_lse else None
        self.kernel, self.grid, args, self.plain = launch_args(q, k, v, out, lse if return_lse else None, bound,
                                                               structure, shape, scale, topk, config, False)
        self.tail = args[5:]
        self.tma = None
        if config.use_tma and tma_eligible(q, k, v):  # strides fit; base alignment is checked per call
            self.tma = dict(self.plain, USE_TMA=True)

    def run(self, q, k, v):
        out = torch.empty_like(q)
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        kwargs = self.plain
        if self.tma is not None and (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0:
            kwargs = self.tma
            _ensure_allocator()
        self.kernel[self.grid](q, k, v, out, out if lse is None else lse, *self.tail, **kwargs)
        return out, lse


def attention_forward(q, k, v, mask=None, *, scale=None, return_lse=False, topk=None, config: KernelConfig,
                      out=None, lse=None):
    """Run the forward kernel with an explicit config. Returns (output, lse or None).

    `out` and `lse` may be given preallocated (tests poison them to catch unwritten elements).
    """
    shape = check_qkv(q, k, v, kernel=True)
    problems = config.problems(shape.head_dim, q.element_size())
    if problems:
        raise ValueError(f"invalid kernel config {config}: {'; '.join(problems)}")
    return forward(q, k, v, masks_.as_mask(mask), shape, check_scale(scale, shape.head_dim),
                   check_topk(topk, shape.kv_len), return_lse, config, out, lse)


def forward(q, k, v, mask, shape, scale: float, topk: int, return_lse: bool, config: KernelConfig, out=None,
            lse=None):
    """attention_forward on checked arguments (the dispatcher's fully checked path)."""
    bound, structure = blocks(q, mask, shape, config)
    if out is None:
        out = torch.empty_like(q)
    if return_lse and lse is None:
        lse = torch.empty((shape.batch, shape.heads, shape.q_len), dtype=torch.float32, device=q.device)
    if not return_lse:
        lse = None
    use_tma = config.use_tma and tma_eligible(q, k, v)
    if shape.q_len > 0:
        launch(q, k, v, out, lse, bound, structure, shape, scale, topk, config, use_tma)
    return out, lse


# ---------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------
class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, shape, scale, topk, return_lse, config):
        return forward(q, k, v, mask, shape, scale, topk, return_lse, config)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("attngen has no backward kernel yet: attngen.attention is forward-only; "
                                  "call it under torch.no_grad() or use SDPA for training")
