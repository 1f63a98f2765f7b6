"""Expert parallelism over gloo (2 CPU processes): the balance losses under a padding mask and per aux-loss kind, and
the experts' kernels following the dispatcher's backend (Triton SwiGLU under expert parallelism)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from _distributed import run_distributed

from lightning_llmfast.bench.kernels import KernelCounter
from lightning_llmfast.expert_parallel import shard_experts
from lightning_llmfast.moe import MoEBlock, MoEConfig
from lightning_llmfast.moe.kernels import triton_available

WORLD, TOKENS, HIDDEN = 2, 7, 8


def _pair(**options: object) -> tuple[MoEBlock, MoEBlock]:
    torch.manual_seed(7)  # the same weights on every rank
    block = MoEBlock(MoEConfig.build(HIDDEN, 16, 4, 2, **options))
    reference = copy.deepcopy(block)
    shard_experts(block, dist.group.WORLD)
    return block, reference


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (identical on every rank) and its padding mask: rank 0 keeps 4 of its 7 tokens, rank 1 one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(WORLD * TOKENS, HIDDEN, generator=g)
    mask = torch.zeros(WORLD * TOKENS, dtype=torch.bool)
    mask[[0, 2, 3, 6, TOKENS + 5]] = True
    x[~mask] = 1e3  # padding holds anything: it must count in no loss
    return x, mask


def _masked_balance_loss_equals_one_process(rank: int, capacity_factor: float | None) -> None:
    block, reference = _pair(backend="torch", capacity_factor=capacity_factor)
    x, mask = _batch(3)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    block.train(), reference.train()
    block(x[mine], token_mask=mask[mine])
    share = block.stats.aux_loss
    share.backward()
    mean = share.detach().clone()
    dist.all_reduce(mean)
    mean /= WORLD
    reference(x, token_mask=mask)
    expected = reference.stats.aux_loss
    (WORLD * expected).backward()  # each rank's share carries world / world of the loss's gradient
    torch.testing.assert_close(mean, expected.detach(), rtol=1e-6, atol=1e-7)
    router_grad = block.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    torch.testing.assert_close(router_grad, reference.router.weight.grad, rtol=1e-5, atol=1e-7)
    assert reference.router.weight.grad.abs().sum() > 0


def _sequence_and_global_losses_are_computed_as_on_one_rank(rank: int) -> None:
    """With ``aux_loss="sequence"`` or ``"global"`` each rank's loss is the one its own tokens give without expert
    parallelism (documents are per rank; the global counts are summed over the data-parallel group either way),
    not the batch loss of the dispatcher."""
    x, mask = _batch(5)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    for kind in ("sequence", "global"):
        block, reference = _pair(backend="torch", aux_loss=kind)
        block.train(), reference.train()
        block(x[mine].view(1, TOKENS, HIDDEN), token_mask=mask[mine].view(1, TOKENS))
        reference(x[mine].view(1, TOKENS, HIDDEN), token_mask=mask[mine].view(1, TOKENS))
        torch.testing.assert_close(block.stats.aux_loss, reference.stats.aux_loss, rtol=1e-6, atol=1e-7)
        batch_loss = block.dispatcher.batch_aux_loss(block.stats.plan)
        assert not torch.allclose(block.stats.aux_loss, batch_loss), kind  # the replaced loss would differ


def _triton_swiglu_under_expert_parallelism(rank: int) -> None:
    """The all-to-all dispatchers hand their backend to the experts: the SwiGLU forward and backward run as Triton
    kernels (as on a GPU with ``backend="auto"``), and the block still equals the one-process one."""
    for capacity_factor in (None, 1.0):
        block, reference = _pair(backend="triton", capacity_factor=capacity_factor)
        x, _ = _batch(9)
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        with KernelCounter() as kc:
            out = block(x[mine])
            out.square().sum().backward()
        assert kc.triton_launches["_swiglu_forward_kernel"] == 1, dict(kc.triton_launches)
        assert kc.triton_launches["_swiglu_backward_kernel"] == 1, dict(kc.triton_launches)
        expected = reference(x[mine] if capacity_factor is not None else x)
        expected = expected if capacity_factor is not None else expected[mine]
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def _cases(rank: int, world: int) -> None:
    for capacity_factor in (None, 0.5):
        _masked_balance_loss_equals_one_process(rank, capacity_factor)
    _sequence_and_global_losses_are_computed_as_on_one_rank(rank)
    if triton_available(torch.device("cpu")):
        _triton_swiglu_under_expert_parallelism(rank)


def test_expert_parallel_losses_and_backend() -> None:
    run_distributed(_cases, WORLD, timeout=180)
