"""Input checks shared by the kernels and the reference: clear errors instead of Triton tracebacks."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from .dtypes import SUPPORTED as SUPPORTED_DTYPES

MAX_HEAD_DIM = 256
MAX_TOPK = 1024


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def interpreter_numpy_problem(triton_version: str, numpy_version: str) -> str | None:
    """A known failure of Triton's interpreter with these versions, or None: triton 3.6's
    interpreter fails with numpy >= 2.4 in kernel loops whose bound is a run-time value (seen with
    the top-k kernels: "TypeError: only 0-dimensional arrays can be converted to Python scalars")."""
    def major_minor(version: str) -> tuple[int, ...]:
        return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in version.split(".")[:2])

    if major_minor(triton_version) == (3, 6) and major_minor(numpy_version) >= (2, 4):
        return (f"triton {triton_version}'s interpreter fails with numpy {numpy_version} (numpy >= 2.4) in kernel "
                "loops with a run-time bound, the top-k kernels' among them; install numpy<2.4 to run kernels "
                "under the interpreter")
    return None


def interpreter_on() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def check_qkv(q, k, v, *, kernel: bool) -> Shape:
    """Check q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D); `kernel`: the inputs go to a Triton kernel."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    dtype, device = q.dtype, q.device
    if (len(q_shape) == len(k_shape) == len(v_shape) == 4 and k.dtype is dtype and v.dtype is dtype
            and dtype in SUPPORTED_DTYPES and k.device == device and v.device == device):
        pass  # the common case: only the sizes below are left to check
    else:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"{name} must have 4 dimensions (batch, heads, seq_len, head_dim), "
                                 f"got shape {tuple(t.shape)}")
            if kernel and t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
            if not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        for name, t in (("k", k), ("v", v)):
            if t.dtype != dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but q has {dtype}; q, k and v must share one dtype")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but q is on {device}; q, k and v must share one device")
    batch, heads, q_len, head_dim = q_shape
    _, kv_heads, kv_len, _ = k_shape
    if k_shape[0] != batch or v_shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, k {k_shape[0]}, v {v_shape[0]}")
    if k_shape[3] != head_dim or v_shape[3] != head_dim:
        raise ValueError(f"head dims differ: q {head_dim}, k {k_shape[3]}, v {v_shape[3]}; "
                         "attngen needs one head dim for q, k and v")
    if v_shape[1] != kv_heads or v_shape[2] != kv_len:
        raise ValueError(f"k has shape {tuple(k_shape)} but v has {tuple(v_shape)}; "
                         "their heads and sequence lengths must match")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q has {heads} heads, which is not a multiple of the {kv_heads} key/value heads")
    if kv_len == 0:
        raise ValueError("k and v have sequence length 0; there is nothing to attend to")
    if kernel:
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head dim {head_dim} is over the supported {MAX_HEAD_DIM}")
        if head_dim < 1:
            raise ValueError(f"head dim {head_dim} must be at least 1")
        if device.type != "cuda":
            if device.type != "cpu":
                raise ValueError(f"q is on {device}; attngen kernels run on CUDA devices")
            if not interpreter_on():
                raise ValueError("q, k and v are CPU tensors; attngen kernels run on a CUDA device, or on the CPU "
                                 "under Triton's interpreter (set TRITON_INTERPRET=1 before triton is imported)")
    return Shape(batch, heads, kv_heads, q_len, kv_len, head_dim)


def check_flag(name: str, value) -> bool:
    """A boolean flag such as `return_lse`: a bool, not a value that merely looks true ('yes', 1)."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return value


def check_topk(topk, kv_len: int) -> int:
    """The number of scores each row keeps; 0 for all of them (topk None, or >= the key length)."""
    if topk is None:
        return 0
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"topk must be an int or None, got {type(topk).__name__}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1 (or None for plain softmax), got {topk}")
    if topk >= kv_len:
        return 0  # every row keeps all the keys it sees
    if topk > MAX_TOPK:
        raise ValueError(f"topk={topk} is over the supported {MAX_TOPK} (for k and v of length {kv_len})")
    return topk


def topk_pad(topk: int) -> int:
    """`topk` rounded up to a power of two (0 when topk is 0): the K bucket of registry variants."""
    return 0 if topk == 0 else 1 << (topk - 1).bit_length()


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return float(scale)


def check_dropout(dropout_p) -> float:
    """The dropout probability as a float in [0, 1)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


_SEEDS = threading.local()  # each thread's one-element buffer that draw_seed fills


def draw_seed() -> int:
    """A dropout seed from torch's default (CPU) generator: torch.manual_seed reproduces it, and no
    device is synchronised. It fills a buffer kept per thread (the draw of torch.randint(0, 2**31 - 1,
    (1,)) without allocating a tensor, a third of its host time)."""
    buffer = getattr(_SEEDS, "buffer", None)
    if buffer is None:
        with torch.inference_mode(False):  # a normal tensor: written in place in and out of inference mode
            buffer = _SEEDS.buffer = torch.empty((), dtype=torch.int64)
    return buffer.random_(0, 2**31 - 1).item()
