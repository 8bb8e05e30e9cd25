"""The README against the command line: every option it names exists, every option exists in it,
and a usage line shows an option without brackets only when the option is required."""

import argparse
import re
from pathlib import Path

from attngen import cli

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# options the README names that belong to a script of benchmarks/, not to `attngen`
SCRIPT_OPTIONS = {"--set": "benchmarks/topk_configs.py", "--nondeterministic": "benchmarks/bwd_configs.py",
                  "--compile": "benchmarks/gluon_fwd.py"}
INTERNAL = {"--help", "--worker-only"}


def parsers() -> dict[str, argparse.ArgumentParser]:
    """{"": the top-level parser, "tune": its parser, ...}."""
    top = cli.build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {"": top, **sub.choices}


def options(parser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s.startswith("--")}


def test_every_option_the_readme_names_exists():
    known = set().union(*(options(p) for p in parsers().values()))
    for name in sorted(set(re.findall(r"--[a-z][a-z-]*", README))):
        if name in SCRIPT_OPTIONS:
            assert name in (ROOT / SCRIPT_OPTIONS[name]).read_text()
            continue
        assert name in known, f"README.md names {name}, which no attngen command has"


def test_every_option_is_in_the_readme():
    for command, parser in parsers().items():
        for name in options(parser):
            if name not in INTERNAL:
                assert re.search(rf"{name}(?![a-z-])", README), f"`attngen {command} {name}` is not in README.md"


def test_usage_lines_bracket_the_optional_options():
    """`attngen profile --method METHOD [--mask SPEC]` says --method is required: it must be."""
    usages = re.findall(r"`attngen ([a-z]+)(?: (?:list|show))? ([^`]*\[[^`]*)`", README)
    assert {command for command, _ in usages} >= {"render", "registry", "profile"}
    for command, text in usages:
        unbracketed = re.sub(r"\[[^\]]*\]", "", text)
        for name in re.findall(r"--[a-z][a-z-]*", unbracketed):
            action = options(parsers()[command])[name]
            assert action.required, f"README.md shows `attngen {command} {name}` as required; it is optional"
