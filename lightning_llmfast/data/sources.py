"""The inputs ``prepare`` reads: files and directories of text corpora, read document by document in input order.

``.jsonl``, ``.jsonl.gz``, ``.parquet``, ``.txt`` files, directories of them (walked in sorted order) and directories
written by HF ``datasets``' ``save_to_disk`` (arrow files, read with pyarrow). jsonl lines leave here unparsed
(:data:`JsonLine`): they are parsed where they are tokenized (:func:`parse_document`), so parsing scales with the
workers. Every bad input is a :class:`~lightning_llmfast.errors.DataError` naming the file (and line).

Example::

    for text, _ in iter_documents(input_files(["corpus/"])): ...
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_llmfast.errors import DataError

__all__ = ["InputFile", "JsonLine", "input_files", "iter_documents", "parse_document", "raw_documents"]

_SUFFIXES = {".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".parquet": "parquet", ".txt": "txt"}

JsonLine = tuple[str, int, bytes]
"""A jsonl document before parsing: ``(file, line number, the line's bytes)``, parsed where it is tokenized."""


@dataclass(frozen=True)
class InputFile:
    """One file to read: its path, its kind (``"jsonl"``, ``"jsonl.gz"``, ``"parquet"``, ``"txt"``, ``"arrow"``)."""

    path: Path
    kind: str


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
    for document, position in raw_documents(files, text_key, lines):
        yield parse_document(document, text_key), position


def raw_documents(files: Sequence[InputFile], text_key: str, lines: bool) -> Iterator[tuple[str | JsonLine, int]]:
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
