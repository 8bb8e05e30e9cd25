"""`attngen tune --storage postgresql://...`: two workers share one Optuna study, and a later run resumes it.

Runs where ATTNGEN_TEST_POSTGRES_URL names a database the test may write to (.ci/run starts a server for it).
"""

import os
import socket
import subprocess
import sys
import time

import pytest
import yaml

from attngen import cli
from attngen.tuning import objective, tune

URL = os.environ.get("ATTNGEN_TEST_POSTGRES_URL", "")
TRIALS = 8
TUNE = ["tune", "--interpret", "--mask", "causal", "--trials", str(TRIALS), "--storage", URL]
TIMEOUT = 240.0  # seconds for the two workers together, and again for the final run

pytestmark = [
    pytest.mark.skipif(not URL, reason="needs ATTNGEN_TEST_POSTGRES_URL, the SQLAlchemy URL of a PostgreSQL database "
                                       "the test may write to, e.g. postgresql+psycopg2://user:password@127.0.0.1/db "
                                       "(.ci/run starts one)"),
    pytest.mark.filterwarnings("ignore:Argument ``heartbeat_interval`` is an experimental feature"),  # tune's storage
]


def study_name() -> str:
    """The study the TUNE command line runs, named the way attngen tune names it."""
    args = cli.build_parser().parse_args(TUNE)
    tune.fill_defaults(args)
    (problem,) = tune.problems_from_args(args)
    return problem.study_name("interpreter")


def start(tmp_path, name, *args):
    """`python -m attngen ARGS` with its cache and user registry under tmp_path; output in tmp_path/NAME.log."""
    env = dict(os.environ, ATTNGEN_CACHE_DIR=str(tmp_path / "cache"), ATTNGEN_USER_REGISTRY=str(tmp_path / "registry"))
    log = tmp_path / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "attngen", *args], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    return proc, log


def wait_all(runs):
    """Wait for every run to exit 0 within TIMEOUT; none is left running."""
    deadline = time.monotonic() + TIMEOUT
    try:
        for proc, log in runs:
            try:
                code = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{log.stem} still running after {TIMEOUT:.0f}s:\n{log.read_text()[-3000:]}")
            assert code == 0, f"{log.stem} exited {code}:\n{log.read_text()[-3000:]}"
    finally:
        for proc, _ in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_two_workers_share_a_study_that_a_later_run_resumes(tmp_path):
    import optuna

    State = optuna.trial.TrialState
    name = study_name()
    storage = tune.open_storage(URL)
    try:  # a fresh study each run; this also creates Optuna's tables before two workers race to do it
        optuna.delete_study(study_name=name, storage=storage)
    except KeyError:
        pass

    # two workers at once, as on two hosts: each runs trials until the study has TRIALS finished ones
    workers = [start(tmp_path, f"worker{seed}", *TUNE, "--jobs", "1", "--seed", str(seed), "--worker-only")
               for seed in (1, 2)]
    wait_all(workers)
    assert not (tmp_path / "registry").exists(), "--worker-only must write nothing"

    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == State.COMPLETE]
    # each worker may finish the one trial it has in flight when the other reaches the target
    assert TRIALS <= len(complete) <= TRIALS + len(workers), [t.state.name for t in trials]
    assert len({t.number for t in trials}) == len(trials)
    assert not [(t.number, t.state.name) for t in trials if t.state in (State.RUNNING, State.FAIL)]
    statuses = {objective.OK, objective.INVALID, objective.FAILED, objective.WRONG}
    assert all(t.user_attrs.get("status") in statuses for t in complete), [t.user_attrs for t in complete]
    host = socket.gethostname()
    assert {t.user_attrs.get("worker") for t in complete} == {f"{host}:{proc.pid}" for proc, _ in workers}

    # the plain command resumes the finished study (no new trials) and writes its winner
    wait_all([start(tmp_path, "finish", *TUNE)])
    assert len(optuna.load_study(study_name=name, storage=storage).trials) == len(trials)
    written = yaml.safe_load((tmp_path / "registry" / "interpreter.yaml").read_text())
    assert written["gpu"] == "interpreter"
    assert len(written["entries"]) == 1
    (entry,) = written["entries"]
    assert entry["config"] == tune.best_trial(study).params
    assert entry["trials"] == len(complete)
