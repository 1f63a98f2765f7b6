"""Key mapping between a transformers model in memory and its checkpoint on disk, one table per family.

transformers 5 holds the routed experts of an MoE block fused, as 3-D tensors ``experts.gate_up_proj`` ``(E, 2F, H)``
(gate rows first, then up rows) and ``experts.down_proj`` ``(E, H, F)``, while ``save_pretrained`` writes them back
per expert, as the original checkpoints have them: ``experts.<e>.gate_proj.weight`` ``(F, H)``, ``up_proj``,
``down_proj`` (Mixtral: ``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2``, and ``block_sparse_moe`` for ``mlp``).
A :class:`StateDictAdapter` (torchtitan's name and methods) converts whole state dicts both ways (:meth:`~
StateDictAdapter.to_hf`, :meth:`~StateDictAdapter.from_hf`) and, for reading only a slice, says which checkpoint
tensor fills which box of a model tensor (:meth:`~StateDictAdapter.pieces`). Dense families map keys one to one.

Example::

    adapter = state_dict_adapter("qwen3_moe")
    on_disk = adapter.to_hf(model.state_dict())        # per-expert keys, as save_pretrained writes them
    in_memory = adapter.from_hf(on_disk)               # fused expert tensors again, bitwise
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_llmfast.errors import CheckpointError, ConfigError

__all__ = ["FAMILIES", "ExpertKeys", "Piece", "StateDictAdapter", "state_dict_adapter"]

_FUSED = re.compile(r"^(?P<prefix>.*)\.mlp\.experts\.(?P<param>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertKeys:
    """How a family names one routed expert's matrices on disk: ``<prefix>.<block>.experts.<e>.<name>.weight``.

    Args:
        block: the MoE block's module name on disk (in memory it is always ``mlp``).
        gate: the gate projection (first half of the fused ``gate_up_proj`` rows).
        up: the up projection (second half).
        down: the down projection (``down_proj``).

    Example::

        ExpertKeys(block="block_sparse_moe", gate="w1", up="w3", down="w2")  # Mixtral
    """

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor and the box of a model tensor it fills.

    Attributes:
        key: the checkpoint key.
        offsets: the box's start in the model tensor, per dimension.
        sizes: the box's extent in the model tensor, per dimension.
        expert: the box covers one expert of a fused tensor; the checkpoint tensor has no expert dimension
            (its shape is ``sizes[1:]``), else its shape is ``sizes``.
    """

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    expert: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape."""
        return self.sizes[1:] if self.expert else self.sizes


@dataclass(frozen=True)
class StateDictAdapter:
    """The key table of one transformers family: model keys (experts fused) <-> checkpoint keys (per expert).

    Args:
        model_type: the family's ``config.model_type``.
        experts: how its routed experts are written (``None``: a dense family, keys map one to one).

    Example::

        adapter = StateDictAdapter("mixtral", ExpertKeys("block_sparse_moe", "w1", "w3", "w2"))
        adapter.hf_key("model.layers.0.mlp.gate.weight")  # "model.layers.0.block_sparse_moe.gate.weight"
    """

    model_type: str
    experts: ExpertKeys | None = None

    def hf_key(self, key: str) -> str:
        """The checkpoint key of a model key that is not a fused expert tensor."""
        if self.experts is None or self.experts.block == "mlp":
            return key
        return key.replace(".mlp.", f".{self.experts.block}.")

    def model_key(self, hf_key: str) -> str:
        """The model key of a checkpoint key that is not a per-expert matrix (inverse of :meth:`hf_key`)."""
        if self.experts is None or self.experts.block == "mlp":
            return hf_key
        return hf_key.replace(f".{self.experts.block}.", ".mlp.")

    def pieces(self, key: str, shape: Sequence[int]) -> list[Piece]:
        """The checkpoint tensors that make up the model tensor ``key`` of global ``shape``, with their boxes.

        Example::

            adapter.pieces("model.layers.0.mlp.experts.down_proj", (4, 32, 16))  # 4 pieces, one per expert
        """
        shape = tuple(shape)
        match = _FUSED.match(key) if self.experts is not None else None
        if match is None:
            return [Piece(self.hf_key(key), (0,) * len(shape), shape)]
        assert self.experts is not None
        base = f"{match['prefix']}.{self.experts.block}.experts"
        num_experts, rows, cols = shape
        pieces = []
        for e in range(num_experts):
            if match["param"] == "down_proj":
                pieces.append(Piece(f"{base}.{e}.{self.experts.down}.weight", (e, 0, 0), (1, rows, cols), True))
            else:
                half = rows // 2
                for start, name in ((0, self.experts.gate), (half, self.experts.up)):
                    pieces.append(Piece(f"{base}.{e}.{name}.weight", (e, start, 0), (1, half, cols), True))
        return pieces

    def to_hf(self, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """A model state dict as the checkpoint holds it (per-expert matrices as views, no copy).

        Example::

            torch.equal(adapter.to_hf(sd)["model.layers.0.mlp.experts.1.up_proj.weight"],
                        sd["model.layers.0.mlp.experts.gate_up_proj"][1, 16:])
        """
        out: dict[str, Tensor] = {}
        for key, tensor in state_dict.items():
            for piece in self.pieces(key, tensor.shape):
                box = tensor[tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes, strict=True))]
                out[piece.key] = box[0] if piece.expert else box
        return out

    def from_hf(self, hf_state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """A checkpoint state dict as the model holds it: per-expert matrices stacked into the fused tensors.

        Raises:
            CheckpointError: an expert's matrix is missing (the experts of a block must be ``0 .. E-1``).

        Example::

            model.load_state_dict(adapter.from_hf(load_file("model.safetensors")))
        """
        out: dict[str, Tensor] = {}
        fused: dict[str, dict[int, dict[str, Tensor]]] = {}
        pattern = self._expert_pattern()
        for hf_key, tensor in hf_state_dict.items():
            match = pattern.match(hf_key) if pattern is not None else None
            if match is None:
                out[self.model_key(hf_key)] = tensor
                continue
            experts = fused.setdefault(match["prefix"], {})
            experts.setdefault(int(match["expert"]), {})[match["name"]] = tensor
        assert self.experts is not None or not fused
        for prefix, experts in fused.items():
            names = self.experts  # type: ignore[union-attr]
            for e in range(len(experts)):
                parts = experts.get(e, {})
                missing = [n for n in (names.gate, names.up, names.down) if n not in parts]
                if missing:
                    raise CheckpointError(
                        f"{prefix}.{names.block}.experts.{e}: missing {', '.join(missing)} (experts must be 0..E-1)"
                    )
            out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([experts[e][names.gate], experts[e][names.up]]) for e in range(len(experts))]
            )
            out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([experts[e][names.down] for e in range(len(experts))])
        return out

    def _expert_pattern(self) -> re.Pattern[str] | None:
        if self.experts is None:
            return None
        names = "|".join(re.escape(n) for n in (self.experts.gate, self.experts.up, self.experts.down))
        block = re.escape(self.experts.block)
        return re.compile(rf"^(?P<prefix>.*)\.{block}\.experts\.(?P<expert>\d+)\.(?P<name>{names})\.weight$")


_PER_EXPERT = ExpertKeys()
FAMILIES: dict[str, StateDictAdapter] = {
    "qwen3_moe": StateDictAdapter("qwen3_moe", _PER_EXPERT),
    "mixtral": StateDictAdapter("mixtral", ExpertKeys(block="block_sparse_moe", gate="w1", up="w3", down="w2")),
    "deepseek_v3": StateDictAdapter("deepseek_v3", _PER_EXPERT),
    "llama": StateDictAdapter("llama"),
    "qwen3": StateDictAdapter("qwen3"),
}
"""The supported families by ``config.model_type``: their checkpoints load per rank and export back."""


def state_dict_adapter(model_type: str, architecture: str | None = None) -> StateDictAdapter:
    """The key table of ``model_type``.

    Raises:
        ConfigError: an unsupported family, naming it (and ``architecture`` when given) and the supported ones.

    Example::

        state_dict_adapter("mixtral").experts.gate  # "w1"
    """
    adapter = FAMILIES.get(model_type)
    if adapter is None:
        name = f"{architecture} (model_type {model_type!r})" if architecture else f"model_type {model_type!r}"
        raise ConfigError(f"unsupported architecture {name}; supported model types: {', '.join(sorted(FAMILIES))}")
    return adapter
