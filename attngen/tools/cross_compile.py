"""Compile kernel launches for a GPU architecture on any machine, GPU or not.

Triton's interpreter runs code that a GPU compiler may refuse (an int8 dot over 16 keys once
did), so the CPU tests also compile the kernels for sm_90 with Triton's bundled ptxas. This runs
in a process of its own: the interpreter, once on, cannot compile.

    python -m attngen.tools.cross_compile topk BLOCK_M BLOCK_N WARPS STAGES TMA(0/1) TOPK KV_LEN
    python -m attngen.tools.cross_compile backward BLOCK_M BLOCK_N WARPS STAGES MASK DROPOUT(0/1)

prints `ok <kernel name> <shared memory bytes>` for every launch of a top-k call (its threshold
kernels), or of a backward call at that `bwd` config (MASK: a spec, `none` for dense), built as for
a CUDA tensor (B=1, H=2, Sq=Sk=64 for the backward, D=128, bf16).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
                 torch.int8: "*i8", torch.bool: "*i1"}


def compile_launch(launch, arch: int = 90, **overrides):
    """Compile `launch` (attngen.kernels.launch.Launch) for CUDA compute capability `arch`; its
    compile options with `overrides` applied. Returns the compiled kernel (metadata: name, shared)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = launch.kernel
    options = dict(launch.options, **overrides)
    launch_options = {name: options.pop(name) for name in ("num_warps", "num_stages", "maxnreg") if name in options}
    signature, constants = {}, {}
    for name, value in zip(launch.names, launch.values):
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
    for name, value in options.items():
        signature[name] = "constexpr"
        constants[(kernel.arg_names.index(name),)] = value
    signature = {name: signature[name] for name in kernel.arg_names}
    return triton.compile(ASTSource(kernel, signature, constexprs=constants), target=GPUTarget("cuda", arch, 32),
                          options=launch_options)


def topk_launches(block_m: int, block_n: int, warps: int, stages: int, tma: bool, topk: int, kv_len: int):
    """The launches of a top-k call's threshold kernels as a CUDA launch would make them (CPU
    tensors stand in for the shapes and strides only)."""
    from ..checks import check_qkv
    from ..config import KernelConfig
    from ..kernels.forward import blocks
    from ..kernels.topk import Thresholds

    config = KernelConfig(block_m, block_n, warps, stages, use_tma=tma)
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, kv_len, 128, dtype=torch.bfloat16)
    shape = check_qkv(q, k, k, kernel=False)
    bound, structure = blocks(q, None, shape, config)
    thresholds = Thresholds(q, k, bound, structure, shape, 128 ** -0.5, topk, config, own=config)
    out = []
    for launch, options, _ in thresholds.launches:
        cuda = {"ASM_STORE": True} if "ASM_STORE" in options[tma] else {}
        out.append((launch, dict(options[tma], **cuda)))
    return out


def backward_launches(block_m: int, block_n: int, warps: int, stages: int, mask: str, dropout: bool):
    """The launches of a backward call at that `bwd` config, as a CUDA launch would make them."""
    from ..checks import check_qkv
    from ..config import KernelConfig
    from ..kernels.backward import backward_launches as launches
    from ..masks import parse_spec

    config = KernelConfig(block_m, block_n, warps, stages)
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    shape = check_qkv(q, q, q, kernel=False)
    lse = torch.zeros(1, 2, 64)
    return launches(q, q, q, q, lse, None, q, None, q, q, q, parse_spec(mask), shape, 128 ** -0.5, config,
                    dropout_p=0.1 if dropout else 0.0, seed=1)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "topk" and len(argv) == 8:
        bm, bn, warps, stages, tma, topk, kv_len = (int(x) for x in argv[1:])
        launches = topk_launches(bm, bn, warps, stages, bool(tma), topk, kv_len)
    elif argv and argv[0] == "backward" and len(argv) == 7:
        bm, bn, warps, stages = (int(x) for x in argv[1:5])
        launches = [(launch, {}) for launch in backward_launches(bm, bn, warps, stages, argv[5], argv[6] == "1")]
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for launch, options in launches:
        compiled = compile_launch(launch, **options)
        print("ok", compiled.metadata.name, compiled.metadata.shared, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
