"""``GroupedRouterMixin``: give any LightningModule grouped, sync-free MoE routing without touching the model code.

Example::

    class MyModule(GroupedRouterMixin, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = MixtralForCausalLM(config)

    # Trainer.fit calls configure_model(), which swaps every MixtralSparseMoeBlock for the grouped block.
"""

from __future__ import annotations

from typing_extensions import override

from lightning_llmfast.moe.adapters import swap_moe_blocks

__all__ = ["GroupedRouterMixin"]


class GroupedRouterMixin:
    """Mixin for a ``LightningModule`` that swaps its MoE blocks for grouped, sync-free ones.

    Put it before ``LightningModule`` in the bases. :meth:`configure_model` (called by the Trainer before the
    optimizers are built, also under FSDP) runs :meth:`swap_moe_blocks`; a subclass that overrides
    ``configure_model`` must call ``super().configure_model()``. Swapping is idempotent and keeps the parameters
    (same objects, same state-dict keys), so checkpoints load either way.

    Attributes:
        moe_backend: routing backend used by the automatic swap (``"auto"``, ``"torch"`` or ``"triton"``).

    Example::

        class LitMixtral(GroupedRouterMixin, L.LightningModule):
            moe_backend = "auto"

            def __init__(self, config: MixtralConfig) -> None:
                super().__init__()
                self.model = MixtralForCausalLM(config)

        module = LitMixtral(config)
        module.swap_moe_blocks()  # or let Trainer.fit do it; returns the number of blocks swapped
    """

    moe_backend: str = "auto"

    def swap_moe_blocks(self, backend: str = "auto") -> int:
        """Replace, in place, every recognised MoE block of this module with the grouped one.

        Recognised: :class:`~lightning_llmfast.moe.NaiveMoEBlock`, the transformers Mixtral/Qwen2-MoE/Qwen3-MoE/
        OLMoE/DeepSeek-V3 blocks and the other transformers 5 families with their layout (listed in
        :mod:`~lightning_llmfast.moe.adapters`), and classes registered with
        :func:`~lightning_llmfast.register_moe_adapter`. Unknown
        modules that look like MoE blocks get a ``UserWarning`` naming their class.

        Args:
            backend: routing backend of the replacements: ``"auto"``, ``"torch"`` or ``"triton"``.

        Returns:
            The number of blocks swapped (0 when called again).

        Example::

            num_swapped = module.swap_moe_blocks(backend="torch")
        """
        return swap_moe_blocks(self, backend)  # type: ignore[arg-type]

    @override
    def configure_model(self) -> None:
        """Lightning hook: swap the MoE blocks (idempotent, so repeated calls are harmless)."""
        super().configure_model()  # type: ignore[misc]
        self.swap_moe_blocks(self.moe_backend)
