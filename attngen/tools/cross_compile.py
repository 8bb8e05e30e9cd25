"""Compile kernel launches for a GPU architecture on any machine, GPU or not.

Triton's interpreter runs code that a GPU compiler may refuse (an int8 dot over 16 keys once
did), so the CPU tests also compile the kernels for sm_90 with Triton's bundled ptxas. This runs
in a process of its own: the interpreter, once on, cannot compile.

    python -m attngen.tools.cross_compile topk BLOCK_M BLOCK_N WARPS STAGES TMA(0/1) TOPK KV_LEN
    python -m attngen.tools.cross_compile backward BLOCK_M BLOCK_N WARPS STAGES MASK DROPOUT(0/1)
    python -m attngen.tools.cross_compile decode BLOCK_M BLOCK_N WARPS STAGES MASK PAGED(0/1) GROUP SQ

prints `ok <kernel name> <shared memory bytes> <registers> <spilled bytes>` for every launch of a top-k call (its threshold
kernels), of a backward call at that `bwd` config (MASK: a spec, `none` for dense), or of a decode
call split over the keys at that `decode` config (its split and combine kernels; a paged cache of
16-row pages or a contiguous one; GROUP query heads per key/value head, SQ new tokens), built as for
a CUDA tensor (B=1, H=2, Sq=Sk=64 for the backward, D=128, bf16).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

def compile_launch(launch, arch: int = 90, **overrides):
    """Compile `launch` (attngen.kernels.launch.Launch) for CUDA compute capability `arch`; its
    compile options with `overrides` applied. Returns the compiled kernel (metadata: name, shared;
    asm: the ttgir, ptx, cubin). Every argument is specialised as a launch of these values would
    specialise it (Triton's own rule: ints equal to 1 become constants, ints and pointers that are
    multiples of 16 are marked so, unless the kernel says do_not_specialize), so the code is the
    code a GPU would run: the CPU tensors' pointers stand in for the GPU's (both 16-byte aligned)."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    kernel = launch.kernel
    options = dict(launch.options, **overrides)
    launch_options = {name: options.pop(name) for name in ("num_warps", "num_stages", "maxnreg") if name in options}
    params = {p.name: p for p in kernel.params}
    signature, constants, attrs = {}, {}, {}
    for name, value in zip(launch.names, launch.values):
        p = params[name]
        kind, spec = native_specialize_impl(CUDABackend, value, False, not p.do_not_specialize,
                                            not p.do_not_specialize_on_alignment)
        signature[name] = kind
        if kind == "constexpr":
            constants[(p.num,)] = spec
        elif isinstance(spec, str):
            attrs[(p.num,)] = CUDABackend.parse_attr(spec)
    for name, value in options.items():
        signature[name] = "constexpr"
        constants[(params[name].num,)] = value
    signature = {name: signature[name] for name in kernel.arg_names}
    return triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=launch_options)


def ptxas_usage(compiled, arch: int = 90) -> tuple[int, int]:
    """(registers per thread, spilled bytes stored) of a compiled kernel, from `ptxas -v` (Triton's
    bundled ptxas) on its PTX: a kernel that spills in its main loop is slow on any GPU."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch)
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([getattr(ptxas, "path", ptxas), "-v", f"--gpu-name=sm_{arch}a", ptx, "-o",
                                 os.path.join(folder, "kernel.cubin")], capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return registers, spills


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


def decode_launches(block_m: int, block_n: int, warps: int, stages: int, mask: str, paged: bool, group: int,
                    q_len: int):
    """The launches of a decode call split four ways at that `decode` config (B=2, 2 key/value heads,
    a 4096-key cache), as a CUDA launch would make them."""
    from ..config import KernelConfig
    from ..kernels.decode import check_decode, decode_launches as launches
    from ..masks import bind, parse_spec

    config = KernelConfig(block_m, block_n, warps, stages)
    q = torch.zeros(2, 2 * group, q_len, 128, dtype=torch.bfloat16)
    lens = torch.zeros(2, dtype=torch.int32)
    table = torch.zeros(2, 256, dtype=torch.int32) if paged else None
    cache = torch.zeros(512, 16, 2, 128, dtype=torch.bfloat16) if paged else torch.zeros(2, 2, 4096, 128,
                                                                                         dtype=torch.bfloat16)
    shape, layout = check_decode(q, cache, cache, lens, table, kernel=False)
    m = parse_spec(mask)
    bound = bind(m, batch=2, heads=shape.heads, q_len=layout.capacity, kv_len=layout.capacity, device=q.device)
    return launches(q, cache, cache, table, lens, q, None, bound, shape, layout, 128 ** -0.5, config, 4)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "topk" and len(argv) == 8:
        bm, bn, warps, stages, tma, topk, kv_len = (int(x) for x in argv[1:])
        launches = topk_launches(bm, bn, warps, stages, bool(tma), topk, kv_len)
    elif argv and argv[0] == "backward" and len(argv) == 7:
        bm, bn, warps, stages = (int(x) for x in argv[1:5])
        launches = [(launch, {}) for launch in backward_launches(bm, bn, warps, stages, argv[5], argv[6] == "1")]
    elif argv and argv[0] == "decode" and len(argv) == 9:
        bm, bn, warps, stages = (int(x) for x in argv[1:5])
        launches = [(launch, {}) for launch in decode_launches(bm, bn, warps, stages, argv[5], argv[6] == "1",
                                                               int(argv[7]), int(argv[8]))]
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for launch, options in launches:
        compiled = compile_launch(launch, **options)
        print("ok", compiled.metadata.name, compiled.metadata.shared, *ptxas_usage(compiled), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
