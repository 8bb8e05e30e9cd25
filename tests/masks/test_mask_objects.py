"""Mask objects: terms with values, combined with & and |, their keys, and the spec text."""

import pytest
import torch

import attngen
from attngen import masks as masks_
from helpers import DEVICE, assert_close, check_forward, rand_qkv


def test_mask_objects_combine():
    a = attngen.mask("causal") & attngen.mask("sliding_window", window=4)
    assert a.variant == "causal(align='top_left') & sliding_window(two_sided=False, align='top_left')"
    b = (a | attngen.mask("prefix_lm", prefix=2)) & attngen.mask("softcap", cap=1.0)
    assert "| prefix_lm" in b.variant and b.variant.endswith("& softcap")
    with pytest.raises(TypeError, match="combine with masks by &"):
        attngen.mask("causal") | attngen.mask("softcap", cap=1.0)
    # two terms of one template with different values are kept apart in the kernel
    c = attngen.mask("sliding_window", window=3) | attngen.mask("sliding_window", window=9, two_sided=True)
    q, k, v = rand_qkv(1, 1, 1, 40, 45, 16, torch.float32)
    check_forward(q, k, v, c)
    assert masks_.parse_spec("sliding_window(window=3) | sliding_window(window=9, two_sided=True)").key == c.key


def test_keys_separate_kernels_from_launches():
    """`key`: what the kernel is specialised for (static parameters); `call_key`: plus the run-time
    scalars; a mask with tensor parameters says so (the dispatcher's fast path cannot key it)."""
    w8, w9 = attngen.mask("sliding_window", window=8), attngen.mask("sliding_window", window=9)
    assert w8.key == w9.key and w8.call_key != w9.call_key
    assert attngen.mask("sliding_window", window=8, two_sided=True).key != w8.key
    assert not w8.has_tensors
    ids = torch.zeros(1, 16, dtype=torch.int64, device=DEVICE)
    assert (attngen.mask("document", doc_ids=ids) & w8).has_tensors
    assert repr(attngen.mask("document", doc_ids=ids)) == "attngen.Mask(document(doc_ids='<tensor>'))"


def test_parse_spec():
    m = masks_.parse_spec("causal & sliding_window(window=256) & softcap(cap=30.0)")
    assert [t.template.name for t in m.terms()] == ["causal", "sliding_window", "softcap"]
    assert m.terms()[1].values["window"] == 256 and m.mods[0].values["cap"] == 30.0
    assert masks_.parse_spec("none") is None and masks_.parse_spec("  ") is None
    partial = masks_.parse_spec("sliding_window", partial=True)  # run-time parameters may be left out to render
    assert "window" not in partial.terms()[0].values
    for text, message in [("causal &", "is not valid"), ("causal(align=x)", "parameter 'align' of causal must be a literal"),
                          ("causal[0]", "expected a template name, or name"), ("nope", "unknown mask 'nope'")]:
        with pytest.raises(ValueError, match=message):
            masks_.parse_spec(text)
    with pytest.raises(TypeError, match="missing parameter 'window'"):
        masks_.parse_spec("sliding_window")


def test_a_name_is_one_mask_until_the_templates_change(tmp_path):
    first = masks_.as_mask("causal")
    assert masks_.as_mask("causal") is first and masks_.as_mask(first) is first and masks_.as_mask(None) is None
    (tmp_path / "other.yaml").write_text("expr: kv_idx < 3\n")
    attngen.register_template_dir(tmp_path)  # the templates are read again: names are looked up again
    again = masks_.as_mask("causal")
    assert again is not first and again.key == first.key
    with pytest.raises(TypeError, match="mask must be None, a mask spec .* or an attngen mask object"):
        masks_.as_mask(1.5)


SPECS = ["sliding_window(window=8)", "sliding_window(window=8) & softcap(cap=20.0)",
         "causal(align='bottom_right') | prefix_lm(prefix=3)", "causal"]


@pytest.mark.parametrize("spec", SPECS)
def test_attention_takes_the_command_lines_mask_specs(spec):
    """The Python API reads the same spec text as the command line; a spec is parsed once."""
    first = masks_.as_mask(spec)
    assert masks_.as_mask(spec) is first and first.call_key == masks_.parse_spec(spec).call_key
    q, k, v = rand_qkv(1, 2, 1, 20, 30, 16, torch.float32)
    out = attngen.attention(q, k, v, mask=spec)
    assert torch.equal(attngen.attention(q, k, v, mask=spec), out)  # the prepared plan: the same result
    assert torch.equal(attngen.attention(q, k, v, mask=masks_.parse_spec(spec)), out)
    assert_close(out, attngen.reference.attention(q, k, v, mask=spec), torch.float32)
    assert masks_.as_mask("none") is None


def test_everything_or_anything_is_everything():
    none = masks_.Mask()
    assert (none | attngen.mask("causal")).tree is None
    assert (none & attngen.mask("causal")).variant == "causal(align='top_left')"
