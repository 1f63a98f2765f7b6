"""One training segment under Lightning and what the benchmark reads from it.

:class:`E2ESettings` says what a profile run trains and how it measures it (the variants' model switches included);
:func:`fit_segment` trains a module on ready batches through a ``Trainer`` (one fit per segment); a
:class:`StepProbe` callback times its steps after a warm-up and counts host syncs, kernels, ATen ops and metadata
builds per step; :class:`PeakMemory` records the peak memory of a segment. The end-to-end, transformers and FSDP
profiles share these; the interleaving of segments is :func:`lightning_llmfast.bench.harness.interleave`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import override

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.bench.harness import Measurement
from lightning_llmfast.bench.kernels import KernelCounter
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models import MoEGPTConfig
from lightning_llmfast.models import model as model_module
from lightning_llmfast.seqmeta import SequenceMetadataCache

__all__ = [
    "VARIANTS",
    "Batches",
    "E2ESettings",
    "MaskBuildCounter",
    "PeakMemory",
    "Segments",
    "StepProbe",
    "builds_of_open_versions",
    "check_device",
    "fit_segment",
    "metadata_builds",
    "quiet",
]


VARIANTS: tuple[str, ...] = ("before", "peer", "llmfast")
"""The end-to-end variants, in report order."""

_MODES: dict[str, tuple[str, str]] = {
    # variant -> (attention_metadata, router_backend); the peer's experts are swapped for transformers' block.
    "before": ("per_layer", "naive"),
    "peer": ("dense", "naive"),
    "llmfast": ("cached", "auto"),
}


@dataclass(frozen=True)
class E2ESettings:
    """What one end-to-end run trains and how it is measured.

    Args:
        model: keyword arguments of :class:`~lightning_llmfast.models.MoEGPTConfig` (without
            ``attention_metadata``/``router_backend``, which each variant sets).
        seq_len: tokens per packed row ``T``.
        batch_size: rows per batch ``B``.
        mean_doc_len: mean document length of the synthetic (log-normal) corpus.
        warmup_steps: steps at the start of every segment that are not measured (optimizer state, lazy init).
        measured_steps: measured steps per segment.
        repeats: timed segments per variant; tokens/sec is their median.
        count_steps: measured steps of the counting segment.
        precision: Lightning precision (``"32-true"`` on CPU, ``"bf16-mixed"`` on CUDA).
        lr: constant AdamW learning rate.
        seed: seed of the weights and the corpus.

    Example::

        settings = E2ESettings(model={"n_layers": 2}, seq_len=128, batch_size=2, mean_doc_len=40)
    """

    model: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 512
    batch_size: int = 4
    mean_doc_len: float = 128.0
    warmup_steps: int = 1
    measured_steps: int = 3
    repeats: int = 3
    count_steps: int = 2
    precision: str = "32-true"
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "measured_steps", "repeats", "count_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"E2ESettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"E2ESettings.warmup_steps must be >= 0, got {self.warmup_steps}")
        for key in ("attention_metadata", "router_backend"):
            if key in self.model:
                raise ConfigError(f"E2ESettings.model must not set {key!r}: each variant sets it")

    @property
    def segment_steps(self) -> int:
        """Steps of one timed segment (warm-up included)."""
        return self.warmup_steps + self.measured_steps

    def config(self, variant: str) -> MoEGPTConfig:
        """The model configuration of ``variant``."""
        attention, router = _MODES[variant]
        return MoEGPTConfig(**self.model, attention_metadata=attention, router_backend=router)

    def with_overrides(self, **changes: Any) -> E2ESettings:
        """A copy with some fields changed (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


class MaskBuildCounter:
    """Counts the reference model's dense-mask builds (``per_layer`` and ``dense`` modes) while installed."""

    def __init__(self) -> None:
        self.builds = 0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            # per_layer_document_mask calls dense_document_mask: that is one build, not two.
            self.builds += self._depth == 0
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    @contextlib.contextmanager
    def installed(self) -> Iterator[MaskBuildCounter]:
        names = ("per_layer_document_mask", "dense_document_mask")
        originals = {name: getattr(model_module, name) for name in names}
        try:
            for name, fn in originals.items():
                setattr(model_module, name, self.wrap(fn))
            yield self
        finally:
            for name, fn in originals.items():
                setattr(model_module, name, fn)


def metadata_builds(trainer: L.Trainer, masks: MaskBuildCounter | None) -> int:
    """Metadata builds so far: dense masks built by the model plus builds of every metadata cache in use."""
    builds = masks.builds if masks is not None else 0
    for callback in trainer.callbacks:
        cache = getattr(callback, "cache", None)
        if isinstance(cache, SequenceMetadataCache):
            builds += int(cache.stats["builds"])
    return builds


def builds_of_open_versions(trainer: L.Trainer) -> int:
    """Builds the metadata callbacks made for the batch whose version they opened."""
    from lightning_llmfast.callbacks import SequenceMetadataCallback

    return sum(cb.builds_last_batch for cb in trainer.callbacks if isinstance(cb, SequenceMetadataCallback))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        # NOTE: host sync, only at the two ends of a timed window (never inside it): the timer must see kernels end.
        torch.cuda.synchronize(device)


class StepProbe(Callback):
    """Times the steps after ``warmup`` of one segment and, when ``count``, counts what they dispatch.

    Counting windows: forward + backward (``on_train_batch_start`` to ``on_before_optimizer_step``) for host syncs,
    ATen ops and metadata builds; the optimizer step (to ``on_train_batch_end``) for ATen ops only: AdamW reads its
    step counter, a CPU tensor even on CUDA, with ``.item()``, which is no device sync but would count as one.
    """

    def __init__(self, warmup: int, count: bool, masks: MaskBuildCounter | None = None) -> None:
        super().__init__()
        self.warmup, self.count, self.masks = warmup, count, masks
        self.step = 0
        self.tokens = 0
        self.t0 = self.t1 = 0.0
        self.losses: list[Tensor] = []
        self.syncs = self.ops = self.kernels = self.builds = self.measured = 0
        self.sync_names: dict[str, int] = {}
        self.kernel_names: Counter[str] = Counter()  # ATen kernel ops and Triton launches by name, summed over steps
        self._counter: SyncCounter | None = None
        self._kernels: KernelCounter | None = None
        self._host: Tensor | None = None
        self._builds_at_start = 0

    def _measuring(self) -> bool:
        return self.step >= self.warmup

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.step == self.warmup:
            synchronize(pl_module.device)
            self.t0 = time.perf_counter()
        if self.count and self._measuring():
            # The metadata callback (before this probe) builds when it opens the batch's version: count that build.
            self._builds_at_start = metadata_builds(trainer, self.masks) - builds_of_open_versions(trainer)
            # The collator's host copy of the boundaries stays on the host on an accelerator too.
            self._host = getattr(batch, "cu_seqlens_cpu", None)
            self._counter = SyncCounter(pl_module.device, host=self._host).__enter__()
            self._kernels = KernelCounter().__enter__()  # the whole step: forward, backward, optimizer

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._counter is not None:
            self._close_counter(syncs=True)
            self.builds += metadata_builds(trainer, self.masks) - self._builds_at_start
            self._counter = SyncCounter(pl_module.device, host=self._host).__enter__()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._counter is not None:
            self._close_counter(syncs=False)
        if self._kernels is not None:
            self._kernels.__exit__(None, None, None)
            self.kernels += self._kernels.kernels
            self.kernel_names.update(self._kernels.kernel_ops)
            self.kernel_names.update({f"triton:{k}": n for k, n in self._kernels.triton_launches.items()})
            self._kernels = None
        if self._measuring():
            self.measured += 1
            self.tokens += batch.num_tokens
            self.losses.append(outputs["loss"].detach())
        self.step += 1
        if self.step == trainer.max_steps:
            synchronize(pl_module.device)
            self.t1 = time.perf_counter()

    def _close_counter(self, *, syncs: bool) -> None:
        assert self._counter is not None
        self._counter.__exit__(None, None, None)
        self.ops += self._counter.total
        if syncs:
            self.syncs += self._counter.num_syncs
            for name, n in self._counter.syncs.items():
                self.sync_names[name] = self.sync_names.get(name, 0) + n
        self._counter = None

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / (self.t1 - self.t0) if self.t1 > self.t0 else float("nan")


class PeakMemory(TorchDispatchMode):
    """Peak memory over a ``with`` block: CUDA's peak allocated bytes, or on CPU the peak of live tensor bytes.

    On CPU the resident set size is no measure: the host allocator keeps freed pages, so the second variant to run
    "grows" by almost nothing. Instead every tensor storage an op creates is counted until it is freed (a weak
    finalizer), which is what the allocator had to hold, independent of its caching. Tensors that exist before the
    block (weights, optimizer state) are not counted; on CUDA everything on the device is.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.peak_bytes = self._live_bytes = 0
        self._live: dict[int, int] = {}

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._live:  # views and in-place results share a storage already counted
                    self._live[key] = storage.nbytes()
                    self._live_bytes += storage.nbytes()
                    self.peak_bytes = max(self.peak_bytes, self._live_bytes)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self._live_bytes -= self._live.pop(key, 0)


# --------------------------------------------------------------------------------------------------------- runner
def _callbacks(variant: str) -> list[Callback]:
    if variant != "llmfast":
        return []
    from lightning_llmfast.callbacks import SequenceMetadataCallback, TokenThroughputMonitor

    return [SequenceMetadataCallback(), TokenThroughputMonitor()]


class Batches:
    """A sized iterable over ready batches: Lightning would take a plain list for a list of dataloaders."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


def fit_segment(
    variant: str, module: L.LightningModule, batches: list[Any], probe: StepProbe, precision: str, device: torch.device
) -> None:
    """Train ``module`` on ``batches`` (one step each) with ``probe`` watching.

    The same Trainer for every variant except strategy and callbacks: ``"llmfast"`` trains under
    ``strategy="llmfast"`` with the metadata and throughput callbacks, any other variant under ``"auto"``. The probe
    runs last, so it sees the others' work.
    """
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        strategy="llmfast" if variant == "llmfast" else "auto",
        precision=precision,  # type: ignore[arg-type]
        max_steps=len(batches),
        callbacks=[*_callbacks(variant), probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=Batches(batches))


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence Lightning's per-fit banners and warnings (list dataloaders, no workers): one fit per segment."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; ``"cuda"`` without CUDA raises :class:`~lightning_llmfast.ConfigError`."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but torch.cuda.is_available() is False")
    return device


class Segments:
    """The training segments of one profile run: warm-up, counting and timed segments over shared batches.

    ``runner(variant, module)(r)`` is the implementation :func:`~lightning_llmfast.bench.harness.interleave` calls:
    ``r < 0`` one unmeasured step (lazy initialisation, kernel compilation and the optimizer state are then in place
    for every variant, and the first variant's memory reading no longer carries them), ``r >= 0`` the ``r``-th timed
    segment (returns tokens/sec). :meth:`count` runs the counting segment; :meth:`row` turns a measurement into the
    result row. ``fit`` trains one segment (the transformers profile passes its own batches per variant).
    """

    def __init__(self, settings: E2ESettings, batches: list[Any], device: torch.device, fit: Any = None) -> None:
        self.settings, self.batches, self.device = settings, batches, device
        self.fit = fit or (lambda variant, module, segment, probe: fit_segment(
            variant, module, segment, probe, settings.precision, device))  # fmt: skip
        self.timed: dict[str, list[StepProbe]] = {}
        self.probe_type: type[StepProbe] = StepProbe

    def data(self, variant: str) -> list[Any]:
        """The batches of ``variant`` (one list for all, or the profile's per-variant lists)."""
        return self.batches[variant] if isinstance(self.batches, dict) else self.batches

    def runner(self, variant: str, module: Any) -> Callable[[int], float | None]:
        s = self.settings
        first = s.warmup_steps + s.count_steps

        def run(r: int) -> float | None:
            data = self.data(variant)
            if r < 0:
                self.fit(variant, module, data[:1], self.probe_type(warmup=1, count=False))
                return None
            probe = self.probe_type(s.warmup_steps, count=False)
            self.fit(variant, module, data[first + r * s.segment_steps : first + (r + 1) * s.segment_steps], probe)
            self.timed.setdefault(variant, []).append(probe)
            return probe.tokens_per_sec

        return run

    def count(self, variant: str, module: Any) -> Measurement:
        """The counting segment: per-step host syncs, kernels, ATen ops, metadata builds and the peak memory."""
        s, masks = self.settings, MaskBuildCounter()
        probe = self.probe_type(s.warmup_steps, count=True, masks=masks)
        with masks.installed(), PeakMemory(self.device) as memory:
            self.fit(variant, module, self.data(variant)[: s.warmup_steps + s.count_steps], probe)
        n = probe.measured
        return Measurement(
            syncs=probe.syncs / n, kernels=probe.kernels / n, ops=probe.ops / n,
            sync_names={k: v / n for k, v in probe.sync_names.items()},
            extra={"builds": probe.builds / n, "peak_mem_bytes": int(memory.peak_bytes), "probe": probe},
        )  # fmt: skip

    def row(self, variant: str, m: Measurement) -> tuple[dict[str, Any], list[str]]:
        """The result row of ``variant`` and its notes (syncs by op, or the failure)."""
        if m.error is not None:
            return {"error": m.error}, [f"{variant}: failed: {m.error}"]
        row = {
            **m.summary("tokens_per_sec"),
            "host_syncs_per_step": m.syncs,
            "metadata_builds_per_step": m.extra["builds"],
            "aten_ops_per_step": m.ops,
            "kernels_per_step": m.kernels,
            "peak_mem_bytes": m.extra["peak_mem_bytes"],
            # NOTE: host sync, once per variant after all measurement.
            "final_loss": float(self.timed[variant][-1].losses[-1]),
        }
        del row["host_syncs"], row["kernels"]
        by_op = ", ".join(f"{k}={n:g}" for k, n in sorted(m.sync_names.items()))
        return row, [f"{variant} host syncs per step by op: {by_op}"] if by_op else []
