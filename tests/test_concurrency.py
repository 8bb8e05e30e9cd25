"""attngen.attention from many threads at once: every result bit for bit the single-threaded one,
no exception, with every cache cold when the threads start (the interpreter's launches take turns,
the caches are shared)."""

import math
import threading
import time

import pytest
import torch

import attngen
from attngen import caches
from helpers import DEVICE, DTYPES, rand_qkv

THREADS = 8


def cases(device, scale: int):
    """Ten calls of mixed shapes, dtypes and masks (a spec string, a mask with a tensor: plans of
    their own), two of them top-k; `scale` multiplies the lengths."""
    generator = torch.Generator().manual_seed(0)
    ids = (torch.arange(11 * scale) // (4 * scale)).to(device)[None]
    masks = [None, "causal", f"sliding_window(window={3 * scale})", attngen.mask("document", doc_ids=ids),
             attngen.mask("causal") & attngen.mask("softcap", cap=5.0)]
    out = []
    for i, (q_len, head_dim) in enumerate([(3, 16), (9, 8)]):
        for j, mask in enumerate(masks):
            dtype = DTYPES[(i + j) % len(DTYPES)]
            q, k, v = rand_qkv(1, 2, 1 + (i + j) % 2, q_len * scale, 11 * scale, head_dim, dtype, device=device,
                               generator=generator)
            topk = 3 * scale if j == 1 + 2 * i else None
            out.append(dict(q=q, k=k, v=v, mask=mask, topk=topk, return_lse=j % 2 == 1))
    return out


def call(case):
    out = attngen.attention(**case)
    return out if isinstance(out, tuple) else (out,)


def run_threads(cases_, expected, *, calls: int, seconds: float = 0.0):
    """THREADS threads, each making at least `calls` calls and calling for at least `seconds`, walk
    the cases from evenly spaced starts (so that together they make every call at least once when
    `calls` >= len(cases_) / THREADS), with every cache of attngen cleared first. Returns (errors,
    mismatches)."""
    for cache in caches.all_caches().values():
        cache.clear()
    start = threading.Barrier(THREADS)
    errors, mismatches = [], []

    def work(t):
        first = t * len(cases_) // THREADS
        start.wait()
        deadline = time.monotonic() + seconds
        done = 0
        try:
            while done < calls or time.monotonic() < deadline:
                i = (first + done) % len(cases_)
                got = call(cases_[i])
                if not all(torch.equal(a, b) for a, b in zip(got, expected[i])):
                    mismatches.append((t, i))
                done += 1
        except Exception as e:  # noqa: BLE001: every failure is reported, by thread
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors, mismatches


def test_threads_give_the_single_threaded_results():
    cases_ = cases(DEVICE, 1)
    expected = [call(c) for c in cases_]
    assert all(not torch.isnan(t).any() for e in expected for t in e)
    errors, mismatches = run_threads(cases_, expected, calls=math.ceil(len(cases_) / THREADS), seconds=3.0)
    assert errors == [] and mismatches == []


@pytest.mark.gpu
def test_threads_give_the_single_threaded_results_compiled():
    """8 threads x 200 calls of the compiled kernels, bf16 included."""
    cases_ = cases("cuda", 37)
    expected = [call(c) for c in cases_]
    torch.cuda.synchronize()
    errors, mismatches = run_threads(cases_, expected, calls=200)
    torch.cuda.synchronize()
    assert errors == [] and mismatches == []
