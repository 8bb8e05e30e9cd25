"""The tuned registry: keys, file round trips, merging, lookups, bad content, concurrent writers."""

import dataclasses
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import yaml

from attngen import masks as masks_
from attngen.config import KernelConfig
from attngen.paths import data_dir
from attngen.tuning import registry
from attngen.tuning.registry import (SCHEMA_VERSION, Entry, EntryKey, Registry, RegistryWarning, gpu_key, load_file,
                                     seq_bucket, shipped_dir, user_dir, variant_of, write_entries)

CONFIG = dict(block_m=128, block_n=64, num_warps=4, num_stages=2, use_tma=True, warp_specialize=False)


def make_entry(variant="none", kernel="fwd", dtype="bf16", head_dim=128, bucket=4096, group=1,
               tflops=100.0, revision=1, **config):
    key = EntryKey(variant, kernel, dtype, head_dim, bucket, group)
    return Entry(key, revision, {**CONFIG, **config}, ms=1.5, tflops=tflops, sdpa_ms=1.2, trials=40,
                 triton="3.6.0", torch="2.11.0+cu130", date="2026-11-29")


def write_raw(path, data):
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ---------------------------------------------------------------------------------------------
# keys


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA RTX A6000", "rtxa6000"),
    ("NVIDIA H200 NVL", "h200"),
    ("NVIDIA GeForce RTX 3090 Ti", "rtx3090ti"),
])
def test_gpu_key(name, key):
    assert gpu_key(name) == key


def test_gpu_key_of_a_name_without_a_model():
    with pytest.raises(ValueError, match="NVIDIA"):
        gpu_key("NVIDIA")


@pytest.mark.parametrize("n, bucket", [(0, 16), (1, 16), (7, 16), (16, 16), (17, 32), (100, 128), (257, 512),
                                       (1000, 1024), (4096, 4096), (4097, 8192)])
def test_seq_bucket(n, bucket):
    assert seq_bucket(n) == bucket


def test_config_fields_are_kernel_config_fields():
    assert list(registry.CONFIG_FIELDS) == [f.name for f in dataclasses.fields(KernelConfig)]


@pytest.mark.parametrize("change, reason", [
    (dict(block_m=48), "block_m=48 must be a power of two"),
    (dict(block_n=8), "block_n=8 must be a power of two"),
    (dict(num_warps=3), "num_warps=3"),
    (dict(num_stages=0), "num_stages=0"),
    (dict(use_tma=1), "use_tma=1 must be true or false"),
    (dict(num_warps=4.0), "num_warps=4.0 must be an integer"),
    (dict(num_ctas=2), "unknown fields num_ctas"),
])
def test_invalid_config_is_refused(change, reason):
    with pytest.raises(ValueError, match=reason):
        make_entry(**change)


def test_missing_config_field_is_refused():
    config = dict(CONFIG)
    del config["warp_specialize"]
    with pytest.raises(ValueError, match="config lacks warp_specialize"):
        Entry(make_entry().key, 1, config, 1.0, 1.0, None, 1, "3.6.0", "2.11", "2026-11-29")


@pytest.mark.parametrize("fields, reason", [
    (dict(kernel="Fwd"), "kernel='Fwd' must be a kernel family name"),
    (dict(kernel=""), "kernel=''"),
    (dict(dtype="fp8"), "dtype='fp8'"),
    (dict(seq_bucket=1000), "seq_bucket=1000 must be a power of two"),
    (dict(group=0), "group=0"),
    (dict(head_dim=True), "head_dim=True"),
    (dict(batch_bucket=3), "batch_bucket=3 must be 0 \\(any batch\\) or a power of two"),
    (dict(batch_bucket=-4), "batch_bucket=-4"),
])
def test_invalid_key_is_refused(fields, reason):
    with pytest.raises(ValueError, match=reason):
        EntryKey(**{**dict(variant="none", kernel="fwd", dtype="bf16", head_dim=64, seq_bucket=16, group=1),
                    **fields})


# ---------------------------------------------------------------------------------------------
# files


def test_round_trip(tmp_path, no_warnings):
    entries = [make_entry(), make_entry("causal(align='top_left')", "bwd", "fp16", 64, 16, 4, tflops=3.5,
                                        use_tma=False, warp_specialize=True),
               make_entry("sliding_window(window=256) & softcap(cap=50.0)", bucket=1 << 17)]
    entries[1].sdpa_ms = None
    path = tmp_path / "sub" / "h200.yaml"
    written = write_entries(path, entries, "h200", "NVIDIA H200")
    loaded = load_file(path)
    assert (loaded.gpu, loaded.device_name) == ("h200", "NVIDIA H200")
    assert loaded.entries == written.entries == {e.key: e for e in entries}
    text = path.read_text()
    assert text.startswith(f"version: {SCHEMA_VERSION}\ngpu: h200\ndevice_name: NVIDIA H200\nentries:\n- variant: ")
    assert "\n  kernel: fwd\n" in text and "direction" not in text
    assert "  config: {block_m: 128, block_n: 64, num_warps: 4, num_stages: 2, use_tma: true, " \
           "warp_specialize: false}\n" in text
    assert "  date: '2026-11-29'\n" in text


def test_batch_bucket_is_written_only_where_set(tmp_path, no_warnings):
    """The families that tune per batch (decode) key entries by batch bucket; the others' entries
    (batch_bucket 0: any batch) leave the field out, so files written before it read the same."""
    per_batch = make_entry(kernel="decode", bucket=8192)
    per_batch = Entry(dataclasses.replace(per_batch.key, batch_bucket=8), 1, per_batch.config, 1.0, 2.0, None, 3,
                      "3.6.0", "2.11", "2026-12-03")
    path = tmp_path / "h200.yaml"
    write_entries(path, [make_entry(), per_batch], "h200", "NVIDIA H200")
    assert path.read_text().count("batch_bucket") == 1 and "  batch_bucket: 8\n" in path.read_text()
    assert {e.key.batch_bucket for e in load_file(path).entries.values()} == {0, 8}
    assert [registry.batch_bucket(n) for n in (1, 2, 3, 8, 9)] == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="batch 0 must be >= 1"):
        registry.batch_bucket(0)


def test_output_is_deterministic(tmp_path):
    entries = [make_entry(variant=v, kernel=d, bucket=b, group=g)
               for v in ("none", "causal(align='top_left')") for d in ("fwd", "bwd")
               for b in (16, 1024, 65536) for g in (1, 8)]
    shuffled = random.Random(0).sample(entries, len(entries))
    write_entries(tmp_path / "a.yaml", entries, "h200", "NVIDIA H200")
    write_entries(tmp_path / "b.yaml", shuffled, "h200", "NVIDIA H200")
    for entry in reversed(entries):  # one at a time, into an existing file
        write_entries(tmp_path / "c.yaml", [entry], "h200", "NVIDIA H200")
    first = (tmp_path / "a.yaml").read_bytes()
    assert (tmp_path / "b.yaml").read_bytes() == first
    assert (tmp_path / "c.yaml").read_bytes() == first


def test_file_bytes_do_not_depend_on_libyaml():
    """The registry writes with libyaml's emitter where PyYAML has it; PyYAML's own gives the same bytes."""
    awkward = ["none", "causal(align='top_left')", 'a"b', "a: b", "- a", "&a", "*a", "#a", "a #b", "yes", "null",
               "1.5", "2026-01-01", " a", "a ", "{a}", "[a]", "%a", "@a", "!a", "|a", ">a", "?a", "~", "ünï", "x" * 300]
    entries = [make_entry(v, bucket=16 << i, tflops=1 / 3 + i * 1e9) for v in awkward for i in range(3)]
    data = registry.RegistryFile("h200", "NVIDIA H200", {e.key: e for e in entries}).as_dict()
    assert registry._SAFE_DUMPER is yaml.CSafeDumper, "PyYAML without libyaml: nothing to compare"
    assert yaml.dump(data, Dumper=yaml.CSafeDumper, **registry._DUMP_STYLE) == \
        yaml.dump(data, Dumper=yaml.SafeDumper, **registry._DUMP_STYLE)


def test_merge_keeps_the_better_entry_per_key(tmp_path):
    path = tmp_path / "h200.yaml"
    write_entries(path, [make_entry(bucket=1024, tflops=100.0), make_entry(bucket=2048, tflops=100.0),
                         make_entry(variant="causal", tflops=7.0)], "h200", "NVIDIA H200")
    write_entries(path, [make_entry(bucket=1024, tflops=200.0, block_n=32),  # better: replaces
                         make_entry(bucket=2048, tflops=50.0, block_n=32),  # worse: dropped
                         make_entry(bucket=8192, tflops=1.0)], "h200", "NVIDIA H200")  # new: added
    by_bucket = {(key.variant, key.seq_bucket): e for key, e in load_file(path).entries.items()}
    assert set(by_bucket) == {("none", 1024), ("none", 2048), ("none", 8192), ("causal", 4096)}
    assert (by_bucket["none", 1024].tflops, by_bucket["none", 1024].config["block_n"]) == (200.0, 32)
    assert (by_bucket["none", 2048].tflops, by_bucket["none", 2048].config["block_n"]) == (100.0, 64)
    assert by_bucket["causal", 4096].tflops == 7.0


def test_writing_another_gpus_file_is_an_error(tmp_path):
    path = tmp_path / "h200.yaml"
    write_entries(path, [make_entry()], "h200", "NVIDIA H200")
    with pytest.raises(ValueError, match="is for gpu 'h200', not 'h100'"):
        write_entries(path, [make_entry()], "h100", "NVIDIA H100")
    with pytest.raises(ValueError, match="gpu key"):
        write_entries(path, [make_entry()], "NVIDIA H200", "NVIDIA H200")


def test_missing_file_is_silently_none(tmp_path, no_warnings):
    assert load_file(tmp_path / "h200.yaml") is None
    assert list(Registry.load([tmp_path, tmp_path / "nowhere"], "h200").entries()) == []


GOOD_ENTRY = make_entry().as_dict()


@pytest.mark.parametrize("content, reason", [
    ("version: 1\ngpu: h200\nentries: [\n", "not valid YAML at line"),
    ("", "the file is empty"),
    ("- 1\n- 2\n", "the top level must be a mapping"),
    ("gpu: h200\ndevice_name: x\nentries: []\n", "it has no version"),
    ("version: 4\ngpu: h200\ndevice_name: x\nentries: []\n", "version 4, this attngen reads versions 1, 2, 3"),
    ("version: 1\ngpu: h200\ndevice_name: x\nentries: {a: 1}\n", "entries={'a': 1} must be a list of entries, got dict"),
    # every top-level problem is named, not only the first checked
    ("version: 2\ngpu: h200\nentries: 5\n", "device_name=None must be a string; entries=5 must be a list of entries, "
                                          "got int"),
    ("version: 1\ngpu: H200\ndevice_name: x\nentries: []\n", "gpu='H200' must be a gpu key"),
    ("version: 1\ngpu: h200\nentries: []\n", "device_name=None must be a string"),
    ("version: 1\ngpu: h200\ndevice_name: x\nentries: []\ncomment: hi\n", "unknown top-level fields comment"),
])
def test_unusable_file_is_ignored_with_a_warning(tmp_path, content, reason):
    path = tmp_path / "h200.yaml"
    path.write_text(content)
    with pytest.warns(RegistryWarning) as record:
        assert load_file(path) is None
    assert len(record) == 1
    assert str(record[0].message).startswith(f"attngen: ignoring registry {path}: {reason}")
    with pytest.warns(RegistryWarning, match="ignoring registry"):
        assert list(Registry.load([tmp_path], "h200").entries()) == []


def test_unreadable_file_is_ignored_with_a_warning(tmp_path):
    (tmp_path / "h200.yaml").mkdir()  # reading a folder fails with an OSError
    with pytest.warns(RegistryWarning, match="ignoring registry .*h200.yaml: cannot read it"):
        assert load_file(tmp_path / "h200.yaml") is None


def test_a_bad_entry_is_skipped_and_the_good_ones_kept(tmp_path):
    bad_config = {**GOOD_ENTRY, "seq_bucket": 1024, "config": {**CONFIG, "block_m": 48}}
    no_key = {"ms": 1.0}
    typo = {**GOOD_ENTRY, "seq_bucket": 2048, "tflop": 3.0}
    typo.pop("tflops")
    bad_date = {**GOOD_ENTRY, "seq_bucket": 16, "date": "29.11.2026"}
    good = {**GOOD_ENTRY, "seq_bucket": 8192}
    path = write_raw(tmp_path / "h200.yaml", {"version": 1, "gpu": "h200", "device_name": "NVIDIA H200",
                                               "entries": [GOOD_ENTRY, bad_config, no_key, "x", typo, bad_date,
                                                           good]})
    with pytest.warns(RegistryWarning) as record:
        loaded = load_file(path)
    messages = [str(w.message) for w in record]
    start = f"attngen: skipping entry {{}} of registry {path}: "
    key = "variant='none', kernel='fwd', dtype='bf16', head_dim=128, seq_bucket={}, group=1"
    assert messages == [
        f"attngen: skipping entry 1 ({key.format(1024)}) of registry {path}: "
        "block_m=48 must be a power of two >= 16",
        start.format(2) + "lacks " + ", ".join(f for f in registry.ENTRY_FIELDS  # a version 1 file has no revisions
                                               if f not in ("ms", "revision", *registry.OPTIONAL_KEY_FIELDS)),
        start.format(3) + "must be a mapping, got str",
        f"attngen: skipping entry 4 ({key.format(2048)}) of registry {path}: lacks tflops; unknown fields tflop",
        f"attngen: skipping entry 5 ({key.format(16)}) of registry {path}: "
        "date='29.11.2026' must be an ISO date (YYYY-MM-DD)",
    ]
    assert sorted(k.seq_bucket for k in loaded.entries) == [4096, 8192]


def test_duplicate_keys_keep_the_better_entry(tmp_path):
    worse = {**GOOD_ENTRY, "tflops": 1.0}
    path = write_raw(tmp_path / "h200.yaml", {"version": 1, "gpu": "h200", "device_name": "NVIDIA H200",
                                               "entries": [worse, GOOD_ENTRY]})
    with pytest.warns(RegistryWarning, match=r"skipping entry 0 of registry .*: same key as entry 1"):
        loaded = load_file(path)
    assert [e.tflops for e in loaded.entries.values()] == [GOOD_ENTRY["tflops"]]


def test_a_version_1_file_is_read_and_written_back_as_version_3(tmp_path, no_warnings):
    """Version 1 called the kernel family `direction` and had no revisions: its entries are read as
    `kernel` ones of revision 1, and the next write turns the file into version 3."""
    old = {("direction" if name == "kernel" else name): value for name, value in GOOD_ENTRY.items()
           if name != "revision"}
    assert list(old)[:3] == ["variant", "direction", "dtype"]
    path = write_raw(tmp_path / "h200.yaml", {"version": 1, "gpu": "h200", "device_name": "NVIDIA H200",
                                               "entries": [old]})
    (entry,) = load_file(path).entries.values()
    assert entry.key == make_entry().key and entry.key.kernel == "fwd" and entry.revision == 1
    found, reason = Registry.load([tmp_path], "h200").lookup(make_entry().key, 1)
    assert found.tflops == GOOD_ENTRY["tflops"] and reason.startswith("exact entry")
    write_entries(path, [make_entry(bucket=1024)], "h200", "NVIDIA H200")
    text = path.read_text()
    assert text.startswith("version: 3\n") and "direction" not in text
    assert text.count("\n  kernel: fwd\n") == 2 and text.count("\n  group: 1\n  revision: 1\n") == 2
    assert sorted(k.seq_bucket for k in load_file(path).entries) == [1024, 4096]
    assert not list(tmp_path.glob("h200.yaml.invalid-*"))  # nothing was unusable


def test_direction_is_only_read_in_version_1(tmp_path):
    old = {("direction" if name == "kernel" else name): value for name, value in GOOD_ENTRY.items()}
    path = write_raw(tmp_path / "h200.yaml", {"version": 2, "gpu": "h200", "device_name": "NVIDIA H200",
                                               "entries": [old]})
    with pytest.warns(RegistryWarning, match="skipping entry 0 .* lacks kernel; unknown fields direction"):
        assert load_file(path).entries == {}


def test_a_version_2_file_has_revision_1_and_version_3_requires_one(tmp_path, no_warnings):
    unrevised = {name: value for name, value in GOOD_ENTRY.items() if name != "revision"}
    path = write_raw(tmp_path / "h200.yaml", {"version": 2, "gpu": "h200", "device_name": "NVIDIA H200",
                                               "entries": [unrevised]})
    assert [e.revision for e in load_file(path).entries.values()] == [1]
    path = write_raw(tmp_path / "h200.yaml", {"version": 3, "gpu": "h200", "device_name": "NVIDIA H200",
                                               "entries": [unrevised, {**GOOD_ENTRY, "seq_bucket": 1024,
                                                                       "revision": 0}]})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert load_file(path).entries == {}
    assert [str(w.message).split(": ", 2)[2] for w in record] == ["lacks revision",
                                                                  "revision=0 must be an integer >= 1"]


def test_lookups_use_only_the_revision_asked_for(tmp_path, no_warnings):
    """An entry's timings are of the kernels of its revision: a lookup at another revision ignores it
    (exact or nearest bucket), other_revisions names it, and a lookup at None takes any."""
    user = write_source(tmp_path / "user", make_entry(revision=1, tflops=5.0), make_entry(bucket=1024, revision=2))
    shipped = write_source(tmp_path / "shipped", make_entry(revision=2, tflops=1.0))
    reg = Registry.load([tmp_path / "user", tmp_path / "shipped"], "h200")
    entry, reason = reg.lookup(make_entry().key, 2)
    assert (entry.tflops, entry.revision, reason) == (1.0, 2, f"exact entry in {shipped}")
    entry, reason = reg.lookup(make_entry().key, 1)
    assert (entry.tflops, reason) == (5.0, f"exact entry in {user}")
    assert reg.lookup(make_entry(bucket=1024).key, 1)[0].key.seq_bucket == 4096  # the 1024 entry is revision 2
    assert reg.lookup(make_entry().key, 3) is None
    assert reg.lookup(make_entry(bucket=16).key, None)[0].key.seq_bucket == 1024
    assert [(path, e.revision, e.key.seq_bucket) for path, e in reg.other_revisions(make_entry().key, 2)] == \
        [(user, 1, 4096)]
    assert reg.other_revisions(make_entry(variant="causal").key, 1) == []


def test_a_later_revision_replaces_a_faster_entry(tmp_path, no_warnings):
    path = tmp_path / "h200.yaml"
    write_entries(path, [make_entry(revision=1, tflops=9.0)], "h200", "NVIDIA H200")
    write_entries(path, [make_entry(revision=2, tflops=1.0)], "h200", "NVIDIA H200")
    assert [(e.revision, e.tflops) for e in load_file(path).entries.values()] == [(2, 1.0)]
    write_entries(path, [make_entry(revision=1, tflops=99.0)], "h200", "NVIDIA H200")  # an earlier kernel's
    assert [(e.revision, e.tflops) for e in load_file(path).entries.values()] == [(2, 1.0)]
    later = {**GOOD_ENTRY, "revision": 2, "tflops": 1.0}
    path = write_raw(path, {"version": 3, "gpu": "h200", "device_name": "NVIDIA H200", "entries": [later, GOOD_ENTRY]})
    with pytest.warns(RegistryWarning, match=r"skipping entry 1 of registry .*: same key as entry 0, which is of a "
                                             r"later kernel revision \(2\)"):
        assert [e.revision for e in load_file(path).entries.values()] == [2]


def test_variant_names():
    assert variant_of(None) == "none"
    assert variant_of(None, 40) == "topk(64)"  # K rounded up to a power of two: one variant per bucket
    assert variant_of(masks_.as_mask("causal"), 8) == "causal(align='top_left') & topk(8)"
    assert variant_of(masks_.mask("sliding_window", window=3) & masks_.mask("softcap", cap=2.0)) == \
        "sliding_window(two_sided=False, align='top_left') & softcap"


def test_unquoted_date_is_read(tmp_path, no_warnings):
    path = tmp_path / "h200.yaml"
    write_entries(path, [make_entry()], "h200", "NVIDIA H200")
    path.write_text(path.read_text().replace("'2026-11-29'", "2026-11-29"))
    assert [e.date for e in load_file(path).entries.values()] == ["2026-11-29"]


def test_writing_over_an_unusable_file_keeps_it_aside(tmp_path):
    path = tmp_path / "h200.yaml"
    path.write_text("version: 7\n")
    with pytest.warns(RegistryWarning, match=r"registry .*h200.yaml is unusable \(version 7.*moved it to"):
        write_entries(path, [make_entry()], "h200", "NVIDIA H200")
    (aside,) = tmp_path.glob("h200.yaml.invalid-*")
    assert aside.read_text() == "version: 7\n"
    assert len(load_file(path).entries) == 1


def test_writing_over_invalid_entries_keeps_the_old_file_aside(tmp_path):
    bad = {**GOOD_ENTRY, "seq_bucket": 16, "config": {**CONFIG, "num_warps": 3}}
    path = write_raw(tmp_path / "h200.yaml", {"version": 1, "gpu": "h200", "device_name": "NVIDIA H200",
                                               "entries": [bad, GOOD_ENTRY]})
    before = path.read_text()
    with pytest.warns(RegistryWarning) as record:
        write_entries(path, [make_entry(bucket=32)], "h200", "NVIDIA H200")
    assert "skipping entry 0" in str(record[0].message)
    assert str(record[1].message).startswith(f"attngen: registry {path}: dropping its invalid entries 0; "
                                             "the old file is kept as ")
    (aside,) = tmp_path.glob("h200.yaml.invalid-*")
    assert aside.read_text() == before
    assert sorted(k.seq_bucket for k in load_file(path).entries) == [32, 4096]


@pytest.mark.parametrize("broken", ["dump", "replace"])
def test_interrupted_write_leaves_the_old_file(tmp_path, monkeypatch, broken):
    path = tmp_path / "h200.yaml"
    write_entries(path, [make_entry()], "h200", "NVIDIA H200")
    before = path.read_bytes()

    def half_dump(data, stream, Dumper, **kwargs):
        stream.write("version: 1\ngpu: h2")
        raise OSError("disk full")

    def no_replace(src, dst):
        raise OSError("disk full")

    if broken == "dump":
        monkeypatch.setattr(registry.yaml, "dump", half_dump)
    else:
        monkeypatch.setattr(registry.os, "replace", no_replace)
    with pytest.raises(OSError, match="disk full"):
        write_entries(path, [make_entry(bucket=16, tflops=1e6)], "h200", "NVIDIA H200")
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h200.yaml", "h200.yaml.lock"]


# ---------------------------------------------------------------------------------------------
# concurrent writers

WRITER = """
import sys, time, types
from pathlib import Path

path, writer, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
# the attngen package without its __init__, which imports triton and the kernels (seconds in each process)
package = types.ModuleType("attngen")
package.__path__ = [sys.argv[4]]
sys.modules["attngen"] = package
from attngen.tuning.registry import Entry, EntryKey, write_entries

Path(f"{go}.ready{writer}").touch()
while not go.exists():
    time.sleep(0.001)
config = dict(block_m=64, block_n=64, num_warps=4, num_stages=2, use_tma=False, warp_specialize=False)
for i in range(25):
    key = EntryKey(f"writer{writer}", "fwd", "fp16", 64, 16 << i, 1)
    entry = Entry(key, 1, config, 1.0, 10.0 + i, None, 1, "3.6.0", "2.11.0", "2026-11-29")
    write_entries(path, [entry], "h200", "NVIDIA H200")
"""


def test_concurrent_writers_lose_nothing(tmp_path):
    """Four processes, 25 single-entry writes each, one file; a reader checks it along the way."""
    path, go = tmp_path / "h200.yaml", tmp_path / "go"
    logs = [tmp_path / f"writer{w}.log" for w in range(4)]
    procs = []
    for w, log in enumerate(logs):
        with log.open("w") as err:
            procs.append(subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w), str(go),
                                           str(Path(registry.__file__).parent.parent)],
                                          stdout=subprocess.DEVNULL, stderr=err))
    try:
        # start the writes together, after the (slow) imports
        deadline = time.monotonic() + 60
        while not all(Path(f"{go}.ready{w}").exists() for w in range(4)):
            assert all(p.poll() is None for p in procs), "a writer died before starting"
            assert time.monotonic() < deadline, "writers did not start"
            time.sleep(0.01)
        go.touch()
        reads = 0
        while any(p.poll() is None for p in procs):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                load_file(path)
            assert not caught, f"a reader saw a broken file: {caught[0].message}"
            reads += 1
            time.sleep(0.001)  # leave the writers some CPU
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log.read_text()
    loaded = load_file(path)
    assert {(k.variant, k.seq_bucket) for k in loaded.entries} == \
        {(f"writer{w}", 16 << i) for w in range(4) for i in range(25)}
    assert reads > 0


# ---------------------------------------------------------------------------------------------
# lookups


def write_source(folder, *entries, gpu="h200"):
    return write_entries(folder / f"{gpu}.yaml", list(entries), gpu, "NVIDIA H200").path


def test_exact_lookup_prefers_the_user(tmp_path):
    user = write_source(tmp_path / "user", make_entry(tflops=1.0))
    shipped = write_source(tmp_path / "shipped", make_entry(tflops=2.0), make_entry(bucket=1024, tflops=3.0))
    reg = Registry.load([tmp_path / "user", tmp_path / "shipped"], "h200")
    entry, reason = reg.lookup(make_entry().key, 1)
    assert (entry.tflops, reason) == (1.0, f"exact entry in {user}")
    entry, reason = reg.lookup(make_entry(bucket=1024).key, 1)
    assert (entry.tflops, reason) == (3.0, f"exact entry in {shipped}")
    assert [(p, e.tflops) for p, e in reg.entries()] == [(user, 1.0), (shipped, 3.0), (shipped, 2.0)]


@pytest.mark.parametrize("asked, found", [
    (16, 1024),  # below all
    (2048, 4096),  # 1024 is one step away, 4096 too: the larger wins
    (8192, 4096),  # one step down beats two steps up
    (16384, 32768),  # one step up beats two steps down
    (1 << 20, 65536),  # above all
])
def test_nearest_bucket(tmp_path, asked, found):
    source = write_source(tmp_path, *(make_entry(bucket=b, tflops=float(b)) for b in (1024, 4096, 32768, 65536)))
    entry, reason = Registry.load([tmp_path], "h200").lookup(make_entry(bucket=asked).key, 1)
    assert entry.key.seq_bucket == found
    assert reason == f"nearest sequence bucket {found} (asked {asked}) in {source}"


def test_nearest_bucket_ties_go_to_the_larger(tmp_path):
    write_source(tmp_path, make_entry(bucket=1024), make_entry(bucket=4096))
    reg = Registry.load([tmp_path], "h200")
    assert reg.lookup(make_entry(bucket=2048).key, 1)[0].key.seq_bucket == 4096
    assert reg.lookup(make_entry(bucket=8192).key, 1)[0].key.seq_bucket == 4096
    assert reg.lookup(make_entry(bucket=512).key, 1)[0].key.seq_bucket == 1024


def test_nearest_bucket_prefers_the_user_at_equal_distance(tmp_path):
    user = write_source(tmp_path / "user", make_entry(bucket=1024), make_entry(bucket=65536))
    write_source(tmp_path / "shipped", make_entry(bucket=4096), make_entry(bucket=32768))
    reg = Registry.load([tmp_path / "user", tmp_path / "shipped"], "h200")
    entry, reason = reg.lookup(make_entry(bucket=2048).key, 1)  # user 1024 and shipped 4096 are one step away
    assert entry.key.seq_bucket == 1024 and reason.endswith(f"in {user}")
    assert reg.lookup(make_entry(bucket=16384).key, 1)[0].key.seq_bucket == 32768  # nearer wins over the user


@pytest.mark.parametrize("other", [dict(variant="causal"), dict(kernel="bwd"), dict(dtype="fp16"),
                                   dict(head_dim=64), dict(group=2)])
def test_lookup_without_a_fitting_entry(tmp_path, other):
    write_source(tmp_path, make_entry())
    assert Registry.load([tmp_path], "h200").lookup(make_entry(**other).key, 1) is None
    assert Registry([]).lookup(make_entry().key, 1) is None


def test_load_reads_files_and_folders(tmp_path):
    folder_file = write_source(tmp_path / "a", make_entry(bucket=16))
    other_gpu = write_source(tmp_path / "b", make_entry(bucket=32), gpu="h100")
    plain_file = write_source(tmp_path / "c", make_entry(bucket=64))
    with pytest.warns(RegistryWarning, match=f"ignoring registry {other_gpu}: it is for gpu 'h100', not 'h200'"):
        reg = Registry.load([tmp_path / "a", other_gpu, plain_file, tmp_path / "missing"], "h200")
    assert [(p, e.key.seq_bucket) for p, e in reg.entries()] == [(folder_file, 16), (plain_file, 64)]


# ---------------------------------------------------------------------------------------------
# places


def test_user_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNGEN_USER_REGISTRY", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert user_dir() == tmp_path / "mine"
    monkeypatch.delenv("ATTNGEN_USER_REGISTRY")
    assert user_dir() == tmp_path / "xdg" / "attngen" / "tuned"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_dir() == tmp_path / "home" / ".config" / "attngen" / "tuned"


def test_shipped_registry_is_valid(no_warnings):
    assert shipped_dir() == data_dir("tuned")
    for path in sorted(shipped_dir().glob("*.yaml")):
        loaded = load_file(path)
        assert loaded is not None and loaded.gpu == path.stem
    assert SCHEMA_VERSION == 3
    text = (shipped_dir() / "h200.yaml").read_text()
    assert text.startswith("version: 3\n") and "direction:" not in text
