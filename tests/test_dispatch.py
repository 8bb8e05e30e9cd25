"""The dispatcher: the registry first (exact entry, then the nearest bucket), then the fallback
table; ATTNGEN_REGISTRY and use_registry; explain; the fast path and its plan cache; a choice per
kernel family."""

import pytest
import torch

import attngen
from attngen import api, dispatch
from attngen.config import KernelConfig, arch_of, default_entry
from attngen.families import FAMILIES
from attngen.kernels.forward import attention_forward
from attngen.tuning import registry
from helpers import DEVICE, TOLERANCE, assert_close, check_output, rand_qkv, rel_error


def entry(seq_bucket, config, variant="none", kernel="fwd", head_dim=32, revision=None):
    """An entry of the kernel family's current revision unless `revision` says otherwise."""
    key = registry.EntryKey(variant=variant, kernel=kernel, dtype="fp16", head_dim=head_dim, seq_bucket=seq_bucket,
                            group=1)
    revision = FAMILIES[kernel].revision if revision is None else revision
    return registry.Entry(key=key, revision=revision, config=config.as_dict(), ms=1.0, tflops=1.0, sdpa_ms=None,
                          trials=3, triton="3.6.0", torch="2.13.0", date="2026-11-29")


def write(folder, *entries):
    gpu = dispatch.gpu_of(torch.device(DEVICE))
    return registry.write_entries(folder / f"{gpu}.yaml", list(entries), gpu, "test").path


def test_dispatcher_prefers_registry_then_nearest_bucket_then_defaults(tmp_path, clean_dispatch):
    config = KernelConfig(16, 16, 2, 1)
    write(tmp_path, entry(256, config))
    dispatch.use_registry(tmp_path)
    q = torch.randn(1, 2, 256, 32, device=DEVICE).half()
    exact = dispatch.choose(q, q, q)
    assert exact.config == config and "exact entry" in exact.source
    assert (exact.kernel, exact.variant) == ("fwd", "none")
    far = torch.randn(1, 2, 1500, 32, device=DEVICE).half()
    nearest = dispatch.choose(far, far, far)
    assert nearest.config == config and "nearest sequence bucket 256 (asked 2048)" in nearest.source
    other = dispatch.choose(q, q, q, "causal")
    fallback, row = default_entry("fwd", arch_of(q.device), 32)
    assert other.config == fallback and other.source == f"no registry entry for {dispatch.gpu_of(q.device)}; {row}"
    # one choice per bucket: sequence lengths inside a bucket share it
    a = torch.randn(1, 2, 200, 32, device=DEVICE).half()
    assert dispatch.choose(a, a, a) is dispatch.choose(q, q, q)
    out = attngen.attention(a, a, a)
    assert_close(out, attngen.reference.attention(a, a, a), torch.float16)


def test_entries_of_another_kernel_revision_are_ignored(tmp_path, clean_dispatch):
    """An entry's timings were of the kernels of its revision: after the kernels change, the
    dispatcher runs the fallback and explain says why, until a retune."""
    bwd = FAMILIES["bwd"]
    tuned = KernelConfig(16, 16, 2, 1)
    path = write(tmp_path, entry(256, tuned, revision=FAMILIES["fwd"].revision + 1),
                 entry(256, tuned, kernel="bwd", revision=bwd.revision - 1),
                 entry(256, tuned, variant="causal(align='top_left')"))
    dispatch.use_registry(tmp_path)
    q = torch.randn(1, 2, 256, 32, device=DEVICE).half()
    fallback, row = default_entry("fwd", arch_of(q.device), 32)
    choice = dispatch.choose(q, q, q)
    assert choice.config == fallback != tuned
    assert choice.source == (f"no registry entry for {dispatch.gpu_of(q.device)} of fwd kernel revision "
                             f"{FAMILIES['fwd'].revision}: 1 of another revision (revision "
                             f"{FAMILIES['fwd'].revision + 1} in {path}) ignored, as their timings were of other "
                             f"kernels (`attngen tune --kernel fwd` retunes); {row}")
    assert dispatch.choose(q, q, q, "causal").config == tuned  # the current revision's entry is used
    backward = dispatch.choose(q, q, q, kernel="bwd")
    assert backward.config != tuned and f"revision {bwd.revision - 1} in {path}) ignored" in backward.source


def test_environment_variable_selects_the_registry(tmp_path, monkeypatch, clean_dispatch):
    config = KernelConfig(32, 16, 2, 1)
    path = write(tmp_path, entry(64, config))
    monkeypatch.setenv(dispatch.REGISTRY_ENV, str(tmp_path))
    dispatch.use_registry(None)
    assert dispatch.registry_paths() == [tmp_path, registry.shipped_dir()]
    q = torch.randn(1, 2, 60, 32, device=DEVICE).half()
    assert dispatch.choose(q, q, q).config == config
    assert f"registry: exact entry in {path}" in attngen.explain(q, q, q)
    monkeypatch.delenv(dispatch.REGISTRY_ENV)
    monkeypatch.setenv("ATTNGEN_USER_REGISTRY", str(tmp_path / "user"))
    assert dispatch.registry_paths() == [tmp_path / "user", registry.shipped_dir()]
    dispatch.use_registry(path)  # a file works too, and wins over the environment
    monkeypatch.setenv(dispatch.REGISTRY_ENV, str(tmp_path / "elsewhere"))
    assert dispatch.registry_paths()[0] == path


def test_environment_variable_naming_nothing_is_the_error_use_registry_gives(tmp_path, monkeypatch, clean_dispatch):
    missing = tmp_path / "missing"
    monkeypatch.setenv(dispatch.REGISTRY_ENV, str(missing))
    dispatch.use_registry(None)  # the caches drop: the next call looks the registry up
    q = torch.randn(1, 2, 20, 16, device=DEVICE).half()
    with pytest.raises(ValueError, match=f"ATTNGEN_REGISTRY: '{missing}' does not exist"):
        attngen.attention(q, q, q)
    with pytest.raises(ValueError, match=f"use_registry: '{missing}' does not exist"):
        attngen.use_registry(missing)
    missing.mkdir()  # once it exists, an empty folder: the fallback
    assert "no registry entry" in attngen.explain(q, q, q)


def test_corrupt_registry_warns_and_falls_back(tmp_path, clean_dispatch):
    gpu = dispatch.gpu_of(torch.device(DEVICE))
    (tmp_path / f"{gpu}.yaml").write_text("version: 2\nentries: [unclosed\n")
    dispatch.use_registry(tmp_path)
    q = torch.randn(1, 2, 64, 32, device=DEVICE).half()
    with pytest.warns(registry.RegistryWarning, match=f"{gpu}.yaml"):
        choice = dispatch.choose(q, q, q)
    assert "no registry entry" in choice.source
    q, k, v = rand_qkv(1, 2, 2, 70, 50, 32, torch.float16)
    out = attngen.attention(q, k, v)  # the call still runs, on the default config
    assert_close(out, attngen.reference.attention(q, k, v), torch.float16)


def test_use_registry_needs_an_existing_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        attngen.use_registry(tmp_path / "missing")


def test_explain_says_which_config_and_why(clean_dispatch, tmp_path):
    dispatch.use_registry(tmp_path)  # an empty registry: the fallback row
    q, k, v = rand_qkv(1, 4, 2, 30, 300, 32, torch.float16)
    config, row = default_entry("fwd", arch_of(q.device), 32)
    fitted, note = FAMILIES["fwd"].fit(config, 30)  # a query of 30 rows fills a tile of 32 at most
    assert fitted.block_m == min(config.block_m, 32)
    assert attngen.explain(q, k, v, mask="causal") == (
        f"fwd kernel, variant causal(align='top_left'); torch.float16; config {fitted}; from no registry entry for "
        f"{dispatch.gpu_of(q.device)}; {row}" + (f"; {note}" if note else ""))
    assert f"; config {fitted}; " in attngen.explain(q, k, v, mask="causal", topk=40)
    assert "variant causal(align='top_left') & topk(64)" in attngen.explain(q, k, v, mask="causal", topk=40)


def test_a_short_query_fills_a_smaller_tile():
    q, k, v = rand_qkv(1, 2, 2, 5, 300, 32, torch.float16)
    choice = dispatch.choose(q, k, v)
    assert choice.config.block_m == 16 and "block_m cut to 16 for q_len 5" in choice.source


def test_a_choice_per_kernel_family(tmp_path, clean_dispatch):
    """Each family has its own fallback row and its own registry entries; only the forward cuts its
    query tile for a short query."""
    bwd_config = KernelConfig(16, 32, 4, 1)
    write(tmp_path, entry(64, bwd_config, kernel="bwd"))
    dispatch.use_registry(tmp_path)
    q, k, v = rand_qkv(1, 2, 2, 40, 64, 32, torch.float16)
    forward, backward = dispatch.choose(q, k, v), dispatch.choose(q, k, v, kernel="bwd")
    assert (forward.kernel, backward.kernel) == ("fwd", "bwd")
    assert "no registry entry" in forward.source
    assert forward.config == FAMILIES["fwd"].fit(default_entry("fwd", arch_of(q.device), 32)[0], 40)[0]
    assert backward.config == bwd_config and "exact entry" in backward.source
    # explain names the backward's config where the inputs require grad
    lines = attngen.explain(q.requires_grad_(), k, v).splitlines()
    assert lines[0].startswith("fwd kernel") and lines[1].startswith("bwd kernel")
    assert f"config {bwd_config}; from registry: exact entry" in lines[1]
    assert len(attngen.explain(q.detach(), k, v).splitlines()) == 1
    short = rand_qkv(1, 2, 2, 3, 64, 32, torch.float16)
    bwd_default = default_entry("bwd", arch_of(q.device), 32)[0]
    dispatch.use_registry(None)
    assert dispatch.choose(*short, kernel="bwd").config == bwd_default  # no cut: its tiles are its own
    assert dispatch.choose(*short).config.block_m == 16


def test_fast_path_matches_the_checked_path(clean_dispatch):
    """The dispatcher's prepared launches (one per call signature) give what a fully checked call gives."""
    q = torch.randn(1, 4, 70, 32, device=DEVICE).half()
    kv = torch.randn(1, 2, 90, 2, 32, device=DEVICE).half()
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]  # strided views
    for mask in (None, "causal", attngen.mask("sliding_window", window=9), attngen.mask("sliding_window", window=30)):
        for return_lse in (False, True):
            got = attngen.attention(q, k, v, mask=mask, return_lse=return_lse)
            again = attngen.attention(q, k, v, mask=mask, return_lse=return_lse)  # from the prepared plan
            config = dispatch.choose(q, k, v, mask).config
            want = attention_forward(q, k, v, mask, return_lse=True, config=config)
            for a in (got, again):
                out, lse = a if return_lse else (a, None)
                assert torch.equal(out, want[0])
                if return_lse:
                    assert torch.equal(lse, want[1])
    # new values of a mask's scalars get their own plan
    a = attngen.attention(q, k, v, mask=attngen.mask("sliding_window", window=9))
    b = attngen.attention(q, k, v, mask=attngen.mask("sliding_window", window=30))
    assert not torch.equal(a, b)


def test_plans_are_cached_per_call_signature(tmp_path, clean_dispatch):
    q, k, v = rand_qkv(1, 2, 1, 33, 47, 16, torch.float32)
    api._plans.clear()
    first = attngen.attention(q, k, v, mask="causal", topk=5)
    assert len(api._plans) == 1
    plan = next(iter(api._plans.values()))
    q2, k2, v2 = rand_qkv(1, 2, 1, 33, 47, 16, torch.float32)  # new tensors, the same signature
    second = attngen.attention(q2, k2, v2, mask="causal", topk=5)
    assert len(api._plans) == 1 and next(iter(api._plans.values())) is plan
    check_output(first, q, k, v, "causal", topk=5)
    check_output(second, q2, k2, v2, "causal", topk=5)
    attngen.attention(q, k, v, mask="causal", topk=5, return_lse=True)  # another signature
    attngen.attention(q, k, v.contiguous().transpose(2, 3).contiguous().transpose(2, 3), mask="causal", topk=5)
    assert len(api._plans) == 3
    ids = torch.zeros(1, 47, dtype=torch.int64, device=DEVICE)
    attngen.attention(q, k, v, mask=attngen.mask("document", doc_ids=ids))  # tensors: the checked path, no plan
    assert len(api._plans) == 3
    dispatch.use_registry(tmp_path)  # another registry may choose other configs: the plans go
    assert len(api._plans) == 0


def test_a_call_whose_config_needs_more_shared_memory_than_the_device_has_runs_fewer_stages(
        tmp_path, clean_dispatch, monkeypatch):
    """The dispatcher fits the chosen config to the device's shared memory at the call's element
    size (under the interpreter there is no limit: a limit is set here), and says so."""
    config = KernelConfig(32, 64, 4, 3)
    write(tmp_path, entry(256, config, kernel="bwd"))
    dispatch.use_registry(tmp_path)
    q = torch.randn(1, 2, 200, 32, device=DEVICE).half()
    shape = attngen.checks.check_qkv(q, q, q, kernel=True)
    limit = config.shared_memory(32, 2, "bwd") - 1
    monkeypatch.setitem(dispatch._smem_limits, q.device, limit)
    choice = dispatch.choose_config(FAMILIES["bwd"], q, shape, None)
    assert choice.config == KernelConfig(32, 64, 4, 2) and choice.config.shared_memory(32, 2, "bwd") <= limit
    assert choice.source.endswith(f"; num_stages 2 to fit the device's {limit} bytes of shared memory")


def test_dropout_calls_take_backward_tiles_that_do_not_spill(tmp_path, clean_dispatch):
    """Dropout's random bits need registers in the dK/dV programs: a backward config on 4 warps runs on
    8 with 128-key blocks and 3 stages under dropout (it spills on sm_90 otherwise), and says so;
    the forward's config and an 8-warp backward stay as they are; a top-k call's backward config
    adapts too (on Hopper it runs at it: kernels.backward.topk_config). The call runs with the
    adapted configs and stays right."""
    fwd, bwd = KernelConfig(128, 16, 4, 1), KernelConfig(64, 64, 4, 1)
    write(tmp_path, entry(256, fwd), entry(256, bwd, kernel="bwd"))
    dispatch.use_registry(tmp_path)
    q = torch.randn(1, 2, 200, 32, device=DEVICE).half()
    shape = attngen.checks.check_qkv(q, q, q, kernel=True)
    assert dispatch.choose_config(FAMILIES["fwd"], q, shape, None, dropout=True).config == fwd
    assert dispatch.choose_config(FAMILIES["bwd"], q, shape, None).config == bwd
    backward = dispatch.choose_config(FAMILIES["bwd"], q, shape, None, dropout=True)
    assert backward.config == KernelConfig(64, 128, 8, 3)
    assert backward.source.endswith("; 8 warps, 128-key blocks under dropout")
    topk = dispatch.choose_config(FAMILIES["bwd"], q, shape, None, topk=8).config  # no entry: the fallback
    wide = dispatch.choose_config(FAMILIES["bwd"], q, shape, None, topk=8, dropout=True).config
    assert wide == FAMILIES["bwd"].fit_wide(topk, "dropout")[0] != topk
    assert FAMILIES["bwd"].fit_wide(KernelConfig(64, 128, 8, 2), "dropout") == (KernelConfig(64, 128, 8, 2), "")
    atomic = dispatch.choose_config(FAMILIES["bwd"], q, shape, None, atomic_dq=True)
    assert atomic.config == KernelConfig(64, 128, 8, 3)
    assert atomic.source.endswith("; 8 warps, 128-key blocks under atomic dQ")
    # a training call at those configs: output and gradients against float64 autograd with its mask
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 200, 200, 32, torch.float16))
    state = torch.get_rng_state()
    out = attngen.attention(q, k, v, dropout_p=0.2)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.set_rng_state(state)
    keep = attngen.dropout_mask(q, k, 0.2)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attngen.reference.attention(q64, k64, v64, dropout_p=0.2, dropout_mask=keep)
    assert_close(out, ref, torch.float16)
    for got, want in zip(grads, torch.autograd.grad(ref, (q64, k64, v64), dout.double())):
        assert rel_error(got, want) <= 2 * TOLERANCE[torch.float16]
