"""Compressed gradient reduction: bf16 through DDP's hook, PowerSGD with resumable state, and the sync-time metric.

The 2-process fits (tests/scripts/comm_fit.py) run once per session and are shared by the slow tests below.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _distributed import run_distributed
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_llmfast import ConfigError, LLMFastStrategy
from lightning_llmfast.comm import PowerSGDConfig, with_reduce_dtype
from lightning_llmfast.comm.grad import STATE_KEY
from lightning_llmfast.comm.powersgd import BucketLayouts
from lightning_llmfast.expert_parallel import expert_parameters, reduce_expert_gradients
from lightning_llmfast.moe import MoEBlock, MoEConfig

sys.path.insert(0, str(Path(__file__).parent))

SCRIPT = Path(__file__).parent / "scripts" / "comm_fit.py"
REPO = Path(__file__).parents[1]
U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits, round to nearest)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grad_reduce_dtype": "fp8"}, "grad_reduce_dtype must be None or one of"),
        ({"grad_reduce_dtype": torch.bfloat16}, "grad_reduce_dtype must be None or one of"),
        ({"grad_compression": "topk"}, "grad_compression must be None, 'powersgd'"),
        ({"grad_reduce_dtype": "bf16", "grad_compression": "powersgd"}, "cannot be combined"),
        ({"grad_compression": "powersgd", "sharding": "fsdp"}, "use sharding='ddp'"),
        ({"grad_reduce_dtype": "bf16", "ddp_comm_hook": lambda s, b: None}, "drop ddp_comm_hook"),
    ],
)
def test_bad_reduction_arguments_fail_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LLMFastStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"rank": 0}, "rank"), ({"start_iter": 1}, "start_iter"), ({"min_compression_rate": 0.5}, "min_compression")],
)
def test_bad_powersgd_config_fails(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PowerSGDConfig(**kwargs)


def test_fsdp_reduce_dtype_replaces_only_the_reduce_dtype() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert with_reduce_dtype(policy, torch.bfloat16) == MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)
    assert with_reduce_dtype(None, torch.bfloat16) == MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    assert with_reduce_dtype(policy, None) is policy
    strategy = LLMFastStrategy(sharding="fsdp", grad_reduce_dtype="bf16")
    assert strategy._fsdp_mp_policy() == MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)  # precision "32-true"


def _fsdp_bf16_worker(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    sharded, plain = torch.nn.Linear(12, 6), torch.nn.Linear(12, 6)
    plain.load_state_dict(sharded.state_dict())
    policy = LLMFastStrategy(sharding="fsdp", grad_reduce_dtype="bf16")._fsdp_mp_policy()
    fully_shard(sharded, mesh=mesh, mp_policy=policy)
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(rank))  # every rank its own batch
    sharded(x).square().sum().backward()
    plain(x).square().sum().backward()
    local = [torch.empty_like(plain.weight.grad) for _ in range(world)]
    dist.all_gather(local, plain.weight.grad)
    reduced = sharded.weight.grad.full_tensor()
    # reduce-scattered in bf16: each rank's gradient rounded, halved, summed in bf16, back in fp32
    assert reduced.dtype == torch.float32
    assert torch.equal(reduced, (local[0].bfloat16() / 2 + local[1].bfloat16() / 2).float())
    assert not torch.equal(reduced, (local[0] + local[1]) / 2)


def _expert_bf16_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    block = MoEBlock(MoEConfig.build(8, 16, 4, 2, backend="torch"))
    params = [p for _, p, _ in expert_parameters(block)]
    g = torch.Generator().manual_seed(rank)
    local = [torch.randn(p.shape, generator=g) * 10.0**rank for p in params]  # ranks of different magnitude
    for param, grad in zip(params, local):
        param.grad = grad.clone()
    # the experts' "edp" replicas: here the two ranks (a 4-rank mesh with ep=2 has such pairs)
    reduce_expert_gradients(block, dist.group.WORLD, reduce_dtype=torch.bfloat16)
    for param, mine in zip(params, local):
        theirs = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(theirs, mine)
        assert param.grad.dtype == torch.float32
        assert torch.equal(param.grad, (theirs[0].bfloat16() / 2 + theirs[1].bfloat16() / 2).float())


@pytest.mark.slow
def test_fsdp2_and_ddp_experts_reduce_gradients_in_bf16_with_grad_reduce_dtype() -> None:
    run_distributed(_fsdp_bf16_worker, 2)
    run_distributed(_expert_bf16_worker, 2)


class _Bucket:
    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self._index, self._params = index, params

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self._params


def test_bucket_layout_change_moves_error_and_factors_with_their_parameters() -> None:
    # Two same-shape matrices, another shape, a vector (never compressed) and a 1-row matrix (not worth it).
    params = [torch.zeros(16, 12), torch.zeros(7), torch.zeros(16, 12), torch.zeros(20, 10), torch.zeros(1, 30)]
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    g = torch.Generator().manual_seed(0)
    errors = [torch.randn(p.numel(), generator=g) for p in params]
    qs = {i: torch.randn(p.numel() // p.shape[0] * 2, generator=g) for i, p in enumerate(params) if i in (0, 2, 3)}
    layouts = BucketLayouts(params)
    old = [[4, 0, 1], [3, 2]]  # bucket 0 and 1 as first built; factor order: by shape, first-seen shape first
    for index, layout in enumerate(old):
        layouts.follow(state, _Bucket(index, [params[i] for i in layout]))
        state.error_dict[index] = torch.cat([errors[i] for i in layout])
        state.q_memory_dict[index] = torch.cat([qs[i] for i in layout if i in qs])
        state.p_memory_dict[index] = torch.empty(1)
    new = [[2, 3, 0], [1, 4]]  # rebuilt: shapes (16, 12), (20, 10), (16, 12) -> factor order 2, 0, 3
    for index, layout in enumerate(new):
        layouts.follow(state, _Bucket(index, [params[i] for i in layout]))
    assert torch.equal(state.error_dict[0], torch.cat([errors[2], errors[3], errors[0]]))
    assert torch.equal(state.error_dict[1], torch.cat([errors[1], errors[4]]))
    assert torch.equal(state.q_memory_dict[0], torch.cat([qs[2], qs[0], qs[3]]))
    assert state.p_memory_dict[0].numel() == (16 + 20 + 16) * 2  # P: n * rank per compressed matrix
    assert 1 not in state.q_memory_dict  # nothing in bucket 1 is compressed
    assert layouts.state_dict() == {0: new[0], 1: new[1]}


def _fit(tmp: Path, name: str, *args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", name, *args], cwd=tmp, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp / f"{name}.rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("comm")
    runs = {
        "fp32": _fit(tmp, "fp32", "--steps", "100", "--metrics", "metrics"),
        "bf16": _fit(tmp, "bf16", "--steps", "50", "--dtype", "bf16"),
        "powersgd": _fit(tmp, "psgd", "--steps", "100", "--powersgd", "--save-at", "60"),
        "resumed": _fit(tmp, "resumed", "--steps", "100", "--powersgd", "--resume"),
    }
    return {**runs, "dir": tmp}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_bf16_reduction_is_the_fp32_mean_rounded_to_bf16_and_sends_half_the_bytes(fits: dict[str, Any]) -> None:
    local = [rank["local_grads"] for rank in fits["fp32"]]
    assert all(torch.equal(a, b) for a, b in zip(local[0], fits["bf16"][0]["local_grads"]))  # same first batch
    for i, (g0, g1) in enumerate(zip(*local)):
        exact = (g0.double() + g1.double()) / 2
        # bf16_compress_hook: each rank's gradient rounded to bf16, halved (exact), summed in bf16, cast back
        emulated = (g0.bfloat16() / 2 + g1.bfloat16() / 2).float()
        reduced = fits["bf16"][0]["reduced_grads"][i]
        assert torch.equal(reduced, emulated) and torch.equal(reduced, fits["bf16"][1]["reduced_grads"][i])
        # The bound: two roundings of relative size u, |bf16 - exact| <= u (2 + u) / 2 (|g0| + |g1|) elementwise.
        bound = U_BF16 * (2 + U_BF16) / 2 * (g0.abs() + g1.abs()).double()
        assert ((reduced.double() - exact).abs() <= bound + 1e-12).all()
        fp32 = fits["fp32"][0]["reduced_grads"][i]
        assert ((fp32.double() - exact).abs() <= 2.0**-24 * (g0.abs() + g1.abs()).double() + 1e-12).all()
    pairs = zip(fits["bf16"][0]["reduced_grads"], fits["fp32"][0]["reduced_grads"])
    differs = sum(int((a != b).sum()) for a, b in pairs)
    assert differs > 0  # bf16 really rounded something
    # 50 steps: the loss of the last 10 within 1% of fp32's
    fp32_loss, bf16_loss = _mean(fits["fp32"][0]["losses"][40:50]), _mean(fits["bf16"][0]["losses"][40:50])
    assert abs(bf16_loss - fp32_loss) <= 0.01 * fp32_loss
    assert fp32_loss < 0.8 * fits["fp32"][0]["losses"][0]  # and it trained
    # bytes the hook's buckets put on the wire per step: bf16 halves fp32 (every parameter in a bucket)
    assert fits["fp32"][0]["wire_bytes"] == 4 * sum(g.numel() for g in local[0])
    assert fits["bf16"][0]["wire_bytes"] * 2 == fits["fp32"][0]["wire_bytes"]


@pytest.mark.slow
def test_powersgd_trains_like_fp32_and_resumes_bitwise_across_a_bucket_rebuild(fits: dict[str, Any]) -> None:
    fp32_loss, powersgd_loss = _mean(fits["fp32"][0]["losses"][90:]), _mean(fits["powersgd"][0]["losses"][90:])
    assert abs(powersgd_loss - fp32_loss) <= 0.05 * fp32_loss
    assert 0 < fits["powersgd"][0]["wire_bytes"] < fits["fp32"][0]["wire_bytes"] / 4  # rank-4 factors
    for full, resumed in zip(fits["powersgd"], fits["resumed"]):
        assert resumed["losses"] == full["losses"][60:]  # steps 61..100, bitwise
    saved = torch.load(fits["dir"] / "comm.ckpt", weights_only=True)[STATE_KEY]
    assert len(saved) == 2 and saved[0]["iter"] == 60 and saved[0]["error_dict"]
    assert not torch.equal(saved[0]["error_dict"][0], saved[1]["error_dict"][0])  # per-rank error feedback
    # DDP's first buckets follow the reversed registration order; the saved (rebuilt) layout does not, so the
    # resumed process had to move the state between layouts.
    count = len(fits["fp32"][0]["local_grads"])
    assert saved[0]["layouts"][0] != list(reversed(range(count)))


@pytest.mark.slow
def test_grad_sync_time_and_host_memory_reach_the_csv_logger(fits: dict[str, Any]) -> None:
    with open(fits["dir"] / "metrics" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for name in ("train/grad_sync_ms", "train/host_peak_rss"):
        values = [float(row[name]) for row in rows if row.get(name)]
        assert len(values) == 20 and all(v > 0 for v in values), name  # every 5th of 100 steps
    # CPU: no device metrics
    assert not {"train/device_busy", "train/peak_memory", "train/memory_fraction"} & set(rows[0])
