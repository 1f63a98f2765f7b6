"""``tune`` against an exhaustive grid on the tiny config (issue 49, item 3).

The space: micro-batch 1, 2, 4, 8 x router backend ``torch`` (grouped, sync-free) or ``naive`` (the per-expert
baseline), at 8 sequences per optimizer step (``trainer.accumulate_grad_batches`` 8, 4, 2, 1). Three phases, each
timed by the wall clock, every trial a process of ``examples/train_moe.py fit`` run by the tuner's
:class:`~lightning_llmfast.tune.SubprocessRunner` (forked from its trial server; the server's start counts in tune's
time, and the grid runs on the same server):

1. ``tune`` (successive halving: every candidate ``--steps`` measured steps, the best third ``eta`` times longer);
2. the grid: every candidate measured ``--grid-steps`` steps (the fidelity a grid needs to rank within noise);
3. re-measurement: tune's choice and the grid's best, ``--grid-steps`` each, interleaved ``--repeats`` times; the
   ratio of their median rates, and each one's spread.

Reports tune's time over the grid's, the chosen and the best settings, the ratio and spreads, and the load average
(the development machine is shared with other engineers' jobs: every rate is host time under their load).

Usage (one intra-op thread per trial: on a loaded 2-core host, two threads waiting on each other for a busy core
make single steps vary several-fold)::

    OMP_NUM_THREADS=1 python benchmarks/bench_tune.py --steps 2 --warmup-steps 1 --grid-steps 24 --repeats 2 \
        --out benchmarks/results/tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from lightning_llmfast.tune import SubprocessRunner, Trial, TuneConfig, apply_settings, tune

ROOT = Path(__file__).parents[1]
SPACE = {"data.batch_size": [1, 2, 4, 8], "model.config.router_backend": ["torch", "naive"]}
GLOBAL_BATCH = 8


def _measure(runner: SubprocessRunner, base: dict, settings: dict, steps: int, warmup: int, where: Path) -> dict:
    trial = Trial(settings, apply_settings(base, settings), steps, warmup, 1800.0, where)
    start = time.monotonic()
    m = runner(trial)
    return {"settings": settings, "status": m.status, "tokens_per_sec": m.tokens_per_sec,
            "seconds": time.monotonic() - start, "reason": m.reason}  # fmt: skip


def _settings(point: tuple[Any, ...]) -> dict[str, Any]:
    settings = dict(zip(SPACE, point))
    settings["trainer.accumulate_grad_batches"] = GLOBAL_BATCH // settings["data.batch_size"]
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples/configs/tiny.yaml"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--eta", type=int, default=3)
    parser.add_argument("--grid-steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/tune.json"))
    args = parser.parse_args()
    base = yaml.safe_load(Path(args.config).read_text())
    work = Path(tempfile.mkdtemp(prefix="bench_tune_"))
    load_before = os.getloadavg()

    start = time.monotonic()
    runner = SubprocessRunner(ROOT / "examples/train_moe.py")
    config = TuneConfig(args.config, work / "tune", space=SPACE, global_batch=GLOBAL_BATCH, steps=args.steps,
                        warmup_steps=args.warmup_steps, eta=args.eta)  # fmt: skip
    result = tune(config, runner)
    tune_seconds = time.monotonic() - start
    assert result.best is not None, "tune measured nothing"
    chosen = result.best.settings

    start = time.monotonic()
    grid = [_measure(runner, base, _settings(p), args.grid_steps, args.warmup_steps, work / f"grid{i}")
            for i, p in enumerate(itertools.product(*SPACE.values()))]  # fmt: skip
    grid_seconds = time.monotonic() - start
    best = max((g for g in grid if g["status"] == "ok"), key=lambda g: g["tokens_per_sec"])

    rates: dict[str, list[float]] = {"tune": [], "grid": []}
    for repeat in range(args.repeats):
        for name, settings in (("tune", chosen), ("grid", best["settings"])):
            m = _measure(runner, base, settings, args.grid_steps, args.warmup_steps, work / f"re{name}{repeat}")
            rates[name].append(m["tokens_per_sec"] or 0.0)
    ratio = statistics.median(rates["tune"]) / statistics.median(rates["grid"])
    report = {
        "machine": "2-core development VM shared with other engineers' jobs (load average below)",
        "config": args.config,
        "space": SPACE,
        "global_batch": GLOBAL_BATCH,
        "tune": {
            "steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "eta": args.eta,
            "seconds": tune_seconds,
            "trials": len(result.records),
            "chosen": chosen,
            "chosen_rate_in_tune": result.best.tokens_per_sec,
            "records": [r.__dict__ for r in result.records],
        },
        "grid": {"steps": args.grid_steps, "seconds": grid_seconds, "trials": grid, "best": best["settings"]},
        "time_ratio_tune_over_grid": tune_seconds / grid_seconds,
        "remeasured": {
            "tokens_per_sec": rates,
            "median_ratio_tune_over_grid_best": ratio,
            "spread": {k: [min(v), max(v)] for k, v in rates.items()},
        },
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps({k: report[k] for k in ("time_ratio_tune_over_grid", "remeasured")}, indent=1))
    print(f"tune chose {chosen} in {tune_seconds:.0f}s; grid best {best['settings']} in {grid_seconds:.0f}s")


if __name__ == "__main__":
    main()
