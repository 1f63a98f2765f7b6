"""The picture of a memory plan: live saved bytes over the step (forward up, backward down) against the budget, one
colour per mechanism (matplotlib, imported only when drawing).

It draws bars it is given; :meth:`~lightning_llmfast.offload.MemoryPlan.plot` computes them from the plan, so this
module knows nothing of the plan and the imports go one way.

Example::

    plot_steps([(0.0, 1.5, 0, "keep"), (1.5, 2.0, 4_000_000, "offload")], budget_bytes=8_000_000, path="plan.png")
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_llmfast.errors import OffloadError

__all__ = ["Bar", "plot_steps"]

Bar = tuple[float, float, int, str]
"""``(start ms, width ms, live saved bytes, mechanism)``: one layer's forward or backward in the step's picture."""

_COLOURS = {"keep": "tab:blue", "recompute": "tab:orange", "offload": "tab:green", "nvme": "tab:purple"}


def plot_steps(bars: Sequence[Bar], budget_bytes: int, path: str) -> None:
    """Write the bars and the budget line to ``path`` (any format matplotlib saves).

    Raises:
        OffloadError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise OffloadError("MemoryPlan.plot needs matplotlib (pip install 'lightning_llmfast[plot]')") from err
    fig, ax = plt.subplots(figsize=(8, 4))
    for start, width, live, mechanism in bars:
        ax.bar(start, live / 1e6, width=max(width, 1e-3), align="edge", color=_COLOURS[mechanism], alpha=0.8)
    ax.axhline(budget_bytes / 1e6, color="red", linestyle="--", label="budget")
    for name, colour in _COLOURS.items():
        ax.bar(0, 0, color=colour, label=name)
    ax.set_xlabel("predicted step time (ms): forward, then backward")
    ax.set_ylabel("live saved activations (MB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
