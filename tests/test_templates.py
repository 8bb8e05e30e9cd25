"""Mask templates: custom folders, tensor parameters, the expression language, errors, the cache, the CLI."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attngen
from attngen import masks as masks_
from attngen import render as render_
from attngen.kernels.forward import attention_forward, render_source
from conftest import DEVICE, assert_close, poisoned_like, rand_qkv

DILATED = """\
doc: |
  Dilated causal attention: a query sees every `dilation`-th key before it.
params:
  dilation: {type: int, min: 1, doc: distance between visible keys}
expr: "(kv_idx <= q_idx) & ((q_idx - kv_idx) % dilation == 0)"
"""

KEY_PADDING = """\
doc: Key padding from a per-batch validity tensor (nonzero = real token).
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


def check(q, k, v, mask):
    out, lse = poisoned_like(q)
    config = attngen.dispatch.choose(q, k, v, mask).config
    attention_forward(q, k, v, mask, return_lse=True, config=config, out=out, lse=lse)
    ref, ref_lse = attngen.reference.attention(q, k, v, mask, return_lse=True)
    assert_close(out, ref, q.dtype, lse, ref_lse)


def test_custom_template_end_to_end(tmp_path):
    folder = write(tmp_path / "mine", "dilated", DILATED)
    write(folder, "key_padding", KEY_PADDING)
    write(folder, "signed", SIGNED)
    attngen.register_template_dir(folder)
    q, k, v = rand_qkv(2, 2, 2, 90, 120, 32, torch.float16)
    check(q, k, v, attngen.mask("dilated", dilation=3))
    keep = (torch.rand(2, 120) > 0.3).to(torch.int32).to(DEVICE)
    check(q, k, v, attngen.mask("key_padding", keep=keep) & attngen.mask("causal", align="bottom_right"))
    check(q, k, v, attngen.mask("signed", period=5))
    check(q, k, v, attngen.mask("signed", period=-7, flip=True) | attngen.mask("dilated", dilation=2))
    # a dilation of 3 hides two keys in three: the reference agrees with a hand count
    w = attngen.reference.attention(torch.zeros(1, 1, 7, 16), torch.zeros(1, 1, 7, 16),
                                    torch.eye(7, 16).view(1, 1, 7, 16), attngen.mask("dilated", dilation=3))
    assert torch.allclose(w[0, 0, 6, :7], torch.tensor([1 / 3, 0, 0, 1 / 3, 0, 0, 1 / 3], dtype=torch.float64))


def test_template_path_env_and_cli(tmp_path):
    folder = write(tmp_path / "env", "dilated", DILATED)
    env = dict(os.environ, ATTNGEN_TEMPLATE_PATH=str(folder), ATTNGEN_CACHE_DIR=str(tmp_path / "cache"))
    listing = subprocess.run([sys.executable, "-m", "attngen", "masks"], env=env, capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    assert "dilated (mask)" in listing.stdout and "param dilation: int >= 1" in listing.stdout
    env.pop("ATTNGEN_TEMPLATE_PATH")
    rendered = subprocess.run([sys.executable, "-m", "attngen", "--template-dir", str(folder), "render",
                               "--mask", "dilated & softcap(cap=2.0)"], env=env, capture_output=True, text=True)
    assert rendered.returncode == 0, rendered.stderr
    assert "% t0_dilation" in rendered.stdout and "_tanh" in rendered.stdout
    missing = subprocess.run([sys.executable, "-m", "attngen", "render", "--mask", "dilated"], env=env,
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "unknown mask 'dilated'" in missing.stderr


def test_rendered_source_is_cached_and_reused_across_processes(tmp_path):
    env = dict(os.environ, ATTNGEN_CACHE_DIR=str(tmp_path), TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "0"))
    script = textwrap.dedent(f"""
        import torch, attngen
        q = torch.randn(1, 1, 20, 16, device="{DEVICE}")
        attngen.attention(q, q, q, mask="causal")
    """)
    for _ in range(2):
        subprocess.run([sys.executable, "-c", script], env=env, check=True)
        files = list((tmp_path / "kernels").glob("*.py"))
        assert len(files) == 1
        if _ == 0:
            first = (files[0], files[0].stat().st_mtime_ns)
    assert (files[0], files[0].stat().st_mtime_ns) == first  # the second process reused the file
    printed = subprocess.run([sys.executable, "-m", "attngen", "render", "--mask", "causal"], env=env,
                             capture_output=True, text=True, check=True)
    assert printed.stdout == files[0].read_text()  # `attngen render` shows exactly what ran
    assert str(files[0]) in printed.stderr


def test_every_builtin_template_renders():
    builtin = masks_.template_dirs()[0]
    assert len(list(builtin.glob("*.yaml"))) == 8
    for name, template in masks_.templates().items():
        source = render_source(masks_.parse_spec(name, partial=True))
        compile(source, name, "exec")
        assert template.doc, f"{name} has no doc"


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


def test_kernel_template_errors_name_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "bad.py.jinja").write_text("line one\n{{ value }}\n{% for x in %}\n")
    (tmp_path / "undef.py.jinja").write_text("ok\nok\n{{ nothing_here }}\n")
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(tmp_path)), undefined=jinja2.StrictUndefined)
    monkeypatch.setattr(render_, "_ENV", env)
    with pytest.raises(attngen.TemplateError, match=r"bad.py.jinja:3: TemplateSyntaxError"):
        render_.render("bad.py.jinja", value=1)
    with pytest.raises(attngen.TemplateError, match=r"undef.py.jinja:3: UndefinedError"):
        render_.render("undef.py.jinja")


def test_duplicate_template_names(tmp_path):
    folder = write(tmp_path / "dup", "causal", "expr: kv_idx <= q_idx\n")
    attngen.register_template_dir(folder)
    with pytest.raises(attngen.TemplateError, match="'causal' is defined twice"):
        attngen.mask("causal")


def test_mask_objects_combine():
    a = attngen.mask("causal") & attngen.mask("sliding_window", window=4)
    assert a.variant == "causal(align='top_left') & sliding_window(two_sided=False, align='top_left')"
    b = (a | attngen.mask("prefix_lm", prefix=2)) & attngen.mask("softcap", cap=1.0)
    assert "| prefix_lm" in b.variant and b.variant.endswith("& softcap")
    with pytest.raises(TypeError, match="combine with masks by &"):
        attngen.mask("causal") | attngen.mask("softcap", cap=1.0)
    # two terms of one template with different values are kept apart in the kernel
    c = attngen.mask("sliding_window", window=3) | attngen.mask("sliding_window", window=9, two_sided=True)
    q, k, v = rand_qkv(1, 1, 1, 40, 40, 16, torch.float32)
    check(q, k, v, c)
    assert masks_.parse_spec("sliding_window(window=3) | sliding_window(window=9, two_sided=True)").key == c.key
