"""A chunk of documents tokenized and written into ``.partial/``: the tokenizer ``prepare`` loads, the writer of a
chunk's tokens and record (in a worker process or the main one), and the check of a done chunk.

A chunk's token file is written under a temporary name, flushed and renamed; its record (counts, document lengths)
is written the same way, last: a chunk is either done or absent, whenever the writer is killed.

Example::

    info = load_tokenizer("tok/")
    writer = ChunkWriter(info.backend, info.eos_id, None, "uint16", "prepared/", "text")
    writer(0, ["first document", "second"])  # .partial/chunk-00000.bin and .json; returns the token count
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from lightning_llmfast.data.files import atomic_file
from lightning_llmfast.data.sources import JsonLine, parse_document
from lightning_llmfast.errors import DataError

__all__ = [
    "PARTIAL",
    "ChunkWriter",
    "TokenizerInfo",
    "chunk_file",
    "chunk_record",
    "load_tokenizer",
    "read_record",
    "start_worker",
    "work",
]

PARTIAL = ".partial"
"""Directory inside the output holding the settings and the records of done chunks while a preparation runs."""

_ENCODE_BATCH = 256  # documents encoded at once inside a chunk


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records of the tokenizer, and its backend as JSON for the workers."""

    name: str
    sha256: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    pad_id: int | None
    backend: str = field(repr=False)

    def record(self) -> dict[str, Any]:
        """The manifest's ``tokenizer`` entry (everything but the backend JSON)."""
        entry = asdict(self)
        del entry["backend"]
        return entry


def load_tokenizer(directory: str | Path) -> TokenizerInfo:
    """Load a local transformers tokenizer directory (fast tokenizers only) and describe it.

    Raises:
        DataError: no such directory, no ``tokenizer.json`` (not a fast tokenizer), a tokenizer that fails to load,
            or one without an EOS token.

    Example::

        info = load_tokenizer("tok/")
        info.vocab_size, info.eos_id
    """
    root = Path(directory)
    if not root.is_dir():
        raise DataError(f"tokenizer {root}: no such directory")
    if not (root / "tokenizer.json").is_file():
        raise DataError(
            f"tokenizer {root}: no tokenizer.json, so no fast tokenizer; prepare needs one (save it with "
            "AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained(DIR))"
        )
    from transformers import AutoTokenizer  # heavy: imported only when preparing

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root), use_fast=True, local_files_only=True)
    except Exception as err:  # transformers raises many kinds; the user needs the reason in one line
        raise DataError(f"tokenizer {root}: cannot be loaded ({type(err).__name__}: {err})") from None
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"tokenizer {root}: {type(tokenizer).__name__} is not a fast tokenizer")
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {root}: no EOS token (set eos_token in its tokenizer_config.json)")
    digest = hashlib.sha256((root / "tokenizer.json").read_bytes()).hexdigest()
    return TokenizerInfo(
        name=str(getattr(tokenizer, "name_or_path", "") or root.name),
        sha256=digest,
        vocab_size=len(tokenizer),
        eos_id=int(tokenizer.eos_token_id),
        bos_id=None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id),
        pad_id=None if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id),
        backend=tokenizer.backend_tokenizer.to_str(),
    )


class ChunkWriter:
    """Tokenizes one chunk of documents and writes its shard and record (in a worker or in the main process)."""

    def __init__(self, backend: str, eos_id: int, bos_id: int | None, dtype: str, output: str, text_key: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(backend)
        # What transformers' own call does without truncation or padding requested.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.prefix = [] if bos_id is None else [bos_id]
        self.suffix = [eos_id]
        self.dtype, self.output, self.text_key = np.dtype(dtype), Path(output), text_key

    def __call__(self, index: int, documents: list[str | JsonLine]) -> int:
        """Write chunk ``index`` and its record into ``.partial/``; return its token count."""
        texts = [parse_document(document, self.text_key) for document in documents]
        # Encodings carry offsets and token strings (tens of bytes per token): keep only a batch of them alive.
        lengths: list[int] = []
        parts = []
        for start in range(0, len(texts), _ENCODE_BATCH):
            encodings = self.tokenizer.encode_batch_fast(texts[start : start + _ENCODE_BATCH], add_special_tokens=False)
            sizes = [len(self.prefix) + len(e.ids) + 1 for e in encodings]
            parts.append(
                np.fromiter(
                    chain.from_iterable(chain(self.prefix, e.ids, self.suffix) for e in encodings),
                    dtype=self.dtype,
                    count=sum(sizes),
                )
            )
            lengths += sizes
            del encodings
        tokens = np.concatenate(parts)
        with atomic_file(chunk_file(self.output, index)) as f:
            f.write(tokens.data)
        record = {"documents": len(texts), "tokens": int(tokens.size), "bytes": tokens.nbytes, "lengths": lengths}
        with atomic_file(chunk_record(self.output, index)) as f:
            f.write(json.dumps(record).encode())
        return int(tokens.size)


_WORKER: ChunkWriter | None = None


def start_worker(*args: Any) -> None:
    """A tokenizing worker process's initializer: its :class:`ChunkWriter` (arguments as its), one thread.

    Example::

        args = (backend, eos_id, None, "uint16", output, "text")
        pool = multiprocessing.Pool(4, initializer=start_worker, initargs=args)
    """
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _WORKER = ChunkWriter(*args)


def work(index: int, documents: list[str | JsonLine]) -> int:
    """Write chunk ``index`` in a worker started by :func:`start_worker`; return its token count.

    Example::

        pool.apply_async(work, (index, documents))
    """
    assert _WORKER is not None
    return _WORKER(index, documents)


def chunk_record(output: Path, index: int) -> Path:
    """The record of chunk ``index`` (counts and document lengths), written last: ``.partial/chunk-00000.json``."""
    return output / PARTIAL / f"chunk-{index:05d}.json"


def chunk_file(output: Path, index: int) -> Path:
    """The token file of chunk ``index``: ``.partial/chunk-00000.bin``."""
    return output / PARTIAL / f"chunk-{index:05d}.bin"


def read_record(output: Path, index: int) -> dict[str, Any]:
    """The record of done chunk ``index``, after checking it and its token file.

    Raises:
        DataError: a record that cannot be parsed or lacks a field, or a token file of another size (names the file).
    """
    path = chunk_record(output, index)
    try:
        record = json.loads(path.read_text())
        counts = [record[key] for key in ("documents", "tokens", "bytes")]
        lengths = record["lengths"]
        if not (all(isinstance(c, int) for c in counts) and len(lengths) == counts[0] and sum(lengths) == counts[1]):
            raise ValueError("counts that do not match its lengths")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise DataError(
            f"{path}: corrupt chunk record ({type(err).__name__}: {err}); delete it and run the same command again to "
            "redo that chunk"
        ) from None
    tokens = chunk_file(output, index)
    size = tokens.stat().st_size if tokens.is_file() else None
    if size != record["bytes"]:
        raise DataError(
            f"{tokens}: {size} bytes, its record {path.name} says {record['bytes']}; delete the record and run the "
            "same command again to redo that chunk"
        )
    return record
