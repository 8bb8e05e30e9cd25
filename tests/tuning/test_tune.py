"""`attngen tune` end to end under the interpreter: the registry it writes and the dispatcher reads,
resuming, workers, the options, samplers and the summary."""

import dataclasses
import importlib.metadata
import json
import signal
import subprocess
import sys
import time

import numpy
import optuna
import pytest
import torch

from attngen import cli
from attngen.checks import interpreter_numpy_problem
from attngen.config import KernelConfig, default_config
from attngen.families import FAMILIES
from attngen.tuning import registry, tune
from attngen.tuning.objective import Problem
from attngen.tuning.space import find_space
from helpers import attngen_cmd, cli_env

PROBLEM = Problem(mask="causal", dtype="fp16", batch=1, heads=2, kv_heads=1, seq_len=40, head_dim=32)


def run_tune(tmp_path, *args):
    """`attngen tune --interpret ARGS` in its own process, with the test's cache and registry."""
    return subprocess.run(attngen_cmd("tune", "--interpret", *args), env=cli_env(tmp_path), capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)


def interpreted(tmp_path, script):
    """A Python script in a process of its own under the interpreter, with the test's registry."""
    r = subprocess.run([sys.executable, "-c", script], env=cli_env(tmp_path, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_tune_writes_a_registry_the_dispatcher_uses(tmp_path):
    r = run_tune(tmp_path, "--mask", "causal", "--trials", "3", "--jobs", "2", "--seq-len", "48", "--head-dim", "16",
                 "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "running under Triton's interpreter" in r.stderr
    assert "1 of 1 problems have a winner" in r.stdout and "causal(align='top_left')" in r.stdout
    file = registry.load_file(tmp_path / "reg" / "interpreter.yaml")
    (entry,) = file.entries.values()
    assert entry.key.seq_bucket == 64 and entry.key.head_dim == 16 and entry.key.kernel == "fwd"
    assert entry.revision == FAMILIES["fwd"].revision  # the kernels the winner was timed on
    assert entry.trials >= 3
    config = str(entry.kernel_config())  # how attngen shows a config: "16x16 w4 s1"
    summary = next(line for line in r.stdout.splitlines() if line.startswith("fwd "))
    assert f"  {config}  " in summary
    # a new process: the dispatcher finds the entry and runs its config
    explained = interpreted(tmp_path, """
import torch, attngen
q = torch.randn(1, 2, 50, 16).half()
print(attngen.explain(q, q, q, mask="causal"))
print(attngen.dispatch.choose(q, q, q, "causal").config.as_dict())
""")
    assert explained.startswith("fwd kernel, variant causal(align='top_left'); torch.float16; config " + config)
    assert f"registry: exact entry in {tmp_path / 'reg' / 'interpreter.yaml'}" in explained
    assert str(entry.config) in explained
    shown = subprocess.run(attngen_cmd("registry", "show"), env=cli_env(tmp_path), capture_output=True, text=True,
                           cwd=tmp_path)
    assert "causal(align='top_left')" in shown.stdout and "interpreter.yaml" in shown.stdout
    assert f"  {config}  " in shown.stdout


INTERPRETER_PROBLEM = interpreter_numpy_problem(importlib.metadata.version("triton"), numpy.__version__)


@pytest.mark.skipif(INTERPRETER_PROBLEM is not None, reason=str(INTERPRETER_PROBLEM))
def test_tune_topk_variants_reach_the_dispatcher(tmp_path):
    """`--topk 8`: its own variant, space and correctness gate (the top-k reference), used by topk calls only."""
    r = run_tune(tmp_path, "--topk", "8", "--trials", "2", "--jobs", "2", "--seq-len", "24", "--head-dim", "16",
                 "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert " topk(8) " in r.stdout and "1 of 1 problems have a winner" in r.stdout
    (entry,) = registry.load_file(tmp_path / "reg" / "interpreter.yaml").entries.values()
    assert entry.key.variant == "topk(8)"
    with_topk, plain = interpreted(tmp_path, """
import torch, attngen
q = torch.randn(1, 2, 30, 16).half()
print(attngen.explain(q, q, q, topk=7))
print(attngen.explain(q, q, q))
""").splitlines()
    assert "variant topk(8)" in with_topk and "registry: exact entry" in with_topk
    assert str(entry.kernel_config()) in with_topk
    assert "no registry entry" in plain  # plain softmax is another variant: not tuned here


def test_tune_decode_keeps_an_entry_per_batch_bucket(tmp_path):
    """`--kernel decode --batch 1,3`: one study per batch, registry entries keyed by batch bucket (1
    and 4) with one new token against a cache of --seq-len keys; the dispatcher picks by batch."""
    r = run_tune(tmp_path, "--kernel", "decode", "--batch", "1,3", "--trials", "2", "--jobs", "1", "--seq-len", "40",
                 "--head-dim", "16", "--heads", "4", "--kv-heads", "2", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "2 of 2 problems have a winner" in r.stdout
    file = registry.load_file(tmp_path / "reg" / "interpreter.yaml")
    keys = sorted((e.key.kernel, e.key.batch_bucket, e.key.seq_bucket, e.key.group) for e in file.entries.values())
    assert keys == [("decode", 1, 64, 2), ("decode", 4, 64, 2)]
    assert {e.revision for e in file.entries.values()} == {FAMILIES["decode"].revision}
    assert (tmp_path / "reg" / "interpreter.yaml").read_text().count("batch_bucket: ") == 2
    configs = {e.key.batch_bucket: str(e.kernel_config()) for e in file.entries.values()}
    chosen = interpreted(tmp_path, """
import torch, attngen
for batch in (1, 3, 2, 64):
    q, k = torch.randn(batch, 4, 1, 16).half(), torch.randn(batch, 2, 50, 16).half()
    choice = attngen.dispatch.choose(q, k, k, kernel="decode")
    print(choice.config, "|", choice.source)
""").splitlines()
    assert chosen[0].startswith(configs[1] + " | registry: exact entry")
    assert chosen[1].startswith(configs[4] + " | registry: exact entry")
    assert chosen[2].startswith(configs[4] + " | registry: nearest batch bucket 4 (asked 2)")  # ties: the larger
    assert chosen[3].startswith(configs[4] + " | registry: nearest batch bucket 4 (asked 64)")


def test_killed_tuner_resumes_without_losing_trials(tmp_path):
    env = cli_env(tmp_path)
    args = attngen_cmd("tune", "--interpret", "--mask", "none", "--trials", "6", "--jobs", "1", "--seq-len", "40",
                       "--head-dim", "16")
    proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    name = Problem(mask="none", dtype="fp16", batch=1, heads=2, kv_heads=2, seq_len=40,
                   head_dim=16).study_name("interpreter")
    journal = tmp_path / "cache" / "tune" / "studies.journal"
    deadline = time.time() + 240
    before = []
    try:
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
            if journal.exists():
                try:
                    study = optuna.load_study(study_name=name, storage=tune.open_storage(str(journal)))
                except KeyError:
                    continue
                before = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
                if len(before) >= 2:
                    break
        assert proc.poll() is None, "the tuner finished before it could be killed; make the study longer"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(before) >= 2
    r = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    study = optuna.load_study(study_name=name, storage=tune.open_storage(str(journal)))
    after = {t.number: t for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))}
    assert len(after) >= 6
    for t in before:  # every trial finished before the kill is still there, unchanged
        assert after[t.number].params == t.params and after[t.number].value == t.value


def finished_study(storage, name: str, trials: int):
    """A study in `storage` with `trials` finished trials that passed, as a run before this one left it."""
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    config = KernelConfig(16, 16, 4, 1).as_dict()
    distributions = {n: optuna.distributions.CategoricalDistribution([v]) for n, v in config.items()}
    for i in range(trials):
        study.add_trial(optuna.trial.create_trial(params=config, distributions=distributions, value=1.0 + i,
                                                  user_attrs={"status": "ok", "ms": 2.0, "tflops": 1.0 + i}))
    return study


def test_a_study_with_enough_trials_says_so_and_fresh_starts_over(tmp_path):
    """`--trials 3` on a study that has 5 says why it runs none; `--fresh` starts it over and keeps the old one."""
    storage = tune.open_storage(str(tmp_path / "cache" / "tune" / "studies.journal"))
    name = Problem(mask="causal", dtype="fp16", batch=1, heads=2, kv_heads=2, seq_len=48,
                   head_dim=16).study_name("interpreter")
    finished_study(storage, name, 5)
    options = ("--mask", "causal", "--seq-len", "48", "--head-dim", "16", "--jobs", "1")
    r = run_tune(tmp_path, *options, "--trials", "3")
    assert r.returncode == 0, r.stderr
    assert (f"attngen tune: study {name} already has 5 finished trials; --trials 3 asks for none more; raise "
            "--trials or pass --fresh to start over") in r.stderr
    assert "1 of 1 problems have a winner" in r.stdout  # the old winner, recorded
    r = run_tune(tmp_path, *options, "--trials", "1", "--fresh")
    assert r.returncode == 0, r.stderr
    (kept,) = [s.study_name for s in optuna.get_all_study_summaries(storage) if s.study_name != name]
    assert kept.startswith(f"{name}@")
    assert f"attngen tune: --fresh: study {name} starts over; its 5 trials are kept as study {kept}" in r.stderr
    assert len(optuna.load_study(study_name=kept, storage=storage).trials) == 5  # nothing lost
    new = optuna.load_study(study_name=name, storage=storage).get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(new) == 1
    # stderr is not a terminal here: one progress line per finished trial, no redrawn bar
    assert "\r" not in r.stderr
    assert "[1/1] causal(align='top_left') fp16 d16 s48: 1/1 trials, " in r.stderr


def test_workers_share_one_study(tmp_path):
    """--workers 2: two processes on the default journal storage split one study's trials."""
    r = run_tune(tmp_path, "--mask", "none", "--trials", "6", "--jobs", "1", "--workers", "2", "--seq-len", "32",
                 "--head-dim", "16")
    assert r.returncode == 0, r.stderr
    assert "1 of 1 problems have a winner" in r.stdout
    name = Problem(mask="none", dtype="fp16", batch=1, heads=2, kv_heads=2, seq_len=32,
                   head_dim=16).study_name("interpreter")
    study = optuna.load_study(study_name=name,
                              storage=tune.open_storage(str(tmp_path / "cache" / "tune" / "studies.journal")))
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert 6 <= len(done) <= 8 and len({t.number for t in done}) == len(done)
    assert len({t.user_attrs["worker"] for t in done}) == 2  # both workers ran trials


BAD_OPTIONS = [
    (["--interpret", "--gpu", "h100"], "interpreter results are kept under the 'interpreter' key"),
    (["--interpret", "--dtype", "bf16"], "bf16 cannot run under the interpreter"),
    (["--interpret", "--mask", "document"], "missing parameter 'doc_ids'"),
    (["--interpret", "--kernel", "backward"], "argument --kernel: invalid choice: 'backward' (choose from "),
    (["--interpret", "--heads", "3", "--kv-heads", "2"], "--heads 3 is not a multiple of --kv-heads 2"),
    (["--interpret", "--trials", "0"], "--trials, --jobs and --workers must be >= 1"),
    (["--interpret", "--mask", "nope"], "unknown mask 'nope'"),
    (["--interpret", "--topk", "2000"], "--topk must be between 1 and 1024"),
    (["--interpret", "--topk", "x"], "--topk"),
    (["--interpret", "--space", "backward"], "backward.yaml is a space for 'bwd' kernels, not 'fwd'"),
    (["--interpret", "--kernel", "decode", "--topk", "8"], "--topk: the decode kernels have no top-k softmax"),
    (["--interpret", "--batch", "2,x"], "--batch"),
] + ([] if torch.cuda.is_available() else [([], "no CUDA device found: tune on the target GPU, or pass --interpret")])

# attngen's command line (cli.main, what `python -m attngen` runs) on every bad option list, in one process
# of its own under the interpreter: (exit code, stderr) of each
BAD_OPTIONS_RUN = """
import contextlib, io, json, sys
from attngen import cli
results = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = cli.main(["tune", *args])
        except SystemExit as e:  # argparse's own errors
            code = e.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def bad_option_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_options")
    r = subprocess.run([sys.executable, "-c", BAD_OPTIONS_RUN, json.dumps([args for args, _ in BAD_OPTIONS])],
                       env=cli_env(tmp, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300, cwd=tmp)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", range(len(BAD_OPTIONS)), ids=[" ".join(args) or "no GPU" for args, _ in BAD_OPTIONS])
def test_tune_bad_options(bad_option_results, case):
    code, stderr = bad_option_results[case]
    assert code == 2 and BAD_OPTIONS[case][1] in stderr, stderr


def test_tune_help_lists_the_options_and_the_kernel_families(tmp_path):
    r = subprocess.run(attngen_cmd("tune", "--help"), capture_output=True, text=True, cwd=tmp_path)
    for option in ("--mask", "--dtype", "--head-dim", "--seq-len", "--kv-heads", "--kernel", "--sampler",
                   "--storage", "--workers", "--interpret", "--out", "--timeout", "--topk", "--space"):
        assert option in r.stdout
    assert "--direction" not in r.stdout
    text = " ".join(r.stdout.split())  # argparse wraps the help
    assert "--kernel {fwd,bwd,decode,all}" in text
    for family in FAMILIES.values():
        assert f"{family.name}: {family.doc}" in text


def test_kernel_all_tunes_every_family():
    args = cli.build_parser().parse_args(["tune", "--interpret", "--kernel", "all", "--head-dim", "32,64"])
    tune.fill_defaults(args)
    problems = tune.problems_from_args(args)
    assert [(p.kernel, p.head_dim) for p in problems] == [(k, d) for k in FAMILIES for d in (32, 64)]
    args = cli.build_parser().parse_args(["tune", "--interpret"])
    tune.fill_defaults(args)
    assert [p.kernel for p in tune.problems_from_args(args)] == ["fwd"]  # the default


def test_new_studies_start_at_the_fallback_the_dispatcher_would_run(tmp_path, monkeypatch):
    """A dense or causal backward falls back to the bwd_dense table, other masks to bwd: a study
    starts from the one its calls would run (sm90, D 128: 64x128 w8 s3 against 64x64 w4 s2)."""
    monkeypatch.setenv("ATTNGEN_USER_REGISTRY", str(tmp_path / "user"))
    space = find_space("backward", "bwd")
    settings = tune.Settings(gpu="interpreter", device_name="x", device="cpu", arch="sm90", trials=1, timeout=None,
                             sampler="tpe", seed=0, storage=None, jobs=1, compile_timeout=60, out=tmp_path / "out")
    for mask, table in (("causal", "bwd_dense"), ("none", "bwd_dense"), ("sliding_window(window=512)", "bwd")):
        problem = Problem(mask=mask, dtype="bf16", batch=4, heads=16, kv_heads=16, seq_len=4096, head_dim=128,
                          kernel="bwd")
        assert tune.starting_points(problem, settings, space)[0] == default_config(table, "sm90", 128), mask
    assert default_config("bwd_dense", "sm90", 128) != default_config("bwd", "sm90", 128)


def test_gp_sampler_needs_scipy():
    try:
        import scipy  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="--sampler gp needs scipy"):
            tune.make_sampler("gp", {}, 0, 10)
    else:
        assert isinstance(tune.make_sampler("gp", {}, 0, 10), optuna.samplers.GPSampler)


def test_new_studies_start_from_the_registry_and_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_USER_REGISTRY", str(tmp_path / "user"))
    space = find_space("forward", "fwd")
    settings = tune.Settings(gpu="interpreter", device_name="x", device="cpu", arch="interpreter", trials=1,
                             timeout=None, sampler="tpe", seed=0, storage=None, jobs=1, compile_timeout=60,
                             out=tmp_path / "out")
    fallback = default_config("fwd", "interpreter", PROBLEM.head_dim)
    assert tune.starting_points(PROBLEM, settings, space) == [fallback]
    tuned = KernelConfig(16, 32, 4, 2, use_tma=True)
    entry = registry.Entry(key=PROBLEM.entry_key(), revision=PROBLEM.family.revision, config=tuned.as_dict(), ms=1.0, tflops=1.0, sdpa_ms=None,
                           trials=3, triton="3.6.0", torch="2.13.0", date="2026-11-29")
    registry.write_entries(tmp_path / "out" / "interpreter.yaml", [entry], "interpreter", "x")
    assert tune.starting_points(PROBLEM, settings, space) == [tuned, fallback]
    # then the space's own starting configs, in order, without repeats and only inside its values
    extra, outside = KernelConfig(16, 16, 4, 1), KernelConfig(16, 16, 8, 1)
    space = dataclasses.replace(space, start={"interpreter": (fallback, extra, outside)})
    assert tune.starting_points(PROBLEM, settings, space) == [tuned, fallback, extra]
    assert tune.space_for(PROBLEM, settings).path.name == "forward.yaml"
    topk = dataclasses.replace(PROBLEM, topk=8)
    assert tune.space_for(topk, settings).path.name == "forward_topk.yaml"


def test_summary_shows_configs_and_says_why_a_problem_has_no_winner():
    study = optuna.create_study(direction="maximize")
    for reason in ("exit 1: CompilationError: out of shared memory", "relative error 1e-1 against the float64 "
                   "reference", "exit 1: CompilationError: out of shared memory"):
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, user_attrs={"reason": reason}))
    text = tune.summary_table([(PROBLEM, study, None)])
    assert "no config passed" in text
    assert f"{PROBLEM.variant} fp16 d32 s40: 2 of 3 trials: exit 1: CompilationError: out of shared memory" in text
    assert "no trial finished" in tune.summary_table([(PROBLEM, optuna.create_study(), None)])
    entry = registry.Entry(key=PROBLEM.entry_key(), revision=1, config=KernelConfig(32, 16, 4, 2, use_tma=True).as_dict(),
                           ms=2.0,
                           tflops=1.5, sdpa_ms=3.0, trials=3, triton="3.6.0", torch="2.13.0", date="2026-11-29")
    won = tune.summary_table([(PROBLEM, None, entry)]).splitlines()
    assert won[0].split() == ["kernel", "mask", "dtype", "D", "S", "B", "H/Hkv", "config", "ms", "TFLOP/s", "SDPA",
                              "ms", "SDPA", "speedup"]
    assert won[2].split() == ["fwd", "causal(align='top_left')", "fp16", "32", "40", "1", "2/1", "32x16", "w4", "s2",
                              "tma", "2", "1.5", "3", "1.50x"]


@pytest.mark.parametrize("triton_version,numpy_version,known", [
    ("3.6.0", "2.5.2", True), ("3.6.1", "2.4.0", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.5.0", False),
    ("3.6.0", "2.4.0rc1", True),
])
def test_known_interpreter_failure_is_named(triton_version, numpy_version, known):
    message = interpreter_numpy_problem(triton_version, numpy_version)
    assert (message is not None) == known
    if known:
        assert "numpy<2.4" in message and numpy_version in message
