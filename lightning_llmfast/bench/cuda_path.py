"""Kernels per step of the CUDA code path, counted on a CPU.

With ``backend="auto"`` the package's MoE blocks take their PyTorch references on a CPU (routing, permutation,
combine, activation) and their Triton kernels on CUDA, so the counting segment on a CPU counts the CPU's path.
:func:`cuda_path_kernels` counts the CUDA one: it trains a fresh copy of the variant (same weights; the timed module
and its optimizer are left alone) over the counting segment's batches, its measured steps inside
:func:`~lightning_llmfast.moe.kernels.cuda_code_path` (``"auto"`` resolves to Triton, which its interpreter runs
under ``TRITON_INTERPRET=1``; :class:`~lightning_llmfast.bench.kernels.KernelCounter` counts each launch once and
none of the interpreter's own ATen ops). The warm-up steps run the CPU path: they only settle lazy state, and the
interpreter is slow.

Counted as on the CPU, because the CPU takes the same path: ATen ops outside the package's backends (SDPA,
``grouped_mm``, cross-entropy: one op either way) and :func:`~lightning_llmfast.seqmeta.varlen_attention`'s choice of
implementation, whose CPU rule CUDA follows at float32 too (FlashAttention varlen, one op forward and one backward,
takes fp16/bf16 only). Not counted: the metadata's host-to-device copies, once per batch on CUDA and none on a CPU.

Example::

    kernels, by_op = cuda_path_kernels(segments, "llmfast", fresh_module_with_the_same_weights)
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_llmfast.bench.steps import Segments, StepProbe
from lightning_llmfast.moe.block import GroupedMoE
from lightning_llmfast.moe.kernels import cuda_code_path, triton_available

__all__ = ["CudaPathProbe", "cuda_path_kernels", "differs_on_cuda"]


class CudaPathProbe(StepProbe):
    """A counting :class:`~lightning_llmfast.bench.steps.StepProbe` whose measured steps run the CUDA code path.

    :meth:`close` leaves the CUDA path (call it after the fit, also when it failed).
    """

    def __init__(self, warmup: int) -> None:
        super().__init__(warmup, count=True)
        self._path = contextlib.ExitStack()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.step == self.warmup:
            self._path.enter_context(cuda_code_path())
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def close(self) -> None:
        """Leave the CUDA code path."""
        self._path.close()


def differs_on_cuda(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds an MoE block of this package whose ``"auto"`` kernels would be Triton on CUDA."""
    return any(isinstance(m, GroupedMoE) and m.config.routing.backend == "auto" for m in module.modules())


def cuda_path_kernels(segments: Segments, variant: str, twin: L.LightningModule) -> tuple[float, dict[str, float]]:
    """Kernels per step of ``variant`` on the CUDA code path, counted on a CPU over the counting segment's batches.

    Args:
        segments: the profile's segments (settings, batches, how to fit).
        variant: the variant's name.
        twin: a fresh module of the variant with its weights (its own optimizer): it trains, the timed one does not.

    Returns:
        ``(kernels per step, {ATen op or "triton:<kernel>": launches per step})``.

    Raises:
        RoutingError: Triton cannot run on the CPU (see :func:`~lightning_llmfast.moe.kernels.cuda_code_path`).
    """
    if not triton_available(torch.device("cpu")):
        with cuda_code_path():  # raises the reason
            pass
    s = segments.settings
    probe = CudaPathProbe(s.warmup_steps)
    try:
        segments.fit(variant, twin, segments.data(variant)[: s.warmup_steps + s.count_steps], probe)
    finally:
        probe.close()
    n = probe.measured
    return probe.kernels / n, {name: k / n for name, k in Counter(probe.kernel_names).most_common()}
