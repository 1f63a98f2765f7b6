"""The MoE block's configuration: :class:`RoutingConfig` (how tokens pick experts) inside :class:`MoEConfig`.

Both are frozen dataclasses validated at construction, so a bad setting fails where it is written, with a
:class:`~lightning_llmfast.errors.ConfigError` naming the field, never at the first forward.

Example::

    routing = RoutingConfig(top_k=2, capacity_factor=1.25)
    block = MoEBlock(MoEConfig(hidden_size=64, ffn_size=128, num_experts=8, routing=routing))
    plan = route(logits, routing)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.moe.kernels import BACKENDS
from lightning_llmfast.moe.selection import check_groups

__all__ = ["AUX_LOSSES", "BIAS_UPDATES", "DROP_POLICIES", "SCORES", "MoEConfig", "RoutingConfig"]

SCORES: frozenset[str] = frozenset({"softmax", "sigmoid"})
DROP_POLICIES: frozenset[str] = frozenset({"position", "score"})
AUX_LOSSES: frozenset[str] = frozenset({"micro_batch", "sequence", "global"})
BIAS_UPDATES: frozenset[str] = frozenset({"step", "forward"})


def _freeze_floats(config: object, names: tuple[str, ...]) -> None:
    """Keep the float fields also as one tuple, ``config.floats``, read by the code that runs compiled.

    ``torch.compile`` turns a float attribute symbolic once two values have been compiled (two blocks with different
    factors), and the host-side arithmetic on them (the capacity, the checks) cannot take symbolic floats; the
    elements of a tuple are specialised instead.
    """
    object.__setattr__(config, "floats", tuple(getattr(config, name) for name in names))


def _check_choice(name: str, value: object, choices: frozenset[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {sorted(choices)}, got {value!r}")


@dataclass(frozen=True)
class RoutingConfig:
    """How :func:`~lightning_llmfast.moe.route` picks and limits each token's experts.

    Args:
        top_k: experts per token, an int ``>= 1`` (``<= num_experts``, checked against the logits or the block).
        score: ``"softmax"`` (over experts) or ``"sigmoid"`` (independent per expert, DeepSeek-V3 style).
        normalize: renormalise the k selected weights of each token to sum to one.
        capacity_factor: ``None`` for dropless routing; else each expert keeps at most
            ``min(max(ceil(capacity_factor * T * k / E), min_capacity), T * k)`` pairs (exact arithmetic).
        min_capacity: floor of the capacity (needs ``capacity_factor``), an int ``>= 0``.
        drop_policy: which overflow pairs a capacity limit drops: ``"position"`` (later tokens first) or
            ``"score"`` (lowest weights first).
        num_groups: group-limited routing (DeepSeek-V3): ``E`` experts in ``num_groups`` equal groups (with
            ``topk_groups``).
        topk_groups: groups each token may route to.
        group_topk: scores summed per group; default ``max(1, top_k // topk_groups)``.
        route_scale: factor of the weights after the normalisation, a finite number ``> 0``.
        backend: routing kernels: ``"auto"`` (Triton on CUDA), ``"torch"`` or ``"triton"``.

    Raises:
        ConfigError: naming the field and the value.

    Example::

        routing = RoutingConfig(top_k=8, score="sigmoid", num_groups=8, topk_groups=4, route_scale=2.5)
    """

    top_k: int
    score: str = "softmax"
    normalize: bool = True
    capacity_factor: float | None = None
    min_capacity: int | None = None
    drop_policy: str = "position"
    num_groups: int | None = None
    topk_groups: int | None = None
    group_topk: int | None = None
    route_scale: float = 1.0
    backend: str = "auto"

    def __post_init__(self) -> None:
        check_int("top_k", self.top_k, low=1)
        _check_choice("score", self.score, SCORES)
        check_bool("normalize", self.normalize)
        if self.capacity_factor is not None:
            check_number("capacity_factor", self.capacity_factor, low=0, low_open=True)
        if self.min_capacity is not None:
            if self.capacity_factor is None:
                raise ConfigError("min_capacity needs a capacity_factor (dropless routing has no capacity)")
            check_int("min_capacity", self.min_capacity, low=0)
        _check_choice("drop_policy", self.drop_policy, DROP_POLICIES)
        for name in ("num_groups", "topk_groups", "group_topk"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=1)
        if (self.num_groups is None) != (self.topk_groups is None):
            raise ConfigError(f"num_groups and topk_groups go together, got {self.num_groups=} and {self.topk_groups=}")
        if self.group_topk is not None and self.num_groups is None:
            raise ConfigError("group_topk needs num_groups and topk_groups (group-limited routing)")
        check_number("route_scale", self.route_scale, low=0, low_open=True)
        _check_choice("backend", self.backend, BACKENDS)
        _freeze_floats(self, ("capacity_factor", "route_scale"))

    def check_experts(self, num_experts: int, error: type[ValueError] = ConfigError) -> None:
        """Check the options that depend on the number of experts (``top_k <= E``, the groups).

        Raises:
            ConfigError (or ``error``): ``top_k`` above ``num_experts`` or group options that do not fit.

        Example::

            RoutingConfig(top_k=2).check_experts(8)
        """
        if self.top_k > num_experts:
            raise error(f"top_k must be an int in [1, num_experts={num_experts}], got {self.top_k!r}")
        try:
            check_groups(num_experts, self.top_k, self.num_groups, self.topk_groups, self.group_topk)
        except RoutingError as err:
            raise error(str(err)) from None

    @classmethod
    def from_options(cls, top_k: int, **options: Any) -> RoutingConfig:
        """The config of the keyword form ``route(logits, top_k, score=..., ...)``; unknown keywords raise.

        Raises:
            ConfigError: an unknown option or a bad value.

        Example::

            RoutingConfig.from_options(2, capacity_factor=1.0)
        """
        unknown = sorted(set(options) - _ROUTING_FIELDS)
        if unknown:
            raise ConfigError(f"unknown routing option(s) {unknown}; known: {sorted(_ROUTING_FIELDS)}")
        return cls(top_k=top_k, **options)


_ROUTING_FIELDS = frozenset(f.name for f in dataclasses.fields(RoutingConfig)) - {"top_k"}


@dataclass(frozen=True)
class MoEConfig:
    """Every setting of a :class:`~lightning_llmfast.moe.MoEBlock`: sizes, routing, balancing and shared experts.

    Args:
        hidden_size: ``H``.
        ffn_size: ``F`` of each expert.
        num_experts: ``E``.
        routing: the :class:`RoutingConfig` (``top_k <= E`` and the group options are checked against ``E``).
        expert_bias: keep an aux-loss-free balancing bias (DeepSeek-V3) as the ``(E,)`` buffer ``expert_bias``.
        bias_update_rate: how far each update moves ``expert_bias`` toward balance, a finite number ``>= 0``.
        bias_update: ``"step"``: the counts of a step's training forwards are summed until ``finish_step()``
            updates the bias once; ``"forward"``: every training forward updates it from its own counts.
        aux_loss: what ``stats.aux_loss`` is: ``"micro_batch"`` (Switch over this forward's tokens), ``"sequence"``
            (DeepSeek-V3's per-document balance over the boundaries passed to the forward; without them, each row
            of a ``(B, S, H)`` input is a document) or ``"global"`` (Switch with the counts summed over the step's
            micro-batches and the data-parallel ranks).
        num_shared_experts: always-on experts added to every token's output; they form one SwiGLU of width
            ``shared_ffn_size``.
        shared_ffn_size: width of the shared SwiGLU; default ``num_shared_experts * ffn_size``.
        cuda_graphs: on CUDA, run the block's route -> experts -> combine path as CUDA graphs
            (``torch.compile(mode="reduce-overhead", fullgraph=True)``: captured once per input shape, replayed after;
            fixed packed ``(B, T)`` batches keep one graph). Refused (:class:`~lightning_llmfast.errors.ConfigError`)
            where capture would be wrong: a dispatcher other than the local one (the dropless all-to-all reads split
            sizes on the host), ``aux_loss="global"`` and ``bias_update="forward"`` (collectives in the captured
            forward), and experts that take the per-expert loop (float64: offsets read on the host). Without CUDA
            the block runs as without it.

    Raises:
        ConfigError: naming the field and the value.

    Example::

        config = MoEConfig(64, 128, 8, RoutingConfig(top_k=2), num_shared_experts=1)
    """

    hidden_size: int
    ffn_size: int
    num_experts: int
    routing: RoutingConfig = field(default_factory=lambda: RoutingConfig(top_k=2))
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    bias_update: str = "step"
    aux_loss: str = "micro_batch"
    num_shared_experts: int = 0
    shared_ffn_size: int | None = None
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_size", "num_experts"):
            check_int(name, getattr(self, name), low=1)
        if not isinstance(self.routing, RoutingConfig):
            raise ConfigError(f"routing must be a RoutingConfig, got {type(self.routing).__name__}")
        self.routing.check_experts(self.num_experts)
        check_bool("expert_bias", self.expert_bias)
        check_number("bias_update_rate", self.bias_update_rate, low=0)
        _check_choice("bias_update", self.bias_update, BIAS_UPDATES)
        _check_choice("aux_loss", self.aux_loss, AUX_LOSSES)
        check_int("num_shared_experts", self.num_shared_experts, low=0)
        if self.shared_ffn_size is not None:
            check_int("shared_ffn_size", self.shared_ffn_size, low=1)
            if not self.num_shared_experts:
                raise ConfigError("shared_ffn_size needs num_shared_experts >= 1")
        check_bool("cuda_graphs", self.cuda_graphs)
        if self.cuda_graphs and (self.aux_loss == "global" or (self.expert_bias and self.bias_update == "forward")):
            what = "aux_loss='global'" if self.aux_loss == "global" else "bias_update='forward'"
            raise ConfigError(
                f"cuda_graphs=True cannot capture {what}: it all-reduces counts inside the forward; use "
                "aux_loss='micro_batch' or 'sequence' and bias_update='step' (finish_step runs outside the graph)"
            )
        _freeze_floats(self, ("bias_update_rate",))

    @property
    def shared_width(self) -> int:
        """Width of the shared SwiGLU (0 without shared experts)."""
        return self.shared_ffn_size or self.num_shared_experts * self.ffn_size

    @classmethod
    def build(cls, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, **options: Any) -> MoEConfig:
        """The keyword form: block and routing options in one flat list, sorted into the two configs.

        Raises:
            ConfigError: an unknown option or a bad value.

        Example::

            block = MoEBlock(MoEConfig.build(64, 128, 8, 2, capacity_factor=1.0, num_shared_experts=1))
        """
        routing = {k: options.pop(k) for k in list(options) if k in _ROUTING_FIELDS}
        unknown = sorted(set(options) - _BLOCK_FIELDS)
        if unknown:
            raise ConfigError(f"unknown MoE option(s) {unknown}; known: {sorted(_BLOCK_FIELDS | _ROUTING_FIELDS)}")
        return cls(hidden_size, ffn_size, num_experts, RoutingConfig(top_k=top_k, **routing), **options)


_BLOCK_FIELDS = frozenset(f.name for f in dataclasses.fields(MoEConfig)) - {
    "hidden_size",
    "ffn_size",
    "num_experts",
    "routing",
}
