"""The backward kernel family: dQ, dK, dV (and the gradient of the LSE) of every mask, score
modifier, GQA, block-sparse layout, top-k and dropout, against float64 autograd through
attngen.reference, on fresh random inputs and upstream gradients."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import attngen
from attngen.config import KernelConfig
import attngen.kernels.backward as backward_module
from attngen.kernels.backward import backward, tiles
from attngen.kernels.forward import forward
from attngen.checks import check_qkv
from helpers import DEVICE, TOLERANCE, rand_qkv, rel_error, rows_to_check
from masks_zoo import ZOO

# the gradients sum over a row or a column of a tile more than the output does: a little more room
GRAD_TOLERANCE = {dtype: 2 * tol for dtype, tol in TOLERANCE.items()}


def nondeterministic(q, k, v, **kwargs):
    """attngen.attention with deterministic=False: dQ added atomically by the dK/dV programs."""
    return attngen.attention(q, k, v, deterministic=False, **kwargs)


def grads(q, k, v, dout, mask=None, *, dlse=None, fn=attngen.attention, **kwargs):
    """(out, dq, dk, dv) of fn, through autograd (of out, and of the LSE where dlse is given)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        if dlse is None:
            out = fn(q, k, v, mask=mask, **kwargs)
            return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
        out, lse = fn(q, k, v, mask=mask, return_lse=True, **kwargs)
        if fn is attngen.reference.attention:  # an empty row's LSE is -inf there: no gradient flows through it
            lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        return (out.detach(), *torch.autograd.grad((out, lse), (q, k, v), (dout, dlse)))


def check_grads(q, k, v, mask=None, *, dtype=None, dlse=False, fn=attngen.attention, **kwargs):
    """attngen's output and gradients against float64 autograd through the reference. A top-k
    call's rows with near ties (rows_to_check) get no upstream gradient and their output is not
    compared: fp32 may select either of their tied scores."""
    rows = rows_to_check(q, k, mask, kwargs.get("topk"), kwargs.get("scale"))
    dout = torch.randn(q.shape, device=q.device).to(q.dtype) * rows[..., None]
    dl = torch.randn(q.shape[:3], device=q.device) * rows if dlse else None
    got = grads(q, k, v, dout, mask, dlse=dl, fn=fn, **kwargs)
    ref = grads(*(t.to(torch.float64) for t in (q, k, v, dout)), mask, dlse=None if dl is None else dl.double(),
                fn=attngen.reference.attention, **kwargs)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert x.shape == r.shape and x.dtype == q.dtype, name
        assert not torch.isnan(x).any(), f"NaN in {name}"
        err = rel_error(x[rows], r[rows]) if name == "out" else rel_error(x, r)
        assert err <= GRAD_TOLERANCE[q.dtype], f"{name}: relative error {err:.3e}"
    return got


@pytest.mark.parametrize("name", list(ZOO))
def test_every_mask(name):
    """Ragged lengths (not block multiples), Sq != Sk, GQA for half the masks."""
    heads, kv_heads = (4, 2) if len(name) % 2 else (2, 2)
    q, k, v = rand_qkv(2, heads, kv_heads, 100, 77, 24, torch.float32)
    check_grads(q, k, v, ZOO[name](2, heads, 100, 77, DEVICE))


@pytest.mark.parametrize("q_len,kv_len,head_dim", [(1, 1, 16), (7, 130, 8), (257, 100, 40), (30, 19, 1), (40, 70, 256)])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_lengths_and_head_dims(q_len, kv_len, head_dim, mask):
    q, k, v = rand_qkv(1, 3, 1, q_len, kv_len, head_dim, torch.float32)
    check_grads(q, k, v, mask)


def test_fp16_and_the_lse_gradient():
    q, k, v = rand_qkv(1, 2, 2, 70, 90, 32, torch.float16)
    check_grads(q, k, v, "causal", dlse=True)
    q, k, v = rand_qkv(1, 2, 1, 50, 50, 16, torch.float32)
    check_grads(q, k, v, attngen.mask("sliding_window", window=9), dlse=True)


def test_a_user_score_template_is_differentiated_from_its_expression(tmp_path):
    """The chain rule through a score modifier nobody wrote a derivative for."""
    (tmp_path / "wobble.yaml").write_text('doc: a test modifier\nkind: score\nparams:\n  a: {type: float}\n'
                                          'expr: "a * score + sigmoid(score) * score - minimum(score, 0.5)"\n')
    attngen.register_template_dir(tmp_path)
    q, k, v = rand_qkv(1, 2, 2, 60, 45, 16, torch.float32)
    check_grads(q, k, v, attngen.mask("causal") & attngen.mask("wobble", a=0.7) & attngen.mask("softcap", cap=2.5))


def test_fully_masked_rows_get_zero_gradients():
    q, k, v = rand_qkv(1, 2, 2, 40, 25, 16, torch.float32)
    mask = attngen.mask("causal", align="bottom_right")  # the first 15 queries see no key
    ref = attngen.reference.attention(q, k, v, mask=mask, return_lse=True)[1]
    assert torch.isinf(ref).any() and not torch.isinf(ref).all()  # some rows see nothing
    out, dq, dk, dv = check_grads(q, k, v, mask)
    assert (dq[torch.isinf(ref)] == 0).all()


def test_strided_inputs_and_gradients():
    """(B, S, H, D) tensors read through .transpose(1, 2), a transposed upstream gradient."""
    base = [torch.randn(2, 50, 4, 16, device=DEVICE) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    assert not q.is_contiguous()
    dout = torch.randn(2, 50, 4, 16, device=DEVICE).transpose(1, 2)
    got = grads(q, k, v, dout, "causal")
    ref = grads(*(t.double() for t in (q, k, v, dout)), "causal", fn=attngen.reference.attention)
    for x, r in zip(got, ref):
        assert rel_error(x, r) <= GRAD_TOLERANCE[torch.float32]


@pytest.mark.parametrize("mask", [None, "causal"])
def test_topk_gradients_flow_through_the_kept_scores_only(mask):
    q, k, v = rand_qkv(1, 2, 2, 64, 100, 16, torch.float32)
    check_grads(q, k, v, mask, topk=7)


@pytest.mark.parametrize("mask,deterministic", [(None, True), ("causal", False)])
def test_topk_at_the_backwards_own_tiles(mask, deterministic, monkeypatch):
    """The path a Hopper GPU takes (backward.topk_config's any_tile rule): a top-k call's backward at
    its own config, tiles unlike the forward's and the thresholds', the dK/dV programs computing
    their scores keys first. Integer-valued q and k make every score exact in any order and tile,
    as wgmma makes them on Hopper (tests/kernels/test_gpu.py), so the backward keeps the keys the
    forward kept; GQA 2:1, with ties at the topk-th score."""
    config = KernelConfig(32, 16, 4, 1)  # dK/dV: 16-key blocks, 32-query tiles; dQ: 16-query blocks
    chosen = []

    def own_config(bwd, fwd, *device_and_sizes):
        chosen.append(fwd)
        return config, False

    monkeypatch.setattr(backward_module, "topk_config", own_config)
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randint(-2, 3, (1, h, n, 16), generator=g).float().to(DEVICE) for h, n in ((4, 70), (2, 90)))
    v = torch.randn(1, 2, 90, 16, device=DEVICE)
    check_grads(q, k, v, mask, topk=7, fn=attngen.attention if deterministic else nondeterministic)
    assert chosen and chosen[0].block_n != config.block_n


def test_topk_config_keeps_32_query_columns_and_fits_shared_memory(monkeypatch):
    """backward.topk_config on a GPU like an H100 (232448 bytes of shared memory a program): on
    Hopper (any_tile) the backward's own config, 16-query tiles widened to the 32 the rule was
    checked for; elsewhere the threshold kernels' tiles, stages taken off until the shared memory
    (the transposed scores included) fits, and a clear error where even one stage does not."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(backward_module, "shared_memory_limit", lambda device: 232448)
    monkeypatch.setattr(backward_module, "any_tile", lambda rows, warps, device: rows in (64, 128) and warps in (4, 8))
    fwd = KernelConfig(64, 64, 4, 3, use_tma=True)
    topk_config = backward_module.topk_config
    assert topk_config(KernelConfig(16, 64, 4, 2), fwd, cpu, 256, 2) == (KernelConfig(32, 64, 4, 2), False)
    assert topk_config(KernelConfig(64, 128, 8, 3), fwd, cpu, 128, 2) == (KernelConfig(64, 128, 8, 3), False)
    monkeypatch.setattr(backward_module, "any_tile", lambda rows, warps, device: False)
    assert topk_config(KernelConfig(16, 64, 4, 2), fwd, cpu, 128, 2) == (fwd, True)
    assert topk_config(KernelConfig(16, 64, 4, 2), fwd, cpu, 256, 2) == (KernelConfig(64, 64, 4, 2, True), True)
    with pytest.raises(ValueError, match="head_dim=256 with 4-byte inputs needs about 278528 bytes"):
        topk_config(KernelConfig(16, 64, 4, 2), fwd, cpu, 256, 4)


def test_explain_names_the_config_a_topk_backward_runs_at():
    """Off Hopper a top-k call's backward runs at the threshold kernels' config (under the
    interpreter the forward's, which they share), whatever the dispatcher chose: explain says so."""
    q, k, v = rand_qkv(1, 2, 2, 40, 50, 16, torch.float32)
    q.requires_grad_()
    text = attngen.explain(q, k, v, mask="causal", topk=5)
    fwd = attngen.dispatch.choose(q, k, v, "causal", topk=5).config
    config, fwd_orient = backward_module.topk_config(attngen.dispatch.choose(q, k, v, "causal", topk=5, kernel="bwd")
                                                     .config, fwd, q.device, 16, 4)
    assert fwd_orient or DEVICE == "cuda"
    want = f"a top-k call's backward runs at the threshold kernels' config {config}"
    assert (want in text) == fwd_orient, text
    assert "threshold kernels" not in attngen.explain(q, k, v, mask="causal")


def test_block_sparse_backward_visits_the_layout_only():
    """A key block the layout hides holds NaN: a kernel that loaded it would spread it (tiles no
    larger than the layout's blocks, as the forward's test does)."""
    layout = attngen.layouts.random(96, 96, (32, 32), density=0.4, seed=3, heads=2, device=DEVICE)
    layout[..., 1] = False  # key block 1 is hidden from every query block
    q, k, v = rand_qkv(1, 2, 2, 96, 96, 16, torch.float32)
    k[:, :, 32:64] = float("nan")
    v[:, :, 32:64] = float("nan")
    mask = attngen.block_sparse(layout, (32, 32))
    shape = check_qkv(q, k, v, kernel=True)
    config = KernelConfig(32, 32, 4, 1)
    out, lse, _ = forward(q, k, v, mask, shape, 0.25, 0, True, config)
    dout = torch.randn_like(q)
    dq, dk, dv = backward(q, k, v, out, lse, None, dout, None, mask, shape, 0.25, config)
    assert not torch.isnan(dq).any() and not torch.isnan(dk[:, :, :32]).any() and not torch.isnan(dk[:, :, 64:]).any()
    assert (dk[:, :, 32:64] == 0).all() and (dv[:, :, 32:64] == 0).all()  # a hidden key gets no gradient


@pytest.mark.parametrize("name", ["none", "causal", "sliding_window", "document"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_tma_loads_give_the_same_gradients(name, deterministic):
    """The backward's streamed tiles through tensor descriptors: the same bits as through pointers
    (ragged lengths, Sq != Sk, GQA, a head dim of 24 inside 32-column tiles), and right."""
    q, k, v = rand_qkv(2, 4, 2, 100, 77, 24, torch.float32)
    mask = attngen.masks.as_mask(ZOO[name](2, 4, 100, 77, DEVICE))
    shape = check_qkv(q, k, v, kernel=True)
    config = KernelConfig(32, 32, 4, 1)
    out, lse, _ = forward(q, k, v, mask, shape, 24 ** -0.5, 0, True, config)
    dout = torch.randn_like(q)
    plain = backward(q, k, v, out, lse, None, dout, None, mask, shape, 24 ** -0.5, config, deterministic=deterministic)
    tma = backward(q, k, v, out, lse, None, dout, None, mask, shape, 24 ** -0.5,
                   KernelConfig(32, 32, 4, 1, use_tma=True), deterministic=deterministic)
    for a, b in zip(plain, tma):
        assert torch.equal(a, b) if deterministic else rel_error(a, b) <= 1e-6
    check_grads(q, k, v, mask)


def test_tiles_of_the_two_kernels():
    assert tiles(KernelConfig(32, 128, 4, 3)) == ((32, 128), (128, 32))


@pytest.mark.parametrize("name", ["none", "causal_bottom_right", "sliding_window", "document", "alibi",
                                  "block_sparse|sliding_window&softcap", "keep&causal&bias"])
def test_atomic_dq_matches_the_reference(name):
    """deterministic=False: the same gradients, to rounding, with dQ added by the dK/dV programs
    (ragged lengths, Sq != Sk, GQA for half the masks, the LSE's gradient)."""
    heads, kv_heads = (4, 2) if len(name) % 2 else (2, 2)
    q, k, v = rand_qkv(2, heads, kv_heads, 100, 77, 24, torch.float32)
    check_grads(q, k, v, ZOO[name](2, heads, 100, 77, DEVICE), dlse=True, fn=nondeterministic)


def test_atomic_dq_with_topk_dropout_and_fully_masked_rows():
    q, k, v = rand_qkv(1, 2, 2, 64, 100, 16, torch.float32)
    check_grads(q, k, v, "causal", topk=7, fn=nondeterministic)
    q, k, v = rand_qkv(1, 2, 1, 70, 50, 16, torch.float32)
    dout = torch.randn_like(q)
    torch.manual_seed(11)
    got = grads(q, k, v, dout, "causal", fn=nondeterministic, dropout_p=0.3)
    torch.manual_seed(11)
    want = grads(q, k, v, dout, "causal", dropout_p=0.3)
    for x, r in zip(got, want):
        assert rel_error(x, r) <= 1e-5
    # rows that see no key (keys 0..9 hidden from query rows 0..9 by a bottom-right causal mask)
    q, k, v = rand_qkv(1, 2, 2, 40, 30, 16, torch.float32)
    dq = grads(q, k, v, torch.randn_like(q), attngen.mask("causal", align="bottom_right"), fn=nondeterministic)[1]
    assert not torch.isnan(dq).any() and (dq[:, :, :10] == 0).all()


def test_torchs_deterministic_mode_runs_the_deterministic_kernels(monkeypatch):
    """deterministic=False under torch.use_deterministic_algorithms(True): the deterministic
    kernels run (each backward's path recorded as it runs) and give their very bits. Bits alone
    cannot tell the paths apart: with one key block the atomic adds round as the dQ programs do."""
    paths = []
    run = backward_module.BackwardPlan.run
    monkeypatch.setattr(backward_module.BackwardPlan, "run",
                        lambda self, *args: paths.append(self.deterministic) or run(self, *args))
    q, k, v = rand_qkv(1, 2, 2, 40, 300, 16, torch.float32)
    dout = torch.randn_like(q)
    plain = grads(q, k, v, dout, "causal")
    loose = grads(q, k, v, dout, "causal", fn=nondeterministic)
    assert paths == [True, False]
    for x, r in zip(loose, plain):
        assert rel_error(x, r) <= 1e-5
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        strict = grads(q, k, v, dout, "causal", fn=nondeterministic)
    finally:
        torch.use_deterministic_algorithms(before)
    assert paths == [True, False, True]
    assert all(torch.equal(a, b) for a, b in zip(strict, plain))


def test_deterministic_must_be_a_bool():
    q, k, v = rand_qkv(1, 1, 1, 8, 8, 16, torch.float32)
    with pytest.raises(TypeError, match="deterministic"):
        attngen.attention(q, k, v, deterministic="no")


def test_gradients_are_deterministic():
    q, k, v = rand_qkv(2, 4, 2, 90, 90, 16, torch.float32)
    dout = torch.randn_like(q)
    first = grads(q, k, v, dout, "causal")
    second = grads(q, k, v, dout, "causal")
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("mask,topk", [(None, None), ("causal", 7), ("doc", None)])
def test_a_repeated_training_call_reuses_its_prepared_launches(mask, topk, monkeypatch):
    """The second call with gradients of a signature builds no launch (api's TrainPlan: the forward's
    Plan and the backward's BackwardPlan), and its gradients are bit for bit those of the unprepared
    `backward` on the same forward results, for a contiguous, a transposed and an expanded dO, with
    and without the LSE's gradient."""
    from attngen.kernels import launch as launch_module
    if mask == "doc":
        mask = attngen.mask("document", doc_ids=(torch.arange(29, device=DEVICE) // 10).expand(2, 29).contiguous())
    q, k, v = rand_qkv(2, 4, 2, 21, 29, 16, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    douts = [torch.randn(q.shape, device=DEVICE), torch.randn(2, 4, 16, 21, device=DEVICE).transpose(-1, -2),
             torch.randn(1, 1, 1, 16, device=DEVICE).expand(q.shape)]
    built = []
    real_init = launch_module.Launch.__init__

    def counting_init(self, *args, **kwargs):
        built.append(args[0])
        real_init(self, *args, **kwargs)

    for i, dout in enumerate(douts):
        dlse = None if i % 2 == 0 else torch.randn(q.shape[:3], device=DEVICE)  # with the LSE's gradient
        for _ in range(2):  # the first call of a dO layout builds its backward, the second none
            monkeypatch.setattr(launch_module.Launch, "__init__", counting_init)
            built.clear()
            out, lse = attngen.attention(q, k, v, mask=mask, topk=topk, return_lse=True)
            got = torch.autograd.grad((out, lse) if dlse is not None else out, (q, k, v),
                                      (dout, dlse) if dlse is not None else dout)
            monkeypatch.setattr(launch_module.Launch, "__init__", real_init)
        assert built == [], built  # the second call: no launch built, forward or backward
        shape = check_qkv(q, k, v, kernel=True)
        config = attngen.dispatch.choose_config(attngen.families.BACKWARD, q, shape, attngen.masks.as_mask(mask),
                                                topk or 0).config
        fwd_config = attngen.dispatch.choose_config(attngen.families.FORWARD, q, shape,
                                                    attngen.masks.as_mask(mask), topk or 0).config
        _, _, thr = forward(q.detach(), k.detach(), v.detach(), attngen.masks.as_mask(mask), shape, 16 ** -0.5,
                            topk or 0, True, fwd_config)
        want = backward(q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), thr, dout, dlse,
                        attngen.masks.as_mask(mask), shape, 16 ** -0.5, config, fwd_config)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_gradcheck():
    """torch.autograd.gradcheck: every entry of the Jacobian of the output and of the LSE against
    central differences, and the backward run twice bit for bit (nondet_tol=0). In float32 on a
    tiny shape: the kernels accumulate in fp32 whatever the input (issue 23), so they do not take
    float64, and the step and tolerances are sized for fp32 (eps 1e-3: rounding ~1e-4, truncation
    ~1e-6). GQA 2:1, a causal mask with a score modifier, a row that sees no key."""
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 1, 6, 5, 4, torch.float32))
    mask = attngen.mask("causal", align="bottom_right") & attngen.mask("softcap", cap=2.0)

    def attention(q, k, v):
        out, lse = attngen.attention(q, k, v, mask=mask, return_lse=True)
        return out, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # the empty row's -inf

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Input #. requires gradient and is not a double")
        assert torch.autograd.gradcheck(attention, (q, k, v), eps=1e-3, atol=2e-3, rtol=2e-2, nondet_tol=0.0)


def test_finite_differences():
    """The gradient's inner product with a random direction against central differences of the
    output's inner product with a random upstream gradient (fp32, tiny shape)."""
    q, k, v = rand_qkv(1, 1, 1, 20, 20, 8, torch.float32)
    dout = torch.randn_like(q)
    mask = attngen.mask("causal") & attngen.mask("softcap", cap=1.5)
    _, dq, dk, dv = grads(q, k, v, dout, mask)
    eps = 1e-2
    for i, g in enumerate((dq, dk, dv)):
        direction = torch.randn_like(g)
        plus, minus = [list((q, k, v)) for _ in range(2)]
        plus[i], minus[i] = plus[i] + eps * direction, minus[i] - eps * direction
        with torch.no_grad():
            difference = attngen.attention(*plus, mask=mask) - attngen.attention(*minus, mask=mask)
            numeric = (difference * dout).sum() / (2 * eps)
        analytic = (g * direction).sum()
        assert abs(float(numeric - analytic)) <= 2e-3 * max(1.0, abs(float(analytic))), (i, numeric, analytic)


# ---------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [None, "causal"])
def test_dropout_matches_the_reference_with_the_mask_the_call_used(mask):
    q, k, v = rand_qkv(1, 2, 1, 70, 50, 16, torch.float32)
    p = 0.3
    torch.manual_seed(11)
    got = grads(q, k, v, torch.ones_like(q), mask, dropout_p=p)
    torch.manual_seed(11)
    keep = attngen.dropout_mask(q, k, p)
    ref = grads(*(t.double() for t in (q, k, v, torch.ones_like(q))), mask, fn=attngen.reference.attention,
                dropout_p=p, dropout_mask=keep)
    for x, r in zip(got, ref):
        assert rel_error(x, r) <= GRAD_TOLERANCE[torch.float32]


def test_dropout_keep_rate_and_seeds():
    q = torch.randn(2, 4, 64, 16, device=DEVICE)
    torch.manual_seed(5)
    first = attngen.dropout_mask(q, q, 0.2)
    second = attngen.dropout_mask(q, q, 0.2)  # the generator moved on: another mask
    torch.manual_seed(5)
    again = attngen.dropout_mask(q, q, 0.2)
    assert torch.equal(first, again) and not torch.equal(first, second)
    n = first.numel()
    rate = float(first.float().mean())
    assert abs(rate - 0.8) < 5 * (0.8 * 0.2 / n) ** 0.5, rate  # within 5 standard deviations of a fair draw
    assert attngen.dropout_mask(q, q, 0.0).all()


def test_dropout_bits_are_uncorrelated_across_keys_rows_heads_and_seeds():
    """At p = 0.5 a fair, independent mask agrees with itself shifted by one key, one row (query),
    one head or drawn from another seed half of the time, and so do keys 8 apart; the XOR of a
    rectangle's four corners is 1 half of the time: each within 5 standard deviations."""
    q = torch.randn(2, 4, 64, 16, device=DEVICE)
    k = torch.randn(2, 4, 72, 16, device=DEVICE)
    torch.manual_seed(11)
    mask = attngen.dropout_mask(q, k, 0.5)
    other = attngen.dropout_mask(q, k, 0.5)  # the next seed
    pairs = {"next key": (mask[..., 1:], mask[..., :-1]), "8 keys on": (mask[..., 8:], mask[..., :-8]),
             "next row": (mask[:, :, 1:], mask[:, :, :-1]), "next head": (mask[:, 1:], mask[:, :-1]),
             "next batch": (mask[1:], mask[:-1]), "another seed": (mask, other)}
    # a generator built from a row's number and a key's number can fail where neither alone does:
    # the four corners of a rectangle (rows r, r + e; keys c, c + d) agree in parity half of the time
    for e, d in ((1, 1), (3, 5), (1, 8)):
        parity = mask[:, :, :-e, :-d] ^ mask[:, :, :-e, d:] ^ mask[:, :, e:, :-d] ^ mask[:, :, e:, d:]
        pairs[f"rectangle {e} x {d}"] = (parity, torch.zeros_like(parity))
    for name, (a, b) in pairs.items():
        agree = float((a == b).float().mean())
        assert abs(agree - 0.5) < 5 * (0.25 / a.numel()) ** 0.5, (name, agree)


def test_dropout_bits_at_p_one_tenth_are_uncorrelated():
    """At p = 0.1, over 2 heads of 768 x 768 weights: the correlation of the mask with itself shifted
    by keys, rows or a head, and of the parities of rectangles' two sides, is within 5 standard
    errors of 0 (a key position that only multiplies its index by a constant fails by 20 or more)."""
    q = torch.randn(1, 2, 768, 16, device=DEVICE)
    torch.manual_seed(13)
    mask = attngen.dropout_mask(q, q, 0.1)[0]

    def z(a, b):  # the correlation of two boolean tensors, in standard errors of independent ones
        a, b = a.double().flatten(), b.double().flatten()
        a, b = a - a.mean(), b - b.mean()
        return float((a * b).mean() / (a.std() * b.std())) * a.numel() ** 0.5

    pairs = {f"{d} keys on": (mask[..., d:], mask[..., :-d]) for d in (1, 2, 8, 64, 256)}
    pairs |= {f"{e} rows on": (mask[:, e:], mask[:, :-e]) for e in (1, 2, 8, 64)}
    pairs["next head"] = (mask[1], mask[0])
    for e, d in ((1, 1), (1, 8), (8, 1), (3, 5)):
        pairs[f"rectangle {e} x {d}"] = (mask[:, :-e, :-d] ^ mask[:, :-e, d:], mask[:, e:, :-d] ^ mask[:, e:, d:])
    scores = {name: z(a, b) for name, (a, b) in pairs.items()}
    assert all(abs(v) < 5 for v in scores.values()), scores


def test_dropout_zero_is_the_plain_kernel():
    q, k, v = rand_qkv(1, 2, 2, 40, 40, 16, torch.float32)
    assert torch.equal(attngen.attention(q, k, v, dropout_p=0.0), attngen.attention(q, k, v))


# ---------------------------------------------------------------------------------------
# training, and what cannot be differentiated
# ---------------------------------------------------------------------------------------
class TinyModel(torch.nn.Module):
    """Two causal self-attention layers with projections, for a few steps of training."""

    def __init__(self, attention, dim=16, heads=2):
        super().__init__()
        self.attention, self.heads = attention, heads
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(2))
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        for layer in self.qkv:
            q, k, v = layer(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            x = x + self.attention(q, k, v, mask="causal").transpose(1, 2).reshape(b, s, d)
        return self.out(x)


def test_a_tiny_model_trains_like_the_reference():
    def reference(q, k, v, mask):
        return attngen.reference.attention(q, k, v, mask=mask).to(q.dtype)

    torch.manual_seed(0)
    models = [TinyModel(attngen.attention).to(DEVICE), TinyModel(reference).to(DEVICE)]
    models[1].load_state_dict(models[0].state_dict())
    data = torch.randn(2, 33, 16, device=DEVICE)
    target = torch.randn(2, 33, 16, device=DEVICE)
    losses = [[], []]
    for model, record in zip(models, losses):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(4):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(data), target)
            loss.backward()
            optimizer.step()
            record.append(float(loss.detach()))
    assert losses[0][-1] < losses[0][0]
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-4 * abs(b), losses


def test_mask_tensors_that_require_grad_are_refused():
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 16, 16, 16, torch.float32))
    slopes = torch.tensor([0.5, 0.25], device=DEVICE, requires_grad=True)
    with pytest.raises(TypeError, match="'alibi' parameter 'slopes' requires grad"):
        attngen.attention(q, k, v, mask=attngen.mask("alibi", slopes=slopes))
    with torch.no_grad():  # without gradients it runs
        attngen.attention(q, k, v, mask=attngen.mask("alibi", slopes=slopes))


def test_a_score_modifier_without_a_derivative_is_a_clear_error(tmp_path):
    (tmp_path / "stairs.yaml").write_text('doc: integer steps\nkind: score\nexpr: "score // 1.0 + score % 2.0"\n')
    attngen.register_template_dir(tmp_path)
    q, k, v = (t.requires_grad_() for t in rand_qkv(1, 2, 2, 16, 16, 16, torch.float32))
    with pytest.raises(ValueError, match="cannot differentiate this mask's score modifiers.*stairs|score % 2.0"):
        attngen.attention(q, k, v, mask=attngen.mask("stairs"))


@pytest.mark.parametrize("dropout_p,error", [(1.0, ValueError), (-0.1, ValueError), ("0.1", TypeError)])
def test_bad_dropout(dropout_p, error):
    q, k, v = rand_qkv(1, 2, 2, 16, 16, 16, torch.float32)
    with pytest.raises(error, match="dropout_p"):
        attngen.attention(q, k, v, dropout_p=dropout_p)


@pytest.mark.parametrize("config,mask,flags", [
    (["64", "128", "8", "3"], "causal & softcap(cap=30.0)", ["1"]),
    (["64", "64", "4", "2"], "sliding_window(window=64)", ["0", "1", "1"]),
    (["64", "64", "4", "3"], "causal", ["1", "0", "0", "1"]),
    (["64", "128", "8", "3"], "none", ["0", "1", "0", "2"]),
], ids=["dropout", "tma and atomic dQ", "top-k and dropout", "top-k at its own tiles with tma"])
def test_backward_kernels_compile_for_hopper(tmp_path, config, mask, flags):
    """The backward compiled for sm_90 in a child process as a CUDA launch would build it: with
    dropout, a mask and a score modifier; with tensor-descriptor loads and deterministic=False's
    atomic dQ (no dQ programs); as a top-k call's at the threshold kernels' tiles (the scores
    computed in the forward's orientation), with dropout; as a top-k call's at its own tiles, with
    tensor-descriptor loads."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-m", "attngen.tools.cross_compile", "backward", *config, mask, *flags],
                            capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [line.split()[1] for line in result.stdout.splitlines()] == ["attention_bwd_preprocess", "attention_bwd"]


# ---------------------------------------------------------------------------------------
# on the GPU
# ---------------------------------------------------------------------------------------
def assert_batch0_close(got, ref, dtype, rows=None):
    """(out, dq, dk, dv) of a call against float32 autograd of its batch 0 (`ref`), within
    GRAD_TOLERANCE; `rows`: the output rows to compare (rows_to_check), default all."""
    for label, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        x = x[:1]
        err = rel_error(x[rows], r[rows]) if label == "out" and rows is not None else rel_error(x, r)
        assert err <= GRAD_TOLERANCE[dtype], f"{label}: relative error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["none", "causal", "sliding_window", "document", "block_sparse&causal", "alibi",
                                  "chunked&causal&softcap"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_realistic_shape_against_fp32(name, dtype):
    """B=4 H=16 S=4096 D=128 (GQA 4:1 for half the masks) against float32 autograd through the
    reference on batch 0 (the float64 reference of the whole call does not fit)."""
    batch, heads, seq, head_dim = 4, 16, 4096, 128
    kv_heads = 4 if len(name) % 2 else heads
    q, k, v = rand_qkv(batch, heads, kv_heads, seq, seq, head_dim, dtype, device="cuda")
    mask = ZOO[name](batch, heads, seq, seq, "cuda")
    dout = torch.randn_like(q)
    got = grads(q, k, v, dout, mask)
    one = ZOO[name](1, heads, seq, seq, "cuda") if name in ("document", "block_sparse&causal") else mask
    if name in ("document", "block_sparse&causal"):
        got = grads(q[:1], k[:1], v[:1], dout[:1], one)
    ref = grads(*(t[:1].float() for t in (q, k, v, dout)), one, fn=attngen.reference.attention)
    assert_batch0_close(got, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [64, 256])
def test_realistic_topk_against_fp32(topk):
    """Top-k at B=4 H=16 (GQA 4:1) S=4096 D=128 in bf16 against float32 autograd through the
    reference on batch 0, whose rows with near ties (rows_to_check) get no upstream gradient."""
    q, k, v = rand_qkv(4, 16, 4, 4096, 4096, 128, torch.bfloat16, device="cuda")
    rows = rows_to_check(q[:1], k[:1], None, topk)
    dout = torch.randn_like(q)
    dout[:1] *= rows[..., None]
    got = grads(q, k, v, dout, topk=topk)
    ref = grads(*(t[:1].float() for t in (q, k, v, dout)), fn=attngen.reference.attention, topk=topk)
    assert_batch0_close(got, ref, torch.bfloat16, rows)


@pytest.mark.gpu
def test_realistic_dropout_against_fp32():
    """Dropout p=0.1 under a causal mask at B=4 H=16 S=4096 D=128 in bf16 against float32 autograd
    through the reference on batch 0, with the dropout mask the call used."""
    q, k, v = rand_qkv(4, 16, 16, 4096, 4096, 128, torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    torch.manual_seed(21)
    got = grads(q, k, v, dout, "causal", dropout_p=0.1)
    torch.manual_seed(21)
    keep = attngen.dropout_mask(q, k, 0.1)[:1].clone()
    ref = grads(*(t[:1].float() for t in (q, k, v, dout)), "causal", fn=attngen.reference.attention,
                dropout_p=0.1, dropout_mask=keep)
    assert_batch0_close(got, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["none", "causal", "document"])
def test_realistic_shape_with_atomic_dq(name):
    """deterministic=False at B=2 H=16 S=4096 D=128 in bf16 against float32 autograd on batch 0."""
    q, k, v = rand_qkv(2, 16, 4, 4096, 4096, 128, torch.bfloat16, device="cuda")
    mask = ZOO[name](2, 16, 4096, 4096, "cuda")
    dout = torch.randn_like(q)
    got = grads(q, k, v, dout, mask, fn=nondeterministic)
    one = ZOO[name](1, 16, 4096, 4096, "cuda") if name == "document" else mask
    if name == "document":
        got = grads(q[:1], k[:1], v[:1], dout[:1], one, fn=nondeterministic)
    ref = grads(*(t[:1].float() for t in (q, k, v, dout)), one, fn=attngen.reference.attention)
    assert_batch0_close(got, ref, torch.bfloat16)


@pytest.mark.gpu
def test_realistic_dropout_keep_rate_and_determinism():
    q, k, v = rand_qkv(2, 8, 8, 2048, 2048, 64, torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    torch.manual_seed(3)
    first = grads(q, k, v, dout, "causal", dropout_p=0.1)
    torch.manual_seed(3)
    second = grads(q, k, v, dout, "causal", dropout_p=0.1)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    keep = attngen.dropout_mask(q[:1, :2], k[:1, :2], 0.1)
    assert abs(float(keep.float().mean()) - 0.9) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [256, 200])
@pytest.mark.parametrize("topk", [None, 16])
def test_large_head_dims(head_dim, topk):
    """bf16 at D=200 and 256 (the largest), causal, plain and top-k: the dispatcher's tiles for such
    heads must fit and give gradients that match float64 autograd."""
    q, k, v = rand_qkv(1, 4, 2, 1000, 1000, head_dim, torch.bfloat16, device="cuda")
    check_grads(q, k, v, "causal", topk=topk)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["none", "causal"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_fp32_head_dim_128_fits_shared_memory(name, deterministic):
    """float32 at D=128: the dispatcher's backward tiles for 16-bit inputs (64x128 at 3 stages on
    sm90) need more shared memory than an SM has at 4 bytes an element; the call must still run
    (at fewer stages), with gradients that match float64 autograd."""
    q, k, v = rand_qkv(1, 4, 2, 1000, 1000, 128, torch.float32, device="cuda")
    check_grads(q, k, v, name, fn=attngen.attention if deterministic else nondeterministic)
    config = attngen.dispatch.choose(q, k, v, name, kernel="bwd").config
    assert config.shared_memory(128, 4, "bwd") <= attngen.dispatch.smem_limit(q.device), config
