"""The grouped, sync-free MoE block: one ``route`` -> ``dispatch`` -> experts -> ``combine`` -> record path.

:class:`GroupedMoE` is that path, for any weights: :class:`MoEBlock` owns its router and experts (the parameters,
names and layout of :class:`~lightning_llmfast.moe.naive.NaiveMoEBlock`), the transformers adapter
(:class:`~lightning_llmfast.moe.adapters.HFGroupedMoeBlock`) wraps a transformers block's. Tokens reach the experts
through the block's :class:`~lightning_llmfast.moe.dispatcher.TokenDispatcher` (local by default; all-to-all under
expert parallelism), and every forward leaves one :class:`~lightning_llmfast.moe.MoEStats` record in ``stats``.
Neither forward nor backward reads a device value on the host.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Size, Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llmfast._autograd import in_backward
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.moe.balance import all_reduce_counts
from lightning_llmfast.moe.checks import check_block_input
from lightning_llmfast.moe.config import MoEConfig
from lightning_llmfast.moe.dispatcher import ExpertRows, LocalDispatcher, TokenDispatcher, compute_copy
from lightning_llmfast.moe.experts import GroupedExperts, autocast_inputs, expert_swiglu, per_expert_loop
from lightning_llmfast.moe.losses import SequenceBoundaries
from lightning_llmfast.moe.routing import RoutingPlan, route, update_expert_bias
from lightning_llmfast.moe.stats import MoEStats

__all__ = ["GroupedMoE", "MoEBlock", "SharedExperts"]

# Devices where config.cuda_graphs captures the block (CUDA graphs exist there only).
CAPTURE_DEVICES: tuple[str, ...] = ("cuda",)
_LOCAL_ONLY = (
    "cuda_graphs=True captures the local dispatcher only, got {}: the all-to-all dispatchers exchange split sizes "
    "through the host (dropless) or are not proven capturable; set MoEConfig(cuda_graphs=False) under expert "
    "parallelism"
)

# Training forwards with bias_update="step" after which a block that never saw finish_step() warns (once).
_UNFINISHED_FORWARDS = 256


class SharedExperts(nn.Module):
    """The always-on SwiGLU expert(s) of a DeepSeek-style MoE block, as one dense SwiGLU of width ``F_shared``.

    Two dense GEMMs next to the routed grouped ones rather than one more group inside them: fused as an extra group
    of ``grouped_mm`` (all tokens' rows appended) it measured no faster on CPU (float32, T=2048, H=F=256, E=64, k=8,
    forward+backward of the GEMMs: 3.50 s fused vs 3.26 s separate), and it would tie the shared weights to the
    routed experts' tensor, which the transformers adapters must leave as they are.

    Attributes:
        gate_up_proj: ``(H, 2 * F_shared)``, gate half first (the routed experts' ``[in, out]`` layout).
        down_proj: ``(F_shared, H)``.

    Example::

        shared = SharedExperts(64, 256)
        y = shared(torch.randn(5, 64))  # (5, 64)
    """

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(hidden_size, 2 * ffn_size))
        self.down_proj = nn.Parameter(torch.empty(ffn_size, hidden_size))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = (x @ self.gate_up_proj).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.down_proj


class GroupedMoE(nn.Module):
    """The route -> dispatch -> experts -> combine -> record path of every grouped MoE block in this package.

    Subclasses own the weights and say how to read them: :meth:`_router_logits`, :meth:`_expert_weights`,
    :meth:`_shared_output` and (optionally) :meth:`_selection_bias`. Implements the
    :class:`~lightning_llmfast.moe.MoELayer` protocol.

    Args:
        config: the block's :class:`~lightning_llmfast.moe.MoEConfig`.
        dispatcher: how tokens reach the experts; ``None``: a
            :class:`~lightning_llmfast.moe.dispatcher.LocalDispatcher` with the routing backend.

    Attributes:
        config: the :class:`~lightning_llmfast.moe.MoEConfig`.
        dispatcher: the :class:`~lightning_llmfast.moe.dispatcher.TokenDispatcher`.
        stats: the last forward's :class:`~lightning_llmfast.moe.MoEStats` (``None`` before the first).
        expert_bias: ``(E,)`` float32 buffer (``config.expert_bias``), or ``None``.
        dp_group: the data-parallel process group of the step sums (``None``: the default group).
        batch_group: the ranks that share this block's batch, each routing a share of its positions (a
            context-parallel group, set by :func:`~lightning_llmfast.expert_parallel.share_batch`), or ``None``.

    Raises:
        ConfigError: ``config`` is not an ``MoEConfig`` or ``dispatcher`` not a ``TokenDispatcher``.
    """

    def __init__(self, config: MoEConfig, dispatcher: TokenDispatcher | None = None) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise ConfigError(f"config must be an MoEConfig, got {type(config).__name__}")
        self.config = config
        self.dispatcher: TokenDispatcher = LocalDispatcher(config.routing.backend)
        self._graphed: Callable[..., tuple[Tensor, MoEStats]] | None = None  # the captured path (config.cuda_graphs)
        if dispatcher is not None:
            self.set_dispatcher(dispatcher)
        self.dp_group: dist.ProcessGroup | None = None
        self.batch_group: dist.ProcessGroup | None = None
        num_experts = config.num_experts
        self.expert_bias: Tensor | None
        self.register_buffer("expert_bias", torch.zeros(num_experts) if config.expert_bias else None)
        # Pairs per expert summed over the training forwards of the current optimizer step: this rank's (for the
        # bias update) and, for aux_loss="global", summed over dp_group. Not state to checkpoint: a step's running sum.
        self._step_counts: Tensor | None
        self._global_counts: Tensor | None
        counts_for_bias = config.expert_bias and config.bias_update == "step"
        self.register_buffer("_step_counts", _zero_counts(num_experts, counts_for_bias), persistent=False)
        self.register_buffer("_global_counts", _zero_counts(num_experts, config.aux_loss == "global"), persistent=False)
        self._row_boundaries: dict[tuple[int, int, torch.device], SequenceBoundaries] = {}
        self._forwards_since_finish = 0
        self.stats: MoEStats | None = None

    def set_dispatcher(self, dispatcher: TokenDispatcher) -> None:
        """Route this block's tokens through ``dispatcher`` from the next forward on (expert parallelism sets it).

        Raises:
            ConfigError: ``dispatcher`` is not a :class:`~lightning_llmfast.moe.dispatcher.TokenDispatcher`.

        Example::

            block.set_dispatcher(LocalDispatcher(backend="torch"))
        """
        if not isinstance(dispatcher, TokenDispatcher):
            raise ConfigError(f"dispatcher must be a TokenDispatcher, got {type(dispatcher).__name__}")
        if self.config.cuda_graphs and not isinstance(dispatcher, LocalDispatcher):
            raise ConfigError(_LOCAL_ONLY.format(type(dispatcher).__name__))
        self.dispatcher = dispatcher
        self._graphed = None

    # ------------------------------------------------------------------ what a subclass provides
    def _router_logits(self, x_compute: Tensor) -> Tensor:
        """``(T, E)`` router logits of the compute-dtype tokens."""
        raise NotImplementedError

    def _expert_weights(self) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
        """``(gate_up (E_l, H, 2F), down (E_l, F, H), act)`` of the experts this rank holds (views, not copies)."""
        raise NotImplementedError

    def _shared_output(self, x_compute: Tensor) -> Tensor | None:
        """The always-on experts' ``(T, H)`` output, or ``None``."""
        return None

    def _selection_bias(self) -> Tensor | None:
        """The bias added to the scores for the selection only (aux-loss-free balancing), or ``None``."""
        return self.expert_bias

    # ------------------------------------------------------------------ the one path
    def _moe(self, x: Tensor, token_mask: Tensor | None, boundaries: SequenceBoundaries | None, shape: Size) -> Tensor:
        """``(T, H)`` tokens to ``(T, H)`` outputs in the compute dtype; records :attr:`stats`. With
        ``config.cuda_graphs`` on CUDA through the captured graphs of :meth:`_path`."""
        if self.config.cuda_graphs and x.device.type in CAPTURE_DEVICES and not torch.compiler.is_compiling():
            if self._graphed is None:
                self._check_capturable(x)
                self._graphed = torch.compile(self._path, mode="reduce-overhead", fullgraph=True)
            out, stats = self._graphed(x, token_mask, boundaries, shape)
            # Recorded here, outside the captured region (whose Python does not run on a replay), from copies: the
            # graph's outputs live in its static memory, which the next replay overwrites.
            self.stats = _copied(stats)
            return out
        out, self.stats = self._path(x, token_mask, boundaries, shape)
        return out

    def _check_capturable(self, x: Tensor) -> None:
        """Refuses what a CUDA graph would capture wrong: host reads of device values, data-dependent shapes."""
        if not isinstance(self.dispatcher, LocalDispatcher):
            raise ConfigError(_LOCAL_ONLY.format(type(self.dispatcher).__name__))
        gate_up, down, _ = self._expert_weights()
        x_compute = compute_copy(x)
        gate_up, down = autocast_inputs(x.device, _local(gate_up), _local(down))
        if per_expert_loop(x_compute, gate_up, down):
            raise ConfigError(
                f"cuda_graphs=True cannot capture the per-expert loop that {x_compute.dtype} experts take (it reads "
                "the group offsets on the host); use bfloat16/float16 or float32 experts"
            )

    def _path(
        self, x: Tensor, token_mask: Tensor | None, boundaries: SequenceBoundaries | None, shape: Size
    ) -> tuple[Tensor, MoEStats]:
        """:meth:`_moe` without CUDA graphs: the outputs and the forward's record (returned, not stored, so that the
        record of a replayed graph is its outputs')."""
        # Cast once for router and experts: both keep this one (T, H) copy for backward (dispatcher.py).
        x_compute = compute_copy(x)
        logits = self._router_logits(x_compute)  # (T, E)
        bias = self._selection_bias()
        # validate=None: no finiteness work in the hot path; stats.nonfinite_flag() checks when a monitor asks.
        plan = route(logits, self.config.routing, expert_bias=bias, token_mask=token_mask, validate=None)
        gate_up, down, act = self._expert_weights()
        counting = self.training and not in_backward()  # not again when recomputation replays this forward

        def independent() -> tuple[Tensor | None, Tensor]:
            # Needs no routed result: an overlapping dispatcher runs it while its exchanges are in flight.
            return self._shared_output(x_compute), self._aux_loss(plan, counting, boundaries, shape)

        def experts(rows: ExpertRows) -> Tensor:
            return expert_swiglu(rows, _local(gate_up), _local(down), act)

        out, (shared, aux_loss) = self.dispatcher.run(x, plan, experts, independent, x_compute=x_compute)
        if shared is not None:
            out = out + shared
        num_pairs = plan.num_tokens * plan.top_k if token_mask is None else None
        stats = MoEStats(plan.tokens_per_expert, aux_loss, plan.z_loss, plan.num_dropped, num_pairs, None, logits, plan)
        if counting:
            self._count(plan)
        return out, stats

    def finish_step(self, group: dist.ProcessGroup | None = None) -> None:
        """Close an optimizer step: update ``expert_bias`` once from the step's counts, reset the step sums.

        With ``bias_update="step"`` the counts summed over the step's training forwards are summed over ``group``
        (one all-reduce of ``E`` integers, no host sync) and ``expert_bias += rate * sign(mean - load)``
        (:func:`~lightning_llmfast.moe.update_expert_bias`). Call it on every rank of the group, once per step.

        Args:
            group: the data-parallel group; ``None``: ``dp_group`` (itself ``None``: the default group).

        Example::

            for micro_batch in step:
                (model(micro_batch).mean() + block.stats.aux_loss).backward()
            optimizer.step()
            block.finish_step()
        """
        (rate,) = self.config.floats  # bias_update_rate, specialised under torch.compile
        if self._step_counts is not None and self.expert_bias is not None and rate > 0:
            group = group if group is not None else self.dp_group
            update_expert_bias(self.expert_bias, self._step_counts, rate, group=group)
        for counts in (self._step_counts, self._global_counts):
            if counts is not None:
                counts.zero_()
        self._forwards_since_finish = 0

    @property
    def last_aux_loss(self) -> Tensor | None:
        """``stats.aux_loss`` of the last forward (``None`` before the first); read-only."""
        return None if self.stats is None else self.stats.aux_loss

    def _aux_loss(
        self, plan: RoutingPlan, counting: bool, boundaries: SequenceBoundaries | None, shape: Size
    ) -> Tensor:
        kind = self.config.aux_loss
        if kind == "sequence":
            if self.batch_group is not None and (boundaries is None or boundaries.group is None):
                # Pieces of documents balanced piece by piece would silently differ from one process.
                raise ConfigError(
                    "aux_loss='sequence' under context parallelism needs the batch's documents: pass the block "
                    "SequenceBoundaries numbering them over the whole batch, with the group holding their other "
                    "pieces (lightning_llmfast.models.ffn.sequence_boundaries(metadata, x) builds them from the "
                    "shard's SequenceMetadata); got "
                    + ("none" if boundaries is None else "boundaries of this rank's tokens only (group=None)")
                )
            if boundaries is None:
                boundaries = self._rows_as_documents(shape, plan.router_probs.device)
            loss = plan.sequence_aux_loss(boundaries)
        elif kind == "global" and self.training:
            if counting:  # the replay inside backward sees the same sums as its forward did
                self._global_counts += all_reduce_counts(plan.routed_per_expert, self.dp_group)
            loss = plan.global_aux_loss(self._global_counts)
        elif counting:
            # Under expert parallelism the dispatcher knows the whole group's counts: its micro-batch loss covers the
            # whole batch. The sequence and global losses mean the same with and without it (per document; counts
            # summed over dp_group), so they are computed above as on one rank.
            batch_loss = self.dispatcher.batch_aux_loss(plan)
            loss = plan.aux_loss if batch_loss is None else batch_loss
        else:
            loss = plan.aux_loss
        return loss

    def _rows_as_documents(self, shape: Size, device: torch.device) -> SequenceBoundaries:
        """Each row of a ``(..., S, H)`` input (the whole input if 2-D) as one document; memoised for the last shape."""
        rows = math.prod(shape[:-2]) if len(shape) > 2 else 1
        length = shape[-2] if len(shape) > 2 else shape[0]
        key = (rows, length, device)
        boundaries = self._row_boundaries.get(key)
        if boundaries is None:
            boundaries = SequenceBoundaries.rows(rows, length, device)
            self._row_boundaries = {key: boundaries}  # one entry: varying shapes must not grow it
        return boundaries

    def _count(self, plan: RoutingPlan) -> None:
        (rate,) = self.config.floats
        if self.expert_bias is None or rate == 0:
            return
        if self.config.bias_update == "forward":
            # After routing, so this forward selected with the bias it started with.
            update_expert_bias(self.expert_bias, plan.routed_per_expert, rate, group=self.dp_group)
        else:
            self._step_counts += plan.routed_per_expert
            self._warn_if_never_finished()

    def _warn_if_never_finished(self) -> None:
        # A host-side count (skipped while tracing, where an int attribute would force recompiles): a bias that is
        # never updated is silent otherwise.
        if torch.compiler.is_compiling():
            return
        self._forwards_since_finish += 1
        if self._forwards_since_finish == _UNFINISHED_FORWARDS:
            warnings.warn(
                f"MoEBlock: {_UNFINISHED_FORWARDS} training forwards without finish_step(): with expert_bias=True and "
                "bias_update='step' the bias moves only in finish_step(); add ExpertBalanceCallback to the Trainer "
                "or call block.finish_step() after each optimizer step (bias_update='forward' updates every forward)",
                stacklevel=4,
            )

    def extra_repr(self) -> str:
        return f"config={self.config}, dispatcher={self.dispatcher!r}"


class MoEBlock(GroupedMoE):
    """Top-k mixture of SwiGLU experts with grouped, sync-free routing. Maps ``(..., H)`` to ``(..., H)``.

    Args:
        config: every setting (:class:`~lightning_llmfast.moe.MoEConfig`; ``MoEConfig.build(H, F, E, k, ...)``
            takes them as keywords).
        dispatcher: how tokens reach the experts (default: all experts local).

    Attributes:
        router: ``nn.Linear(H, E, bias=False)``; ``router.weight`` is ``(E, H)``.
        experts: :class:`~lightning_llmfast.moe.GroupedExperts` (``gate_up_proj`` ``(E, H, 2F)``, ``down_proj``
            ``(E, F, H)``).
        shared_experts: :class:`SharedExperts`, or ``None``.
        stats: the last forward's :class:`~lightning_llmfast.moe.MoEStats`.

    Raises:
        ConfigError: ``config`` is not an ``MoEConfig``, ``dispatcher`` not a ``TokenDispatcher``.

    Example::

        block = MoEBlock(MoEConfig.build(hidden_size=64, ffn_size=128, num_experts=8, top_k=2))
        y = block(torch.randn(2, 16, 64))  # (2, 16, 64), no host sync
        loss = y.square().mean() + 0.01 * block.stats.aux_loss + 1e-3 * block.stats.z_loss
    """

    def __init__(self, config: MoEConfig, dispatcher: TokenDispatcher | None = None) -> None:
        super().__init__(config, dispatcher)
        hidden, ffn = config.hidden_size, config.ffn_size
        self.router = nn.Linear(hidden, config.num_experts, bias=False)
        self.experts = GroupedExperts(config.num_experts, hidden, ffn)
        self.shared_experts = SharedExperts(hidden, config.shared_width) if config.num_shared_experts else None

    def forward(
        self, x: Tensor, *, token_mask: Tensor | None = None, boundaries: SequenceBoundaries | None = None
    ) -> Tensor:
        """Route, dispatch, run the experts and combine, without a host sync.

        Args:
            x: ``(..., H)`` in the block's dtype (any float dtype under autocast).
            token_mask: ``x.shape[:-1]`` bool; False tokens (padding) go to no routed expert (their routed output is
                0) and count in no loss or count.
            boundaries: the packed documents of the flattened tokens, for ``aux_loss="sequence"`` (the caller
                owns the sequence metadata); ``None``: each row of a ``(B, S, H)`` input is a document.

        Returns:
            ``(..., H)``, same dtype as ``x``.

        Raises:
            RoutingError: ``x`` is not a float ``(..., H)`` tensor on the block's device, or (outside autocast)
                its dtype is not the block's: the block does not cast ``x`` itself (``nn.Linear`` neither); a
                ``token_mask`` of another shape, or boundaries of another token count.
        """
        check_block_input(x, self.config.hidden_size, self.router.weight)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if token_mask is not None:
            if not isinstance(token_mask, Tensor) or token_mask.shape != shape[:-1]:
                got = tuple(token_mask.shape) if isinstance(token_mask, Tensor) else type(token_mask).__name__
                raise RoutingError(f"token_mask must have shape {tuple(shape[:-1])} (x.shape[:-1]), got {got}")
            token_mask = token_mask.reshape(-1)
        return self._moe(x, token_mask, boundaries, shape).to(x.dtype).reshape(shape)

    def _router_logits(self, x_compute: Tensor) -> Tensor:
        return self.router(x_compute)

    def _expert_weights(self) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
        return self.experts.gate_up_proj, self.experts.down_proj, F.silu

    def _shared_output(self, x_compute: Tensor) -> Tensor | None:
        return None if self.shared_experts is None else self.shared_experts(x_compute)


def _local(weight: Tensor) -> Tensor:
    """This rank's experts of ``weight``: under FSDP2 x expert parallelism the (gathered) expert weights are DTensors
    sharded over the expert-parallel group, whose local shard holds exactly the experts this rank serves."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _zero_counts(num_experts: int, needed: bool) -> Tensor | None:
    return torch.zeros(num_experts, dtype=torch.int64) if needed else None


def _copied(record: Any) -> Any:
    """``record`` (a tensor, ``None``, a number, or a NamedTuple of them, nested) with every tensor cloned (autograd
    follows the clones)."""
    if isinstance(record, Tensor):
        return record.clone()
    if isinstance(record, tuple) and hasattr(record, "_fields"):
        return type(record)._make(_copied(value) for value in record)
    return record
