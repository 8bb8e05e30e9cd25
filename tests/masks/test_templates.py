"""Mask templates: custom folders, tensor parameters, the expression language, errors, duplicates."""


import pytest
import torch

import attngen
from attngen.masks import template_files as templates_
from helpers import DILATED, DEVICE, check_forward, rand_qkv



VALID_KEYS = """\
doc: Key padding from a per-batch validity tensor of ints (nonzero = real token).
params:
  keep: {type: tensor, shape: [batch, kv_len], dtype: int}
expr: "keep[b, kv_idx] != 0"
"""

# negative operands: // and % truncate toward zero in the kernel and in the reference alike
SIGNED = """\
params:
  period: {type: int}
  flip: {type: bool, default: false}
expr: "{% if flip %}~{% endif %}((kv_idx - q_idx) // period % 2 == 0)"
"""


def write(folder, name, text):
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(text)
    return folder


def test_custom_template_end_to_end(tmp_path):
    folder = write(tmp_path / "mine", "dilated", DILATED)
    write(folder, "valid_keys", VALID_KEYS)
    write(folder, "signed", SIGNED)
    attngen.register_template_dir(folder)
    q, k, v = rand_qkv(2, 2, 2, 90, 120, 32, torch.float16)
    check_forward(q, k, v, attngen.mask("dilated", dilation=3))
    keep = (torch.rand(2, 120) > 0.3).to(torch.int32).to(DEVICE)
    check_forward(q, k, v, attngen.mask("valid_keys", keep=keep) & attngen.mask("causal", align="bottom_right"))
    check_forward(q, k, v, attngen.mask("signed", period=5))
    check_forward(q, k, v, attngen.mask("signed", period=-7, flip=True) | attngen.mask("dilated", dilation=2))
    # a dilation of 3 hides two keys in three: the reference agrees with a hand count
    w = attngen.reference.attention(torch.zeros(1, 1, 7, 16), torch.zeros(1, 1, 7, 16),
                                    torch.eye(7, 16).view(1, 1, 7, 16), attngen.mask("dilated", dilation=3))
    assert torch.allclose(w[0, 0, 6, :7], torch.tensor([1 / 3, 0, 0, 1 / 3, 0, 0, 1 / 3], dtype=torch.float64))


def test_registered_folders_are_listed_and_restored(tmp_path):
    folder = write(tmp_path / "mine", "dilated", DILATED)
    before = templates_.registered_dirs()
    generation = templates_.generation()
    attngen.register_template_dir(folder)
    assert templates_.registered_dirs() == before + [folder.resolve()]
    assert templates_.template_dirs()[-1] == folder.resolve()
    assert "dilated" in attngen.templates() and templates_.generation() > generation
    templates_.set_registered_dirs(before)
    assert "dilated" not in attngen.templates()
    with pytest.raises(ValueError, match="unknown mask 'dilated'"):
        attngen.mask("dilated", dilation=2)


def test_every_builtin_template_has_a_doc_and_loads():
    builtin = templates_.template_dirs()[0]
    assert sorted(p.stem for p in builtin.glob("*.yaml")) == sorted(attngen.templates())
    assert len(attngen.templates()) == 13
    for name, template in attngen.templates().items():
        assert template.doc, f"{name} has no doc"
        assert templates_.load_template(template.path).expr_text == template.expr_text
        assert templates_.get_template(name) is template


@pytest.mark.parametrize("text,message", [
    ("expr: 'kv_idx <= q_idx +'", "syntax error"),
    ("expr: 'kv_idx <= nonsense'", "unknown name 'nonsense'"),
    ("expr: 'open(q_idx)'", "unknown function 'open'"),
    ("expr: 'q_idx.real'", "Attribute is not allowed"),
    ("params:\n  t: {type: tensor, shape: [kv_len], dtype: int}\nexpr: 't == 1'", "must be indexed"),
    ("params:\n  t: {type: tensor, shape: [kv_len], dtype: int}\nexpr: 't[q_idx, kv_idx] == 1'",
     "has 1 dimension"),
])
def test_expression_errors_name_file_and_line(tmp_path, text, message):
    folder = write(tmp_path / "bad", "broken", "doc: broken\n" + text + "\n")
    attngen.register_template_dir(folder)
    with pytest.raises(attngen.TemplateError, match=message) as info:
        attngen.mask("broken", **({} if "tensor" not in text else {"t": torch.zeros(3, dtype=torch.int32)})).terms()[0].expr
    assert f"broken.yaml:{text.count(chr(10)) + 2}" in str(info.value)


@pytest.mark.parametrize("text,message", [
    ("expr: 'kv_idx <= {% if x %}q_idx'", r"broken.yaml:2: TemplateSyntaxError"),
    ("expr: 'kv_idx <= {{ undefined_thing }}'", r"broken.yaml:2: UndefinedError: 'undefined_thing' is undefined"),
    ("params: {w: {type: int, default: 1.5}}\nexpr: 'kv_idx < w'", "bad default"),
    ("params: {w: {type: nope}}\nexpr: 'kv_idx < w'", "needs a type"),
    ("kind: other\nexpr: 'True'", "kind must be mask or score"),
    ("expr: [1, 2\n", "not valid YAML"),
])
def test_template_file_errors(tmp_path, text, message):
    folder = write(tmp_path / "bad", "broken", "doc: broken\n" + text + "\n")
    attngen.register_template_dir(folder)
    with pytest.raises(attngen.TemplateError, match=message):
        attngen.mask("broken").terms()[0].expr


def test_duplicate_template_names(tmp_path):
    folder = write(tmp_path / "dup", "causal", "expr: kv_idx <= q_idx\n")
    attngen.register_template_dir(folder)
    with pytest.raises(attngen.TemplateError, match="'causal' is defined twice"):
        attngen.mask("causal")


BOUNDED = """\
doc: A temperature on the score, bounded on both sides.
kind: score
params:
  t: {type: float, min: 0.5, max: 2, doc: the temperature}
  n: {type: int, max: 3, default: 1}
expr: "score * t * n"
"""


def test_float_and_int_parameters_keep_to_their_bounds(tmp_path):
    attngen.register_template_dir(write(tmp_path / "mine", "bounded", BOUNDED))
    params = attngen.templates()["bounded"].params
    assert params["t"].describe() == "t: float in [0.5, 2]" and params["n"].describe() == "n: int <= 3, default 1"
    assert attngen.mask("bounded", t=0.5).mods[0].values["t"] == 0.5  # bounds are inclusive
    assert attngen.mask("bounded", t=2, n=3).mods[0].values == {"t": 2.0, "n": 3}
    for value in (0.49, 2.01, float("inf"), float("-inf")):
        with pytest.raises(ValueError, match="mask 'bounded' parameter 't' must be "):
            attngen.mask("bounded", t=value)
    with pytest.raises(ValueError, match=r"parameter 't' must be a finite number, got nan"):
        attngen.mask("bounded", t=float("nan"))
    with pytest.raises(ValueError, match=r"parameter 't' must be in \[0.5, 2\], got 2.5"):
        attngen.mask("bounded", t=2.5)
    with pytest.raises(ValueError, match=r"parameter 'n' must be <= 3, got 4"):
        attngen.mask("bounded", t=1.0, n=4)


@pytest.mark.parametrize("spec,message", [
    ("{type: float, min: abc}", "`min` is a finite number, for int and float parameters only"),
    ("{type: float, max: .nan}", "`max` is a finite number"),
    ("{type: bool, min: 0}", "for int and float parameters only"),
    ("{type: float, min: 2, max: 1}", "min 2 is over max 1"),
    ("{type: float, min: 1, default: 0.5}", r"bad default: .* must be >= 1, got 0.5"),
    ("{type: float, default: .inf}", "bad default: .* must be a finite number, got inf"),
])
def test_bad_bounds_are_template_errors(tmp_path, spec, message):
    attngen.register_template_dir(write(tmp_path / "bad", "broken", f"params:\n  x: {spec}\nexpr: 'kv_idx < x'\n"))
    with pytest.raises(attngen.TemplateError, match=message):
        attngen.templates()
