"""How many trials Optuna needs to come within 2% of the best config, against an exhaustive sweep.

    attngen tune --mask causal --dtype bf16 --head-dim 128 --seq-len 4096 --space forward_small \
                 --sampler grid --trials 1000 --storage STORE --out DIR      # on the GPU: every point
    python benchmarks/search_efficiency.py --storage STORE [--out DIR]       # anywhere: the replay

The grid study measures every point of search_spaces/forward_small.yaml with the tuner's own
pipeline (compile, correctness gate, timing). The replay then runs Optuna's samplers (TPE, the
default, and random as the baseline) many times with different seeds over that measured table:
each suggested config gets the TFLOP/s measured for it (0 and an infeasible constraint for the
points that were invalid, failed or wrong), and we count the trials until the best so far is
within 2% of the exhaustive best. Replaying measured values, instead of re-timing on the GPU,
makes many seeds affordable; it assumes a config's time does not change between runs (the
timing noise, about 1%, is below the 2% threshold).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import optuna

from attngen.tuning import tune


def measured_table(storage: str, study_name: str | None):
    store = tune.open_storage(storage)
    names = [s.study_name for s in optuna.get_all_study_summaries(store)]
    if study_name is None:
        if len(names) != 1:
            raise SystemExit(f"--study is needed: {storage} holds {names}")
        study_name = names[0]
    study = optuna.load_study(study_name=study_name, storage=store)
    table, distributions = {}, None
    for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)):
        ok = t.user_attrs.get("status") == tune.OK
        table[tuple(sorted(t.params.items()))] = t.user_attrs["tflops"] if ok else None
        distributions = t.distributions
    return study_name, table, distributions


def trials_to_reach(sampler, table, distributions, target: float, max_trials: int) -> int | None:
    study = optuna.create_study(direction="maximize", sampler=sampler)
    best = 0.0
    for n in range(1, max_trials + 1):
        trial = study.ask(distributions)
        value = table.get(tuple(sorted(trial.params.items())))
        trial.set_constraint("feasible", 0.0 if value is not None else 1.0)
        study.tell(trial, value if value is not None else 0.0)
        best = max(best, value or 0.0)
        if best >= target:
            return n
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", required=True, help="the storage of the exhaustive (grid) study")
    p.add_argument("--study", help="study name, when the storage holds several")
    p.add_argument("--seeds", type=int, default=50)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name, table, distributions = measured_table(args.storage, args.study)
    values = [v for v in table.values() if v is not None]
    best = max(values)
    target = 0.98 * best
    within = sum(v >= target for v in values)
    size = 1
    for d in distributions.values():
        size *= len(d.choices)
    results = {}
    for label, make in (("tpe", lambda s: tune.make_sampler("tpe", {}, s, 32)),
                        ("random", lambda s: optuna.samplers.RandomSampler(seed=s))):
        counts = [trials_to_reach(make(seed), table, distributions, target, 4 * size) for seed in range(args.seeds)]
        reached = sorted(c for c in counts if c is not None)
        results[label] = dict(median=statistics.median(reached) if reached else None,
                              p90=reached[int(0.9 * (len(reached) - 1))] if reached else None,
                              max=max(reached) if reached else None, missed=len(counts) - len(reached))
    report = dict(study=name, points=size, measured=len(table), valid=len(values), best_tflops=best,
                  within_2pct=within, seeds=args.seeds, samplers=results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "search_efficiency.json").write_text(json.dumps(report, indent=1))
    lines = [f"study {name}: {size} points, {len(values)} valid, best {best:.4g} TFLOP/s, "
             f"{within} within 2% of it", "",
             "| sampler | trials to within 2%: median | 90th percentile | max | seeds that missed |",
             "|---|---|---|---|---|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['median']} | {r['p90']} | {r['max']} | {r['missed']} of {args.seeds} |")
    lines += ["", "every measured point, fastest first:", "| config | TFLOP/s |", "|---|---|"]
    for params, value in sorted(table.items(), key=lambda kv: -(kv[1] or 0)):
        lines.append(f"| {', '.join(f'{k}={v}' for k, v in params)} | {f'{value:.1f}' if value else 'not valid'} |")
    print("\n".join(lines))
    (out / "search_efficiency.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
