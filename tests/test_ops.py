"""attngen.attention as the attngen::attention operator: torch.compile (fullgraph, dynamic shapes,
masks built inside or outside the compiled function), torch.export, the operator's own checks
(torch.library.opcheck), dropout under compile, CUDA graphs (GPU)."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import attngen
from helpers import DEVICE, rand_qkv

DOCS = torch.tensor([0] * 10 + [1] * 7 + [2] * 7, device=DEVICE)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(seq=24, grad=True):
    q, k, v = rand_qkv(1, 4, 2, seq, seq, 16, torch.float32)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _grads(out, inputs):
    torch.manual_seed(1)
    upstream = torch.randn_like(out)
    return torch.autograd.grad(out, inputs, upstream)


def test_masks_built_outside_go_through_fullgraph_forward_and_backward():
    window = attngen.mask("sliding_window", window=8) & attngen.mask("softcap", cap=20.0)
    document = attngen.mask("document", doc_ids=DOCS) & attngen.mask("causal")

    def f(q, k, v):
        a, lse = attngen.attention(q, k, v, mask=window, return_lse=True)
        return a + attngen.attention(q, k, v, mask=document) + attngen.attention(q, k, v, mask="causal", topk=5), lse

    q, k, v = _inputs()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    out, lse = compiled(q, k, v)
    ref, ref_lse = f(q, k, v)
    assert counter.frame_count >= 1 and counter.op_count >= 3  # the operator is in the graph
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)  # the same kernels as an eager call
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert torch.equal(got, want)


def test_a_compiled_training_step_reuses_its_prepared_launches(monkeypatch):
    """The operators keep a TrainPlan per call signature (ops._plan): the second compiled step,
    forward and backward, builds no launch, and its gradients are those of an eager step."""
    from attngen.kernels import launch as launch_module
    document = attngen.mask("document", doc_ids=DOCS) & attngen.mask("causal")

    def f(q, k, v):
        return attngen.attention(q, k, v, mask=document) + attngen.attention(q, k, v, mask="causal", topk=5)

    q, k, v = _inputs()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    _grads(compiled(q, k, v), (q, k, v))  # compiles, and prepares the plans
    built = []
    real_init = launch_module.Launch.__init__
    monkeypatch.setattr(launch_module.Launch, "__init__", lambda self, *a, **kw: built.append(a[0]) or real_init(
        self, *a, **kw))
    got = _grads(compiled(q, k, v), (q, k, v))
    assert built == []
    monkeypatch.setattr(launch_module.Launch, "__init__", real_init)
    for g, w in zip(got, _grads(f(q, k, v), (q, k, v))):
        assert torch.equal(g, w)


def test_masks_built_inside_the_compiled_function():
    outside = attngen.mask("softcap", cap=20.0)

    def f(q, k, v):
        m = (attngen.mask("sliding_window", window=8) | attngen.mask("causal")) & attngen.mask("document", doc_ids=DOCS)
        return attngen.attention(q, k, v, mask=m & outside)

    q, k, v = _inputs(grad=False)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(out, f(q, k, v))
    ref = attngen.reference.attention(q, k, v, mask=(attngen.mask("sliding_window", window=8) | attngen.mask("causal"))
                                      & attngen.mask("document", doc_ids=DOCS) & outside)
    assert (out.double() - ref).abs().max() < 1e-5


def test_a_bad_mask_inside_a_compiled_function_is_the_same_clear_error():
    def f(q, k, v):
        return attngen.attention(q, k, v, mask=attngen.mask("sliding_window", windw=8))

    with pytest.raises(Exception, match="has no parameter 'windw'"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(*_inputs(grad=False))


def test_a_changing_sequence_length_does_not_recompile():
    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v):
        return attngen.attention(q, k, v, mask=attngen.mask("sliding_window", window=4))

    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    counts = []
    for seq in (17, 24, 40):
        q, k, v = _inputs(seq, grad=False)
        assert torch.equal(compiled(q, k, v), f(q, k, v))
        counts.append(counter.frame_count)
    assert counts[0] == counts[-1], f"recompiled as the length changed: frame counts {counts}"


def test_export():
    class Model(torch.nn.Module):
        def forward(self, q, k, v):
            return attngen.attention(q, k, v, mask=attngen.mask("document", doc_ids=DOCS) & attngen.mask("causal"))

    q, k, v = _inputs(grad=False)
    program = torch.export.export(Model(), (q, k, v))
    assert "torch.ops.attngen.attention" in program.graph_module.code
    assert torch.equal(program.module()(q, k, v), Model()(q, k, v))


@pytest.mark.parametrize("spec, tensors, topk, deterministic", [
    ("none", [], None, True), ("causal(align='bottom_right')", [], 5, True),
    ("document(doc_ids=tensor_0) & softcap(cap=10.0)", [DOCS], None, True), ("causal", [], None, False)])
def test_opcheck(spec, tensors, topk, deterministic):
    q, k, v = _inputs()
    result = torch.library.opcheck(torch.ops.attngen.attention.default,
                                   (q, k, v, spec, tensors, None, topk, 0.0, None, deterministic),
                                   test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_dropout_draws_a_new_mask_every_call_and_follows_manual_seed():
    def f(q, k, v):
        return attngen.attention(q, k, v, dropout_p=0.5)

    q, k, v = _inputs(grad=False)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    first, second = compiled(q, k, v), compiled(q, k, v)
    torch.manual_seed(3)
    again = compiled(q, k, v)
    assert not torch.equal(first, second)
    assert torch.equal(first, again)


def test_mask_tensors_that_require_grad_are_refused_under_compile():
    slopes = torch.rand(4, device=DEVICE, requires_grad=True)

    def f(q, k, v):
        return attngen.attention(q, k, v, mask=attngen.mask("alibi", slopes=slopes))

    with pytest.raises(Exception, match="requires grad"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(*_inputs())


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_inductor_fullgraph_training_step_on_the_gpu():
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in rand_qkv(2, 8, 2, 1000, 1000, 128, torch.float32))

    def f(q, k, v):
        return attngen.attention(q, k, v, mask=attngen.mask("sliding_window", window=256)) * 2

    out = torch.compile(f, fullgraph=True)(q, k, v)
    ref = f(q, k, v)
    assert torch.equal(out, ref)
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("mask", ["causal", attngen.mask("sliding_window", window=128) & attngen.mask("softcap", cap=30.0)])
def test_a_call_is_captured_in_a_cuda_graph_and_replayed(mask):
    q, k, v = rand_qkv(2, 8, 2, 1000, 1000, 128, torch.bfloat16)
    for _ in range(2):  # warm up: compile, plan
        attngen.attention(q, k, v, mask=mask)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attngen.attention(q, k, v, mask=mask)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attngen.attention(q, k, v, mask=mask))
