"""The tuner, the search spaces and the dispatcher's use of the registry (CPU, interpreter)."""

import importlib.metadata
import os
import signal
import subprocess
import sys
import time

import numpy
import optuna
import pytest
import torch

import attngen
from attngen import dispatch, registry, tune
from attngen.checks import interpreter_numpy_problem
from attngen.config import KernelConfig
from attngen.space import SpaceError, default_space, load_space
from conftest import DEVICE

GOOD_SPACE = """\
template: attention_fwd.py.jinja
direction: fwd
arch:
  interpreter:
    block_m: [16, 32]
    block_n: [16]
    num_warps: [4]
    num_stages: [1]
    use_tma: [false]
    warp_specialize: [false]
constraints:
  - {expr: "block_m * block_d <= 1024", why: too big for this test}
"""


def env_for(tmp_path, **extra):
    env = dict(os.environ, ATTNGEN_CACHE_DIR=str(tmp_path / "cache"), ATTNGEN_USER_REGISTRY=str(tmp_path / "reg"),
               PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # `attngen tune --interpret` sets it itself
    env.update(extra)
    return env


def attngen_cmd(*args):
    return [sys.executable, "-m", "attngen", *args]


def run_tune(tmp_path, *args):
    """`attngen tune --interpret ARGS` in its own process, with the test's cache and registry."""
    return subprocess.run(attngen_cmd("tune", "--interpret", *args), env=env_for(tmp_path), capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)


# ---------------------------------------------------------------------------------------
# search spaces
# ---------------------------------------------------------------------------------------
def test_shipped_space_parses():
    space = default_space("fwd")
    for arch in ("sm90", "sm80", "generic", "interpreter"):
        assert space.size(arch) > 1
    assert space.violations(KernelConfig(64, 64, 4, 2, use_tma=False, warp_specialize=True), head_dim=64,
                            elem_bytes=2, seq_len=1024) == ["warp specialization is only tried with tensor-descriptor loads"]


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace("direction: fwd\n", ""), "missing 'direction'"),
    (lambda s: s.replace("block_n: [16]", "block_n: [24]"), "powers of two >= 16, got 24"),
    (lambda s: s.replace("block_n: [16]", "block_n: 16"), "block_n must be a list of distinct int values"),
    (lambda s: s.replace("use_tma: [false]", "use_tma: [0]"), "use_tma must be a list of distinct bool values"),
    (lambda s: s.replace("    warp_specialize: [false]\n", ""), "must list exactly block_m"),
    (lambda s: s + "extra: 1\n", "unknown key"),
    (lambda s: s.replace("block_m * block_d <= 1024", "block_m * nonsense"), "unknown name 'nonsense'"),
    (lambda s: s.replace("why: too big for this test", "because: x"), "exactly `expr` and `why`"),
    (lambda s: "arch: [unclosed", "cannot read search space"),
])
def test_bad_space_files_are_rejected(tmp_path, edit, message):
    path = tmp_path / "space.yaml"
    path.write_text(edit(GOOD_SPACE))
    with pytest.raises(SpaceError, match=message) as info:
        load_space(path)
    assert str(path) in str(info.value)


# ---------------------------------------------------------------------------------------
# the objective: constraints, the correctness gate, the winner
# ---------------------------------------------------------------------------------------
PROBLEM = tune.Problem(mask="causal", dtype="fp16", batch=1, heads=2, kv_heads=1, seq_len=40, head_dim=32)


@pytest.fixture
def objective(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "compile_in_child", lambda problem, config, timeout: None)
    path = tmp_path / "space.yaml"
    path.write_text(GOOD_SPACE)
    return tune.Objective(PROBLEM, load_space(path), "interpreter", DEVICE, 60)


def test_static_rules_reject_before_compiling(objective, monkeypatch):
    def never(*args):
        raise AssertionError("an invalid config must not be compiled")
    monkeypatch.setattr(tune, "compile_in_child", never)
    study = optuna.create_study(direction="maximize")
    status, reason, _ = objective.evaluate(study, 0, KernelConfig(64, 16, 4, 1))
    assert status == tune.INVALID and "too big for this test" in reason
    objective.smem_limit = 4096
    status, reason, _ = objective.evaluate(study, 0, KernelConfig(16, 16, 4, 4))
    assert status == tune.INVALID and "shared memory" in reason and "the device has 4096" in reason


def test_wrong_results_fail_and_never_win(objective):
    study = optuna.create_study(direction="maximize")
    good = objective.evaluate(study, 0, KernelConfig(16, 16, 4, 1))
    assert good[0] == tune.OK and good[2]["tflops"] > 0 and good[2]["error"] < 3e-3
    real = objective.run
    objective.run = lambda q, k, v, config: real(q, k, v, config) * 1.01  # a kernel that is 1% off
    status, reason, result = objective.evaluate(study, 1, KernelConfig(32, 16, 4, 1))
    assert status == tune.WRONG and "against the float64 reference" in reason
    objective.run = lambda q, k, v, config: torch.full_like(q, float("nan"))
    assert objective.evaluate(study, 2, KernelConfig(32, 16, 4, 1))[0] == tune.WRONG


def test_best_trial_is_the_fastest_correct_one():
    study = optuna.create_study(direction="maximize")
    dist = {"block_m": optuna.distributions.CategoricalDistribution([16, 32, 64])}
    for value, status, bm in ((5.0, tune.OK, 16), (50.0, tune.WRONG, 32), (7.0, tune.OK, 64), (90.0, tune.FAILED, 32)):
        study.add_trial(optuna.trial.create_trial(params={"block_m": bm}, distributions=dist, value=value,
                                                  user_attrs={"status": status, "tflops": value}))
    assert tune.best_trial(study).params == {"block_m": 64}


def test_repeated_configs_are_not_measured_twice(objective, monkeypatch):
    study = optuna.create_study(direction="maximize")
    dist = {n: optuna.distributions.CategoricalDistribution(v) for n, v in objective.values.items()}
    config = KernelConfig(16, 16, 4, 1)
    study.add_trial(optuna.trial.create_trial(params=config.as_dict(), distributions=dist, value=3.0,
                                              user_attrs={"status": tune.OK, "tflops": 3.0, "ms": 1.0}))
    objective.run = None  # would fail if called
    status, _, result = objective.evaluate(study, 1, config)
    assert status == tune.OK and result["tflops"] == 3.0 and result["repeat_of"] == 0


# ---------------------------------------------------------------------------------------
# the command, end to end
# ---------------------------------------------------------------------------------------
def test_tune_writes_a_registry_the_dispatcher_uses(tmp_path):
    env = env_for(tmp_path)
    r = run_tune(tmp_path, "--mask", "causal", "--trials", "4", "--jobs", "2", "--seq-len", "48", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "running under Triton's interpreter" in r.stderr
    assert "1 of 1 problems have a winner" in r.stdout and "causal(align='top_left')" in r.stdout
    file = registry.load_file(tmp_path / "reg" / "interpreter.yaml")
    (entry,) = file.entries.values()
    assert entry.key.seq_bucket == 64 and entry.key.head_dim == 32 and entry.trials >= 4
    # a new process: the dispatcher finds the entry and runs its config
    check = subprocess.run([sys.executable, "-c", """
import os, torch, attngen
q = torch.randn(1, 2, 50, 32).half()
print(attngen.explain(q, q, q, mask="causal"))
print(attngen.dispatch.choose(q, q, q, "causal").config.as_dict())
"""], env=dict(env, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert f"registry: exact entry in {tmp_path / 'reg' / 'interpreter.yaml'}" in check.stdout
    assert str(entry.config) in check.stdout
    shown = subprocess.run(attngen_cmd("registry", "show"), env=env, capture_output=True, text=True)
    assert "causal(align='top_left')" in shown.stdout and "interpreter.yaml" in shown.stdout


INTERPRETER_PROBLEM = interpreter_numpy_problem(importlib.metadata.version("triton"), numpy.__version__)


@pytest.mark.skipif(INTERPRETER_PROBLEM is not None, reason=str(INTERPRETER_PROBLEM))
def test_tune_topk_variants_reach_the_dispatcher(tmp_path):
    """`--topk 8`: its own variant, space and correctness gate (the top-k reference), used by topk calls only."""
    env = env_for(tmp_path)
    r = run_tune(tmp_path, "--topk", "8", "--trials", "2", "--jobs", "2", "--seq-len", "40", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "\ntopk(8) " in r.stdout and "1 of 1 problems have a winner" in r.stdout
    (entry,) = registry.load_file(tmp_path / "reg" / "interpreter.yaml").entries.values()
    assert entry.key.variant == "topk(8)"
    check = subprocess.run([sys.executable, "-c", """
import torch, attngen
q = torch.randn(1, 2, 40, 32).half()
print(attngen.explain(q, q, q, topk=7))
print(attngen.explain(q, q, q))
"""], env=dict(env, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    with_topk, plain = check.stdout.splitlines()
    assert "variant topk(8)" in with_topk and "registry: exact entry" in with_topk
    assert str(entry.kernel_config()) in with_topk
    assert "no registry entry" in plain  # plain softmax is another variant: not tuned here


def test_topk_space_rules():
    space = tune.find_space(tune.TOPK_SPACE)
    # no per-row buffer beside the tile: a wide query tile is allowed whatever K
    assert space.violations(KernelConfig(128, 64, 4, 2), head_dim=128, elem_bytes=2, seq_len=4096, topk_pad=256) == []
    assert space.violations(KernelConfig(128, 64, 4, 2), head_dim=256, elem_bytes=2, seq_len=4096, topk_pad=256) == [
        "the fp32 accumulator would take over 128 registers a thread and spill"]


def test_killed_tuner_resumes_without_losing_trials(tmp_path):
    env = env_for(tmp_path)
    args = attngen_cmd("tune", "--interpret", "--mask", "none", "--trials", "8", "--jobs", "1", "--seq-len", "40")
    proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    storage = None
    name = tune.Problem(mask="none", dtype="fp16", batch=1, heads=2, kv_heads=2, seq_len=40,
                        head_dim=32).study_name("interpreter")
    journal = tmp_path / "cache" / "tune" / "studies.journal"
    deadline = time.time() + 240
    before = []
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
        if journal.exists():
            storage = tune.open_storage(str(journal))
            try:
                study = optuna.load_study(study_name=name, storage=storage)
            except KeyError:
                continue
            before = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
            if len(before) >= 3:
                break
    assert proc.poll() is None, "the tuner finished before it could be killed; make the study longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(before) >= 3
    r = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    study = optuna.load_study(study_name=name, storage=tune.open_storage(str(journal)))
    after = {t.number: t for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))}
    assert len(after) >= 8
    for t in before:  # every trial finished before the kill is still there, unchanged
        assert after[t.number].params == t.params and after[t.number].value == t.value


@pytest.mark.parametrize("args,message", [
    (["--interpret", "--gpu", "h100"], "interpreter results are kept under the 'interpreter' key"),
    (["--interpret", "--dtype", "bf16"], "bf16 cannot run under the interpreter"),
    (["--interpret", "--mask", "document"], "missing parameter 'doc_ids'"),
    (["--interpret", "--direction", "bwd"], "only the forward kernel exists so far"),
    (["--interpret", "--heads", "3", "--kv-heads", "2"], "--heads 3 is not a multiple of --kv-heads 2"),
    (["--interpret", "--trials", "0"], "--trials, --jobs and --workers must be >= 1"),
    (["--interpret", "--mask", "nope"], "unknown mask 'nope'"),
    (["--interpret", "--topk", "2000"], "--topk must be between 1 and 1024"),
    (["--interpret", "--topk", "x"], "--topk"),
] + ([] if torch.cuda.is_available() else [([], "no CUDA device found: tune on the target GPU, or pass --interpret")]))
def test_tune_bad_options(tmp_path, args, message):
    r = subprocess.run(attngen_cmd("tune", *args), env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_tune_help_lists_the_matrix_options():
    r = subprocess.run(attngen_cmd("tune", "--help"), capture_output=True, text=True)
    for option in ("--mask", "--dtype", "--head-dim", "--seq-len", "--kv-heads", "--direction", "--sampler",
                   "--storage", "--workers", "--interpret", "--out", "--timeout", "--topk"):
        assert option in r.stdout


def test_gp_sampler_needs_scipy():
    try:
        import scipy  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="--sampler gp needs scipy"):
            tune.make_sampler("gp", {}, 0, 10)
    else:
        assert isinstance(tune.make_sampler("gp", {}, 0, 10), optuna.samplers.GPSampler)


# ---------------------------------------------------------------------------------------
# the dispatcher and the registry
# ---------------------------------------------------------------------------------------
def _entry(seq_bucket, config, variant="none", tflops=1.0):
    key = registry.EntryKey(variant=variant, direction="fwd", dtype="fp16", head_dim=32, seq_bucket=seq_bucket,
                            group=1)
    return registry.Entry(key=key, config=config.as_dict(), ms=1.0, tflops=tflops, sdpa_ms=None, trials=3,
                          triton="3.6.0", torch="2.13.0", date="2026-11-29")


@pytest.fixture
def clean_dispatch():
    yield
    dispatch.use_registry(None)


def test_dispatcher_prefers_registry_then_nearest_bucket_then_defaults(tmp_path, clean_dispatch):
    gpu = dispatch.gpu_of(torch.device(DEVICE))
    config = KernelConfig(16, 16, 2, 1)
    registry.write_entries(tmp_path / f"{gpu}.yaml", [_entry(256, config)], gpu, "test")
    dispatch.use_registry(tmp_path)
    q = torch.randn(1, 2, 256, 32, device=DEVICE).half()
    exact = dispatch.choose(q, q, q)
    assert exact.config == config and "exact entry" in exact.source
    far = torch.randn(1, 2, 1500, 32, device=DEVICE).half()
    nearest = dispatch.choose(far, far, far)
    assert nearest.config == config and "nearest sequence bucket 256 (asked 2048)" in nearest.source
    other = dispatch.choose(q, q, q, "causal")
    assert "no registry entry" in other.source
    # one choice per bucket: sequence lengths inside a bucket share it
    a = torch.randn(1, 2, 200, 32, device=DEVICE).half()
    assert dispatch.choose(a, a, a) is dispatch.choose(q, q, q)
    out = attngen.attention(q, q, q)
    assert torch.allclose(out.double(), attngen.reference.attention(q, q, q), atol=2e-3)


def test_environment_variable_selects_the_registry(tmp_path, monkeypatch, clean_dispatch):
    gpu = dispatch.gpu_of(torch.device(DEVICE))
    config = KernelConfig(32, 16, 2, 1)
    registry.write_entries(tmp_path / f"{gpu}.yaml", [_entry(64, config)], gpu, "test")
    monkeypatch.setenv(dispatch.REGISTRY_ENV, str(tmp_path))
    dispatch.use_registry(None)
    q = torch.randn(1, 2, 64, 32, device=DEVICE).half()
    assert dispatch.choose(q, q, q).config == config
    assert str(tmp_path) in attngen.explain(q, q, q)


def test_corrupt_registry_warns_and_falls_back(tmp_path, clean_dispatch):
    gpu = dispatch.gpu_of(torch.device(DEVICE))
    (tmp_path / f"{gpu}.yaml").write_text("version: 1\nentries: [unclosed\n")
    dispatch.use_registry(tmp_path)
    q = torch.randn(1, 2, 64, 32, device=DEVICE).half()
    with pytest.warns(registry.RegistryWarning, match=f"{gpu}.yaml"):
        choice = dispatch.choose(q, q, q)
    assert "no registry entry" in choice.source
    out = attngen.attention(q, q, q)  # the call still runs, on the default config
    assert torch.allclose(out.double(), attngen.reference.attention(q, q, q), atol=2e-3)


def test_use_registry_needs_an_existing_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        attngen.use_registry(tmp_path / "missing")


def test_new_studies_start_from_the_registry_and_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "user_dir", lambda: tmp_path / "user")
    values = default_space("fwd").for_arch("interpreter")
    settings = tune.Settings(gpu="interpreter", device_name="x", device="cpu", arch="interpreter", trials=1,
                             timeout=None, sampler="tpe", seed=0, storage=None, jobs=1, compile_timeout=60,
                             out=tmp_path / "out")
    from attngen.config import default_config

    fallback = default_config("interpreter", PROBLEM.head_dim)
    assert tune.starting_points(PROBLEM, settings, values) == [fallback]
    tuned = KernelConfig(16, 32, 4, 2, use_tma=True)
    entry = registry.Entry(key=PROBLEM.entry_key(), config=tuned.as_dict(), ms=1.0, tflops=1.0, sdpa_ms=None,
                           trials=3, triton="3.6.0", torch="2.13.0", date="2026-11-29")
    registry.write_entries(tmp_path / "out" / "interpreter.yaml", [entry], "interpreter", "x")
    assert tune.starting_points(PROBLEM, settings, values) == [tuned, fallback]


def test_tensor_descriptors_get_an_allocator_in_every_thread():
    """Triton keeps its allocator per thread (ContextVar); the tuner times configs from worker threads."""
    import threading

    from triton.runtime import _allocation

    from attngen.kernels.forward import _ensure_allocator

    seen = []

    def work():
        before = _allocation._allocator.get() is _allocation._NULL_ALLOCATOR
        _ensure_allocator()
        seen.append((before, _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR))

    for _ in range(2):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert seen == [(True, True), (True, True)]


def test_fast_path_matches_the_checked_path(clean_dispatch):
    """The dispatcher's prepared launches (one per call signature) give what a fully checked call gives."""
    from attngen.kernels.forward import attention_forward

    q = torch.randn(1, 4, 70, 32, device=DEVICE).half()
    kv = torch.randn(1, 2, 90, 2, 32, device=DEVICE).half()
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]  # strided views
    for mask in (None, "causal", attngen.mask("sliding_window", window=9), attngen.mask("sliding_window", window=30)):
        for return_lse in (False, True):
            got = attngen.attention(q, k, v, mask=mask, return_lse=return_lse)
            again = attngen.attention(q, k, v, mask=mask, return_lse=return_lse)  # from the prepared plan
            config = dispatch.choose(q, k, v, mask).config
            want = attention_forward(q, k, v, mask, return_lse=True, config=config)
            for a in (got, again):
                out, lse = a if return_lse else (a, None)
                assert torch.equal(out, want[0])
                if return_lse:
                    assert torch.equal(lse, want[1])
    # new values of a mask's scalars get their own plan
    a = attngen.attention(q, k, v, mask=attngen.mask("sliding_window", window=9))
    b = attngen.attention(q, k, v, mask=attngen.mask("sliding_window", window=30))
    assert not torch.equal(a, b)


def test_workers_share_one_study(tmp_path):
    """--workers 2: two processes on the default journal storage split one study's trials."""
    r = run_tune(tmp_path, "--mask", "none", "--trials", "10", "--jobs", "1", "--workers", "2", "--seq-len", "32")
    assert r.returncode == 0, r.stderr
    assert "1 of 1 problems have a winner" in r.stdout
    name = tune.Problem(mask="none", dtype="fp16", batch=1, heads=2, kv_heads=2, seq_len=32,
                        head_dim=32).study_name("interpreter")
    study = optuna.load_study(study_name=name,
                              storage=tune.open_storage(str(tmp_path / "cache" / "tune" / "studies.journal")))
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert 10 <= len(done) <= 12 and len({t.number for t in done}) == len(done)
    assert len({t.user_attrs["worker"] for t in done}) == 2  # both workers ran trials


def test_summary_says_why_a_problem_has_no_winner():
    study = optuna.create_study(direction="maximize")
    for reason in ("exit 1: CompilationError: out of shared memory", "relative error 1e-1 against the float64 "
                   "reference", "exit 1: CompilationError: out of shared memory"):
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, user_attrs={"reason": reason}))
    text = tune.summary_table([(PROBLEM, study, None)])
    assert "no config passed" in text
    assert f"{PROBLEM.variant} fp16 d32 s40: 2 of 3 trials: exit 1: CompilationError: out of shared memory" in text
    assert "no trial finished" in tune.summary_table([(PROBLEM, optuna.create_study(), None)])


@pytest.mark.parametrize("triton_version,numpy_version,known", [
    ("3.6.0", "2.5.2", True), ("3.6.1", "2.4.0", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.5.0", False),
    ("3.6.0", "2.4.0rc1", True),
])
def test_known_interpreter_failure_is_named(triton_version, numpy_version, known):
    message = interpreter_numpy_problem(triton_version, numpy_version)
    assert (message is not None) == known
    if known:
        assert "numpy<2.4" in message and numpy_version in message
