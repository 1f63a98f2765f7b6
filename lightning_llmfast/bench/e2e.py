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
*counting* segment (host syncs, kernels, ATen ops, metadata builds and peak memory, under a ``TorchDispatchMode``
that would distort timings), then ``repeats`` *timed* segments, interleaved with the other variants (the order
rotates every repeat); tokens/sec is the median over repeats, reported with its min and max. One optimizer per
variant lives across all segments. After the timed segments, on a CPU, a variant whose kernels differ on CUDA (the
package's ``backend="auto"``) is counted again on a copy, on the CUDA code path
(:mod:`~lightning_llmfast.bench.cuda_path`). All variants see the same sequence of batches, so their losses must
agree: the report prints the largest relative difference.

The load-balancing loss is left out of the objective (``aux_loss_coef=0``): transformers defines it ``top_k``
times larger than ours, and with it the three variants would optimise different functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_llmfast.bench.cuda_path import cuda_path_kernels, differs_on_cuda
from lightning_llmfast.bench.harness import Measurement, interleave
from lightning_llmfast.bench.peer import HFMixtralFFN
from lightning_llmfast.bench.steps import VARIANTS, E2ESettings, Segments, check_device, quiet
from lightning_llmfast.data import PackedBatch, SyntheticCorpus, TextCorpus, pack_documents
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.models import MoEGPTLightningModule
from lightning_llmfast.moe.stats import MoELayer

__all__ = [
    "VARIANTS",
    "E2ESettings",
    "HFMixtralFFN",
    "build_variants",
    "kernel_diff",
    "make_batches",
    "num_batches",
    "run_e2e",
]


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
                    if isinstance(layer.ffn, MoELayer):
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
        ``host_syncs_per_step`` (forward + backward), ``metadata_builds_per_step``, ``aten_ops_per_step``,
        ``kernels_per_step`` (whole step, the CUDA code path, counted on a CPU by
        :func:`~lightning_llmfast.bench.cuda_path.cuda_path_kernels` where it differs from the CPU's;
        :class:`~lightning_llmfast.bench.kernels.KernelCounter`) and ``kernels_by_op_per_step``, then
        ``kernels_per_step_cpu_path`` where it differs,
        ``peak_mem_bytes`` (CUDA peak allocated; CPU peak of tensor bytes allocated during the counted segment) and
        ``final_loss``; a skipped variant maps to ``{"skipped": reason}``. ``notes`` lists what a reader needs to
        interpret them (loss agreement, syncs by op). A variant that raises maps to ``{"error": message}``; the
        others still run.

    Example::

        results, notes = run_e2e(E2ESettings(model={"n_layers": 2}, seq_len=128), "cpu")
        results["llmfast"]["host_syncs_per_step"]  # 0.0
    """
    device = check_device(device)
    import lightning_llmfast  # noqa: F401  (registers the "llmfast" strategies with Lightning)

    modules = build_variants(settings, variants)
    batches = make_batches(settings, num_batches(settings), settings.config("before").vocab_size)
    if device.type == "cuda":
        # Pinned batches let Lightning's non-blocking copies overlap, the same for every variant.
        batches = [b.pin_memory() for b in batches]
    active = {v: m for v, m in modules.items() if not isinstance(m, str)}
    segments = Segments(settings, batches, device)
    with quiet():
        measured = interleave(
            {v: segments.runner(v, m) for v, m in active.items()}, settings.repeats,
            count=lambda v: segments.count(v, active[v]), deadline=deadline, catch=True, log=log,
        )  # fmt: skip
    results: dict[str, dict[str, Any]] = {v: {"skipped": m} for v, m in modules.items() if isinstance(m, str)}
    notes = [f"{v}: {row['skipped']}" for v, row in results.items()]
    ran = min((len(m.values) for m in measured.values() if m.error is None), default=settings.repeats)
    if ran < settings.repeats:
        notes.append(f"time budget reached: {ran} of {settings.repeats} timed repeats ran")
    for variant in active:
        results[variant], more = segments.row(variant, measured[variant])
        notes += more
    with quiet():
        notes += _cuda_path_columns(segments, active, measured, results, log)
    notes.append(f"final loss max relative difference: {loss_agreement(results):.2e}")
    return {v: results[v] for v in variants}, [*notes, *_settings_notes(settings, device)]


def _cuda_path_columns(
    segments: Segments,
    modules: dict[str, MoEGPTLightningModule],
    measured: dict[str, Measurement],
    results: dict[str, dict[str, Any]],
    log: Callable[[str], None],
) -> list[str]:
    """Makes ``kernels_per_step`` the CUDA code path's and adds ``kernels_by_op_per_step``; on a CPU, variants whose
    path differs there are counted again by :func:`~lightning_llmfast.bench.cuda_path.cuda_path_kernels` (their
    CPU path's count moves to ``kernels_per_step_cpu_path``). Returns the notes saying how."""
    notes, recounted = [], []
    for variant, module in modules.items():
        row, m = results[variant], measured[variant]
        if "error" in row:
            continue
        probe = m.extra["probe"]
        by_op = {name: k / probe.measured for name, k in probe.kernel_names.most_common()}
        if segments.device.type == "cpu" and differs_on_cuda(module):
            log(f"{variant}: counting the kernels of the CUDA code path (Triton interpreted)")
            try:
                twin = _module(segments.settings, variant)
                twin.load_state_dict(module.state_dict())
                kernels, by_op = cuda_path_kernels(segments, variant, twin)
            except RoutingError as err:
                notes.append(f"{variant}: kernels/step counted on the CPU path only: {err}")
            else:
                row["kernels_per_step_cpu_path"], row["kernels_per_step"] = row["kernels_per_step"], kernels
                recounted.append(variant)
        row["kernels_by_op_per_step"] = by_op
    if recounted:
        notes.append(
            f"kernels/step: the CUDA code path; {', '.join(recounted)} counted again for it by a separate pass over "
            "the counting segment's batches (backend='auto' as on CUDA: Triton under TRITON_INTERPRET=1, each launch "
            "once; see lightning_llmfast/bench/cuda_path.py), its CPU path's count in kernels_per_step_cpu_path"
        )
    if "kernels_by_op_per_step" in results.get("llmfast", {}) and "kernels_by_op_per_step" in results.get("peer", {}):
        notes.append("llmfast - peer kernels/step by op: " + kernel_diff(results["llmfast"], results["peer"]))
    return notes


def kernel_diff(row: dict[str, Any], other: dict[str, Any], top: int = 12) -> str:
    """The ``top`` largest per-op differences of kernels per step between two result rows, largest first.

    Example::

        kernel_diff({"kernels_by_op_per_step": {"mm": 4}}, {"kernels_by_op_per_step": {"mm": 3, "bmm": 2}})
        # "bmm=-2, mm=+1"
    """
    mine, theirs = row["kernels_by_op_per_step"], other["kernels_by_op_per_step"]
    diff = {name: mine.get(name, 0) - theirs.get(name, 0) for name in {*mine, *theirs}}
    ranked = sorted((d for d in diff.items() if d[1]), key=lambda d: (-abs(d[1]), d[0]))[:top]
    return ", ".join(f"{name}={n:+g}" for name, n in ranked) or "none"


def num_batches(settings: E2ESettings) -> int:
    """Batches one run needs: the warm-up step, the counting segment and every timed segment."""
    return settings.warmup_steps + settings.count_steps + settings.repeats * settings.segment_steps


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
