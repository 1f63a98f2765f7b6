"""Kernel launches of one MoE block forward+backward: ours (dropless, capacity) against transformers' ``grouped_mm``.

Counted by :class:`~lightning_llmfast.bench.kernels.KernelCounter`: ATen ops that launch a kernel on an accelerator
(views, reshapes, ``detach``, aliasing and metadata ops and bare allocations left out), this package's custom ops
opened into the ATen ops and Triton launches inside them. Our block is counted on both kernel paths: ``triton`` (what
runs on CUDA; on CPU under ``TRITON_INTERPRET=1``, each launch counted once) and ``torch`` (the PyTorch reference, the
CPU path). The gradient seed ``ones_like`` of the harness is counted for every block alike. Shapes: T tokens, H=64,
F=128, E experts, top-k.

Run: ``PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/moe_kernel_counts.py`` (prints a markdown table, writes
``benchmarks/results/moe_kernels.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_llmfast.bench.kernels import KernelCounter
from lightning_llmfast.moe import MoEBlock, MoEConfig
from lightning_llmfast.moe.kernels import triton_available

SHAPES = [(512, 8, 2), (512, 64, 8), (4096, 8, 2), (4096, 64, 8), (8192, 8, 2), (8192, 64, 8)]
HIDDEN, FFN = 64, 128


def count_block(block: nn.Module, x: Tensor) -> KernelCounter:
    """Kernels of ``block``'s forward and backward on ``x`` (a fresh leaf)."""
    x = x.detach().clone().requires_grad_()
    with KernelCounter() as counter:
        y = block(x)
        y.backward(torch.ones_like(y))
    return counter


def transformers_grouped_mm(num_experts: int, top_k: int) -> nn.Module:
    """transformers' Mixtral block with its ``grouped_mm`` experts implementation (the peer)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=num_experts, num_experts_per_tok=top_k,
        router_jitter_noise=0.0, experts_implementation="grouped_mm",
    )  # fmt: skip
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():
        nn.init.normal_(p, std=0.02)
    return block


def backends() -> tuple[str, ...]:
    """The kernel paths to count: Triton (the CUDA path; on CPU under ``TRITON_INTERPRET=1``) and the reference."""
    return ("triton", "torch") if triton_available(torch.device("cpu")) else ("torch",)


def counts(tokens: int, num_experts: int, top_k: int) -> dict[str, int]:
    """Kernels per block forward+backward at one shape: ours dropless and with capacity 1.25 (per kernel path), and
    the peer."""
    torch.manual_seed(0)
    x = torch.randn(tokens, HIDDEN)
    out = {}
    for backend in backends():
        for name, factor in (("dropless", None), ("capacity", 1.25)):
            config = MoEConfig.build(HIDDEN, FFN, num_experts, top_k, capacity_factor=factor, backend=backend)
            out[f"ours_{name}_{backend}"] = count_block(MoEBlock(config), x).kernels
    out["transformers_grouped_mm"] = count_block(transformers_grouped_mm(num_experts, top_k), x[None]).kernels
    return out


def main() -> None:
    rows = [{"T": t, "E": e, "k": k, **counts(t, e, k)} for t, e, k in SHAPES]
    columns = [c for c in rows[0] if c.startswith("ours_")] + ["transformers_grouped_mm"]
    print("| T | E | k | " + " | ".join(c.replace("_", " ") for c in columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    for r in rows:
        print(f"| {r['T']} | {r['E']} | {r['k']} | " + " | ".join(str(r[c]) for c in columns) + " |")
    path = Path(__file__).parent / "results" / "moe_kernels.json"
    path.write_text(json.dumps({"torch": torch.__version__, "hidden": HIDDEN, "ffn": FFN, "rows": rows}, indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
