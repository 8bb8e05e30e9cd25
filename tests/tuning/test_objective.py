"""One trial of the tuner: the static rules, the correctness gate against the float64 reference,
repeated configs, and the winner (CPU, interpreter)."""

import dataclasses

import optuna
import pytest
import torch

from attngen.config import KernelConfig
from attngen.tuning import objective as objective_
from attngen.tuning import tune
from attngen.tuning.objective import FAILED, INVALID, OK, WRONG, Objective, Problem
from attngen.tuning.space import load_space
from helpers import DEVICE, GOOD_SPACE

PROBLEM = Problem(mask="causal", dtype="fp16", batch=1, heads=2, kv_heads=1, seq_len=40, head_dim=32)


@pytest.fixture
def objective(tmp_path, monkeypatch):
    monkeypatch.setattr(objective_, "compile_in_child", lambda problem, config, timeout: None)  # no child process
    path = tmp_path / "space.yaml"
    path.write_text(GOOD_SPACE)
    return Objective(PROBLEM, load_space(path), "interpreter", DEVICE, 60)


def test_problem_names_its_study_and_registry_key():
    assert PROBLEM.kernel == "fwd" and PROBLEM.group == 2 and PROBLEM.variant == "causal(align='top_left')"
    assert PROBLEM.study_name("h200") == "attngen/h200/fwd/r1/causal(align='top_left')/fp16/d32/s40/b1h2kv1"
    key = PROBLEM.entry_key()
    assert (key.kernel, key.seq_bucket, key.group) == ("fwd", 64, 2)
    topk = Problem(mask="none", dtype="fp16", batch=1, heads=2, kv_heads=2, seq_len=40, head_dim=32, topk=8)
    assert topk.variant == "topk(8)" and topk.effective_topk == 8
    assert dataclasses.replace(topk, topk=40).variant == "none"  # K >= S is plain softmax


def test_static_rules_reject_before_compiling(objective, monkeypatch):
    def never(*args):
        raise AssertionError("an invalid config must not be compiled")
    monkeypatch.setattr(objective_, "compile_in_child", never)
    study = optuna.create_study(direction="maximize")
    status, reason, _ = objective.evaluate(study, 0, KernelConfig(64, 16, 4, 1))
    assert status == INVALID and "too big for this test" in reason
    objective.smem_limit = 4096
    status, reason, _ = objective.evaluate(study, 0, KernelConfig(16, 16, 4, 4))
    assert status == INVALID and "shared memory" in reason and "the device has 4096" in reason


def test_warp_specialized_forward_trials_are_refused(objective):
    """triton 3.6's warp specialization hung or gave wrong outputs on sm_90: such a trial is refused
    before compiling (KernelConfig.problems), never timed."""
    study = optuna.create_study(direction="maximize")
    status, reason, _ = objective.evaluate(study, 0, KernelConfig(16, 16, 4, 1, use_tma=True, warp_specialize=True))
    assert status == INVALID and "warp_specialize is not supported" in reason


def test_a_config_that_does_not_compile_fails(objective, monkeypatch):
    monkeypatch.setattr(objective_, "compile_in_child", lambda problem, config, timeout: "exit 1: out of registers")
    study = optuna.create_study(direction="maximize")
    status, reason, result = objective.evaluate(study, 0, KernelConfig(16, 16, 4, 1))
    assert (status, reason, result) == (FAILED, "exit 1: out of registers", {})


def test_wrong_results_fail_and_never_win(objective):
    study = optuna.create_study(direction="maximize")
    good = objective.evaluate(study, 0, KernelConfig(16, 16, 4, 1))
    assert good[0] == OK and good[2]["tflops"] > 0 and good[2]["error"] < 3e-3
    real = objective.runner
    objective.runner = lambda config: lambda *tensors: [out * 1.01 for out in real(config)(*tensors)]  # 1% off
    status, reason, result = objective.evaluate(study, 1, KernelConfig(32, 16, 4, 1))
    assert status == WRONG and "against the float64 reference" in reason, reason
    objective.runner = lambda config: lambda q, k, v: [torch.full_like(q, float("nan"))]
    assert objective.evaluate(study, 2, KernelConfig(32, 16, 4, 1))[0] == WRONG


def test_best_trial_is_the_fastest_correct_one():
    study = optuna.create_study(direction="maximize")
    dist = {"block_m": optuna.distributions.CategoricalDistribution([16, 32, 64])}
    for value, status, bm in ((5.0, OK, 16), (50.0, WRONG, 32), (7.0, OK, 64), (90.0, FAILED, 32)):
        study.add_trial(optuna.trial.create_trial(params={"block_m": bm}, distributions=dist, value=value,
                                                  user_attrs={"status": status, "tflops": value}))
    assert tune.best_trial(study).params == {"block_m": 64}


def test_repeated_configs_are_not_measured_twice(objective):
    study = optuna.create_study(direction="maximize")
    dist = {n: optuna.distributions.CategoricalDistribution(v) for n, v in objective.values.items()}
    config = KernelConfig(16, 16, 4, 1)
    study.add_trial(optuna.trial.create_trial(params=config.as_dict(), distributions=dist, value=3.0,
                                              user_attrs={"status": OK, "tflops": 3.0, "ms": 1.0}))
    objective.runner = None  # would fail if called
    status, _, result = objective.evaluate(study, 1, config)
    assert status == OK and result["tflops"] == 3.0 and result["repeat_of"] == 0


@pytest.mark.parametrize("kernel, module, plan", [("fwd", "forward", "Plan"), ("bwd", "backward", "BackwardPlan"),
                                                  ("decode", "decode", "DecodePlan")])
def test_trials_time_a_plan_built_once(tmp_path, monkeypatch, kernel, module, plan):
    """Building a call's plan takes longer on the host than a short call's kernels run on the GPU, so
    a trial builds it once and checks and times its launches: one plan for the gate and every timed
    call (building one per call made an H100's tuner read 264 µs for a 97 µs decode call)."""
    import importlib

    cls = getattr(importlib.import_module(f"attngen.kernels.{module}"), plan)
    monkeypatch.setattr(objective_, "compile_in_child", lambda problem, config, timeout: None)
    path = tmp_path / "space.yaml"
    path.write_text(GOOD_SPACE.replace("kernel: fwd", f"kernel: {kernel}"))
    problem = Problem(mask="sliding_window(window=24)", dtype="fp16", batch=2, heads=4, kv_heads=2, seq_len=40,
                      head_dim=32, kernel=kernel)
    objective = Objective(problem, load_space(path), "interpreter", DEVICE, 60)
    built, calls = [], []
    real_init, real_run = cls.__init__, cls.run
    monkeypatch.setattr(cls, "__init__", lambda self, *a, **kw: built.append(1) or real_init(self, *a, **kw))
    monkeypatch.setattr(cls, "run", lambda self, *a, **kw: calls.append(1) or real_run(self, *a, **kw))
    status, reason, result = objective.evaluate(optuna.create_study(direction="maximize"), 0, KernelConfig(16, 16, 4, 1))
    assert status == OK, reason
    assert result["error"] < 3e-3
    assert len(built) == 1 and len(calls) >= 4  # the gate's call and median_ms's warm-up and three timed calls
