"""Bad input gives a clear ValueError / TypeError naming the argument, never a Triton traceback."""

import pytest
import torch

import attngen
from helpers import DEVICE


def qkv(q_shape=(1, 4, 8, 16), k_shape=(1, 2, 8, 16), dtype=torch.float16, device=DEVICE):
    return (torch.randn(*q_shape, device=device).to(dtype), torch.randn(*k_shape, device=device).to(dtype),
            torch.randn(*k_shape, device=device).to(dtype))


@pytest.mark.parametrize("args,kwargs,error,message", [
    (qkv(q_shape=(4, 8, 16)), {}, ValueError, r"q must have 4 dimensions .* got shape \(4, 8, 16\)"),
    (qkv(k_shape=(2, 2, 8, 16)), {}, ValueError, "batch sizes differ: q 1, k 2"),
    (qkv(k_shape=(1, 2, 8, 32)), {}, ValueError, "head dims differ: q 16, k 32"),
    (qkv(k_shape=(1, 3, 8, 16)), {}, ValueError, "q has 4 heads, which is not a multiple of the 3"),
    (qkv(q_shape=(1, 2, 8, 300), k_shape=(1, 2, 8, 300)), {}, ValueError, "head dim 300 is over the supported 256"),
    (qkv(dtype=torch.float64), {}, TypeError, "q has dtype torch.float64; supported: float16, bfloat16, float32"),
    ((torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16).half(), torch.randn(1, 2, 8, 16)), {}, TypeError,
     "k has dtype torch.float16 but q has torch.float32"),
    (qkv(), {"mask": "no_such_mask"}, ValueError, r"unknown mask 'no_such_mask'; known: alibi, bias, block_sparse, causal, chunked"),
    (qkv(), {"mask": 3}, TypeError, r"mask must be None, a mask spec \(a template name, or name\(param=value, "
     r"\.\.\.\), joined by & and \|, e\.g\. 'sliding_window\(window=256\) & softcap\(cap=30\.0\)'\) or an attngen "
     "mask object, got int"),
    (qkv(), {"mask": "sliding_window(window=8"}, ValueError,
     r"mask spec 'sliding_window\(window=8' is not valid .*; write a template name, or name\(param=value"),
    (qkv(), {"mask": "sliding_window(window=w)"}, ValueError,
     "parameter 'window' of sliding_window must be a literal"),
    (qkv(), {"mask": "sliding_window(size=8)"}, TypeError,
     r"has no parameter 'size' .*; in a mask spec: sliding_window\(window=\.\.\.\)"),
    (qkv(), {"mask": "document"}, TypeError,
     r"tensor parameters cannot be given in a mask spec: use attngen.mask\('document', doc_ids=\.\.\.\)"),
    (qkv(), {"mask": "sliding_window"}, TypeError,
     r"mask 'sliding_window' is missing parameter 'window' \(window: int >= 1\); in a mask spec: "
     r"sliding_window\(window=\.\.\.\)"),
    (qkv(), {"return_lse": "yes"}, TypeError, "return_lse must be a bool \\(True or False\\), got str 'yes'"),
    (qkv(), {"return_lse": 1}, TypeError, "return_lse must be a bool"),
    (qkv(), {"scale": "big"}, TypeError, "scale must be a float or None, got str"),
    (qkv(), {"scale": -1.0}, ValueError, "scale must be a positive finite number, got -1.0"),
])
def test_bad_input(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        attngen.attention(*args, **kwargs)


def test_device_mismatch():
    q, k, v = qkv(device="cpu")
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="k is on cuda:0 but q is on cpu"):
            attngen.attention(q, k.cuda(), v)
    else:
        with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
            attngen.attention(q, k.to("meta"), v)


def test_cpu_tensors_without_interpreter(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="CPU tensors; attngen kernels run on a CUDA device.*TRITON_INTERPRET=1"):
        attngen.attention(*qkv(device="cpu"))


@pytest.mark.parametrize("call,error,message", [
    (lambda: attngen.mask("sliding_window", window="8"), TypeError,
     "mask 'sliding_window' parameter 'window' must be an int, got str '8'"),
    (lambda: attngen.mask("sliding_window", window=0), ValueError, "parameter 'window' must be >= 1, got 0"),
    (lambda: attngen.mask("sliding_window", window=8, size=3), TypeError,
     r"mask 'sliding_window' has no parameter 'size' \(parameters: window, two_sided, align\)"),
    (lambda: attngen.mask("causal", align="middle"), ValueError,
     "parameter 'align' must be one of 'top_left', 'bottom_right', got 'middle'"),
    (lambda: attngen.mask("sliding_window", window=8, two_sided=1), TypeError, "'two_sided' must be a bool"),
    (lambda: attngen.mask("softcap", cap=True), TypeError, "'cap' must be a float, got bool"),
    (lambda: attngen.mask("softcap", cap=float("nan")), ValueError,
     "mask 'softcap' parameter 'cap' must be a finite number, got nan"),
    (lambda: attngen.mask("softcap", cap=float("inf")), ValueError, "'cap' must be a finite number, got inf"),
    (lambda: attngen.mask("softcap", cap=0.0), ValueError, "'cap' must be >= 0.001, got 0.0"),
    (lambda: attngen.masks.parse_spec("softcap(cap=1e999)"), ValueError, "'cap' must be a finite number, got inf"),
    (lambda: attngen.reference.attention(*qkv(), return_lse="no"), TypeError, "return_lse must be a bool"),
    (lambda: attngen.layouts.strided(64, 64, (16, 16), causal="no"), TypeError, "causal must be a bool"),
    (lambda: attngen.layouts.local_global(64, 64, (16, 16), causal=0), TypeError, "causal must be a bool"),
    (lambda: attngen.mask("document", doc_ids=[0, 1]), TypeError, r"'doc_ids' must be a torch.Tensor of shape \(batch, kv_len\)"),
    (lambda: attngen.mask("document", doc_ids=torch.zeros(3, 2, 8, dtype=torch.int64)), ValueError,
     r"'doc_ids' must have 2 dimension\(s\) \(batch, kv_len\), got shape \(3, 2, 8\)"),
    (lambda: attngen.mask("document", doc_ids=torch.zeros(8)), TypeError, "'doc_ids' must be a int tensor, got torch.float32"),
    (lambda: attngen.mask(5), TypeError, "mask name must be a str"),
])
def test_bad_mask_parameters(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_tensor_parameter_of_wrong_length():
    q, k, v = qkv()
    ids = torch.zeros(1, 9, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"'doc_ids': dimension 1 \(kv_len\) has size 9, expected 8"):
        attngen.attention(q, k, v, mask=attngen.mask("document", doc_ids=ids))
    slopes = torch.ones(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"'slopes': dimension 0 \(heads\) has size 3, expected 4 \(or 1\)"):
        attngen.attention(q, k, v, mask=attngen.mask("alibi", slopes=slopes))
    with pytest.raises(ValueError, match=r"'doc_ids' is on meta, but q is on"):
        attngen.attention(q, k, v, mask=attngen.mask("document", doc_ids=torch.zeros(8, dtype=torch.int64, device="meta")))


def test_register_template_dir_needs_a_folder(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        attngen.register_template_dir(tmp_path / "missing")



def test_a_bad_flag_is_refused_after_a_good_one_made_a_plan():
    """The fast path keys its prepared launches by the arguments: `return_lse='yes'` must not reach one."""
    q, k, v = qkv()
    out, lse = attngen.attention(q, k, v, return_lse=True)  # a plan for return_lse=True now exists
    for bad in ("yes", 1, None, torch.tensor(True)):
        with pytest.raises(TypeError, match="return_lse must be a bool"):
            attngen.attention(q, k, v, return_lse=bad)
