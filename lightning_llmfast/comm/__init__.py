"""Communication: compressed gradient reduction (DDP hooks, FSDP2 reduce dtype) and timers that never sync the step.

The expert-parallel payloads (``DispatchPayload``) live in :mod:`lightning_llmfast.expert_parallel`; the name here is a
deprecated alias.

Plain PyTorch (no Lightning): :class:`GradReduction` registers torch's bf16 or PowerSGD communication hook and counts
the bytes it sends; :class:`SpanTimer` / :class:`BusyTimer` time gradient reduction and device busy time from stamps
read only once they completed.

Example::

    from lightning_llmfast.comm import GradReduction

    GradReduction(reduce_dtype=torch.bfloat16).register(ddp_model)
"""

from __future__ import annotations

from lightning_llmfast._lazy import lazy_getattr
from lightning_llmfast.comm.grad import GRAD_REDUCE_DTYPES, GradReduction, PowerSGDConfig, with_reduce_dtype
from lightning_llmfast.comm.timing import BusyTimer, Clock, EventClock, HostClock, SpanTimer, clock_for

__all__ = [
    "GRAD_REDUCE_DTYPES",
    "BusyTimer",
    "Clock",
    "EventClock",
    "GradReduction",
    "HostClock",
    "PowerSGDConfig",
    "SpanTimer",
    "clock_for",
    "with_reduce_dtype",
]

# Deprecated: DispatchPayload moved to lightning_llmfast.expert_parallel.
__getattr__ = lazy_getattr(__name__, {}, moved={"DispatchPayload": "lightning_llmfast.expert_parallel"})
