"""Progress display: a bar on a terminal, one line per finished item in a log (never a bar redrawn
with carriage returns into a file)."""

import io
import re

from attngen.tools.progress import LineProgress, progress_bar


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_a_line_per_finished_item():
    log = io.StringIO()  # not a terminal, as stderr redirected to a file or a pipe
    with progress_bar(3, "run", log) as bar:
        assert isinstance(bar, LineProgress)
        bar.set_description("S=64 fp16 causal fwd: naive")
        bar.update(1)
        bar.update(0)  # nothing finished: no line
        bar.set_description("S=64 fp16 causal fwd: attngen")
        bar.update(2)
        bar.write("a note", file=log)
        bar.reset(total=5)
        bar.update(1)
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 4
    assert re.fullmatch(r"S=64 fp16 causal fwd: naive: 1/3 runs, \d+ s", lines[0])
    assert re.fullmatch(r"S=64 fp16 causal fwd: attngen: 3/3 runs, \d+ s", lines[1])
    assert lines[2] == "a note"
    assert lines[3].startswith("S=64 fp16 causal fwd: attngen: 1/5 runs, ")


def test_a_terminal_gets_a_bar():
    terminal = Terminal()
    with progress_bar(3, "run", terminal) as bar:
        assert not isinstance(bar, LineProgress)
        bar.update(1)
    assert "\r" in terminal.getvalue() and "1/3" in terminal.getvalue()
