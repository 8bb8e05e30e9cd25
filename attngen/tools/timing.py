"""Timing and work counting shared by the tuner and the benchmarks.

FLOPs: 4 * D per visible (query, key) pair (two matrix products, a multiply and an add each),
counted over every batch and head; a causal mask counts about half the pairs of a dense one.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from .. import masks as masks_

BWD_FACTOR = 2.5  # backward FLOPs per forward FLOP (FlashAttention's convention: 5 matmuls against 2)


def visible_pairs(mask, batch: int, heads: int, q_len: int, kv_len: int, device, chunk: int = 1024) -> int:
    """Number of visible (query, key) pairs, evaluated in chunks of query rows."""
    m = masks_.as_mask(mask)
    if m is None or m.tree is None:
        return batch * heads * q_len * kv_len
    bound = masks_.bind(m, batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, device=device)
    total = 0
    for start in range(0, q_len, chunk):
        q = torch.arange(start, min(q_len, start + chunk), device=device)
        env = masks_.index_env(q, torch.arange(kv_len, device=device), q_len=q_len, kv_len=kv_len, batch=batch,
                               heads=heads)
        visible = torch.as_tensor(masks_.evaluate_visible(bound, env), device=device)
        total += int(visible.expand(batch, heads, q.numel(), kv_len).sum())
    return total


def attention_flops(mask, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, device) -> int:
    return 4 * head_dim * visible_pairs(mask, batch, heads, q_len, kv_len, device)


def input_sets(bytes_per_set: int, device) -> int:
    """How many input sets to rotate so that one pass over them is at least 4x the L2 (at most 16)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(16, math.ceil(4 * l2 / max(1, bytes_per_set))))


def median_ms(fn, device, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median time of fn() in ms: CUDA events via triton.testing.do_bench, or a wall clock on the CPU."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warm-up (compilation, caches)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class Rotation:
    """Calls fn on each input set in turn, so repeated timing runs do not all hit the L2."""

    def __init__(self, fn, sets: list):
        self.fn, self.sets, self.i = fn, sets, 0

    def __call__(self):
        args = self.sets[self.i % len(self.sets)]
        self.i += 1
        return self.fn(*args)


def kernel_times(fn, calls: int = 20) -> dict[str, float]:
    """GPU time per call of each CUDA kernel that `fn()` launches, in ms (torch.profiler over
    `calls` calls after one warm-up call), keyed by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls / 1e3 for e in prof.key_averages()
            if e.device_time_total > 0 and e.device_type.name == "CUDA"}


_FLUSH_BYTES = 256 * 1024 * 1024
_flush_buffers: dict = {}


def clean_ms(fn, calls: int = 100) -> float:
    """Median time of fn() in ms over `calls` calls, each timed with CUDA events after a read of
    256 MiB: the L2 holds none of fn's inputs and nothing dirty. triton.testing.do_bench zeroes
    256 MiB instead, and the L2 writes those dirty lines back while the timed call runs: on an H200
    that added 8 µs to a 70 µs memory-bound decode call and 4 µs to a 127 µs copy (2026-12-04),
    a cost of the flush, not of the call."""
    device = torch.cuda.current_device()
    buffer = _flush_buffers.get(device)
    if buffer is None:
        buffer = _flush_buffers[device] = torch.ones(_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    for _ in range(3):  # warm-up
        fn()
    events = []
    for _ in range(calls):
        buffer.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def graph_ms(fns: list, calls: int = 30, replays: int = 10) -> float:
    """Time per call in ms of fns[0](), fns[1](), ... in turn (`calls` calls), captured in one CUDA
    graph: the median of `replays` replays timed with CUDA events, over `calls`. How a decoding
    server runs its steps: no launch gaps and no host in the timing, and nothing between the calls.
    Give fns over input sets that together exceed the L2."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture: compilation, plans, allocator pools
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)
