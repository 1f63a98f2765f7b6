"""FSDP2 and expert-parallel code paths on a world-size-1 process group: NCCL's device rules on one GPU.

NCCL refuses two ranks on one device, but one rank runs every collective for real: the tensors handed to NCCL must
live on the GPU, counts exchanged by ``all_to_all_single`` must be device tensors, DCP must write and read sharded
(DTensor) state. This script runs, in order, and fails on the first wrong result:

1. FSDP2: :func:`~lightning_llmfast.parallel.shard_module` of the reference MoE model over a 1-rank mesh, one
   forward+backward, outputs and gradients equal the unsharded model's;
2. a DCP save of the sharded model and a load into a second, differently initialised one: equal weights;
3. expert parallelism: :func:`~lightning_llmfast.expert_parallel.shard_experts` over the world group (the count
   exchange and both all-to-alls), one dropless forward+backward equal to the unsharded block;
4. fp8 dispatch (``dispatch_dtype="fp8"``: e4m3 rows and their scales as bytes through NCCL), dropless and capacity:
   outputs within e4m3's rounding of the unsharded block (relative 2-norm error below ``2**-3``), finite input
   gradients.

Usage (one GPU; a CPU test runs it with ``--backend gloo --device cpu`` so it cannot rot)::

    python benchmarks/gpu_nccl_check.py --json out/nccl_check.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_llmfast.bench.processes import free_port
from lightning_llmfast.expert_parallel import shard_experts
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.moe import MoEBlock, MoEConfig
from lightning_llmfast.parallel import (
    ParallelDims,
    load_distributed_checkpoint,
    save_distributed_checkpoint,
    shard_module,
)

__all__ = ["run"]


class _Root(nn.Module):
    """The model as a LightningModule holds it: shard_module shards the children, not the root."""

    def __init__(self, model: MoEGPT) -> None:
        super().__init__()
        self.model = model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to a plain tensor (one rank: its local shard is everything)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float) -> None:
    a, b = a.detach().double(), b.detach().double()
    err = float((a - b).norm() / b.norm().clamp_min(1e-12))
    if not err <= tol:
        raise AssertionError(f"{what}: relative error {err:.2e} > {tol:g}")


def _fsdp_and_dcp(device: torch.device, dtype: torch.dtype, tol: float) -> dict[str, Any]:
    config = MoEGPTConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=96, num_experts=4)
    torch.manual_seed(0)
    reference = MoEGPT(config).to(device, dtype)
    sharded = _Root(copy.deepcopy(reference))
    dims = ParallelDims(1, "fsdp")
    dims.build_mesh(device.type)
    mesh = dims.dp_shard_mesh
    shard_module(sharded, mesh, list(sharded.model.layers))
    ids = torch.randint(0, config.vocab_size, (2, 48), device=device)
    out_ref, out = reference(ids), sharded.model(ids)
    _close(out, out_ref, "FSDP2 forward", tol)
    out_ref.float().square().mean().backward()
    out.float().square().mean().backward()
    grads = dict(reference.named_parameters())
    for name, param in sharded.model.named_parameters():
        _close(_full(param.grad), grads[name].grad, f"FSDP2 gradient of {name}", tol)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        save_distributed_checkpoint({"state_dict": sharded.state_dict()}, path, rank=0)
        torch.manual_seed(1)
        other = _Root(MoEGPT(config).to(device, dtype))
        shard_module(other, mesh, list(other.model.layers))
        load_distributed_checkpoint(path, other)
        for (name, a), (_, b) in zip(sharded.state_dict().items(), other.state_dict().items()):
            if not torch.equal(_full(a), _full(b)):
                raise AssertionError(f"DCP round trip changed {name}")
    return {"fsdp_parameters": sum(p.numel() for p in reference.parameters()), "dcp_entries": len(other.state_dict())}


def _expert_parallel(device: torch.device, dtype: torch.dtype, tol: float) -> dict[str, Any]:
    torch.manual_seed(2)
    reference = MoEBlock(MoEConfig.build(32, 48, 4, 2, backend="torch")).to(device, dtype)
    block = shard_experts(copy.deepcopy(reference), dist.group.WORLD)
    x = torch.randn(37, 32, device=device, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn_like(x)
    y, y_ref = block(x), reference(x_ref)
    _close(y, y_ref, "expert-parallel dropless forward", tol)
    y.backward(grad)
    y_ref.backward(grad)
    _close(x.grad, x_ref.grad, "expert-parallel input gradient", tol)
    return {"ep_tokens": x.shape[0]}


def _fp8_dispatch(device: torch.device, dtype: torch.dtype, tol: float) -> dict[str, Any]:
    for factor in (None, 1.0):
        torch.manual_seed(3)
        reference = MoEBlock(MoEConfig.build(32, 48, 4, 2, capacity_factor=factor, backend="torch")).to(device, dtype)
        block = shard_experts(copy.deepcopy(reference), dist.group.WORLD, dispatch_dtype="fp8")
        x = torch.randn(37, 32, device=device, dtype=dtype, requires_grad=True)
        y = block(x)
        _close(y, reference(x.detach()), f"fp8 dispatch forward (capacity_factor={factor})", max(tol, 2.0**-3))
        y.backward(torch.randn_like(y))
        assert x.grad is not None and bool(torch.isfinite(x.grad).all()), "fp8 dispatch: non-finite input gradient"
    return {"fp8_dispatch_modes": 2}


def run(backend: str = "nccl", device: str = "cuda") -> dict[str, Any]:
    """Initialise a world-size-1 group on ``backend``, run the four checks, tear the group down; their report.

    Example::

        run("gloo", "cpu")["passed"]  # True
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(seconds=60))
    report: dict[str, Any] = {"backend": backend, "device": str(dev), "dtype": str(dtype).removeprefix("torch.")}
    try:
        checks = (("fsdp_dcp", _fsdp_and_dcp), ("expert_parallel", _expert_parallel), ("fp8_dispatch", _fp8_dispatch))
        for name, check in checks:
            start = time.perf_counter()
            report.update(check(dev, dtype, tol))
            report[f"{name}_s"] = round(time.perf_counter() - start, 2)
            print(f"PASS {name} ({report[f'{name}_s']} s)", flush=True)
        report["passed"] = True
    finally:
        dist.destroy_process_group()
    return report


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    report = run(args.backend, args.device)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
