"""``StagedReader``: byte ranges of files delivered in batches, each range's bytes exact and aligned, errors named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_llmfast.errors import CheckpointError
from lightning_llmfast.parallel.staging import ALIGNMENT, StagedReader


def test_ranges_arrive_exact_and_aligned_in_few_batches(tmp_path: Path) -> None:
    data = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    got: list[tuple[int, int, torch.Tensor, int]] = []
    ranges = [(0, 1), (1, 63), (997, 3), (64, 64), (5, 65), (0, 256), (400, 0), (300, 200)]  # 4 share the first batch
    with StagedReader(torch.device("cpu"), capacity=256) as reader:
        for offset, n in ranges:
            reader.add(
                [(path, offset, n)],
                lambda parts, o=offset, n=n: got.append((o, n, parts[0].clone(), parts[0].storage_offset())),
            )
        assert reader.batches < len(ranges)  # delivered when full, not one by one
    assert [(o, n) for o, n, _, _ in got] == ranges
    for offset, n, part, start in got:
        assert torch.equal(part, data[offset : offset + n]) and start % ALIGNMENT == 0
    assert reader.bytes_read == sum(n for _, n in ranges)
    # aligned to 64: 1+63+3+64 | 65 | 256+0 | 200; an add that does not fit starts the next batch
    assert reader.batches == 4


def test_a_short_file_and_an_oversized_add_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="short"), StagedReader(torch.device("cpu"), 64) as reader:
        reader.add([(path, 4, 8)], lambda parts: None)
    with pytest.raises(ValueError, match="capacity"), StagedReader(torch.device("cpu"), 64) as reader:
        reader.add([(path, 0, 65)], lambda parts: None)
