"""Swap third-party MoE blocks for grouped, sync-free ones that share their parameters.

An *adapter* is a callable ``adapter(block) -> nn.Module`` returning a replacement that holds the very same
``Parameter`` objects under the same state-dict keys (no copies: optimizers, checkpoints and tied weights keep
working) and computes the same function with :func:`~lightning_llmfast.moe.route`, :func:`~lightning_llmfast.moe.
permute` and grouped expert GEMMs. Built in: this package's :class:`~lightning_llmfast.moe.NaiveMoEBlock` and, when
``transformers`` is loaded, the transformers 5 sparse-MoE blocks of Mixtral, MiniMax, Qwen2-MoE, Qwen3-MoE,
Qwen3-Next, Qwen3-Omni-MoE, OLMoE, FlexOlmo and Mellum (softmax top-k) and of DeepSeek-V3, DeepSeek-V3.2, GLM-4-MoE
(and -Lite, 4V-MoE, MoE-DSA), dots1, EXAONE-MoE, Kimi-Linear, Solar-Open and Bailing-Hybrid (DeepSeek-V3 routing:
sigmoid scores, correction bias, group-limited top-k, routed scaling, shared experts). All share the transformers 5
layout: fused 3-D ``experts.gate_up_proj`` ``(E, 2F, H)`` and ``experts.down_proj`` ``(E, H, F)``, router
``gate.weight`` ``(E, H)``.

Example::

    from lightning_llmfast.moe.adapters import swap_moe_blocks

    model = MixtralForCausalLM(config)
    num_swapped = swap_moe_blocks(model)  # one per MoE layer
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.moe.block import GroupedMoE
from lightning_llmfast.moe.checks import check_block_input
from lightning_llmfast.moe.config import MoEConfig, RoutingConfig
from lightning_llmfast.moe.dispatcher import TokenDispatcher
from lightning_llmfast.moe.kernels import BACKENDS

__all__ = [
    "HFGroupedMoeBlock",
    "get_moe_adapter",
    "looks_like_moe",
    "register_moe_adapter",
    "swap_moe_blocks",
]

Adapter = Callable[..., nn.Module]

_ADAPTERS: dict[type, Adapter] = {}
# Replacements made by swap_moe_blocks (user adapters' included): a second pass neither swaps nor warns about them.
_SWAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()

# (model, class) of the transformers blocks we adapt, in transformers.models.<model>.modeling_<model>. They are looked
# up in sys.modules only: a model holding one has imported its module already, and importing transformers ourselves
# would cost seconds for nothing. Softmax top-k routers (Mixtral, Qwen2/3-MoE, OLMoE and the families whose block,
# router and experts code is theirs), optionally with a gated shared expert:
_HF_SOFTMAX_BLOCKS: tuple[tuple[str, str], ...] = (
    ("mixtral", "MixtralSparseMoeBlock"),
    ("minimax", "MiniMaxSparseMoeBlock"),
    ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    ("qwen3_next", "Qwen3NextSparseMoeBlock"),
    ("qwen3_omni_moe", "Qwen3OmniMoeThinkerTextSparseMoeBlock"),
    ("qwen3_omni_moe", "Qwen3OmniMoeTalkerTextSparseMoeBlock"),
    ("qwen4_exp", "Qwen4ExpTextSparseMoeBlock"),
    ("mellum", "MellumSparseMoeBlock"),
    ("olmoe", "OlmoeSparseMoeBlock"),
    ("flex_olmo", "FlexOlmoSparseMoeBlock"),
)
# DeepSeek-V3 routers (sigmoid scores, correction bias, group-limited top-k, routed scaling) with shared experts:
_HF_DEEPSEEK_BLOCKS: tuple[tuple[str, str], ...] = (
    ("deepseek_v3", "DeepseekV3MoE"),
    ("deepseek_v32", "DeepseekV32MoE"),
    ("bailing_hybrid", "BailingHybridMoE"),
    ("dots1", "Dots1MoE"),
    ("dots3_note", "Dots3NoteTextMoE"),
    ("exaone_moe", "ExaoneMoeSparseMoEBlock"),
    ("glm4_moe", "Glm4MoeMoE"),
    ("glm4_moe_lite", "Glm4MoeLiteMoE"),
    ("glm4v_moe", "Glm4vMoeTextMoE"),
    ("glm_moe_dsa", "GlmMoeDsaMoE"),
    ("kimi_linear", "KimiLinearMoE"),
    ("solar_open", "SolarOpenMoE"),
)
# DeepSeek-V3 sums each group's 2 best scores (its top_k // topk_groups = 8 // 4); transformers hard-codes the 2.
_HF_GROUP_TOPK = 2

# Class names of MoE-looking modules we do not know (warned about): sparse-MoE blocks and expert containers.
_MOE_NAME = re.compile(r"SparseMoe|Mo[Ee](Block|Layer|MLP|FeedForward)|Mo[Ee]$|Experts$")


def register_moe_adapter(block_class: type[nn.Module], adapter: Adapter) -> None:
    """Teach :func:`swap_moe_blocks` (and :class:`~lightning_llmfast.GroupedRouterMixin`) a new MoE block class.

    Args:
        block_class: the class to replace (subclasses match too, unless they have their own adapter).
        adapter: ``adapter(block) -> nn.Module``, the replacement; it also gets the routing backend as
            ``backend=...`` when it accepts that keyword. The replacement must share the block's parameters (the
            same ``Parameter`` objects under the same state-dict keys) and compute the same function.

    Raises:
        ConfigError: ``block_class`` is not an ``nn.Module`` subclass or ``adapter`` is not callable.

    Example::

        register_moe_adapter(MyMoE, lambda block: MyGroupedMoE.from_block(block))
    """
    if not (isinstance(block_class, type) and issubclass(block_class, nn.Module)):
        raise ConfigError(f"block_class must be an nn.Module subclass, got {block_class!r}")
    if not callable(adapter):
        raise ConfigError(f"adapter must be a callable(block) -> nn.Module, got {adapter!r}")
    _ADAPTERS[block_class] = adapter


def get_moe_adapter(block: nn.Module) -> Adapter | None:
    """The adapter registered for ``block``'s class (or its nearest registered base class), else ``None``.

    Example::

        get_moe_adapter(NaiveMoEBlock(8, 16, 4, 2))  # the built-in adapter (registered by moe.naive)
    """
    _register_loaded_hf_adapters()
    for cls in type(block).__mro__:
        adapter = _ADAPTERS.get(cls)
        if adapter is not None:
            return adapter
    return None


def looks_like_moe(module: nn.Module) -> bool:
    """Heuristic for unknown MoE blocks: an ``experts`` child next to a ``gate``/``router``, or an MoE-ish name."""
    children = dict(module.named_children())
    structural = "experts" in children and ("gate" in children or "router" in children)
    return structural or _MOE_NAME.search(type(module).__name__) is not None


def swap_moe_blocks(model: nn.Module, backend: str = "auto") -> int:
    """Replace, in place, every recognised MoE block inside ``model`` with its grouped equivalent.

    Recognised: classes with a registered adapter (:func:`register_moe_adapter`; this package's naive block and the
    loaded transformers blocks are built in). Modules already swapped are left alone, so calling it twice is safe.
    Unknown modules that look like MoE blocks (:func:`looks_like_moe`) are left as they are, with a warning.

    Args:
        model: any module tree (``model`` itself is never replaced).
        backend: routing backend of the replacements: ``"auto"``, ``"torch"`` or ``"triton"``.

    Returns:
        The number of blocks swapped.

    Raises:
        ConfigError: unknown ``backend``.

    Example::

        model = MoEGPT(MoEGPTConfig(router_backend="naive"))
        swap_moe_blocks(model)  # == number of MoE layers
    """
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    return _swap_children(model, backend)


def _swap_children(parent: nn.Module, backend: str, prefix: str = "") -> int:
    swapped = 0
    for name, child in list(parent.named_children()):
        path = f"{prefix}{name}"
        if isinstance(child, GroupedMoE) or child in _SWAPPED:
            continue
        adapter = get_moe_adapter(child)
        if adapter is not None:
            replacement = adapter(child, backend=backend) if _takes_backend(adapter) else adapter(child)
            _SWAPPED.add(replacement)
            setattr(parent, name, replacement)
            swapped += 1
        elif looks_like_moe(child):
            warnings.warn(
                f"{type(child).__qualname__} at {path!r} looks like an MoE block but has no adapter; left unchanged "
                "(register one with lightning_llmfast.register_moe_adapter)",
                UserWarning,
                stacklevel=2,
            )
        else:
            swapped += _swap_children(child, backend, f"{path}.")
    return swapped


def _takes_backend(adapter: Adapter) -> bool:
    """Whether ``adapter`` accepts the ``backend`` keyword (plain ``adapter(block)`` callables are fine too)."""
    try:
        params = inspect.signature(adapter).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return False
    return any(p.name == "backend" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


# ----------------------------------------------------------------------------------------------------------------
# Built-in adapters
# ----------------------------------------------------------------------------------------------------------------


class HFGroupedMoeBlock(GroupedMoE):
    """Grouped, sync-free replacement of a transformers 5 sparse-MoE block, sharing its submodules.

    The same route -> dispatch -> record path as :class:`~lightning_llmfast.moe.MoEBlock`, over the transformers
    weights. The block's children (``gate``, ``experts`` and, for Qwen2-MoE, ``shared_expert``/``shared_expert_gate``,
    for DeepSeek-V3 ``shared_experts``) are re-registered here in their original order, so the state-dict keys and
    ``Parameter`` objects are the original ones. The fused expert weights are used through transposed views
    (``(E, 2F, H)`` -> ``(E, H, 2F)``), never copied. The router module is still called (its forward hooks record
    ``output_router_logits``); its top-k is recomputed by :func:`~lightning_llmfast.moe.route`, which costs one
    ``(T, E)`` softmax, far below the GEMMs.

    Args:
        block: the transformers block (``gate`` with ``weight``/``top_k``, ``experts`` with ``gate_up_proj``,
            ``down_proj``, ``act_fn``).
        normalize: renormalise the top-k weights (Mixtral always does; the others follow ``gate.norm_topk_prob``).
        backend: routing backend.
        deepseek: route as DeepSeek-V3's router does, with its ``e_score_correction_bias`` (read at every
            forward, not updated), ``num_group``/``topk_group`` and ``routed_scaling_factor``.
        dispatcher: how tokens reach the experts (default: all experts local).

    Attributes:
        stats: the last forward's :class:`~lightning_llmfast.moe.MoEStats`.

    Raises:
        ConfigError: not transformers>=5 fused experts, or routing options our router cannot take.

    Example::

        block = HFGroupedMoeBlock(model.model.layers[0].mlp, normalize=True)
    """

    def __init__(
        self,
        block: nn.Module,
        *,
        normalize: bool,
        backend: str = "auto",
        deepseek: bool = False,
        dispatcher: TokenDispatcher | None = None,
    ) -> None:
        super().__init__(_hf_config(block, normalize, backend, deepseek), dispatcher)
        for name, child in block.named_children():
            self.add_module(name, child)
        for name, param in block.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in block.named_buffers(recurse=False):
            self.register_buffer(name, buf)
        self.deepseek = deepseek
        self.jitter_noise: float = getattr(block, "jitter_noise", 0.0)
        act = block.experts.act_fn
        # HF's SiLUActivation and nn.SiLU compute F.silu; passing the function itself selects the fused SwiGLU.
        self._act: Callable[[Tensor], Tensor] = (
            F.silu if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" else act
        )
        self.train(block.training)

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Same contract as the transformers block.

        Args:
            hidden_states: ``(batch, seq, H)`` (any ``(..., H)``).

        Returns:
            ``(batch, seq, H)``.
        """
        router = self.gate.weight  # (E, H)
        check_block_input(hidden_states, router.shape[1], router, name="hidden_states")
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            # Mixtral's multiplicative router jitter, drawn exactly as the original block draws it.
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        out = self._moe(hidden_states.reshape(-1, shape[-1]), None, None, shape)
        # A fresh tensor, not a view of the (T, H) rows: FSDP2 (which wraps this block under expert parallelism) hooks
        # its pre-backward all-gather on the output, and an in-place op on a view would silently drop that hook.
        return out.reshape(shape).clone()

    def _router_logits(self, x_compute: Tensor) -> Tensor:
        return self.gate(x_compute)[0]

    def _selection_bias(self) -> Tensor | None:
        return self.gate.e_score_correction_bias if self.deepseek else None

    def _expert_weights(self) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
        return self.experts.gate_up_proj.transpose(1, 2), self.experts.down_proj.transpose(1, 2), self._act

    def _shared_output(self, x_compute: Tensor) -> Tensor | None:
        if hasattr(self, "shared_expert"):
            return F.sigmoid(self.shared_expert_gate(x_compute)) * self.shared_expert(x_compute)
        if hasattr(self, "shared_experts"):
            return self.shared_experts(x_compute)
        return None


def _hf_config(block: nn.Module, normalize: bool, backend: str, deepseek: bool) -> MoEConfig:
    """The :class:`MoEConfig` of a transformers block (checked to have the fused 3-D expert layout)."""
    experts = getattr(block, "experts", None)
    gate_up = getattr(experts, "gate_up_proj", None)
    if not isinstance(gate_up, Tensor) or gate_up.dim() != 3 or getattr(experts, "has_bias", False):
        raise ConfigError(
            f"{type(block).__qualname__}: expected transformers>=5 fused experts (3-D experts.gate_up_proj, "
            "no expert biases)"
        )
    gate = block.gate
    num_experts, hidden = gate.weight.shape
    options = {}
    if deepseek:
        options = {
            "score": "sigmoid",
            "num_groups": gate.num_group,
            "topk_groups": gate.topk_group,
            "group_topk": min(_HF_GROUP_TOPK, num_experts // gate.num_group),
            "route_scale": gate.routed_scaling_factor,
        }
    routing = RoutingConfig(top_k=gate.top_k, normalize=normalize, backend=backend, **options)
    return MoEConfig(hidden, gate_up.shape[1] // 2, num_experts, routing)


def _adapt_hf(block: nn.Module, backend: str = "auto") -> HFGroupedMoeBlock:
    # Mixtral's router has no norm_topk_prob and always renormalises; Qwen2/3-MoE and OLMoE make it a config flag.
    return HFGroupedMoeBlock(block, normalize=getattr(block.gate, "norm_topk_prob", True), backend=backend)


def _adapt_hf_deepseek(block: nn.Module, backend: str = "auto") -> HFGroupedMoeBlock:
    return HFGroupedMoeBlock(block, normalize=block.gate.norm_topk_prob, backend=backend, deepseek=True)


def _register_loaded_hf_adapters() -> None:
    for blocks, adapter in ((_HF_SOFTMAX_BLOCKS, _adapt_hf), (_HF_DEEPSEEK_BLOCKS, _adapt_hf_deepseek)):
        for model, class_name in blocks:
            cls = getattr(sys.modules.get(f"transformers.models.{model}.modeling_{model}"), class_name, None)
            if cls is not None and cls not in _ADAPTERS:
                _ADAPTERS[cls] = adapter
