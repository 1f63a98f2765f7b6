"""Tiny corpora and a tiny BPE tokenizer for the prepare tests, built in temp dirs (no download)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

WORDS = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta", "θeta", "iota", "kappa", "λ", "mu", "\n", "🙂"]


def make_texts(count: int, seed: int, max_words: int = 60) -> list[str]:
    """``count`` documents of 0 to ``max_words`` words (empty ones and a few long ones included)."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words))) for _ in range(count)]
    texts[min(3, count - 1)] = ""  # an empty document: EOS alone
    return texts


def make_tokenizer(directory: Path, vocab_size: int = 300, extra_tokens: int = 0) -> Path:
    """Train a byte-level BPE tokenizer on :func:`make_texts` and save it as a transformers fast tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>", "<bos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(make_texts(200, seed=99), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", bos_token="<bos>")
    if extra_tokens:
        fast.add_tokens([f"<extra{i}>" for i in range(extra_tokens)])
    fast.save_pretrained(directory)
    return directory


def write_jsonl(path: Path, texts: Sequence[str], key: str = "text") -> Path:
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, key: text}) + "\n")
    return path


def write_parquet(path: Path, texts: Sequence[str], row_group_size: int = 7) -> Path:
    pq.write_table(pa.table({"text": list(texts), "n": list(range(len(texts)))}), path, row_group_size=row_group_size)
    return path


def file_bytes(directory: Path) -> dict[str, bytes]:
    """Every file of a directory (recursively), by relative path."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
