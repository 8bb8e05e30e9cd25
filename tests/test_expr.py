"""The expression language: one parse, a Triton rendering and a torch evaluation that agree."""

import pytest
import torch

from attngen.expr import INDEX_NAMES, Expr, ExprError, TensorRef


def expr(text, tensors=None):
    tensors = tensors or {}
    return Expr(text, set(INDEX_NAMES) | {"w"} | set(tensors), tensors)


def test_chained_comparisons_and_python_boolean_words():
    e = expr("0 <= q_idx - kv_idx < w and not (kv_idx == 3) or q_idx == 0")
    assert e.to_triton({"w": "t0_w"}, {}) == (
        "((((0 <= (q_idx - kv_idx)) & ((q_idx - kv_idx) < t0_w)) & (~((kv_idx == 3)))) | ((q_idx == 0)))")
    q = torch.arange(6).view(-1, 1)
    kv = torch.arange(6).view(1, -1)
    got = e.evaluate(dict(q_idx=q, kv_idx=kv, w=2))
    want = (((q - kv) >= 0) & ((q - kv) < 2) & (kv != 3)) | (q == 0)
    assert torch.equal(got, want)


def test_integer_division_truncates_like_triton():
    e = expr("(q_idx - kv_idx) // 3")
    got = e.evaluate(dict(q_idx=torch.tensor([0, 0, 0, 7]), kv_idx=torch.tensor([4, 3, 1, 0])))
    assert got.tolist() == [-1, -1, 0, 2]  # Python's // would give -2, -1, -1, 2
    assert expr("(q_idx - kv_idx) % 3").evaluate(dict(q_idx=0, kv_idx=4)) == -1
    assert expr("q_idx / 2").evaluate(dict(q_idx=3)) == 1.5


def test_functions_and_ternary():
    e = expr("where(q_idx > 1, abs(kv_idx - q_idx), maximum(q_idx, 7)) if w else minimum(q_idx, kv_idx)")
    assert "tl.where" in e.to_triton({}, {}) and "tl.maximum" in e.to_triton({}, {})
    q = torch.arange(4)
    assert e.evaluate(dict(q_idx=q, kv_idx=torch.tensor(2), w=True)).tolist() == [7, 7, 0, 1]
    assert expr("tanh(w)").to_triton({}, {}) == "_tanh(w)"


def test_tensor_parameters_read_zero_outside():
    e = expr("ids[kv_idx] + 1", {"ids": 1})
    ref = TensorRef("T0_IDS", ("t0_ids_stride0",), ("kv_len",))
    assert e.to_triton({}, {"ids": ref}) == "(_load_param1(T0_IDS, kv_idx, kv_len, t0_ids_stride0) + 1)"
    out = e.evaluate(dict(ids=torch.tensor([5, 6, 7]), kv_idx=torch.tensor([-1, 0, 2, 3])))
    assert out.tolist() == [1, 6, 8, 1]


@pytest.mark.parametrize("text,message", [
    ("q_idx +", "syntax error"),
    ("lambda: 1", "Lambda is not allowed"),
    ("[q_idx]", "List is not allowed"),
    ("'a' == 'a'", "only numbers and booleans"),
    ("q_idx[0]", "only tensor parameters can be indexed"),
    ("os.system(1)", "unknown function"),
    ("maximum(q_idx, b=1)", "unknown function"),
    ("xyz", "unknown name 'xyz'"),
    ("ids[0:2]", "slices are not supported"),
])
def test_rejected(text, message):
    with pytest.raises(ExprError, match=message):
        expr(text, {"ids": 1})


def test_substitute_replaces_names_not_tensor_names():
    e = Expr("(q_idx + kv_len - q_len) - kv_idx < window", set(INDEX_NAMES) | {"window"}, {})
    local = e.substitute({"q_idx": "q_idx - start[q_idx]", "q_len": "n[q_idx]"}, {"start": 1, "n": 1})
    assert local.text == "q_idx - start[q_idx] + kv_len - n[q_idx] - kv_idx < window"
    env = dict(q_idx=torch.tensor([5]), kv_idx=torch.tensor([4]), kv_len=10, window=3,
               start=torch.tensor([0, 0, 0, 0, 0, 3]), n=torch.tensor([0, 0, 0, 0, 0, 8]))
    # local q_idx 2, q_len 8: 2 + 10 - 8 - 4 = 0 < 3
    assert bool(local.evaluate(env))
    assert "start" in local.names and "start" not in e.names
