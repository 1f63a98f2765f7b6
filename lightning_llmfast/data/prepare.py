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
"""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.data.prepared import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PACK_WINDOW,
    SPLITS,
    atomic_file,
    in_validation,
    layout_files,
    npy_from_raw,
    read_manifest,
    sha256_file,
    shard_file,
    write_layout,
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

PARTIAL = ".partial"
"""Directory inside the output holding the settings and the records of done chunks while a preparation runs."""

_SUFFIXES = {".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".parquet": "parquet", ".txt": "txt"}
_ENCODE_BATCH = 256  # documents encoded at once inside a chunk
CHUNK_SIZE = 1 << 25
"""A chunk also ends once its documents reach this size (jsonl: bytes of the lines; other inputs: characters of
the texts), so a chunk of long documents stays bounded."""
SHARD_BYTES = 1 << 28
"""Default size of a token shard (256 MiB): chunks are concatenated into a shard until it reaches this many bytes."""

JsonLine = tuple[str, int, bytes]
"""A jsonl document before parsing: ``(file, line number, the line's bytes)``, parsed where it is tokenized."""


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


@dataclass(frozen=True)
class InputFile:
    """One file to read: its path, its kind (``"jsonl"``, ``"jsonl.gz"``, ``"parquet"``, ``"txt"``, ``"arrow"``)."""

    path: Path
    kind: str


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


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, kind in _SUFFIXES.items():
        if name.endswith(suffix):
            return kind
    return None


def _arrow_files(directory: Path) -> list[InputFile]:
    """The arrow files of an HF ``datasets`` directory, in the order its ``state.json`` lists them."""
    try:
        state = json.loads((directory / "state.json").read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"input {directory}: unreadable HF datasets state.json ({err})") from None
    return [InputFile(directory / name, "arrow") for name in names]


def input_files(paths: Sequence[str | Path]) -> list[InputFile]:
    """Expand ``paths`` into the files to read, in order; directories are walked in sorted order.

    Raises:
        DataError: a path that does not exist, a file of an unsupported kind, a ``DatasetDict`` directory (pass one
            split's directory), or no file at all.

    Example::

        [f.path.name for f in input_files(["corpus/"])]  # ['a.jsonl', 'b.parquet', ...]
    """
    files: list[InputFile] = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise DataError(f"input {path}: no such file or directory")
        if path.is_file():
            kind = _kind(path)
            if kind is None:
                raise DataError(
                    f"input {path}: unsupported file type (expected .jsonl, .jsonl.gz, .parquet, .txt, or an HF "
                    "datasets directory)"
                )
            files.append(InputFile(path, kind))
            continue
        if (path / "dataset_dict.json").is_file():
            raise DataError(f"input {path}: an HF DatasetDict; pass one split's directory (e.g. {path / 'train'})")
        if (path / "state.json").is_file():
            files.extend(_arrow_files(path))
            continue
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            here = Path(root)
            if (here / "state.json").is_file():
                dirs[:] = []
                files.extend(_arrow_files(here))
                continue
            files.extend(InputFile(here / n, k) for n in sorted(names) if (k := _kind(here / n)) and n[0] != ".")
    if not files:
        raise DataError(f"no input file (.jsonl, .jsonl.gz, .parquet, .txt, HF datasets) in {list(map(str, paths))}")
    return files


def _text(value: object, where: str, text_key: str) -> str:
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise DataError(f"{where}: field {text_key!r} is {kind}, not a string")
    return value


def _jsonl(file: InputFile) -> Iterator[tuple[JsonLine, int]]:
    """Every non-blank line of a jsonl file, unparsed, with the file's bytes read so far."""
    name, number = str(file.path), 0
    with open(file.path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if file.kind == "jsonl.gz" else raw
        try:
            for number, line in enumerate(stream, start=1):
                if line.strip():
                    yield (name, number, line), raw.tell()
        except (OSError, EOFError, zlib.error) as err:  # a damaged .gz (BadGzipFile is an OSError)
            raise DataError(f"{file.path}: unreadable after line {number} ({type(err).__name__}: {err})") from None


def parse_document(document: str | JsonLine, text_key: str) -> str:
    """The text of a document as :func:`iter_documents` reads it: a jsonl line is parsed here.

    Raises:
        DataError: malformed JSON or text that is not UTF-8 (file and line number), not a JSON object, no
            ``text_key`` field, or a value that is not a string.

    Example::

        parse_document(("a.jsonl", 1, b'{"text": "hi"}\\n'), "text")  # 'hi'
    """
    if isinstance(document, str):
        return document
    name, number, line = document
    where = f"{name}:{number}"
    try:
        record = json.loads(line.rstrip(b"\r\n"))
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not UTF-8 ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, expected an object with {text_key!r}")
    if text_key not in record:
        raise DataError(f"{where}: no field {text_key!r} (fields: {', '.join(map(repr, record)) or 'none'})")
    return _text(record[text_key], where, text_key)


def _table_batches(file: InputFile) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if file.kind == "parquet":
            yield from pq.ParquetFile(file.path).iter_batches(batch_size=1024)
            return
        with pa.memory_map(str(file.path)) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
                return
            yield from reader
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{file.path}: unreadable {file.kind} file ({err})") from None


def _columnar(file: InputFile, text_key: str) -> Iterator[tuple[str, int]]:
    import pyarrow as pa

    row = 0
    for batch in _table_batches(file):
        if text_key not in batch.schema.names:
            raise DataError(f"{file.path}: no column {text_key!r} (columns: {', '.join(batch.schema.names)})")
        column = batch.column(text_key)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            raise DataError(f"{file.path}: column {text_key!r} is {column.type}, not a string")
        for value in column.to_pylist():
            row += 1
            yield _text(value, f"{file.path}: row {row}", text_key), 0  # progress moves per file


def _txt(file: InputFile, lines: bool) -> Iterator[tuple[str, int]]:
    with open(file.path, "rb") as raw:
        if not lines:
            data = raw.read()
            try:
                yield data.decode("utf-8"), len(data)
            except UnicodeDecodeError as err:
                raise DataError(f"{file.path}: not UTF-8 ({err.reason} at byte {err.start})") from None
            return
        for number, line in enumerate(raw, start=1):
            try:
                text = line.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                raise DataError(f"{file.path}:{number}: not UTF-8 ({err.reason} at byte {err.start})") from None
            if text.strip():
                yield text, raw.tell()


def iter_documents(
    files: Sequence[InputFile], text_key: str = "text", lines: bool = False
) -> Iterator[tuple[str, int]]:
    """Every document's text in input order, with the input bytes read so far (for progress).

    Raises:
        DataError: a malformed JSON line (file and line number), a record without ``text_key`` or whose value is not
            a string, a missing column, text that is not UTF-8, or an unreadable parquet/arrow/``.gz`` file.

    Example::

        for text, _ in iter_documents(input_files(["corpus.jsonl"])): ...
    """
    for document, position in _raw_documents(files, text_key, lines):
        yield parse_document(document, text_key), position


def _raw_documents(files: Sequence[InputFile], text_key: str, lines: bool) -> Iterator[tuple[str | JsonLine, int]]:
    """:func:`iter_documents` with jsonl lines left unparsed (:data:`JsonLine`): what the main process reads."""
    done = 0
    stream: Iterator[tuple[str | JsonLine, int]]
    for file in files:
        if file.kind in ("jsonl", "jsonl.gz"):
            stream = _jsonl(file)
        elif file.kind == "txt":
            stream = _txt(file, lines)
        else:
            stream = _columnar(file, text_key)
        size = 0
        for text, position in stream:
            size = position
            yield text, done + position
        done += max(size, file.path.stat().st_size)


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
        with atomic_file(_chunk_file(self.output, index)) as f:
            f.write(tokens.data)
        record = {"documents": len(texts), "tokens": int(tokens.size), "bytes": tokens.nbytes, "lengths": lengths}
        with atomic_file(_chunk_record(self.output, index)) as f:
            f.write(json.dumps(record).encode())
        return int(tokens.size)


_WORKER: ChunkWriter | None = None


def _start_worker(*args: Any) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _WORKER = ChunkWriter(*args)


def _work(index: int, documents: list[str | JsonLine]) -> int:
    assert _WORKER is not None
    return _WORKER(index, documents)


def _chunk_record(output: Path, index: int) -> Path:
    return output / PARTIAL / f"chunk-{index:05d}.json"


def _chunk_file(output: Path, index: int) -> Path:
    return output / PARTIAL / f"chunk-{index:05d}.bin"


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
    """Whether ``name`` is a file this pipeline (or a reader deriving a layout) writes in an output directory."""
    return name == PARTIAL or name.startswith((MANIFEST, "documents.npy", "tokens-", "rows-L", "pieces-L"))


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
    documents = _raw_documents(files, config.text_key, config.lines)
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
        local, pool = None, context.Pool(config.workers, initializer=_start_worker, initargs=args)
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
            if not _chunk_record(output, index).is_file():
                if local is not None:
                    finish(local(index, chunk), len(chunk))
                else:
                    pending.append((pool.apply_async(_work, (index, chunk)), len(chunk)))  # type: ignore[union-attr]
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


def _read_record(output: Path, index: int) -> dict[str, Any]:
    """The record of done chunk ``index``, after checking it and its token file.

    Raises:
        DataError: a record that cannot be parsed or lacks a field, or a token file of another size (names the file).
    """
    path = _chunk_record(output, index)
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
    tokens = _chunk_file(output, index)
    size = tokens.stat().st_size if tokens.is_file() else None
    if size != record["bytes"]:
        raise DataError(
            f"{tokens}: {size} bytes, its record {path.name} says {record['bytes']}; delete the record and run the "
            "same command again to redo that chunk"
        )
    return record


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
                with open(_chunk_file(output, index), "rb") as source:
                    shutil.copyfileobj(source, f, 1 << 22)
        group = chunks[first : last + 1]
        shards.append({"file": name, "first_document": group[0]["first_document"],
                       "documents": sum(c["documents"] for c in group), "first_token": group[0]["first_token"],
                       "tokens": sum(c["tokens"] for c in group)})  # fmt: skip
        first = last + 1
    return shards


def _fsync_directory(path: Path) -> None:
    """Make the renames inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


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
            record = _read_record(output, index)
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
            layouts[str(seq_len)][split] = write_layout(output, seq_len, split, ids, offsets_map, partial)
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
    _fsync_directory(output)
    with atomic_file(output / MANIFEST) as f:
        f.write((json.dumps(manifest, indent=1) + "\n").encode())
    _fsync_directory(output)
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
