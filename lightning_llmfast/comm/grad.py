"""Compressed gradient reduction on torch's own engines: DDP communication hooks and FSDP2's ``reduce_dtype``.

:class:`GradReduction` is what ``LLMFastStrategy(grad_reduce_dtype=..., grad_compression=...)`` holds. Under DDP it
registers one communication hook: torch's ``bf16_compress_hook`` (gradients cast to bf16, averaged, cast back), or
torch's ``powerSGD_hook`` (rank-``r`` factors with error feedback and warm start), or, when only the gradient-sync
time is wanted, torch's ``allreduce_hook``. Around whichever runs it counts the bytes each bucket puts on the wire
(:attr:`GradReduction.wire_bytes`) and, on request, times the step's reduction (:attr:`GradReduction.timer`).
Under FSDP2 the dtype goes into ``MixedPrecisionPolicy.reduce_dtype`` (:func:`with_reduce_dtype`).

PowerSGD's state (error feedback, warm-start factors, iteration, random generator) is per rank;
:meth:`GradReduction.state_dict` returns this rank's as plain tensors and numbers, and a restored state is
applied when the hook is registered. Its tensors are keyed by DDP bucket index and follow the buckets' parameters
when DDP's layout changes (:class:`~lightning_llmfast.comm.powersgd.BucketLayouts`), as it does in a resumed process.

Example::

    reduction = GradReduction(reduce_dtype=torch.bfloat16)
    reduction.register(ddp_model)  # once, after wrapping, before the first backward
    reduction.wire_bytes  # bytes all-reduced in the last step: half of fp32's
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.comm.powersgd import BucketLayouts
from lightning_llmfast.comm.timing import Clock, SpanTimer
from lightning_llmfast.errors import ConfigError

__all__ = [
    "GRAD_REDUCE_DTYPES",
    "STATE_KEY",
    "GradReduction",
    "PowerSGDConfig",
    "check_ddp_arguments",
    "with_reduce_dtype",
]

GRAD_REDUCE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16}
"""``grad_reduce_dtype`` names and the dtype gradients travel in."""

STATE_KEY = "grad_compression_states"
"""The checkpoint entry holding every rank's PowerSGD state, in rank order."""

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass(frozen=True)
class PowerSGDConfig:
    """Settings of torch's PowerSGD hook (``grad_compression="powersgd"`` is ``PowerSGDConfig()``).

    Args:
        rank: the rank of the low-rank factors (``matrix_approximation_rank``).
        start_iter: plain all-reduce before this many steps (at least 2: error feedback and warm start need it).
        min_compression_rate: a tensor is compressed only if this saves at least this factor.
        seed: seed of the random initial factors (the same on every rank).

    Raises:
        ConfigError: ``rank`` or ``seed`` not an int >= 1 / >= 0, ``start_iter`` not an int >= 2,
            ``min_compression_rate`` not a number >= 1.

    Example::

        LLMFastStrategy(grad_compression=PowerSGDConfig(rank=4, start_iter=10))
    """

    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("PowerSGDConfig.rank", self.rank, low=1)
        check_int("PowerSGDConfig.start_iter", self.start_iter, low=2)
        check_number("PowerSGDConfig.min_compression_rate", self.min_compression_rate, low=1)
        check_int("PowerSGDConfig.seed", self.seed, low=0)


def with_reduce_dtype(policy: MixedPrecisionPolicy | None, dtype: torch.dtype | None) -> MixedPrecisionPolicy | None:
    """FSDP2's policy with gradients reduce-scattered in ``dtype`` (``policy`` itself when ``dtype`` is ``None``)."""
    if dtype is None:
        return policy
    return MixedPrecisionPolicy(reduce_dtype=dtype) if policy is None else replace(policy, reduce_dtype=dtype)


class GradReduction:
    """How gradients are reduced: the dtype on the wire or PowerSGD, with bytes counted and time measured.

    Args:
        reduce_dtype: the dtype gradients are all-reduced in (``None``: their own).
        powersgd: PowerSGD settings, or ``None``.

    Raises:
        ConfigError: both given (PowerSGD already sends low-rank fp32 factors).

    Example::

        reduction = GradReduction.from_args("bf16", None, owner="LLMFastStrategy")
    """

    def __init__(self, reduce_dtype: torch.dtype | None = None, powersgd: PowerSGDConfig | None = None) -> None:
        if reduce_dtype is not None and powersgd is not None:
            raise ConfigError("grad_reduce_dtype and grad_compression='powersgd' cannot be combined; choose one")
        self.reduce_dtype = reduce_dtype
        self.powersgd = powersgd
        self.timer: SpanTimer | None = None
        """Times each step's reduction once :meth:`time_with` was called (read with ``timer.read_ms()``)."""
        self.wire_bytes = 0
        """Bytes the last step's buckets all-reduced (host count, every rank the same)."""
        self._step_bytes = 0
        self._state: Any = None
        self._device = torch.device("cpu")
        self._pending_state: dict[str, Any] | None = None
        self._layouts: BucketLayouts | None = None

    @classmethod
    def from_args(cls, grad_reduce_dtype: object, grad_compression: object, *, owner: str) -> GradReduction:
        """Validate the strategy's arguments (``None``/``"bf16"``; ``None``/``"powersgd"``/:class:`PowerSGDConfig`)."""
        if grad_reduce_dtype is not None and grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ConfigError(f"{owner}: grad_reduce_dtype must be None or one of {sorted(GRAD_REDUCE_DTYPES)}, "
                              f"got {grad_reduce_dtype!r}")  # fmt: skip
        if grad_compression == "powersgd":
            grad_compression = PowerSGDConfig()
        if grad_compression is not None and not isinstance(grad_compression, PowerSGDConfig):
            raise ConfigError(f"{owner}: grad_compression must be None, 'powersgd' or a PowerSGDConfig, "
                              f"got {grad_compression!r}")  # fmt: skip
        dtype = GRAD_REDUCE_DTYPES[grad_reduce_dtype] if grad_reduce_dtype is not None else None
        try:
            return cls(dtype, grad_compression)
        except ConfigError as err:
            raise ConfigError(f"{owner}: {err}") from err

    @property
    def compresses(self) -> bool:
        """Whether a dtype or PowerSGD was asked for."""
        return self.reduce_dtype is not None or self.powersgd is not None

    def time_with(self, clock: Clock) -> SpanTimer:
        """Time every step's reduction with ``clock`` (call before :meth:`register`); returns the timer."""
        if self.timer is None:
            self.timer = SpanTimer(clock)
        return self.timer

    def register(self, model: DistributedDataParallel) -> bool:
        """Register the hook on a DDP model if there is anything to do; returns whether one was registered."""
        if not self.compresses and self.timer is None:
            return False
        group = model.process_group
        self._device = next(model.parameters()).device
        if self.powersgd is not None:
            cfg = self.powersgd
            self._state = PowerSGDState(
                group, matrix_approximation_rank=cfg.rank, start_powerSGD_iter=cfg.start_iter,
                min_compression_rate=cfg.min_compression_rate, random_seed=cfg.seed,
            )  # fmt: skip
            layouts = self._layouts = BucketLayouts(model.parameters())

            def inner(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                layouts.follow(state, bucket)
                return powerSGD_hook(state, bucket)

            if self._pending_state is not None:
                self._restore(self._pending_state)
        else:
            self._state = group
            inner = default_hooks.bf16_compress_hook if self.reduce_dtype is not None else default_hooks.allreduce_hook
        model.register_comm_hook(self._state, self._hook(inner))
        return True

    def _hook(self, inner: Hook) -> Hook:
        # Unannotated: DDP checks a hook's annotations against the real classes, and these would be strings here.
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            last = bucket.is_last()
            span = self.timer.begin(last) if self.timer is not None else None
            sent_before = self._sent_elements()
            future = inner(state, bucket)
            self._count(bucket, sent_before, last)
            if span is None:
                return future
            timer = self.timer

            def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                timer.end(span)
                return fut.value()

            return future.then(done)

        return hook

    def _sent_elements(self) -> int | None:
        """PowerSGD's own count of elements it sent compressed (``None`` before it starts compressing)."""
        state = self._state
        if isinstance(state, PowerSGDState) and state.iter >= state.start_powerSGD_iter:
            return state.total_numel_after_compression
        return None

    def _count(self, bucket: dist.GradBucket, sent_before: int | None, last: bool) -> None:
        buffer = bucket.buffer()
        if sent_before is not None:  # PowerSGD: its factors and the tensors it left uncompressed
            sent = (self._state.total_numel_after_compression - sent_before) * buffer.element_size()
        else:
            sent = buffer.numel() * (self.reduce_dtype or buffer.dtype).itemsize
        self._step_bytes += sent
        if last:
            self.wire_bytes, self._step_bytes = self._step_bytes, 0

    # ------------------------------------------------------------------ PowerSGD state
    def state_dict(self) -> dict[str, Any]:
        """This rank's PowerSGD state as CPU tensors and numbers (empty without PowerSGD or before registering)."""
        state = self._state
        if not isinstance(state, PowerSGDState):
            return dict(self._pending_state or {})
        _, keys, pos, has_gauss, cached = state.rng.get_state()
        memories = {name: getattr(state, name) for name in ("error_dict", "p_memory_dict", "q_memory_dict")}
        return {
            **{name: {k: v.detach().cpu().clone() for k, v in d.items()} for name, d in memories.items()},
            "iter": state.iter,
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": pos,
                "has_gauss": has_gauss,
                "cached_gaussian": cached,
            },
            "numel": [state.total_numel_before_compression, state.total_numel_after_compression],
            "layouts": self._layouts.state_dict() if self._layouts is not None else {},
        }

    def gather_states(self) -> dict[str, list[dict[str, Any]]]:
        """Every rank's :meth:`state_dict` under :data:`STATE_KEY` (a collective when a process group is up; call it
        on every rank), or ``{}`` without PowerSGD."""
        if self.powersgd is None:
            return {}
        states: list[Any] = [self.state_dict()]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, self.state_dict())
        return {STATE_KEY: states}

    def load_gathered_states(self, checkpoint: Mapping[str, Any], rank: int, world_size: int) -> None:
        """Restore this rank's state from a checkpoint written with :meth:`gather_states` (a no-op without one)."""
        states = checkpoint.get(STATE_KEY)
        if self.powersgd is None or states is None:
            return
        if len(states) != world_size:
            warnings.warn(f"the checkpoint's PowerSGD state is for {len(states)} ranks, not {world_size}; "
                          "PowerSGD starts afresh", stacklevel=2)  # fmt: skip
            return
        self.load_state_dict(states[rank])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; applied when the hook is registered if that has not happened yet."""
        if isinstance(self._state, PowerSGDState):
            self._restore(state)
        else:
            self._pending_state = dict(state)

    def _restore(self, saved: dict[str, Any]) -> None:
        state, device = self._state, self._device
        for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
            setattr(state, name, {int(k): v.to(device) for k, v in saved[name].items()})
        state.iter = saved["iter"]
        rng = saved["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        state.rng.set_state(("MT19937", keys, rng["pos"], rng["has_gauss"], rng["cached_gaussian"]))
        state.total_numel_before_compression, state.total_numel_after_compression = saved["numel"]
        if self._layouts is not None:
            self._layouts.load_state_dict(saved["layouts"])
        self._pending_state = None


def check_ddp_arguments(reduction: GradReduction, sharding: str, ddp_kwargs: dict[str, Any], owner: str) -> None:
    """Check a strategy's sharding and DDP keyword arguments against ``reduction``.

    Raises:
        ConfigError: PowerSGD with ``sharding="fsdp"`` (it is a DDP hook), a compression together with the user's
            own ``ddp_comm_hook`` (DDP takes one hook).
    """
    if reduction.powersgd is not None and sharding != "ddp":
        raise ConfigError(f"{owner}: grad_compression='powersgd' is a DDP communication hook; use sharding='ddp'")
    if reduction.compresses and ddp_kwargs.get("ddp_comm_hook") is not None:
        raise ConfigError(f"{owner}: grad_reduce_dtype/grad_compression register their own DDP communication hook; "
                          "drop ddp_comm_hook or the compression")  # fmt: skip
