"""Where attngen finds its data folders and keeps its caches and user registry.

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


def _user_path(override_env: str, xdg_env: str, xdg_default: str, *parts: str) -> Path:
    """$override_env, else $xdg_env/<parts>, else ~/<xdg_default>/<parts> (the XDG base directories)."""
    if os.environ.get(override_env):
        return Path(os.environ[override_env])
    base = os.environ.get(xdg_env) or os.path.join(os.path.expanduser("~"), xdg_default)
    return Path(base).joinpath(*parts)


def cache_dir() -> Path:
    """ATTNGEN_CACHE_DIR, else $XDG_CACHE_HOME/attngen, else ~/.cache/attngen."""
    return _user_path("ATTNGEN_CACHE_DIR", "XDG_CACHE_HOME", ".cache", "attngen")


def user_registry_dir() -> Path:
    """ATTNGEN_USER_REGISTRY, else $XDG_CONFIG_HOME/attngen/tuned, else ~/.config/attngen/tuned."""
    return _user_path("ATTNGEN_USER_REGISTRY", "XDG_CONFIG_HOME", ".config", "attngen", "tuned")
