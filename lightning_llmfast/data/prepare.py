"""The prepare pipeline: local text corpora -> token shards, document index, pre-packed rows and manifest.

Documents are read in input order (file order, then row order) and cut into chunks of ``chunk_docs`` documents (or
:data:`CHUNK_SIZE` of input); the chunk boundaries depend on the inputs alone, never on ``workers``. jsonl lines
travel to the workers unparsed (the main process only splits lines): JSON is parsed where it is tokenized. Each
chunk is tokenized (by a worker process when ``workers > 1``) and written to ``.partial/`` under a temporary name,
flushed to disk and renamed, with a record of its document lengths renamed last: a chunk is either done or absent.
Once every chunk is done, the chunks are concatenated into token shards of about ``shard_bytes`` (so the number of
files grows with the bytes, not with the documents), the document index, the validation split and the packed rows
are derived from the chunk records alone, and ``manifest.json`` is written last (every file flushed to disk before
its rename, every sha256 read back from the file on disk). So a killed run, started again with the same command,
skips the done chunks and ends with the same bytes as an uninterrupted one, and a directory without a manifest is
never mistaken for a complete one. Memory stays bounded by a few chunks in flight (plus the packer's window of
documents), whatever the size of the input.

``prepare`` never deletes what it cannot read: an output whose manifest or settings cannot be parsed, or that was
written in another format version, is refused unless ``overwrite`` is set.

The tokenizer runs through the ``tokenizers`` backend of the user's transformers tokenizer (exactly the one
``AutoTokenizer`` builds, handed to the workers as JSON), without special tokens; EOS is appended to every document
(and BOS prepended with ``bos=True``).

This module runs the steps; each lives with its concept: reading the inputs (:mod:`~lightning_llmfast.data.sources`),
tokenizing and writing a chunk (:mod:`~lightning_llmfast.data.chunks`), packing rows
(:mod:`~lightning_llmfast.data.layouts`) and writing files whole (:mod:`~lightning_llmfast.data.files`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.data.chunks import (
    PARTIAL,
    ChunkWriter,
    TokenizerInfo,
    chunk_file,
    chunk_record,
    load_tokenizer,
    read_record,
    start_worker,
    work,
)
from lightning_llmfast.data.files import atomic_file, fsync_directory, npy_from_raw, sha256_file
from lightning_llmfast.data.layouts import PACK_WINDOW, SPLITS, id_windows, in_validation, layout_files, write_layout
from lightning_llmfast.data.prepared import FORMAT, FORMAT_VERSION, MANIFEST, read_manifest, shard_file
from lightning_llmfast.data.sources import (
    InputFile,
    JsonLine,
    input_files,
    iter_documents,
    parse_document,
    raw_documents,
)
from lightning_llmfast.errors import ConfigError, DataError

__all__ = [
    "CHUNK_SIZE",
    "PARTIAL",
    "SHARD_BYTES",
    "ChunkWriter",
    "InputFile",
    "JsonLine",
    "PrepareConfig",
    "TokenizerInfo",
    "input_files",
    "iter_documents",
    "load_tokenizer",
    "parse_document",
    "prepare",
    "verify",
]

CHUNK_SIZE = 1 << 25
"""A chunk also ends once its documents reach this size (jsonl: bytes of the lines; other inputs: characters of
the texts), so a chunk of long documents stays bounded."""
SHARD_BYTES = 1 << 28
"""Default size of a token shard (256 MiB): chunks are concatenated into a shard until it reaches this many bytes."""


@dataclass(frozen=True)
class PrepareConfig:
    """What ``prepare`` reads, how it tokenizes and packs, and where it writes.

    Attributes:
        inputs: files (``.jsonl``, ``.jsonl.gz``, ``.parquet``, ``.txt``), directories of them (walked in sorted
            order), or directories saved by HF ``datasets`` (``save_to_disk``: arrow files and ``state.json``).
        tokenizer: a local transformers tokenizer directory with a fast tokenizer (``tokenizer.json``).
        output: the directory to write.
        text_key: field (jsonl) or column (parquet, arrow) holding each document's text.
        workers: tokenizing processes; the output is the same for any number.
        seq_len: row lengths to pre-pack the documents for (one layout each).
        val_fraction: share of documents (whole ones, drawn by a fixed hash of their index) in the validation split.
        lines: read ``.txt`` files as one document per non-empty line instead of one per file.
        bos: prepend the tokenizer's BOS to every document.
        overwrite: replace an output prepared with other settings, in another format version or that cannot be
            read (else refused, and left untouched).
        chunk_docs: documents per chunk: the unit of work, of resuming and of memory.
        shard_bytes: size a token shard grows to before the next one starts (whole chunks, whole documents).
        progress: show a progress bar on a terminal.

    Example::

        config = PrepareConfig(inputs=("corpus.jsonl",), tokenizer="tok/", output="prepared/", seq_len=(2048,))
    """

    inputs: tuple[str, ...]
    tokenizer: str
    output: str
    text_key: str = "text"
    workers: int = 1
    seq_len: tuple[int, ...] = (2048,)
    val_fraction: float = 0.01
    lines: bool = False
    bos: bool = False
    overwrite: bool = False
    chunk_docs: int = 4096
    shard_bytes: int = SHARD_BYTES
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.inputs, (str, os.PathLike)) or not self.inputs:
            raise ConfigError(f"inputs must be a non-empty list of paths, got {self.inputs!r}")
        object.__setattr__(self, "inputs", tuple(str(p) for p in self.inputs))
        object.__setattr__(self, "tokenizer", str(self.tokenizer))
        object.__setattr__(self, "output", str(self.output))
        if not isinstance(self.text_key, str) or not self.text_key:
            raise ConfigError(f"text_key must be a non-empty string, got {self.text_key!r}")
        check_int("workers", self.workers, low=1)
        lengths = (self.seq_len,) if isinstance(self.seq_len, int) else tuple(self.seq_len)
        if not lengths:
            raise ConfigError("seq_len: give at least one row length")
        object.__setattr__(self, "seq_len", tuple(sorted({check_int("seq_len", n, low=2) for n in lengths})))
        check_number("val_fraction", self.val_fraction, low=0, high=1)
        if self.val_fraction >= 1:
            raise ConfigError(f"val_fraction must be < 1 (some documents must train), got {self.val_fraction}")
        for name in ("lines", "bos", "overwrite", "progress"):
            check_bool(name, getattr(self, name))
        check_int("chunk_docs", self.chunk_docs, low=1)
        check_int("shard_bytes", self.shard_bytes, low=1)


def _settings(config: PrepareConfig, files: Sequence[InputFile], tokenizer: TokenizerInfo) -> dict[str, Any]:
    """Everything the output's bytes depend on (``workers`` and ``progress`` do not)."""
    return {
        "format_version": FORMAT_VERSION,
        "inputs": [
            {"path": str(f.path.resolve()), "bytes": f.path.stat().st_size, "mtime_ns": f.path.stat().st_mtime_ns}
            for f in files
        ],
        "tokenizer_sha256": tokenizer.sha256,
        "text_key": config.text_key,
        "lines": config.lines,
        "bos": config.bos,
        "seq_len": list(config.seq_len),
        "val_fraction": config.val_fraction,
        "chunk_docs": config.chunk_docs,
        "chunk_size": CHUNK_SIZE,
        "shard_bytes": config.shard_bytes,
        "packing": {"policy": "best-fit decreasing", "window": PACK_WINDOW},
    }


def _ours(name: str) -> bool:
    """Whether ``name`` is a file this pipeline (or a reader deriving a layout: ``layout-L*``, and its temporary
    ``.layout-L*``) writes in an output directory."""
    prefixes = (MANIFEST, "documents.npy", "tokens-", "rows-L", "pieces-L", "layout-L", ".layout-L")
    return name == PARTIAL or name.startswith(prefixes)


def _previous(output: Path) -> tuple[dict[str, Any] | None, str]:
    """The settings of what ``output`` holds (``None``: nothing of a run) and what it is, for messages.

    Raises:
        DataError: a manifest or settings file that cannot be parsed, or one of another format version: prepare
            does not replace what it cannot read unless told to (``overwrite``).
    """
    if (output / MANIFEST).is_file():
        source, what = output / MANIFEST, "a prepared dataset"
    elif (output / PARTIAL / "settings.json").is_file():
        source, what = output / PARTIAL / "settings.json", "an unfinished preparation"
    elif any(_ours(n) and n != PARTIAL for n in os.listdir(output)) or any((output / PARTIAL).glob("*")):
        raise DataError(f"output {output}: holds prepared files without {MANIFEST} or settings to read")
    else:
        return None, ""
    try:
        loaded = json.loads(source.read_text())
        settings = loaded["settings"] if source.name == MANIFEST else loaded
        version = settings["format_version"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"output {output}: {source.name} cannot be read ({type(err).__name__}: {err})") from None
    if version != FORMAT_VERSION:
        raise DataError(f"output {output}: holds {what} of format version {version!r}, not {FORMAT_VERSION}")
    return settings, what


def _claim_output(output: Path, settings: dict[str, Any], overwrite: bool) -> bool:
    """Make ``output`` ready for a run with ``settings``; ``True`` when it already holds that complete output.

    Nothing is deleted unless ``overwrite`` is set: an output of other settings, of another format version, or whose
    manifest or settings cannot be parsed is refused and left as it is.
    """
    if output.exists() and not output.is_dir():
        raise DataError(f"output {output}: exists and is not a directory")
    if not output.is_dir():
        output.mkdir(parents=True)
        return False
    foreign = sorted(n for n in os.listdir(output) if not _ours(n))
    if foreign:
        raise DataError(
            f"output {output}: holds files prepare did not write ({', '.join(foreign[:3])}...); choose a new or empty "
            "directory"
        )
    try:
        previous, what = _previous(output)
    except DataError as err:
        if not overwrite:
            raise DataError(f"{err}; pass --overwrite to replace it, or choose another directory") from None
        previous, what = {}, ""
    if previous == settings:
        return (output / MANIFEST).is_file()
    if previous is not None and not overwrite:
        differ = sorted(k for k in set(previous) | set(settings) if previous.get(k) != settings.get(k))
        raise DataError(
            f"output {output}: holds {what} with other settings ({', '.join(differ)} differ); pass --overwrite to "
            "replace it, or choose another directory"
        )
    # Replace: the manifest goes first, so the directory is never a complete-looking mix of two runs.
    if (output / MANIFEST).exists():
        (output / MANIFEST).unlink()
    for name in sorted(os.listdir(output)):
        target = output / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return False


def prepare(config: PrepareConfig) -> dict[str, Any]:
    """Tokenize, shard, index and pre-pack ``config.inputs`` into ``config.output``; return the manifest.

    Starting again after a crash (even ``kill -9``) with the same config continues from the done chunks; an output
    already complete with the same settings is returned as it is.

    Raises:
        DataError: bad input (see :func:`input_files`, :func:`iter_documents`, :func:`load_tokenizer`), no document
            at all, a validation split that leaves nothing to train on, an output that holds other data, or one
            that cannot be read or is of another format version (without ``overwrite``), or a corrupt chunk record
            of an unfinished run (named).

    Example::

        from lightning_llmfast.data.prepare import PrepareConfig, prepare

        manifest = prepare(PrepareConfig(inputs=("corpus.jsonl",), tokenizer="tok/", output="prepared/", workers=4))
        manifest["num_documents"], manifest["num_tokens"]
    """
    files = input_files(config.inputs)
    tokenizer = load_tokenizer(config.tokenizer)
    documents = raw_documents(files, config.text_key, config.lines)
    first = next(documents, None)
    if first is None:
        raise DataError(f"no document in the inputs ({', '.join(str(f.path) for f in files)}): they are empty")
    output = Path(config.output)
    settings = _settings(config, files, tokenizer)
    if _claim_output(output, settings, config.overwrite):
        return read_manifest(output)
    (output / PARTIAL).mkdir(exist_ok=True)
    with atomic_file(output / PARTIAL / "settings.json") as f:
        f.write(json.dumps(settings, indent=1).encode())
    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    total = sum(f.path.stat().st_size for f in files)
    num_chunks = _tokenize(config, chain([first], documents), tokenizer, dtype, total)
    return _assemble(output, num_chunks, config, settings, tokenizer, dtype)


def _chunks(documents: Iterator[tuple[str | JsonLine, int]], size: int) -> Iterator[tuple[list[str | JsonLine], int]]:
    """Consecutive chunks of ``size`` documents or :data:`CHUNK_SIZE` of input, with the input position after each;
    the boundaries depend on the documents alone."""
    chunk: list[str | JsonLine] = []
    position = used = 0
    for document, position in documents:
        chunk.append(document)
        used += len(document) if isinstance(document, str) else len(document[2])
        if len(chunk) == size or used >= CHUNK_SIZE:
            yield chunk, position
            chunk, used = [], 0
    if chunk:
        yield chunk, position


def _tokenize(
    config: PrepareConfig, documents: Iterator[tuple[str, int]], tokenizer: TokenizerInfo, dtype: str, total: int
) -> int:
    """Write every chunk not done yet (at most two per worker in flight); return the number of chunks."""
    from tqdm.auto import tqdm

    output = Path(config.output)
    args = (
        tokenizer.backend,
        tokenizer.eos_id,
        tokenizer.bos_id if config.bos else None,
        dtype,
        str(output),
        config.text_key,
    )
    if config.workers == 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        local, pool = ChunkWriter(*args), None
    else:
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        local, pool = None, context.Pool(config.workers, initializer=start_worker, initargs=args)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=None if config.progress else True)
    pending: deque[tuple[Any, int]] = deque()
    started, done = time.perf_counter(), {"documents": 0, "tokens": 0}

    def finish(tokens: int, documents: int) -> None:
        done["tokens"] += tokens
        done["documents"] += documents
        elapsed = max(time.perf_counter() - started, 1e-9)
        bar.set_postfix_str(f"{done['documents'] / elapsed:,.0f} docs/s, {done['tokens'] / elapsed:,.0f} tokens/s")

    index = 0
    try:
        for index, (chunk, position) in enumerate(_chunks(documents, config.chunk_docs)):
            if not chunk_record(output, index).is_file():
                if local is not None:
                    finish(local(index, chunk), len(chunk))
                else:
                    pending.append((pool.apply_async(work, (index, chunk)), len(chunk)))  # type: ignore[union-attr]
                    while len(pending) > 2 * config.workers:
                        result, count = pending.popleft()
                        finish(result.get(), count)
            bar.update(max(position - bar.n, 0))
        while pending:
            result, count = pending.popleft()
            finish(result.get(), count)
        bar.update(max(total - bar.n, 0))
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return index + 1


def _write_shards(output: Path, chunks: list[dict[str, Any]], shard_bytes: int) -> list[dict[str, Any]]:
    """Concatenate the chunks' token files, in order, into shards of about ``shard_bytes``; return their entries."""
    shards: list[dict[str, Any]] = []
    first = 0
    while first < len(chunks):
        last, size = first, chunks[first]["bytes"]
        while size < shard_bytes and last + 1 < len(chunks):
            last += 1
            size += chunks[last]["bytes"]
        name = shard_file(len(shards))
        with atomic_file(output / name) as f:
            for index in range(first, last + 1):
                with open(chunk_file(output, index), "rb") as source:
                    shutil.copyfileobj(source, f, 1 << 22)
        group = chunks[first : last + 1]
        shards.append({"file": name, "first_document": group[0]["first_document"],
                       "documents": sum(c["documents"] for c in group), "first_token": group[0]["first_token"],
                       "tokens": sum(c["tokens"] for c in group)})  # fmt: skip
        first = last + 1
    return shards


def _assemble(
    output: Path,
    num_chunks: int,
    config: PrepareConfig,
    settings: dict[str, Any],
    tokenizer: TokenizerInfo,
    dtype: str,
) -> dict[str, Any]:
    """Shard, index, split, pack and list what the chunks hold, then write the manifest (last, atomically)."""
    partial = output / PARTIAL
    chunks: list[dict[str, Any]] = []
    ids_raw = {split: open(partial / f"{split}-documents.bin", "wb") for split in SPLITS}
    offsets_raw = partial / "documents.bin"
    split_counts = {split: {"documents": 0, "tokens": 0} for split in SPLITS}
    document = token = 0
    with open(offsets_raw, "wb") as offsets:
        offsets.write(np.zeros(1, dtype=np.int64).tobytes())
        for index in range(num_chunks):
            record = read_record(output, index)
            lengths = np.array(record["lengths"], dtype=np.int64)
            chunks.append({"first_document": document, "first_token": token,
                           **{k: record[k] for k in ("documents", "tokens", "bytes")}})  # fmt: skip
            offsets.write((token + np.cumsum(lengths)).tobytes())
            val = in_validation(document, len(lengths), config.val_fraction)
            for split, members in (("train", ~val), ("val", val)):
                ids_raw[split].write((document + np.flatnonzero(members)).astype(np.int64).tobytes())
                split_counts[split]["documents"] += int(members.sum())
                split_counts[split]["tokens"] += int(lengths[members].sum())
            document += len(lengths)
            token += record["tokens"]
    for f in ids_raw.values():
        f.close()
    if split_counts["train"]["documents"] == 0:
        raise DataError(f"val_fraction={config.val_fraction} leaves no training document among {document}; lower it")
    shards = _write_shards(output, chunks, config.shard_bytes)
    npy_from_raw(offsets_raw, output / "documents.npy", 1)
    offsets_map = np.load(output / "documents.npy", mmap_mode="r")
    layouts: dict[str, dict[str, Any]] = {}
    for seq_len in config.seq_len:
        layouts[str(seq_len)] = {}
        for split in SPLITS:
            ids = np.memmap(partial / f"{split}-documents.bin", dtype=np.int64, mode="r") if split_counts[split][
                "documents"] else np.zeros(0, dtype=np.int64)  # fmt: skip
            layouts[str(seq_len)][split] = write_layout(output, seq_len, split, id_windows(ids), offsets_map, partial)
    del offsets_map
    names = [s["file"] for s in shards] + ["documents.npy"]
    names += [n for s in config.seq_len for split in SPLITS for n in layout_files(s, split)]
    # read back from disk: the checksums are of the bytes a reader will get
    files = {name: {"bytes": (output / name).stat().st_size, "sha256": sha256_file(output / name)} for name in names}
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": tokenizer.record(),
        "dtype": dtype,
        "num_documents": document,
        "num_tokens": token,
        "splits": split_counts,
        "shards": shards,
        "layouts": layouts,
        "files": dict(sorted(files.items())),
        "settings": settings,
    }
    fsync_directory(output)
    with atomic_file(output / MANIFEST) as f:
        f.write((json.dumps(manifest, indent=1) + "\n").encode())
    fsync_directory(output)
    shutil.rmtree(partial)
    return manifest


def verify(path: str | Path) -> dict[str, Any]:
    """Recheck the size and sha256 of every file of a prepared directory against its manifest.

    Raises:
        DataError: see :func:`~lightning_llmfast.data.prepared.read_manifest` (names the first bad file).

    Example::

        verify("prepared/")  # returns the manifest when every file matches
    """
    return read_manifest(path, checksums=True)
