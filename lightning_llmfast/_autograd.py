"""The one place that asks torch whether code runs inside the autograd engine (backward)."""

from __future__ import annotations

import torch

__all__ = ["in_backward"]


def in_backward() -> bool:
    """Whether the caller runs inside backward: activation recomputation, ``create_graph`` or a backward hook.

    Module forwards run there when ``torch.utils.checkpoint`` replays them; side effects of a forward (an expert-bias
    update, offload bookkeeping, another checkpoint) must not run twice.

    Example::

        if not in_backward():
            update_running_state()
    """
    return torch._C._current_autograd_node() is not None
