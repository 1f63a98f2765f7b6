"""The ``hf`` profile: a transformers Qwen3-MoE trained by :class:`~lightning_llmfast.HFCausalLMModule` against the
same model trained the way the transformers documentation shows for packed data, in one run, from the same weights.

- ``hf_eager`` and ``hf_grouped_mm``: ``Qwen3MoeForCausalLM`` with that ``experts_implementation`` and SDPA
  attention, fed the fields ``DataCollatorWithFlattening`` produces (every document of the batch flattened into one
  ``(1, B*T)`` row: ``input_ids``, ``position_ids`` restarting at each document, unshifted ``labels`` with ``-100``
  at each document start) and computing its own loss (``model(**fields).loss``). ``use_cache=False`` is passed as
  well: with the default ``use_cache=True`` transformers 5 creates a cache in training and then attends across
  documents, which would make this a benchmark of a wrong computation. transformers detects the packing from the
  ``position_ids`` in each forward;
- ``llmfast``: :class:`~lightning_llmfast.HFCausalLMModule` (grouped, sync-free MoE blocks swapped in,
  :func:`~lightning_llmfast.packed_model_inputs` on the ``(B, T)`` rows, the package's varlen attention driven by the
  batch's metadata, no mask) with ``strategy="llmfast"``,
  :class:`~lightning_llmfast.SequenceMetadataCallback` and :class:`~lightning_llmfast.TokenThroughputMonitor`.

All three train on the same tokens with the same labels (the peer's labels are ours unshifted), without the
load-balancing loss (transformers scales it differently), so their losses must agree.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import Tensor
from typing_extensions import override

from lightning_llmfast.bench.e2e import E2ESettings, loss_agreement, make_batches, num_batches
from lightning_llmfast.bench.harness import Measurement, interleave
from lightning_llmfast.bench.steps import Segments, StepProbe, check_device, quiet
from lightning_llmfast.data import PackedBatch

__all__ = ["HF_VARIANTS", "FlattenedBatch", "flatten_like_transformers", "run_hf"]

HF_VARIANTS: tuple[str, ...] = ("hf_eager", "hf_grouped_mm", "llmfast")
"""The ``hf`` profile's variants, in report order."""


@dataclass
class FlattenedBatch:
    """``DataCollatorWithFlattening``'s fields for a batch, plus its real-token count for the benchmark's probe.

    Attributes:
        input_ids: ``(1, B*T)`` token ids.
        position_ids: ``(1, B*T)`` positions restarting at each segment.
        labels: ``(1, B*T)`` unshifted labels, ``-100`` at each segment's first token (and where ours ignore).
        num_tokens: real tokens, a host int.
    """

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    num_tokens: int

    def to(self, device: torch.device | str, non_blocking: bool = True) -> FlattenedBatch:
        """The batch on ``device`` (how Lightning moves it)."""
        move = {"device": device, "non_blocking": non_blocking and torch.device(device).type != "cpu"}
        return FlattenedBatch(
            self.input_ids.to(**move), self.position_ids.to(**move), self.labels.to(**move), self.num_tokens
        )

    def fields(self) -> dict[str, Tensor]:
        """The keyword arguments of the model's forward."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "labels": self.labels}


def flatten_like_transformers(batch: PackedBatch) -> FlattenedBatch:
    """The packed batch as ``DataCollatorWithFlattening`` would give it: one row, unshifted labels.

    transformers shifts ``labels`` inside the model (position ``i`` predicts ``labels[i + 1]``), so the unshifted
    labels are ours moved one to the right, with ``-100`` at each segment's first position.

    Example::

        flat = flatten_like_transformers(batch)
        loss = hf_model(**flat.fields(), use_cache=False).loss  # the same loss as HFCausalLMModule's
    """
    ours = batch.labels.reshape(-1)
    labels = torch.full_like(ours, -100)
    labels[1:] = ours[:-1]
    starts = batch.cu_seqlens_cpu if batch.cu_seqlens_cpu is not None else batch.cu_seqlens
    labels[starts[:-1].long()] = -100
    return FlattenedBatch(
        batch.input_ids.reshape(1, -1), batch.position_ids.reshape(1, -1), labels[None], batch.num_tokens
    )


class _KeepOptimizer:
    """One optimizer across the benchmark's many short fits: a restart would change the training trajectory."""

    _kept: Any = None

    def configure_optimizers(self) -> Any:
        if self._kept is None:
            self._kept = super().configure_optimizers()  # type: ignore[misc]
        return self._kept


class _TransformersWay(_KeepOptimizer, L.LightningModule):
    """A transformers causal LM trained on the flattening collator's fields, with its own loss."""

    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    @override
    def training_step(self, batch: FlattenedBatch, batch_idx: int) -> Tensor:
        return self.model(**batch.fields(), use_cache=False).loss

    @override
    def configure_optimizers(self) -> Any:
        # The same AdamW as HFCausalLMModule's with weight_decay=0 (a constant learning rate there too).
        if self._kept is None:
            self._kept = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.0)
        return self._kept


class _CPUTimeProbe(StepProbe):
    """The step probe that also reads this process's CPU time over the measured steps.

    On a shared machine other processes take the cores away between and during steps, so wall-clock tokens/sec
    swing with their load; the CPU seconds this process spends vary far less. Run with one torch thread
    (``OMP_NUM_THREADS=1``) so that OpenMP workers spinning on a contended core do not count as work.
    """

    c0 = c1 = 0.0

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.step == self.warmup:
            self.c0 = time.process_time()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.step == trainer.max_steps:
            self.c1 = time.process_time()

    @property
    def tokens_per_cpu_sec(self) -> float:
        """Real tokens per CPU second of this process over the measured steps."""
        return self.tokens / (self.c1 - self.c0) if self.c1 > self.c0 else float("nan")


def _modules(settings: E2ESettings, variants: tuple[str, ...]) -> dict[str, L.LightningModule]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lightning_llmfast.hf import HFCausalLMModule

    class Ours(_KeepOptimizer, HFCausalLMModule):
        pass

    def model(experts: str) -> torch.nn.Module:
        config = Qwen3MoeConfig(**settings.model, attn_implementation="sdpa", experts_implementation=experts)
        return Qwen3MoeForCausalLM(config)

    torch.manual_seed(settings.seed)
    state = model("eager").state_dict()
    out: dict[str, L.LightningModule] = {}
    for name in variants:
        hf = model(name.removeprefix("hf_") if name != "llmfast" else "eager")
        hf.load_state_dict(state)
        if name == "llmfast":
            out[name] = Ours(hf, lr=settings.lr, weight_decay=0.0, aux_loss_coef=0.0, warmup_steps=1)
        else:
            out[name] = _TransformersWay(hf, settings.lr)
    return out


def run_hf(
    settings: E2ESettings,
    device: str | torch.device = "cpu",
    variants: tuple[str, ...] = HF_VARIANTS,
    log: Callable[[str], None] = print,
    deadline: float | None = None,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Train every variant on the same batches from the same weights and measure it, interleaved.

    Args:
        settings: ``model`` holds ``Qwen3MoeConfig`` keyword arguments; rows, documents and repeats as in
            :class:`~lightning_llmfast.bench.e2e.E2ESettings`.
        device: ``"cpu"`` or ``"cuda"``.
        variants: names from :data:`HF_VARIANTS`.
        log: progress messages.
        deadline: a ``time.perf_counter()`` value after which no further timed repeat starts.

    Returns:
        ``(results, notes)`` as :func:`~lightning_llmfast.bench.e2e.run_e2e` returns them.

    Example::

        results, notes = run_hf(PROFILES["hf"].e2e, "cpu")
        results["llmfast"]["tokens_per_sec"] / results["hf_grouped_mm"]["tokens_per_sec"]
    """
    import lightning_llmfast  # noqa: F401  (registers the "llmfast" strategies with Lightning)

    device = check_device(device)
    modules = _modules(settings, variants)
    packed = make_batches(settings, num_batches(settings), settings.model["vocab_size"])
    data = {v: packed if v == "llmfast" else [flatten_like_transformers(b) for b in packed] for v in variants}
    segments = Segments(settings, data, device)
    segments.probe_type = _CPUTimeProbe
    with quiet():
        measured = interleave(
            {v: segments.runner(v, modules[v]) for v in variants}, settings.repeats,
            count=lambda v: segments.count(v, modules[v]), deadline=deadline, log=log,
        )  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    notes = []
    for variant in variants:
        results[variant], more = segments.row(variant, measured[variant])
        cpu = [probe.tokens_per_cpu_sec for probe in segments.timed[variant]]
        results[variant]["tokens_per_cpu_sec"] = statistics.median(cpu)
        notes += more
    notes.append(f"final loss max relative difference: {loss_agreement(results):.2e}")
    return results, notes + _peer_notes(results, measured, variants) + [_model_note(settings, device, measured)]


def _peer_notes(
    results: dict[str, dict[str, Any]], measured: dict[str, Measurement], variants: tuple[str, ...]
) -> list[str]:
    peers = [v for v in variants if v != "llmfast"]
    if "llmfast" not in variants or not peers:
        return []
    # Within one repeat the variants run back to back, so a shared machine's load changes less between them.
    ours = measured["llmfast"].values
    paired = [ours[r] / max(measured[v].values[r] for v in peers) for r in range(len(ours))]
    shown = ", ".join(f"{x:.2f}" for x in paired)
    best_cpu = max(results[v]["tokens_per_cpu_sec"] for v in peers)
    ratio_cpu = results["llmfast"]["tokens_per_cpu_sec"] / best_cpu
    return [
        f"llmfast / best transformers setting per repeat: {shown} (median {statistics.median(paired):.2f})",
        f"llmfast / best transformers setting in tokens per CPU second: {ratio_cpu:.2f}",
    ]


def _model_note(settings: E2ESettings, device: torch.device, measured: dict[str, Measurement]) -> str:
    cfg = settings.model
    rounds = len(next(iter(measured.values())).values)
    return (
        f"model: Qwen3-MoE, {cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, "
        f"{cfg.get('num_experts')} experts top-{cfg.get('num_experts_per_tok')}; batches {settings.batch_size}x"
        f"{settings.seq_len} (mean document {settings.mean_doc_len:g} tokens), fp32 on {device.type}; "
        f"{rounds} interleaved segments of {settings.warmup_steps} warm-up + "
        f"{settings.measured_steps} measured steps, median"
    )
