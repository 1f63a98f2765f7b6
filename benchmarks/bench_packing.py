"""Deriving the rows of a prepared split: the streaming best-fit loop against best-fit decreasing with NumPy.

    python benchmarks/bench_packing.py --documents 1000000 10000000 --json benchmarks/results/packing.json

Document lengths are drawn log-normal (median 500 tokens, sigma 1.2: web text's long tail; seed 0). For each
number of documents and row length, in one process and interleaved over ``--repeats`` rounds:

- ``before``: :func:`~lightning_llmfast.data.packing.plan_rows` (best fit with a look-ahead of 256 short pieces, one
  Python step per document), fed lengths by blocks as prepared layouts were packed before;
- ``after``: :func:`~lightning_llmfast.data.packing.pack_lengths` on windows of
  :data:`~lightning_llmfast.data.prepared.PACK_WINDOW` documents, as
  :func:`~lightning_llmfast.data.prepared.write_layout` packs them now.

Both exclude writing the files. Reported: seconds (median, min, max), the ratio before / after (median with min and
max over rounds), rows and the padding fraction (``1 - tokens / (rows * seq_len)``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lightning_llmfast.data.packing import pack_lengths, plan_rows
from lightning_llmfast.data.prepared import PACK_WINDOW


def _before(lengths: np.ndarray, seq_len: int) -> int:
    def stream() -> Iterator[int]:
        for first in range(0, len(lengths), 1 << 16):
            yield from lengths[first : first + (1 << 16)].tolist()

    return sum(1 for _ in plan_rows(stream(), seq_len))


def _after(lengths: np.ndarray, seq_len: int) -> int:
    rows = 0
    for first in range(0, len(lengths), PACK_WINDOW):
        rows += len(pack_lengths(lengths[first : first + PACK_WINDOW], seq_len)[0]) - 1
    return rows


def run(documents: int, seq_len: int, repeats: int) -> dict[str, Any]:
    lengths = np.maximum(1, np.random.default_rng(0).lognormal(np.log(500), 1.2, documents)).astype(np.int64)
    tokens = int(lengths.sum())
    times: dict[str, list[float]] = {"before": [], "after": []}
    rows = {}
    for _ in range(repeats):  # interleaved: the machine's load changes under both alike
        for name, pack in (("before", _before), ("after", _after)):
            start = time.perf_counter()
            rows[name] = pack(lengths, seq_len)
            times[name].append(time.perf_counter() - start)
    ratios = [b / a for b, a in zip(times["before"], times["after"], strict=True)]
    out: dict[str, Any] = {"documents": documents, "seq_len": seq_len, "tokens": tokens, "repeats": repeats}
    for name in times:
        out[name] = {"seconds": statistics.median(times[name]), "seconds_min": min(times[name]),
                     "seconds_max": max(times[name]), "rows": rows[name],
                     "padding_fraction": 1 - tokens / (rows[name] * seq_len)}  # fmt: skip
    out["speedup"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--seq-len", type=int, nargs="+", default=[2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
        "numpy": np.__version__, "pack_window": PACK_WINDOW, "runs": [],
    }  # fmt: skip
    for documents in args.documents:
        for seq_len in args.seq_len:
            result["runs"].append(run(documents, seq_len, args.repeats))
            print(json.dumps(result["runs"][-1]), flush=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
