"""Compile kernel launches for a GPU architecture on any machine, GPU or not.

Triton's interpreter runs code that a GPU compiler may refuse (an int8 dot over 16 keys once
did), so the CPU tests also compile the kernels for sm_90 with Triton's bundled ptxas. This runs
in a process of its own: the interpreter, once on, cannot compile.

    python -m attngen.tools.cross_compile topk BLOCK_M BLOCK_N WARPS STAGES TMA(0/1) TOPK KV_LEN
    python -m attngen.tools.cross_compile backward BLOCK_M BLOCK_N WARPS STAGES MASK DROPOUT(0/1)
    python -m attngen.tools.cross_compile varlen MASK

prints `ok <kernel name> <shared memory bytes>` for every launch of a top-k call (its threshold
kernels), or of a backward call at that `bwd` config (MASK: a spec, `none` for dense), built as for
a CUDA tensor (B=1, H=2, Sq=Sk=64 for the backward, D=128, bf16). `varlen` compiles the forward,
dK/dV and dQ launches of a varlen_attention call with MASK (a spec) and of the same packing as
`document & MASK` on the packed view, at the sm_90 default configs, and prints
`<varlen|document> <kernel name> <registers> <spill bytes> <SASS instructions>` for each (ptxas -v
and cuobjdump from Triton's CUDA tools).
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
    compile options with `overrides` applied, its arguments specialised as Triton's launcher
    specialises a CUDA launch's (ints and pointers divisible by 16, ints equal to 1). Returns the
    compiled kernel (metadata: name, shared; asm: ptx, cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    args, specialization, options = bind(**dict(zip(launch.names, launch.values)), **dict(launch.options, **overrides))
    options, signature, constexprs, attrs = kernel._pack_args(backend, options, args, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def usage(compiled) -> tuple[int, int, int]:
    """(registers, spill bytes stored and loaded, SASS instructions) of a kernel compile_launch
    compiled, from ptxas -v and cuobjdump -sass of Triton's CUDA tools."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton import knobs

    arch = compiled.metadata.target.arch
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([knobs.nvidia.ptxas.path, "-v", f"--gpu-name=sm_{arch}a", str(ptx), "-o", str(cubin)],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups()
    instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.MULTILINE))
    return registers, int(stores) + int(loads), instructions


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


def varlen_launches(mask: str) -> dict:
    """{"varlen": launches, "document": launches}: the forward, dK/dV and dQ launches of a
    varlen_attention call with `mask` on 1024 packed tokens in 5 sequences, and of attention() on
    the same packing as `document & mask` (the same tiles), at the sm_90 default configs."""
    from .. import masks as masks_
    from ..checks import check_qkv
    from ..config import default_config
    from ..kernels.backward import backward_launches as bwd_launches
    from ..kernels.forward import blocks, forward_launch
    from ..varlen import _localize, _positions

    lengths = torch.tensor([300, 200, 1, 475, 48])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    q = torch.zeros(1, 2, int(lengths.sum()), 128, dtype=torch.bfloat16)
    shape = check_qkv(q, q, q, kernel=False)
    lse = torch.zeros(1, 2, shape.q_len)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    fwd, bwd = default_config("fwd", "sm90", 128), default_config("bwd", "sm90", 128)
    out = {}
    for name, m in (("varlen", _localize(mask, _positions(cu, cu, shape.q_len))),
                    ("document", masks_.mask("document", doc_ids=doc_ids) & masks_.parse_spec(mask))):
        bound, structure = blocks(q, m, shape, fwd)
        out[name] = [forward_launch(q, q, q, q, lse, None, bound, structure, shape, 128 ** -0.5, fwd, fwd.use_tma)]
        out[name] += bwd_launches(q, q, q, q, lse, None, q, None, q, q, q, m, shape, 128 ** -0.5, bwd)[1:]
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] == "topk" and len(argv) == 8:
        bm, bn, warps, stages, tma, topk, kv_len = (int(x) for x in argv[1:])
        launches = topk_launches(bm, bn, warps, stages, bool(tma), topk, kv_len)
    elif argv and argv[0] == "backward" and len(argv) == 7:
        bm, bn, warps, stages = (int(x) for x in argv[1:5])
        launches = [(launch, {}) for launch in backward_launches(bm, bn, warps, stages, argv[5], argv[6] == "1")]
    elif argv and argv[0] == "varlen" and len(argv) == 2:
        for name, launches in varlen_launches(argv[1]).items():
            for launch in launches:
                compiled = compile_launch(launch)
                print(name, compiled.metadata.name, *usage(compiled), flush=True)
        return 0
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for launch, options in launches:
        compiled = compile_launch(launch, **options)
        print("ok", compiled.metadata.name, compiled.metadata.shared, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
