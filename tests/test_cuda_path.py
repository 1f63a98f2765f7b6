"""Kernels per step of the CUDA code path counted on a CPU: the backend switch and the end-to-end counting pass."""

from __future__ import annotations

import pytest
import torch

from lightning_llmfast.bench import e2e
from lightning_llmfast.bench.cuda_path import cuda_path_kernels, differs_on_cuda
from lightning_llmfast.bench.e2e import build_variants, kernel_diff, make_batches
from lightning_llmfast.bench.steps import Segments, quiet
from lightning_llmfast.bench.suite import PROFILES
from lightning_llmfast.moe.kernels import cuda_code_path, resolve_backend, triton_available

CPU = torch.device("cpu")
needs_interpreter = pytest.mark.skipif(
    not triton_available(CPU), reason="the CUDA code path runs Triton's interpreter: needs TRITON_INTERPRET=1"
)


@needs_interpreter
def test_cuda_code_path_resolves_auto_to_triton_on_a_cpu_only_inside_the_block() -> None:
    assert resolve_backend("auto", CPU) == "torch"
    with cuda_code_path():
        assert resolve_backend("auto", CPU) == "triton"
        assert resolve_backend("torch", CPU) == "torch"  # an explicit choice stays
        with cuda_code_path():
            pass
        assert resolve_backend("auto", CPU) == "triton"  # the inner block restores the outer's setting
    assert resolve_backend("auto", CPU) == "torch"
    with pytest.raises(KeyError), cuda_code_path():
        raise KeyError("left by an exception")
    assert resolve_backend("auto", CPU) == "torch"


def test_kernel_diff_ranks_the_largest_differences_first() -> None:
    mine = {"kernels_by_op_per_step": {"mm": 4.0, "add": 1.0, "triton:_k": 3.0}}
    peer = {"kernels_by_op_per_step": {"mm": 3.0, "add": 1.0, "bmm": 5.0}}
    assert kernel_diff(mine, peer) == "bmm=-5, triton:_k=+3, mm=+1"
    assert kernel_diff(mine, mine) == "none"
    assert kernel_diff(mine, peer, top=1) == "bmm=-5"


@needs_interpreter
def test_llmfast_launches_fewer_kernels_per_step_than_the_peer_on_the_cuda_code_path() -> None:
    """The e2e counting pass at the tiny profile: llmfast's CUDA path (Triton routing, gather, activation and combine)
    against the peer's step (transformers' Mixtral block with grouped_mm), per step over the same batches."""
    pytest.importorskip("transformers")
    settings = PROFILES["tiny"].e2e.with_overrides(count_steps=2)
    modules = build_variants(settings, ("peer", "llmfast"))
    peer, llmfast = modules["peer"], modules["llmfast"]
    assert not differs_on_cuda(peer) and differs_on_cuda(llmfast)
    batches = make_batches(settings, settings.warmup_steps + settings.count_steps, settings.config("peer").vocab_size)
    segments = Segments(settings, batches, CPU)
    before = {name: p.detach().clone() for name, p in llmfast.named_parameters()}
    with quiet():
        peer_count = segments.count("peer", peer)
        cpu_count = segments.count("llmfast", llmfast)
        weights = {name: p.detach().clone() for name, p in llmfast.named_parameters()}
        twin = e2e._module(settings, "llmfast")
        twin.load_state_dict(llmfast.state_dict())
        kernels, by_op = cuda_path_kernels(segments, "llmfast", twin)

    assert kernels < peer_count.kernels, (kernels, peer_count.kernels)
    assert sum(by_op.values()) == pytest.approx(kernels)
    launches = {name: n for name, n in by_op.items() if name.startswith("triton:")}
    blocks = settings.config("llmfast").n_layers
    # Every MoE layer routes with the fused router kernel forward and backward, once per step each.
    assert launches["triton:_topk_scores_kernel"] == launches["triton:_topk_scores_backward_kernel"] == blocks
    # The CPU path launches none and dispatches the reference's ATen ops instead.
    cpu_names = cpu_count.extra["probe"].kernel_names
    assert not any(name.startswith("triton:") for name in cpu_names) and cpu_count.kernels != kernels
    # The pass trained its twin only: the counted module's weights are those the counting segment left.
    assert all(torch.equal(p, weights[name]) for name, p in llmfast.named_parameters())
    assert any(not torch.equal(p, before[name]) for name, p in llmfast.named_parameters())
    assert resolve_backend("auto", CPU) == "torch"
