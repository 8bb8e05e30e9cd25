"""Progress of a long command (`attngen tune`, `attngen bench`) on stderr: a tqdm bar on a terminal,
one line per finished item anywhere else (a bar redrawn into a log file floods it)."""

from __future__ import annotations

import sys
import time


def progress_bar(total: int, unit: str, file=None):
    """A tqdm bar when `file` (default stderr) is a terminal, else a `LineProgress`; both take
    set_description, reset, update, write and close, and work as context managers."""
    file = file if file is not None else sys.stderr
    isatty = getattr(file, "isatty", None)
    if isatty is not None and isatty():
        from tqdm import tqdm

        return tqdm(total=total, unit=unit, dynamic_ncols=True, file=file)
    return LineProgress(total, unit, file)


class LineProgress:
    """The part of tqdm's interface attngen uses, writing one line per finished item:
    `[1/2] causal fp16 d32 s64: 3/6 trials, 12 s`."""

    def __init__(self, total: int, unit: str, file):
        self.total, self.unit, self.file = total, unit, file
        self.n = 0
        self.desc = ""
        self.started = time.monotonic()

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def reset(self, total: int | None = None) -> None:
        self.n, self.started = 0, time.monotonic()
        if total is not None:
            self.total = total

    def update(self, n: int = 1) -> None:
        if n <= 0:
            return
        self.n += n
        prefix = f"{self.desc}: " if self.desc else ""
        self.write(f"{prefix}{self.n}/{self.total} {self.unit}s, {time.monotonic() - self.started:.0f} s")

    def write(self, text: str, file=None) -> None:
        """A line of its own (tqdm.write's signature: pass file=sys.stderr to both)."""
        print(text, file=file if file is not None else self.file, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
