"""attngen's in-process caches: each bounded, a value built before a clear never stored after it,
and the fast path's plans hold none of a call's tensors (host and device memory stay bounded)."""

import gc
import weakref

import pytest
import torch

import attngen
from attngen import api, caches
from attngen.caches import BoundedCache
from helpers import DEVICE, check_output, rand_qkv


def test_a_bounded_cache_drops_the_least_recently_used():
    cache = BoundedCache("test.lru", 2)
    try:
        assert cache.put("a", 1) == 1
        cache.put("b", 2)
        cache.touch("a")
        cache.touch("gone")  # a key another thread dropped meanwhile is fine
        cache.put("c", 3)
        assert dict(cache) == {"a": 1, "c": 3}
    finally:
        del caches._ALL["test.lru"]


def test_a_value_built_before_a_clear_is_not_stored():
    """The value was built from what the clear made stale (a registry that use_registry replaced)."""
    cache = BoundedCache("test.generation", 4)
    try:
        generation = cache.generation
        cache.clear()
        assert cache.put("a", 1, generation) == 1 and "a" not in cache
        assert cache.put("a", 2, cache.generation) == 2 and cache["a"] == 2
    finally:
        del caches._ALL["test.generation"]


def test_every_cache_stays_within_its_bound(monkeypatch, clean_dispatch):
    """Many calls with new shapes, masks and parameters, every cache's limit cut to 3: each one
    fills up and never holds more; the results stay right."""
    named = caches.all_caches()
    assert {"api.plans", "api.tensor_plans", "dispatch.choices", "dispatch.registries", "blocks.structures",
            "launch.modules", "launch.names", "render.modules", "masks.specs"} <= set(named)
    for cache in named.values():
        monkeypatch.setattr(cache, "limit", 3)
        cache.clear()
    peak = dict.fromkeys(named, 0)
    for i in range(15):
        q, k, v = rand_qkv(1, 1 + i % 2, 1, 1 + i, 2 + 3 * i, 4 << (i % 3), torch.float32)
        ids = torch.arange(2 + 3 * i, device=DEVICE) // 3  # a new tensor: a plan of its own
        mask = [None, "causal", f"sliding_window(window={i + 1})", attngen.mask("document", doc_ids=ids),
                attngen.mask("causal") & attngen.mask("softcap", cap=3.0)][i % 5]
        topk = 2 if i % 4 == 3 else None
        out = attngen.attention(q, k, v, mask=mask, topk=topk)
        if i % 5 == 0:
            check_output(out, q, k, v, mask, topk=topk)
        for name, cache in named.items():
            assert len(cache) <= 3, f"{name} holds {len(cache)} entries"
            peak[name] = max(peak[name], len(cache))
    for name in ("api.plans", "api.tensor_plans", "dispatch.choices", "blocks.structures", "launch.modules",
                 "render.modules", "masks.specs"):
        assert peak[name] == 3, f"{name} never filled up: the test did not exercise its bound"


def test_a_plan_keeps_none_of_the_tensors_of_its_call():
    """A cached plan would otherwise hold its first call's q, k, v and output (device memory)."""
    refs = []
    for topk in (None, 3):
        api._plans.clear()
        q, k, v = rand_qkv(1, 2, 1, 9, 13, 16, torch.float32)
        out, lse = attngen.attention(q, k, v, mask="causal", topk=topk, return_lse=True)
        assert len(api._plans) == 1
        refs += [weakref.ref(t) for t in (q, k, v, out, lse)]
    del q, k, v, out, lse
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)
    q, k, v = rand_qkv(1, 2, 1, 9, 13, 16, torch.float32)  # the plan still runs
    out, _ = attngen.attention(q, k, v, mask="causal", topk=3, return_lse=True)
    assert len(api._plans) == 1
    check_output(out, q, k, v, "causal", topk=3)


def test_a_training_plan_keeps_none_of_the_tensors_of_its_call():
    """A TrainPlan is built from its first call's tensors (and its backward from the first dO):
    neither the inputs, the outputs, dO nor the gradients outlive the call."""
    api._plans.clear()
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 1, 9, 13, 16, torch.float32))
    out = attngen.attention(q, k, v, mask="causal", topk=3)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert len(api._plans) == 1 and len(next(iter(api._plans.values())).backwards) == 1
    refs = [weakref.ref(t) for t in (q, k, v, out, dout, *grads)]
    del q, k, v, out, dout, grads
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)


@pytest.mark.gpu
def test_device_memory_stays_bounded_under_new_shapes(monkeypatch):
    """Calls with ever new shapes, every cache cut to 4 entries: once the caches are full, the
    device memory allocated between calls stops growing (the plans keep no call's tensors)."""
    for cache in caches.all_caches().values():
        monkeypatch.setattr(cache, "limit", 4)
        cache.clear()
    allocated = []
    for i in range(60):
        q, k, v = rand_qkv(2, 4, 2, 500 + 37 * i, 700 + 41 * i, 64, torch.float16, device="cuda")
        attngen.attention(q, k, v, mask="causal", topk=8 if i % 2 else None)
        del q, k, v
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert max(allocated[30:]) <= max(allocated[10:30]) + (1 << 20), allocated
