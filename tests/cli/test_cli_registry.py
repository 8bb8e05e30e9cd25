"""`attngen registry list` and `show`: the registry files the dispatcher reads, and their entries."""

import pytest

from attngen import cli
from attngen.config import KernelConfig
from attngen.tuning import registry
from attngen.tuning.registry import Entry, EntryKey


def entry(variant, bucket, config, sdpa_ms=None):
    return Entry(EntryKey(variant, "fwd", "fp16", 32, bucket, 1), config.as_dict(), ms=0.5, tflops=12.5,
                 sdpa_ms=sdpa_ms, trials=7, triton="3.6.0", torch="2.13.0", date="2026-11-29")


@pytest.fixture
def user_registry(tmp_path, monkeypatch):
    """A user registry with two interpreter entries, and no ATTNGEN_REGISTRY override."""
    monkeypatch.delenv("ATTNGEN_REGISTRY", raising=False)
    monkeypatch.setenv("ATTNGEN_USER_REGISTRY", str(tmp_path / "user"))
    registry.write_entries(tmp_path / "user" / "interpreter.yaml",
                           [entry("causal(align='top_left')", 64, KernelConfig(32, 16, 4, 2, use_tma=True), 1.0),
                            entry("none", 1024, KernelConfig(16, 64, 2, 1, warp_specialize=True))],
                           "interpreter", "Triton interpreter (CPU)")
    return tmp_path / "user" / "interpreter.yaml"


def test_list_names_every_source_and_its_entries(user_registry, capsys):
    assert cli.main(["registry", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{user_registry}: 2 entries"
    assert lines[1] == f"{registry.shipped_dir() / 'interpreter.yaml'}: no file"
    assert cli.main(["registry", "list", "--gpu", "h200"]) == 0
    shipped = registry.load_file(registry.shipped_dir() / "h200.yaml")
    assert capsys.readouterr().out.splitlines()[1] == f"{shipped.path}: {len(shipped.entries)} entries"


def test_show_prints_configs_as_attngen_shows_them(user_registry, capsys):
    assert cli.main(["registry", "show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["source", "variant", "kernel", "dtype", "D", "bucket", "group", "config", "ms",
                                "TFLOP/s", "SDPA", "ms", "speedup", "trials", "date"]
    causal, dense = lines[1:]
    assert causal.split() == [str(user_registry), "causal(align='top_left')", "fwd", "fp16", "32", "64", "1", "32x16",
                              "w4", "s2", "tma", "0.5000", "12.5", "1.0000", "2.00x", "7", "2026-11-29"]
    assert "  32x16 w4 s2 tma  " in causal and "  16x64 w2 s1 ws  " in dense and dense.split()[-4:-2] == ["n/a", "n/a"]


def test_show_without_entries_says_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNGEN_USER_REGISTRY", str(tmp_path / "empty"))
    monkeypatch.delenv("ATTNGEN_REGISTRY", raising=False)
    assert cli.main(["registry", "show", "--gpu", "a100"]) == 0
    assert capsys.readouterr().out.startswith("no registry entries for gpu 'a100' in ")
