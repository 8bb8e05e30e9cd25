"""Compile kernel launches for a GPU architecture on any machine, GPU or not.

Triton's interpreter runs code that a GPU compiler may refuse (an int8 dot over 16 keys once
did), so the CPU tests also compile the kernels for sm_90 with Triton's bundled ptxas. This runs
in a process of its own: the interpreter, once on, cannot compile.

    python -m attngen.tools.cross_compile topk BLOCK_M BLOCK_N WARPS STAGES TMA(0/1) TOPK KV_LEN
    python -m attngen.tools.cross_compile forward BLOCK_M BLOCK_N WARPS STAGES TMA(0/1) MASK DROPOUT(0/1) [WS(0/1)]
    python -m attngen.tools.cross_compile backward BLOCK_M BLOCK_N WARPS STAGES MASK DROPOUT(0/1) [TMA(0/1) [ATOMIC_DQ(0/1) [TOPK(0/1/2)]]]
    python -m attngen.tools.cross_compile decode BLOCK_M BLOCK_N WARPS STAGES MASK PAGED(0/1) GROUP SQ
    python -m attngen.tools.cross_compile varlen MASK

(every form but varlen may start with `--loops`)

prints `ok <kernel name> <shared memory bytes> <registers> <spill bytes> <SASS instructions>` for
every launch of a top-k call (its threshold kernels), of a forward call at that `fwd` config, of a backward call at that `bwd` config (MASK:
a spec, `none` for dense), or of a decode call split over the keys at that `decode` config (its
split and combine kernels; a paged cache of 16-row pages or a contiguous one; GROUP query heads per
key/value head, SQ new tokens), built as for a CUDA tensor (B=1, H=2, Sq=Sk=256 for the forward,
64 for the backward, D=128, bf16); with WS 1, then `partitions <kernel name> <N>`: the
warp-specialized regions of its TTGIR (0 where the compiler made none). `varlen` compiles the forward,
dK/dV and dQ launches of a varlen_attention call with MASK (a spec) and of the same packing as
`document & MASK` on the packed view, at the sm_90 default configs, and prints
`<varlen|document> <kernel name> <registers> <spill bytes> <SASS instructions>` for each (ptxas -v
and cuobjdump from Triton's CUDA tools). With `--loops`, each `ok` line is followed by one
`loop <kernel name> <index> <instructions> <OPCODE>=<count> ...` line per loop of its SASS (a branch
back to an earlier instruction), in address order: the instructions an iteration issues per thread.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

def compile_launch(launch, arch: int = 90, **overrides):
    """Compile `launch` (attngen.kernels.launch.Launch) for CUDA compute capability `arch`; its
    compile options with `overrides` applied, its arguments specialised as Triton's launcher
    specialises a CUDA launch's (ints and pointers divisible by 16, ints equal to 1). A Gluon
    kernel compiles from its Gluon source. Returns the compiled kernel (metadata: name, shared; asm:
    ptx, cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    if kernel.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    args, specialization, options = bind(**dict(zip(launch.names, launch.values)), **dict(launch.options, **overrides))
    options, signature, constexprs, attrs = kernel._pack_args(backend, options, args, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def assemble(compiled) -> tuple[str, str]:
    """(ptxas -v's report, cuobjdump -sass's listing) of a kernel compile_launch compiled, from
    Triton's CUDA tools."""
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
    return report, sass


def usage(compiled) -> tuple[int, int, int]:
    """(registers, spill bytes stored and loaded, SASS instructions) of a kernel compile_launch
    compiled."""
    import re

    report, sass = assemble(compiled)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups()
    return registers, int(stores) + int(loads), len(_instructions(sass))


def _instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction of a cuobjdump -sass listing."""
    import re

    return [(int(a, 16), text.strip()) for a, text in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass,
                                                                 flags=re.MULTILINE)]


def loops(sass: str) -> list[tuple[int, Counter]]:
    """The loops of a cuobjdump -sass listing, in address order: for each branch back to an earlier
    instruction, the instructions from its target to it, as (count, opcodes without modifiers or
    predicate counted). How a change's cost per iteration shows before any GPU runs it."""
    import re

    listing = _instructions(sass)
    at = {address: i for i, (address, _) in enumerate(listing)}
    found = []
    for i, (address, text) in enumerate(listing):
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address and int(branch.group(1), 16) in at:
            body = listing[at[int(branch.group(1), 16)]:i + 1]
            ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)
            found.append((len(body), ops))
    return found


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


def forward_launches(block_m: int, block_n: int, warps: int, stages: int, tma: bool, mask: str, dropout: bool,
                     warp_specialize: bool = False):
    """The launch of a forward call (storing the LSE, as under autograd) at that `fwd` config, on
    Sq = Sk = 256 (a whole number of key blocks: without a mask, no tile is partial)."""
    from ..checks import check_qkv
    from ..config import KernelConfig
    from ..kernels.forward import blocks, forward_launch
    from ..masks import parse_spec

    config = KernelConfig(block_m, block_n, warps, stages, use_tma=tma, warp_specialize=warp_specialize)
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    shape = check_qkv(q, q, q, kernel=False)
    bound, structure = blocks(q, parse_spec(mask), shape, config)
    return [forward_launch(q, q, q, q, torch.zeros(1, 2, 256), None, bound, structure, shape, 128 ** -0.5, config,
                           tma, dropout_p=0.1 if dropout else 0.0, seed=1)]


def backward_launches(block_m: int, block_n: int, warps: int, stages: int, mask: str, dropout: bool,
                      tma: bool = False, atomic_dq: bool = False, topk: int = 0):
    """The launches of a backward call at that `bwd` config, as a CUDA launch would make them (with
    tensor-descriptor loads; with deterministic=False's atomic dQ). `topk` 1: as a top-k call's at
    the threshold kernels' tiles (kernels.backward.topk_config off its any_tile rule), both kernels
    at (block_m, block_n) with the scores in the forward's orientation (with `tma` too, what they
    would be if kernels.backward.takes_tma let them load through descriptors); 2: as a top-k
    call's at its own config, the tiles and orientation of any other call (on Hopper)."""
    from ..checks import check_qkv
    from ..config import KernelConfig
    from ..kernels.backward import backward_launches as launches
    from ..masks import parse_spec

    config = KernelConfig(block_m, block_n, warps, stages, use_tma=tma)
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    shape = check_qkv(q, q, q, kernel=False)
    lse = torch.zeros(1, 2, 64)
    acc = torch.zeros(q.shape, dtype=torch.float32) if atomic_dq else None
    thr = torch.zeros(2 * q.shape[:3].numel()) if topk else None
    return launches(q, q, q, q, lse, thr, q, None, q, q, q, parse_spec(mask), shape, 128 ** -0.5, config,
                    fwd_orient=topk == 1, dropout_p=0.1 if dropout else 0.0, seed=1, dq_acc=acc, use_tma=tma)


def decode_launches(block_m: int, block_n: int, warps: int, stages: int, mask: str, paged: bool, group: int,
                    q_len: int):
    """The launches of a decode call split 32 ways at that `decode` config (B=2, 2 key/value heads,
    a 4096-key cache), as a CUDA launch on sm_90 would make them (the combine a programmatic
    dependent; it reads all 32 splits at once where its element budget allows: batch 1 on an H200
    takes 29 splits)."""
    from ..config import KernelConfig
    from ..kernels.decode import check_decode
    from ..kernels.decode import decode_launches as launches
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
    return launches(q, cache, cache, table, lens, q, None, bound, shape, layout, 128 ** -0.5, config, 32, pdl=True)


def varlen_launches(mask: str) -> dict:
    """{"varlen": launches, "document": launches}: the forward, dK/dV and dQ launches of a
    varlen_attention call with `mask` on 1024 packed tokens in 5 sequences, and of attention() on
    the same packing as `document & mask`, at the sm_90 default configs (the forward's for each
    mask: attngen.families.FORWARD.table)."""
    from .. import masks as masks_
    from ..checks import check_qkv
    from ..config import default_config
    from ..families import FORWARD
    from ..kernels.backward import backward_launches as bwd_launches
    from ..kernels.forward import blocks, forward_launch
    from ..varlen import _localize, _positions

    lengths = torch.tensor([300, 200, 1, 475, 48])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    q = torch.zeros(1, 2, int(lengths.sum()), 128, dtype=torch.bfloat16)
    shape = check_qkv(q, q, q, kernel=False)
    lse = torch.zeros(1, 2, shape.q_len)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    bwd = default_config("bwd", "sm90", 128)
    out = {}
    for name, m in (("varlen", _localize(mask, _positions(cu, cu, shape.q_len))),
                    ("document", masks_.mask("document", doc_ids=doc_ids) & masks_.parse_spec(mask))):
        fwd = default_config(FORWARD.table(shape, q.device, False, m), "sm90", 128)
        bound, structure = blocks(q, m, shape, fwd)
        out[name] = [forward_launch(q, q, q, q, lse, None, bound, structure, shape, 128 ** -0.5, fwd, fwd.use_tma)]
        out[name] += bwd_launches(q, q, q, q, lse, None, q, None, q, q, q, m, shape, 128 ** -0.5, bwd)[1:]
    return out


def main(argv: list[str]) -> int:
    show_loops = bool(argv) and argv[0] == "--loops"
    if show_loops:
        argv = argv[1:]
    warp_specialize = bool(argv) and argv[0] == "forward" and argv[8:] == ["1"]
    if argv and argv[0] == "topk" and len(argv) == 8:
        bm, bn, warps, stages, tma, topk, kv_len = (int(x) for x in argv[1:])
        launches = topk_launches(bm, bn, warps, stages, bool(tma), topk, kv_len)
    elif argv and argv[0] == "forward" and 8 <= len(argv) <= 9:
        bm, bn, warps, stages, tma = (int(x) for x in argv[1:6])
        launches = [(launch, {}) for launch in forward_launches(bm, bn, warps, stages, bool(tma), argv[6],
                                                                argv[7] == "1", warp_specialize)]
    elif argv and argv[0] == "backward" and 7 <= len(argv) <= 10:
        bm, bn, warps, stages = (int(x) for x in argv[1:5])
        flags = [x == "1" for x in argv[6:9]] + [False] * (9 - min(len(argv), 9))
        topk = int(argv[9]) if len(argv) == 10 else 0
        launches = [(launch, {}) for launch in backward_launches(bm, bn, warps, stages, argv[5], *flags, topk)]
    elif argv and argv[0] == "decode" and len(argv) == 9:
        bm, bn, warps, stages = (int(x) for x in argv[1:5])
        launches = [(launch, {}) for launch in decode_launches(bm, bn, warps, stages, argv[5], argv[6] == "1",
                                                               int(argv[7]), int(argv[8]))]
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
        print("ok", compiled.metadata.name, compiled.metadata.shared, *usage(compiled), flush=True)
        if warp_specialize:
            print("partitions", compiled.metadata.name, compiled.asm["ttgir"].count("ttg.warp_specialize("),
                  flush=True)
        if show_loops:
            for i, (count, ops) in enumerate(loops(assemble(compiled)[1])):
                print("loop", compiled.metadata.name, i, count, " ".join(f"{op}={n}" for op, n in ops.most_common()),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
