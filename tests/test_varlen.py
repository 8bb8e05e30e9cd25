"""attngen.varlen_attention on packed (total, H, D) tensors against per-sequence reference calls:
every position mask, GQA, empty and one-token sequences, a padding tail, gradients, top-k,
dropout, torch.compile, and clear errors."""

import pytest
import torch

import attngen
from helpers import DEVICE, TOLERANCE, rel_error

M = attngen.mask
MASKS = {
    "none": None,
    "causal": "causal",
    "causal_bottom_right": M("causal", align="bottom_right"),
    "sliding_window&softcap": M("sliding_window", window=5) & M("softcap", cap=4.0),
    "sliding_window_two_sided|prefix_lm": M("sliding_window", window=3, two_sided=True) | M("prefix_lm", prefix=4),
    "chunked&causal&alibi": M("chunked", chunk=6) & M("causal") & M("alibi", slopes=torch.tensor([0.5, 0.25, 0.125,
                                                                                                   0.0625], device=DEVICE)),
}


def _packed(lens_q, lens_k, heads=4, kv_heads=2, head_dim=16, pad_q=3, dtype=torch.float32):
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0)  # int64: both are taken
    q = torch.randn(sum(lens_q) + pad_q, heads, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(sum(lens_k), kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn_like(k)
    return q, k, v, cu_q, cu_k


def _reference(q, k, v, cu_q, cu_k, mask, **kwargs):
    """One reference call per sequence, packed again; padding rows 0."""
    outs = []
    for i in range(len(cu_q) - 1):
        piece = [t[a:b].permute(1, 0, 2)[None].double() for t, (a, b) in
                 ((q, cu_q[i:i + 2]), (k, cu_k[i:i + 2]), (v, cu_k[i:i + 2]))]
        if piece[0].shape[2] == 0:
            continue
        if piece[1].shape[2] == 0:  # no keys: nothing to see
            outs.append(torch.zeros_like(piece[0][0].permute(1, 0, 2)))
            continue
        outs.append(attngen.reference.attention(*piece, mask=mask, **kwargs)[0].permute(1, 0, 2))
    tail = q.shape[0] - int(cu_q[-1])
    return torch.cat(outs + [torch.zeros(tail, *q.shape[1:], dtype=torch.float64, device=q.device)])


@pytest.mark.parametrize("name", MASKS)
def test_every_position_mask_against_per_sequence_calls(name):
    q, k, v, cu_q, cu_k = _packed([5, 1, 17, 0, 9], [7, 3, 17, 2, 12])
    out = attngen.varlen_attention(q, k, v, cu_q, cu_k, 17, 17, mask=MASKS[name])
    assert out.shape == q.shape and not torch.isnan(out).any()
    assert rel_error(out, _reference(q, k, v, cu_q, cu_k, MASKS[name])) <= TOLERANCE[q.dtype]


def test_self_attention_packing_in_fp16_with_the_lse():
    q, k, v, cu_q, _ = _packed([20, 33, 11], [20, 33, 11], pad_q=0, dtype=torch.float16)
    out, lse = attngen.varlen_attention(q, k, v, cu_q, cu_q, mask="causal", return_lse=True)
    assert rel_error(out, _reference(q, k, v, cu_q, cu_q, "causal")) <= TOLERANCE[torch.float16]
    assert lse.shape == (4, 64) and lse.dtype == torch.float32
    first = attngen.reference.attention(*(t[:20].permute(1, 0, 2)[None] for t in (q, k, v)), mask="causal",
                                        return_lse=True)[1]
    assert rel_error(lse[:, :20], first[0]) <= 1e-4


def test_gradients_match_per_sequence_calls():
    q, k, v, cu_q, cu_k = _packed([6, 13, 1], [9, 13, 4])
    mask = MASKS["sliding_window&softcap"]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attngen.varlen_attention(q, k, v, cu_q, cu_k, mask=mask)
    up = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), up)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference(q64, k64, v64, cu_q, cu_k, mask)
    for name, got, want in zip("qkv", grads, torch.autograd.grad(ref, (q64, k64, v64), up.double())):
        assert rel_error(got, want) <= 1e-4, f"d{name}"


def test_topk_and_dropout():
    q, k, v, cu_q, cu_k = _packed([12, 20], [12, 20], pad_q=0)
    out = attngen.varlen_attention(q, k, v, cu_q, cu_k, mask="causal", topk=3)
    assert rel_error(out, _reference(q, k, v, cu_q, cu_k, "causal", topk=3)) <= TOLERANCE[q.dtype]
    torch.manual_seed(4)
    dropped = attngen.varlen_attention(q, k, v, cu_q, cu_k, mask="causal", dropout_p=0.3)
    torch.manual_seed(4)
    assert torch.equal(dropped, attngen.varlen_attention(q, k, v, cu_q, cu_k, mask="causal", dropout_p=0.3))
    assert not torch.equal(dropped, attngen.varlen_attention(q, k, v, cu_q, cu_k, mask="causal"))


def test_the_same_cu_seqlens_classify_once():
    q, k, v, cu_q, cu_k = _packed([12, 20], [12, 20], pad_q=0)
    attngen.varlen_attention(q, k, v, cu_q, cu_k, mask="causal")
    from attngen.masks import blocks
    before = len(blocks._STRUCTURE_CACHE)
    attngen.varlen_attention(q, k, v, cu_q, cu_k, mask="causal")
    assert len(blocks._STRUCTURE_CACHE) == before
    cu_q[1] = 13  # changed in place: seen (torch's version counter)
    cu_k[1] = 13
    out = attngen.varlen_attention(q, k, v, cu_q, cu_k, mask="causal")
    assert rel_error(out, _reference(q, k, v, cu_q, cu_k, "causal")) <= TOLERANCE[q.dtype]


def test_under_torch_compile():
    q, k, v, cu_q, cu_k = _packed([12, 20], [14, 20])
    torch._dynamo.reset()

    def f(q, k, v, cu_q, cu_k):
        return attngen.varlen_attention(q, k, v, cu_q, cu_k, mask=attngen.mask("causal", align="bottom_right"))

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, cu_q, cu_k)
    torch._dynamo.reset()
    assert torch.equal(out, f(q, k, v, cu_q, cu_k))


@pytest.mark.parametrize("args, error, match", [
    (dict(q=torch.randn(1, 4, 10, 16)), ValueError, "q must be a \\(total_tokens, heads, head_dim\\) tensor"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 5.0])), ValueError, "cu_seqlens_q must be a 1-d int32 or int64"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 10])), ValueError, "cu_seqlens_q has 1 sequences but cu_seqlens_k has 2"),
    (dict(mask=attngen.mask("document", doc_ids=torch.zeros(10, dtype=torch.long))), ValueError,
     "no meaning inside each packed sequence"),
])
def test_bad_input(args, error, match):
    call = dict(q=torch.randn(10, 4, 16), k=torch.randn(10, 2, 16), v=torch.randn(10, 2, 16),
                cu_seqlens_q=torch.tensor([0, 10]), cu_seqlens_k=torch.tensor([0, 10]))
    call.update(args)
    call = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in call.items()}
    mask = call.pop("mask", None)
    with pytest.raises(error, match=match):
        attngen.varlen_attention(**call, mask=mask)
