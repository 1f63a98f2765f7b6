"""Quantized all-to-all payloads of expert parallelism: rows sent in bf16 or fp8 (e4m3, one scale per row).

The fp8 layout is the one DeepEP and Megatron-Core use: each row ``x`` is sent as ``q = e4m3(x / s)`` with the row's
scale ``s = max|x| / 448`` (448 is e4m3's largest finite value), and received as ``q * s``. Here the fp32 scale
travels in the same message, as 4 more bytes at the end of the row (``H + 4`` bytes a row against bf16's ``2 H``),
so one ``all_to_all_single`` moves both. Rounding: e4m3 keeps 3 mantissa bits, so every element comes back within
``max(2**-4 * |x|, 2**-10 * s)`` of what was sent (half a unit in the last place; the second term covers e4m3's
subnormals); bf16 within ``2**-8 * |x|``.

:func:`exchange` is the differentiable exchange: the forward sends ``wire``, the backward sends the gradient back by
the reverse exchange in ``grad_wire`` (quantization is treated as the identity in the gradient, the usual
straight-through choice). Nothing reads a device value on the host.

:func:`start_exchange` and :meth:`PendingExchange.finish` are the same exchange in two halves, so that work runs
while it is in flight: the forward issues it in ``start_exchange`` and waits in ``finish``; the backward issues the
gradient's reverse exchange in ``finish``'s backward and waits for it in ``start_exchange``'s, so that the backward
of whatever ran between the two halves in the forward runs while the gradient is in flight. Every rank must start
and finish its exchanges in the same order (the autograd engine replays a graph of the same shape in the same order).
:func:`start_route` does the same for any :class:`Route` (several tensors each way, several exchanges in a row:
the hierarchical dispatch's two hops); :func:`start_exchange` is its one-exchange case.

Example::

    received = exchange(rows, out_splits, in_splits, group, wire="fp8", grad_wire="bf16")
    pending = start_exchange(rows, out_splits, in_splits, group, wire="fp8", grad_wire="bf16")
    ...  # work that does not need the received rows
    received = pending.finish()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llmfast.comm.timing import ExchangeTimer
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel.exchange import InFlight, all_to_all_async

__all__ = [
    "E4M3_MAX",
    "WIRES",
    "DispatchPayload",
    "PendingExchange",
    "Route",
    "dequantize_rows",
    "exchange",
    "exchange_route",
    "quantize_rows",
    "start_exchange",
    "start_route",
    "wire_row_bytes",
]

E4M3_MAX = 448.0
"""The largest finite value of ``torch.float8_e4m3fn``."""

WIRES = ("bf16", "fp8")
"""Payload names: ``None`` (the activations' own dtype) or one of these."""

_SCALE_BYTES = 4


@dataclass(frozen=True)
class DispatchPayload:
    """What expert-parallel exchanges put on the wire.

    Args:
        dispatch: the tokens sent to their experts: ``"bf16"``, ``"fp8"`` (e4m3, one fp32 scale per row) or ``None``
            (their own dtype).
        combine: the expert outputs sent back, and every gradient exchange: ``"bf16"`` or ``None`` (``"fp32"``
            is accepted as a name for ``None``: the activations' own dtype, fp32 in fp32 training). Defaults to
            ``"bf16"`` when ``dispatch`` is set: the outputs are weighted and summed over each token's experts at
            home, in the activations' dtype, so each returned row is rounded once (``2**-8`` of each value) and the
            roundings do not add up; gradients span too wide a range within a row for e4m3 (DeepEP and Megatron-Core
            combine in bf16 too).

    Raises:
        ConfigError: an unknown name, or ``combine="fp8"`` (outputs and gradients are not sent in fp8).

    Example::

        DispatchPayload("fp8")  # fp8 dispatch, bf16 combine and gradients
        DispatchPayload("bf16", combine="fp32")
    """

    dispatch: str | None = None
    combine: str | None = "default"

    def __post_init__(self) -> None:
        if self.dispatch is not None and self.dispatch not in WIRES:
            raise ConfigError(f"dispatch_dtype must be None or one of {WIRES}, got {self.dispatch!r}")
        combine = self.combine
        if combine == "default":
            combine = "bf16" if self.dispatch is not None else None
        elif combine == "fp32":
            combine = None
        if combine not in (None, "bf16"):
            raise ConfigError(f"the combine payload must be None, 'bf16' or 'fp32', got {self.combine!r}")
        object.__setattr__(self, "combine", combine)

    @classmethod
    def of(cls, value: str | DispatchPayload | None) -> DispatchPayload:
        """The payload of a ``dispatch_dtype`` argument: a name (``None``, ``"bf16"``, ``"fp8"``) or a payload.

        Raises:
            ConfigError: anything else, naming the value.

        Example::

            DispatchPayload.of("fp8") == DispatchPayload("fp8")
        """
        if isinstance(value, DispatchPayload):
            return value
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"dispatch_dtype must be None, one of {WIRES} or a DispatchPayload, got {value!r}")
        return cls(value)

    @property
    def code(self) -> int:
        """One integer for both payloads (the ranks of an exchange must agree on it: it fixes the bytes per row)."""
        return (1 + WIRES.index(self.dispatch) if self.dispatch else 0) * 2 + (self.combine == "bf16")


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(q, scale)``: ``x`` ``(R, H)`` as e4m3 with one fp32 scale per row (``max|row| / 448``; 1 for zero rows)."""
    amax = x.detach().abs().amax(dim=1).float() if x.shape[1] else x.new_zeros(x.shape[0], dtype=torch.float32)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (x.float() / scale[:, None]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q * scale`` per row, in ``dtype``."""
    return (q.float() * scale[:, None]).to(dtype)


def wire_row_bytes(wire: str | None, hidden: int, dtype: torch.dtype) -> int:
    """Bytes one row of ``hidden`` values takes on the wire (fp8: its scale included)."""
    if wire == "fp8":
        return hidden + _SCALE_BYTES
    return hidden * (2 if wire == "bf16" else dtype.itemsize)


def _encode(x: Tensor, wire: str | None) -> Tensor:
    if wire == "bf16":
        return x.to(torch.bfloat16)
    if wire == "fp8":
        q, scale = quantize_rows(x)
        return torch.cat([q.view(torch.uint8), scale[:, None].view(torch.uint8)], dim=1)
    return x


def _decode(wire_rows: Tensor, wire: str | None, dtype: torch.dtype) -> Tensor:
    if wire == "fp8":
        hidden = wire_rows.shape[1] - _SCALE_BYTES
        q = wire_rows[:, :hidden].contiguous().view(torch.float8_e4m3fn)
        scale = wire_rows[:, hidden:].contiguous().view(torch.float32).squeeze(1)
        return dequantize_rows(q, scale, dtype)
    return wire_rows.to(dtype)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, splits: tuple[Any, Any], group: Any, wires: tuple[Any, Any], timer: Any) -> Tensor:
        out_splits, in_splits = splits
        ctx.splits, ctx.group, ctx.wire, ctx.dtype, ctx.timer = (in_splits, out_splits), group, wires[1], x.dtype, timer
        sent = all_to_all_async(_encode(x, wires[0]), out_splits, in_splits, group, timer)
        return _decode(sent.wait(), wires[0], x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = all_to_all_async(_encode(grad, ctx.wire), out_splits, in_splits, ctx.group, ctx.timer)
        return _decode(back.wait(), ctx.wire, ctx.dtype), None, None, None, None


def exchange(
    x: Tensor,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    group: dist.ProcessGroup,
    *,
    wire: str | None,
    grad_wire: str | None,
    timer: ExchangeTimer | None = None,
) -> Tensor:
    """``all_to_all_single`` of the rows of ``x`` sent as ``wire``, returned in ``x``'s dtype; differentiable.

    Args:
        x: ``(R, H)`` rows, in send order.
        out_splits: rows received from each rank (``None``: equal).
        in_splits: rows sent to each rank (``None``: equal).
        group: the process group.
        wire: the payload of the forward exchange (``None``, ``"bf16"``, ``"fp8"``).
        grad_wire: the payload of the gradients' reverse exchange (``None`` or ``"bf16"``).
        timer: stamps the exchange and its wait, forward and backward (``comm/a2a_ms``), or ``None``.

    Example::

        recv = exchange(rows, None, None, group, wire="fp8", grad_wire="bf16")  # capacity mode: equal splits
    """
    return _Exchange.apply(x, (out_splits, in_splits), group, (wire, grad_wire), timer)


class Route(ABC):
    """An exchange split in two halves (:func:`start_route`): what travels, both ways, and what is in flight.

    The forward sends the inputs (:meth:`send`, from :func:`start_route`) and returns what arrived
    (:meth:`receive`, from :meth:`PendingExchange.finish_all`); the backward sends the gradients of what arrived
    (:meth:`send_back`, from ``finish``'s backward) and returns the inputs' gradients (:meth:`receive_back`, from
    ``start``'s backward). A route may run several exchanges (the hierarchical dispatch's two hops): the work between
    them belongs to whichever half waits. Called inside autograd functions: nothing here records a graph.
    """

    @abstractmethod
    def send(self, *inputs: Tensor) -> None:
        """Issue the forward exchange of ``inputs``."""

    @abstractmethod
    def receive(self) -> tuple[Tensor, ...]:
        """Wait for the forward exchange: what arrived."""

    @abstractmethod
    def send_back(self, *grads: Tensor) -> None:
        """Issue the backward exchange of the gradients of :meth:`receive`'s outputs."""

    @abstractmethod
    def receive_back(self) -> tuple[Tensor, ...]:
        """Wait for the backward exchange: the gradients of :meth:`send`'s inputs."""


class _Route(Route):
    """One ``all_to_all_single``: where rows go, in which payloads, and what is in flight."""

    __slots__ = ("dtype", "group", "in_splits", "inflight", "out_splits", "timer", "wires")

    def __init__(self, splits: tuple[Any, Any], group: Any, wires: tuple[Any, Any], timer: Any) -> None:
        self.out_splits, self.in_splits = splits
        self.group, self.wires, self.timer = group, wires, timer
        self.dtype = torch.float32
        self.inflight: InFlight | None = None

    def send(self, *inputs: Tensor) -> None:
        (rows,) = inputs
        self.dtype = rows.dtype
        self._issue(rows, self.wires[0], backward=False)

    def receive(self) -> tuple[Tensor, ...]:
        return (self._take(self.wires[0]),)

    def send_back(self, *grads: Tensor) -> None:
        self._issue(grads[0], self.wires[1], backward=True)

    def receive_back(self) -> tuple[Tensor, ...]:
        return (self._take(self.wires[1]),)

    def _issue(self, rows: Tensor, wire: str | None, backward: bool) -> None:
        out_splits, in_splits = (self.in_splits, self.out_splits) if backward else (self.out_splits, self.in_splits)
        self.inflight = all_to_all_async(_encode(rows, wire), out_splits, in_splits, self.group, self.timer)

    def _take(self, wire: str | None) -> Tensor:
        inflight, self.inflight = self.inflight, None  # the wire buffer is not kept past its decode
        assert inflight is not None, "a split exchange was finished before it was started"
        return _decode(inflight.wait(), wire, self.dtype)


class _StartExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, route: Route, *inputs: Tensor) -> Tensor:
        route.send(*inputs)
        ctx.route = route
        return inputs[0].new_empty(0)  # a token: orders finish after start, and the backward's wait after its issue

    @staticmethod
    def backward(ctx: Any, _token: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *ctx.route.receive_back())


class _FinishExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, route: Route, token: Tensor) -> tuple[Tensor, ...]:
        ctx.route, ctx.token = route, (token.dtype, token.device)
        return route.receive()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        ctx.route.send_back(*grads)
        dtype, device = ctx.token
        return None, torch.empty(0, dtype=dtype, device=device)


class PendingExchange:
    """An exchange started by :func:`start_exchange` or :func:`start_route`; finish it once."""

    __slots__ = ("_route", "_token")

    def __init__(self, token: Tensor, route: Route) -> None:
        self._token, self._route = token, route

    def finish(self) -> Tensor:
        """The received rows, in the sent rows' dtype (waits for the exchange: module docstring)."""
        return self.finish_all()[0]

    def finish_all(self) -> tuple[Tensor, ...]:
        """Everything the route's :meth:`Route.receive` returns (a one-exchange route: the received rows)."""
        return tuple(_FinishExchange.apply(self._route, self._token))


def start_route(route: Route, *inputs: Tensor) -> PendingExchange:
    """Send ``inputs`` along ``route`` now; :meth:`PendingExchange.finish_all` returns what arrived (module
    docstring). The gradients of the inputs come back through the route's backward halves.

    Example::

        pending = start_route(route, rows, weights)
        ...  # work that does not need what arrives
        received, weights = pending.finish_all()
    """
    return PendingExchange(_StartExchange.apply(route, *inputs), route)


def start_exchange(
    x: Tensor,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    group: dist.ProcessGroup,
    *,
    wire: str | None,
    grad_wire: str | None,
    timer: ExchangeTimer | None = None,
) -> PendingExchange:
    """:func:`exchange`, issued now and finished by :meth:`PendingExchange.finish` (module docstring); same
    arguments, same values and gradients.

    Example::

        pending = start_exchange(rows, None, None, group, wire=None, grad_wire=None)
        shared = shared_experts(x)  # runs while the rows travel
        received = pending.finish()
    """
    return start_route(exchange_route(out_splits, in_splits, group, (wire, grad_wire), timer), x)


def exchange_route(
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    group: dist.ProcessGroup,
    wires: tuple[str | None, str | None],
    timer: ExchangeTimer | None = None,
) -> Route:
    """The :class:`Route` of one :func:`exchange` (``wires``: its ``wire`` and ``grad_wire``), for
    :func:`start_route`.

    Example::

        received = start_route(exchange_route(None, None, group, ("fp8", "bf16")), rows).finish()
    """
    return _Route((out_splits, in_splits), group, wires, timer)
