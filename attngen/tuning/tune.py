"""`attngen tune`: search kernel configs with Optuna on the target GPU and record the winners.

One Optuna study per problem (kernel family, mask variant, dtype, head dim, sequence length,
batch, heads); a trial is attngen.tuning.objective's. Studies live in an Optuna storage (default:
a journal file under the cache dir), so running the same command again resumes them;
`--storage postgresql://...` shares them between hosts. Each problem's best correct trial is
written to the registry as soon as its study ends.
"""

from __future__ import annotations

import datetime
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..argtypes import comma_list
from ..checks import MAX_TOPK, Shape, interpreter_numpy_problem, interpreter_on
from ..config import KernelConfig, arch_of
from ..dtypes import DTYPES
from ..families import FAMILIES
from ..paths import cache_dir
from ..tools.progress import progress_bar
from . import registry as registry_
from .objective import OK, Objective, Problem
from .space import find_space

SAMPLERS = ("tpe", "gp", "random", "grid")


def default_storage_url() -> str:
    return str(cache_dir() / "tune" / "studies.journal")


def open_storage(url: str | None):
    """An Optuna storage: an RDB URL (sqlite:///, postgresql://...) or a journal file path."""
    import optuna

    url = url or default_storage_url()
    if "://" in url:
        import sqlalchemy.exc

        for attempt in range(5):
            try:
                return optuna.storages.RDBStorage(url, heartbeat_interval=60, grace_period=180)
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
                # workers starting together on a new database race to create Optuna's tables; one wins
                if attempt == 4:
                    raise
                time.sleep(0.5 + random.random())
    Path(url).parent.mkdir(parents=True, exist_ok=True)
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(url))


def make_sampler(name: str, values: dict, seed: int | None, trials: int):
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                          n_startup_trials=max(4, trials // 4))
    if name == "gp":
        try:
            import scipy  # noqa: F401
        except ImportError:
            raise ValueError("--sampler gp needs scipy (pip install scipy)") from None
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=max(4, trials // 4))
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(values, seed=seed)
    raise ValueError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {name!r}")


def best_trial(study):
    """The fastest trial that compiled, passed the correctness gate and was timed."""
    import optuna

    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if t.user_attrs.get("status") == OK]
    return max(done, key=lambda t: t.user_attrs["tflops"], default=None)


@dataclass
class Settings:
    gpu: str
    device_name: str
    device: str
    arch: str
    trials: int
    timeout: float | None
    sampler: str
    seed: int | None
    storage: str | None
    jobs: int
    compile_timeout: float
    out: Path
    space: str | None = None  # a file name in search_spaces/ or a path; None: the kernel family's default


def detect(args_gpu: str | None, interpret: bool) -> tuple[str, str, str]:
    """(gpu key, device name, device) of this machine; a --gpu that does not match is an error."""
    if interpret:
        if args_gpu not in (None, "interpreter"):
            raise ValueError(f"--gpu {args_gpu} with --interpret: interpreter results are kept under the "
                             "'interpreter' key, never mixed with a GPU's")
        return "interpreter", "Triton interpreter (CPU)", "cpu"
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device found: tune on the target GPU, or pass --interpret to try the pipeline "
                         "on the CPU under Triton's interpreter")
    name = torch.cuda.get_device_name()
    gpu = registry_.gpu_key(name)
    if args_gpu is not None and args_gpu != gpu:
        raise ValueError(f"--gpu {args_gpu} does not match this machine's GPU ({name!r} -> {gpu}); "
                         "configs must be tuned on the GPU that will run them")
    return gpu, name, "cuda"


def run_study(problem: Problem, settings: Settings, progress=None):
    """Create or resume the study of `problem` and run it to `settings.trials` finished trials; a
    study that already has them says so (on stderr) and runs none."""
    import optuna

    space = space_for(problem, settings)
    storage = open_storage(settings.storage)
    values = space.for_arch(settings.arch)
    name = problem.study_name(settings.gpu)
    study = optuna.create_study(study_name=name, storage=storage,
                                sampler=make_sampler(settings.sampler, values, settings.seed, settings.trials),
                                direction="maximize", load_if_exists=True)
    finished = lambda: len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))  # noqa: E731
    target = settings.trials if settings.sampler != "grid" else min(settings.trials, space.size(settings.arch))
    done = finished()
    if done >= target:
        say = progress.write if progress is not None else print
        if target < settings.trials:
            say(f"attngen tune: study {name} has measured all {target} points of its grid; pass --fresh to start "
                "over", file=sys.stderr)
        else:
            say(f"attngen tune: study {name} already has {done} finished trials; --trials {settings.trials} asks "
                "for none more; raise --trials or pass --fresh to start over", file=sys.stderr)
        return study
    objective = Objective(problem, space, settings.arch, settings.device, settings.compile_timeout)
    if "sdpa_ms" not in study.user_attrs:
        sdpa, how = objective.sdpa_ms()
        study.set_user_attr("sdpa_ms", sdpa)
        study.set_user_attr("sdpa", how)
        study.set_user_attr("flops", objective.flops)
        study.set_user_attr("problem", asdict(problem))
    if not study.get_trials(deepcopy=False):
        for config in starting_points(problem, settings, space):
            study.enqueue_trial(config.as_dict(), skip_if_exists=True)
    callbacks = [optuna.study.MaxTrialsCallback(target, states=(optuna.trial.TrialState.COMPLETE,))]
    if progress is not None:
        progress.reset(total=target)
        progress.update(min(target, finished()))
        lock = threading.Lock()  # callbacks run in the trials' threads (--jobs)

        def advance(study, trial):
            with lock:
                progress.update(min(target, finished()) - progress.n)
        callbacks.append(advance)
    study.optimize(objective, n_trials=None if settings.sampler != "grid" else target, timeout=settings.timeout,
                   n_jobs=settings.jobs, callbacks=callbacks, catch=())
    return study


def start_fresh(problems: list[Problem], settings: Settings) -> None:
    """--fresh: every problem's study starts over. An existing study is copied to
    `<name>@<date and time>` in the same storage first, then deleted: its trials stay there."""
    import optuna

    storage = open_storage(settings.storage)
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S.%f")
    for name in dict.fromkeys(p.study_name(settings.gpu) for p in problems):
        try:
            count = len(optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False))
        except KeyError:
            continue  # nothing to start over from
        kept = f"{name}@{stamp}"
        optuna.copy_study(from_study_name=name, from_storage=storage, to_storage=storage, to_study_name=kept)
        optuna.delete_study(study_name=name, storage=storage)
        print(f"attngen tune: --fresh: study {name} starts over; its {count} trials are kept as study "
              f"{kept}", file=sys.stderr)


def starting_points(problem: Problem, settings: Settings, space) -> list[KernelConfig]:
    """The first configs a new study tries: what the registries already hold for this problem
    (exact or nearest bucket, of any kernel revision: a config that won on the kernels before is a
    good first guess), the fallback the dispatcher would run it at (its family's DEFAULTS
    table for the call: bwd_dense for a dense backward, say), then the space's `start` configs; a
    search never ends worse than them."""
    values = space.for_arch(settings.arch)
    found = registry_.Registry.load([settings.out, registry_.user_dir(), registry_.shipped_dir()],
                                    settings.gpu).lookup(problem.entry_key(), None)  # any revision's config
    configs = [found[0].kernel_config()] if found else []
    shape = Shape(problem.batch, problem.heads, problem.kv_heads, problem.q_len, problem.seq_len, problem.head_dim)
    table = problem.family.table(shape, torch.device(settings.device), False, problem.mask_object())
    configs.append(problem.family.default(settings.arch, problem.head_dim, table)[0])  # the dispatcher's fallback
    configs.extend(space.start.get(settings.arch, ()))
    inside = [c for c in configs if all(getattr(c, n) in values[n] for n in values)]
    return list(dict.fromkeys(inside))


def winner_entry(problem: Problem, study, gpu: str) -> registry_.Entry | None:
    import optuna
    import triton

    best = best_trial(study)
    if best is None:
        return None
    trials = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    return registry_.Entry(key=problem.entry_key(), revision=problem.family.revision, config=dict(best.params),
                           ms=_round(best.user_attrs["ms"]),
                           tflops=_round(best.user_attrs["tflops"]), sdpa_ms=_round(study.user_attrs.get("sdpa_ms")),
                           trials=trials, triton=str(triton.__version__), torch=str(torch.__version__),
                           date=datetime.date.today().isoformat())


def _round(x):
    """Five significant digits: readable files, no false precision."""
    return None if x is None else float(f"{x:.5g}")


def summary_table(rows) -> str:
    """rows: (problem, study or None, entry or None)."""
    head = ["kernel", "mask", "dtype", "D", "S", "B", "H/Hkv", "config", "ms", "TFLOP/s", "SDPA ms", "SDPA",
            "speedup"]
    lines = []
    notes = []
    for p, study, e in rows:
        if e is None:
            lines.append([p.kernel, p.variant, p.dtype, p.head_dim, p.seq_len, p.batch, f"{p.heads}/{p.kv_heads}",
                          "no config passed", "", "", "", "", ""])
            if study is not None:
                notes.append(f"{p.variant} {p.dtype} d{p.head_dim} s{p.seq_len}: {why_no_winner(study)}")
            continue
        sdpa = e.sdpa_ms
        lines.append([p.kernel, p.variant, p.dtype, p.head_dim, p.seq_len, p.batch, f"{p.heads}/{p.kv_heads}",
                      str(e.kernel_config()), f"{e.ms:.4g}", f"{e.tflops:.4g}", f"{sdpa:.4g}" if sdpa else "n/a",
                      study.user_attrs.get("sdpa", "") if study else "",
                      f"{sdpa / e.ms:.2f}x" if sdpa else "n/a"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines] + notes)


def why_no_winner(study) -> str:
    """The most common reason the study's trials gave for failing, and how many gave it."""
    trials = study.get_trials(deepcopy=False)
    reasons = Counter(t.user_attrs["reason"] for t in trials if t.user_attrs.get("reason"))
    if not reasons:
        return "no trial finished"
    top, count = reasons.most_common(1)[0]
    return f"{count} of {len(trials)} trials: {top}"


def problems_from_args(args) -> list[Problem]:
    out = []
    kernels = list(FAMILIES) if args.kernel == "all" else [args.kernel]
    for kernel in kernels:
        for dtype in args.dtype:
            if dtype not in DTYPES:
                raise ValueError(f"--dtype must be a list of {', '.join(DTYPES)}, got {dtype!r}")
            for head_dim in args.head_dim:
                for seq_len in args.seq_len:
                    for batch in args.batch:
                        for topk in args.topk:
                            if topk and kernel == "decode" and args.kernel == "all":
                                continue  # no top-k decode kernel: check_problems refuses it when asked for
                            out.append(Problem(mask=args.mask, dtype=dtype, batch=batch, heads=args.heads,
                                               kv_heads=args.kv_heads, seq_len=seq_len, head_dim=head_dim,
                                               kernel=kernel, topk=topk))
    return out


def space_for(problem: Problem, settings: Settings):
    """The search space of a problem: --space, else its family's default (the top-k one for top-k)."""
    family = problem.family
    name = settings.space or (family.topk_space if problem.effective_topk else family.space)
    return find_space(name, problem.kernel)


def check_problems(problems: list[Problem], interpret: bool):
    problems[0].mask_object()  # a bad spec fails here, before any work (tensor parameters cannot be given)
    for p in problems:
        if p.heads % p.kv_heads:
            raise ValueError(f"--heads {p.heads} is not a multiple of --kv-heads {p.kv_heads}")
        if min(p.batch, p.heads, p.kv_heads, p.seq_len, p.head_dim) < 1 or p.head_dim > 256:
            raise ValueError("--batch, --heads, --kv-heads, --seq-len must be >= 1 and --head-dim 1..256")
        if p.topk and p.kernel == "decode":
            raise ValueError("--topk: the decode kernels have no top-k softmax")
        if p.topk < 0 or p.topk > MAX_TOPK:
            raise ValueError(f"--topk must be between 1 and {MAX_TOPK} (0: plain softmax), got {p.topk}")
        if interpret and p.dtype == "bf16":
            raise ValueError("--dtype bf16 cannot run under the interpreter (its bf16 tl.dot is wrong); use fp16 "
                             "or fp32")


def main(args) -> int:
    """Run `attngen tune` with parsed arguments (see attngen.cli)."""
    if args.interpret:
        if "triton" in sys.modules and not interpreter_on():
            raise ValueError("--interpret needs TRITON_INTERPRET=1 before triton is imported; run `attngen tune "
                             "--interpret` in a process of its own")
        os.environ["TRITON_INTERPRET"] = "1"
        print("attngen tune: running under Triton's interpreter on the CPU, on tiny shapes; the timings say "
              "nothing about a GPU and are stored under the 'interpreter' key", file=sys.stderr)
        import importlib.metadata

        import numpy

        known = interpreter_numpy_problem(importlib.metadata.version("triton"), numpy.__version__)
        if known:
            print(f"attngen tune: warning: {known}", file=sys.stderr)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress bar and the summary say it all
    gpu, device_name, device = detect(args.gpu, args.interpret)
    problems = problems_from_args(args)
    check_problems(problems, args.interpret)
    settings = Settings(gpu=gpu, device_name=device_name, device=device, arch=arch_of(device), trials=args.trials,
                        timeout=args.timeout, sampler=args.sampler, seed=args.seed, storage=args.storage,
                        jobs=args.jobs, compile_timeout=args.compile_timeout,
                        out=Path(args.out) if args.out else registry_.user_dir(), space=args.space)
    # fail now, not after the first study, on a bad sampler or space
    for problem in problems:
        make_sampler(settings.sampler, space_for(problem, settings).for_arch(settings.arch), None, 1)
    if args.fresh and not args.worker_only:  # before any worker starts: the workers share the new studies
        start_fresh(problems, settings)
    if args.workers > 1 and not args.worker_only:
        open_storage(settings.storage)  # create the storage's tables once, before the workers race to
        run_workers(args, settings)
    else:
        bar = progress_bar(settings.trials, "trial")
        try:
            for i, problem in enumerate(problems, 1):
                bar.set_description(f"[{i}/{len(problems)}] {problem.variant} {problem.dtype} d{problem.head_dim} "
                                    f"s{problem.seq_len}")
                study = run_study(problem, settings, bar)
                if not args.worker_only:  # record each winner at once: an interrupted run keeps what it found
                    entry = winner_entry(problem, study, settings.gpu)
                    if entry is not None:
                        registry_.write_entries(settings.out / f"{settings.gpu}.yaml", [entry], settings.gpu,
                                                settings.device_name)
        finally:
            bar.close()
    if args.worker_only:
        return 0
    return finish(problems, settings)


def run_workers(args, settings: Settings) -> None:
    """One worker process per local GPU, all on the same storage; each takes trials as they come."""
    storage = settings.storage or default_storage_url()
    argv = [a for a in sys.argv[1:]]
    procs = []
    for i in range(args.workers):
        env = dict(os.environ)
        if settings.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        cmd = [sys.executable, "-m", "attngen"] + argv + ["--worker-only", "--storage", storage]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"tuning workers exited with codes {codes}")


def finish(problems: list[Problem], settings: Settings) -> int:
    """Write every study's winner into the registry and print the summary."""
    import optuna

    storage = open_storage(settings.storage)
    rows, entries = [], []
    for p in problems:
        try:
            study = optuna.load_study(study_name=p.study_name(settings.gpu), storage=storage)
        except KeyError:
            rows.append((p, None, None))
            continue
        entry = winner_entry(p, study, settings.gpu)
        rows.append((p, study, entry))
        if entry is not None:
            entries.append(entry)
    path = settings.out / f"{settings.gpu}.yaml"
    if entries:
        registry_.write_entries(path, entries, settings.gpu, settings.device_name)
    print(summary_table(rows))
    print(f"\n{len(entries)} of {len(problems)} problems have a winner, written to {path}")
    return 0 if len(entries) == len(problems) else 1


def add_arguments(parser) -> None:
    g = parser.add_argument_group("what to tune (each list option takes comma-separated values)")
    g.add_argument("--mask", default="none", metavar="SPEC",
                   help="mask variant, e.g. causal or 'sliding_window(window=1024)' (default none = dense)")
    g.add_argument("--dtype", type=comma_list(str), default=None, help="fp16,bf16,fp32 (default bf16,fp16)")
    g.add_argument("--head-dim", type=comma_list(int), default=None, help="default 64,128")
    g.add_argument("--seq-len", type=comma_list(int), default=None,
                   help="default 1024,4096,16384 (Sq = Sk; for --kernel decode the cache length, Sq = 1)")
    g.add_argument("--batch", type=comma_list(int), default=None,
                   help="default 4; the decode family keeps a registry entry per batch bucket (a power of two), so "
                        "tune it at the batches it will run, e.g. 1,8,64")
    g.add_argument("--heads", type=int, default=None, help="query heads (default 16)")
    g.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default = --heads)")
    g.add_argument("--kernel", default="fwd", choices=[*FAMILIES, "all"],
                   help="the kernel family to tune: " + "; ".join(f"{f.name}: {f.doc}" for f in FAMILIES.values())
                        + "; all: every family (default fwd)")
    g.add_argument("--topk", type=comma_list(int), default=[0],
                   help="top-k softmax variants, e.g. 64,256 (0 = plain softmax, the default); they search "
                        "search_spaces/forward_topk.yaml unless --space is given")
    g = parser.add_argument_group("how to search")
    g.add_argument("--gpu", help="the GPU to tune for; must match this machine's (default: detected)")
    g.add_argument("--trials", type=int, default=None,
                   help="finished trials per problem (default 40); a study run before counts the trials it has, "
                        "so it runs only the rest (none when it has that many: raise --trials or pass --fresh)")
    g.add_argument("--fresh", action="store_true",
                   help="start every study over instead of resuming it; the old study is kept in the storage as "
                        "<name>@<date and time>")
    g.add_argument("--timeout", type=float, default=None, help="seconds per problem")
    g.add_argument("--sampler", default="tpe", choices=SAMPLERS, help="Optuna sampler (default tpe)")
    g.add_argument("--space", help="search space: a file name in search_spaces/ (e.g. forward_small) or a path "
                                   "(default: the family's, e.g. search_spaces/forward.yaml, forward_topk.yaml "
                                   "with --topk)")
    g.add_argument("--seed", type=int, default=None, help="sampler seed")
    g.add_argument("--storage", help="Optuna storage: a journal file path or an RDB URL such as "
                                     "postgresql+psycopg2://user:password@host/db (default: a journal file "
                                     "under the cache dir)")
    g.add_argument("--workers", type=int, default=1, help="worker processes, one per local GPU (default 1)")
    g.add_argument("--jobs", type=int, default=None,
                   help="trials in flight per worker: configs compile in parallel child processes (default 8)")
    g.add_argument("--compile-timeout", type=float, default=300.0,
                   help="seconds one compilation may take (default 300)")
    g.add_argument("--out", help="registry folder to write (default: the user registry; --out tuned/ to commit)")
    g.add_argument("--interpret", action="store_true",
                   help="no GPU: run the pipeline on tiny shapes under Triton's interpreter ('interpreter' key); "
                        "the defaults are then fp16, head dim 32, seq len 64, batch 1, 2 heads, 6 trials, 2 jobs")
    g.add_argument("--worker-only", action="store_true", help="internal: run trials, write nothing")


def fill_defaults(args) -> None:
    tiny = args.interpret
    defaults = dict(dtype=["fp16"] if tiny else ["bf16", "fp16"], head_dim=[32] if tiny else [64, 128],
                    seq_len=[64] if tiny else [1024, 4096, 16384], batch=[1] if tiny else [4], heads=2 if tiny else 16,
                    trials=6 if tiny else 40, jobs=2 if tiny else 8)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.trials < 1 or args.jobs < 1 or args.workers < 1:
        raise ValueError("--trials, --jobs and --workers must be >= 1")
