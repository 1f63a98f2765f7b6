"""Activation offload on CPU (force=True): bit-identical gradients, pool reuse, dedup, prefetch order, errors."""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.errors import ConfigError, OffloadError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.models.rmsnorm import rms_norm
from lightning_llmfast.offload import (
    ActivationOffloader,
    OffloadConfig,
    PinnedBufferPool,
    mark_rebuildable,
    plan_offload,
    plan_offload_layers,
    plan_partial_bytes,
    resolve_layers,
    size_class,
)
from lightning_llmfast.offload import measure as offloader_module
from lightning_llmfast.offload.copier import CpuCopier as _Copier

VOCAB = 64


# ---------------------------------------------------------------------------------------------- toy models
class Block(nn.Module):
    """Residual MLP block that saves several views of one storage (chunk) and an output (sigmoid)."""

    def __init__(self, d: int, ckpt: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.ckpt = ckpt

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.up(self.norm(x)).chunk(2, dim=-1)
        return self.down(torch.cat([torch.relu(a) * torch.sigmoid(b), a * b], dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = checkpoint(self._inner, x, use_reentrant=False) if self.ckpt else self._inner(x)
        return x + inner


class Stack(nn.Module):
    def __init__(self, n_layers: int = 4, d: int = 8, ckpt: str = "none") -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)  # so that layer inputs are activations (need grad), as in a real model
        self.layers = nn.ModuleList(Block(d, ckpt=ckpt == "inside") for _ in range(n_layers))
        self.head = nn.Linear(d, 3)
        self.ckpt_around = ckpt == "around"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.ckpt_around else layer(x)
        return self.head(x)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _step(model: nn.Module, x: torch.Tensor, offloader: ActivationOffloader | None = None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if offloader is None:
        model(x).square().mean().backward()
    else:
        with offloader:
            model(x).square().mean().backward()
    return _grads(model)


def _pair(seed: int = 0, **kwargs: Any) -> tuple[Stack, Stack]:
    torch.manual_seed(seed)
    model = Stack(**kwargs)
    return model, copy.deepcopy(model)


# ---------------------------------------------------------------------------------------------- pool
@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=1 << 40))
def test_size_class_bounds_rounding_waste(nbytes: int) -> None:
    cls = size_class(nbytes)
    assert cls >= nbytes and cls % 1024 == 0
    assert cls <= max(4096, math.ceil(nbytes * 1.25))  # four classes per octave: at most 25% waste
    assert size_class(cls) == cls  # classes are fixed points, so a buffer serves its own class
    assert size_class(nbytes + 1) >= cls  # monotone


def test_pool_release_of_unknown_buffer_and_bad_headroom_raise() -> None:
    pool = PinnedBufferPool(pin_memory=False)
    with pytest.raises(OffloadError, match="not checked out"):
        pool.release(torch.empty(4096, dtype=torch.uint8))
    for bad in (0.5, float("nan"), float("inf"), 1e308, "2", True):  # inf or 1e308 overflowed when the pool was sized
        with pytest.raises(OffloadError, match="headroom"):
            PinnedBufferPool(headroom=bad)
    for bad in (-1, None, 1.5):
        with pytest.raises(OffloadError, match="size_class: nbytes"):
            size_class(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_offload_bytes": -1}, "min_offload_bytes"),
        ({"keep_last_layers": -2}, "keep_last_layers"),
        ({"prefetch_layers": -1}, "prefetch_layers"),
        ({"prefetch_layers": 1.5}, "prefetch_layers"),
        ({"keep_last_layers": True}, "keep_last_layers"),
        ({"pool_headroom": 0.99}, "pool_headroom"),
        ({"pool_headroom": float("nan")}, "pool_headroom"),
        ({"pool_headroom": float("inf")}, "pool_headroom"),
        ({"pool_headroom": 17}, "pool_headroom"),
        ({"force": "no"}, "force"),  # bool("no") is True: a string must not switch the mechanism on
        ({"rebuild": "norms+gemms", "rebuild_gemm_layers": -1}, "rebuild_gemm_layers"),
        ({"rebuild": "norms+gemms", "rebuild_gemm_layers": 1.5}, "rebuild_gemm_layers"),
    ],
)
def test_bad_configuration_raises_at_construction(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(OffloadError, match=field) as info:
        ActivationOffloader(Stack().layers, OffloadConfig(**kwargs))
    assert isinstance(info.value, ValueError)


def test_layers_that_match_nothing_raise() -> None:
    model = Stack()
    with pytest.raises(OffloadError, match="no attribute 'blocks'"):
        resolve_layers(model, "blocks", error=OffloadError)
    with pytest.raises(ConfigError, match="matched no modules"):
        resolve_layers(model, nn.ModuleList())
    with pytest.raises(ConfigError, match=r"no nn\.ModuleList"):
        resolve_layers(nn.Linear(2, 2), None)
    with pytest.raises(OffloadError, match="matched no modules"):
        ActivationOffloader(nn.ModuleList())
    with pytest.raises(OffloadError, match="must be the modules"):
        ActivationOffloader("layers")  # type: ignore[arg-type]
    # default: the largest ModuleList of identical blocks
    assert resolve_layers(model, None) == list(model.layers)
    assert resolve_layers(model, "layers") == list(model.layers)


# ---------------------------------------------------------------------------------------------- correctness
@settings(max_examples=12, deadline=None)
@given(
    shape=st.sampled_from([(1, 1), (1, 7), (3, 5), (2, 13), (5, 1)]),
    n_layers=st.integers(1, 5),
    keep=st.integers(0, 2),
    prefetch=st.integers(0, 2),
    ckpt=st.sampled_from(["none", "inside", "around"]),
    seed=st.integers(0, 2**16),
)
def test_gradients_bit_identical_on_fresh_inputs(
    shape: tuple[int, int], n_layers: int, keep: int, prefetch: int, ckpt: str, seed: int
) -> None:
    ref, model = _pair(seed, n_layers=n_layers, ckpt=ckpt)
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=keep, prefetch_layers=prefetch, force=True)
    )
    for step in range(2):
        x = torch.randn(*shape, 8, generator=torch.Generator().manual_seed(seed + step))
        expected, got = _step(ref, x), _step(model, x, off)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        stats = off.stats
        assert stats["segments"] == n_layers and stats["checked_out"] == 0 and stats["lazy_reloads"] == 0
        # with checkpoints around the layers, layer 0's checkpoint input is saved before the first layer: kept
        offloading_layers = n_layers - keep - (ckpt == "around")
        if offloading_layers > 0:
            assert stats["offloaded_tensors"] > 0 and stats["prefetch_hits"] > 0
        else:
            assert stats["offloaded_bytes"] == 0
    off.close()


def test_offloaded_bytes_match_an_independent_count_of_saved_storages() -> None:
    # The distinct non-parameter storages saved inside layers 0..L-2, counted by a plain saved_tensors_hooks pass.
    ref, model = _pair(3, n_layers=3)
    x = torch.randn(4, 6, 8)
    seen = {key: n for key, n in _saved_storages(ref, x).items() if key[0] < 2}
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True))
    _step(model, x, off)
    stats = off.stats
    assert stats["offloaded_bytes"] == sum(seen.values())
    assert stats["dedup_hits"] > 0  # the two chunk() views of one projection share a storage: copied once
    assert stats["offloaded_tensors"] == stats["dedup_hits"] + len(seen)


def test_parameters_and_small_tensors_stay_on_device() -> None:
    big = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])  # weight 16 KiB, input (2, 64) 512 B
    x = torch.randn(2, 64, requires_grad=True)
    off = ActivationOffloader(big, OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True))
    with off:
        h = x
        for layer in big:
            h = layer(h)
        h.sum().backward()
    assert off.stats["offloaded_bytes"] == 3 * 2 * 64 * 4  # the three inputs, never the weights
    off2 = ActivationOffloader(big, OffloadConfig(min_offload_bytes=513, keep_last_layers=0, force=True))
    with off2:
        h = x
        for layer in big:
            h = layer(h)
        h.sum().backward()
    assert off2.stats["offloaded_bytes"] == 0  # every activation is under the threshold


def test_prefetch_order_alternates_buffer_sets_and_runs_before_use() -> None:
    _, model = _pair(1, n_layers=5)
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, prefetch_layers=1, force=True)
    )
    events: list[tuple[str, int, int]] = []
    prefetch, unpack = off.reloader.prefetch, off._unpack

    def spy_prefetch(seg: Any) -> None:
        events.append(("prefetch", seg.index, seg.index % 2))
        prefetch(seg)

    def spy_unpack(saved: Any) -> torch.Tensor:
        if getattr(saved, "block", None) is not None:
            events.append(("unpack", saved.block.segment, saved.block.set_index))
        return unpack(saved)

    off.reloader.prefetch, off._unpack = spy_prefetch, spy_unpack  # type: ignore[method-assign]
    _step(model, torch.randn(2, 3, 8), off)
    prefetches = [e for e in events if e[0] == "prefetch"]
    # layer 4 is kept; its backward prefetches layer 3, layer 3's prefetches 2, ...: double buffering
    assert prefetches == [("prefetch", 3, 1), ("prefetch", 2, 0), ("prefetch", 1, 1), ("prefetch", 0, 0)]
    for seg in range(4):
        first_use = next(i for i, e in enumerate(events) if e[:2] == ("unpack", seg))
        issued = events.index(("prefetch", seg, seg % 2))
        assert issued < first_use  # prefetched before its first unpack
        if seg > 0:  # and the layer below is prefetched while this layer's backward still runs
            assert events.index(("prefetch", seg - 1, (seg - 1) % 2)) < max(
                i for i, e in enumerate(events) if e[:2] == ("unpack", seg)
            )
    assert off.stats["lazy_reloads"] == 0


def test_lazy_reload_fallback_when_no_prefetch_was_issued() -> None:
    ref, model = _pair(2, n_layers=3)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True))
    off._backward_begins = lambda seg_index: None  # type: ignore[method-assign]
    x = torch.randn(3, 4, 8)
    assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
    assert off.stats["prefetch_hits"] == 0 and off.stats["lazy_reloads"] > 0


def test_checkpoint_inside_layers_offloads_only_checkpoint_inputs() -> None:
    ref, model = _pair(4, n_layers=4, ckpt="inside")
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True))
    x = torch.randn(2, 5, 8)
    assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
    # per offloaded layer: the checkpoint's input x (also saved by nothing else inside the checkpointed region)
    assert off.stats["offloaded_tensors"] == 3 and off.stats["offloaded_bytes"] == 3 * x.numel() * 4


def test_checkpoint_around_layers_attributes_inputs_to_the_next_layer() -> None:
    ref, model = _pair(5, n_layers=4, ckpt="around")
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True))
    x = torch.randn(2, 5, 8)
    assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
    # layers 1 and 2: their checkpoint inputs, saved between layers; layer 0's is saved before the first layer
    assert off.stats["offloaded_tensors"] == 2 and off.stats["lazy_reloads"] == 0


def test_offload_adds_no_host_syncs() -> None:
    _, model = _pair(6, n_layers=3)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True))
    x = torch.randn(2, 4, 8)
    with SyncCounter() as plain:
        model(x).sum().backward()
    with SyncCounter() as offloaded, off:
        model(x).sum().backward()
    assert offloaded.num_syncs == plain.num_syncs == 0, offloaded.syncs
    assert off.stats["offloaded_tensors"] > 0


class _Boom(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _Boom.armed:
            raise RuntimeError("boom in backward")
        return grad


def test_exception_in_backward_leaves_nothing_checked_out_and_next_step_works() -> None:
    ref, model = _pair(7, n_layers=4)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True))
    x = torch.randn(3, 2, 8)
    _step(model, x, off)
    _Boom.armed = True
    try:
        with pytest.raises(RuntimeError, match="boom"), off:
            h = model.embed(x)
            for i, layer in enumerate(model.layers):
                h = layer(_Boom.apply(h) if i == 1 else h)
            model.head(h).square().mean().backward()
    finally:
        _Boom.armed = False
    assert off.stats["checked_out"] == 0
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
    assert off.stats["checked_out"] == 0 and off.stats["offloaded_tensors"] > 0


def test_unpack_after_the_step_ended_raises() -> None:
    _, model = _pair(8, n_layers=2)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True))
    with off:
        loss = model(torch.randn(2, 3, 8)).sum()
    with pytest.raises(OffloadError, match="after its step ended"):
        loss.backward()


def test_cpu_without_force_is_a_no_op() -> None:
    ref, model = _pair(9, n_layers=2)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0))
    x = torch.randn(2, 3, 8)
    assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
    assert not off.enabled and off.stats["offloaded_bytes"] == 0


def test_close_removes_hooks() -> None:
    _, model = _pair(10, n_layers=2)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True))
    off.close()
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in model.layers)


# ---------------------------------------------------------------------------------------------- stream protocol
class _Event:
    def __init__(self) -> None:
        self.fired = False


class _DeferredCopier(_Copier):
    """CPU stand-in for CUDA's copy streams: a copy runs only when something waits for its event.

    Any missing wait (an unpack before its copy event, a host buffer reused before its reload was read, a buffer
    set overwritten while still in use) then reads stale or uninitialised memory and changes the gradients.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.queues: dict[bool, list[tuple[_Event, Any, Any, tuple[Any, ...]]]] = {True: [], False: []}
        self.waits = 0

    def mark_compute(self) -> None:
        return None  # compute is synchronous here

    def copy(self, pairs: Any, to_host: bool, after: Any = ()) -> _Event:
        event = _Event()
        self.queues[to_host].append((event, list(pairs), tuple(e for e in after if e is not None)))
        return event

    def _flush(self, event: _Event) -> None:
        for queue in self.queues.values():
            while not event.fired and any(e is event for e, *_ in queue):
                first, pairs, after = queue.pop(0)  # streams are FIFO
                for dep in after:
                    self._flush(dep)
                for dst, src in pairs:
                    dst.copy_(src)
                first.fired = True

    def compute_waits(self, event: Any) -> None:
        if event is not None:
            self.waits += 1
            self._flush(event)

    def done(self, event: Any) -> bool:
        return event is None or event.fired

    def wait_host(self, event: Any) -> None:
        if event is not None:
            self._flush(event)


@pytest.mark.parametrize("ckpt", ["none", "inside", "around"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_deferred_copies_prove_every_use_waits_for_its_event(ckpt: str, prefetch: int) -> None:
    ref, model = _pair(11, n_layers=5, ckpt=ckpt)
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, prefetch_layers=prefetch, force=True)
    )
    copiers: list[_DeferredCopier] = []
    off._make_copier = lambda device: copiers.append(_DeferredCopier(device)) or copiers[-1]  # type: ignore[method-assign]
    for step, shape in enumerate([(2, 7), (3, 5), (1, 1)]):
        x = torch.randn(*shape, 8, generator=torch.Generator().manual_seed(step))
        assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
        assert off.stats["lazy_reloads"] == 0 and off.stats["prefetch_hits"] > 0
    assert len(copiers) == 1 and copiers[0].waits > 0
    off.synchronize()
    assert off.stats["checked_out"] == 0 and not any(copiers[0].queues.values())


class _CountingCopier(_Copier):
    """Synchronous CPU copier that counts copy calls per direction (each is a stream switch and an event on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.calls: dict[bool, int] = {True: 0, False: 0}

    def copy(self, pairs: Any, to_host: bool, after: Any = ()) -> None:
        self.calls[to_host] += 1
        return super().copy(pairs, to_host, after)


def test_one_copy_call_per_offloaded_layer_and_direction() -> None:
    ref, model = _pair(12, n_layers=5)
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, offload_layers=3, force=True)
    )
    copiers: list[_CountingCopier] = []
    off._make_copier = lambda device: copiers.append(_CountingCopier(device)) or copiers[-1]  # type: ignore[method-assign]
    x = torch.randn(2, 7, 8)
    assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
    stats = off.stats
    assert stats["offloaded_tensors"] > 3 * 2  # several tensors per layer ...
    assert copiers[0].calls == {True: 3, False: 3}  # ... one batched copy per layer each way
    off.close()


# ---------------------------------------------------------------------------------------------- reference model
def _reference(n_layers: int = 3, ckpt: bool = False) -> MoEGPT:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=VOCAB, hidden_size=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_size=64)
    model = MoEGPT(config)
    if ckpt:  # checkpoint inside each block (its hooks still see one call)
        for block in model.layers:
            block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
    return model


def _train(
    model: MoEGPT, steps: int, offloader: ActivationOffloader | None, seq_lens: list[int], bf16: bool = False
) -> list[Any]:
    """Train ``steps`` steps; ``bf16``: forward and loss under autocast as Lightning's "bf16-mixed" runs them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (2, seq_lens[step % len(seq_lens)]), generator=g)
        ids = ids.to(model.embed.weight.device)
        opt.zero_grad(set_to_none=True)
        with offloader if offloader is not None else torch.enable_grad():
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
                logits = model(ids).float()
                loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
            loss.backward()
        out.append(([p.grad.clone() for p in model.parameters()], offloader.stats if offloader else None))
        opt.step()
    return out


@pytest.mark.filterwarnings("ignore:PinnedBufferPool")  # step 3 is the longest sequence: the pool grows once
@pytest.mark.parametrize("ckpt", [False, True])
def test_reference_model_gradients_bit_identical_over_three_steps(ckpt: bool) -> None:
    seq_lens = [17, 1, 31]  # prime, length 1, prime: MoE expert loads and activation sizes differ per step
    expected = _train(_reference(ckpt=ckpt), 3, None, seq_lens)
    model = _reference(ckpt=ckpt)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True))
    got = _train(model, 3, off, seq_lens)
    for (g_ref, _), (g_off, stats) in zip(expected, got):
        assert all(torch.equal(a, b) for a, b in zip(g_ref, g_off))
        assert stats["offloaded_tensors"] > 0 and stats["checked_out"] == 0 and stats["lazy_reloads"] == 0
    off.close()


@pytest.mark.filterwarnings("ignore:PinnedBufferPool")
@pytest.mark.parametrize(
    ("rebuild", "gemm_layers_setting", "gemm_layers"),
    [("norms", None, 0), ("norms+gemms", None, 3), ("norms+gemms", 2, 2), ("norms+gemms", 0, 0), ("norms+gemms", 7, 3)],
)
def test_reference_model_bf16_mixed_gradients_bit_identical_with_rebuilt_weight_copies(
    rebuild: str, gemm_layers_setting: int | None, gemm_layers: int
) -> None:
    seq_lens = [17, 1, 31]
    expected = _train(_reference(), 3, None, seq_lens, bf16=True)
    model = _reference()
    off = ActivationOffloader(
        model.layers,
        OffloadConfig(
            min_offload_bytes=0,
            keep_last_layers=1,
            force=True,
            rebuild=rebuild,  # type: ignore[arg-type]
            rebuild_gemm_layers=gemm_layers_setting,
        ),
    )
    got = _train(model, 3, off, seq_lens, bf16=True)
    for (g_ref, _), (g_off, stats) in zip(expected, got):
        assert all(torch.equal(a, b) for a, b in zip(g_ref, g_off))
        # per layer: qkv, output, router, gate/up and down weights, in all three layers (the kept last one too)
        assert stats["recast_casts"] == 15 and stats["kept_casts"] == 0 and stats["offloaded_tensors"] > 0
        # and the norms' bf16 outputs: the attention input, and the MoE input that router and experts share; with
        # "norms+gemms" the experts' gate/up output too, in every layer or the first rebuild_gemm_layers
        assert stats["rebuilt_tensors"] == 3 * 3 + gemm_layers
        # Backward runs one rebuild per dropped tensor (the MoE input's copy once for router and experts: -3); a
        # gate/up output's rebuild reads its weight copy and input: the copy (one cast) is rebuilt again for the
        # GEMM's own backward, the input is held for it.
        assert stats["rebuilds"] == 15 + 3 * 3 + gemm_layers - 3 + gemm_layers
    off.close()


def test_reference_model_pool_does_not_grow_after_second_step() -> None:
    model = _reference(n_layers=2)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=256, keep_last_layers=1, force=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a growth would warn
        results = _train(model, 50, off, [8])
    sizes = [stats["pool_bytes"] for _, stats in results]
    assert sizes[0] > 0 and len(set(sizes[1:])) == 1, sizes
    assert results[-1][1]["pool_grow_events"] == 0 and results[-1][1]["checked_out"] == 0
    assert all(stats["peak_inflight"] <= sizes[1] for _, stats in results)


# ---------------------------------------------------------------------------------------------- offload_layers
@pytest.mark.parametrize(
    ("compute_ms", "nbytes", "bandwidth", "margin", "prefetch", "expected"),
    [
        # F = 1, 2, 3, 4 (forward ends 4); copies of 1 ms end 2, 3, 4, 5: the fourth ends after the forward, and a
        # third would be prefetched when the last layer starts its backward, before anything is freed (memory)
        ([1.0] * 4, [1] * 4, 1.0, 0.0, 1, 2),
        # a 100% margin makes copies 2 ms: they end 3, then max(3, 2) + 2 = 5 > 4
        ([1.0] * 4, [1] * 4, 1.0, 1.0, 1, 1),
        # same numbers through the bandwidth: 2 bytes at 2 bytes/ms is 1 ms
        ([1.0] * 4, [2] * 4, 2.0, 0.0, 1, 2),
        # zero layers fit: layer 0's copy (10 ms) ends at 11, after the 2 ms forward
        ([1.0, 1.0], [10, 10], 1.0, 0.0, 1, 0),
        # all fit: nothing to copy
        ([1.0, 1.0, 1.0], [0, 0, 0], 1.0, 0.0, 1, 3),
        # one layer: no forward follows its copy, so it cannot hide ...
        ([5.0], [1], 1.0, 0.0, 1, 0),
        # ... unless there is nothing to copy
        ([5.0], [0], 1.0, 0.0, 1, 1),
        # forward fits (layer 0's copy ends at 2 <= 6.25) but backward does not: B = (10.5, 10, 0), layer 0's
        # prefetch is issued at B_1 = 10 and ends at 11 > B_0 = 10.5
        ([1.0, 0.25, 5.0], [1, 1, 1], 1.0, 0.0, 1, 0),
        # prefetching two ahead issues it at B_2 = 0, but then it is on the device while layer 2 still holds its
        # activations: nothing was freed yet (memory)
        ([1.0, 0.25, 5.0], [1, 1, 1], 1.0, 0.0, 2, 0),
        # two more layers after it: B = (14.5, 14, 4, 2, 0); one ahead, layer 0's prefetch at B_1 = 14 ends at 15 >
        # 14.5; two ahead, layers 1 and 0 are issued at B_3 = 2 and B_2 = 4 and end at 3 and 5, with layers 4 and
        # 3 freed by then; a third layer would be prefetched at B_4 with nothing freed
        ([1.0, 0.25, 5.0, 1.0, 1.0], [1] * 5, 1.0, 0.0, 1, 0),
        ([1.0, 0.25, 5.0, 1.0, 1.0], [1] * 5, 1.0, 0.0, 2, 2),
        # empty stack
        ([], [], 1.0, 0.0, 1, 0),
    ],
)
def test_plan_offload_layers_hand_computed(
    compute_ms: list[float], nbytes: list[int], bandwidth: float, margin: float, prefetch: int, expected: int
) -> None:
    got = plan_offload_layers(compute_ms, nbytes, bandwidth, margin=margin, prefetch_layers=prefetch)
    assert got == expected


def test_plan_offload_layers_h200_like_numbers() -> None:
    # 12 layers of 3 ms forward (6 ms backward), 10 ms copies per layer and direction (the H200: 223 ms of
    # copies for 11 layers both ways against 106 ms of compute). B_j = 6 (11 - j).
    args = ([3.0] * 12, [10_000] * 12, 1_000.0)
    # prefetching one layer ahead leaves 6 ms for a 10 ms copy: nothing hides
    assert plan_offload_layers(*args, margin=0.0, prefetch_layers=1) == 0
    # three ahead: forward copies end at 13, 23, 33 (<= 36), 43 (> 36); backward prefetches of layers 2, 1, 0
    # are issued at B_5 = 36, B_4 = 42, B_3 = 48 and end at 46 <= 54, 56 <= 60, 66 <= 66
    assert plan_offload_layers(*args, margin=0.0, prefetch_layers=3) == 3
    # a 20% margin (12 ms copies: forward 15, 27, 39 > 36) costs one layer
    assert plan_offload_layers(*args, margin=0.2, prefetch_layers=3) == 2
    # plan_offload picks the depth: the shallowest that hides the most layers
    assert plan_offload(*args, margin=0.0) == (3, 3)
    assert plan_offload(*args, margin=0.2) == (2, 3)
    # measured backward times replace the 2x estimate: a 1 ms backward per layer hides one 10 ms prefetch at most
    assert plan_offload(*args, margin=0.0, backward_ms=[1.0] * 12) == (1, 10)


def _stacks(min_layers: int, min_bytes: int, max_bytes: int) -> st.SearchStrategy[Any]:
    """Random layer stacks: ``(forward ms, saved bytes, backward ms)``, one entry per layer, up to 8 layers."""
    return st.integers(min_value=min_layers, max_value=8).flatmap(
        lambda n: st.tuples(
            st.lists(st.floats(min_value=0.1, max_value=10.0), min_size=n, max_size=n),
            st.lists(st.integers(min_value=min_bytes, max_value=max_bytes), min_size=n, max_size=n),
            st.lists(st.floats(min_value=0.1, max_value=20.0), min_size=n, max_size=n),
        )
    )


@settings(max_examples=80, deadline=None)
@given(_stacks(1, 0, 100), st.floats(min_value=0.5, max_value=50.0))
def test_freed_bytes_of_the_later_layers_is_the_default_and_less_freed_never_offloads_more(
    layers: tuple[list[float], list[int], list[float]], bandwidth: float
) -> None:
    compute, sizes, backward = layers
    suffix = [sum(sizes[k + 1 :]) for k in range(len(sizes))]
    default = plan_offload(compute, sizes, bandwidth, margin=0.0, backward_ms=backward)
    assert plan_offload(compute, sizes, bandwidth, margin=0.0, backward_ms=backward, freed_bytes=suffix) == default
    # backward that also allocates (weight gradients) frees less: the plan can only shrink
    less = [f // 3 for f in suffix]
    assert plan_offload(compute, sizes, bandwidth, margin=0.0, backward_ms=backward, freed_bytes=less)[0] <= default[0]


def test_plan_offload_with_gradients_eating_the_freed_memory() -> None:
    # The H200-like numbers above (3 layers, three ahead), but every layer's backward allocates weight gradients of
    # 70% of what it frees (3_000 net of 10_000). Three layers no longer fit: three ahead, layers 0 .. 2 are all
    # resident when layer 3 starts its backward, 30_000 against the 24_000 that 8 layers freed; deeper, layers 1 .. 2
    # are resident at layer 5 (20_000 > 18_000). Without gradients the same rule saw 80_000 freed there.
    args = ([3.0] * 12, [10_000] * 12, 1_000.0)
    freed = [3_000 * (11 - k) for k in range(12)]
    assert plan_offload(*args, margin=0.0) == (3, 3)
    n, depth = plan_offload(*args, margin=0.0, freed_bytes=freed)
    assert (n, depth) == (2, 3)
    # with the measured numbers, no prefetch holds more than backward has freed by then
    for k in range(12):
        resident = sum(10_000 for i in range(max(k - depth, 0), min(k, n - 1) + 1))
        assert resident <= freed[k] - 10_000 * max(n - k - 1, 0)


def test_auto_plan_uses_the_memory_backward_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measuring step reads the allocator's count when each layer's backward starts (CUDA only; scripted here)."""
    monkeypatch.setattr(_Copier, "bandwidth", lambda self, nbytes, host: 1e30)
    counts = iter([1_000, 900, 850, 845])  # layers 3, 2, 1, 0 start their backward in this order
    monkeypatch.setattr(_Copier, "allocated", lambda self: next(counts))
    _, model = _pair(7, n_layers=4)
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True, offload_layers="auto")
    )
    _step(model, torch.randn(2, 5, 8), off)
    plan = off.auto_plan
    assert plan is not None and plan["freed_bytes"] == [155, 150, 100, 0]
    # a few hundred bytes freed cannot hold a prefetched layer of several KiB: nothing offloads
    assert plan["offload_layers"] == 0 and min(plan["bytes_per_layer"]) > 1_000
    off.close()


@pytest.mark.parametrize(
    ("layers", "depth", "match"),
    [(-1, 1, "offload_layers"), (1.5, 1, "offload_layers"), (None, 1, "offload_layers"), (0, 0, "prefetch_layers")],
)
def test_plan_partial_bytes_rejects_bad_counts(layers: Any, depth: int, match: str) -> None:
    with pytest.raises(OffloadError, match=f"plan_partial_bytes: {match} must be an int >= "):
        plan_partial_bytes([1.0], [1], 1.0, margin=0.0, offload_layers=layers, prefetch_layers=depth)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bytes_per_layer": [1, 2]}, "differ in length"),  # was an IndexError
        ({"bytes_per_layer": [1, 1, -5, 1], "offload_layers": 2}, r"bytes_per_layer\[2\]"),  # was a silent 0
        ({"bandwidth_bytes_per_ms": 0.0, "offload_layers": 4}, "bandwidth"),  # past the last layer: checked too
    ],
)
def test_plan_partial_bytes_validates_before_it_plans(kwargs: dict[str, Any], match: str) -> None:
    args = {"compute_ms": [1.0] * 4, "bytes_per_layer": [1] * 4, "bandwidth_bytes_per_ms": 1.0, "offload_layers": 3}
    with pytest.raises(OffloadError, match=match):
        plan_partial_bytes(**{**args, **kwargs}, margin=0.0, prefetch_layers=1)


def test_plan_partial_bytes_hand_computed() -> None:
    args = ([3.0] * 12, [10_000] * 12, 1_000.0)
    # no margin: (3, 3); layer 3's copy starts when layer 2's ends (33 ms) and must end with the forward (36 ms)
    assert plan_partial_bytes(*args, margin=0.0, offload_layers=3, prefetch_layers=3) == 3_000
    # 20% margin: (2, 3) with 12 ms copies. The forward leaves 36 - 27 = 9 ms, but backward less: layer 2's prefetch
    # (issued at B_5 = 36) delays layer 1's (42 + ...) and so layer 0's, which must end by B_0 = 66:
    # 36 + t + 12 + 12 <= 66 gives t <= 6 ms, 5_000 bytes at 1.2 ms per 1_000
    assert plan_partial_bytes(*args, margin=0.2, offload_layers=2, prefetch_layers=3) == 5_000
    # past the last layer there is nothing left to offload
    assert plan_partial_bytes(*args, margin=0.0, offload_layers=12, prefetch_layers=3) == 0


@settings(max_examples=60, deadline=None)
@given(_stacks(2, 1, 5_000), st.floats(min_value=10.0, max_value=2_000.0))
def test_plan_partial_bytes_is_the_largest_that_fits(
    layers: tuple[list[float], list[int], list[float]], bandwidth: float
) -> None:
    compute, sizes, backward = layers
    n, depth = plan_offload(compute, sizes, bandwidth, margin=0.1, backward_ms=backward)
    part = plan_partial_bytes(
        compute, sizes, bandwidth, margin=0.1, offload_layers=n, prefetch_layers=depth, backward_ms=backward
    )
    if n == len(sizes):
        assert part == 0
        return
    assert 0 <= part < sizes[n]  # a whole layer N would have been planned whole
    freed = [sum(sizes[k + 1 :]) for k in range(len(sizes))]  # backward frees all of layer N either way

    def planned_with(nbytes: int) -> int:
        trial = [*sizes[:n], nbytes, *sizes[n + 1 :]]
        kwargs = {"prefetch_layers": depth, "backward_ms": backward, "freed_bytes": freed}
        return plan_offload_layers(compute, trial, bandwidth, margin=0.1, **kwargs)

    assert planned_with(part) >= n + 1 and planned_with(part + 1) <= n


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1.0], [1, 2], 1.0), "'bytes_per_layer': 2"),
        (([None], [1], 1.0), r"compute_ms\[0\]"),  # was a TypeError
        (([float("inf")], [1], 1.0), r"compute_ms\[0\]"),
        (([1.0], [True], 1.0), r"bytes_per_layer\[0\]"),
        (([-1.0], [1], 1.0), r"compute_ms\[0\]"),
        (([1.0, 1.0], [1, -5], 1.0), r"bytes_per_layer\[1\]"),
        (([1.0], [1], 0.0), "bandwidth"),
        (([1.0], [1], float("nan")), "bandwidth"),
        (([1.0, 1.0], [1, 1], 1.0, None, [5]), "'freed_bytes': 1"),
        (([1.0, 1.0], [1, 1], 1.0, None, [5, -1]), r"freed_bytes\[1\]"),
    ],
)
def test_plan_offload_layers_rejects_bad_inputs(args: tuple[Any, ...], match: str) -> None:
    compute, sizes, bandwidth, backward, freed = (*args, None, None)[:5]
    with pytest.raises(OffloadError, match=match):
        plan_offload_layers(compute, sizes, bandwidth, margin=0.0, backward_ms=backward, freed_bytes=freed)
    with pytest.raises(OffloadError, match="margin"):
        plan_offload_layers([1.0], [1], 1.0, margin=-0.1)
    for depth in (-1, -100, 1.5, None):  # -1 returned 1, -100 raised IndexError, 1.5 TypeError
        with pytest.raises(OffloadError, match="prefetch_layers"):
            plan_offload_layers([1.0], [1], 1.0, margin=0.0, prefetch_layers=depth)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, "all", "AUTO", True, 1.5, [1]])
def test_bad_offload_layers_raise_at_construction(value: Any) -> None:
    model = Stack(n_layers=2)
    with pytest.raises(OffloadError, match="offload_layers") as info:
        ActivationOffloader(model.layers, OffloadConfig(offload_layers=value, force=True))
    assert isinstance(info.value, ValueError)


def _saved_storages(model: Stack, x: torch.Tensor) -> dict[tuple[int, int], int]:
    """Independent count: ``(layer, storage ptr) -> bytes`` of the non-parameter storages each layer saves (a plain
    saved_tensors_hooks pass over one forward and backward)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[tuple[int, int], int] = {}
    current: list[int | None] = [None]
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
        for i, layer in enumerate(model.layers)
    ] + [layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)) for layer in model.layers]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if current[0] is not None and s.data_ptr() not in params:
            seen[(current[0], s.data_ptr())] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).square().mean().backward()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    return seen


def _saved_bytes_per_layer(model: Stack, x: torch.Tensor) -> list[int]:
    seen = _saved_storages(model, x)
    return [sum(n for (i, _), n in seen.items() if i == layer) for layer in range(len(model.layers))]


@pytest.mark.parametrize("n_layers", [1, 4, 5])
@pytest.mark.parametrize("keep", [0, 1])
def test_offload_layers_n_offloads_exactly_the_first_n_and_keeps_gradients(n_layers: int, keep: int) -> None:
    x = torch.randn(3, 7, 8, generator=torch.Generator().manual_seed(n_layers))
    ref, _ = _pair(11, n_layers=n_layers)
    per_layer = _saved_bytes_per_layer(copy.deepcopy(ref), x)
    assert all(b > 0 for b in per_layer)
    for n in sorted({0, 1, 2, n_layers - 1, n_layers, n_layers + 3}):
        ref, model = _pair(11, n_layers=n_layers)
        off = ActivationOffloader(
            model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=keep, force=True, offload_layers=n)
        )
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
            chosen = min(n, n_layers - keep)
            stats = off.stats
            assert stats["offload_layers"] == chosen
            assert stats["offloaded_bytes"] == sum(per_layer[:chosen]), (n, per_layer)
            assert stats["checked_out"] == 0 and stats["lazy_reloads"] == 0
            assert (stats["prefetch_hits"] > 0) == (chosen > 0)
        off.close()


def test_offload_layers_none_is_all_but_keep_last() -> None:
    x = torch.randn(2, 5, 8)
    ref, model = _pair(5, n_layers=4)
    per_layer = _saved_bytes_per_layer(ref, x)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True))
    _step(model, x, off)
    assert off.stats["offload_layers"] == 3 and off.stats["offloaded_bytes"] == sum(per_layer[:3])
    off.close()


# Infinite bandwidth: 3 of 4 layers are eligible (keep_last_layers=1), but layer 2's prefetch would be issued when
# layer 3 starts its backward, before anything is freed, so the memory rule stops at 2.
@pytest.mark.parametrize(("bandwidth", "expected"), [(1e30, 2), (1e-30, 0)])
def test_auto_measures_first_step_then_offloads_the_planned_prefix(
    monkeypatch: pytest.MonkeyPatch, bandwidth: float, expected: int
) -> None:
    # The probe's bandwidth decides: practically infinite -> every eligible layer; practically zero -> none.
    monkeypatch.setattr(_Copier, "bandwidth", lambda self, nbytes, host: bandwidth)
    x = torch.randn(2, 5, 8)
    ref, model = _pair(7, n_layers=4)
    per_layer = _saved_bytes_per_layer(copy.deepcopy(ref), x)
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True, offload_layers="auto")
    )
    assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
    first = off.stats
    assert first["offloaded_bytes"] == 0 and first["checked_out"] == 0  # step 1 only measures
    assert first["offload_layers"] == expected  # the plan is in place once step 1 has ended
    plan = off.auto_plan
    assert plan is not None and plan["bytes_per_layer"] == per_layer and plan["offload_layers"] == expected
    assert len(plan["compute_ms"]) == 4 and all(ms > 0 for ms in plan["compute_ms"])
    assert len(plan["backward_ms"]) == 4 and all(ms > 0 for ms in plan["backward_ms"])  # measured, not estimated
    assert plan["prefetch_layers"] == off.prefetch_layers >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # sized after step 2: no growth after that
        pool_sizes = []
        for _ in range(4):
            assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
            stats = off.stats
            assert stats["offload_layers"] == expected and stats["offloaded_bytes"] == sum(per_layer[:expected])
            assert stats["lazy_reloads"] == 0 and stats["checked_out"] == 0
            pool_sizes.append(stats["pool_bytes"])
    assert len(set(pool_sizes)) == 1 and stats["pool_grow_events"] == 0
    # the device buffer sets were used in backward and dropped with the step: no memory held between steps
    assert (stats["device_set_bytes"] > 0) == (expected > 0) and off.reloader.sets_held() == []
    off.close()


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_auto_partial_layer_offloads_up_to_its_budget(monkeypatch: pytest.MonkeyPatch, fraction: float) -> None:
    """The plan's partial layer offloads its first saved storages up to the budget and keeps the rest."""
    x = torch.randn(2, 5, 8)
    ref, model = _pair(9, n_layers=4)
    per_layer = _saved_bytes_per_layer(copy.deepcopy(ref), x)
    budget = int(per_layer[1] * fraction)
    monkeypatch.setattr(offloader_module, "plan_offload", lambda *a, **k: (1, 1))
    monkeypatch.setattr(offloader_module, "plan_partial_bytes", lambda *a, **k: budget)
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True, offload_layers="auto")
    )
    for step in range(3):
        assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
        stats = off.stats
        assert stats["checked_out"] == 0 and stats["lazy_reloads"] == 0
        if step == 0:
            assert stats["offloaded_bytes"] == 0  # measuring
            continue
        assert stats["offload_layers"] == 1 and stats["partial_offload_bytes"] == budget
        extra = stats["offloaded_bytes"] - per_layer[0]
        assert 0 < extra <= budget
        assert (extra == per_layer[1]) == (fraction == 1.0)
    assert off.auto_plan is not None and off.auto_plan["partial_bytes"] == budget
    off.close()


def _device_sets_peak(layers: nn.ModuleList, x: torch.Tensor, budget: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """Most device-set bytes the offloader references when a layer's backward starts (plan: 3 layers + budget)."""
    monkeypatch.setattr(offloader_module, "plan_offload", lambda *a, **k: (3, 1))
    monkeypatch.setattr(offloader_module, "plan_partial_bytes", lambda *a, **k: budget)
    off = ActivationOffloader(
        layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True, offload_layers="auto")
    )
    seen: list[int] = []
    begins = off._backward_begins

    def record(index: int) -> None:
        begins(index)
        # distinct device buffers: the sets and every block's view of one
        bufs = {id(t): t.numel() for t in off.reloader.sets_held()}
        bufs.update(
            {id(b.flat): b.flat.numel() for seg in off.calls.segments for b in seg.blocks if b.flat is not None}
        )
        seen.append(sum(bufs.values()))

    monkeypatch.setattr(off, "_backward_begins", record)
    for _ in range(2):  # measuring step, then the plan
        seen.clear()
        with off:
            h = x.clone().requires_grad_()
            for layer in layers:
                h = layer(h)
            h.sum().backward()
    off.close()
    return max(seen)


def test_partial_layer_device_sets_hold_no_more_than_whole_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A partial layer is prefetched first, into a smaller set; when that set grows, the old buffer goes at once."""
    torch.manual_seed(0)
    layers = nn.ModuleList(Block(32) for _ in range(6))
    x = torch.randn(64, 32)
    whole = _device_sets_peak(layers, x, 0, monkeypatch)  # two sets (depth 1) of one layer each
    assert whole > 0
    for budget in (20_000, 1 << 40):  # part of layer 3, and all of it
        assert _device_sets_peak(layers, x, budget, monkeypatch) == whole, budget


@pytest.mark.parametrize("recompute", [None, "selective"])
def test_partial_layer_only_without_recompute(monkeypatch: pytest.MonkeyPatch, recompute: str | None) -> None:
    """With recomputation, layer N recomputes (keeping what a partial budget leaves would hold more)."""
    monkeypatch.setattr(offloader_module, "plan_offload", lambda *a, **k: (1, 1))
    monkeypatch.setattr(offloader_module, "plan_partial_bytes", lambda *a, **k: 1_000)
    _, model = _pair(3, n_layers=4)
    off = ActivationOffloader(
        model.layers,
        OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True, offload_layers="auto", recompute=recompute),
    )
    for _ in range(2):
        _step(model, torch.randn(2, 5, 8), off)
    stats = off.stats
    assert stats["offload_layers"] == 1
    assert (stats["partial_offload_bytes"], stats["recompute_layers"]) == ((1_000, 0) if recompute is None else (0, 3))
    off.close()


def test_auto_with_measured_cpu_bandwidth_keeps_reference_gradients_bit_identical() -> None:
    # The whole "auto" path unpatched: perf_counter layer times and a measured memcpy bandwidth.
    seq_lens = [17, 1, 31]
    expected = _train(_reference(n_layers=3), 3, None, seq_lens)
    model = _reference(n_layers=3)
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True, offload_layers="auto")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # step 3 is the longest sequence: the pool may grow once
        got = _train(model, 3, off, seq_lens)
    for (g_ref, _), (g_off, stats) in zip(expected, got):
        assert all(torch.equal(a, b) for a, b in zip(g_ref, g_off))
        assert stats["checked_out"] == 0 and stats["lazy_reloads"] == 0
    plan = off.auto_plan
    assert plan is not None and plan["bandwidth_bytes_per_ms"] > 0 and all(b > 0 for b in plan["bytes_per_layer"])
    assert 0 <= got[-1][1]["offload_layers"] == plan["offload_layers"] <= 2
    assert (got[-1][1]["offloaded_bytes"] > 0) == (plan["offload_layers"] > 0)
    off.close()


def test_auto_adds_no_host_syncs_in_measuring_or_planned_steps() -> None:
    _, model = _pair(6, n_layers=3)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True, offload_layers=2))
    auto = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True, offload_layers="auto"))
    x = torch.randn(2, 4, 8)
    for offloader in (off, auto, auto):  # fixed N; "auto" measuring step; "auto" planned step
        with SyncCounter() as counter, offloader:
            model(x).sum().backward()
        assert counter.num_syncs == 0, counter.syncs
    assert off.stats["offloaded_tensors"] > 0 and auto.auto_plan is not None
    off.close()
    auto.close()


def test_auto_measuring_step_without_saved_tensors_or_backward_is_measured_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A first step under no_grad (an evaluation pass) or without backward measures no backward to plan from;
    planning from it offloaded every eligible layer, past the memory rule that a real measuring step applies."""
    monkeypatch.setattr(_Copier, "bandwidth", lambda self, nbytes, host: 1e30)
    model = Stack(n_layers=3)
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True, offload_layers="auto")
    )
    with off, torch.no_grad():
        model(torch.randn(2, 8))
    with off:
        model(torch.randn(2, 8))  # forward only: no backward measured
    assert off.auto_plan is None and off.stats["offload_layers"] == 0
    _step(model, torch.randn(2, 8), off)
    # as after a real measuring step: the memory rule keeps layer 1 (see the test below)
    assert off.auto_plan is not None and off.auto_plan["bytes_per_layer"][0] > 0 and off.stats["offload_layers"] == 1
    off.close()


def test_auto_measuring_step_that_fails_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Copier, "bandwidth", lambda self, nbytes, host: 1e30)
    model = Stack(n_layers=3)
    off = ActivationOffloader(
        model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True, offload_layers="auto")
    )
    with pytest.raises(RuntimeError, match="boom"), off:
        model(torch.randn(2, 8))
        raise RuntimeError("boom")
    assert off.auto_plan is None and off.stats["offload_layers"] == 0
    _step(model, torch.randn(2, 8), off)
    # 2 eligible; the memory rule keeps layer 1 (its prefetch would come before anything is freed)
    assert off.auto_plan is not None and off.stats["offload_layers"] == 1
    off.close()


# ---------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (copy streams, pinned memory)")
def test_cuda_streams_gradients_match_and_pool_is_pinned() -> None:
    model = _reference(n_layers=4).cuda()
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1))

    def grads(ids: torch.Tensor, offloader: ActivationOffloader | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with offloader if offloader is not None else torch.enable_grad():
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, cache_enabled=False):  # as "bf16-mixed"
                logits = model(ids).float()
                loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    g = torch.Generator().manual_seed(3)
    for seq_len in (64, 1, 37, 64):  # varying sizes: pool by size class, sets grow
        ids = torch.randint(0, VOCAB, (2, seq_len), generator=g).cuda()
        plain, again, offloaded = grads(ids, None), grads(ids, None), grads(ids, off)
        deterministic = all(torch.equal(a, b) for a, b in zip(plain, again))
        for a, b in zip(plain, offloaded):
            if deterministic:  # bit-identical wherever the model's own kernels are
                assert torch.equal(a, b)
            else:  # atomics in some backward kernels: compare to the run-to-run noise level
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
        stats = off.stats
        assert stats["offloaded_tensors"] > 0 and stats["lazy_reloads"] == 0 and stats["pinned"]
        assert stats["recast_casts"] > 0 and stats["kept_casts"] == 0  # weight copies rebuilt, not kept
    off.synchronize()
    assert off.stats["checked_out"] == 0
    off.close()


def _bf16_loss(model: nn.Module, x: torch.Tensor, cache: bool = False) -> torch.Tensor:
    """Forward and loss under CPU bf16 autocast (by default without its cache, as Lightning's "bf16-mixed")."""
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
        return model(x).float().square().mean()


def _autocast_grads(model: nn.Module, x: torch.Tensor, off: ActivationOffloader | None, cache: bool) -> list[Any]:
    """One step under CPU bf16 autocast; backward outside the autocast region, as Lightning's precision plugin does."""
    model.zero_grad(set_to_none=True)
    with off if off is not None else torch.enable_grad():
        _bf16_loss(model, x, cache).backward()
    return _grads(model)


def test_autocast_cached_weight_copies_stay_on_the_device_and_gradients_match() -> None:
    """Autocast's cache holds its bf16 copies of the weights for the whole forward: moving them would free nothing."""
    ref, model = _pair(13, n_layers=3)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True))
    x = torch.randn(2, 5, 8)
    expected, got = _autocast_grads(ref, x, None, True), _autocast_grads(model, x, off, True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    stats = off.stats
    # three blocks, two Linear weights each: both casts are saved (by the matmul) and kept
    assert stats["kept_casts"] == 6 and stats["recast_casts"] == 0 and stats["offloaded_tensors"] > 0
    off.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_uncached_weight_copies_are_rebuilt_in_backward_bit_identically(seed: int) -> None:
    """Lightning's autocast has no cache: the saved bf16 weight copy is the only reference and is rebuilt instead."""
    ref, model = _pair(seed, n_layers=3)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True))
    for step in range(2):
        x = torch.randn(3, 7, 8, generator=torch.Generator().manual_seed(seed + step))
        expected, got = _autocast_grads(ref, x, None, False), _autocast_grads(model, x, off, False)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
        stats = off.stats
        # every block (offloading or not) saves both of its weights' bf16 copies once: 2 bytes per element
        weights = [w for blk in model.layers for w in (blk.up.weight, blk.down.weight)]
        assert stats["recast_casts"] == 6 and stats["kept_casts"] == 0
        assert stats["recast_bytes"] == sum(2 * w.numel() for w in weights)
        assert stats["offloaded_tensors"] > 0 and stats["checked_out"] == 0
    off.close()


class _TrackWeightCasts(TorchDispatchMode):
    """Weak references to every 2-D bf16 ``_to_copy`` output (the weights' casts: activations are 3-D here)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16 and out.dim() == 2:
            self.refs.append(weakref.ref(out.untyped_storage()))  # the memory, whichever tensor object holds it
        return out


@pytest.mark.parametrize("offload", [False, True])
def test_uncached_weight_copies_are_freed_after_forward(offload: bool) -> None:
    """Without the cache only the saved copy keeps a bf16 weight alive: under the offloader, nothing does, even in
    layers that do not offload."""
    _, model = _pair(2, n_layers=2)
    off = None
    if offload:
        off = ActivationOffloader(
            model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True, offload_layers=0)
        )
    track = _TrackWeightCasts()
    with off if off is not None else torch.enable_grad():
        with track, torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            loss = model(torch.randn(2, 5, 8)).float().square().mean()
        alive = sum(ref() is not None for ref in track.refs)
        loss.backward()
    # embed and head (outside the layers), two weights per block; the embed's input needs no grad, so autograd does
    # not save its weight's copy, and the head's is always kept
    assert len(track.refs) == 2 + 4
    assert alive == (1 if offload else 5)
    if off is not None:
        assert off.stats["recast_casts"] == 4 and off.stats["offloaded_tensors"] == 0
        off.close()


class _ChannelsLastBlock(nn.Module):
    """Uses a bf16 copy of its weight in another memory format: a copy that ``param.to(dtype)`` would not rebuild."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 3, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(torch.bfloat16, memory_format=torch.channels_last)
        return x + (x.to(torch.bfloat16) * w).float()  # mul saves the copy itself


def test_weight_copy_in_another_memory_format_is_offloaded_not_rebuilt() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(*(_ChannelsLastBlock() for _ in range(3)))
    model = copy.deepcopy(ref)
    off = ActivationOffloader(list(model), OffloadConfig(min_offload_bytes=0, keep_last_layers=1, force=True))
    x = torch.randn(2, 3, 4, 4)
    assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
    stats = off.stats
    assert stats["recast_casts"] == 0 and stats["offloaded_tensors"] >= 2  # both offloading blocks' copies move
    off.close()


class _ComplexViewBlock(nn.Module):
    """Saves a reinterpreting view (``view_as_complex``) of its weight's copy, which ``as_strided`` cannot rebuild."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (64, 2) float64 pairs as complex numbers; mul saves the complex view of the weight's float64 copy
        return torch.view_as_real(torch.view_as_complex(x) * torch.view_as_complex(self.weight.to(torch.float64)))


def test_reinterpreting_view_of_a_weight_copy_is_not_rebuilt() -> None:
    torch.manual_seed(1)
    ref = nn.Sequential(_ComplexViewBlock(), _ComplexViewBlock())
    model = copy.deepcopy(ref)
    off = ActivationOffloader(
        list(model), OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True, offload_layers=0)
    )
    x = torch.randn(64, 2, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
    assert off.stats["recast_casts"] == 0
    off.close()


class _NormCopyBlock(nn.Module):
    """An RMSNorm whose output reaches a matmul as a bf16 copy (as is, reshaped, or transposed) or itself."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.norm = nn.Parameter(torch.rand(8) + 0.5)
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 8, 8)
        y = rms_norm(x, self.norm, 1e-5)
        if self.how == "reshape":
            h = y.reshape(-1, 8).to(torch.bfloat16)
        elif self.how == "transpose":  # a contiguous copy of a transpose: a recipe would need the transpose back
            h = y.transpose(1, 2).to(torch.bfloat16, memory_format=torch.contiguous_format)
        elif self.how == "float32":  # no copy: the matmul saves the norm's output itself
            return x + y @ self.weight
        else:
            h = y.to(torch.bfloat16)
        out = (h @ self.weight.to(torch.bfloat16)).float()  # the matmul saves h
        out = out.transpose(1, 2) if self.how == "transpose" else out
        return x + out.reshape(x.shape)


@pytest.mark.parametrize(("how", "rebuilt"), [("copy", 2), ("reshape", 2), ("transpose", 0), ("float32", 2)])
def test_norm_outputs_and_their_copies_are_rebuilt_bit_identically(how: str, rebuilt: int) -> None:
    """A matmul's saved RMSNorm output, or its bf16 copy (also of a reshape), is rebuilt from the norm's saved input;
    a copy of a transpose is not (rebuilding it in row-major order would give other values)."""
    torch.manual_seed(4)
    ref = nn.Sequential(*(_NormCopyBlock(how) for _ in range(2)))
    model = copy.deepcopy(ref)
    off = ActivationOffloader(
        list(model), OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True, offload_layers=0)
    )
    x = torch.randn(3, 8, 8)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(_step(ref, x), _step(model, x, off)))
        assert off.stats["rebuilt_tensors"] == rebuilt
    off.close()


class _SavesItsOutput(torch.autograd.Function):
    """Breaks the ``llmfast_rebuild`` contract: it saves the very output it claims to rebuild."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.exp()
        ctx.save_for_backward(y)
        mark_rebuildable(ctx, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * y

    @staticmethod
    def llmfast_rebuild(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        return y


def test_rebuild_of_a_function_that_saves_its_output_raises_instead_of_recursing() -> None:
    block = nn.Linear(4, 4)
    block.forward = lambda x: _SavesItsOutput.apply(x * block.weight[0])
    off = ActivationOffloader(
        [block], OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True, offload_layers=0)
    )
    with pytest.raises(OffloadError, match="saves its own output"):
        with off:
            block(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert off.stats["checked_out"] == 0
    off.close()


def test_parameter_modified_between_forward_and_backward_raises() -> None:
    _, model = _pair(3, n_layers=2)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True))
    x = torch.randn(2, 5, 8)
    with pytest.raises(OffloadError, match="modified in place"):
        with off:
            loss = _bf16_loss(model, x)
            with torch.no_grad():
                model.layers[0].up.weight.mul_(2)  # an optimizer step before backward
            loss.backward()
    assert off.stats["checked_out"] == 0
    off.close()


def test_rebuilt_weight_copies_support_double_backward() -> None:
    ref, model = _pair(5, n_layers=2)
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True))
    x = torch.randn(2, 5, 8)
    results = []
    for m, o in ((ref, None), (model, off)):
        with o if o is not None else torch.enable_grad():
            loss = _bf16_loss(m, x)
            (g,) = torch.autograd.grad(loss, [m.layers[0].up.weight], create_graph=True)
            (gg,) = torch.autograd.grad(g.float().square().sum(), [m.layers[1].down.weight])
        results.append((g.detach(), gg))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    off.close()
