"""``python -m lightning_llmfast.bench``: before, peer and llmfast in one run, plus the micro-benchmarks.

Example::

    python -m lightning_llmfast.bench --profile quick --device cpu --json bench.json --plot bench.png
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning_llmfast.bench.e2e import VARIANTS
from lightning_llmfast.bench.report import markdown_report, plot_result
from lightning_llmfast.bench.suite import MICRO_BENCHMARKS, PROFILES, run_benchmark


def _names(text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(n for n in text.split(",") if n)
    bad = [n for n in names if n not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(allowed)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the benchmark, print the Markdown table, write the JSON and the plot.

    Returns:
        The process exit status (0).
    """
    args = _parser().parse_args(argv)

    def write_json(result: dict[str, Any]) -> None:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            # default=str: micro-benchmarks may return non-JSON scalars (dtypes, devices); keep them readable.
            args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")

    if args.profile == "fsdp":
        from lightning_llmfast.bench.fsdp import fsdp_markdown, run_fsdp_benchmark

        fsdp_result = run_fsdp_benchmark(
            args.world_size,
            expert_parallel_size=args.expert_parallel_size,
            repeats=args.repeats,
            measured_steps=args.steps,
            log=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
        write_json(fsdp_result)
        print(fsdp_markdown(fsdp_result))
        return 0
    if args.profile == "scaling":
        return _scaling(args, write_json)
    result = run_benchmark(
        args.profile,
        args.device,
        variants=args.variants,
        micro=args.micro,
        repeats=args.repeats,
        measured_steps=args.steps,
        max_seconds=args.max_seconds,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
        on_update=write_json,
    )
    if args.plot is not None:
        try:
            plot_result(result, args.plot)
        except ImportError:
            print("--plot skipped: matplotlib is not installed (pip install lightning-llmfast[plot])", file=sys.stderr)
    print(markdown_report(result))
    for warning in result["warnings"]:
        print(f"WARNING: {warning}", file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_llmfast.bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile",
        choices=sorted([*PROFILES, "fsdp", "scaling"]),
        default="quick",
        help="quick (CPU), full (GPU), fsdp (--world-size CPU processes: FSDP2 vs DDP vs Lightning's FSDP2 peer; "
        "with --expert-parallel-size also EP alone and FSDP2 x EP), "
        "scaling (tokens/s and efficiency on 1, 2, 4 processes at 3 batch sizes)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path, help="write the result dictionary here")
    parser.add_argument("--plot", type=Path, help="write a PNG comparing the variants here (needs matplotlib)")
    parser.add_argument(
        "--variants", type=lambda s: _names(s, VARIANTS), default=VARIANTS, help="comma-separated e2e variants"
    )
    parser.add_argument(
        "--micro",
        type=lambda s: _names(s, MICRO_BENCHMARKS),
        default=MICRO_BENCHMARKS,
        help="comma-separated micro-benchmarks ('' for none)",
    )
    parser.add_argument("--repeats", type=int, help="override the profile's timed repeats")
    parser.add_argument("--world-size", type=int, default=2, help="fsdp profile: CPU processes")
    parser.add_argument(
        "--expert-parallel-size", type=int, default=1, help="fsdp profile: N > 1 adds EP alone and FSDP2 x EP"
    )
    parser.add_argument("--steps", type=int, help="override the profile's measured steps per segment")
    parser.add_argument("--max-seconds", type=float, help="soft time budget (fewer repeats, micro-benchmarks skipped)")
    return parser


def _scaling(args: argparse.Namespace, write_json: Callable[[dict[str, Any]], None]) -> int:
    from lightning_llmfast.bench.scaling import plot_scaling, run_scaling_benchmark, scaling_markdown

    result = run_scaling_benchmark(
        device=args.device, repeats=args.repeats, measured_steps=args.steps,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
        **({} if args.max_seconds is None else {"max_seconds": args.max_seconds}),
    )  # fmt: skip
    write_json(result)
    if args.plot is not None and not plot_scaling(result, args.plot):
        print("--plot skipped: matplotlib is not installed", file=sys.stderr)
    print(scaling_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
