"""Overlapped expert-parallel exchanges: the routed rows travel in chunks, and the experts run on one chunk while the
next one is in flight.

With ``overlap_chunks`` set on an all-to-all dispatcher (:func:`~lightning_llmfast.expert_parallel.set_ep_overlap`;
the strategy's ``ep_overlap``), its
:meth:`~lightning_llmfast.moe.dispatcher.TokenDispatcher.run` splits the rows each rank sends to each other rank into
``n`` consecutive pieces; chunk ``c`` is piece ``c`` of every destination. :func:`exchange_chunks` then

1. starts the dispatch exchange of every chunk (:func:`~lightning_llmfast.expert_parallel.payload.start_exchange`);
2. for each chunk in turn: finishes its dispatch, runs the experts on it and starts its combine exchange, so the
   experts of chunk ``c`` run while chunks ``c + 1 ..`` arrive and chunk ``c - 1``'s outputs travel back;
3. runs the work that needs no routed result (the shared experts, the balance loss), while the combines travel;
4. finishes the combines.

The backward mirrors it: the gradients of every combine are sent first, and the experts' backward on chunk ``c``
runs while the gradients of the other chunks travel (see :mod:`~lightning_llmfast.expert_parallel.payload`). The
chunks carry the same rows, in the same payloads, as one exchange would (the byte counters do not change) and
their split sizes come from the host values the dispatch already has (no host read is added); the experts see the
same rows with the same weights, so outputs and gradients equal the unchunked ones up to the order of floating-point
sums. Every rank must use the same number of chunks: ``"auto"`` derives it from values every rank shares.

:func:`exchange_routes` is the same schedule over any :class:`~lightning_llmfast.expert_parallel.payload.Route`:
the hierarchical dispatch's chunks travel two hops each way
(:class:`~lightning_llmfast.expert_parallel.HierarchicalDispatcher`).

Example::

    chunk_count("auto", rows_per_rank=4096)  # 4 chunks of 1024 rows
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch.distributed as dist
from torch import Tensor

from lightning_llmfast.comm.timing import ExchangeTimer
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.expert_parallel.payload import DispatchPayload, Route, exchange_route, start_route

__all__ = [
    "AUTO_MAX_CHUNKS",
    "AUTO_MIN_CHUNK_ROWS",
    "Chunk",
    "ChunkRoutes",
    "check_chunks",
    "chunk_count",
    "exchange_chunks",
    "exchange_routes",
    "split_evenly",
]

AUTO_MAX_CHUNKS = 4
"""``"auto"``: at most this many chunks (each one more exchange's latency, and smaller grouped GEMMs)."""

AUTO_MIN_CHUNK_ROWS = 256
"""``"auto"``: no chunk smaller than this many rows received per rank on average (below it a GEMM is latency-bound
and one more exchange costs more than the overlap wins)."""

_Side = TypeVar("_Side")


class ChunkRoutes(NamedTuple):
    """One chunk of :func:`exchange_routes`: what its dispatch sends, and the routes of its dispatch and combine.

    Attributes:
        inputs: the tensors the dispatch route sends (their gradients come back through it).
        dispatch: the way to the experts.
        combine: the way back.
    """

    inputs: tuple[Tensor, ...]
    dispatch: Route
    combine: Route


Chunk = tuple[Tensor, list[int] | None, list[int] | None]
"""One chunk's dispatch: ``(rows to send, rows received from each rank, rows sent to each rank)`` (``None``: equal)."""


def check_chunks(chunks: int | str | None, owner: str = "ep_overlap_chunks") -> int | str | None:
    """``chunks`` if it is ``None``, ``"auto"`` or an int ``>= 1``.

    Raises:
        ConfigError: anything else, naming ``owner``.
    """
    if chunks is None or chunks == "auto" or (isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1):
        return chunks
    raise ConfigError(f"{owner} must be an int >= 1 or 'auto', got {chunks!r}")


def chunk_count(chunks: int | str, rows_per_rank: int, limit: int | None = None) -> int:
    """How many chunks to send: ``chunks``, or for ``"auto"`` as many as keep ``AUTO_MIN_CHUNK_ROWS`` rows each (at
    most ``AUTO_MAX_CHUNKS``); never more than ``limit``. ``rows_per_rank`` must be the same on every rank.

    Example::

        chunk_count("auto", rows_per_rank=4096)  # 4
    """
    count = max(1, min(AUTO_MAX_CHUNKS, rows_per_rank // AUTO_MIN_CHUNK_ROWS)) if chunks == "auto" else int(chunks)
    return max(1, min(count, limit)) if limit is not None else count


def split_evenly(count: int, parts: int) -> list[int]:
    """``count`` rows as ``parts`` consecutive pieces whose sizes differ by at most one (the same rule on every rank).

    Example::

        split_evenly(7, 3)  # [2, 2, 3]
    """
    return [count * (i + 1) // parts - count * i // parts for i in range(parts)]


def exchange_chunks(
    chunks: Sequence[Chunk],
    experts: Callable[[int, Tensor], Tensor],
    independent: Callable[[], _Side],
    group: dist.ProcessGroup,
    payload: DispatchPayload,
    timer: ExchangeTimer | None,
) -> tuple[list[Tensor], _Side]:
    """The overlapped exchange of the module docstring, each chunk one ``all_to_all_single`` each way.

    Args:
        chunks: each chunk's rows and split sizes (:data:`Chunk`), in the order they are sent.
        experts: ``experts(c, received)``: chunk ``c``'s outputs, in the order its rows were received.
        independent: work that needs no routed result; called once, while the combines are in flight.
        group: the expert-parallel process group.
        payload: the exchanges' wires.
        timer: stamps every exchange and wait, or ``None``.

    Returns:
        ``(returned rows per chunk, in each chunk's send order; independent())``.
    """
    wires = {"out": (payload.dispatch, payload.combine), "back": (payload.combine, payload.combine)}
    routes = [
        ChunkRoutes(
            (rows,),
            exchange_route(out, inp, group, wires["out"], timer),
            exchange_route(inp, out, group, wires["back"], timer),
        )
        for rows, out, inp in chunks
    ]
    backs, side = exchange_routes(routes, lambda c, received: (experts(c, received[0]),), independent)
    return [back[0] for back in backs], side


def exchange_routes(
    chunks: Sequence[ChunkRoutes],
    experts: Callable[[int, tuple[Tensor, ...]], tuple[Tensor, ...]],
    independent: Callable[[], _Side],
) -> tuple[list[tuple[Tensor, ...]], _Side]:
    """The overlapped exchange of the module docstring over any :class:`~lightning_llmfast.expert_parallel.payload.
    Route` (one exchange, or the hierarchical dispatch's two hops).

    Args:
        chunks: each chunk's inputs and its dispatch and combine routes, in the order they are sent.
        experts: ``experts(c, arrived)``: what chunk ``c``'s combine route sends, from what its dispatch route
            delivered.
        independent: work that needs no routed result; called once, while the combines are in flight.

    Returns:
        ``(what each chunk's combine route delivered; independent())``.
    """
    dispatched = [start_route(chunk.dispatch, *chunk.inputs) for chunk in chunks]
    combined = [
        start_route(chunk.combine, *experts(c, pending.finish_all()))
        for c, (pending, chunk) in enumerate(zip(dispatched, chunks, strict=True))
    ]
    side = independent()
    return [pending.finish_all() for pending in combined], side
