"""Kernel launches of one MoE block forward+backward: ours (dropless, capacity) against transformers' ``grouped_mm``.

A kernel is an ATen op that launches one on an accelerator: views, reshapes, ``detach``, aliasing and metadata ops and
bare allocations are left out (:data:`NOT_KERNELS`), and this package's custom ops are counted by the ATen ops inside
them (:class:`KernelCounter`). Counted on CPU for the PyTorch path of our kernels (``backend="torch"``); the
gradient seed ``ones_like`` of the harness is counted for every block alike. Shapes: T tokens, H=64, F=128, E experts,
top-k; the counts depend on T only through the reference combine's cache-sized chunks.

Run: ``PYTHONPATH=. python benchmarks/moe_kernel_counts.py`` (prints a markdown table, writes
``benchmarks/results/moe_kernels.json``).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_llmfast.moe import MoEBlock, MoEConfig

NOT_KERNELS: frozenset[str] = frozenset(
    {
        "detach",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "lift_fresh",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_reshape_alias",
        "_unsafe_view",
    }
)
SHAPES = [(512, 8, 2), (512, 64, 8), (4096, 8, 2), (4096, 64, 8), (8192, 8, 2), (8192, 64, 8)]
HIDDEN, FFN = 64, 128


class KernelCounter(TorchDispatchMode):
    """Counts kernel-launching ATen ops; this package's custom ops are opened and their ATen ops counted instead.

    Example::

        with KernelCounter() as counter:
            block(x).sum().backward()
        counter.total
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == "lightning_llmfast":
            with self:  # the implementation's own ATen ops are the launches
                return OPDEFS[f"{func.namespace}::{name}"]._init_fn(*args, **kwargs)
        if not (func.is_view or name in NOT_KERNELS):
            self.ops[name] += 1
        return func(*args, **kwargs)


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


def counts(tokens: int, num_experts: int, top_k: int) -> dict[str, int]:
    """Kernels per block forward+backward at one shape: ours dropless, ours with capacity 1.25, the peer."""
    torch.manual_seed(0)
    x = torch.randn(tokens, HIDDEN)
    out = {}
    for name, factor in (("ours_dropless", None), ("ours_capacity", 1.25)):
        block = MoEBlock(MoEConfig.build(HIDDEN, FFN, num_experts, top_k, capacity_factor=factor, backend="torch"))
        out[name] = count_block(block, x).total
    out["transformers_grouped_mm"] = count_block(transformers_grouped_mm(num_experts, top_k), x[None]).total
    return out


def main() -> None:
    rows = [{"T": t, "E": e, "k": k, **counts(t, e, k)} for t, e, k in SHAPES]
    print("| T | E | k | ours dropless | ours capacity 1.25 | transformers grouped_mm |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['E']} | {r['k']} | {r['ours_dropless']} | {r['ours_capacity']} | "
              f"{r['transformers_grouped_mm']} |")  # fmt: skip
    path = Path(__file__).parent / "results" / "moe_kernels.json"
    path.write_text(json.dumps({"torch": torch.__version__, "hidden": HIDDEN, "ffn": FFN, "rows": rows}, indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
