"""Where attngen finds its data folders and keeps its caches.

`templates/`, `search_spaces/` and `tuned/` sit at the top of the source tree and are copied
into the package (`attngen/templates`, ...) when it is built, so both a source checkout and an
installed wheel find them here.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def data_dir(name: str) -> Path:
    """The folder `name` (templates, search_spaces, tuned) of this installation."""
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"attngen's {name}/ folder is missing (looked in {_PACKAGE} and its parent); "
                            "reinstall attngen")


def cache_dir() -> Path:
    """ATTNGEN_CACHE_DIR, else $XDG_CACHE_HOME/attngen, else ~/.cache/attngen."""
    if os.environ.get("ATTNGEN_CACHE_DIR"):
        return Path(os.environ["ATTNGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attngen"
