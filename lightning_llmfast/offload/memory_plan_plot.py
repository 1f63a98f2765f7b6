"""The picture of a :class:`~lightning_llmfast.offload.MemoryPlan`: predicted live saved bytes over the step (forward
up, backward down) against the budget, one colour per mechanism (matplotlib, imported only here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_llmfast.errors import OffloadError

if TYPE_CHECKING:
    from lightning_llmfast.offload.memory_plan import MemoryPlan

__all__ = ["plot_plan"]

_COLOURS = {"keep": "tab:blue", "recompute": "tab:orange", "offload": "tab:green", "nvme": "tab:purple"}


def plot_plan(plan: MemoryPlan, path: str) -> None:
    """Write the plan's picture to ``path`` (any format matplotlib saves).

    Raises:
        OffloadError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise OffloadError("MemoryPlan.plot needs matplotlib (pip install 'lightning_llmfast[plot]')") from err
    layers = plan.profile.layers
    fig, ax = plt.subplots(figsize=(8, 4))
    t, live = 0.0, 0
    # Forward: each layer adds what its mechanism leaves on the device; backward frees it again, last layer first.
    order = [(i, +1) for i in range(len(layers))] + [(i, -1) for i in reversed(range(len(layers)))]
    for i, sign in order:
        width = layers[i].forward_ms if sign > 0 else layers[i].backward_ms + plan.cost_ms[i]
        kept = layers[i].saved_bytes - plan.freed_bytes[i]
        ax.bar(t, live / 1e6, width=max(width, 1e-3), align="edge", color=_COLOURS[plan.choices[i]], alpha=0.8)
        live += sign * kept
        t += width
    ax.axhline(plan.budget_bytes / 1e6, color="red", linestyle="--", label="budget")
    for name, colour in _COLOURS.items():
        ax.bar(0, 0, color=colour, label=name)
    ax.set_xlabel("predicted step time (ms): forward, then backward")
    ax.set_ylabel("live saved activations (MB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
