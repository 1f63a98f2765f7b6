"""Hierarchical expert-parallel dispatch on 4 gloo processes as 2 simulated nodes of 2 (node of a rank: rank // 2),
against the flat dispatch of the same block: outputs and every gradient, and the bytes that cross the node boundary
(counted by a spy on ``all_to_all_single``)."""

from __future__ import annotations

import copy
import itertools
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _distributed import COLLECTIVE_TIMEOUT, run_distributed
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from typing_extensions import override

import lightning_llmfast.expert_parallel.payload as payload_module
import lightning_llmfast.moe.block as block_module
from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.bench.slow_link import SlowLink
from lightning_llmfast.comm.timing import ExchangeTimer, HostClock
from lightning_llmfast.data import pack_documents
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.expert_parallel import (
    DispatchPayload,
    HierarchicalDispatcher,
    NodeGroups,
    node_groups,
    set_ep_dispatch,
    set_ep_overlap,
    shard_experts,
)
from lightning_llmfast.expert_parallel.hierarchical import group_nodes
from lightning_llmfast.moe import MoEBlock, MoEConfig, RoutingConfig, route
from lightning_llmfast.plan import expected_remote_nodes, expected_remote_pairs, inter_node_bytes, main

WORLD, PER_NODE = 4, 2
HIDDEN = 16
TOKENS = (5, 0, 3, 7)  # per rank: awkward sizes, one rank without tokens


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 1e-5) -> float:
    actual, expected = actual.detach(), expected.detach()
    scale = expected.abs().max().clamp(min=1e-30) if expected.numel() else torch.tensor(1.0)
    err = float((actual - expected).abs().max() / scale) if expected.numel() else 0.0
    assert err <= rtol, f"{what}: max error {err:.3g} relative to max |expected| (tolerance {rtol})"
    return err


@contextmanager
def _inter_node_spy(per_node: int = PER_NODE) -> Iterator[list[int]]:
    """Bytes of rows this rank sends to ranks on other nodes through ``all_to_all_single`` (the int64 split
    handshakes are not payload; fp8 rows, and hierarchical rows with their weights and ids, travel as bytes)."""
    sent = [0]
    real = dist.all_to_all_single

    def spy(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
            input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:  # fmt: skip
        if input.dtype != torch.int64 and input.shape[0]:
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            splits = input_split_sizes or [input.shape[0] // len(ranks)] * len(ranks)
            row_bytes = input[0].numel() * input.element_size()
            me = dist.get_rank() // per_node
            sent[0] += sum(rows * row_bytes for rows, g in zip(splits, ranks, strict=True) if g // per_node != me)
        return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = spy
    try:
        yield sent
    finally:
        dist.all_to_all_single = real


def _pair(layout: Any, payload: DispatchPayload | None = None, **options: Any) -> tuple[MoEBlock, MoEBlock]:
    """The same block sharded flat and hierarchical (same seed on every rank)."""
    torch.manual_seed(1234)
    flat = MoEBlock(MoEConfig.build(HIDDEN, 12, 8, 4, backend="torch", **options))
    hier = copy.deepcopy(flat)
    shard_experts(flat, dist.group.WORLD, node_layout=layout, dispatch_dtype=payload)
    shard_experts(hier, dist.group.WORLD, ep_dispatch="hierarchical", node_layout=layout, dispatch_dtype=payload)
    assert isinstance(hier.dispatcher, HierarchicalDispatcher)
    return flat, hier


def _step(block: MoEBlock, x: torch.Tensor, g: torch.Tensor, per_node: int) -> tuple[torch.Tensor, ...]:
    """Output, input/router/expert gradients, and the forward's spied and counted inter-node bytes."""
    xs = x.clone().requires_grad_()
    traffic = block.dispatcher.traffic
    before = traffic.inter
    with _inter_node_spy(per_node) as spied:
        out = block(xs)
    counted = traffic.inter - before
    (out * g).sum().add(0.1 * block.stats.aux_loss).backward()
    experts = [getattr(block.experts, n).grad for n in ("gate_up_proj", "down_proj")]
    return out, xs.grad, block.router.weight.grad, *experts, torch.tensor([spied[0], counted])


def _compare(rank: int, layout: Any, seed: int, routing: Callable[[MoEBlock, torch.Tensor], torch.Tensor] | None,
             tokens: tuple[int, ...] = TOKENS, payload: DispatchPayload | None = None, rtol: float = 1e-5,
             **options: Any) -> tuple[int, int]:  # fmt: skip
    flat, hier = _pair(layout, payload, **options)
    gen = torch.Generator().manual_seed(seed + rank)
    x, g = torch.randn(tokens[rank], HIDDEN, generator=gen), torch.randn(tokens[rank], HIDDEN, generator=gen)
    if routing is not None:
        x = routing(flat, x)
        hier.load_state_dict(flat.state_dict())
    per_node = layout.ranks_per_node
    expected, actual = _step(flat, x, g, per_node), _step(hier, x, g, per_node)
    names = ("output", "input gradient", "router gradient", "gate_up gradient", "down gradient")
    errors = [_close(a, e, n, rtol) for a, e, n in zip(actual[:-1], expected[:-1], names, strict=True)]
    flat_bytes, hier_bytes = expected[-1].tolist(), actual[-1].tolist()
    assert flat_bytes[0] == flat_bytes[1] and hier_bytes[0] == hier_bytes[1], (flat_bytes, hier_bytes)
    if rank == 0:
        print(f"seed {seed} {payload} {options}: max relative errors {max(errors):.2g}, inter-node bytes "
              f"{flat_bytes[0]} flat, {hier_bytes[0]} hierarchical")  # fmt: skip
    assert hier.dispatcher.host_syncs == 1
    return flat_bytes[0], hier_bytes[0]


_COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "broadcast")  # fmt: skip


@contextmanager
def _collective_spy() -> Iterator[list[tuple[str, torch.dtype, int]]]:
    """Every collective this rank enters: ``(name, dtype, bytes of one row of its input)``."""
    calls: list[tuple[str, torch.dtype, int]] = []
    real = {name: getattr(dist, name) for name in _COLLECTIVES}

    def spy(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[1] if name == "all_to_all_single" else args[0]
            calls.append((name, tensor.dtype, math.prod(tensor.shape[1:]) * tensor.element_size()))
            return real[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, spy(name))
    try:
        yield calls
    finally:
        for name, function in real.items():
            setattr(dist, name, function)


@contextmanager
def _fp8_encode_spy() -> Iterator[list[int]]:
    """The rows of every fp8 encoding (``quantize_rows``) this rank runs."""
    encoded: list[int] = []
    real = payload_module.quantize_rows

    def spy(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        encoded.append(rows.shape[0])
        return real(rows)

    payload_module.quantize_rows = spy
    try:
        yield encoded
    finally:
        payload_module.quantize_rows = real


def _check_counts(rank: int) -> None:
    """One training forward and backward of a hierarchical block: one host read, one handshake, one exchange per hop
    and direction (the weights and expert ids inside the tokens' rows, fp8 kept across the intermediate rank), no
    all-reduce for the balance loss."""
    layout = node_groups(dist.group.WORLD, PER_NODE, timeout=COLLECTIVE_TIMEOUT)
    top_k, experts, nodes = 4, 8, 2
    # Every rank's pairs per expert and tokens per node, its valid tokens and its signature (dtype, hidden, payload).
    handshake = ("all_to_all_single", torch.int64, 8 * (experts + nodes + 4))
    for dispatch, wire, out_bytes in ((None, torch.float32, 4 * HIDDEN), ("fp8", torch.uint8, HIDDEN + 4)):
        _, hier = _pair(layout, DispatchPayload(dispatch))
        x = torch.randn(TOKENS[rank], HIDDEN, requires_grad=True)
        back = torch.float32 if dispatch is None else torch.bfloat16
        back_bytes = HIDDEN * back.itemsize
        with SyncCounter() as syncs, _collective_spy() as calls, _fp8_encode_spy() as encodes:
            out = hier(x)
            forward = list(calls)
            (out.square().sum() + hier.stats.aux_loss).backward()
        sent = hier.dispatcher.send_rows  # once at home, never at the intermediate rank
        assert encodes == [sent] * (dispatch == "fp8"), (encodes, sent)
        a2a = "all_to_all_single"
        assert dict(syncs.syncs) == {"tolist": 1} and hier.dispatcher.host_syncs == 1, syncs.syncs
        assert forward == [
            handshake,
            (a2a, torch.uint8, out_bytes + 8 * top_k),  # across: the token's row, k fp32 weights, k int32 ids
            (a2a, wire, out_bytes),  # inside the node: still encoded
            (a2a, back, back_bytes),  # the outputs to the intermediate rank
            (a2a, back, back_bytes),  # their sums home
        ], forward
        assert calls[len(forward) :] == [
            (a2a, back, back_bytes),
            (a2a, back, back_bytes),
            (a2a, back, back_bytes),
            (a2a, torch.uint8, back_bytes + 4 * top_k),  # the rows' gradients with the weights' gradients
        ], calls
        assert x.grad is not None and hier.router.weight.grad is not None


def _everything_to_node_0(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # experts 0 > 1 > 2 > 3 for every (positive) token: node 1 receives nothing
        block.router.weight.zero_()
        block.router.weight[:4] = torch.tensor([10.0, 9.0, 8.0, 7.0])[:, None]
    return x.abs()


def _total(value: int) -> int:
    total = torch.tensor([value])
    dist.all_reduce(total)
    return int(total)


@contextmanager
def _shape_spy() -> Iterator[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The input and output shapes of every token exchange (the int64 handshake left out)."""
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = dist.all_to_all_single

    def spy(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if input.dtype != torch.int64:
            shapes.append((tuple(input.shape), tuple(output.shape)))
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = spy
    try:
        yield shapes
    finally:
        dist.all_to_all_single = real


def _check_fixed_shapes(rank: int, layout: NodeGroups) -> None:
    """With a capacity limit every exchange has the same shapes whatever the routing (forward and backward, with
    and without overlap): blocks of ``min(T, E / N * C)`` token rows per node and ``N * E_l * C`` pair rows per rank
    of the node; ranks whose tokens differ (so would their blocks) all raise."""
    for overlap in (None, 2):
        seen = []
        for routing in (None, _everything_to_node_0):  # spread, then every pair on node 0 (dropped pairs)
            _, hier = _pair(layout, capacity_factor=1.0)
            set_ep_overlap(hier, overlap)
            x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(rank))
            x = routing(hier, x) if routing is not None else x
            with _shape_spy() as shapes:
                hier(x.requires_grad_()).square().sum().backward()
            seen.append(shapes)
        # T = 6, C = ceil(6 * 4 / 8) = 3: 6 rows to each of 2 nodes, 2 * 2 * 3 = 12 to each of 2 ranks of the node.
        assert seen[0] == seen[1] and seen[0][0][0][0] == 2 * 6 and seen[0][1][0][0] == 2 * 12, seen
    _, hier = _pair(layout, capacity_factor=1.0)
    with pytest.raises(RoutingError, match="tokens or capacity"):
        hier(torch.randn(6 if rank else 5, HIDDEN))


def _cases(rank: int, world: int) -> None:
    layout = node_groups(dist.group.WORLD, PER_NODE, timeout=COLLECTIVE_TIMEOUT)
    assert layout.nodes == (0, 0, 1, 1) and layout.num_nodes == 2
    _compare(rank, layout, 0, None)
    flat_bytes, hier_bytes = _compare(rank, layout, 1, _everything_to_node_0)
    # Node 0 sends one 64-byte sum back per node-1 token of its local index, node 1 each token once, with its 4
    # weights and expert ids (32 bytes); flat sends 4 rows per node-1 token and returns 2 rows per pair it holds.
    row = 4 * HIDDEN
    assert hier_bytes == (row * TOKENS[rank + 2] if rank < 2 else (row + 32) * TOKENS[rank])
    assert flat_bytes == (2 * row * (TOKENS[2] + TOKENS[3]) if rank < 2 else 4 * row * TOKENS[rank])
    _compare(rank, layout, 2, None, (6,) * WORLD, capacity_factor=0.5)  # flat capacity: equal tokens per rank
    _compare(rank, layout, 8, _everything_to_node_0, (6,) * WORLD, capacity_factor=1.0)  # the same pairs dropped
    _check_fixed_shapes(rank, layout)
    _compare(rank, layout, 3, None, score="sigmoid", num_groups=4, topk_groups=2)
    # Both payloads: the tokens are encoded once at home and stay encoded across the intermediate hop, so they reach
    # the experts as the flat dispatch's do (sums come back in fp32 here: the combine's rounding is not compared).
    for dispatch in ("bf16", "fp8"):
        _compare(rank, layout, 6, None, payload=DispatchPayload(dispatch, combine="fp32"))
        _compare(rank, layout, 7, None, payload=DispatchPayload(dispatch), rtol=2e-2)  # bf16 sums and gradients
    _check_counts(rank)
    # Node-limited routing: top-4 of 8 experts within 1 of the 2 nodes' groups.
    flat_bytes, hier_bytes = (_total(b) for b in _compare(rank, layout, 4, None, num_groups=2, topk_groups=1))
    if rank == 0:
        print(f"node-limited, all ranks: inter-node bytes {flat_bytes} flat, {hier_bytes} hierarchical")
    assert 0 < hier_bytes <= flat_bytes // 2, (flat_bytes, hier_bytes)
    # 4 nodes of one rank (nothing stays inside a node; 16 values a row do not pay for the 32 bytes of weights and
    # ids). One node of 4 ranks (nothing crosses) is refused, before any collective.
    other = node_groups(dist.group.WORLD, 1, timeout=COLLECTIVE_TIMEOUT)
    assert other.num_nodes == WORLD
    _compare(rank, other, 5, None)
    one_node = NodeGroups((0,) * WORLD, dist.group.WORLD, dist.group.WORLD)
    with pytest.raises(ConfigError, match="spans several nodes"):
        _pair(one_node)
    # Groups that straddle the nodes bound nothing: refused.
    torch.manual_seed(0)
    block = MoEBlock(MoEConfig.build(HIDDEN, 12, 8, 4, backend="torch", num_groups=1, topk_groups=1))
    with pytest.raises(ConfigError, match="does not align"):
        shard_experts(block, dist.group.WORLD, ep_dispatch="hierarchical", node_layout=layout)
    shard_experts(block, dist.group.WORLD)
    with pytest.raises(ConfigError, match="does not align"):  # the strategy's path, at setup
        set_ep_dispatch(block, "hierarchical", PER_NODE, timeout=COLLECTIVE_TIMEOUT)
    with pytest.raises(ConfigError, match="spans several nodes"):
        set_ep_dispatch(block, "hierarchical", WORLD)
    # An already sharded block switched to hierarchical (the strategy's path) keeps its experts and equals flat.
    flat, switched = _pair(layout)
    assert set_ep_dispatch(switched, "flat", PER_NODE) is None
    assert switched.dispatcher.nodes == (0, 0, 1, 1)
    assert set_ep_dispatch(switched, "hierarchical", PER_NODE, timeout=COLLECTIVE_TIMEOUT).nodes == layout.nodes
    assert isinstance(switched.dispatcher, HierarchicalDispatcher)
    x = torch.randn(TOKENS[rank], HIDDEN)
    torch.testing.assert_close(switched(x), flat(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_hierarchical_equals_flat_and_crosses_nodes_less() -> None:
    run_distributed(_cases, WORLD, timeout=240.0)


# ---------------------------------------------------------------------------------------------- overlap
def _overlap_pair(layout: Any, payload: DispatchPayload | None, chunks: int | str, **options: Any) -> list[MoEBlock]:
    """The same hierarchical block exchanging, then computing (``ep_overlap=False``), and in ``chunks`` chunks."""
    blocks = []
    for overlap in (None, chunks):
        torch.manual_seed(1234)
        block = MoEBlock(MoEConfig.build(HIDDEN, 12, 8, 4, backend="torch", **options))
        shard_experts(block, dist.group.WORLD, ep_dispatch="hierarchical", node_layout=layout, dispatch_dtype=payload)
        set_ep_overlap(block, overlap, ExchangeTimer(HostClock()))
        blocks.append(block)
    return blocks


@contextmanager
def _order_spy(layout: NodeGroups) -> Iterator[list[str]]:
    """What this rank runs, in order: ``"across"`` / ``"inside"`` for a token exchange over the inter- / intra-node
    group (the int64 handshake left out), ``"experts"`` for a grouped GEMM of the local experts."""
    events: list[str] = []
    real_a2a, real_experts = dist.all_to_all_single, block_module.expert_swiglu

    def a2a(output: torch.Tensor, input: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        if input.dtype != torch.int64:
            events.append("across" if group is layout.inter else "inside")
        return real_a2a(output, input, *args, group=group, **kwargs)

    def experts(*args: Any, **kwargs: Any) -> torch.Tensor:
        events.append("experts")
        return real_experts(*args, **kwargs)

    dist.all_to_all_single, block_module.expert_swiglu = a2a, experts
    try:
        yield events
    finally:
        dist.all_to_all_single, block_module.expert_swiglu = real_a2a, real_experts


def _run_counted(block: MoEBlock, x: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, int], int, list[str]]:
    """Forward and backward: outputs and every gradient, the host syncs, the bytes of every all-to-all (handshake
    included) and the forward's order of exchanges and GEMMs."""
    xs = x.clone().requires_grad_()
    sent: list[int] = []
    with SyncCounter() as syncs, _order_spy(block.dispatcher.node_layout) as order:
        original, spy = _sent_bytes(sent)
        dist.all_to_all_single = spy
        try:
            out = block(xs)
            forward = list(order)
            (out.square().sum() + block.stats.aux_loss).backward()
        finally:
            dist.all_to_all_single = original
    grads = [xs.grad, *(p.grad for p in block.parameters())]
    return [out.detach(), *grads], dict(syncs.syncs), sum(sent), forward


def _sent_bytes(sent: list[int]) -> tuple[Any, Any]:
    original = dist.all_to_all_single

    def spy(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(input.numel() * input.element_size())
        return original(output, input, *args, **kwargs)

    return original, spy


def _one_expert(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # expert 0 first for every (positive) token, the rest spread
        block.router.weight[0] = 10.0
    return x.abs()


def _overlap_cases(rank: int, world: int) -> None:
    two_nodes = node_groups(dist.group.WORLD, PER_NODE, timeout=COLLECTIVE_TIMEOUT)
    four_nodes = node_groups(dist.group.WORLD, 1, timeout=COLLECTIVE_TIMEOUT)
    cases = [  # layout, payload, chunks, routing, tokens, block options
        (two_nodes, None, 2, None, TOKENS, {"num_shared_experts": 1}),  # a rank without tokens
        (two_nodes, DispatchPayload("fp8"), 3, _everything_to_node_0, TOKENS, {}),  # node 1 receives nothing
        (two_nodes, DispatchPayload("bf16"), "auto", _one_expert, (1, 2, 1, 3), {}),  # "auto": one chunk
        (two_nodes, DispatchPayload("bf16"), 2, None, (6,) * WORLD, {"capacity_factor": 0.5}),  # dropped pairs
        (four_nodes, None, 3, _one_expert, (4, 1, 0, 9), {"num_shared_experts": 1}),  # chunks of 1, 1, 2 nodes
    ]
    for layout, payload, chunks, routing, tokens, options in cases:
        sequential, overlapped = _overlap_pair(layout, payload, chunks, **options)
        x = torch.randn(tokens[rank], HIDDEN, generator=torch.Generator().manual_seed(11 + rank))
        if routing is not None:
            x = routing(sequential, x)
            overlapped.load_state_dict(sequential.state_dict())
        want, want_syncs, want_bytes, _ = _run_counted(sequential, x)
        got, got_syncs, got_bytes, order = _run_counted(overlapped, x)
        what = f"rank {rank}: {layout.num_nodes} nodes, payload {payload}, chunks {chunks}, {options}"
        for g, w in zip(got, want, strict=True):
            _close(g, w, what, rtol=1e-6)
        assert got_syncs == want_syncs == {"tolist": 1}, (what, got_syncs, want_syncs)
        assert overlapped.dispatcher.host_syncs == sequential.dispatcher.host_syncs == 1, what
        assert got_bytes == want_bytes and overlapped.dispatcher.traffic == sequential.dispatcher.traffic, what
        # Every chunk's hop across is issued before the first chunk's experts run (each chunk: across, inside,
        # experts, inside back, across back).
        count = 1 if chunks == "auto" or "capacity_factor" in options else min(chunks, layout.num_nodes)
        first = order.index("experts")
        assert order[:first] == ["across"] * count + ["inside"] and order.count("experts") == count, (what, order)
        # Every exchange is timed (the fits below, under a slowed link, show the waits).
        for block in (sequential, overlapped):
            block.dispatcher.timer.close()
            assert block.dispatcher.timer.read_ms()[0] > 0, what


@pytest.mark.slow
def test_hierarchical_overlap_equals_the_sequential_dispatch() -> None:
    run_distributed(_overlap_cases, WORLD, timeout=240.0)


def test_group_nodes_and_bad_arguments() -> None:
    assert group_nodes([4, 5, 6, 7], 2) == (0, 0, 1, 1)
    assert group_nodes([0, 1], 4) == (0, 0)
    with pytest.raises(ConfigError, match="whole nodes"):
        group_nodes([0, 1, 2], 2)
    with pytest.raises(ConfigError, match="ranks_per_node"):
        group_nodes([0, 1], 0)
    block = MoEBlock(MoEConfig.build(HIDDEN, 12, 8, 4, backend="torch"))
    with pytest.raises(ConfigError, match="ep_dispatch must be one of"):
        shard_experts(block, ep_dispatch="tree")
    with pytest.raises(ConfigError, match="needs the group's node_layout"):
        shard_experts(block, ep_dispatch="hierarchical")


class _ForwardBytes(Callback):
    """Spies on each training step's forward (batch start to backward) and reads what the strategy logged for it:
    the bytes, and after the step the exchange times (``comm/a2a_ms``, ``comm/a2a_exposed_ms``)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float]] = []
        self.times: list[dict[str, float]] = []

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._spy = _inter_node_spy()
        self._sent = self._spy.__enter__()

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._spy.__exit__(None, None, None)
        metrics = trainer.callback_metrics
        self.steps.append(
            (self._sent[0], float(metrics["comm/inter_node_bytes"]), float(metrics["comm/intra_node_bytes"]))
        )

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        names = ("comm/a2a_ms", "comm/a2a_exposed_ms")
        self.times.append({k: float(v) for k, v in trainer.callback_metrics.items() if k in names})


def _fit(rank: int, ep_dispatch: str) -> tuple[dict[str, torch.Tensor], _ForwardBytes]:
    torch.manual_seed(0)
    config = MoEGPTConfig(
        vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_size=16, num_experts=8, top_k=4,
        router_backend="torch",
    )  # fmt: skip
    module = MoEGPTLightningModule(config, lr=1e-2, warmup_steps=1)
    g = torch.Generator().manual_seed(7 + rank)
    batches = [next(pack_documents([torch.randint(0, 64, (8,), generator=g)], 8, 1)) for _ in range(2)]
    spy = _ForwardBytes()
    strategy = LLMFastStrategy(  # ep_overlap=True (the default), one chunk per node
        expert_parallel_size=WORLD, ep_dispatch=ep_dispatch, ep_overlap_chunks=2, process_group_backend="gloo"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=PER_NODE, num_nodes=WORLD // PER_NODE, strategy=strategy, max_steps=2,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[spy],
    )  # fmt: skip
    with SlowLink(1e6):  # about 1 ms an exchange: the step waits for the ones its compute cannot hide
        trainer.fit(module, DataLoader(batches, batch_size=None))
    assert strategy.ep_dispatch == ep_dispatch
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, spy


def _fit_cases(rank: int, world: int) -> None:
    # Two simulated nodes of two processes: Lightning joins the process group run_distributed created.
    os.environ.update(LOCAL_RANK=str(rank % PER_NODE), NODE_RANK=str(rank // PER_NODE), WORLD_SIZE=str(world))
    os.environ.update(RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    flat, flat_spy = _fit(rank, "flat")
    hier, hier_spy = _fit(rank, "hierarchical")
    flat_steps, hier_steps = flat_spy.steps, hier_spy.steps
    # Two AdamW steps amplify the summation-order differences of the gradients (as test_expert_parallel_fit allows).
    for name, value in flat.items():
        torch.testing.assert_close(hier[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    for spied, inter, intra in flat_steps + hier_steps:
        assert spied == inter and intra > 0, (flat_steps, hier_steps)
    flat_inter = _total(sum(int(step[1]) for step in flat_steps))
    hier_inter = _total(sum(int(step[1]) for step in hier_steps))
    if rank == 0:
        print(f"fit, 2 steps: inter-node bytes {flat_inter} flat, {hier_inter} hierarchical")
    assert 0 < hier_inter < flat_inter
    # Both dispatches' exchanges are timed: step 1 logs step 0's (step 0 has nothing to read yet).
    for times in (flat_spy.times, hier_spy.times):
        assert not times[0] and times[1]["comm/a2a_ms"] > 0 and times[1]["comm/a2a_exposed_ms"] > 0, times


@pytest.mark.slow
def test_strategy_hierarchical_fit_equals_flat_and_logs_node_bytes() -> None:
    run_distributed(_fit_cases, WORLD, timeout=300.0)


def test_strategy_checks_ep_dispatch() -> None:
    with pytest.raises(ConfigError, match="ep_dispatch must be one of"):
        LLMFastStrategy(expert_parallel_size=2, ep_dispatch="tree")
    with pytest.raises(ConfigError, match="needs expert_parallel_size > 1"):
        LLMFastStrategy(ep_dispatch="hierarchical")


def _brute_force(experts: int, top_k: int, nodes: int, groups: int | None, chosen: int | None) -> tuple[float, float]:
    """Remote pairs and remote nodes per token on node 0, averaged over every equally likely routing of the model."""
    per_node = experts // nodes
    outcomes = []
    group_sets = itertools.combinations(range(groups), chosen) if groups else [None]
    for picked in group_sets:
        pool = (
            range(experts)
            if picked is None
            else [e for g in picked for e in range(g * experts // groups, (g + 1) * experts // groups)]
        )
        for selected in itertools.combinations(pool, top_k):
            hit = {e // per_node for e in selected}
            outcomes.append((sum(e >= per_node for e in selected), len(hit - {0})))
    return tuple(sum(o[i] for o in outcomes) / len(outcomes) for i in (0, 1))  # fmt: skip


@pytest.mark.parametrize(("experts", "top_k", "nodes", "groups", "chosen"),
                         [(8, 4, 2, None, None), (8, 4, 2, 2, 1), (16, 4, 4, 8, 2), (12, 3, 3, 3, 2)])  # fmt: skip
def test_plan_expectations_equal_a_brute_force_count(experts: int, top_k: int, nodes: int, groups: Any,
                                                     chosen: Any) -> None:  # fmt: skip
    pairs, reached = _brute_force(experts, top_k, nodes, groups, chosen)
    assert expected_remote_pairs(experts, top_k, nodes) == pytest.approx(pairs, rel=1e-12)
    assert expected_remote_nodes(experts, top_k, nodes, groups, chosen) == pytest.approx(reached, rel=1e-12)


def test_plan_cli_counts_equal_random_routing(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's numbers for the reference model (8 experts, top-2) on 2 nodes x 2 ranks, ep 4, against route() on
    random logits: remote (token, expert) pairs and (token, node) pairs counted token by token."""
    plan = main(["reference", "--nodes", "2", "--gpus-per-node", "2", "--ep", "4", "--tokens", "16"])
    assert "hierarchical" in capsys.readouterr().out
    nodes = plan.inter_node
    assert nodes is not None and nodes.nodes == 2
    experts = route(torch.randn(40000, 8, generator=torch.Generator().manual_seed(0)), top_k=2).expert_ids.long()
    node = experts // 4  # tokens on node 0: 4 experts a node
    assert nodes.remote_pairs == pytest.approx((node == 1).sum(dim=1).float().mean().item(), abs=0.02)
    assert nodes.remote_nodes == pytest.approx((node == 1).any(dim=1).float().mean().item(), abs=0.02)
    # bf16 rows of 128 values: 4 exchanges a row, plus 8 * k bytes of weights and ids forward, 4 * k of the weights'
    # gradients backward.
    row = 4 * 2 * 128
    assert nodes.flat_per_token == pytest.approx(nodes.remote_pairs * row)
    assert nodes.hierarchical_per_token == pytest.approx(nodes.remote_nodes * (row + 12 * 2))
    assert nodes.flat_per_step == pytest.approx(nodes.flat_per_token * 16 * 4)  # 16 tokens, 4 MoE layers
    with pytest.raises(ConfigError, match="does not align"):
        inter_node_bytes(RoutingConfig(top_k=2, num_groups=3, topk_groups=1), 6, 8, ep=4, gpus_per_node=2,
                         tokens_per_rank=1, moe_layers=1)  # fmt: skip
