"""What every kernel family shares: the kernel templates rendered for every mask and run, launches
checked by argument name, and the tensors' launch properties."""

import threading

import pytest
import torch

import attngen
from attngen import masks as masks_
from attngen.checks import check_qkv
from attngen.config import KernelConfig
from attngen.kernels import forward, launch
from attngen.paths import data_dir
from helpers import DEVICE, TOLERANCE, assert_close, check_forward, poisoned_like, rand_qkv, rel_error

SPECS = ["none", "causal(align='bottom_right') & softcap", "(sliding_window(two_sided=True) | prefix_lm) & alibi",
         "block_sparse & document"] + sorted(attngen.templates())


def test_kernel_templates_are_the_files():
    names = launch.kernel_templates()
    files = (data_dir("templates") / "kernels").glob("*.py.jinja")
    assert names == sorted(p.name.removesuffix(".py.jinja") for p in files)
    assert {"forward", "topk"} <= set(names)


@pytest.mark.parametrize("template", launch.kernel_templates())
def test_every_kernel_template_renders_for_every_mask(template):
    """Each kernel template, rendered for every mask template alone and for some combinations, is
    Python that compiles; its header names the variant."""
    for spec in SPECS:
        mask = masks_.parse_spec(spec, partial=True)
        source = launch.render_kernel(template, mask)
        compile(source, f"{template}: {spec}", "exec")
        assert f"# mask: {mask.variant if mask is not None else 'none'}\n" in source
        assert source.startswith(f"# Rendered by attngen from templates/kernels/{template}.py.jinja")
        for name in masks_.kernel_params(mask):
            assert name in source, (spec, name)


def _forward(q, k, v, mask):
    check_forward(q, k, v, mask)


def _topk(q, k, v, mask):
    check_forward(q, k, v, mask, topk=5)


def _backward(q, k, v, mask):
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attngen.attention(q, k, v, mask=mask)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attngen.reference.attention(q64, k64, v64, mask=mask)
    for got, want in zip(grads, torch.autograd.grad(ref, (q64, k64, v64), dout.double())):
        assert not torch.isnan(got).any() and rel_error(got, want) <= 2 * TOLERANCE[q.dtype]  # sums over tiles


def _decode(q, k, v, mask):
    lens = torch.tensor([k.shape[2] - 7], dtype=torch.int32, device=k.device)  # a cache not full
    out = attngen.decode(q, k, v, lens, mask=mask)
    ref = attngen.reference.decode(q, k, v, lens, mask=mask)
    assert not torch.isnan(out).any() and rel_error(out, ref) <= TOLERANCE[q.dtype]


RUNS = {"forward": _forward, "topk": _topk, "backward": _backward, "decode": _decode}  # a call that runs each kernel template


@pytest.mark.parametrize("template", launch.kernel_templates())
def test_every_kernel_template_runs(template):
    """Code that is never run rots: every kernel template has a call that runs it (the families'
    own tests run each in depth), here once on a ragged shape against the float64 reference."""
    assert template in RUNS, f"no test runs templates/kernels/{template}.py.jinja: add one to RUNS"
    q, k, v = rand_qkv(1, 2, 1, 37 if template != "decode" else 3, 45, 16, torch.float32)
    RUNS[template](q, k, v, attngen.mask("causal") & attngen.mask("softcap", cap=4.0))


def test_modules_are_rendered_once_per_variant():
    a = launch.module_for("forward", attngen.mask("sliding_window", window=8))
    assert launch.module_for("forward", attngen.mask("sliding_window", window=300)) is a  # a run-time scalar
    assert launch.module_for("forward", attngen.mask("sliding_window", window=8, two_sided=True)) is not a
    assert launch.module_for("topk", attngen.mask("sliding_window", window=8)) is not a
    assert hasattr(a, "attention_fwd") and hasattr(launch.module_for("topk", None), "topk_bracket")


def _a_forward_launch(q, k, v, out, lse):
    shape = check_qkv(q, k, v, kernel=True)
    config = KernelConfig(16, 16, 4, 1)
    bound, structure = forward.blocks(q, None, shape, config)
    return forward.forward_launch(q, k, v, out, lse, None, bound, structure, shape, 0.25, config, False)


def test_a_launch_checks_its_arguments_by_name():
    q, k, v = rand_qkv(1, 1, 1, 20, 30, 16, torch.float32)
    good = _a_forward_launch(q, k, v, *poisoned_like(q))
    assert good.names == [n for n in good.kernel.arg_names if n not in good.options]
    args = dict(zip(good.names, good.values))
    with pytest.raises(TypeError, match=r"launch of attention_fwd: missing arguments \['Q', 'stride_kd'\], "
                                        r"unknown arguments \[\]"):
        launch.Launch(good.kernel, good.grid, {n: a for n, a in args.items() if n not in ("Q", "stride_kd")},
                      good.options)
    with pytest.raises(TypeError, match=r"missing arguments \[\], unknown arguments \['stride_qx'\]"):
        launch.Launch(good.kernel, good.grid, dict(args, stride_qx=1), good.options)
    with pytest.raises(TypeError, match=r"missing arguments \['BLOCK_M'\]"):  # a constexpr left out of the options
        launch.Launch(good.kernel, good.grid, args, {n: o for n, o in good.options.items() if n != "BLOCK_M"})


def test_a_launch_replaces_what_changes_per_call():
    """A prepared launch runs with the tensors of a call: the new output is written, the one it was
    built with is not touched."""
    q, k, v = rand_qkv(1, 2, 2, 20, 30, 16, torch.float32)
    built_out, built_lse = poisoned_like(q)
    prepared = _a_forward_launch(q, k, v, built_out, built_lse)
    q2, k2, v2 = rand_qkv(1, 2, 2, 20, 30, 16, torch.float32)
    out, lse = poisoned_like(q)
    prepared(Q=q2, K=k2, V=v2, O=out, LSE=lse)
    ref, ref_lse = attngen.reference.attention(q2, k2, v2, scale=0.25, return_lse=True)
    assert_close(out, ref, torch.float32, lse, ref_lse)
    assert torch.isnan(built_out).all() and torch.isnan(built_lse).all()
    out3, lse3 = poisoned_like(q)
    prepared.runner("Q", "O", "LSE")(q, out3, lse3)
    assert_close(out3, attngen.reference.attention(q, k, v, scale=0.25), torch.float32)


def test_tensor_arguments_are_named_by_their_dims():
    q = torch.empty(2, 3, 5, 8, device=DEVICE)
    assert launch.tensor_args("q", q, "bhmd") == dict(Q=q, stride_qb=120, stride_qh=40, stride_qm=8, stride_qd=1)
    assert launch.strides3(torch.empty(1, 3, 4, 2)) == [0, 8, 2]  # a dim of size 1 is shared: stride 0


def test_tma_eligibility_and_alignment():
    t = torch.randn(1, 2, 64, 32, device=DEVICE)
    assert launch.tma_eligible(t) and launch.aligned(t)
    assert not launch.tma_eligible(t[..., 1:])  # a 4-byte offset base and a 31-wide row
    assert not launch.aligned(t.view(-1)[1:])
    assert not launch.tma_eligible(t.transpose(-1, -2))  # no unit last stride
    assert launch.dot_precision(torch.float16) == "tf32"
    if DEVICE == "cpu":
        assert launch.dot_precision(torch.float32) == "ieee"  # the interpreter's matmul is exact fp32


def test_tensor_descriptors_get_an_allocator_in_every_thread():
    """Triton keeps its allocator per thread (ContextVar); the tuner times configs from worker threads."""
    from triton.runtime import _allocation

    seen = []

    def work():
        before = _allocation._allocator.get() is _allocation._NULL_ALLOCATOR
        launch.ensure_allocator()
        seen.append((before, _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR))

    for _ in range(2):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert seen == [(True, True), (True, True)]
