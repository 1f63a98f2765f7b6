"""Per-layer ``torch.compile``, as torchtitan applies it: every transformer layer compiled whole and in place.

Compiling each layer rather than the whole model keeps compilation time independent of depth (identical layers
share one compiled graph), leaves the model's own ``forward`` (where token ids are bound to the packed metadata)
eager, and keeps parameter names unchanged (``nn.Module.compile`` wraps the call, not the module).
"""

from __future__ import annotations

from torch import nn

from lightning_llmfast._layers import LayersSpec, resolve_layers
from lightning_llmfast.errors import ConfigError

__all__ = ["check_compile", "compile_layers"]


def check_compile(value: object) -> bool | str:
    """``value`` if it is a valid ``compile=`` argument: a bool, or the name of a ``torch.compile`` backend."""
    if isinstance(value, bool) or (isinstance(value, str) and value):
        return value
    raise ConfigError(f"compile must be True, False or a torch.compile backend name such as 'inductor', got {value!r}")


def compile_layers(root: nn.Module, compile: bool | str, layers: LayersSpec = None) -> int:
    """Compiles every transformer layer of ``root`` in place with ``torch.compile(fullgraph=True)``.

    Args:
        root: the model.
        compile: ``True`` (the default backend, Inductor), ``False`` (do nothing) or a backend name.
        layers: the layers (see :func:`~lightning_llmfast._layers.resolve_layers`); default: the largest module list
            of identical blocks.

    Returns:
        The number of layers compiled.

    Example::

        compile_layers(model, True)  # model.layers[i] compiled whole, names unchanged
    """
    if compile is False:
        return 0
    found = resolve_layers(root, layers, hint="layers=")
    options = {} if compile is True else {"backend": compile}
    for layer in found:
        layer.compile(fullgraph=True, **options)
    return len(found)
