"""Communication: compressed gradient reduction (DDP hooks, FSDP2 reduce dtype), quantized expert-parallel payloads
(:class:`DispatchPayload`, :mod:`~lightning_llmfast.comm.payload`) and timers that never sync the step.

Plain PyTorch (no Lightning): :class:`GradReduction` registers torch's bf16 or PowerSGD communication hook and counts
the bytes it sends; :class:`SpanTimer` / :class:`BusyTimer` time gradient reduction and device busy time from stamps
read only once they completed.

Example::

    from lightning_llmfast.comm import GradReduction

    GradReduction(reduce_dtype=torch.bfloat16).register(ddp_model)
"""

from __future__ import annotations

from lightning_llmfast.comm.grad import GRAD_REDUCE_DTYPES, GradReduction, PowerSGDConfig, with_reduce_dtype
from lightning_llmfast.comm.payload import DispatchPayload
from lightning_llmfast.comm.timing import BusyTimer, Clock, EventClock, HostClock, SpanTimer, clock_for

__all__ = [
    "GRAD_REDUCE_DTYPES",
    "BusyTimer",
    "Clock",
    "DispatchPayload",
    "EventClock",
    "GradReduction",
    "HostClock",
    "PowerSGDConfig",
    "SpanTimer",
    "clock_for",
    "with_reduce_dtype",
]
