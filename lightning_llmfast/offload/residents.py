"""The tensors of a layer stack that stay on the device anyway (parameters, buffers), read cheaply every step.

The layers' modules are walked once, and again only after some module registers a parameter, buffer or submodule:
``torch.nn``'s global registration hooks count those, installed while at least one :class:`Residents` is open and
removed when the last one closes. Their parameter and buffer dicts are read every step, so ``.to()``, ``.double()``,
``to_empty()``, ``del`` and ``param.data = ...`` are seen without a registration.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["Residents"]

_LOCK = threading.Lock()
_EPOCH = [0]  # bumped by every registration while hooks are installed
_HOOKS: list[RemovableHandle] = []
_OPEN = [0]  # Residents that need the hooks


def _bump(*_args: Any) -> None:
    _EPOCH[0] += 1


def _release() -> None:
    with _LOCK:
        _OPEN[0] -= 1
        if not _OPEN[0]:
            for handle in _HOOKS:
                handle.remove()
            _HOOKS.clear()


class Residents:
    """Parameters and buffers of ``layers``; :meth:`close` releases the global hooks when it is the last one.

    Example::

        residents = Residents(model.layers)
        ptrs = {t.untyped_storage().data_ptr() for t in residents.tensors()}
        residents.close()
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._layers = [weakref.ref(layer) for layer in layers]
        self._modules: list[weakref.ref[nn.Module]] | None = None
        self._epoch = -1
        self._open = True
        with _LOCK:
            if not _OPEN[0]:
                _HOOKS.extend(
                    (
                        nn.modules.module.register_module_parameter_registration_hook(_bump),
                        nn.modules.module.register_module_buffer_registration_hook(_bump),
                        nn.modules.module.register_module_module_registration_hook(_bump),
                    )
                )
            _OPEN[0] += 1
        # Released at close(), or when collected without one (an offloader dropped after an error).
        self._release = weakref.finalize(self, _release)

    def tensors(self) -> list[torch.Tensor]:
        """The layers' parameters and buffers now (modules held weakly: a deleted submodule is not kept alive)."""
        if self._modules is None or self._epoch != _EPOCH[0] or not self._open:
            self._epoch = _EPOCH[0]
            layers = [layer for layer in (ref() for ref in self._layers) if layer is not None]
            self._modules = [weakref.ref(m) for layer in layers for m in layer.modules()]
        modules = [m for m in (ref() for ref in self._modules) if m is not None]
        return [t for m in modules for d in (m._parameters, m._buffers) for t in d.values() if t is not None]

    def close(self) -> None:
        """Stop watching; the last open one removes the global registration hooks."""
        if not self._open:
            return
        self._open = False
        self._modules = None
        self._release()

    @staticmethod
    def hooks_installed() -> bool:
        """Whether the global registration hooks are installed now."""
        return bool(_HOOKS)
