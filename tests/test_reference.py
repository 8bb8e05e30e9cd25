"""The float64 reference itself: visibility facts written out by hand, top-k ties, empty rows."""

import torch

import attngen


def weights(mask, sq=6, sk=6, **kwargs):
    """Row i of the result: the softmax weights of query i (zero scores: equal weights on the visible keys)."""
    q = torch.zeros(1, 1, sq, 16)
    k = torch.zeros(1, 1, sk, 16)
    v = torch.eye(sk, 16).view(1, 1, sk, 16)
    return attngen.reference.attention(q, k, v, mask, **kwargs)[0, 0, :, :sk]


def row(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_masks_hide_what_they_should():
    assert torch.allclose(weights("causal")[2], row(1 / 3, 1 / 3, 1 / 3, 0, 0, 0))
    assert torch.allclose(weights(attngen.mask("sliding_window", window=2))[4], row(0, 0, 0, .5, .5, 0))
    assert torch.allclose(weights(attngen.mask("chunked", chunk=4))[5], row(0, 0, 0, 0, .5, .5))
    assert torch.allclose(weights(attngen.mask("prefix_lm", prefix=3))[0], row(1 / 3, 1 / 3, 1 / 3, 0, 0, 0))
    docs = weights(attngen.mask("document", doc_ids=torch.tensor([0, 0, 1, 1, 1, 2])))
    assert torch.allclose(docs[3], row(0, 0, 1 / 3, 1 / 3, 1 / 3, 0))
    bottom_right = weights(attngen.mask("causal", align="bottom_right"), sq=3)
    assert torch.allclose(bottom_right[0], row(.25, .25, .25, .25, 0, 0))


def test_empty_rows_and_top_k_ties():
    """A row that sees no key: output 0, LSE -inf. Equal scores tie at the k-th: all of them are kept."""
    q, k = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 2, 8)
    out, lse = attngen.reference.attention(q, k, torch.ones(1, 1, 2, 8), attngen.mask("causal", align="bottom_right"),
                                           return_lse=True)
    assert (out[0, 0, :2] == 0).all() and torch.isneginf(lse[0, 0, :2]).all() and torch.isfinite(lse[0, 0, 2:]).all()
    assert torch.allclose(weights(None, topk=2)[0], row(*[1 / 6] * 6))  # six equal scores: all tied at the 2nd
