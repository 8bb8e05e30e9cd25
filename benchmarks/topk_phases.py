"""Where the top-k threshold kernel spends its time: the kernel timed whole and with its later
phases cut off, one at a time.

    python benchmarks/topk_phases.py [--shape 4,16,4096,128] [--topk 64] [--config 128x64x4x2t]

Each cut is a textual edit of the rendered source (the edits assert that their text is there, so a
change to the template that moves it fails loudly here instead of timing the wrong thing):
  full          the kernel as shipped (its output checked against the float64 reference first)
  no retries    the retry loop never runs (rows whose bracket missed keep a wrong threshold)
  no select     also no selection over the captured scores
  no prefix     also no slot dot: every score of a row lands in the same slot
  no stores     also no capture stores (and so no slots): the capture pass only counts
  sample only   also no capture pass: the sample and its order statistics
The differences between neighbouring rows are what each phase costs; cutting a phase also frees
registers, so they are estimates. Only `full` computes correct thresholds.
"""

from __future__ import annotations

import argparse
import sys

import attngen
import attngen.kernels.forward as fwd
from attngen.render import load_module
from topk_configs import bench, parse_config, random_inputs  # benchmarks/ is on the path of its scripts

# (name, [(old, new), ...]): each cut adds its edits to those of the cuts before it
CUTS = [
    ("full", []),
    ("no retries", [("while tl.max(tl.where(done, 0, 1), 0) > 0:", "while tl.max(tl.where(done, 0, 1), 0) > 1:")]),
    ("no select", [("thr = _select(CAPTURE, CAP_W, SCR, tl.where(fits, n_in, 0), tl.where(fits, topk - ge_hi, 0), "
                    "BLOCK_M,\n                      CAP_GROUP, GRID, ROUNDS)", "thr = (ge_hi + n_in).to(tl.float32)")]),
    ("no prefix", [("earlier = tl.dot(inside.to(tl.int8), before, out_dtype=tl.int32)",
                    "earlier = tl.zeros_like(inside)")]),
    ("no stores", [("    _scatter(CAPTURE, rows[:, None] * CAP_W + slot, s, (inside > 0) & (slot < CAP_W), "
                    "ASM_STORE)\n", "")]),
    ("sample only", [("    for i in tl.range(0, n_full):\n        s = _list_scores(q, K_src, FULL_IDX, first_full,",
                      "    for i in tl.range(0, 0):\n        s = _list_scores(q, K_src, FULL_IDX, first_full,"),
                     ("    for i in tl.range(0, n_part):\n        s = _list_scores(q, K_src, PART_IDX, first_part,",
                      "    for i in tl.range(0, 0):\n        s = _list_scores(q, K_src, PART_IDX, first_part,")]),
]


def cut_sources(source: str):
    """(name, source) of every cut, in order."""
    for name, edits in CUTS:
        for old, new in edits:
            if source.count(old) != 1:
                raise SystemExit(f"cut {name!r}: expected the text once in the rendered kernel, found it "
                                 f"{source.count(old)} times: {old!r}")
            source = source.replace(old, new)
        yield name, source


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="4,16,4096,128", help="B,H,S,D")
    p.add_argument("--topk", default="64", help="comma-separated")
    p.add_argument("--config", default="128x64x4x2t", help="BLOCK_M x BLOCK_N x warps x stages; trailing t: TMA")
    args = p.parse_args()
    config = parse_config(args.config)
    q, k, v, shape, scale, env = random_inputs(args.shape, 9876)
    bound, structure = fwd.blocks(q, None, shape, config)
    print(f"{env}, config {args.config}")
    print("| k | phases kept | threshold ms | less than the row above |")
    print("|---|---|---|---|")
    for topk in (int(x) for x in args.topk.split(",")):
        ref = attngen.reference.attention(q[:1, :2], k[:1, :2], v[:1, :2], topk=topk)
        out = fwd.attention_forward(q, k, v, topk=topk, config=config)[0]
        error = float((out[:1, :2].double() - ref).norm() / ref.norm())
        if error > 1e-2:
            raise SystemExit(f"k={topk}: relative error {error:.1e} against the reference; not timing it")
        thresholds = fwd.Thresholds(q, k, bound, structure, shape, scale, topk, config)
        before = None
        for name, source in cut_sources(fwd.render_source(None)):
            thresholds.kernel = load_module(source).topk_threshold
            thresholds.run(q, k)
            ms = bench(lambda: thresholds.run(q, k))
            delta = f"{before - ms:.3f}" if before is not None else f"(error {error:.1e})"
            print(f"| {topk} | {name} | {ms:.3f} | {delta} |", flush=True)
            before = ms
    return 0


if __name__ == "__main__":
    sys.exit(main())
