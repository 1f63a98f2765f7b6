"""The grouped, sync-free MoE block: ``route`` -> ``permute`` -> grouped experts -> ``unpermute``.

:class:`MoEBlock` has the parameters (names, shapes, layout) of :class:`~lightning_llmfast.moe.naive.NaiveMoEBlock`
and computes the same function; it only replaces the bincount/``nonzero``/per-expert loop with one routing pass, a
stable gather and one grouped GEMM per projection, so neither its forward nor its backward reads a device value on
the host.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Size, Tensor, nn

from lightning_llmfast._autograd import in_backward
from lightning_llmfast._checks import check_int, check_number
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.moe.balance import all_reduce_counts
from lightning_llmfast.moe.dispatch import compute_copy, routed_swiglu
from lightning_llmfast.moe.experts import GroupedExperts
from lightning_llmfast.moe.kernels import BACKENDS
from lightning_llmfast.moe.naive import check_block_input, check_moe_args
from lightning_llmfast.moe.routing import DROP_POLICIES, RoutingPlan, route, update_expert_bias
from lightning_llmfast.moe.selection import check_groups
from lightning_llmfast.seqmeta.cache import active_cache
from lightning_llmfast.seqmeta.metadata import SequenceMetadata

__all__ = ["AUX_LOSSES", "BIAS_UPDATES", "MoEBlock", "SharedExperts", "check_block_routing_args", "record_plan"]

# Training forwards with bias_update="step" after which a block that never saw finish_step() warns (once).
_UNFINISHED_FORWARDS = 256


def check_block_routing_args(capacity_factor: float | None, backend: str, drop_policy: str) -> None:
    """Validate routing options at construction time rather than at the first forward.

    Raises:
        ConfigError: naming the offending argument and value.
    """
    if capacity_factor is not None:
        # Finite, as route() requires: an infinite factor must fail here, not at the first forward.
        check_number("capacity_factor", capacity_factor, low=0, low_open=True)
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if drop_policy not in DROP_POLICIES:
        raise ConfigError(f"drop_policy must be one of {sorted(DROP_POLICIES)}, got {drop_policy!r}")


AUX_LOSSES: frozenset[str] = frozenset({"micro_batch", "sequence", "global"})
BIAS_UPDATES: frozenset[str] = frozenset({"step", "forward"})


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


class MoEBlock(nn.Module):
    """Top-k mixture of SwiGLU experts with grouped, sync-free routing. Maps ``(..., H)`` to ``(..., H)``.

    Args:
        hidden_size: ``H``.
        ffn_size: ``F`` of each expert.
        num_experts: ``E``.
        top_k: experts per token, ``1 <= top_k <= E``.
        capacity_factor: ``None`` (dropless) or a finite factor ``> 0`` of ``capacity = ceil(cf * T * k / E)``
            (at most ``T * k``, exact arithmetic).
        backend: routing kernels, ``"auto"`` (Triton on CUDA), ``"torch"`` or ``"triton"``.
        normalize: renormalise the top-k weights to sum to 1.
        score: ``"softmax"`` or ``"sigmoid"``.
        drop_policy: ``"position"`` or ``"score"`` (which overflow pairs a capacity limit drops).
        expert_bias: keep an aux-loss-free balancing bias (DeepSeek-V3) as the ``(E,)`` buffer ``expert_bias``.
        bias_update_rate: how far each update moves ``expert_bias`` toward balance, a finite number ``>= 0``.
        num_shared_experts: always-on experts added to every token's output (DeepSeek-V3); they form one SwiGLU of
            width ``shared_ffn_size``.
        shared_ffn_size: width of the shared SwiGLU; default ``num_shared_experts * ffn_size``.
        num_groups: group-limited routing: ``E`` experts in ``num_groups`` groups (needs ``topk_groups``).
        topk_groups: groups each token may use.
        route_scale: factor of the routed weights after normalisation (DeepSeek-V3's routed scaling factor).
        aux_loss: what ``last_aux_loss`` is: ``"micro_batch"`` (Switch over this forward's tokens),
            ``"sequence"`` (DeepSeek-V3's per-document balance over the packed documents of the forward's
            ``sequence_metadata``, else of the active :class:`~lightning_llmfast.seqmeta.SequenceMetadataCache`; without
            either, each row of a ``(B, S, H)`` input is a document) or ``"global"``
            (Switch with the counts summed over the micro-batches of the optimizer step so far and over the ranks of
            ``dp_group``: one all-reduce of ``E`` integers per training forward; outside training, as micro_batch).
        bias_update: ``"step"``: the counts of every training forward are summed until :meth:`finish_step`
            (called once per optimizer step, e.g. by :class:`~lightning_llmfast.callbacks.ExpertBalanceCallback`)
            sums them over ``dp_group`` and updates ``expert_bias`` once; ``"forward"``: each training forward
            updates it from its own counts (a single process without gradient accumulation only).

    Attributes:
        router: ``nn.Linear(H, E, bias=False)``; ``router.weight`` is ``(E, H)``.
        experts: :class:`~lightning_llmfast.moe.GroupedExperts` (``gate_up_proj`` ``(E, H, 2F)``, ``down_proj``
            ``(E, F, H)``).
        shared_experts: :class:`SharedExperts`, or ``None``.
        expert_bias: ``(E,)`` float32 buffer, or ``None``.
        dp_group: the data-parallel process group of the step sums (``None``: the default group).
        last_plan: the :class:`~lightning_llmfast.moe.RoutingPlan` of the last forward.
        last_aux_loss: 0-d differentiable load-balancing loss of the last forward (of the kind ``aux_loss``).
        last_z_loss: 0-d differentiable router z-loss of the last forward.
        last_tokens_per_expert: ``(E,)`` int32 kept pairs per expert of the last forward.
        last_router_logits: ``(T, E)`` router logits of the last forward.
        last_nonfinite: 0-d bool tensor, whether the last router logits had NaN/inf (checked off the hot path,
            e.g. by :class:`~lightning_llmfast.callbacks.ExpertLoadMonitor`).

    Example::

        block = MoEBlock(hidden_size=64, ffn_size=128, num_experts=8, top_k=2)
        y = block(torch.randn(2, 16, 64))  # (2, 16, 64), no host sync
        loss = y.square().mean() + 0.01 * block.last_aux_loss + 1e-3 * block.last_z_loss
    """

    # Already grouped: swap_moe_blocks leaves it (and its children) alone.
    _llmfast_grouped = True

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        top_k: int,
        *,
        capacity_factor: float | None = None,
        backend: str = "auto",
        normalize: bool = True,
        score: str = "softmax",
        drop_policy: str = "position",
        expert_bias: bool = False,
        bias_update_rate: float = 1e-3,
        num_shared_experts: int = 0,
        shared_ffn_size: int | None = None,
        num_groups: int | None = None,
        topk_groups: int | None = None,
        route_scale: float = 1.0,
        aux_loss: str = "micro_batch",
        bias_update: str = "step",
    ) -> None:
        super().__init__()
        check_moe_args(hidden_size, ffn_size, num_experts, top_k, score)
        check_block_routing_args(capacity_factor, backend, drop_policy)
        check_number("bias_update_rate", bias_update_rate, low=0)
        check_number("route_scale", route_scale, low=0, low_open=True)
        check_int("num_shared_experts", num_shared_experts, low=0)
        if shared_ffn_size is not None:
            check_int("shared_ffn_size", shared_ffn_size, low=1)
            if not num_shared_experts:
                raise ConfigError("shared_ffn_size needs num_shared_experts >= 1")
        if aux_loss not in AUX_LOSSES:
            raise ConfigError(f"aux_loss must be one of {sorted(AUX_LOSSES)}, got {aux_loss!r}")
        if bias_update not in BIAS_UPDATES:
            raise ConfigError(f"bias_update must be one of {sorted(BIAS_UPDATES)}, got {bias_update!r}")
        try:
            check_groups(num_experts, top_k, num_groups, topk_groups, None)
        except RoutingError as err:
            raise ConfigError(str(err)) from None
        self.hidden_size = hidden_size
        self.ffn_size = ffn_size
        self.num_experts = num_experts
        self.top_k = top_k
        # The float options live in one tuple (read-only properties below): torch.compile specialises the elements
        # of a tuple attribute, where float attributes become symbolic once two blocks with different values are
        # compiled, and the host-side checks in route() cannot take symbolic floats.
        self._floats = (capacity_factor, route_scale, bias_update_rate)
        self.backend = backend
        self.normalize = normalize
        self.score = score
        self.drop_policy = drop_policy
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.aux_loss = aux_loss
        self.bias_update = bias_update
        self.dp_group: dist.ProcessGroup | None = None
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, hidden_size, ffn_size)
        self.shared_experts = (
            SharedExperts(hidden_size, shared_ffn_size or num_shared_experts * ffn_size) if num_shared_experts else None
        )
        # The routed experts' call: replaced by an expert-parallel dispatch by shard_experts (moe/expert_parallel.py).
        self.expert_dispatch: Callable[..., Tensor] = routed_swiglu
        self.expert_bias: Tensor | None
        self.register_buffer("expert_bias", torch.zeros(num_experts) if expert_bias else None)
        # Pairs per expert summed over the training forwards of the current optimizer step: this rank's (for the
        # bias update) and, for aux_loss="global", summed over dp_group. Not state to checkpoint: a step's running sum.
        self._step_counts: Tensor | None
        self._global_counts: Tensor | None
        counts_for_bias = expert_bias and bias_update == "step"
        self.register_buffer("_step_counts", _zero_counts(num_experts, counts_for_bias), persistent=False)
        self.register_buffer("_global_counts", _zero_counts(num_experts, aux_loss == "global"), persistent=False)
        self._documents: dict[tuple[int, int, torch.device], SequenceMetadata] = {}
        self._forwards_since_finish = 0
        self.last_plan: RoutingPlan | None = None
        self.last_aux_loss: Tensor | None = None
        self.last_z_loss: Tensor | None = None
        self.last_tokens_per_expert: Tensor | None = None
        self.last_router_logits: Tensor | None = None
        self.last_nonfinite: Tensor | None = None

    @property
    def capacity_factor(self) -> float | None:
        """The capacity factor (``None``: dropless)."""
        return self._floats[0]

    @property
    def route_scale(self) -> float:
        """The factor of the routed weights."""
        return self._floats[1]

    @property
    def bias_update_rate(self) -> float:
        """The step of each expert-bias update."""
        return self._floats[2]

    def forward(
        self, x: Tensor, *, token_mask: Tensor | None = None, sequence_metadata: SequenceMetadata | None = None
    ) -> Tensor:
        """Route, dispatch, run the experts and combine, without a host sync.

        Args:
            x: ``(..., H)`` in the block's dtype (any float dtype under autocast).
            token_mask: ``x.shape[:-1]`` bool; False tokens (padding) go to no routed expert (their routed output is
                0) and count in no loss or count.
            sequence_metadata: the packed documents of the flattened tokens, for ``aux_loss="sequence"``.

        Returns:
            ``(..., H)``, same dtype as ``x``.

        Raises:
            RoutingError: ``x`` is not a float ``(..., H)`` tensor on the block's device, or (outside autocast)
                its dtype is not the block's: the block does not cast ``x`` itself (``nn.Linear`` neither); a
                ``token_mask`` of another shape, or metadata of another token count.
        """
        check_block_input(x, self.hidden_size, self.router.weight)
        shape = x.shape
        x = x.reshape(-1, self.hidden_size)
        if token_mask is not None:
            if not isinstance(token_mask, Tensor) or token_mask.shape != shape[:-1]:
                got = tuple(token_mask.shape) if isinstance(token_mask, Tensor) else type(token_mask).__name__
                raise RoutingError(f"token_mask must have shape {tuple(shape[:-1])} (x.shape[:-1]), got {got}")
            token_mask = token_mask.reshape(-1)
        # Cast once for router and experts: both keep this one (T, H) copy for backward (dispatch.py).
        x_compute = compute_copy(x)
        logits = self.router(x_compute)  # (T, E)
        plan = route(
            logits,
            self.top_k,
            score=self.score,
            normalize=self.normalize,
            capacity_factor=self.capacity_factor,
            drop_policy=self.drop_policy,
            expert_bias=self.expert_bias,
            validate=False,
            backend=self.backend,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            route_scale=self.route_scale,
            token_mask=token_mask,
        )
        experts = self.experts
        out = self.expert_dispatch(
            x, plan, experts.gate_up_proj, experts.down_proj, x_compute=x_compute, backend=self.backend
        )
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_compute)
        counting = self.training and not in_backward()  # not again when recomputation replays this forward
        record_plan(self, plan, logits, self._aux_loss(plan, counting, sequence_metadata, shape))
        if counting:
            self._count(plan)
        return out.to(x.dtype).reshape(shape)

    def finish_step(self, group: dist.ProcessGroup | None = None) -> None:
        """Close an optimizer step: update ``expert_bias`` once from the step's counts, reset the step sums.

        With ``bias_update="step"`` the counts summed over the step's training forwards are summed over ``group``
        (one all-reduce of ``E`` integers, no host sync) and ``expert_bias += rate * sign(mean - load)``
        (:func:`~lightning_llmfast.moe.update_expert_bias`). Call it on every rank of the group, once per step.

        Args:
            group: the data-parallel group; ``None``: ``dp_group`` (itself ``None``: the default group).

        Example::

            for micro_batch in step:
                (model(micro_batch).mean() + block.last_aux_loss).backward()
            optimizer.step()
            block.finish_step()
        """
        if self._step_counts is not None and self.expert_bias is not None and self.bias_update_rate > 0:
            group = group if group is not None else self.dp_group
            update_expert_bias(self.expert_bias, self._step_counts, self.bias_update_rate, group=group)
        for counts in (self._step_counts, self._global_counts):
            if counts is not None:
                counts.zero_()
        self._forwards_since_finish = 0

    def _aux_loss(self, plan: RoutingPlan, counting: bool, metadata: SequenceMetadata | None, shape: Size) -> Tensor:
        if self.aux_loss == "sequence":
            cache = active_cache()
            if metadata is None and cache is not None:
                metadata = cache.get(plan.router_probs)
            if metadata is None:
                metadata = self._row_documents(shape, plan.router_probs.device)
            return plan.sequence_aux_loss(metadata)
        if self.aux_loss == "global" and self.training:
            if counting:  # the replay inside backward sees the same sums as its forward did
                self._global_counts += all_reduce_counts(plan.routed_per_expert, self.dp_group)
            return plan.global_aux_loss(self._global_counts)
        return plan.aux_loss

    def _row_documents(self, shape: Size, device: torch.device) -> SequenceMetadata:
        """Each row of a ``(..., S, H)`` input (the whole input if 2-D) as one document; memoised for the last shape."""
        rows = math.prod(shape[:-2]) if len(shape) > 2 else 1
        length = shape[-2] if len(shape) > 2 else shape[0]
        key = (rows, length, device)
        metadata = self._documents.get(key)
        if metadata is None:
            metadata = SequenceMetadata.from_lengths([length] * rows, device=device)
            self._documents = {key: metadata}  # one entry: varying shapes must not grow it
        return metadata

    def _count(self, plan: RoutingPlan) -> None:
        if self.expert_bias is None or self.bias_update_rate == 0:
            return
        if self.bias_update == "forward":
            # After routing, so this forward selected with the bias it started with.
            update_expert_bias(self.expert_bias, plan.routed_per_expert, self.bias_update_rate, group=self.dp_group)
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
                stacklevel=3,
            )

    def extra_repr(self) -> str:
        return (
            f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, backend={self.backend!r}, "
            f"normalize={self.normalize}, score={self.score!r}, num_groups={self.num_groups}, "
            f"topk_groups={self.topk_groups}, route_scale={self.route_scale}, aux_loss={self.aux_loss!r}, "
            f"bias_update={self.bias_update!r}"
        )


def _zero_counts(num_experts: int, needed: bool) -> Tensor | None:
    return torch.zeros(num_experts, dtype=torch.int64) if needed else None


def record_plan(block: nn.Module, plan: RoutingPlan, logits: Tensor, aux_loss: Tensor | None = None) -> None:
    """Store a forward's routing results as the ``last_*`` attributes read by losses, metrics and callbacks.

    Args:
        block: the MoE block (ours or an adapted third-party one).
        plan: its :class:`~lightning_llmfast.moe.RoutingPlan`.
        logits: ``(T, E)`` router logits.
        aux_loss: the block's load-balancing loss; ``None``: ``plan.aux_loss``.
    """
    block.last_plan = plan
    block.last_aux_loss = plan.aux_loss if aux_loss is None else aux_loss
    block.last_z_loss = plan.z_loss
    block.last_tokens_per_expert = plan.tokens_per_expert
    block.last_router_logits = logits
    block.last_nonfinite = plan.nonfinite
