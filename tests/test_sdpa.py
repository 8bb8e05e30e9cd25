"""attngen.scaled_dot_product_attention against torch's on the same inputs (outputs, gradients,
errors), and sdpa_override routing a model's SDPA calls."""

import pytest
import torch
import torch.nn.functional as F

import attngen
from helpers import DEVICE, TOLERANCE, rel_error


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _bool_mask(*shape):
    m = torch.rand(*shape, device=DEVICE) > 0.4
    m[..., 0, :] = False  # a row with no key: torch and attngen both give 0
    return m


def _float_mask(*shape):
    m = _rand(*shape)
    m[..., 0, :] = float("-inf")
    m[..., 1, :3] = float("-inf")
    return m


def _torch_sdpa(*args, **kwargs):
    """torch's SDPA in float64 (its math backend), the reference. attn_mask with is_causal: both
    apply (torch 2.13 does so; torch 2.11 raises), so the reference is given the two joined."""
    up = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
    mask = kwargs.get("attn_mask")
    if mask is not None and kwargs.get("is_causal"):
        causal = torch.ones(up[0].shape[-2], up[1].shape[-2], dtype=torch.bool, device=mask.device).tril()
        mask = mask & causal
        kwargs = dict(kwargs, attn_mask=mask, is_causal=False)
    if mask is not None and mask.is_floating_point():
        kwargs = dict(kwargs, attn_mask=mask.double())
    return F.scaled_dot_product_attention(*up, **kwargs)


CASES = {
    "plain": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 16)), {}),
    "causal, Sq < Sk": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 16)), dict(is_causal=True)),
    "bool mask": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 16)),
                          dict(attn_mask=_bool_mask(9, 11))),
    "bool mask and causal": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 16)),
                                     dict(attn_mask=_bool_mask(2, 1, 9, 11), is_causal=True)),
    "float mask, broadcast": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 16)),
                                      dict(attn_mask=_float_mask(2, 1, 9, 11))),
    "key padding mask (B, 1, 1, S)": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 16)),
                                              dict(attn_mask=torch.rand(2, 1, 1, 11, device=DEVICE) > 0.3)),
    "gqa": lambda: ((_rand(2, 4, 9, 16), _rand(2, 2, 11, 16), _rand(2, 2, 11, 16)), dict(enable_gqa=True)),
    "broadcast key heads": lambda: ((_rand(2, 4, 9, 16), _rand(2, 1, 11, 16), _rand(2, 1, 11, 16)), {}),
    "3-d": lambda: ((_rand(4, 9, 16), _rand(4, 11, 16), _rand(4, 11, 16)), dict(is_causal=True)),
    "2-d": lambda: ((_rand(9, 16), _rand(11, 16), _rand(11, 16)), {}),
    "5-d": lambda: ((_rand(3, 2, 4, 9, 16), _rand(1, 2, 4, 11, 16), _rand(1, 2, 4, 11, 16)), {}),
    "value narrower": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 8)), {}),
    "value wider": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 24)), dict(is_causal=True)),
    "scale": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 16)), dict(scale=0.7)),
    "negative scale": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 16)), dict(scale=-0.3)),
    "zero scale": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 11, 16), _rand(2, 4, 11, 16)), dict(scale=0.0)),
    "transposed": lambda: ((_rand(2, 9, 4, 16).transpose(1, 2), _rand(2, 11, 4, 16).transpose(1, 2),
                            _rand(2, 11, 4, 16).transpose(1, 2)), {}),
    "fp16": lambda: ((_rand(2, 4, 9, 16, dtype=torch.float16), _rand(2, 4, 11, 16, dtype=torch.float16),
                      _rand(2, 4, 11, 16, dtype=torch.float16)), dict(attn_mask=_float_mask(9, 11))),
    "empty keys": lambda: ((_rand(2, 4, 9, 16), _rand(2, 4, 0, 16), _rand(2, 4, 0, 16)), {}),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_torch(case):
    (q, k, v), kwargs = CASES[case]()
    out = attngen.scaled_dot_product_attention(q, k, v, **kwargs)
    ref = _torch_sdpa(q, k, v, **kwargs)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    assert rel_error(out, ref) <= TOLERANCE[q.dtype]


@pytest.mark.parametrize("case", ["bool mask and causal", "float mask, broadcast", "gqa", "value narrower", "3-d"])
def test_gradients_match_torch(case):
    (q, k, v), kwargs = CASES[case]()
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attngen.scaled_dot_product_attention(q, k, v, **kwargs)
    ref = _torch_sdpa(q, k, v, **kwargs)
    upstream = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), upstream.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    for name, got, want in zip("qkv", grads, ref_grads):
        assert rel_error(got, want) <= 1e-4, f"d{name}"


def test_dropout_is_attention_with_the_same_dropout():
    q, k, v = _rand(1, 2, 9, 16), _rand(1, 2, 9, 16), _rand(1, 2, 9, 16)
    torch.manual_seed(5)
    out = attngen.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    torch.manual_seed(5)
    assert torch.equal(out, attngen.attention(q, k, v, mask="causal", dropout_p=0.3))
    assert not torch.equal(out, attngen.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert torch.equal(attngen.scaled_dot_product_attention(q, k, v, dropout_p=1.0), torch.zeros_like(q))


Q, K, V = (torch.randn(2, 4, 5, 8, device=DEVICE) for _ in range(3))
BAD = {
    "dtypes differ": ((Q, K.half(), V), {}),
    "head dims differ": ((Q, K[..., :4], V), {}),
    "mask of int": ((Q, K, V), dict(attn_mask=torch.ones(5, 5, dtype=torch.int32, device=DEVICE))),
    "mask of float64 for float32": ((Q, K, V), dict(attn_mask=torch.ones(5, 5, dtype=torch.float64, device=DEVICE))),
    "mask does not broadcast": ((Q, K, V), dict(attn_mask=torch.ones(4, 5, dtype=torch.bool, device=DEVICE))),
    "gqa heads do not divide": ((Q, K[:, :3], V[:, :3]), dict(enable_gqa=True)),
    "key not a tensor": ((Q, [[1.0]], V), {}),
    "mask not a tensor": ((Q, K, V), dict(attn_mask=[[True]])),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises_what_torch_raises(case):
    args, kwargs = BAD[case]
    with pytest.raises(Exception) as theirs:
        F.scaled_dot_product_attention(*args, **kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        attngen.scaled_dot_product_attention(*args, **kwargs)
    assert len(str(ours.value)) > 20


def test_what_attngen_cannot_run_says_so():
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        attngen.scaled_dot_product_attention(Q.double(), K.double(), V.double())
    with pytest.raises(RuntimeError, match="same sequence length"):  # torch 2.13's CPU SDPA runs this
        attngen.scaled_dot_product_attention(Q, K, V[:, :, :3])
    with pytest.raises(RuntimeError, match="dropout_p"):
        attngen.scaled_dot_product_attention(Q, K, V, dropout_p=1.5)


class _Block(torch.nn.Module):
    """A model that calls SDPA the way transformer code does, knowing nothing of attngen."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


def test_sdpa_override_routes_a_models_calls_to_attngen(monkeypatch):
    model = _Block().to(DEVICE)
    x = torch.randn(2, 13, 32, device=DEVICE)
    calls = []
    original = attngen.sdpa.attention
    monkeypatch.setattr(attngen.sdpa, "attention", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    ref = model(x)
    assert not calls
    with attngen.sdpa_override():
        out = model(x)
    assert len(calls) == 1 and calls[0]["mask"].variant == "causal(align='top_left')"
    assert rel_error(out, ref) <= 1e-5
    model(x)
    assert len(calls) == 1  # the override ends with the block
