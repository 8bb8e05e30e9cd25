"""NaN and inf in q, k or v: they reach exactly the outputs the float64 reference gives them to
(README, "NaN and inf"), and no warning leaks from Triton's interpreter."""

import warnings

import pytest
import torch

import attngen
from helpers import DEVICE, DTYPES, TOLERANCE, rand_qkv

NAN, INF = float("nan"), float("inf")
MASKS = {"none": None, "causal": "causal", "sliding_window": attngen.mask("sliding_window", window=5)}


def run(q, k, v, mask, topk):
    """attngen's (out, lse) and the reference's, with every warning recorded (none may come)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", append=True)  # every warning that no earlier filter stops
        out, lse = attngen.attention(q, k, v, mask=mask, topk=topk, return_lse=True)
    assert [str(w.message) for w in caught] == []
    return (out, lse), attngen.reference.attention(q, k, v, mask=mask, topk=topk, return_lse=True)


def assert_same_nonfinite(got, want, dtype):
    """NaN, +inf and -inf at exactly the same places; the finite elements within tolerance."""
    for g, w in zip(got, want):
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(test(g), test(w)), f"{test.__name__} differs at {(test(g) != test(w)).nonzero()}"
        finite = torch.isfinite(w)
        err = ((g[finite].double() - w[finite]).norm() / w[finite].norm().clamp_min(1e-30)).item()
        assert err <= TOLERANCE[dtype] if g.dtype == dtype else err <= 1e-4, err


def nonfinite_qk(where, value, dtype):
    """q, k, v of 40 positions (a full key tile and a partial one) with `value` in q or k: one
    element (row or key 9: scores of +-inf or NaN of either sign) and all of row or key 20 (its
    scores all +-inf, or NaN)."""
    q, k, v = rand_qkv(1, 2, 1, 40, 40, 16, dtype)
    t, other = (q, k) if where == "q" else (k, q)
    t[0, 0, 9, 3] = value
    t[0, 0, 20] = 0
    t[0, 0, 20, 0] = value
    other[..., 0] = other[..., 0].abs() + 0.5  # every score of row / key 20 has the sign of `value`
    return q, k, v


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["q", "k"])
def test_nonfinite_q_or_k(where, value, mask):
    """A NaN or +inf score a row sees makes the row NaN (output and LSE); a -inf score weighs
    nothing; a row whose scores are all -inf is empty (output 0, LSE -inf); hidden scores never
    matter."""
    dtype = DTYPES[len(mask) % len(DTYPES)]
    q, k, v = nonfinite_qk(where, value, dtype)
    assert_same_nonfinite(*run(q, k, v, MASKS[mask], None), dtype)


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["q", "k"])
def test_nonfinite_q_or_k_topk(where, value):
    """Top-k keeps a NaN score (its row is NaN) and drops -inf ones like any low score."""
    q, k, v = nonfinite_qk(where, value, torch.float32)
    assert_same_nonfinite(*run(q, k, v, "causal", 3), torch.float32)


@pytest.mark.parametrize("mask,topk", [("none", None), ("causal", None), ("causal", 3)])
def test_nan_in_v_reaches_the_rows_that_see_its_key(mask, topk):
    """Key 0, which every row sees (causal included): its NaN value is in every row's output, in
    that column only; the LSE is untouched."""
    dtype = DTYPES[-1] if topk is None else torch.float32
    q, k, v = rand_qkv(1, 2, 1, 40, 40, 16, dtype)
    v[0, 0, 0, 5] = NAN
    assert_same_nonfinite(*run(q, k, v, MASKS[mask], topk), dtype)


@pytest.mark.parametrize("value", [INF, -INF], ids=["inf", "-inf"])
def test_inf_in_v_reaches_the_rows_that_see_its_key(value):
    """+-inf in v: the rows that see its key are not finite in that column (inf, or NaN where a weight
    is 0: 0 * inf), as in the reference; the other columns stay right."""
    q, k, v = rand_qkv(1, 2, 1, 40, 40, 16, torch.float32)
    v[0, 0, 0, 5] = value
    (out, lse), (ref, ref_lse) = run(q, k, v, "causal", None)
    assert not torch.isfinite(out[0, :, :, 5]).any() and not torch.isfinite(ref[0, :, :, 5]).any()
    others = [d for d in range(16) if d != 5]
    assert torch.allclose(out[..., others].double(), ref[..., others], atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


def test_nan_in_v_of_a_hidden_key_reaches_no_row_outside_its_tiles():
    """A key that a row does not see: attngen never visits the tiles a mask hides, so its NaN stays
    out of their rows (the reference, a float64 matmul with zero weights, spreads it to every row)."""
    q, k, v = rand_qkv(1, 1, 1, 300, 300, 16, torch.float32, device=DEVICE)
    v[0, 0, 5, 3] = NAN
    mask = attngen.mask("sliding_window", window=3)
    out = attngen.attention(q, k, v, mask=mask)
    assert out[0, 0, :8, 3].isnan().all()  # rows 5..7 see key 5, rows 0..4 share its tile
    assert torch.isfinite(out[0, 0, 200:]).all()  # far away: tiles the mask hides
    assert torch.isfinite(out[..., [0, 1, 2, 4]]).all()


def test_no_warning_leaks_after_a_callers_own_catch_warnings():
    """attngen's filters are in place from its import: a caller's catch_warnings() around a call
    (pytest opens one per test) does not take them away when it closes."""
    q, k, v = rand_qkv(1, 1, 1, 20, 40, 16, torch.float32)  # a full key tile: the interpreter's max of a NaN row
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attngen.attention(q, k, v)
    q[0, 0, 3, 0] = NAN
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", append=True)  # every warning that no earlier filter stops
        out = attngen.attention(q, k, v)
    assert out[0, 0, 3].isnan().all() and [str(w.message) for w in caught] == []
