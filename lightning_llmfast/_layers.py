"""Finding a model's transformer layer stack: shared by the offload callback and strategy and by
:class:`~lightning_llmfast.callbacks.SequenceMetadataCallback`, so both accept the same ``layers=`` and fail alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_llmfast.errors import ConfigError, LLMFastError

__all__ = ["LayersSpec", "resolve_layers"]

LayersSpec = nn.ModuleList | Sequence[nn.Module] | nn.Module | str | None


def resolve_layers(
    root: nn.Module,
    layers: LayersSpec,
    *,
    error: type[LLMFastError] = ConfigError,
    hint: str = "layers=",
    single: bool = False,
) -> list[nn.Module]:
    """The layers in execution order.

    Args:
        root: the model.
        layers: ``None`` (the largest ``nn.ModuleList`` whose children all have the same type; the first on ties),
            an attribute path such as ``"model.layers"``, or the modules (a ``ModuleList``/``Sequential`` or a list).
        error: the error class raised (a ``ValueError`` subclass of ours).
        hint: how the caller's argument is spelled, for the message (e.g. ``"SequenceMetadataCallback(layers=...)"``).
        single: accept one module that is not a list as a stack of one.

    Raises:
        LLMFastError: ``error``, when nothing matches: no such attribute, no ``ModuleList`` of identical blocks, an
            empty list, or something that is not modules.

    Example::

        layers = resolve_layers(model, "model.layers")
    """
    if layers is None:
        return _largest_stack(root, error, hint)
    found: Any = layers
    if isinstance(layers, str):
        found = root
        for part in layers.split("."):
            if not hasattr(found, part):
                raise error(f"layers: {type(root).__name__} has no attribute path {layers!r} (no attribute {part!r})")
            found = getattr(found, part)
    if isinstance(found, nn.Module) and not isinstance(found, (nn.ModuleList, nn.Sequential)):
        if not single:
            raise error(f"layers: expected a module list or sequence of modules, got {type(found).__name__}")
        found = [found]
    if not isinstance(found, (nn.Module, Sequence)):
        raise error(f"layers: expected a module list, an attribute path or None, got {found!r}")
    result = list(found)
    if not result or not all(isinstance(m, nn.Module) for m in result):
        raise error(
            f"layers: {layers!r} matched no modules ({len(result)} entries); must be a non-empty list of nn.Module "
            "transformer layers"
        )
    return result


def _largest_stack(root: nn.Module, error: type[LLMFastError], hint: str) -> list[nn.Module]:
    best: list[nn.Module] = []
    for module in root.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) and len({type(c) for c in module}) == 1:
            best = list(module)
    if not best:
        raise error(
            f"layers: no nn.ModuleList of identical blocks found in {type(root).__name__}; pass {hint} "
            "(a module list or an attribute path such as 'model.layers')"
        )
    return best
