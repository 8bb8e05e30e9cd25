"""Which (row, column) of a key block's scores each packed register of a thread holds, in the
layout the threshold kernels compute their scores in on Hopper: a 64x64 wgmma accumulator at 4
warps (TOPK_THRESHOLD_TILE), bf16 operands with D=128.

A dense capture (benchmarks/RESULTS.md, after runs 56 to 59) would hand all 32 of a thread's
scores of a block to one inline-asm block (`tl.inline_asm_elementwise(..., pack=32)`, which
compiles for sm_90 with no layout conversion) and needs to know whose they are. The kernel below
writes, at every (row, column), the index of the packed register that holds it and the thread
(`%tid.x`) that holds it. The script prints thread 0's map, then checks that every thread's map
is thread 0's shifted by the same rule, and exits 1 if not. GPU only (the interpreter has no
layouts): python benchmarks/experiments/topk_capture/register_map.py
"""
import sys

import torch
import triton
import triton.language as tl

N_PACK = 32  # a thread's scores of a 64x64 block at 4 warps
PACK = tl.constexpr(N_PACK)
SLOT_ASM = tl.constexpr("".join(f"mov.b32 ${i}, {i}; " for i in range(N_PACK)))  # register i holds i
SLOT_CONSTRAINTS = tl.constexpr(",".join(["=r"] * N_PACK + ["r"] * N_PACK))


@triton.jit
def register_map(Q, K, SLOT, TID, D: tl.constexpr):
    rows = tl.arange(0, 64)
    dims = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + dims[None, :])
    k = tl.load(K + rows[:, None] * D + dims[None, :])
    s = tl.dot(q, tl.trans(k))  # as _scores computes a block's scores
    slot = tl.inline_asm_elementwise(SLOT_ASM, SLOT_CONSTRAINTS, [s], dtype=tl.int32, is_pure=True, pack=PACK)
    tid = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [s], dtype=tl.int32, is_pure=True, pack=1)
    out = rows[:, None] * 64 + rows[None, :]
    tl.store(SLOT + out, slot)
    tl.store(TID + out, tid)


def describe(slot: torch.Tensor, tid: torch.Tensor) -> list[int]:
    """Print thread 0's register map and each warp's first thread's shift from it; return the
    threads whose map is not thread 0's shifted (or who hold other than N_PACK registers)."""
    owned = {}
    for r in range(slot.shape[0]):
        for c in range(slot.shape[1]):
            owned.setdefault(int(tid[r, c]), []).append((int(slot[r, c]), r, c))
    base = sorted(owned[0])
    print("thread 0: register -> (row, column):")
    print("  " + ", ".join(f"{i}: ({r}, {c})" for i, r, c in base))
    bad = []
    for t, cells in sorted(owned.items()):
        cells = sorted(cells)
        if [i for i, _, _ in cells] != list(range(N_PACK)):
            bad.append(t)
            continue
        dr, dc = cells[0][1] - base[0][1], cells[0][2] - base[0][2]
        if any((r - r0, c - c0) != (dr, dc) for (_, r, c), (_, r0, c0) in zip(cells, base)):
            bad.append(t)
        elif t % 32 == 0 or t < 4:
            print(f"thread {t}: thread 0's map shifted by ({dr} rows, {dc} columns)")
    print("every thread holds 32 registers, its map thread 0's shifted" if not bad else f"threads that differ: {bad}")
    return bad


def main() -> int:
    d = 128
    q = torch.randn(64, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, d, device="cuda", dtype=torch.bfloat16)
    slot = torch.full((64, 64), -1, dtype=torch.int32, device="cuda")
    tid = torch.full((64, 64), -1, dtype=torch.int32, device="cuda")
    register_map[(1,)](q, k, slot, tid, D=d, num_warps=4)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    return 1 if describe(slot.cpu(), tid.cpu()) else 0


if __name__ == "__main__":
    sys.exit(main())
