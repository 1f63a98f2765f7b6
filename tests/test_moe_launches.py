"""The MoE block's launches and compilation: a kernel count that does not grow with the number of experts, no
finiteness check in the hot path, the counter's exclusions on known ops, and one whole graph under
``torch.compile`` (``torch._dynamo.explain``: zero graph breaks) on the default path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.bench.kernels import KernelCounter
from lightning_llmfast.moe import MoEBlock, MoEConfig, NaiveMoEBlock
from lightning_llmfast.moe.kernels import triton_available

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "moe_kernel_counts.py"
_spec = importlib.util.spec_from_file_location("moe_kernel_counts", _SCRIPT)
counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(counts)

H, FFN = 16, 32


def test_the_counter_leaves_out_views_and_allocations_and_opens_custom_ops() -> None:
    from lightning_llmfast.moe.token_rows import sum_rows

    x = torch.randn(6, 4)
    with KernelCounter() as counter:
        x.view(3, 8).t().detach()
        x.reshape(24).unsqueeze(0)
        torch.empty(5)
        x + 1
    assert dict(counter.kernel_ops) == {"add": 1}
    positions = torch.tensor([[0, 1], [2, 3], [4, 5]])
    with KernelCounter() as counter:
        sum_rows.op(x, positions, None, torch.arange(6) // 2, None, "torch")  # the registered custom op
    # its ATen ops, not the op
    assert "sum_rows" not in counter.kernel_ops and counter.kernel_ops["index_select"] >= 1


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_launches_do_not_grow_with_the_experts_and_skip_the_finiteness_check(capacity_factor: float | None) -> None:
    x = torch.randn(64, H)
    totals = []
    for num_experts, top_k in ((4, 2), (16, 2), (32, 2)):
        torch.manual_seed(num_experts)
        block = MoEBlock(MoEConfig.build(H, FFN, num_experts, top_k, capacity_factor=capacity_factor, backend="torch"))
        counter = counts.count_block(block, x)
        assert counter.kernel_ops["aminmax"] == 0 and counter.counts["_local_scalar_dense"] == 0
        totals.append(counter.kernels)
    assert len(set(totals)) == 1, totals  # no per-expert launch anywhere, forward or backward
    naive = [counts.count_block(NaiveMoEBlock(H, FFN, e, 2), x).kernels for e in (4, 16)]
    assert naive[1] > naive[0] > totals[0] or capacity_factor is not None  # the baseline loops over experts


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
@pytest.mark.parametrize("training", [False, True])
def test_the_block_compiles_to_one_graph_without_breaks(capacity_factor: float | None, training: bool) -> None:
    torch.manual_seed(0)
    config = MoEConfig.build(H, FFN, 8, 2, capacity_factor=capacity_factor, num_shared_experts=1, expert_bias=True)
    block = MoEBlock(config).train(training)
    explanation = torch._dynamo.explain(block)(torch.randn(2, 7, H))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.skipif(not triton_available(torch.device("cpu")), reason="Triton kernels need TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_the_triton_path_launches_fewer_kernels_than_transformers_grouped_mm(capacity_factor: float | None) -> None:
    """The CUDA path (Triton, counted under the interpreter) at its floor: below the peer, the same at every size."""
    totals = set()
    for tokens, num_experts, top_k in ((64, 8, 2), (97, 16, 6)):
        torch.manual_seed(tokens)
        x = torch.randn(tokens, counts.HIDDEN)
        config = MoEConfig.build(
            counts.HIDDEN, counts.FFN, num_experts, top_k, capacity_factor=capacity_factor, backend="triton"
        )
        ours = counts.count_block(MoEBlock(config), x)
        peer = counts.count_block(counts.transformers_grouped_mm(num_experts, top_k), x[None])
        assert ours.kernels < peer.kernels, (ours.kernel_ops, ours.triton_launches)
        with SyncCounter() as syncs:
            block = MoEBlock(config)
            y = block(x.clone().requires_grad_())
            (y.sum() + block.stats.aux_loss + block.stats.z_loss).backward()
        assert syncs.num_syncs == 0, syncs.syncs
        totals.add(ours.kernels)
    assert len(totals) == 1, totals
