"""Checkpoint integrity: a content digest of every tensor written with the checkpoint, verified when it is loaded.

A single-file checkpoint (:class:`~lightning_llmfast.strategy.checkpoint_io.VerifiedCheckpointIO`, the default
checkpoint IO of ``strategy="llmfast"``) carries a checksum of every tensor's bytes (block sums of its words, see
``_checksum``), computed on the host tensors that ``torch.save`` serialises anyway; a distributed (DCP) checkpoint
gets one digest file per rank, with the checksum of each of the rank's shard files and of every tensor chunk inside
them, named with the rank and the saving world size (:func:`write_shard_digests`), so a checkpoint that lost a rank's
part is seen. Loading recomputes them: a mismatch, a truncated or unreadable file raises
:class:`~lightning_llmfast.errors.CheckpointError` naming the file and the first tensor that differs. A checkpoint
verified across several ranks is split between them: each verifies the digest files of the ranks it stands for
(:func:`verify_shard_digests`), so the checkpoint is read once in all, not once per rank; the ranks then decide
together (:func:`~lightning_llmfast.parallel.verdict.agree`). Plain torch and numpy: the Lightning layer builds on
these.

Both detect accidental corruption (bit flips, torn or truncated writes, a block of garbage), not tampering; the block
sums of a single file do not see two 8-byte words swapped inside one 4 KiB block.

Example::

    trainer = L.Trainer(strategy="llmfast", callbacks=[ModelCheckpoint(save_last=True)])
    trainer.fit(module, ckpt_path="last")  # CheckpointError on every rank if any rank finds its part damaged
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_llmfast.errors import CheckpointError

__all__ = [
    "DIGEST_KEY",
    "tensor_digests",
    "verify_shard_digests",
    "verify_tensor_digests",
    "write_shard_digests",
]

DIGEST_KEY = "llmfast_tensor_digests"
"""The checkpoint entry holding ``{tensor path: digest}``."""

_BLOCK_WORDS = 512  # 4 KiB of 8-byte words per block sum
_SHARD_DIGESTS = "integrity_rank{rank}_of_{world}.json"
_SHARD_DIGESTS_RANK = re.compile(r"integrity_rank(\d+)(?:_of_(\d+))?\.json")


def _checksum(data: np.ndarray) -> int:
    """CRC-32 of the 64-bit wrap-around sums of ``data``'s 8-byte words in blocks of 4 KiB, then of its last bytes:
    one memory-bound pass, about 20x faster than a CRC-32 of the bytes themselves."""
    words = data[: data.size // 8 * 8].view(np.uint64)
    full = words.size // _BLOCK_WORDS * _BLOCK_WORDS
    checksum = zlib.crc32(words[:full].reshape(-1, _BLOCK_WORDS).sum(axis=1, dtype=np.uint64).tobytes())
    checksum = zlib.crc32(words[full:].sum(dtype=np.uint64).tobytes(), checksum)
    return zlib.crc32(data[words.size * 8 :].tobytes(), checksum) & 0xFFFFFFFF


def _tensor_digest(tensor: Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}:{_checksum(data):08x}"


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    """``(path, tensor)`` of every tensor in nested dicts, lists and tuples, in insertion order."""
    if isinstance(obj, Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}/{index}" if prefix else str(index))


def tensor_digests(checkpoint: dict[str, Any]) -> dict[str, str]:
    """``{path: "dtype[shape]:checksum"}`` of every tensor of ``checkpoint`` (host tensors: no device read then).

    Example::

        digests = tensor_digests({"state_dict": model.state_dict()})  # {"state_dict/lm_head.weight": ...}
    """
    return {path: _tensor_digest(tensor) for path, tensor in _tensors(checkpoint) if path != DIGEST_KEY}


def verify_tensor_digests(checkpoint: dict[str, Any], digests: dict[str, str], file: str | Path) -> None:
    """Raises :class:`CheckpointError` naming ``file`` and the first tensor whose digest differs (or is missing).

    Example::

        verify_tensor_digests(loaded, loaded.pop(DIGEST_KEY), "last.ckpt")
    """
    found = dict(_tensors(checkpoint))
    for path, expected in digests.items():
        tensor = found.get(path)
        if tensor is None:
            raise CheckpointError(f"{file}: tensor {path!r} is missing from the checkpoint")
        got = _tensor_digest(tensor)
        if got != expected:
            raise CheckpointError(
                f"{file}: tensor {path!r} differs from what was saved (digest {got}, saved {expected})"
            )


def write_shard_digests(
    path: str | Path, rank: int, extra: tuple[str, ...] = (), *, world_size: int = 1, metadata: Any | None = None
) -> Path:
    """After ``dcp.save``: writes the digests of ``rank``'s shard files of the DCP checkpoint ``path`` (and of the
    ``extra`` files, e.g. the metadata): each file's size, every tensor chunk's checksum inside it and the checksum of
    the bytes around the chunks, so every byte is read once and hashed once. The digest file's name holds the rank and
    the saving world size, so that a verification counts the digest files against it (a missing rank is seen).

    Args:
        path: the checkpoint directory.
        rank: the saving rank.
        extra: more files of the directory to digest with the rank's shards.
        world_size: how many ranks saved the checkpoint (each writes its digest file).
        metadata: the checkpoint's DCP ``Metadata`` (``dcp.save`` returns it on every rank); ``None`` reads it.

    Example::

        metadata = dcp.save(state, checkpoint_id=path)
        write_shard_digests(path, rank, (".metadata",) if rank == 0 else (), world_size=world, metadata=metadata)
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if metadata is None:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    chunks: dict[str, list[tuple[str, int, int]]] = {}
    for index, info in metadata.storage_data.items():
        chunks.setdefault(info.relative_path, []).append(
            (f"{index.fqn}{list(index.offset or [])}", info.offset, info.length)
        )
    files = [*sorted(p.name for p in path.glob(f"__{rank}_*.distcp")), *extra]
    entries = {}
    for name in files:
        file = path / name
        items = sorted(chunks.get(name, []), key=lambda item: item[1])
        # Each chunk read alone (a mapped file's touched pages would stay resident: the rank's whole shard at once).
        sums = [[fqn, offset, length, _checksum(_read(file, offset, length))] for fqn, offset, length in items]
        data = _mapped(file)  # only the bytes around the chunks are touched through the map
        entries[name] = {"size": int(data.size), "rest": _checksum(_rest(data, sums)), "chunks": sums}
    out = path / _SHARD_DIGESTS.format(rank=rank, world=world_size)
    out.write_text(json.dumps(entries))
    return out


def _digest_files(path: Path) -> dict[int, Path]:
    """The digest files of the checkpoint ``path`` by saving rank, checked against the saving world size that their
    names hold: every rank's present, of one save (files without it, of lightning_llmfast 0.2, are taken
    as they are)."""
    found: dict[int, Path] = {}
    worlds: set[int] = set()
    for file in path.glob("integrity_rank*.json"):
        match = _SHARD_DIGESTS_RANK.fullmatch(file.name)
        if match is None:
            continue
        found[int(match.group(1))] = file
        if match.group(2) is not None:
            worlds.add(int(match.group(2)))
    if len(worlds) > 1:
        raise CheckpointError(f"{path}: digest files of saves by {sorted(worlds)} ranks mixed in one checkpoint")
    if worlds:
        (world,) = worlds
        missing, beyond = sorted(set(range(world)) - set(found)), sorted(set(found) - set(range(world)))
        if missing:
            raise CheckpointError(
                f"{path}: incomplete: saved by {world} ranks, the digests of rank(s) {missing} missing"
            )
        if beyond:
            raise CheckpointError(f"{path}: digests of rank(s) {beyond}, beyond the {world} ranks that saved it")
    return found


def verify_shard_digests(path: str | Path, rank: int = 0, world_size: int = 1) -> int:
    """Verifies the files that ``rank``'s share of the digest files of the DCP checkpoint ``path`` lists: the digests
    of the saving ranks ``s`` with ``s % world_size == rank`` (a rank resuming at the world size of the save verifies
    the shards it wrote, and rank 0 also the metadata, which saving rank 0 listed). Together the ranks verify every
    file once. Every rank first counts the digest files (their names) against the saving world size: a checkpoint
    missing a rank's digests is refused by every rank. No digest file: nothing to verify.

    Args:
        path: the checkpoint directory.
        rank: this rank among the ``world_size`` ranks that verify together (``0`` of ``1``: every file).
        world_size: how many ranks share the verification.

    Returns:
        The bytes read (and hashed) to verify this rank's share.

    Raises:
        CheckpointError: a saving rank's digest file is missing, a listed file is missing, truncated or altered
            (naming the file and the first tensor chunk that differs), or a digest file is unreadable.

    Example::

        verify_shard_digests("ckpts/last.ckpt")  # every file
        verify_shard_digests("ckpts/last.ckpt", dist.get_rank(), dist.get_world_size())  # this rank's share
    """
    path = Path(path)
    read = 0
    for saving_rank, digest_file in sorted(_digest_files(path).items()):
        if saving_rank % world_size != rank:
            continue
        try:
            entries = json.loads(digest_file.read_text())
        except ValueError as err:
            raise CheckpointError(f"{digest_file}: unreadable digest file ({err})") from err
        for name, entry in entries.items():
            read += _verify_file(path / name, entry)
    return read


def _mapped(file: Path) -> np.ndarray:
    """The bytes of ``file`` as a read-only memory map (pages the save just wrote are read from the page cache, not
    copied); an empty file as an empty array (which cannot be mapped)."""
    if file.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(file, dtype=np.uint8, mode="r")


def _read(file: Path, offset: int, length: int) -> np.ndarray:
    """``length`` bytes of ``file`` from ``offset`` (fewer where the file ends first)."""
    return np.fromfile(file, dtype=np.uint8, count=length, offset=offset)


def _rest(data: np.ndarray, chunks: list[list[Any]]) -> np.ndarray:
    """The bytes of ``data`` outside the ``[fqn, offset, length, ...]`` chunks (headers, pickled metadata: small),
    in order; only those bytes are read."""
    gaps, start = [], 0
    for _, offset, length, *_ in sorted(chunks, key=lambda chunk: chunk[1]):
        gaps.append(data[start : max(start, offset)])
        start = max(start, offset + length)
    gaps.append(data[start:])
    return np.concatenate(gaps)


def _verify_file(file: Path, entry: dict[str, Any]) -> int:
    """Every chunk's checksum, then the size and the bytes around the chunks (``"rest"``): each byte is hashed once.
    A digest without ``"rest"`` (written by lightning_llmfast 0.2) holds one checksum of the whole file instead.
    Returns the file's size (the bytes read)."""
    if not file.is_file():
        raise CheckpointError(f"{file}: missing from the checkpoint")
    data = _mapped(file)
    if "rest" not in entry and data.size == entry["size"] and _checksum(data) == entry["checksum"]:
        return int(data.size)
    for fqn, offset, length, crc in entry["chunks"]:
        if offset + length > data.size or _checksum(data[offset : offset + length]) != crc:
            raise CheckpointError(f"{file}: tensor {fqn!r} differs from what was saved (file of {data.size} bytes)")
    if "rest" not in entry or data.size != entry["size"] or _checksum(_rest(data, entry["chunks"])) != entry["rest"]:
        raise CheckpointError(
            f"{file}: differs from what was saved ({data.size} bytes, saved {entry['size']}) outside the tensor data"
        )
    return int(data.size)
