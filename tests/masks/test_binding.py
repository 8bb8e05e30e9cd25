"""A mask bound to a call: its kernel arguments, its Triton source and its torch evaluation."""

import pytest
import torch

import attngen
from attngen import masks as masks_
from helpers import DEVICE


def combined(batch=2, heads=3, kv_len=12):
    ids = torch.randint(0, 3, (batch, kv_len), device=DEVICE).sort(-1).values
    slopes = torch.rand(heads, device=DEVICE) + 0.1
    return (attngen.mask("sliding_window", window=4, two_sided=True) & attngen.mask("document", doc_ids=ids)
            & attngen.mask("alibi", slopes=slopes) & attngen.mask("softcap", cap=2.0)), ids, slopes


def test_kernel_arguments_are_named_by_term_and_parameter():
    m, ids, slopes = combined()
    assert masks_.kernel_params(m) == ["t0_window", "T1_DOC_IDS", "t1_doc_ids_stride0", "t1_doc_ids_stride1",
                                       "T2_SLOPES", "t2_slopes_stride0", "t3_cap"]
    assert masks_.scalar_params(m) == ["t0_window", "t3_cap"]  # never specialised: a new value never recompiles
    assert masks_.kernel_params(None) == [] and masks_.scalar_params(None) == []
    bound = masks_.bind(m, batch=2, heads=3, q_len=12, kv_len=12, device=DEVICE)
    assert bound.kernel_args[0] == 4 and bound.kernel_args[1] is ids and bound.kernel_args[-1] == 2.0
    assert bound.kernel_args[2:4] == list(ids.stride()) and bound.kernel_args[4] is slopes
    visible, mods = masks_.triton_sources(m)
    assert "t0_window" in visible and "_load_param2(T1_DOC_IDS" in visible
    assert len(mods) == 2 and "_load_param1(T2_SLOPES" in mods[0] and "_tanh" in mods[1] and "t3_cap" in mods[1]
    assert masks_.predicate_names(m.tree) >= {"b", "q_idx", "kv_idx"} and "h" not in masks_.predicate_names(m.tree)


def test_a_shared_tensor_dimension_broadcasts_with_stride_zero():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]], device=DEVICE)  # (1, kv_len): one layout for every batch row
    bound = masks_.bind(attngen.mask("document", doc_ids=ids), batch=3, heads=2, q_len=8, kv_len=8, device=DEVICE)
    assert bound.kernel_args[1:] == [0, 1]
    with pytest.raises(ValueError, match=r"dimension 1 \(kv_len\) has size 8, expected 9"):
        masks_.bind(attngen.mask("document", doc_ids=ids), batch=3, heads=2, q_len=9, kv_len=9, device=DEVICE)


def test_torch_evaluation_is_the_expression():
    """predicate_fn and score_fn compute what the templates' expressions say, written out by hand."""
    batch, heads, n = 2, 3, 12
    m, ids, slopes = combined(batch, heads, n)
    bound = masks_.bind(m, batch=batch, heads=heads, q_len=n, kv_len=n, device=DEVICE)
    pos = torch.arange(n, device=DEVICE)
    env = masks_.index_env(pos, pos, q_len=n, kv_len=n, batch=batch, heads=heads)
    q_idx, kv_idx = pos.view(1, 1, -1, 1), pos.view(1, 1, 1, -1)
    want = ((q_idx - kv_idx).abs() < 4) & (ids[:, None, :, None] == ids[:, None, None, :])
    got = masks_.evaluate_visible(bound, env)
    assert torch.equal(got.expand(batch, 1, n, n), want.expand(batch, 1, n, n))
    assert torch.equal(masks_.predicate_fn(bound)(env), got)
    score = torch.randn(batch, heads, n, n, dtype=torch.float64, device=DEVICE) * 4
    biased = score + slopes.double().view(1, -1, 1, 1) * (kv_idx - q_idx)
    assert torch.allclose(masks_.score_fn(bound)(score, env), 2.0 * torch.tanh(biased / 2.0))


def test_terms_of_a_tree():
    m = (attngen.mask("causal") | attngen.mask("chunked", chunk=4)) & attngen.mask("prefix_lm", prefix=2)
    assert [t.template.name for t in masks_.binding.tree_terms(m.tree)] == ["causal", "chunked", "prefix_lm"]
    assert masks_.binding.is_term(m.terms()[0]) and not masks_.binding.is_term(m.tree)
    assert masks_.binding.tree_terms(None) == []
