"""Kernel families: each record's templates, search spaces, fallback configs, run, reference and
FLOP count resolve, and its run agrees with its reference."""

import pytest
import torch

import attngen
from attngen.config import DEFAULTS, KernelConfig, arch_of
from attngen.families import FAMILIES, FORWARD, family, query_rows
from attngen.kernels.launch import kernel_templates
from attngen.masks import as_mask
from attngen.tools.timing import attention_flops
from attngen.tuning.space import find_space
from helpers import DEVICE, TOLERANCE, rand_qkv, rel_error

ARCHS = ("sm90", "sm80", "generic", "interpreter")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_record_resolves(name):
    f = FAMILIES[name]
    assert f.name == name and family(name) is f and f.doc
    assert set(f.templates) <= set(kernel_templates())  # templates/kernels/<name>.py.jinja
    for space in (f.space, f.topk_space):
        assert find_space(space, name).kernel == name
    assert set(DEFAULTS[name]) == set(ARCHS)
    for arch in ARCHS:
        for head_dim in (16, 64, 80, 128, 256):
            config, row = f.default(arch, head_dim)
            assert isinstance(config, KernelConfig) and not config.problems(head_dim, 2)
            assert row.startswith(f"default {name} config for {arch}, head dim <= ")
    assert set(f.inputs) | set(f.outputs) <= {"q", "kv"} and f.inputs[:3] == ("q", "kv", "kv")


def test_the_forward_family():
    assert FAMILIES["fwd"] is FORWARD and FORWARD.templates == ("forward", "topk")
    assert (FORWARD.space, FORWARD.topk_space) == ("forward", "forward_topk")
    assert FORWARD.flops is attention_flops
    assert FORWARD.fit(KernelConfig(128, 64, 4, 2), 5) == (KernelConfig(16, 64, 4, 2), "block_m cut to 16 for q_len 5")
    assert FORWARD.fit(KernelConfig(64, 64, 4, 2), 4096) == (KernelConfig(64, 64, 4, 2), "")



def test_the_forward_fallback_of_packed_sequences():
    """A varlen call's mask (its terms read the packing's per-query tensors) takes the fwd_varlen
    row: 64-row tiles on sm90 for D 65-128, where 128-row tiles convert the mask through shared
    memory; every other mask, and other head dims and architectures, the fwd rows."""
    from attngen.varlen import _localize, _positions
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    positions = _positions(cu, cu, 12)
    table = lambda mask: FORWARD.table(None, torch.device("cpu"), False, mask)  # noqa: E731
    for mask in ("causal", None, attngen.mask("sliding_window", window=4) & attngen.mask("causal")):
        assert table(_localize(mask, positions)) == "fwd_varlen"
    for mask in (None, as_mask("causal"), attngen.mask("document", doc_ids=torch.zeros(12, dtype=torch.int32))):
        assert table(mask) == "fwd"
    assert FORWARD.default("sm90", 128, "fwd_varlen")[0] == KernelConfig(64, 64, 4, 2, use_tma=True)
    assert FORWARD.default("sm90", 128, "fwd")[0] == KernelConfig(128, 64, 4, 2, use_tma=True)
    for arch, head_dim in (("sm90", 64), ("sm90", 256), ("sm80", 128), ("interpreter", 128)):
        assert FORWARD.default(arch, head_dim, "fwd_varlen")[0] == FORWARD.default(arch, head_dim, "fwd")[0]


def test_the_backward_fallback_of_dense_and_causal_calls():
    """Dense and causal calls (causal alone, either alignment, no score modifier) take the
    bwd_dense row: 128-key blocks on 8 warps on sm90 for D 65-128, where nearly every block is
    full; other masks, modifiers, head dims and architectures the bwd rows. Top-k calls run tiles
    of their own whatever the row."""
    from attngen.families import BACKWARD
    table = lambda mask: BACKWARD.table(None, torch.device("cpu"), False, mask)  # noqa: E731
    for mask in (None, as_mask("causal"), as_mask("causal(align='bottom_right')")):
        assert table(mask) == "bwd_dense"
    for mask in (as_mask("causal & softcap(cap=30.0)"), as_mask("sliding_window(window=512)"),
                 attngen.mask("document", doc_ids=torch.zeros(12, dtype=torch.int32)) & attngen.mask("causal")):
        assert table(mask) == "bwd"
    assert BACKWARD.default("sm90", 128, "bwd_dense")[0] == KernelConfig(64, 128, 8, 3)
    assert BACKWARD.default("sm90", 128, "bwd")[0] == KernelConfig(64, 64, 4, 2)
    for arch, head_dim in (("sm90", 64), ("sm90", 256), ("sm80", 128), ("interpreter", 128)):
        assert BACKWARD.default(arch, head_dim, "bwd_dense")[0] == BACKWARD.default(arch, head_dim, "bwd")[0]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_run_agrees_with_reference(name):
    """What the tuner's correctness gate compares: the family's run at its fallback config, against
    its reference, on a ragged GQA shape with a mask and a modifier."""
    f = FAMILIES[name]
    q, k, v = rand_qkv(1, 4, 2, 45, 45, 16, torch.float32)
    extra = [torch.randn_like(q if kind == "q" else k) for kind in f.inputs[3:]]
    mask = as_mask("causal") & attngen.mask("softcap", cap=3.0)
    config = f.default(arch_of(q.device), 16)[0]
    outs = f.run(q, k, v, *extra, mask, topk=None, config=config)
    refs = f.reference(q, k, v, *extra, mask, topk=None)
    assert len(outs) == len(refs) == len(f.outputs)
    for out, ref, kind in zip(outs, refs, f.outputs):
        assert out.shape == (q if kind == "q" else k).shape and ref.dtype == torch.float64
        assert not torch.isnan(out).any() and rel_error(out, ref) <= TOLERANCE[torch.float32]
    flops = f.flops(mask, 1, 4, 45, 45, 16, DEVICE)
    assert flops >= attention_flops(mask, 1, 4, 45, 45, 16, DEVICE) == 4 * 16 * 4 * (45 * 46 // 2)  # causal pairs


def test_unknown_family_is_a_clear_error():
    with pytest.raises(ValueError, match="--kernel must be one of fwd, bwd, decode, got 'fused'"):
        family("fused", "--kernel")


@pytest.mark.parametrize("q_len,rows", [(0, 16), (1, 16), (16, 16), (17, 32), (100, 128), (4096, 4096)])
def test_query_rows(q_len, rows):
    assert query_rows(q_len) == rows
