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
import linecache
import os
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import jinja2

from .caches import BoundedCache
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


_MODULES = BoundedCache("render.modules", 1024)  # (path, interpreted) -> module
_LOAD_LOCK = threading.Lock()  # one import of a module per process, whatever the threads


def load_module(source: str):
    """Write `source` to the kernel cache (once, atomically) and import it.

    Processes that render the same kernel at once each write a temporary file of their own and
    rename it over the cached one (an atomic replace), so a reader only ever finds the whole
    source; a cached file that is not exactly `source` (cut short by a full disk, edited) is
    written again. The module runs `source` itself, and Python's line cache (where Triton reads a
    kernel's source) holds it, so what happens to the file later never changes what runs.
    """
    from .checks import interpreter_on

    path = source_path(source)
    key = (path, interpreter_on())  # triton.jit picks compiled or interpreted when the module runs
    module = _MODULES.get(key)
    if module is not None:
        return module
    with _LOAD_LOCK:
        module = _MODULES.get(key)
        if module is None:
            if not _holds(path, source):
                _write_atomic(path, source)
            name = f"attngen_kernels.{path.stem}" + ("_interpreted" if key[1] else "")
            module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
            sys.modules[name] = module  # Triton resolves globals through the module
            linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))  # never re-read
            exec(compile(source, str(path), "exec"), module.__dict__)
            _MODULES.put(key, module)
    return module


def _holds(path: Path, source: str) -> bool:
    try:
        return path.read_text() == source
    except (FileNotFoundError, UnicodeDecodeError):
        return False


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it to `path` (atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
