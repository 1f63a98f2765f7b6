"""The import path :class:`GroupedRouterMixin` had before the Lightning layer got its rooms (kept for users): it
lives in :mod:`lightning_llmfast.modules.grouped_router`."""

from lightning_llmfast.modules.grouped_router import GroupedRouterMixin

__all__ = ["GroupedRouterMixin"]
