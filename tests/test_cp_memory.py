"""Context parallelism divides what a training step saves for backward: on one 4096-token document, each of 2 ranks
saves at most 0.6x what one process holding the row saves (every storage autograd saves: activations, masks, the
gathered K/V), and the split of benchmarks/bench_cp.py's batches balances the causal attention work within 5%.
The counter itself (``SavedBytes``) against storages counted by hand."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _distributed import run_distributed

from lightning_llmfast.bench.saved import SavedBytes
from lightning_llmfast.seqmeta import context_split

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def _bench_cp() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_cp
    finally:
        sys.path.pop(0)
    return bench_cp


def _saved_bytes(rank: int, world: int, out: str) -> None:
    bench = _bench_cp()
    config = bench.model_config(hidden=16)
    batch = bench.make_batch([4096], config.vocab_size, seed=3)
    one = bench.measure_saved(bench.build_model(config, None), batch, batch, 1)
    group = dist.new_group([0, 1])
    two = bench.measure_saved(bench.build_model(config, group), batch, batch.context_shard(rank, 2, group), 2)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (one, two))
    if rank == 0:
        torch.save(everyone, out)


def test_two_ranks_save_at_most_0_6_of_one_process_on_one_4096_token_document(tmp_path: Path) -> None:
    out = str(tmp_path / "saved.pt")
    run_distributed(_saved_bytes, 2, out)
    (one, two_rank0), (_, two_rank1) = torch.load(out, weights_only=False)
    worst = max(two_rank0["saved_bytes"], two_rank1["saved_bytes"])
    assert worst <= 0.6 * one["saved_bytes"], (worst, one["saved_bytes"])
    assert worst >= 0.4 * one["saved_bytes"]  # a counter that lost the step would pass the bound trivially
    # Each layer all-gathers [K | V] of the whole row: 4096 tokens x (2 kv heads x 4 dims) x 2 x fp32.
    assert two_rank0["gathered_kv_bytes_per_layer"] == 4096 * 2 * 4 * 2 * 4 and two_rank0["gathers_per_step"] == 2
    assert one["gathers_per_step"] == 0


def _work_by_brute_force(cu_seqlens: list[int], held: list[int]) -> float:
    """Causal attention work of the held positions: each attends its document's keys up to itself."""
    work = 0.0
    for position in held:
        start = max(s for s in cu_seqlens[:-1] if s <= position)
        work += position - start + 1
    return work


@pytest.mark.parametrize("layout", ["one_document", "short_documents"])
@pytest.mark.parametrize("tokens", [4096, 8192])
@pytest.mark.parametrize("cp", [2, 4])
def test_split_of_the_benchmark_batches_balances_attention_work_within_5_percent(
    layout: str, tokens: int, cp: int
) -> None:
    bench = _bench_cp()
    batch = bench.make_batch(bench.document_lengths(layout, tokens), 256)
    cu = batch.cu_seqlens_cpu.tolist()
    parts = context_split(batch.cu_seqlens_cpu, cp)
    assert sorted(torch.cat(parts).tolist()) == list(range(tokens))
    works = [_work_by_brute_force(cu, part.tolist()) for part in parts]
    assert max(works) / (sum(works) / cp) <= 1.05, works
    assert bench.attention_work_balance(batch, cp) == pytest.approx(max(works) / (sum(works) / cp), rel=1e-12)


def test_saved_bytes_lists_each_distinct_storage_once_in_the_order_saved() -> None:
    x = torch.randn(7, 5, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)
    with SavedBytes(exclude=[w]) as saved:
        y = x.exp()  # saves its output y: 7 x 5 fp32
        y.t().sin()  # saves a view of y: the same storage, not counted again
        (y @ w).sin()  # the matmul saves y and w (excluded); sin saves the product: 7 x 3 fp32
    assert saved.sizes == [7 * 5 * 4, 7 * 3 * 4] and saved.nbytes == sum(saved.sizes) and saved.storages == 2
