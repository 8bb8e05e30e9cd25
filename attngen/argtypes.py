"""Argument types the command line's subcommands share."""

from __future__ import annotations


def comma_list(kind):
    """An argparse type: a comma-separated list of `kind` values ("64,128" -> [64, 128])."""
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"expected a comma-separated list of {kind.__name__}, got {text!r}") from None
    parse.__name__ = f"list of {kind.__name__}"
    return parse
