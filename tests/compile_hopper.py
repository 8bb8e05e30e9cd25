"""Compile the top-k threshold kernel for sm_90 on any machine, GPU or not: run as a child process
(the tests' own process runs kernels under Triton's interpreter, which cannot compile them).

    python tests/compile_hopper.py BLOCK_M BLOCK_N WARPS STAGES TMA(0/1) TOPK KV_LEN

Builds the launches the way Thresholds does for a CUDA tensor (their kwargs, the asm stores, the
register cap) and compiles every launch with Triton's bundled ptxas; prints `ok`, the kernel's name and
its shared memory in bytes for each.
"""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import attngen.kernels.forward as fwd  # noqa: E402
from attngen.checks import check_qkv  # noqa: E402
from attngen.config import KernelConfig  # noqa: E402

POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32"}


def main() -> int:
    bm, bn, warps, stages, tma, topk, kv_len = (int(x) for x in sys.argv[1:8])
    config = KernelConfig(bm, bn, warps, stages, use_tma=bool(tma))
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, kv_len, 128, dtype=torch.bfloat16)
    shape = check_qkv(q, k, k, kernel=False)  # CPU tensors stand in for the shapes and strides only
    bound, structure = fwd.blocks(q, None, shape, config)
    thresholds = fwd.Thresholds(q, k, bound, structure, shape, 128 ** -0.5, topk, config)
    thresholds.tma = bool(tma)  # CPU tensors are never TMA-eligible; the config says what a GPU would run
    buffers = thresholds.buffers(q.device)
    for kernel, _, values, kwargs in thresholds.launches(q, k, *buffers):
        kwargs = dict(kwargs, **({"ASM_STORE": True} if "ASM_STORE" in kwargs else {}))
        options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages", "maxnreg") if name in kwargs}
        signature = {}
        for name, value in zip(kernel.arg_names, values):
            if isinstance(value, torch.Tensor):
                signature[name] = POINTER_TYPES[value.dtype]
            else:
                signature[name] = "fp32" if isinstance(value, float) else "i32"
        constants = {}
        for name, value in kwargs.items():
            signature[name] = "constexpr"
            constants[(kernel.arg_names.index(name),)] = value
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        print("ok", compiled.metadata.name, compiled.metadata.shared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
