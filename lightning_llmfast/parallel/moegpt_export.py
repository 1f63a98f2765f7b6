"""The reference :class:`~lightning_llmfast.models.MoEGPT` as a transformers Mixtral model, for export.

A MoEGPT is a Mixtral: pre-norm blocks of grouped-query attention with half-split RoPE and a dropless MoE of SwiGLU
experts whose router takes the softmax over the experts, keeps the top ``k`` and renormalises them. Only the names and
layouts of the tensors differ, so a MoEGPT checkpoint (any layout: one process's ``.ckpt`` file, or a DCP directory
written by FSDP2 or a pipeline's stages, keyed by the model's names) exports to a directory
``AutoModelForCausalLM.from_pretrained`` loads as ``MixtralForCausalLM``, computing the same logits:

============================================  ==================================================================
MoEGPT (``layers.i.``)                        Mixtral in memory (``model.layers.i.``)
============================================  ==================================================================
``attn.qkv.weight`` ``((h + 2 g) d, H)``      ``self_attn.q_proj`` / ``k_proj`` / ``v_proj.weight``: its row blocks
``attn.proj.weight``                          ``self_attn.o_proj.weight``
``attn_norm.weight`` / ``ffn_norm.weight``    ``input_layernorm.weight`` / ``post_attention_layernorm.weight``
``ffn.router.weight``                         ``mlp.gate.weight``
``ffn.experts.gate_up_proj`` ``(E, H, 2F)``   ``mlp.experts.gate_up_proj`` ``(E, 2F, H)``: transposed
``ffn.experts.down_proj`` ``(E, F, H)``       ``mlp.experts.down_proj`` ``(E, H, F)``: transposed
``embed.weight``, ``norm.weight``             ``model.embed_tokens.weight``, ``model.norm.weight``
============================================  ==================================================================

A model Mixtral cannot express is refused: dense layers (``dense_layers``) and capacity-limited routing
(``capacity_factor``, which drops tokens that Mixtral would route).

Example::

    config = mixtral_config(moegpt_config)
    shapes, read = mixtral_source(moegpt_config, moegpt_shapes, read_moegpt)  # keyed by Mixtral's names
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import MixtralConfig

from lightning_llmfast.errors import CheckpointError, ConfigError
from lightning_llmfast.models import MoEGPTConfig

__all__ = ["mixtral_config", "mixtral_source"]

Reader = Callable[[list[str]], dict[str, Tensor]]
# How a Mixtral tensor comes from a MoEGPT one: its key, and None (as it is), "T" (the last two dimensions swapped)
# or a (start, stop) block of rows.
_Recipe = tuple[str, str | tuple[int, int] | None]


def mixtral_config(config: MoEGPTConfig) -> MixtralConfig:
    """The Mixtral configuration of a MoEGPT's hyper-parameters.

    Raises:
        ConfigError: dense layers or capacity-limited routing (no Mixtral has them).

    Example::

        mixtral_config(MoEGPTConfig(n_layers=2)).num_local_experts  # 8
    """
    refused = {
        f"layers {config.dense_layers} are dense; a Mixtral has an MoE block in every layer": config.dense_layers,
        f"routes with capacity_factor={config.capacity_factor} (dropping tokens); a Mixtral is dropless, so the "
        "export would compute another function": config.capacity_factor is not None,
    }
    for why, applies in refused.items():
        if applies:
            raise ConfigError(f"export: this MoEGPT {why}")
    return MixtralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_size,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        num_local_experts=config.num_experts,
        num_experts_per_tok=config.top_k,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        initializer_range=config.init_std,
        tie_word_embeddings=config.tie_embeddings,
        sliding_window=None,
        router_jitter_noise=0.0,
        architectures=["MixtralForCausalLM"],
    )


def _recipes(config: MoEGPTConfig) -> dict[str, _Recipe]:
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    out: dict[str, _Recipe] = {
        "model.embed_tokens.weight": ("embed.weight", None),
        "model.norm.weight": ("norm.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
    }
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out |= {
            theirs + "self_attn.q_proj.weight": (ours + "attn.qkv.weight", (0, q)),
            theirs + "self_attn.k_proj.weight": (ours + "attn.qkv.weight", (q, q + kv)),
            theirs + "self_attn.v_proj.weight": (ours + "attn.qkv.weight", (q + kv, q + 2 * kv)),
            theirs + "self_attn.o_proj.weight": (ours + "attn.proj.weight", None),
            theirs + "input_layernorm.weight": (ours + "attn_norm.weight", None),
            theirs + "post_attention_layernorm.weight": (ours + "ffn_norm.weight", None),
            theirs + "mlp.gate.weight": (ours + "ffn.router.weight", None),
            theirs + "mlp.experts.gate_up_proj": (ours + "ffn.experts.gate_up_proj", "T"),
            theirs + "mlp.experts.down_proj": (ours + "ffn.experts.down_proj", "T"),
        }
    return out


def mixtral_source(config: MoEGPTConfig, shapes: Mapping[str, Any], read: Reader) -> tuple[dict[str, Tensor], Reader]:
    """A MoEGPT checkpoint's tensors under Mixtral's in-memory names and layouts, read on demand.

    Args:
        config: the MoEGPT's hyper-parameters.
        shapes: the checkpoint's MoEGPT tensors (``embed.weight``, ``layers.0.attn.qkv.weight``, ...): anything with
            ``shape`` and ``dtype``.
        read: MoEGPT keys -> their tensors.

    Returns:
        Mixtral keys -> meta tensors of their shapes and dtypes, and a reader of Mixtral keys (each MoEGPT tensor
        read once per call).

    Raises:
        CheckpointError: the checkpoint lacks a tensor the model has (another model than its config).

    Example::

        shapes, read = mixtral_source(config, moegpt_shapes, read_moegpt)
        read(["model.layers.0.self_attn.k_proj.weight"])
    """
    recipes = {key: recipe for key, recipe in _recipes(config).items() if recipe[0] in shapes}
    missing = sorted({source for source, _ in _recipes(config).values()} - set(shapes))
    if missing and missing != ["lm_head.weight"]:  # a tied head may be saved once, as the embedding
        raise CheckpointError(f"the checkpoint lacks MoEGPT tensors {missing[:5]} (another model than its config?)")

    def shape(key: str) -> Tensor:
        source, how = recipes[key]
        size = tuple(shapes[source].shape)
        if how == "T":
            size = (*size[:-2], size[-1], size[-2])
        elif isinstance(how, tuple):
            size = (how[1] - how[0], *size[1:])
        return torch.empty(size, dtype=shapes[source].dtype, device="meta")

    def convert(keys: list[str]) -> dict[str, Tensor]:
        tensors = read(sorted({recipes[key][0] for key in keys}))
        out = {}
        for key in keys:
            source, how = recipes[key]
            tensor = tensors[source]
            if how == "T":
                tensor = tensor.transpose(-1, -2)
            elif isinstance(how, tuple):
                tensor = tensor[how[0] : how[1]]
            out[key] = tensor.contiguous()
        return out

    return {key: shape(key) for key in recipes}, convert
