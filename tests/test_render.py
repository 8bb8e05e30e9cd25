"""Rendering: kernel template errors name the file and line; the kernel cache is written
atomically, by racing processes too, and what runs never depends on the file afterwards."""

import inspect
import subprocess
import sys
import textwrap
import time

import jinja2
import pytest
import torch

import attngen
from attngen import render as render_
from helpers import DEVICE, cli_env


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


def test_a_cached_file_that_is_not_the_source_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef fill(X, VALUE: tl.constexpr):\n"
              "    tl.store(X + tl.arange(0, 16), VALUE)\n")
    path = render_.source_path(source)
    path.parent.mkdir(parents=True)
    path.write_text(source[:30])  # cut short (a full disk, a writer that died)
    module = render_.load_module(source)
    assert path.read_text() == source
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    path.write_text("garbage")  # what happens to the file later changes nothing that runs
    x = torch.zeros(16, device=DEVICE)
    module.fill[(1,)](x, VALUE=7)  # Triton reads the kernel's source (the interpreter at its first launch)
    assert (x == 7).all() and "tl.store(X" in inspect.getsource(module.fill.fn)


# A child process: wait for the start file, then render the forward kernel of a mask variant that the
# fresh cache does not have and run it, then write and import 20 sources of 1 MB, reading each one's
# cached file first (another process may be writing it): every read finds nothing or the whole source.
RACER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    import attngen
    from attngen import render
    go = Path(sys.argv[1])
    (go.parent / f"ready-{os.getpid()}").touch()
    while not go.exists():
        time.sleep(0.001)
    q = torch.randn(1, 1, 5, 16)
    out = attngen.attention(q, q, q, mask=attngen.mask("sliding_window", window=2))
    ref = attngen.reference.attention(q, q, q, mask=attngen.mask("sliding_window", window=2))
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6), float((out.double() - ref).abs().max())
    for i in range(20):
        source = f"N = {i}\\n" + f"# filler line {i}: {'x' * 100}\\n" * 8000
        path = render.source_path(source)
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = None
        assert text in (None, source), f"source {i}: read {len(text)} of {len(source)} characters"
        assert render.load_module(source).N == i
    print("ok")
""")


def test_processes_racing_to_write_the_kernel_cache(tmp_path):
    env = cli_env(tmp_path, TRITON_INTERPRET="1")
    go = tmp_path / "go"
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(go)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(4)]
    deadline = time.monotonic() + 300
    while len(list(tmp_path.glob("ready-*"))) < len(racers) and time.monotonic() < deadline:
        time.sleep(0.01)  # every racer has imported torch and attngen: start them at once
    go.touch()
    results = [racer.communicate(timeout=300) for racer in racers]
    assert [(racer.returncode, out.strip()) for racer, (out, _) in zip(racers, results)] == [(0, "ok")] * 4, \
        [err[-2000:] for _, err in results]
    kernels = tmp_path / "cache" / "kernels"
    files = sorted(kernels.iterdir())
    assert [f for f in files if f.suffix != ".py"] == []  # no temporary file left behind
    assert len(files) == 21  # the forward kernel of the variant and the 20 sources, each once
    for f in files:
        compile(f.read_text(), str(f), "exec")  # whole: every file is valid Python
