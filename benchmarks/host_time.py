"""Host time per call on a tiny shape: attngen.attention with and without the direct launch, against
SDPA, an empty Triton kernel and attngen's kernel launched through `kernel[grid]`; and of a training
step (forward and backward) of attngen and SDPA flash.

    python benchmarks/host_time.py [--calls 2000] [--rounds 7]

B1 H8 S128 D64 bf16: the GPU work of a call takes a few microseconds, so the host's time per call
is what limits back-to-back calls. Each round times `calls` back-to-back calls on the host
(time.perf_counter around the loop, the GPU idle at its start), then synchronizes; the methods
take turns within a round, and the figure is the median over the rounds. `host` is the loop's time
per call, `with sync` includes the wait for the GPU at the end: where the two are close, the GPU was
the bottleneck and `host` is an upper bound. The direct launch is switched with
attngen.kernels.launch.direct_launch (ATTNGEN_DIRECT_LAUNCH=0 turns it off for a whole process).
Prints a table; writes host_time.json into $OUT where OUT is set. About 20 s on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen
from attngen.kernels.launch import direct_launch, direct_launches
from overhead import raw_launch  # benchmarks/overhead.py: attngen's kernel through kernel[grid]

SHAPE = (1, 8, 128, 64)  # B, H, S, D
MASKS = {"dense": None, "causal": "causal", "sliding_window": "sliding_window(window=64)"}


@triton.jit
def empty_kernel(X):
    pass


def methods(q, k, v) -> dict:
    """name -> (a call, the context it runs in, whether it takes the direct launch)."""
    empty = empty_kernel[(1,)]
    found = {
        "SDPA (default backend)": (lambda: F.scaled_dot_product_attention(q, k, v), nullcontext, None),
        "SDPA flash": (lambda: F.scaled_dot_product_attention(q, k, v),
                       lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION), None),
        "empty Triton kernel, kernel[grid]": (lambda: empty(q), nullcontext, None),
        "attngen kernel, kernel[grid] (dense)": (raw_launch(q, k, v, None), nullcontext, None),
    }
    for name, mask in MASKS.items():
        for direct in (True, False):
            found[f"attngen.attention {name}, direct {'on' if direct else 'off'}"] = (
                lambda mask=mask: attngen.attention(q, k, v, mask=mask), nullcontext, direct)
    # a training step: the forward and torch.autograd.grad of q, k, v (attngen: its TrainPlan's launches)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def step(fn):
        return lambda: torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), dout)

    found["SDPA flash, forward + backward (causal)"] = (
        step(lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)),
        lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION), None)
    for direct in (True, False):
        found[f"attngen.attention causal, forward + backward, direct {'on' if direct else 'off'}"] = (
            step(lambda q_, k_, v_: attngen.attention(q_, k_, v_, mask="causal")), nullcontext, direct)
    return found


def check(q, k, v) -> None:
    """The direct launch gives the outputs of Triton's path, bit for bit, before anything is timed."""
    for name, mask in MASKS.items():
        outs = []
        for direct in (False, True, True):  # the first direct call keeps the kernel, the second launches it
            previous = direct_launch(direct)
            try:
                outs.append(attngen.attention(q, k, v, mask=mask))
            finally:
                direct_launch(previous)
        if not torch.equal(outs[0], outs[2]):
            raise SystemExit(f"{name}: the direct launch's output differs from Triton's path's")


def measure(found: dict, calls: int, rounds: int) -> dict:
    """name -> {host, with_sync: per-round µs per call, direct: direct launches per call}."""
    times = {name: dict(host=[], with_sync=[], direct=0) for name in found}
    for round_ in range(rounds + 1):  # round 0 warms up (compiles, keeps the kernels)
        for name, (call, context, direct) in found.items():
            previous = direct_launch(direct) if direct is not None else None
            try:
                with context():
                    for _ in range(20 if round_ else 50):
                        call()
                    torch.cuda.synchronize()
                    taken = direct_launches()
                    start = time.perf_counter()
                    for _ in range(calls):
                        call()
                    host = time.perf_counter() - start
                    torch.cuda.synchronize()
                    total = time.perf_counter() - start
            finally:
                if previous is not None:
                    direct_launch(previous)
            if round_:
                times[name]["host"].append(host / calls * 1e6)
                times[name]["with_sync"].append(total / calls * 1e6)
                times[name]["direct"] = (direct_launches() - taken) / calls
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    q, k, v = (torch.randn(*SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    check(q, k, v)
    times = measure(methods(q, k, v), args.calls, args.rounds)
    rows = [dict(method=name, host_us=statistics.median(t["host"]), with_sync_us=statistics.median(t["with_sync"]),
                 direct_per_call=t["direct"], host_rounds=t["host"]) for name, t in times.items()]
    width = max(len(r["method"]) for r in rows)
    print(f"\nB{SHAPE[0]} H{SHAPE[1]} S{SHAPE[2]} D{SHAPE[3]} bf16, {torch.cuda.get_device_name()}, median of "
          f"{args.rounds} rounds of {args.calls} calls; µs per call")
    print(f"{'method':{width}s}  {'host':>6s}  {'with sync':>9s}  direct launches per call")
    for r in rows:
        print(f"{r['method']:{width}s}  {r['host_us']:6.1f}  {r['with_sync_us']:9.1f}  {r['direct_per_call']:.2f}")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_time.json").write_text(json.dumps(dict(
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
            python=sys.version.split()[0], shape=SHAPE, dtype="bf16", calls=args.calls, rounds=args.rounds,
            rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
