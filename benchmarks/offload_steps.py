"""What the offload benchmarks share: the reference model's shapes, the offloader modes, one training step as
Lightning's ``"bf16-mixed"`` runs it, the inventory of what a layer saves, and the pinned copy time of some bytes.

:mod:`bench_offload` (modes against each other), :mod:`offload_cpu` (its CPU path) and :mod:`gpu_memplan` (memory
plans against single mechanisms) build on it.

Example::

    model, opt, ids = setup(SHAPES["cpu"], "cpu")
    step(model, opt, ids, None)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.offload import ActivationOffloader

__all__ = ["COPY_FREE_MODES", "MODES", "SHAPES", "VOCAB", "copy_ms", "forward_backward", "saved_inventory",
           "selected", "setup", "step"]  # fmt: skip


def _shape(hidden: int, heads: int, kv_heads: int, ffn: int, batch: int, seq_len: int, **model: Any) -> dict[str, Any]:
    """A reference-model shape: its config fields and the ``(batch, seq_len)`` token ids of a step."""
    config = {"hidden_size": hidden, "n_layers": 12, "n_heads": heads, "n_kv_heads": kv_heads, "ffn_size": ffn}
    return {"model": {**config, **model}, "batch": batch, "seq_len": seq_len}


SHAPES: dict[str, dict[str, Any]] = {
    "full": _shape(1024, 16, 8, 1408, 4, 2048),
    # A width closer to production MoE layers: per token, compute grows with H^2 and saved bytes with H.
    "wide": _shape(2048, 16, 8, 2816, 4, 2048),
    # Production-like width (4 experts keep AdamW state for 2.9B parameters near 47 GB). The expert weights are large
    # next to 8192 tokens: their bf16 copies are 37% of what a layer saves, 47% with the norms' outputs (all rebuilt,
    # not copied, by the offloader).
    "large": _shape(4096, 32, 8, 4096, 4, 2048, num_experts=4),
    "quick": _shape(512, 8, 4, 704, 2, 1024),
    "cpu": _shape(32, 4, 2, 64, 2, 33, n_layers=4),
    # Kernels so small that a step is host time (as a launch-bound GPU forward is): the offloader's hooks and
    # rebuild bookkeeping show as step time.
    "host": _shape(32, 4, 2, 64, 2, 32),
}
# Offloader settings per mode (None: no offloader).
MODES: dict[str, dict[str, Any] | None] = {
    "off": None,
    # Nothing is copied: only the layers' saved bf16 weight copies are dropped and rebuilt in backward.
    "rebuild": {"offload_layers": 0},
    "rebuild_gemms": {"offload_layers": 0, "rebuild": "norms+gemms"},
    "rebuild_gemms_6": {"offload_layers": 0, "rebuild": "norms+gemms", "rebuild_gemm_layers": 6},
    "all": {"offload_layers": None},
    "auto": {"offload_layers": "auto"},
    "auto_gemms": {"offload_layers": "auto", "rebuild": "norms+gemms"},
    "recompute": {"offload_layers": 0, "recompute": "selective"},
    "auto_recompute": {"offload_layers": "auto", "recompute": "selective"},
}
# The modes CPU measurements compare: the baseline and the two that copy nothing.
COPY_FREE_MODES = ("off", "rebuild", "rebuild_gemms")
# A small vocabulary keeps the (B, T, V) logits, which no layer offload can touch, from dominating the peak.
VOCAB = 4096


def setup(shape: dict[str, Any], device: str) -> tuple[MoEGPT, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    config = MoEGPTConfig(**{"vocab_size": VOCAB, "num_experts": 8, "top_k": 2, **shape["model"]})
    with torch.device(device):  # built in place: initialising the "large" shape's 2.9B parameters on the host is slow
        model = MoEGPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    ids = torch.randint(0, VOCAB, (shape["batch"], shape["seq_len"]), device=device)
    return model, opt, ids


def step(
    model: MoEGPT,
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,
    off: ActivationOffloader | None,
    marks: tuple[Any, Any] | None = None,
    free_grads: bool = True,
    held: list[int] | None = None,
) -> None:
    """One training step; ``marks``: two CUDA events recorded when the loss exists and when backward has ended;
    ``free_grads``: ``zero_grad(set_to_none=...)``; ``held``: see :func:`forward_backward`."""
    opt.zero_grad(set_to_none=free_grads)
    forward_backward(model, ids, off, marks, held)
    opt.step()


def forward_backward(
    model: MoEGPT,
    ids: torch.Tensor,
    off: ActivationOffloader | None,
    marks: tuple[Any, Any] | None = None,
    held: list[int] | None = None,
) -> None:
    """``held``: gets ``torch.cuda.memory_allocated()`` once the loss exists (the allocator's count: no sync)."""
    # As Lightning's "bf16-mixed" runs a step: autocast without its weight cache around forward and loss only.
    autocast = torch.autocast(ids.device.type, dtype=torch.bfloat16, cache_enabled=False)
    with off if off is not None else torch.enable_grad():
        with autocast:
            logits = model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
        if marks is not None:
            marks[0].record()
        if held is not None:
            held.append(torch.cuda.memory_allocated())
        loss.backward()
        if marks is not None:
            marks[1].record()


def saved_inventory(model: MoEGPT, ids: torch.Tensor, layer: int | None = 0, top: int = 12) -> dict[str, Any]:
    """What one layer (``layer=None``: every layer) saves for backward, as the offloader would see it (one forward, no
    offloader).

    Storages are counted once (views and shared storages deduplicated), parameters not at all; each entry is the
    autograd node that made the saved tensor (``grad_fn`` of its base; ``leaf`` for none), its shape and dtype.

    Returns:
        ``{"total_bytes", "tensors", "top": [{"op", "shape", "dtype", "bytes", "count"}, ...]}``, largest first.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside = [False]
    seen: set[int] = set()
    groups: dict[tuple[str, tuple[int, ...], str], list[int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr and ptr not in params and ptr not in seen:  # ptr 0: an empty storage
            seen.add(ptr)
            base = t if t._base is None else t._base
            key = (base.grad_fn.name() if base.grad_fn is not None else "leaf", tuple(t.shape), str(t.dtype))
            entry = groups.setdefault(key, [0, 0])
            entry[0] += t.untyped_storage().nbytes()
            entry[1] += 1
        return t

    blocks = list(model.layers) if layer is None else [model.layers[layer]]
    handles = [
        hook
        for block in blocks
        for hook in (
            block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
            block.register_forward_hook(lambda *_: inside.__setitem__(0, False)),
        )
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, cache_enabled=False):
                model(ids)
    finally:
        for handle in handles:
            handle.remove()
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "total_bytes": sum(v[0] for v in groups.values()),
        "tensors": sum(v[1] for v in groups.values()),
        "top": [
            {"op": op, "shape": list(shape), "dtype": dtype, "bytes": nbytes, "count": count}
            for (op, shape, dtype), (nbytes, count) in rows[:top]
        ],
    }


def copy_ms(nbytes: int, device: str) -> float:
    """Device-to-host plus host-to-device time of ``nbytes`` through pinned memory, alone (CUDA events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host.copy_(src, non_blocking=True)  # warm-up
    start.record()
    host.copy_(src, non_blocking=True)
    src.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()  # NOTE: host sync: benchmark timing only
    return start.elapsed_time(end)


def selected(names: Sequence[str] | None) -> dict[str, dict[str, Any] | None]:
    """The modes to run, in ``MODES`` order, ``off`` (the baseline) always among them."""
    unknown = sorted(set(names or ()) - set(MODES))
    if unknown:
        raise ConfigError(f"modes: unknown {unknown}; choose from {sorted(MODES)}")
    return {name: settings for name, settings in MODES.items() if names is None or name == "off" or name in names}
