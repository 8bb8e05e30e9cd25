"""`attngen registry list` and `show`: the registry files the dispatcher reads, and their entries."""

import pytest

from attngen import cli
from attngen.config import KernelConfig
from attngen.families import FORWARD
from attngen.tuning import registry
from attngen.tuning.registry import Entry, EntryKey


def entry(variant, bucket, config, sdpa_ms=None):
    return Entry(EntryKey(variant, "fwd", "fp16", 32, bucket, 1), FORWARD.revision, config.as_dict(), ms=0.5,
                 tflops=12.5, sdpa_ms=sdpa_ms, trials=7, triton="3.6.0", torch="2.13.0", date="2026-11-29")


@pytest.fixture
def user_registry(tmp_path, monkeypatch):
    """A user registry with two interpreter entries, and no ATTNGEN_REGISTRY override."""
    monkeypatch.delenv("ATTNGEN_REGISTRY", raising=False)
    monkeypatch.setenv("ATTNGEN_USER_REGISTRY", str(tmp_path / "user"))
    registry.write_entries(tmp_path / "user" / "interpreter.yaml",
                           [entry("causal(align='top_left')", 64, KernelConfig(32, 16, 4, 2, use_tma=True), 1.0),
                            entry("none", 1024, KernelConfig(16, 64, 2, 1))],
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
    assert lines[0].split() == ["source", "variant", "kernel", "revision", "dtype", "D", "bucket", "group", "batch",
                                "config", "ms", "TFLOP/s", "SDPA", "ms", "speedup", "trials", "date"]
    causal, dense = lines[1:]
    # configs as stored and as tune / explain print them (the interpreter runs the tma path too);
    # four significant digits
    assert causal.split() == [str(user_registry), "causal(align='top_left')", "fwd", str(FORWARD.revision), "fp16",
                              "32", "64", "1", "any", "32x16", "w4", "s2", "tma", "0.5", "12.5", "1", "2.00x", "7",
                              "2026-11-29"]
    assert "  32x16 w4 s2 tma  " in causal and "  16x64 w2 s1  " in dense and dense.split()[-4:-2] == ["n/a", "n/a"]


def test_show_keeps_small_figures_and_gpu_flags(user_registry, capsys):
    slow = Entry(EntryKey("none", "fwd", "fp16", 32, 64, 1), FORWARD.revision,
                 KernelConfig(32, 16, 4, 2, use_tma=True).as_dict(), ms=1234.5678, tflops=1.8123e-05, sdpa_ms=None,
                 trials=7, triton="3.6.0", torch="2.13.0", date="2026-11-29")
    registry.write_entries(user_registry, [slow], "interpreter", "Triton interpreter (CPU)")
    registry.write_entries(user_registry.with_name("h200.yaml"), [slow], "h200", "NVIDIA H200")
    assert cli.main(["registry", "show"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if " none " in ln and " 64 " in ln]
    assert line.split()[9:15] == ["32x16", "w4", "s2", "tma", "1235", "1.812e-05"]  # not 0.0 TFLOP/s
    assert cli.main(["registry", "show", "--gpu", "h200"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert str(user_registry.with_name("h200.yaml")) in line and "  32x16 w4 s2 tma  " in line


def test_show_marks_entries_of_another_kernel_revision(user_registry, capsys):
    """The dispatcher ignores them (tests/test_dispatch.py); show says so, and why."""
    old = entry("none", 4096, KernelConfig(16, 64, 2, 1))
    old.revision = FORWARD.revision + 1
    unknown = Entry(EntryKey("none", "bwd2", "fp16", 32, 64, 1), 1, KernelConfig(16, 16, 2, 1).as_dict(), ms=0.5,
                    tflops=12.5, sdpa_ms=None, trials=7, triton="3.6.0", torch="2.13.0", date="2026-11-29")
    registry.write_entries(user_registry, [old, unknown], "interpreter", "Triton interpreter (CPU)")
    assert cli.main(["registry", "show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (line,) = [ln for ln in lines if " 4096 " in ln]
    assert f" {FORWARD.revision + 1} (ignored: kernels at {FORWARD.revision}) " in line
    (line,) = [ln for ln in lines if " bwd2 " in ln]
    assert " 1 (ignored: no kernel family 'bwd2') " in line
    assert sum("ignored" in ln for ln in lines) == 2  # the entries of the current revision are not marked
    assert cli.main(["registry", "list"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{user_registry}: 4 entries (2 of another kernel revision or family, which the dispatcher ignores)")


def test_show_without_entries_says_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNGEN_USER_REGISTRY", str(tmp_path / "empty"))
    monkeypatch.delenv("ATTNGEN_REGISTRY", raising=False)
    registry.write_entries(tmp_path / "empty" / "a100.yaml", [], "a100", "NVIDIA A100")
    assert cli.main(["registry", "show", "--gpu", "a100"]) == 0
    assert capsys.readouterr().out.startswith("no registry entries for gpu 'a100' in ")


@pytest.mark.parametrize("content,reason", [
    ("version: 2\nentries: [unclosed\n", "not valid YAML at line 3"),
    ("version: 2\ngpu: interpreter\nentries: 5\n", "device_name=None must be a string; entries=5 must be a list"),
])
def test_list_says_a_present_file_is_unusable_and_why(user_registry, capsys, content, reason):
    user_registry.write_text(content)
    assert cli.main(["registry", "list"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith(f"{user_registry}: unusable, ignored: {reason}")
    assert "no file" not in out.splitlines()[0] and "RegistryWarning" not in err


def test_list_counts_the_entries_it_skipped(user_registry, capsys):
    text = user_registry.read_text().replace("block_m: 32", "block_m: 48")  # not a power of two
    user_registry.write_text(text)
    assert cli.main(["registry", "list"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{user_registry}: 1 entry (skipped invalid entries 0; `attngen registry show` says why)")


def test_a_gpu_without_a_registry_is_an_error_naming_the_ones_there_are(user_registry, capsys):
    for action in ("list", "show"):
        assert cli.main(["registry", action, "--gpu", "nosuchgpu"]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert f"attngen registry: error: no registry for gpu 'nosuchgpu': none of {user_registry.parent}" in err
        shipped = sorted(p.stem for p in registry.shipped_dir().glob("*.yaml"))
        assert f"registries exist for {', '.join(sorted({'interpreter', *shipped}))} (--gpu KEY picks one" in err


def test_a_registry_path_that_does_not_exist_is_an_error(user_registry, monkeypatch, capsys, clean_dispatch):
    monkeypatch.setenv("ATTNGEN_REGISTRY", "/nonexistent/registry")
    assert cli.main(["registry", "list"]) == 2
    assert "ATTNGEN_REGISTRY: '/nonexistent/registry' does not exist" in capsys.readouterr().err
