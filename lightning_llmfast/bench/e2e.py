"""End-to-end training benchmark: ``before``, ``peer`` and ``llmfast`` on the same batches and the same weights.

Every variant is the reference :class:`~lightning_llmfast.models.MoEGPTLightningModule` trained through a Lightning
``Trainer`` with identical settings, except for what the variant is about:

- ``before``: ``attention_metadata="per_layer"`` (every layer rebuilds boundaries and a dense mask, with host
  syncs) and ``router_backend="naive"`` (``bincount`` + a per-expert loop), no offload, plain ``Trainer``;
- ``peer``: what HF transformers 5 gives a user today: one dense packed-sequence mask per forward
  (``attention_metadata="dense"``, as its SDPA path) and, in every layer, transformers' own
  ``MixtralSparseMoeBlock`` with the ``grouped_mm`` experts implementation (our expert weights copied into its
  layout, so the function is the same). Skipped, with the reason, when transformers is not installed;
- ``llmfast``: ``attention_metadata="cached"``, ``router_backend="auto"``, ``Trainer(strategy="llmfast")`` with
  :class:`~lightning_llmfast.SequenceMetadataCallback` and :class:`~lightning_llmfast.TokenThroughputMonitor`.

Each variant first runs one unmeasured step (lazy initialisation, kernel compilation, optimizer state), then one
*counting* segment (host syncs, ATen ops, metadata builds and peak memory, under a ``TorchDispatchMode`` that would
distort timings), then ``repeats`` *timed* segments, interleaved with the other variants (the order rotates every
repeat); tokens/sec is the median over repeats, reported with its min and max. One optimizer per variant lives
across all segments. All variants see the same sequence of batches, so their losses must agree: the report prints the
largest relative difference.

The load-balancing loss is left out of the objective (``aux_loss_coef=0``): transformers defines it ``top_k``
times larger than ours, and with it the three variants would optimise different functions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import override

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.bench.kernels import KernelCounter
from lightning_llmfast.data import PackedBatch, SyntheticCorpus, TextCorpus, pack_documents
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models import MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.models import model as model_module
from lightning_llmfast.seqmeta import SequenceMetadataCache

if TYPE_CHECKING:
    from lightning_llmfast.moe import NaiveMoEBlock

__all__ = [
    "VARIANTS",
    "E2ESettings",
    "HFMixtralFFN",
    "build_variants",
    "make_batches",
    "run_e2e",
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


# ----------------------------------------------------------------------------------------------------------- data
def make_batches(settings: E2ESettings, num_batches: int, vocab_size: int) -> list[PackedBatch]:
    """``num_batches`` full packed batches of real text, identical for every variant.

    Documents are consecutive pieces of the standard library's sources (:class:`~lightning_llmfast.data.TextCorpus`,
    byte-level, so the loss has something to learn and its agreement across variants means something), cut to the
    log-normal lengths of a :class:`~lightning_llmfast.data.SyntheticCorpus` of mean ``settings.mean_doc_len``, so
    every row packs several documents as in pre-training on short documents.

    Args:
        settings: row length, batch size, mean document length and seed.
        num_batches: batches wanted.
        vocab_size: the model's vocabulary; it must cover the byte tokenizer's.

    Returns:
        ``num_batches`` :class:`~lightning_llmfast.data.PackedBatch` objects of shape ``(B, T)`` on the CPU.

    Raises:
        ConfigError: the vocabulary is too small for the text, or the text ran out.

    Example::

        batches = make_batches(E2ESettings(seq_len=256, batch_size=2), num_batches=4, vocab_size=258)
        batches[0].input_ids.shape  # (2, 256)
    """
    if vocab_size < TextCorpus.vocab_size:
        raise ConfigError(f"vocab_size {vocab_size} is below the byte tokenizer's {TextCorpus.vocab_size}")
    tokens_needed = num_batches * settings.batch_size * settings.seq_len
    # 1.5x the expected need (plus slack for tiny runs): the packer's look-ahead holds some pieces back.
    num_docs = math.ceil(1.5 * tokens_needed / settings.mean_doc_len) + 64
    lengths = SyntheticCorpus(num_docs, settings.mean_doc_len, settings.seed).lengths
    batches = list(
        pack_documents(
            _text_pieces(lengths), settings.seq_len, settings.batch_size, vocab_size=vocab_size, drop_last=True
        )
    )
    if len(batches) < num_batches:
        raise ConfigError(f"the text packed into {len(batches)} batches, {num_batches} needed")
    # The streaming packer emits whole-row chunks of long documents first and mixed rows of short ones later:
    # a seeded shuffle gives every segment the corpus's mix instead of one end of it.
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(settings.seed))
    return [batches[i] for i in order[:num_batches].tolist()]


def _text_pieces(lengths: list[int]) -> Iterator[Tensor]:
    """Consecutive pieces of the stdlib text with the given lengths, as 1-D int64 views (no per-piece copy)."""
    files = iter(TextCorpus())
    pending = torch.empty(0, dtype=torch.int64)
    for length in lengths:
        while pending.numel() < length:
            chunk = next(files, None)
            if chunk is None:
                raise ConfigError(f"the standard library's text ran out after {len(lengths)} documents' worth")
            pending = torch.cat([pending, torch.tensor(chunk, dtype=torch.int64)])
        yield pending[:length]
        pending = pending[length:]


# ------------------------------------------------------------------------------------------------------ the peer
class HFMixtralFFN(nn.Module):
    """transformers' ``MixtralSparseMoeBlock`` (``grouped_mm`` experts) as the reference model's feed-forward.

    The block itself is transformers' code, unchanged. This wrapper only exposes what the reference model reads
    after every forward: ``last_aux_loss``, computed with transformers' own ``load_balancing_loss_func`` from the
    router logits (as ``MixtralForCausalLM`` does when it trains with router logits).

    Args:
        block: a ``MixtralSparseMoeBlock``.

    Attributes:
        moe: the wrapped block.
        last_aux_loss: 0-d load-balancing loss of the last forward.

    Example::

        ffn = HFMixtralFFN.from_naive(naive_block)  # same function as naive_block, transformers' kernels
        y = ffn(x)  # (B, T, H)
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        self.moe = block
        self._loss_fn = load_balancing_loss_func
        self._router_logits: Tensor | None = None
        self.last_aux_loss: Tensor | None = None
        # The block drops its router logits; a hook on its router keeps them for the loss.
        block.gate.register_forward_hook(self._keep_router_logits)

    def _keep_router_logits(self, module: nn.Module, args: Any, output: tuple[Tensor, ...]) -> None:
        self._router_logits = output[0]

    @classmethod
    def from_naive(cls, naive: NaiveMoEBlock) -> HFMixtralFFN:
        """Build transformers' block with the same weights as ``naive`` (so the same function), on its device.

        Our experts store ``gate_up_proj`` as ``(E, H, 2F)`` and ``down_proj`` as ``(E, F, H)`` (``x @ W``);
        transformers stores ``(E, 2F, H)`` and ``(E, H, F)`` (``F.linear``): the copies are transposes.

        Raises:
            ImportError: transformers is not installed, or has no ``grouped_mm`` experts implementation.
        """
        from transformers import MixtralConfig
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
            raise ImportError("this transformers version has no 'grouped_mm' experts implementation")
        if not naive.normalize or naive.score != "softmax":
            raise ConfigError("the Mixtral peer needs softmax scores renormalised over the top-k (as Mixtral does)")
        config = MixtralConfig(
            hidden_size=naive.hidden_size,
            intermediate_size=naive.ffn_size,
            num_local_experts=naive.num_experts,
            num_experts_per_tok=naive.top_k,
            router_jitter_noise=0.0,
            hidden_act="silu",
            experts_implementation="grouped_mm",
        )
        block = MixtralSparseMoeBlock(config).to(naive.router.weight.device)
        with torch.no_grad():
            block.gate.weight.copy_(naive.router.weight)
            block.experts.gate_up_proj.copy_(naive.experts.gate_up_proj.transpose(1, 2))
            block.experts.down_proj.copy_(naive.experts.down_proj.transpose(1, 2))
        return cls(block)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``(B, T, H)`` to ``(B, T, H)``."""
        y = self.moe(x)
        self.last_aux_loss = self._loss_fn((self._router_logits,), self.moe.experts.num_experts, self.moe.top_k)
        return y


def build_variants(
    settings: E2ESettings, variants: tuple[str, ...] = VARIANTS
) -> dict[str, MoEGPTLightningModule | str]:
    """One LightningModule per variant, all with the weights of the ``before`` model.

    Args:
        settings: model hyper-parameters, learning rate and seed.
        variants: names from :data:`VARIANTS`.

    Returns:
        ``{variant: module}``, or ``{variant: "skipped: <reason>"}`` for a variant that cannot run here (the peer
        without transformers).

    Example::

        modules = build_variants(E2ESettings(model={"n_layers": 2}))
        modules["llmfast"].model.config.attention_metadata  # "cached"
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown variants {unknown}; choose from {VARIANTS}")
    torch.manual_seed(settings.seed)
    reference = _module(settings, "before")
    state = reference.state_dict()
    out: dict[str, MoEGPTLightningModule | str] = {}
    for name in variants:
        module = reference if name == "before" else _module(settings, name)
        module.load_state_dict(state)
        if name == "peer":
            try:
                for layer in module.model.layers:
                    if not isinstance(layer.ffn, model_module.DenseSwiGLU):
                        layer.ffn = HFMixtralFFN.from_naive(layer.ffn)
            except ImportError as err:
                reason = "transformers not installed" if isinstance(err, ModuleNotFoundError) else str(err)
                out[name] = f"skipped: {reason}"
                continue
        out[name] = module
    return out


class _BenchModule(MoEGPTLightningModule):
    """The reference module with one optimizer kept across the benchmark's many short fits.

    A fresh AdamW per segment would make each segment's first update ``lr * sign(grad)`` for every parameter,
    rounding noise included (an expert without tokens has a gradient of exactly 0 in one implementation and 1e-12
    in another), and the variants' losses would drift apart for no reason but the restarts.
    """

    _kept: Any = None

    @override
    def configure_optimizers(self) -> Any:
        if self._kept is None:
            self._kept = super().configure_optimizers()
        return self._kept


def _module(settings: E2ESettings, variant: str) -> MoEGPTLightningModule:
    # warmup_steps=1: a constant learning rate from the first step.
    return _BenchModule(settings.config(variant), lr=settings.lr, aux_loss_coef=0.0, warmup_steps=1)


# ------------------------------------------------------------------------------------------------- measurement
class _MaskBuildCounter:
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
    def installed(self) -> Iterator[_MaskBuildCounter]:
        names = ("per_layer_document_mask", "dense_document_mask")
        originals = {name: getattr(model_module, name) for name in names}
        try:
            for name, fn in originals.items():
                setattr(model_module, name, self.wrap(fn))
            yield self
        finally:
            for name, fn in originals.items():
                setattr(model_module, name, fn)


def _metadata_builds(trainer: L.Trainer, masks: _MaskBuildCounter | None) -> int:
    """Metadata builds so far: dense masks built by the model plus builds of every metadata cache in use."""
    builds = masks.builds if masks is not None else 0
    for callback in trainer.callbacks:
        cache = getattr(callback, "cache", None)
        if isinstance(cache, SequenceMetadataCache):
            builds += int(cache.stats["builds"])
    return builds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        # NOTE: host sync, only at the two ends of a timed window (never inside it): the timer must see kernels end.
        torch.cuda.synchronize(device)


class _StepProbe(Callback):
    """Times the steps after ``warmup`` of one segment and, when ``count``, counts what they dispatch.

    Counting windows: forward + backward (``on_train_batch_start`` to ``on_before_optimizer_step``) for host syncs,
    ATen ops and metadata builds; the optimizer step (to ``on_train_batch_end``) for ATen ops only: AdamW reads its
    step counter, a CPU tensor even on CUDA, with ``.item()``, which is no device sync but would count as one.
    """

    def __init__(self, warmup: int, count: bool, masks: _MaskBuildCounter | None = None) -> None:
        super().__init__()
        self.warmup, self.count, self.masks = warmup, count, masks
        self.step = 0
        self.tokens = 0
        self.t0 = self.t1 = 0.0
        self.losses: list[Tensor] = []
        self.syncs = self.ops = self.kernels = self.builds = self.measured = 0
        self.sync_names: dict[str, int] = {}
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
            _synchronize(pl_module.device)
            self.t0 = time.perf_counter()
        if self.count and self._measuring():
            self._builds_at_start = _metadata_builds(trainer, self.masks)
            # The collator's host copy of the boundaries stays on the host on an accelerator too.
            self._host = getattr(batch, "cu_seqlens_cpu", None)
            self._counter = SyncCounter(pl_module.device, host=self._host).__enter__()
            self._kernels = KernelCounter().__enter__()  # the whole step: forward, backward, optimizer

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._counter is not None:
            self._close_counter(syncs=True)
            self.builds += _metadata_builds(trainer, self.masks) - self._builds_at_start
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
            self._kernels = None
        if self._measuring():
            self.measured += 1
            self.tokens += batch.num_tokens
            self.losses.append(outputs["loss"].detach())
        self.step += 1
        if self.step == trainer.max_steps:
            _synchronize(pl_module.device)
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


class _PeakMemory(TorchDispatchMode):
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

    def __enter__(self) -> _PeakMemory:
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


class _Batches:
    """A sized iterable over ready batches: Lightning would take a plain list for a list of dataloaders."""

    def __init__(self, batches: list[PackedBatch]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[PackedBatch]:
        return iter(self.batches)


def _fit(
    variant: str,
    module: MoEGPTLightningModule,
    batches: list[PackedBatch],
    probe: _StepProbe,
    settings: E2ESettings,
    device: torch.device,
) -> None:
    # Same Trainer for every variant except strategy and callbacks; the probe runs last so it sees the others' work.
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        strategy="llmfast" if variant == "llmfast" else "auto",
        precision=settings.precision,  # type: ignore[arg-type]
        max_steps=len(batches),
        callbacks=[*_callbacks(variant), probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=_Batches(batches))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
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


def run_e2e(
    settings: E2ESettings,
    device: str | torch.device = "cpu",
    variants: tuple[str, ...] = VARIANTS,
    log: Callable[[str], None] = print,
    deadline: float | None = None,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Train every variant on the same batches from the same weights and measure it.

    Args:
        settings: model, data and measurement settings.
        device: ``"cpu"`` or ``"cuda"``.
        variants: names from :data:`VARIANTS`.
        log: progress messages.
        deadline: a ``time.perf_counter()`` value after which no further timed repeat starts (at least one runs);
            the notes say how many ran.

    Returns:
        ``(results, notes)``: ``results[variant]`` holds ``tokens_per_sec`` (median over repeats), its spread
        ``tokens_per_sec_min``/``tokens_per_sec_max`` and every repeat's value ``tokens_per_sec_repeats`` (in order),
        ``host_syncs_per_step`` (forward + backward), ``metadata_builds_per_step``, ``aten_ops_per_step`` and
        ``kernels_per_step`` (whole step; :class:`~lightning_llmfast.bench.kernels.KernelCounter`),
        ``peak_mem_bytes`` (CUDA peak allocated; CPU peak of tensor bytes allocated during the counted segment) and
        ``final_loss``; a skipped variant maps to ``{"skipped": reason}``. ``notes`` lists what a reader needs to
        interpret them (loss agreement, syncs by op). A variant that raises maps to ``{"error": message}``; the
        others still run.

    Example::

        results, notes = run_e2e(E2ESettings(model={"n_layers": 2}, seq_len=128), "cpu")
        results["llmfast"]["host_syncs_per_step"]  # 0.0
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda asked for, but torch.cuda.is_available() is False")
    import lightning_llmfast  # noqa: F401  (registers the "llmfast" strategies with Lightning)

    modules = build_variants(settings, variants)
    vocab_size = settings.config("before").vocab_size
    seg = settings.segment_steps
    count_seg = settings.warmup_steps + settings.count_steps
    batches = make_batches(settings, count_seg + settings.repeats * seg, vocab_size)
    if device.type == "cuda":
        # Pinned batches let Lightning's non-blocking copies overlap, the same for every variant.
        batches = [b.pin_memory() for b in batches]
    active = [v for v in variants if not isinstance(modules[v], str)]
    results: dict[str, dict[str, Any]] = {v: {"skipped": modules[v]} for v in variants if v not in active}
    notes = [f"{v}: {results[v]['skipped']}" for v in results]
    counted: dict[str, _StepProbe] = {}
    memory: dict[str, int] = {}
    timed: dict[str, list[float]] = {v: [] for v in active}
    last: dict[str, _StepProbe] = {}
    failed: dict[str, str] = {}

    def run_segment(variant: str, segment: list[PackedBatch], probe: _StepProbe) -> bool:
        if variant in failed:
            return False
        try:
            _fit(variant, modules[variant], segment, probe, settings, device)  # type: ignore[arg-type]
        except Exception as err:  # one failing variant (out of memory, a missing kernel) must not lose the others
            failed[variant] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            log(f"[e2e] {variant} failed: {failed[variant]}")
            return False
        return True

    with _quiet():
        for variant in active:
            # One unmeasured step each first: lazy initialisation, kernel compilation and the optimizer state are
            # then in place for every variant, and the first variant's memory reading no longer carries them.
            run_segment(variant, batches[:1], _StepProbe(warmup=1, count=False))
        for variant in active:
            masks = _MaskBuildCounter()
            probe = _StepProbe(settings.warmup_steps, count=True, masks=masks)
            with masks.installed(), _PeakMemory(device) as mem:
                ok = run_segment(variant, batches[:count_seg], probe)
            if ok:
                counted[variant], memory[variant] = probe, mem.peak_bytes
                log(f"[e2e] counted {variant}: {probe.syncs / probe.measured:.1f} syncs/step")
        for r in range(settings.repeats):
            if r > 0 and deadline is not None and time.perf_counter() > deadline:
                notes.append(f"time budget reached: {r} of {settings.repeats} timed repeats ran")
                break
            segment = batches[count_seg + r * seg : count_seg + (r + 1) * seg]
            order = active[r % len(active) :] + active[: r % len(active)]
            for variant in order:
                probe = _StepProbe(settings.warmup_steps, count=False)
                if run_segment(variant, segment, probe):
                    timed[variant].append(probe.tokens_per_sec)
                    last[variant] = probe
                    log(f"[e2e] repeat {r + 1}/{settings.repeats} {variant}: {probe.tokens_per_sec:,.0f} tokens/s")
    for variant in active:
        if variant in failed:
            results[variant] = {"error": failed[variant]}
            notes.append(f"{variant}: failed: {failed[variant]}")
            continue
        c = counted[variant]
        results[variant] = {
            "tokens_per_sec": statistics.median(timed[variant]),
            "tokens_per_sec_min": min(timed[variant]),
            "tokens_per_sec_max": max(timed[variant]),
            "tokens_per_sec_repeats": list(timed[variant]),
            "host_syncs_per_step": c.syncs / c.measured,
            "metadata_builds_per_step": c.builds / c.measured,
            "aten_ops_per_step": c.ops / c.measured,
            "kernels_per_step": c.kernels / c.measured,
            "peak_mem_bytes": int(memory[variant]),
            # NOTE: host sync, once per variant after all measurement.
            "final_loss": float(last[variant].losses[-1]),
        }
        if c.sync_names:
            by_op = ", ".join(f"{k}={n / c.measured:g}" for k, n in sorted(c.sync_names.items()))
            notes.append(f"{variant} host syncs per step by op: {by_op}")
    notes.append(f"final loss max relative difference: {loss_agreement(results):.2e}")
    return results, [*notes, *_settings_notes(settings, device)]


def loss_agreement(results: dict[str, dict[str, Any]]) -> float:
    """Largest relative difference between the final losses of the variants that ran (0 with fewer than two).

    Example::

        loss_agreement({"before": {"final_loss": 2.0}, "llmfast": {"final_loss": 2.02}})  # 0.01
    """
    losses = [r["final_loss"] for r in results.values() if "final_loss" in r]
    if len(losses) < 2:
        return 0.0
    return (max(losses) - min(losses)) / max(abs(min(losses)), 1e-12)


def _settings_notes(settings: E2ESettings, device: torch.device) -> list[str]:
    c = settings.config("before")
    return [
        f"model: {c.n_layers} layers, hidden {c.hidden_size}, {c.n_heads}/{c.n_kv_heads} heads, "
        f"{c.num_experts} experts top-{c.top_k}, ffn {c.ffn_size}; batches {settings.batch_size}x{settings.seq_len} "
        f"(mean document {settings.mean_doc_len:g} tokens), {settings.precision} on {device.type}",
        f"timing: {settings.repeats} interleaved segments of {settings.warmup_steps} warm-up + "
        f"{settings.measured_steps} measured steps per variant, median; counters over {settings.count_steps} steps; "
        "host syncs over forward+backward (the optimizer's CPU step counter is not a device sync); peak memory: "
        + (
            "torch.cuda.max_memory_allocated over the counted segment"
            if device.type == "cuda"
            else "peak of tensor bytes allocated during the counted segment (weights and optimizer state excluded)"
        ),
    ]
