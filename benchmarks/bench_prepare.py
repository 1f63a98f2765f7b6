"""Prepare throughput against the tokenizer alone, files, a new row length, loader speed and peak memory.

    python benchmarks/bench_prepare.py --mib 1024 --json benchmarks/results/prepare.json

Everything is built in a temp dir (a synthetic jsonl corpus of ``--mib`` MiB, a byte-level BPE tokenizer trained on
it: no download):

- ``tokenizer``: the tokenizer alone on the corpus's texts: the call prepare makes (the fast tokenizer's backend,
  ``encode_batch_fast``, no special tokens) in batches of 1000, one process, one thread
  (``TOKENIZERS_PARALLELISM=false``, as each prepare worker runs); JSON parsing excluded;
- ``prepare_wN``: ``prepare`` end to end with ``N`` workers (reading, JSON parsing, tokenizing, writing, sharding,
  index, packing, checksums, manifest), interleaved with the tokenizer alone over ``--repeats`` rounds. Per worker:
  ``ratio_per_worker`` = tokens/s / N / the tokenizer's tokens/s (wall clock: on a shared or small machine N
  workers do not get N cores) and ``cpu_ratio_per_worker`` = tokens per CPU second of a worker / the tokenizer's
  tokens per CPU second (what a worker delivers for the core it gets); medians with min and max;
- ``files``: the files of the output, against one token file per 4,096 documents before (format version 1);
- ``new_seq_len``: the time to serve a row length the data was not prepared with (both splits packed from the
  document index and cached), against the prepare time, and to open it again from the cache;
- ``loader``: batches/s of ``PreparedBatches`` (one process) at the prepared and at the new length;
- ``rss``: peak RSS of ``python -m lightning_llmfast.prepare --workers 1`` (a fresh process) on inputs of the given
  sizes: it should not grow with the input.

The machine these run on is shared: compare ratios, not absolute rates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightning_llmfast.data import PreparedBatches, PreparedDataset, layouts
from lightning_llmfast.data.prepare import PrepareConfig, prepare

REPO = Path(__file__).resolve().parents[1]


def _words(seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzéüñ"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(1, 10))) for _ in range(5000)]


def write_corpus(path: Path, mib: float, seed: int = 0) -> int:
    """A jsonl of documents of 20 to 2000 words until ``mib`` MiB; returns the number of documents."""
    rng, words, size, count = random.Random(seed), _words(seed), 0, 0
    with open(path, "w") as f:
        while size < mib * 2**20:
            text = " ".join(rng.choice(words) for _ in range(int(rng.lognormvariate(5, 1)) % 2000 + 20))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size, count = size + len(line.encode()), count + 1
    return count


def make_tokenizer(directory: Path, sample: Path) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    with open(sample) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(500), f, strict=False)]
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(directory)
    return directory


def tokenizer_alone(tokenizer_dir: Path, corpus: Path) -> dict[str, float]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir).backend_tokenizer
    seconds = cpu = tokens = 0
    with open(corpus) as f:
        while texts := [json.loads(line)["text"] for _, line in zip(range(20_000), f, strict=False)]:
            before_cpu, start = _cpu_seconds()[0], time.perf_counter()  # JSON parsing excluded
            for i in range(0, len(texts), 1000):
                encodings = tokenizer.encode_batch_fast(texts[i : i + 1000], add_special_tokens=False)
                tokens += sum(len(e.ids) + 1 for e in encodings)
            seconds, cpu = seconds + time.perf_counter() - start, cpu + _cpu_seconds()[0] - before_cpu
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "cpu_s": cpu,
            "tokens_per_cpu_s": tokens / cpu}  # fmt: skip


def prepare_run(tokenizer_dir: Path, corpus: Path, output: Path, workers: int, seq_len: int) -> dict[str, float]:
    shutil.rmtree(output, ignore_errors=True)  # an output complete with the same settings would be kept as it is
    config = PrepareConfig(inputs=(str(corpus),), tokenizer=str(tokenizer_dir), output=str(output), workers=workers,
                           seq_len=(seq_len,), progress=False)  # fmt: skip
    cpu = _cpu_seconds()
    start = time.perf_counter()
    manifest = prepare(config)
    seconds = time.perf_counter() - start
    main_cpu, workers_cpu = (after - before for after, before in zip(_cpu_seconds(), cpu, strict=True))
    # On an idle machine with enough cores the run takes about max(main, workers / N) CPU seconds.
    bound = max(main_cpu, workers_cpu / workers) if workers > 1 else main_cpu
    return {"tokens": manifest["num_tokens"], "seconds": seconds, "tokens_per_s": manifest["num_tokens"] / seconds,
            "main_cpu_s": main_cpu, "workers_cpu_s": workers_cpu,
            "idle_machine_tokens_per_s_estimate": manifest["num_tokens"] / bound}  # fmt: skip


def _cpu_seconds() -> tuple[float, float]:
    """User + system CPU seconds of this process and of its finished children (the prepare workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def loader_run(prepared: Path, seq_len: int, batch_size: int, limit: int) -> dict[str, float]:
    batches = PreparedBatches([PreparedDataset(prepared)], "train", seq_len=seq_len, batch_size=batch_size,
                              shuffle_seed=0)  # fmt: skip
    start, count, tokens = time.perf_counter(), 0, 0
    for batch in batches:
        count, tokens = count + 1, tokens + batch.num_tokens
        if count == limit:
            break
    seconds = time.perf_counter() - start
    return {"seq_len": seq_len, "batch_size": batch_size, "batches": count, "batches_per_s": count / seconds,
            "tokens_per_s": tokens / seconds}  # fmt: skip


def new_length(prepared: Path, seq_len: int, prepare_seconds: float) -> dict[str, float]:
    """Serve ``seq_len`` (not prepared): both splits packed from the document index and cached; then reopened as
    another process does (the cached pair checked in full before use)."""
    start = time.perf_counter()
    dataset = PreparedDataset(prepared)
    rows = sum(dataset.layout(seq_len, split).num_rows for split in ("train", "val"))
    first = time.perf_counter() - start
    layouts._PLACES.clear()  # forget what this process derived: the reopen checks the published pair
    start = time.perf_counter()
    again = PreparedDataset(prepared)
    assert sum(again.layout(seq_len, split).num_rows for split in ("train", "val")) == rows
    cached = time.perf_counter() - start
    return {"seq_len": seq_len, "rows": rows, "first_use_seconds": first, "prepare_seconds": prepare_seconds,
            "fraction_of_prepare": first / prepare_seconds, "cached_open_seconds": cached}  # fmt: skip


def _median(runs: list[dict[str, float]]) -> dict[str, Any]:
    """The median of every field over the runs, with the min and max of the ratios."""
    out: dict[str, Any] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    for key in [k for k in runs[0] if "ratio" in k]:
        out[f"{key}_min"], out[f"{key}_max"] = min(r[key] for r in runs), max(r[key] for r in runs)
    out["repeats"] = len(runs)
    return out


def peak_rss(tokenizer_dir: Path, corpus: Path, output: Path, seq_len: int) -> dict[str, float]:
    # VmHWM, not getrusage: Linux carries ru_maxrss over from the parent through fork and exec.
    code = (
        "import sys; from pathlib import Path; from lightning_llmfast.prepare import main; code = main(sys.argv[1:]); "
        "print([x for x in Path('/proc/self/status').read_text().splitlines() if x[:6] == 'VmHWM:'][0].split()[1]); "
        "sys.exit(code)"
    )
    args = ["--input", str(corpus), "--tokenizer", str(tokenizer_dir), "--output", str(output), "--seq-len",
            str(seq_len), "--no-progress", "--overwrite"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    return {"input_mib": corpus.stat().st_size / 2**20, "peak_rss_mib": int(proc.stdout.split()[-1]) / 1024,
            "seconds": time.perf_counter() - start, "files": len(list(output.iterdir()))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=16, help="corpus size for the throughput runs (1024: 1 GiB)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of tokenizer and prepare runs")
    parser.add_argument("--rss-mib", type=float, nargs="+", default=[2, 16], help="input sizes for peak RSS")
    parser.add_argument("--seq-len", type=int, default=1024, help="the row length prepared")
    parser.add_argument("--new-seq-len", type=int, default=4096, help="a row length served without preparing it")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = root / "corpus.jsonl"
        documents = write_corpus(corpus, args.mib)
        tokenizer_dir = make_tokenizer(root / "tok", corpus)
        result: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "corpus_mib": args.mib, "documents": documents, "seq_len": args.seq_len,
        }  # fmt: skip
        alones, runs = [], {w: [] for w in args.workers}  # type: ignore[var-annotated]
        for _ in range(args.repeats):  # interleaved: the machine's load changes under all of them alike
            alone = tokenizer_alone(tokenizer_dir, corpus)
            alones.append(alone)
            for workers in args.workers:
                run = prepare_run(tokenizer_dir, corpus, root / f"out-w{workers}", workers, args.seq_len)
                run["ratio_per_worker"] = run["tokens_per_s"] / workers / alone["tokens_per_s"]
                # the workers' CPU (the main process's when it tokenizes itself), per worker, against the tokenizer's
                cpu = run["workers_cpu_s"] if workers > 1 else run["main_cpu_s"]
                run["cpu_ratio_per_worker"] = run["tokens"] / cpu / alone["tokens_per_cpu_s"]
                runs[workers].append(run)
                print(f"workers={workers}: {run}", flush=True)
        result["tokenizer"] = _median(alones)
        for workers, measured in runs.items():
            result[f"prepare_w{workers}"] = _median(measured)
        output = root / f"out-w{args.workers[0]}"
        names = sorted(p.name for p in output.iterdir())
        result["files"] = {"count": len(names), "token_files": sum(n.startswith("tokens-") for n in names),
                           "token_files_v1": -(-documents // 4096), "names": names}  # fmt: skip
        prepare_seconds = result[f"prepare_w{args.workers[0]}"]["seconds"]
        result["new_seq_len"] = new_length(output, args.new_seq_len, prepare_seconds)
        result["loader"] = [loader_run(output, n, 8, 200) for n in (args.seq_len, args.new_seq_len)]
        result["rss"] = []
        for mib in args.rss_mib:
            big = root / f"rss-{mib}.jsonl"
            write_corpus(big, mib, seed=1)
            result["rss"].append(peak_rss(tokenizer_dir, big, root / f"rss-{mib}", args.seq_len))
            big.unlink()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
