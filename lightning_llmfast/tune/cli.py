"""The command line, ``python -m lightning_llmfast.tune`` (:func:`main`): the flags of :class:`TuneConfig`, one line
per trial while it searches, the summary and the files written at the end."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lightning_llmfast.errors import ConfigError, LLMFastError
from lightning_llmfast.tune.config import TuneConfig, parse_bytes
from lightning_llmfast.tune.records import STATUSES
from lightning_llmfast.tune.search import tune

__all__ = ["INTERRUPTED", "main"]

INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT, as a shell reports a process SIGINT ended)."""
_DESCRIPTION = "Search the training settings by short trials and write the fastest config."


def _memory_size(text: str) -> int:
    """``--memory-budget``: :func:`parse_bytes`, its error as argparse's (usage, the message, exit status 2)."""
    try:
        return parse_bytes(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_llmfast.tune", description=_DESCRIPTION)
    parser.add_argument("--config", required=True, help="an example-CLI config (examples/train_moe.py fit --config)")
    parser.add_argument("--out", required=True, help="the results directory (rerun to continue a killed search)")
    parser.add_argument("--space", default=None, help="YAML: dotted keys to lists of values (default: from the config)")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step in every trial")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds the search may take")
    parser.add_argument("--memory-budget", type=_memory_size, default=None,
                        help="per device, bytes or with a unit (80GiB, 500MB); prunes predicted over")  # fmt: skip
    parser.add_argument("--steps", type=int, default=4, help="measured steps of the first trials (default 4)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps left out before them (default 2)")
    parser.add_argument("--eta", type=int, default=3, help="halving factor (default 3)")
    parser.add_argument("--trial-timeout", type=float, default=600.0, help="seconds a trial may run (default 600)")
    parser.add_argument("--script", default=None, help="the example CLI (default: examples/train_moe.py)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the search; returns the exit status: 0, 2 after printing ``error: ...``, or 130 after Ctrl-C (the running
    trial stopped; rerunning the same command continues the search).

    Example::

        main(["--config", "examples/configs/tiny.yaml", "--out", "tuned/", "--time-budget", "600"])
    """
    args = _parser().parse_args(argv)
    try:
        result = tune(
            TuneConfig(
                args.config, args.out, space=args.space, global_batch=args.global_batch, time_budget=args.time_budget,
                memory_budget=args.memory_budget, steps=args.steps, warmup_steps=args.warmup_steps, eta=args.eta,
                trial_timeout=args.trial_timeout, script=args.script,
            )
        )  # fmt: skip
    except (LLMFastError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tune: interrupted; rerun the same command to continue the search", file=sys.stderr)
        return INTERRUPTED
    counts = {s: sum(r.status == s for r in result.records) for s in STATUSES}
    print(f"tune: {len(result.records)} trials ({', '.join(f'{n} {s}' for s, n in counts.items())})"
          + (", stopped by the time budget" if result.stopped_by_budget else ""))  # fmt: skip
    if result.best is not None:
        print(f"best: {result.best.tokens_per_sec:,.0f} tokens/s {json.dumps(result.best.settings)}")
    for path in result.files:
        print(path)
    return 0
