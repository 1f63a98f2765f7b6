"""Bytes each rank reads to verify a distributed checkpoint when it resumes.

    python benchmarks/bench_resume_verify.py --json benchmarks/results/ckpt_resume_verify.json

On ``--world`` gloo processes, a model of ``--layers`` linear layers (FSDP2-sharded over the ranks, AdamW state
included) is saved with ``save_distributed_checkpoint`` and loaded back with ``load_distributed_checkpoint``; every
rank counts the bytes its integrity check hashes (each byte it verifies is read once and hashed once), by wrapping
``lightning_llmfast.parallel.integrity._checksum``. Reported per rank, with the checkpoint's size and each rank's own
files (its shards; rank 0 also ``.metadata`` and ``meta.pt``). Run it on two checkouts to compare.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_llmfast.bench.processes import free_port, leave_world, spawn_world
from lightning_llmfast.parallel import integrity
from lightning_llmfast.parallel.checkpoint import (
    load_distributed_checkpoint,
    model_state,
    optimizer_state,
    save_distributed_checkpoint,
)


def _model(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def _worker(rank: int, world: int, port: int, root: str, layers: int, width: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    path = Path(root) / "last.ckpt"
    model, optimizer = _model(layers, width)
    state = {"state_dict": model_state(model), "optimizer_states": [optimizer_state(model, optimizer)]}
    save_distributed_checkpoint({**state, "step": 1}, path, rank=rank)
    hashed: list[int] = []
    real = integrity._checksum

    def counting(data: np.ndarray) -> int:
        hashed.append(int(data.size))
        return real(data)

    integrity._checksum = counting
    target, target_optimizer = _model(layers, width)
    load_distributed_checkpoint(path, target, [target_optimizer])
    integrity._checksum = real
    own = [*path.glob(f"__{rank}_*.distcp"), *((path / ".metadata", path / "meta.pt") if rank == 0 else ())]
    total = sum(f.stat().st_size for f in path.iterdir() if not f.name.startswith("integrity_"))
    record = {"rank": rank, "bytes_verified": sum(hashed), "own_files_bytes": sum(f.stat().st_size for f in own)}
    (Path(root) / f"rank{rank}.json").write_text(json.dumps({**record, "checkpoint_bytes": total}))
    leave_world()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        spawn_world(_worker, args.world, (args.world, free_port(), root, args.layers, args.width), 300, "resume verify")
        files = [Path(root) / f"rank{r}.json" for r in range(args.world)]
        ranks: list[dict[str, Any]] = [json.loads(f.read_text()) for f in files]
    result = {"world": args.world, "checkpoint_bytes": ranks[0]["checkpoint_bytes"],
              "ranks": [{k: v for k, v in r.items() if k != "checkpoint_bytes"} for r in ranks]}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
