"""Checkpoints that survive kill -9 in the middle of a save, and one resume decision for all ranks.

A save writes beside its target, flushes and renames (``parallel/atomic.py``); a resume verifies each rank's share of
the digests and decides with one collective (``parallel/verdict.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _distributed import run_distributed
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.fsdp import fully_shard

from lightning_llmfast import CheckpointError
from lightning_llmfast.parallel import atomic, checkpoint, integrity
from lightning_llmfast.parallel.checkpoint import (
    META_FILENAME,
    load_distributed_checkpoint,
    model_state,
    optimizer_state,
    save_distributed_checkpoint,
)

SCRIPT = Path(__file__).parent / "scripts" / "kill_saves.py"
REPO = Path(__file__).parents[1]


def test_a_failed_file_write_leaves_the_previous_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    atomic.write_file_atomically(target, lambda f: f.write(b"first"))

    def torn(file: Any) -> None:
        file.write(b"half of the sec")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.write_file_atomically(target, torn)
    assert target.read_bytes() == b"first"
    assert atomic.temporary_beside(target).read_bytes() == b"half of the sec"  # the stale temporary, beside it
    atomic.clear_stale(target)
    atomic.write_file_atomically(target, lambda f: f.write(b"second"))
    assert target.read_bytes() == b"second" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_directory_is_swapped_in_whole_and_a_kill_between_the_renames_is_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    target, tmp = tmp_path / "last.ckpt", atomic.temporary_beside(tmp_path / "last.ckpt")
    for step in (1, 2):
        atomic.clear_stale(target)
        tmp.mkdir()
        (tmp / "step").write_text(str(step))
        atomic.move_into_place(tmp, target)
        assert (target / "step").read_text() == str(step) and sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    # a kill between the fallback's two renames: the previous checkpoint aside as .old, the new one still temporary
    tmp.mkdir()
    target.rename(tmp_path / ".last.ckpt.old")
    atomic.clear_stale(target)  # what the next save does first
    assert (target / "step").read_text() == "2" and sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    # a single file at the target gives way to a directory (and back), only once the new one is whole
    file_target = tmp_path / "file.ckpt"
    file_target.write_bytes(b"file")
    atomic.temporary_beside(file_target).mkdir()
    atomic.move_into_place(atomic.temporary_beside(file_target), file_target)
    assert file_target.is_dir()
    atomic.write_file_atomically(file_target, lambda f: f.write(b"file again"))
    assert file_target.read_bytes() == b"file again"


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(37, 29)
        self.b = nn.Linear(29, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Tiny()
    fully_shard(model.a)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 37)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, step: int, rank: int) -> None:
    state = {"state_dict": model_state(model), "optimizer_states": [optimizer_state(model, optimizer)]}
    save_distributed_checkpoint({**state, "step": step}, path, rank=rank)


def _disk_full(*args: Any) -> None:
    raise OSError("disk full")


def _own_files(path: Path, rank: int) -> int:
    names = [*(p.name for p in path.glob(f"__{rank}_*.distcp")), *((".metadata", META_FILENAME) if rank == 0 else ())]
    return sum((path / name).stat().st_size for name in names)


@contextmanager
def _metadata_reads() -> Iterator[list[int]]:
    """Reads of DCP's ``.metadata`` while the context is open."""
    reads: list[int] = []
    real = FileSystemReader.read_metadata

    def counting(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
        reads.append(1)
        return real(self, *args, **kwargs)

    FileSystemReader.read_metadata = counting  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        FileSystemReader.read_metadata = real  # type: ignore[method-assign]


def _two_ranks(rank: int, world: int, root: str) -> None:
    root_path = Path(root)
    last, older = root_path / "last.ckpt", root_path / "step=1.ckpt"
    model, optimizer = _sharded(0)
    _save(model, optimizer, older, 1, rank)
    with warnings.catch_warnings(record=True) as caught, _metadata_reads() as saving_reads:
        warnings.simplefilter("always")
        for step in (1, 2):  # the second save replaces the first: no "overwriting" of a directory in place
            _save(model, optimizer, last, step, rank)
    assert not [w for w in caught if "overwrit" in str(w.message)], [str(w.message) for w in caught]
    assert not saving_reads  # the digests are written from the metadata dcp.save returned
    assert sorted(os.listdir(root_path)) == ["last.ckpt", "step=1.ckpt"]  # no temporary left beside them
    # resume: every rank reads and hashes its own files only (rank 0 also the metadata), and loads bitwise
    hashed: list[int] = []
    real = integrity._checksum

    def counting(data: np.ndarray) -> int:
        hashed.append(data.size)
        return real(data)

    integrity._checksum = counting
    try:
        target, target_optimizer = _sharded(1)
        with _metadata_reads() as loading_reads:
            assert load_distributed_checkpoint(last, target, [target_optimizer])["step"] == 2
    finally:
        integrity._checksum = real
    assert sum(hashed) == _own_files(last, rank) > 0
    assert len(loading_reads) == (rank == 0)  # .metadata read once, by rank 0, and shared
    for (key, got), expected in zip(target.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(got.to_local(), expected.to_local()), key
    # a save that fails on one rank, with any exception, fails on every rank alike; the previous one stays
    real_write = checkpoint._write_rank_files
    if rank == 1:
        checkpoint._write_rank_files = _disk_full  # type: ignore[assignment]
    try:
        with pytest.raises(CheckpointError, match=r"saving .*last\.ckpt: rank 1 failed with OSError: disk full"):
            _save(model, optimizer, last, 3, rank)
    finally:
        checkpoint._write_rank_files = real_write
    state = {"state_dict": model_state(model), "optimizer_states": [optimizer_state(model, optimizer)]}
    unpicklable = {"hyper_parameters": {"schedule": lambda step: step}} if rank == 0 else {}  # meta.pt: rank 0's
    with pytest.raises(CheckpointError, match=r"saving .*last\.ckpt: rank 0 failed with \w+: .*pickle"):
        save_distributed_checkpoint({**state, **unpicklable, "step": 4}, last, rank=rank)
    assert load_distributed_checkpoint(last, _sharded(2)[0])["step"] == 2
    # a checkpoint missing a saving rank's digests (and shards): every rank refuses it
    torch.distributed.barrier()
    if rank == 0:
        for name in ("integrity_rank1_of_2.json", "__1_0.distcp"):
            (older / name).unlink()
    torch.distributed.barrier()
    with pytest.raises(
        CheckpointError, match=r"step=1\.ckpt: incomplete: saved by 2 ranks, .* rank\(s\) \[1\] missing"
    ):
        load_distributed_checkpoint(older, _sharded(3)[0])
    # one rank's shard damaged: every rank raises, none falls back to the intact older sibling
    torch.distributed.barrier()
    if rank == 1:
        with open(last / "__1_0.distcp", "r+b") as f:
            f.seek(os.path.getsize(last / "__1_0.distcp") // 2)
            f.write(b"\xff" * 64)
    torch.distributed.barrier()
    pattern = r"last\.ckpt: rank 1 failed with CheckpointError: .*__1_0\.distcp: tensor .* differs"
    with pytest.raises(CheckpointError, match=pattern):
        load_distributed_checkpoint(last, _sharded(3)[0])


def test_each_rank_verifies_its_own_shards_and_all_ranks_decide_together(tmp_path: Path) -> None:
    run_distributed(_two_ranks, 2, str(tmp_path), timeout=180)


def _kill_loop(tmp_path: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "loop", "--root", str(tmp_path), *args],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("devices", "sharding"), [(2, "fsdp"), (1, "ddp")], ids=["dcp-fsdp2-2-processes", "ckpt-file-1-process"]
)
def test_kill_9_during_saves_never_costs_the_last_checkpoint(tmp_path: Path, devices: int, sharding: str) -> None:
    result = _kill_loop(tmp_path, "--runs", "1", "--devices", str(devices), "--sharding", sharding)
    assert result["failed_resumes"] == 0, result["errors"]
    assert result["last_run_rc"] == 0
    assert result["kills_inside_save"] == 1  # the slowed writer put a kill inside a save (a missed one is retried)
