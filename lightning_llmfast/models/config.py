"""The hyper-parameters of the reference MoE GPT, checked at construction.

Both the model (:mod:`lightning_llmfast.models.model`) and its feed-forward layers
(:mod:`lightning_llmfast.models.ffn`) read them, so they sit below both.

Example::

    config = MoEGPTConfig(n_layers=2, num_experts=4)
    config.head_dim  # hidden_size // n_heads
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from lightning_llmfast._checks import check_bool, check_int, check_number
from lightning_llmfast.data import VOCAB_SIZE
from lightning_llmfast.errors import ConfigError

__all__ = ["MoEGPTConfig"]

_ATTENTION_METADATA = ("per_layer", "dense", "cached")
_ROUTER_BACKENDS = ("naive", "torch", "triton", "auto")


@dataclass
class MoEGPTConfig:
    """Hyper-parameters of :class:`MoEGPT`. The defaults are a small model for CPU runs.

    Every field is checked at construction (:class:`~lightning_llmfast.errors.ConfigError` naming the field): sizes
    are ints >= 1, ``capacity_factor`` and ``rope_theta`` finite numbers > 0, ``norm_eps`` and ``init_std`` finite
    numbers >= 0, ``dense_layers`` layer indices.

    Args:
        vocab_size: token ids are in ``[0, vocab_size)``.
        hidden_size: model width; must split into ``n_heads`` heads of even size.
        n_layers: number of transformer layers.
        n_heads: query heads per attention layer.
        n_kv_heads: key/value heads (grouped-query attention); must divide ``n_heads``.
        ffn_size: hidden width of each expert's (and each dense layer's) SwiGLU feed-forward.
        num_experts: experts per MoE layer.
        top_k: experts each token is routed to; at most ``num_experts``.
        dense_layers: indices of layers that get a dense SwiGLU feed-forward instead of an MoE one.
        capacity_factor: ``null`` for dropless routing, else each expert keeps at most this times its fair share.
        rope_theta: base of the rotary position embedding; > 0.
        norm_eps: epsilon of the RMS norms; >= 0.
        init_std: standard deviation of the weight initialisation; >= 0.
        tie_embeddings: share the input embedding and the output projection.
        attention_metadata: ``cached`` (one metadata per batch, varlen attention), ``dense`` or ``per_layer``.
        router_backend: ``auto``, ``torch`` or ``triton`` (grouped, sync-free), or ``naive`` (the baseline).

    Example::

        config = MoEGPTConfig(n_layers=2, num_experts=4, router_backend="naive")
        model = MoEGPT(config)
    """

    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_size: int = 256
    num_experts: int = 8
    top_k: int = 2
    dense_layers: list[int] = field(default_factory=list)
    capacity_factor: float | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = True
    attention_metadata: str = "cached"
    router_backend: str = "auto"

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_size",
            "num_experts",
            "top_k",
        )
        for name in positive:
            check_int(f"MoEGPTConfig.{name}", getattr(self, name), low=1)
        if self.capacity_factor is not None:
            check_number("MoEGPTConfig.capacity_factor", self.capacity_factor, low=0, low_open=True)
        check_number("MoEGPTConfig.rope_theta", self.rope_theta, low=0, low_open=True)
        check_number("MoEGPTConfig.norm_eps", self.norm_eps, low=0)
        check_number("MoEGPTConfig.init_std", self.init_std, low=0)
        check_bool("MoEGPTConfig.tie_embeddings", self.tie_embeddings)
        if isinstance(self.dense_layers, (str, bytes)) or not isinstance(self.dense_layers, Iterable):
            raise ConfigError(f"MoEGPTConfig.dense_layers must be a list of layer indices, got {self.dense_layers!r}")
        # Any iterable of ints (a range, a NumPy array), kept as a list of Python ints.
        self.dense_layers = [check_int("MoEGPTConfig.dense_layers entry", index) for index in self.dense_layers]
        if self.hidden_size % self.n_heads or (self.hidden_size // self.n_heads) % 2:
            raise ConfigError(
                f"MoEGPTConfig.hidden_size ({self.hidden_size}) must split into n_heads ({self.n_heads}) heads of "
                "even size (RoPE)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"MoEGPTConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.top_k > self.num_experts:
            raise ConfigError(f"MoEGPTConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.attention_metadata not in _ATTENTION_METADATA:
            raise ConfigError(
                f"MoEGPTConfig.attention_metadata must be one of {_ATTENTION_METADATA}, got {self.attention_metadata!r}"
            )
        if self.router_backend not in _ROUTER_BACKENDS:
            raise ConfigError(
                f"MoEGPTConfig.router_backend must be one of {_ROUTER_BACKENDS}, got {self.router_backend!r}"
            )
        if self.router_backend == "naive" and self.capacity_factor is not None:
            raise ConfigError(
                "MoEGPTConfig.router_backend='naive' is dropless; capacity_factor needs a grouped backend"
            )
        bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ConfigError(f"MoEGPTConfig.dense_layers {bad} out of range for n_layers={self.n_layers}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads


# Checkpoints store the config among the hyper-parameters: a safe global for torch.load(weights_only=True),
# Lightning's default, from the config's import on, so resuming and exporting need no unsafe loading.
torch.serialization.add_safe_globals([MoEGPTConfig])
