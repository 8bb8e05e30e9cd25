"""`attngen render` and `attngen masks`: the exact kernel source a call runs, the kernel cache, and
the templates attngen can see (custom folders included)."""

import os
import subprocess
import sys
import textwrap

import pytest

from attngen import cli
from attngen import masks as masks_
from attngen.kernels.launch import kernel_templates, render_kernel
from attngen.render import source_path
from attngen.masks import template_files as templates_
from attngen.paths import data_dir
from helpers import DILATED, DEVICE, attngen_cmd, cli_env




def render(capsys, *args):
    code = cli.main(["render", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("template,kernels", [("forward", ["attention_fwd"]),
                                              ("topk", ["topk_bracket", "topk_capture", "topk_select",
                                                        "topk_threshold"])])
def test_render_prints_the_kernel_template(capsys, template, kernels):
    spec = "causal & softcap(cap=2.0)"
    code, out, err = render(capsys, "--mask", spec, *(["--template", template] if template != "forward" else []))
    assert code == 0
    assert out == render_kernel(template, masks_.parse_spec(spec))
    assert out.startswith(f"# Rendered by attngen from templates/kernels/{template}.py.jinja")
    assert "# mask: causal(align='top_left') & softcap\n" in out and "_tanh" in out
    for kernel in kernels:
        assert f"\ndef {kernel}(" in out
    assert err == f"# cached as {source_path(out)}\n"


def test_render_refuses_an_unknown_template(capsys):
    code, out, err = render(capsys, "--template", "fwd")
    assert code == 2 and out == ""
    assert f"attngen render: error: --template must be one of {', '.join(kernel_templates())}, got 'fwd'" in err


def test_template_folders_from_the_option_and_the_environment(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "env"
    folder.mkdir()
    (folder / "dilated.yaml").write_text(DILATED)
    code, out, err = render(capsys, "--mask", "dilated")
    assert code == 2 and "unknown mask 'dilated'" in err
    registered = templates_.registered_dirs()
    assert cli.main(["--template-dir", str(folder), "render", "--mask", "dilated & softcap(cap=2.0)"]) == 0
    out = capsys.readouterr().out
    assert "% t0_dilation" in out and "_tanh" in out
    templates_.set_registered_dirs(registered)
    monkeypatch.setenv("ATTNGEN_TEMPLATE_PATH", str(folder))
    assert cli.main(["masks"]) == 0
    listing = capsys.readouterr().out
    assert f"dilated (mask) - {folder / 'dilated.yaml'}" in listing and "param dilation: int >= 1" in listing
    assert "causal (mask)" in listing and "softcap (score)" in listing and "param cap: float >= 0.001" in listing


def test_rendered_source_is_cached_and_reused_across_processes(tmp_path):
    env = cli_env(tmp_path, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "0"))
    script = textwrap.dedent(f"""
        import torch, attngen
        q = torch.randn(1, 1, 20, 16, device="{DEVICE}")
        attngen.attention(q, q, q, mask="causal")
    """)
    kernels = tmp_path / "cache" / "kernels"
    for run in range(2):
        subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=tmp_path)
        files = list(kernels.glob("*.py"))
        assert len(files) == 1
        if run == 0:
            first = (files[0], files[0].stat().st_mtime_ns)
    assert (files[0], files[0].stat().st_mtime_ns) == first  # the second process reused the file
    printed = subprocess.run(attngen_cmd("render", "--mask", "causal"), env=env, capture_output=True, text=True,
                             check=True, cwd=tmp_path)
    assert printed.stdout == files[0].read_text()  # `attngen render` shows exactly what ran
    assert str(files[0]) in printed.stderr


BROKEN_NAME = "doc: a typo in the expression\nexpr: 'kv_idx <= q_index'\n"
# broken only for one value of its static parameter: the check renders every value
BROKEN_WHEN_FLIPPED = """\
doc: broken when flip is true
params:
  flip: {type: bool, default: false}
expr: "{% if flip %}kv_idx < nowhere{% else %}kv_idx <= q_idx{% endif %}"
"""


def test_masks_lists_a_broken_template_as_broken_and_check_fails(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "dilated.yaml").write_text(DILATED)
    (folder / "typo.yaml").write_text(BROKEN_NAME)
    (folder / "flipped.yaml").write_text(BROKEN_WHEN_FLIPPED)
    (folder / "notyaml.yaml").write_text("expr: [1, 2\n")
    registered = templates_.registered_dirs()
    assert cli.main(["--template-dir", str(folder), "masks"]) == 0  # the listing itself works
    out, err = capsys.readouterr()
    assert f"dilated (mask) - {folder / 'dilated.yaml'}" in out and "causal (mask)" in out
    assert f"typo (BROKEN)\n    error: {folder / 'typo.yaml'}:2: unknown name 'q_index'" in out
    assert f"flipped (BROKEN)\n    error: {folder / 'flipped.yaml'}:4: unknown name 'nowhere'" in out
    assert "(with flip=True)" in out and "notyaml (BROKEN)\n    error: " in out and "not valid YAML" in out
    total = len(list((data_dir("templates") / "masks").glob("*.yaml"))) + 4  # the built-in ones and these four
    assert f"3 of {total} templates are broken: flipped, notyaml, typo" in err
    assert cli.main(["--template-dir", str(folder), "masks", "--check"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]  # one per template
    assert len(lines) == total and f"ok dilated - {folder / 'dilated.yaml'}" in lines
    assert [line.split(":")[0] for line in lines if line.startswith("BROKEN")] == [
        "BROKEN flipped", "BROKEN notyaml", "BROKEN typo"]
    templates_.set_registered_dirs(registered)
    assert cli.main(["masks", "--check"]) == 0  # the built-in templates are all sound
    assert "BROKEN" not in capsys.readouterr().out


def test_masks_check_reports_a_name_defined_twice(tmp_path, capsys):
    folder = tmp_path / "dup"
    folder.mkdir()
    (folder / "causal.yaml").write_text("expr: kv_idx <= q_idx\n")
    assert cli.main(["--template-dir", str(folder), "masks", "--check"]) == 1
    out = capsys.readouterr().out
    assert f"BROKEN causal: template 'causal' is defined twice: {templates_.template_dirs()[0] / 'causal.yaml'} and " \
           f"{folder / 'causal.yaml'}" in out
