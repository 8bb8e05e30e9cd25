"""Can the threshold kernels and the attention kernel of a top-k call run at different tile
configs? Only if every score comes out bit for bit the same. Per config B: the capture and select
launches of B on A's brackets must give A's thresholds exactly (any bit of difference in a score
near a threshold changes a count); then the attention kernel at B on A's thresholds, checked
against float64 and timed next to the attention kernel at A."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch  # noqa: E402
import triton  # noqa: E402

import attngen  # noqa: E402
import attngen.kernels.forward as fwd  # noqa: E402
from topk_configs import bench, launch_times, parse_config, random_inputs  # noqa: E402

shape_text = sys.argv[1] if len(sys.argv) > 1 else "4,16,4096,128"
others = sys.argv[2].split(",") if len(sys.argv) > 2 else ["128x64x4x2t", "128x64x8x2t", "64x64x4x2t"]
a_text = "64x64x4x3t"
q, k, v, shape, scale, env = random_inputs(shape_text, 97531)
print(env)
fwd._ensure_allocator()
print("| K | config | thresholds equal A's | rows differing | attention ms (A: 64x64x4x3t) | capture | select | rel. error |")
print("|---|---|---|---|---|---|---|---|")
for topk in (64, 256):
    ref = attngen.reference.attention(q[:1, :2], k[:1, :2], v[:1, :2], topk=topk)
    cfg_a = parse_config(a_text)
    bound, st_a = fwd.blocks(q, None, shape, cfg_a)
    th_a = fwd.Thresholds(q, k, bound, st_a, shape, scale, topk, cfg_a)
    bufs_a = th_a.buffers(q.device)
    for kernel, grid, args, kw in th_a.launches(q, k, *bufs_a):
        kernel[grid](*args, **kw)
    thr_a, lo_a, hi_a = bufs_a[:3]
    for text in [a_text] + others:
        cfg = parse_config(text)
        try:
            _, st = fwd.blocks(q, None, shape, cfg)
            th = fwd.Thresholds(q, k, bound, st, shape, scale, topk, cfg)
            bufs = list(th.buffers(q.device))
            bufs[1].copy_(lo_a)
            bufs[2].copy_(hi_a)
            launches = th.launches(q, k, *bufs)
            for kernel, grid, args, kw in launches[1:]:  # not the bracket: A's brackets
                kernel[grid](*args, **kw)
            same = torch.equal(bufs[0].view(torch.int32), thr_a.view(torch.int32))
            differ = int((bufs[0].view(torch.int32) != thr_a.view(torch.int32)).sum())
            parts, _ = launch_times(th, q, k)
            out = torch.empty_like(q)
            kernel, grid, args, kw = fwd.launch_args(q, k, v, out, None, thr_a, bound, st, shape, scale, cfg,
                                                     cfg.use_tma)
            kernel[grid](*args, **kw)
            err = float((out[:1, :2].double() - ref).norm() / ref.norm())
            t = bench(lambda: kernel[grid](*args, **kw))
            print(f"| {topk} | {text} | {same} | {differ} | {t:.3f} | {parts['topk_capture']:.3f} | "
                  f"{parts['topk_select']:.3f} | {err:.1e} |", flush=True)
        except Exception as e:
            print(f"| {topk} | {text} | n/a | | | | | {type(e).__name__}: {str(e).splitlines()[0][:80]} |",
                  flush=True)
