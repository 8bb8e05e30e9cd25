"""Render kernel templates and load the rendered source from a cache directory.

The Jinja environment over `templates/` turns a kernel template plus a context (the mask
expression, the kernel arguments it needs) into Python source. The source is written to
`<cache>/kernels/<hash>.py`, where the hash covers the source and the versions of attngen,
Triton and torch, and imported from there: every process that renders the same kernel reuses
the same file (and so Triton's own compile cache), and anyone can open exactly what ran.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import traceback
from pathlib import Path

import jinja2

from .paths import cache_dir, data_dir
from .version import __version__


class TemplateError(Exception):
    """A kernel or mask template that cannot be rendered; the message names file and line."""


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


_ENV: jinja2.Environment | None = None


def template_error(exc: Exception, default_file: str, line_offset: int = 0) -> TemplateError:
    """A TemplateError naming the template file and line that `exc` was raised at."""
    filename, lineno = default_file, None
    if isinstance(exc, jinja2.TemplateSyntaxError):
        filename = exc.filename or default_file
        lineno = exc.lineno
    else:  # runtime errors: Jinja rewrites the traceback so that template frames show up
        for frame in reversed(traceback.extract_tb(exc.__traceback__)):
            if frame.filename.endswith((".jinja", ".yaml", "<template>")):
                filename = default_file if frame.filename == "<template>" else frame.filename
                lineno = frame.lineno
                break
    where = f"{filename}:{lineno + line_offset}" if lineno is not None else filename
    message = getattr(exc, "message", None) or str(exc)
    return TemplateError(f"{where}: {type(exc).__name__}: {message}")


def render(template: str, **context) -> str:
    """Render `templates/<template>` with `context`."""
    global _ENV
    if _ENV is None:
        _ENV = _environment()
    try:
        return _ENV.get_template(template).render(**context)
    except jinja2.TemplateError as e:
        path = str(data_dir("templates") / template)
        raise template_error(e, path) from None


def render_string(text: str, filename: str, line_offset: int = 0, **context) -> str:
    """Render a template given as text (a mask's expression); errors name `filename`."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    try:
        return env.from_string(text).render(**context)
    except jinja2.TemplateError as e:
        raise template_error(e, filename, line_offset) from None


def _versions() -> str:
    import torch
    import triton

    return f"attngen {__version__}, triton {triton.__version__}, torch {torch.__version__}"


def source_path(source: str) -> Path:
    """Where `source` is (or will be) cached."""
    digest = hashlib.sha256((_versions() + "\n" + source).encode()).hexdigest()[:24]
    return cache_dir() / "kernels" / f"k{digest}.py"


_MODULES: dict[tuple[Path, bool], object] = {}


def load_module(source: str):
    """Write `source` to the kernel cache (once, atomically) and import it."""
    from .checks import interpreter_on

    path = source_path(source)
    key = (path, interpreter_on())  # triton.jit picks compiled or interpreted when the module runs
    module = _MODULES.get(key)
    if module is not None:
        return module
    if not path.exists() or path.read_text() != source:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    name = f"attngen_kernels.{path.stem}" + ("_interpreted" if key[1] else "")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton resolves globals through the module
    spec.loader.exec_module(module)
    _MODULES[key] = module
    return module
