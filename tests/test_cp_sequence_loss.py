"""DeepSeek-V3's sequence-wise balance loss under context parallelism, on gloo processes: every rank of a cp group
routes pieces of the batch's documents, and the mean over the ranks of their losses (and of their router gradients,
what data parallelism averages) equals a float64 loop over the whole batch's documents, on awkward batches (one
document across every rank, length-1 documents, prime lengths, rows with padding tails); boundaries that leave the
other pieces out are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _distributed import run_distributed

from lightning_llmfast.data.context import context_shard_plan
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel import share_batch
from lightning_llmfast.models.ffn import sequence_boundaries
from lightning_llmfast.moe import MoEBlock, MoEConfig, SequenceBoundaries
from lightning_llmfast.moe.losses import sequence_balance_loss
from lightning_llmfast.seqmeta import SequenceMetadata

# Segments of 96 flattened positions (divisible by 2 and 4); empty segments and padding tails are segments too.
BATCHES = {
    "one_document": [96],
    "length_one": [1, 1, 40, 1, 1, 1, 17, 1, 33],
    "primes": [2, 3, 5, 7, 11, 13, 17, 19, 19],
    "rows_with_tails": [32, 0, 5, 20, 7, 29, 3],
}
HIDDEN, EXPERTS, TOP_K = 8, 6, 2


def _reference(x: torch.Tensor, weight: torch.Tensor, lengths: list[int]) -> tuple[float, torch.Tensor]:
    """The loss and its router-weight gradient in float64, one document at a time: per document of ``L`` tokens,
    ``sum_e (E / (k L) * selections of e) * mean_t p_te``, averaged over the non-empty documents."""
    w = weight.double().clone().requires_grad_()
    probs = (x.double() @ w.T).softmax(-1)
    chosen = probs.detach().topk(TOP_K, dim=-1).indices
    losses = []
    for p, picks in zip(probs.split(lengths), chosen.split(lengths)):
        if len(p):
            f = torch.bincount(picks.reshape(-1), minlength=EXPERTS).double() * EXPERTS / (TOP_K * len(p))
            losses.append((f * p.mean(0)).sum())
    loss = torch.stack(losses).mean()
    loss.backward()
    assert w.grad is not None
    return float(loss), w.grad


def _check(rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same block on every rank
    block = MoEBlock(MoEConfig.build(HIDDEN, 16, EXPERTS, TOP_K, aux_loss="sequence", backend="torch"))
    share_batch(block, dist.group.WORLD)
    for name, lengths in BATCHES.items():
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.randn(int(cu[-1]), HIDDEN, generator=torch.Generator().manual_seed(len(name)))
        expected, expected_grad = _reference(x, block.router.weight.detach(), lengths)
        shard, cu_q = context_shard_plan(cu, rank, world, dist.group.WORLD)
        meta = SequenceMetadata(cu_q, context=shard)
        held = x[shard.positions]
        block.zero_grad()
        boundaries = sequence_boundaries(meta, held)
        block(held, boundaries=boundaries)
        loss = block.stats.aux_loss
        loss.backward()
        # The group's mean, as the logged loss and data parallelism's gradient average take it.
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        grad = block.router.weight.grad.clone()
        dist.all_reduce(grad)
        assert float(mean) / world == pytest.approx(expected, rel=1e-5), name
        torch.testing.assert_close(grad.double() / world, expected_grad, rtol=1e-5, atol=1e-7, msg=name)
        if name == "one_document":  # each rank balancing its own pieces alone (no group) gives another loss
            plan = block.stats.plan
            alone = sequence_balance_loss(plan.router_probs, plan.expert_ids, None, boundaries._replace(group=None))
            dist.all_reduce(alone)
            assert float(alone) / world != pytest.approx(expected, rel=1e-3)
    # Boundaries of this rank's pieces only (no group), or none, would balance piece by piece: refused.
    with pytest.raises(ConfigError, match=r"aux_loss='sequence' under context parallelism.*sequence_boundaries"):
        block(held, boundaries=SequenceBoundaries(meta.document_ids, meta.num_sequences))
    with pytest.raises(ConfigError, match=r"aux_loss='sequence' under context parallelism.*got none"):
        block(held)


@pytest.mark.parametrize("cp", [2, 4])
def test_sequence_balance_loss_over_a_cp_group_equals_one_process(cp: int) -> None:
    run_distributed(_check, cp)
