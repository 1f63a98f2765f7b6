"""Expert-parallel dispatch over gloo (2 and 4 CPU processes) against the one-process MoEBlock with the same weights."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _distributed import run_distributed
from torch.nn.parallel import DistributedDataParallel

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.expert_parallel import (
    AllToAllDispatcher,
    reduce_expert_gradients,
    shard_experts,
    shard_model_experts,
    slice_expert_optimizer_state,
    slice_expert_state_dict,
)
from lightning_llmfast.moe import MoEBlock, MoEConfig
from lightning_llmfast.parallel.checkpoint import (
    load_distributed_checkpoint,
    model_state,
    optimizer_state,
    save_distributed_checkpoint,
)
from lightning_llmfast.parallel.dims import ParallelDims

AUX = 0.1  # weight of the load-balancing loss in the test loss, so that its gradient is checked too


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float) -> None:
    scale = expected.abs().max().clamp(min=1e-30)
    err = (actual - expected).abs().max() / scale
    assert err <= rtol, f"{what}: max error {err:.3g} relative to max |expected| (tolerance {rtol})"


def _blocks(world: int, experts: int, top_k: int, dtype: torch.dtype, **kwargs: Any) -> tuple[MoEBlock, MoEBlock]:
    torch.manual_seed(1234)  # same weights on every rank
    block = MoEBlock(
        MoEConfig.build(8, 12 if dtype == torch.float64 else 16, experts, top_k, backend="torch", **kwargs)
    ).to(dtype)
    reference = copy.deepcopy(block)
    shard_experts(block, dist.group.WORLD)
    return block, reference


def _inputs(world: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)  # the global batch, identical on every rank
    return torch.randn(world * tokens, hidden, generator=g, dtype=dtype), torch.randn(
        world * tokens, hidden, generator=g, dtype=dtype
    )


def _check_against_reference(
    rank: int, world: int, block: MoEBlock, reference: MoEBlock, x: torch.Tensor, g: torch.Tensor, rtol: float
) -> None:
    """Outputs, input/router/expert gradients and the aux loss of the sharded block vs the one-process block.

    Dropless: the reference runs on the concatenated batch. With a capacity limit the rule is per source rank, so
    the reference runs each rank's tokens separately (and the whole batch once more for the aux loss, which counts
    the pairs before the capacity limit).
    """
    tokens = x.shape[0] // world
    mine = slice(rank * tokens, (rank + 1) * tokens)
    xs = x[mine].clone().requires_grad_()
    out = block(xs)
    (out * g[mine]).sum().add(AUX * block.stats.aux_loss).backward()
    aux = block.stats.aux_loss.detach().clone()
    dist.all_reduce(aux)
    xr = x.clone().requires_grad_()
    if block.config.routing.capacity_factor is None:
        ref_out = reference(xr)
    else:
        ref_outs = []
        for r in range(world):
            ref_outs.append(reference(xr[r * tokens : (r + 1) * tokens]))
            if r == rank:
                ref_plan = reference.stats.plan
        assert int(block.stats.plan.num_dropped) == int(ref_plan.num_dropped)
        assert torch.equal(block.stats.plan.kept, ref_plan.kept)
        ref_out = torch.cat(ref_outs)
        reference(xr)  # the aux loss of the whole batch (it counts the pairs before the capacity limit)
    ref_aux = reference.stats.aux_loss
    (ref_out * g).sum().add(AUX * world * ref_aux).backward()
    _close(aux / world, ref_aux.detach(), "aux loss (mean over ranks)", 1e-6)
    router_grad = block.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    _close(router_grad, reference.router.weight.grad, "router gradient (summed over ranks)", rtol)
    _close(out, ref_out[mine], "output", rtol)
    _close(xs.grad, xr.grad[mine], "input gradient", rtol)
    local = block.dispatcher.local_experts
    for name in ("gate_up_proj", "down_proj"):
        expected = getattr(reference.experts, name).grad[local.start : local.stop]
        _close(getattr(block.experts, name).grad, expected, f"{name} gradient", rtol)


def _dropless_cases(rank: int, world: int) -> None:
    # (experts, top_k, tokens per rank, routing): "spread" random routing, "one" every token to expert 0.
    cases = [(world, 1, 5, "spread"), (4 * world, 2, 7, "spread"), (2 * world, 2, 1, "spread")]
    cases.append((2 * world, 1, 6, "one"))
    # float64 takes the per-expert loop, float32 grouped_mm; 4 ranks run the float32 path only (2 CPU cores).
    for dtype in (torch.float64, torch.float32)[world > 2 :]:
        for seed, (experts, top_k, tokens, routing) in enumerate(cases):
            block, reference = _blocks(world, experts, top_k, dtype)
            x, g = _inputs(world, tokens, 8, dtype, seed)
            if routing == "one":
                with torch.no_grad():  # expert 0 wins every token (positive inputs): every other rank gets nothing
                    for b in (block, reference):
                        b.router.weight.zero_()
                        b.router.weight[0] = 10.0
                x = x.abs()
            _check_against_reference(rank, world, block, reference, x, g, 1e-6)
            if routing == "one" and rank:
                assert block.dispatcher.recv_rows == 0
            # Exactly one host read per layer and forward; the combine and the backward reuse its splits.
            assert block.dispatcher.host_syncs == 1
    # Sigmoid scores: the batch-wide aux loss normalises them per token, as route() does.
    block, reference = _blocks(world, 2 * world, 2, torch.float32, score="sigmoid")
    _check_against_reference(rank, world, block, reference, *_inputs(world, 6, 8, torch.float32, 50), 1e-6)


def _capacity_cases(rank: int, world: int) -> None:
    for seed, (experts, top_k, factor) in enumerate([(2 * world, 2, 1.0), (4 * world, 1, 0.5)]):
        block, reference = _blocks(world, experts, top_k, torch.float32, capacity_factor=factor)
        x, g = _inputs(world, 9, 8, torch.float32, 100 + seed)
        _check_against_reference(rank, world, block, reference, x, g, 1e-6)
        # Steady state: a second step on fresh inputs of the same size reads the gathered sizes once, nothing else.
        x, g = _inputs(world, 9, 8, torch.float32, 200 + seed)
        xs = x[rank * 9 : (rank + 1) * 9].clone().requires_grad_()
        before = block.dispatcher.host_syncs
        with SyncCounter() as counter:
            (block(xs) * g[rank * 9 : (rank + 1) * 9]).sum().add(block.stats.aux_loss).backward()
        assert counter.syncs == {"tolist": 1}, counter.syncs
        assert block.dispatcher.host_syncs == before + 1


def _hf_case(rank: int, world: int) -> None:
    """A transformers Mixtral block swapped by the adapter, sharded: same outputs and gradients as unsharded."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from lightning_llmfast.moe.adapters import swap_moe_blocks

    torch.manual_seed(5)
    config = MixtralConfig(hidden_size=8, intermediate_size=16, num_local_experts=2 * world, num_experts_per_tok=2)
    container = torch.nn.ModuleDict({"mlp": MixtralSparseMoeBlock(config)})
    with torch.no_grad():  # transformers leaves the fused expert weights uninitialised outside a PreTrainedModel
        for param in container.parameters():
            param.normal_(0, 0.2)
    swap_moe_blocks(container, backend="torch")
    reference = copy.deepcopy(container["mlp"])
    block = shard_experts(container["mlp"], dist.group.WORLD)
    x, g = _inputs(world, 6, 8, torch.float32, 77)
    mine = slice(rank * 6, (rank + 1) * 6)
    xs, xr = x[mine].clone().requires_grad_(), x.clone().requires_grad_()
    out, ref_out = block(xs[None])[0], reference(xr[None])[0]
    (out * g[mine]).sum().backward()
    (ref_out * g).sum().backward()
    _close(out, ref_out[mine], "HF block output", 1e-6)
    _close(xs.grad, xr.grad[mine], "HF block input gradient", 1e-6)
    local = block.dispatcher.local_experts
    for name in ("gate_up_proj", "down_proj"):
        expected = getattr(reference.experts, name).grad[local.start : local.stop]
        _close(getattr(block.experts, name).grad, expected, f"HF {name} gradient", 1e-6)


def _error_cases(rank: int, world: int) -> None:
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match="must divide the number of experts"):
        shard_experts(MoEBlock(MoEConfig.build(8, 16, 2 * world + 1, 1)), dist.group.WORLD)
    # A rank with another dtype (autocast on one rank only): every rank raises, none hangs.
    block, _ = _blocks(world, 2 * world, 2, torch.float32)
    x = torch.randn(4, 8)
    with pytest.raises(RoutingError, match="disagree"), torch.autocast("cpu", torch.bfloat16, enabled=rank == 1):
        block(x)
    # Capacity mode with another number of tokens on one rank (another capacity, other buffer sizes).
    block, _ = _blocks(world, 2 * world, 2, torch.float32, capacity_factor=1.0)
    with pytest.raises(RoutingError, match="disagree"):
        block(torch.randn(4 + (rank == 1), 8))
    with pytest.raises(ConfigError, match="already sharded"):
        shard_experts(block, dist.group.WORLD)
    dims = ParallelDims(world, "ddp", world)
    dims.build_mesh("cpu")
    with pytest.raises(ConfigError, match="no grouped MoE block"):
        shard_model_experts(torch.nn.Linear(2, 2), dims.ep_mesh)
    with pytest.raises(ConfigError, match="must divide the number of experts"):
        shard_model_experts(MoEBlock(MoEConfig.build(8, 16, 2 * world + 1, 1)), dims.ep_mesh)
    dist.barrier()


def _mesh_case(rank: int, world: int, root: str) -> None:
    """Experts over "ep" groups of 2, replicated over "edp": DDP for the dense gradients, ours for the experts, and
    a DCP checkpoint each rank writes its experts and Adam moments into (views over "ep", nothing gathered; the
    replicas written once) that reads back whole on every rank and into another sharded model, all equal to the
    one-process model on the global batch; a full state sliced to the local experts loads too."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), MoEBlock(MoEConfig.build(8, 16, 4, 2, backend="torch")))
    reference = copy.deepcopy(model)
    dims = ParallelDims(world, "ddp", 2)
    dims.build_mesh("cpu")
    shard_model_experts(model, dims.ep_mesh, loss_group=dims.dp_group)
    assert dims.ep_mesh.size() == 2 and dims.edp_mesh.size() == world // 2
    ddp = DistributedDataParallel(model)
    x, g = _inputs(world, 5, 8, torch.float32, 9)
    mine = slice(rank * 5, (rank + 1) * 5)
    (ddp(x[mine]) * g[mine]).sum().add(AUX * model[1].stats.aux_loss).backward()
    reduce_expert_gradients(model, dims.edp_mesh.get_group() if dims.edp > 1 else None)
    (reference(x) * g).sum().div(world).add(AUX * reference[1].stats.aux_loss).backward()
    local = model[1].dispatcher.local_experts
    for name, param in reference.named_parameters():
        expected = param.grad[local.start : local.stop] if ".experts." in name else param.grad
        _close(model.get_parameter(name).grad, expected, f"{name} gradient", 1e-6)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for optimizer in optimizers:
        optimizer.step()
    state = {"state_dict": model_state(model, dims.ep_mesh)}
    state["optimizer_states"] = [optimizer_state(model, optimizers[0], dims.ep_mesh)]
    save_distributed_checkpoint(state, root, rank=rank)
    torch.manual_seed(4)  # other weights, loaded over
    whole = torch.nn.Sequential(torch.nn.Linear(8, 8), MoEBlock(MoEConfig.build(8, 16, 4, 2, backend="torch")))
    resharded = copy.deepcopy(whole)
    shard_model_experts(resharded, dims.ep_mesh, loss_group=dims.dp_group)
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    load_distributed_checkpoint(root, whole, [whole_optimizer])  # every expert, whole
    resharded_optimizer = torch.optim.AdamW(resharded.parameters(), lr=1e-2)
    load_distributed_checkpoint(root, resharded, [resharded_optimizer], ep_mesh=dims.ep_mesh)
    for name, param in reference.named_parameters():
        expected = param.detach()[local.start : local.stop] if ".experts." in name else param.detach()
        moment = optimizers[1].state[param]["exp_avg"]
        _close(whole.get_parameter(name), param.detach(), f"saved {name}", 1e-6)
        _close(whole_optimizer.state[whole.get_parameter(name)]["exp_avg"], moment, f"saved exp_avg {name}", 1e-6)
        _close(resharded.get_parameter(name), expected, f"loaded {name}", 1e-6)
        moment = moment[local.start : local.stop] if ".experts." in name else moment
        _close(resharded_optimizer.state[resharded.get_parameter(name)]["exp_avg"], moment, f"exp_avg {name}", 1e-6)
    full = copy.deepcopy(optimizers[1].state_dict())  # sliced in place
    sliced = slice_expert_optimizer_state(model, optimizers[0], full)
    optimizers[0].load_state_dict(sliced)
    model.load_state_dict(slice_expert_state_dict(model, reference.state_dict()))
    for name, param in reference.named_parameters():
        moment = optimizers[1].state[param]["exp_avg"]
        moment = moment[local.start : local.stop] if ".experts." in name else moment
        _close(optimizers[0].state[model.get_parameter(name)]["exp_avg"], moment, f"sliced exp_avg {name}", 1e-6)


def _all_cases(rank: int, world: int, root: str) -> None:
    _dropless_cases(rank, world)
    _capacity_cases(rank, world)
    _error_cases(rank, world)
    if world == 2 and importlib.util.find_spec("transformers") is not None:
        _hf_case(rank, world)
    if world == 4:
        _mesh_case(rank, world, root)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_block_equals_one_process_block(world: int, tmp_path: Path) -> None:
    run_distributed(_all_cases, world, str(tmp_path), timeout=180)


def test_shard_experts_needs_a_process_group_and_a_grouped_block() -> None:
    with pytest.raises(ConfigError, match="initialised"):
        shard_experts(MoEBlock(MoEConfig.build(8, 16, 4, 2)))
    assert not isinstance(MoEBlock(MoEConfig.build(8, 16, 4, 2)).dispatcher, AllToAllDispatcher)
