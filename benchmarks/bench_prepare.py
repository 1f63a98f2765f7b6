"""Prepare throughput against the tokenizer alone, its scaling with workers, loader speed and peak memory.

    python benchmarks/bench_prepare.py --mib 16 --rss-mib 2 100 --json benchmarks/results/cpu_prepare_<date>.json

Everything is built in a temp dir (a synthetic jsonl corpus, a byte-level BPE tokenizer trained on it: no download):

- ``tokenizer``: the transformers tokenizer alone on the corpus's texts, in batches of 1000, one process, one thread
  (``TOKENIZERS_PARALLELISM=false``, as each prepare worker runs); JSON parsing excluded;
- ``prepare_wN``: ``prepare`` end to end with ``N`` workers (reading, tokenizing, writing, index, packing,
  checksums, manifest); tokens/s and its ratio to the tokenizer alone, per worker;
- ``loader``: batches/s of ``PreparedBatches`` over the prepared rows (one process), and one training step of the
  reference MoE GPT (default CPU size) on such a batch, for the loader's share of a step;
- ``rss``: peak RSS of ``python -m lightning_llmfast.prepare --workers 1`` (a fresh process) on inputs of the given
  sizes: it should not grow with the input.

The machine these run on is shared: repeat and compare ratios, not absolute rates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
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

from lightning_llmfast.data import PreparedBatches, PreparedDataset
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
    with open(corpus) as f:
        texts = [json.loads(line)["text"] for line in f]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cpu, start, tokens = _cpu_seconds()[0], time.perf_counter(), 0
    for i in range(0, len(texts), 1000):
        tokens += sum(len(ids) + 1 for ids in tokenizer(texts[i : i + 1000], add_special_tokens=False)["input_ids"])
    seconds, cpu = time.perf_counter() - start, _cpu_seconds()[0] - cpu
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "cpu_s": cpu,
            "tokens_per_cpu_s": tokens / cpu}  # fmt: skip


def prepare_run(tokenizer_dir: Path, corpus: Path, output: Path, workers: int, seq_len: int) -> dict[str, float]:
    config = PrepareConfig(inputs=(str(corpus),), tokenizer=str(tokenizer_dir), output=str(output), workers=workers,
                           seq_len=(seq_len,), overwrite=True, progress=False)  # fmt: skip
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
    from lightning_llmfast import MoEGPTConfig
    from lightning_llmfast.models import MoEGPT

    batches = PreparedBatches([PreparedDataset(prepared)], "train", seq_len=seq_len, batch_size=batch_size,
                              shuffle_seed=0)  # fmt: skip
    start, count = time.perf_counter(), 0
    for batch in batches:  # noqa: B007 (the last batch feeds the model step below)
        count += 1
        if count == limit:
            break
    loader_s = (time.perf_counter() - start) / count
    model = MoEGPT(MoEGPTConfig(vocab_size=8001))
    step_times = []
    for _ in range(3):  # the first is a warm-up
        start = time.perf_counter()
        logits = model(batch.input_ids, batch.position_ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100).backward()
        step_times.append(time.perf_counter() - start)
    step_s = min(step_times[1:])
    return {"batches": count, "batches_per_s": 1 / loader_s, "seconds_per_batch": loader_s,
            "model_step_seconds": step_s, "share_of_step": loader_s / (loader_s + step_s)}  # fmt: skip


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
            "seconds": time.perf_counter() - start}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=16, help="corpus size for the throughput runs")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rss-mib", type=float, nargs="+", default=[2, 100], help="input sizes for peak RSS")
    parser.add_argument("--seq-len", type=int, default=1024)
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
        alone = tokenizer_alone(tokenizer_dir, corpus)
        result["tokenizer"] = alone
        for workers in args.workers:
            run = prepare_run(tokenizer_dir, corpus, root / f"out-w{workers}", workers, args.seq_len)
            run["ratio_to_tokenizer"] = run["tokens_per_s"] / alone["tokens_per_s"]
            run["ratio_per_worker"] = run["ratio_to_tokenizer"] / workers
            # per CPU second: what the pipeline costs beyond tokenizing, whatever the load
            run["tokenizer_share_of_cpu"] = alone["cpu_s"] / (run["main_cpu_s"] + run["workers_cpu_s"])
            result[f"prepare_w{workers}"] = run
            print(f"workers={workers}: {run}", flush=True)
        result["rss"] = []
        for mib in args.rss_mib:
            big = root / f"rss-{mib}.jsonl"
            write_corpus(big, mib, seed=1)
            result["rss"].append(peak_rss(tokenizer_dir, big, root / f"rss-{mib}", args.seq_len))
            big.unlink()
        result["loader"] = loader_run(root / f"out-w{args.workers[0]}", args.seq_len, 4, 200)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
