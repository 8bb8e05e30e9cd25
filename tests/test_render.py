"""Rendering: kernel template errors name the file and line."""

import jinja2
import pytest

import attngen
from attngen import render as render_


def test_kernel_template_errors_name_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "bad.py.jinja").write_text("line one\n{{ value }}\n{% for x in %}\n")
    (tmp_path / "undef.py.jinja").write_text("ok\nok\n{{ nothing_here }}\n")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(tmp_path)), undefined=jinja2.StrictUndefined)
    monkeypatch.setattr(render_, "_ENV", env)  # templates from tmp_path instead of attngen's
    with pytest.raises(attngen.TemplateError, match=r"bad.py.jinja:3: TemplateSyntaxError"):
        render_.render("bad.py.jinja", value=1)
    with pytest.raises(attngen.TemplateError, match=r"undef.py.jinja:3: UndefinedError"):
        render_.render("undef.py.jinja")
    assert render_.render("undef.py.jinja", nothing_here="x") == "ok\nok\nx"


def test_sources_are_cached_by_content_and_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    a, b = render_.source_path("x = 1\n"), render_.source_path("x = 2\n")
    assert a != b and a.parent == b.parent == tmp_path / "kernels" and a == render_.source_path("x = 1\n")
    module = render_.load_module("VALUE = 41 + 1\n")
    assert module.VALUE == 42 and a.parent.joinpath(render_.source_path("VALUE = 41 + 1\n").name).read_text() == \
        "VALUE = 41 + 1\n"
    assert render_.load_module("VALUE = 41 + 1\n") is module
