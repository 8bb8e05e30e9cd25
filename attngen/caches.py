"""The in-process caches of attngen: each one bounded, each one safe to share between threads.

A cache here is a dict that is read without a lock (`cache.get(key)`, the per-call fast path)
and written only through `put`, which inserts a fully built value under a lock and drops the
oldest entries past its limit. `clear()` starts a new generation: a value built from what the
clear made stale (a registry that was replaced) is dropped by `put` instead of stored. Every
cache registers itself by name; `all_caches()` lists them (tests check each one's bound).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

_ALL: dict[str, "BoundedCache"] = {}


class BoundedCache(OrderedDict):
    """A dict of at most `limit` entries, the least recently stored (or `touch`ed) dropped first."""

    def __init__(self, name: str, limit: int):
        super().__init__()
        self.name, self.limit = name, limit
        self.generation = 0  # clear() counts up: put(..., generation=g) stores only while it is g
        self._lock = threading.Lock()
        _ALL[name] = self

    def put(self, key, value, generation: int | None = None):
        """Store `value` (fully built) and return it; with `generation`, the value of
        `cache.generation` read before building it, the value is only returned where a clear() ran
        since."""
        with self._lock:
            if generation is None or generation == self.generation:
                self[key] = value
                self.move_to_end(key)
                while len(self) > self.limit:
                    self.popitem(last=False)
        return value

    def touch(self, key) -> None:
        """Mark `key` as recently used (least recently used entries go first); gone keys are fine."""
        with self._lock:
            if key in self:
                self.move_to_end(key)

    def clear(self) -> None:
        with self._lock:
            super().clear()
            self.generation += 1

    def __repr__(self):
        return f"BoundedCache({self.name!r}, {len(self)}/{self.limit})"


def all_caches() -> dict[str, BoundedCache]:
    """Every cache of attngen by name (a copy)."""
    return dict(_ALL)
