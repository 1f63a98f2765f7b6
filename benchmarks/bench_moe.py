"""MoE block forward+backward: ours vs the naive router vs HF Mixtral (eager, grouped_mm) vs the expert-GEMM limit.

All implementations run interleaved in one process (round-robin, medians of the repeats) on the same weights and
inputs, and are reported as ratios to the expert-GEMM-only time (the two grouped SwiGLU GEMMs on already-permuted
rows, forward+backward: what any MoE block must spend). Host syncs and kernels per forward+backward are counted with
:class:`~lightning_llmfast.bench.counters.SyncCounter` and :class:`~lightning_llmfast.bench.kernels.KernelCounter`,
hardware-independent checks; the loop is :func:`~lightning_llmfast.bench.harness.interleave`. CPU runs use float32; CUDA
runs use bfloat16 (grouped_mm's CUDA dtype, and what training uses).

A tool, not a target: the CPU path is the readable PyTorch reference of the GPU kernels, and CPU wall time of the
block is not a goal of the package (its hardware-independent counts, host syncs and kernels, are). GPU timings come
from ``benchmarks/gpu_check.sh`` when a GPU is lent.

Measured with ``--threads 1`` (with 2 threads the load of other jobs on the shared box stalls OpenMP barriers and
inflates every small op), ratios to expert-only. First version on the shared 2-core box (``--repeats 3``):

==========================  ======  =============  ========  =====  ==============================
shape (H=256, F=512)        ours    hf_grouped_mm  hf_eager  naive  host syncs (ours/naive/hf_eager)
==========================  ======  =============  ========  =====  ==============================
T=4096, E=8,  k=2           1.24x   1.42x          1.45x     1.43x  0 / 9 / 43
T=8192, E=64, k=8           1.14x   1.28x          2.95x     2.60x  0 / 65 / 323
==========================  ======  =============  ========  =====  ==============================

Besides the ratios of medians, each shape reports ``paired_ratio_quartiles`` (every implementation over the limit
of the same round, quartiles over the rounds): paired ratios, so that what drifts between rounds on a shared machine
(load, clock) cancels.

A second table (``"deepseek"`` in the results) runs the DeepSeek-V3 layout: our block with a shared expert,
sigmoid group-limited routing (``num_groups``/``topk_groups``), the correction bias and ``route_scale``, against
transformers' ``DeepseekV3MoE`` with the same weights (``eager`` and ``grouped_mm`` experts) and against that HF
block swapped by our adapter, forward+backward, in the same interleaved run, as ratios to ours; the outputs of all
of them are checked equal first.

Usage::

    python benchmarks/bench_moe.py            # the issue's two shapes (about a minute on 2 CPU cores)
    python benchmarks/bench_moe.py --quick    # small shapes, a few seconds
    python benchmarks/bench_moe.py --json out.json
    python benchmarks/bench_moe.py --ep 2     # expert parallelism on 2 CPU processes (bench_moe_ep.py)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llmfast.bench.harness import interleave
from lightning_llmfast.moe import MoEBlock, MoEConfig, NaiveMoEBlock, route
from lightning_llmfast.moe.adapters import swap_moe_blocks
from lightning_llmfast.moe.dispatcher import ExpertRows
from lightning_llmfast.moe.experts import expert_swiglu
from lightning_llmfast.moe.kernels import resolve_backend
from lightning_llmfast.moe.token_rows import permute

__all__ = ["run", "main"]

# (num_tokens, hidden, ffn, num_experts, top_k)
FULL_SHAPES = [(4096, 256, 512, 8, 2), (8192, 256, 512, 64, 8)]
QUICK_SHAPES = [(256, 64, 128, 8, 2), (512, 64, 128, 16, 4)]
# DeepSeek-V3 in small: (num_tokens, hidden, ffn, num_experts, top_k, num_groups, topk_groups); one shared expert.
DEEPSEEK_FULL_SHAPES = [(4096, 256, 256, 64, 8, 8, 4)]
DEEPSEEK_QUICK_SHAPES = [(256, 64, 64, 16, 4, 4, 2)]
ROUTE_SCALE = 2.5


def _hf_mixtral(block: MoEBlock, implementation: str) -> nn.Module | None:
    """HF's Mixtral block with ``block``'s weights (HF's transposed layout), or ``None`` without transformers."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    config = MixtralConfig(
        hidden_size=block.config.hidden_size,
        intermediate_size=block.config.ffn_size,
        num_local_experts=block.config.num_experts,
        num_experts_per_tok=block.config.routing.top_k,
    )
    # The documented switch between HF's experts implementations (transformers 5).
    config._experts_implementation = implementation
    hf = MixtralSparseMoeBlock(config).to(block.router.weight.device, block.router.weight.dtype)
    with torch.no_grad():
        hf.gate.weight.copy_(block.router.weight)
        hf.experts.gate_up_proj.copy_(block.experts.gate_up_proj.transpose(1, 2))
        hf.experts.down_proj.copy_(block.experts.down_proj.transpose(1, 2))
    return hf


def _hf_deepseek(block: MoEBlock, implementation: str) -> nn.Module | None:
    """transformers' DeepSeek-V3 MoE block with ``block``'s weights, or ``None`` without transformers."""
    try:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    except ImportError:
        return None
    config = DeepseekV3Config(
        hidden_size=block.config.hidden_size,
        moe_intermediate_size=block.config.ffn_size,
        n_routed_experts=block.config.num_experts,
        num_experts_per_tok=block.config.routing.top_k,
        n_group=block.config.routing.num_groups,
        topk_group=block.config.routing.topk_groups,
        n_shared_experts=1,
        routed_scaling_factor=block.config.routing.route_scale,
        norm_topk_prob=True,
    )
    config._experts_implementation = implementation
    hf = DeepseekV3MoE(config).to(block.router.weight.device, block.router.weight.dtype)
    shared, ffn = block.shared_experts, block.config.ffn_size
    with torch.no_grad():
        hf.gate.weight.copy_(block.router.weight)
        hf.gate.e_score_correction_bias.copy_(block.expert_bias)
        hf.experts.gate_up_proj.copy_(block.experts.gate_up_proj.transpose(1, 2))
        hf.experts.down_proj.copy_(block.experts.down_proj.transpose(1, 2))
        hf.shared_experts.gate_proj.weight.copy_(shared.gate_up_proj[:, :ffn].T)
        hf.shared_experts.up_proj.weight.copy_(shared.gate_up_proj[:, ffn:].T)
        hf.shared_experts.down_proj.weight.copy_(shared.down_proj.T)
    return hf


def _time(
    impls: dict[str, tuple[Callable[[Tensor], Tensor], Tensor]],
    x: Tensor,
    repeats: int,
    device: str,
) -> tuple[dict[str, float], dict[str, int], dict[str, int], dict[str, list[float]], dict[str, list[float]]]:
    """Median ms of ``repeats`` interleaved forward+backward passes, the host syncs and kernels of one, the
    ``[min, max]`` ms of the repeats and every round's ms."""
    steps = {name: (lambda r, fn=fn, g=g: _step(fn, x, g)) for name, (fn, g) in impls.items()}
    measured = interleave(steps, repeats, count=True, device=device)
    median_ms = {name: 1e3 * m.median for name, m in measured.items()}
    spread = {name: [1e3 * m.low, 1e3 * m.high] for name, m in measured.items()}
    rounds = {name: [1e3 * v for v in m.values] for name, m in measured.items()}
    syncs, kernels = {n: m.syncs for n, m in measured.items()}, {n: m.kernels for n, m in measured.items()}
    return median_ms, syncs, kernels, spread, rounds


def _paired_quartiles(times: list[float], reference: list[float]) -> list[float]:
    """``[q1, median, q3]`` of ``times[r] / reference[r]`` over the rounds: a ratio whose two sides ran in the same
    round, so that the machine's drift between rounds (load, clock, the allocator's state) cancels."""
    ratios = sorted(t / ref for t, ref in zip(times, reference))
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return [q1, median, q3]


def _bench_deepseek(
    num_tokens: int, hidden: int, ffn: int, num_experts: int, top_k: int, num_groups: int, topk_groups: int,
    repeats: int, device: str,
) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    ours = MoEBlock(MoEConfig.build(
        hidden, ffn, num_experts, top_k, score="sigmoid", num_groups=num_groups, topk_groups=topk_groups,
        route_scale=ROUTE_SCALE, num_shared_experts=1, expert_bias=True,
    )).to(device, dtype)  # fmt: skip
    with torch.no_grad():
        ours.router.weight.normal_(std=0.1)  # scores spread out, so the groups and top-k are not near-ties
        ours.expert_bias.normal_(std=0.01)
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
    impls: dict[str, tuple[Callable[[Tensor], Tensor], Tensor]] = {"ours": (ours, grad)}
    for implementation in ("eager", "grouped_mm"):
        hf = _hf_deepseek(ours, implementation)
        if hf is not None:
            impls[f"hf_{implementation}"] = (lambda t, m=hf: m(t.unsqueeze(0)).squeeze(0), grad)
    if "hf_eager" in impls:
        adapted = swap_into(_hf_deepseek(ours, "eager"))
        impls["hf_swapped_by_our_adapter"] = (lambda t, m=adapted: m(t.unsqueeze(0)).squeeze(0), grad)
    with torch.no_grad():  # same weights, same function: checked before anything is timed
        reference = ours(x)
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
        max_error = {n: float((fn(x) - reference).abs().max()) for n, (fn, _) in impls.items()}
        if any(err > tolerance * float(reference.abs().max()) for err in max_error.values()):
            raise AssertionError(f"implementations disagree: max abs error {max_error}")
    median_ms, syncs, kernels, _, _ = _time(impls, x, repeats, device)
    return {
        "kernels_per_step": kernels,
        "shape": {"T": num_tokens, "H": hidden, "F": ffn, "E": num_experts, "k": top_k, "groups": num_groups,
                  "topk_groups": topk_groups, "shared": 1},
        "dtype": str(dtype).removeprefix("torch."),
        "repeats": repeats,
        "median_ms": median_ms,
        "ratio_to_ours": {name: ms / median_ms["ours"] for name, ms in median_ms.items()},
        "host_syncs_per_step": syncs,
        "max_abs_error_vs_ours": max_error,
    }  # fmt: skip


def swap_into(block: nn.Module) -> nn.Module:
    """``block`` swapped for our grouped adapter (in a container, as a model holds it)."""
    container = nn.Sequential(block)
    swap_moe_blocks(container)
    return container[0]


def _step(fn: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor) -> None:
    x.grad = None
    fn(x).backward(grad)


def _bench_shape(
    num_tokens: int, hidden: int, ffn: int, num_experts: int, top_k: int, repeats: int, device: str
) -> dict[str, Any]:
    torch.manual_seed(0)
    # bfloat16 on GPUs (what training uses, and grouped_mm's CUDA dtype); float32 on CPU.
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    ours = MoEBlock(MoEConfig.build(hidden, ffn, num_experts, top_k)).to(device, dtype)
    naive = NaiveMoEBlock(hidden, ffn, num_experts, top_k).to(device, dtype)
    naive.load_state_dict(ours.state_dict())
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(num_tokens, hidden, device=device, dtype=dtype)

    # The limit: the expert GEMMs alone, on the rows our router produced for this very input.
    with torch.no_grad():
        plan = route(ours.router(x), top_k, validate=False)
        rows = permute(x, plan).detach().requires_grad_()
    rows_grad = torch.randn_like(rows)

    def expert_only(_: Tensor) -> Tensor:
        rows.grad = None
        grouped = ExpertRows(rows, plan.offsets, False, resolve_backend("auto", rows.device))
        return expert_swiglu(grouped, ours.experts.gate_up_proj, ours.experts.down_proj)

    bounds = plan.offsets.tolist()  # read before timing: the loop slices rows with host offsets

    def expert_loop(_: Tensor) -> Tensor:  # one matmul pair per expert over the same rows
        rows.grad = None
        gate_up, down = ours.experts.gate_up_proj, ours.experts.down_proj
        outs = []
        for e, (start, end) in enumerate(itertools.pairwise(bounds)):
            gate, up = (rows[start:end] @ gate_up[e]).chunk(2, dim=-1)
            outs.append((torch.nn.functional.silu(gate) * up) @ down[e])
        return torch.cat(outs)

    impls: dict[str, tuple[Callable[[Tensor], Tensor], Tensor]] = {
        "expert_only": (expert_only, rows_grad),
        "expert_loop": (expert_loop, rows_grad),
        "ours": (ours, grad),
        "naive": (naive, grad),
    }
    for implementation in ("eager", "grouped_mm"):
        hf = _hf_mixtral(ours, implementation)
        if hf is not None:
            impls[f"hf_{implementation}"] = (lambda t, m=hf: m(t.unsqueeze(0)).squeeze(0), grad)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    median_ms, syncs, kernels, spread, rounds = _time(impls, x, repeats, device)
    # The limit: the faster of one grouped_mm pair and a per-expert matmul loop over the same rows.
    limit = min(median_ms["expert_only"], median_ms["expert_loop"])
    limit_rounds = [min(a, b) for a, b in zip(rounds["expert_only"], rounds["expert_loop"])]
    ratios = {name: ms / limit for name, ms in median_ms.items()}
    return {
        "shape": {"T": num_tokens, "H": hidden, "F": ffn, "E": num_experts, "k": top_k},
        "dtype": str(dtype).removeprefix("torch."),
        "repeats": repeats,
        "load_average": [load, os.getloadavg()[0] if load is not None else None],
        "median_ms": median_ms,
        "min_max_ms": spread,
        "ratio_to_expert_only": ratios,
        "ratio_range": {name: [lo / limit, hi / limit] for name, (lo, hi) in spread.items()},
        # Per round: each implementation over that round's limit.
        "paired_ratio_quartiles": {name: _paired_quartiles(times, limit_rounds) for name, times in rounds.items()},
        "host_syncs_per_step": syncs,
        "kernels_per_step": kernels,
    }


def run(
    quick: bool = False,
    device: str = "cpu",
    repeats: int | None = None,
    threads: int | None = None,
    sizes: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return its results (the lead's harness calls this).

    Args:
        quick: small shapes and few repeats (seconds) instead of the issue's shapes.
        device: ``"cpu"`` or ``"cuda"``.
        repeats: timed repeats per implementation (default 3 quick, 7 full).
        threads: CPU threads for torch (default: leave as is). On a loaded shared machine one thread avoids
            OpenMP barrier stalls that inflate every small op, which would measure the machine, not the code.
        sizes: ``(H, F)`` for the issue's two shapes instead of (256, 512), and no DeepSeek-V3 table (a run that
            fits in a few minutes on a loaded 2-core machine).

    Returns:
        ``{"device", "results": [per-shape dicts with median_ms, ratio_to_expert_only, host_syncs_per_step,
        kernels_per_step], "deepseek": [per-shape dicts with median_ms, ratio_to_ours,
        host_syncs_per_step, max_abs_error_vs_ours]}``.

    Example::

        results = run(quick=True)
        results["results"][0]["ratio_to_expert_only"]["ours"]
    """
    if threads is not None:
        torch.set_num_threads(threads)
    shapes = QUICK_SHAPES if quick else FULL_SHAPES
    if sizes is not None:
        shapes = [(t, *sizes, e, k) for t, _, _, e, k in shapes]
    repeats = repeats or (3 if quick else 7)
    results = [_bench_shape(*shape, repeats=repeats, device=device) for shape in shapes]
    deepseek_shapes = [] if sizes is not None else DEEPSEEK_QUICK_SHAPES if quick else DEEPSEEK_FULL_SHAPES
    deepseek = [_bench_deepseek(*shape, repeats=repeats, device=device) for shape in deepseek_shapes]
    return {
        "device": device,
        "threads": torch.get_num_threads(),
        "results": results,
        "deepseek": deepseek,
    }


def _print(report: dict[str, Any]) -> None:
    for result in report["results"]:
        shape = ", ".join(f"{k}={v}" for k, v in result["shape"].items())
        print(f"\nMoE block fwd+bwd on {report['device']} ({shape}), median of {result['repeats']}:")
        print(f"  load average before/after: {result.get('load_average')}")
        print(f"  {'implementation':<18} {'ms':>10} {'x limit':>8} {'range':>13} {'paired: q1 median q3':>21} "
              f"{'host syncs':>11} {'kernels':>8}")  # fmt: skip
        for name, ms in sorted(result["median_ms"].items(), key=lambda kv: kv[1]):
            ratio, kernels = result["ratio_to_expert_only"][name], result["kernels_per_step"][name]
            low, high = result["ratio_range"][name]
            q1, q2, q3 = result["paired_ratio_quartiles"][name]
            syncs = result["host_syncs_per_step"][name]
            print(f"  {name:<18} {ms:>10.1f} {ratio:>8.3f} {low:>6.3f}-{high:<6.3f} {q1:>7.3f}{q2:>7.3f}{q3:>7.3f} "
                  f"{syncs:>11} {kernels:>8}")  # fmt: skip
    for result in report.get("deepseek", []):
        shape = ", ".join(f"{k}={v}" for k, v in result["shape"].items())
        print(f"\nDeepSeek-V3 MoE block fwd+bwd on {report['device']} ({shape}), median of {result['repeats']}:")
        print(f"  {'implementation':<26} {'ms':>10} {'x ours':>8} {'host syncs':>11}")
        for name, ms in sorted(result["median_ms"].items(), key=lambda kv: kv[1]):
            ratio = result["ratio_to_ours"][name]
            print(f"  {name:<26} {ms:>10.1f} {ratio:>8.3f} {result['host_syncs_per_step'][name]:>11}")


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, a few seconds")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: unchanged)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--sizes", type=int, nargs=2, default=None, metavar=("H", "F"), help="hidden and ffn sizes")
    parser.add_argument("--ep", type=int, default=None, help="expert parallelism on this many CPU processes instead")
    args = parser.parse_args()
    if args.ep is not None:
        from bench_moe_ep import print_report
        from bench_moe_ep import run as run_ep

        report = run_ep(world=args.ep, quick=args.quick, repeats=args.repeats)
        print_report(report)
    else:
        sizes = tuple(args.sizes) if args.sizes else None
        report = run(quick=args.quick, device=args.device, repeats=args.repeats, threads=args.threads, sizes=sizes)
        _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
