"""Checkpoints put back before Lightning looks for them: the launcher of ``strategy="llmfast"``.

A kill between the two renames of the fallback swap (:mod:`lightning_llmfast.parallel.atomic`; every save on a file
system without ``renameat2``'s exchange, as NFS and Lustre are) leaves the previous checkpoint aside as
``.<name>.old`` and no ``<name>``. Lightning resolves ``ckpt_path="last"`` by listing the checkpoint directories
before the strategy sets up (no process group yet; under ``torchrun`` or ``srun`` no launcher of its own starts the
processes), so the checkpoint must be back by then. Lightning hands every ``fit``, ``validate``, ``test`` and
``predict`` to the strategy's launcher first, with the Trainer: the launcher of ``strategy="llmfast"`` (Lightning's
own, extended by :class:`RecoveringLauncher`, or an in-process one where Lightning has none) puts back what was left
aside in every ``ModelCheckpoint`` directory, and the checkpoint of an explicit ``ckpt_path``, then runs the call.
Every process does it; on shared storage one rename wins and the others find nothing left to do.

Example::

    trainer = L.Trainer(strategy="llmfast", callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True)])
    trainer.fit(module, ckpt_path="last")  # finds ckpts/last.ckpt even when a kill left only ckpts/.last.ckpt.old
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_llmfast.parallel import atomic

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["InProcessLauncher", "RecoveringLauncher", "recover_checkpoints", "with_recovery"]


def _checkpoint_dirs(trainer: pl.Trainer) -> list[str]:
    """The directories Lightning lists for ``ckpt_path="last"``: each ``ModelCheckpoint``'s, resolved as it does."""
    dirs = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            resolve = getattr(callback, "_ModelCheckpoint__resolve_ckpt_dir", None)
            dirpath = resolve(trainer) if resolve is not None else callback.dirpath
            if dirpath is not None:
                dirs.append(os.fspath(dirpath))
    return dirs


def recover_checkpoints(
    trainer: pl.Trainer, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Path]:
    """Before ``function(*args, **kwargs)`` (the Trainer's ``fit``, ``validate``, ``test`` or ``predict``): puts back
    the checkpoints a kill left aside (:func:`~lightning_llmfast.parallel.atomic.recover`) in the Trainer's
    ``ModelCheckpoint`` directories and at the call's explicit ``ckpt_path`` (local paths; remote ones are Lightning's
    fsspec writes, which make no ``.old``). Returns those put back.

    Example::

        recover_checkpoints(trainer, trainer._fit_impl, (module, None, None, None, "ckpts/last.ckpt"), {})
    """
    recovered = [
        path for dirpath in _checkpoint_dirs(trainer) if _is_local_file_protocol(dirpath)
        for path in atomic.recover_directory(Path(dirpath))
    ]  # fmt: skip
    try:
        ckpt_path = inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):  # a call without that parameter
        ckpt_path = None
    if isinstance(ckpt_path, (str, os.PathLike)) and _is_local_file_protocol(ckpt_path):
        if ckpt_path not in ("last", "best", "hpc") and atomic.recover(Path(ckpt_path)):
            recovered.append(Path(ckpt_path))
    return recovered


class RecoveringLauncher(_Launcher):
    """Mixed into a launcher: :func:`recover_checkpoints` before every launch (:func:`with_recovery`)."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            recover_checkpoints(trainer, function, args, kwargs)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class InProcessLauncher(_Launcher):
    """The launcher of one process that starts nothing: runs the call where it is (also in a notebook).

    Example::

        with_recovery(InProcessLauncher())  # what strategy="llmfast" uses on one device
    """

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        """Nothing was started: nothing to kill."""


class _RecoveringSubprocessScriptLauncher(RecoveringLauncher, _SubprocessScriptLauncher):
    """Lightning's launcher of ``popen`` processes (also under ``torchrun``/``srun``), recovering first."""


class _RecoveringMultiProcessingLauncher(RecoveringLauncher, _MultiProcessingLauncher):
    """Lightning's launcher of ``spawn``/``fork`` processes, recovering first."""


class _RecoveringInProcessLauncher(RecoveringLauncher, InProcessLauncher):
    """One process, recovering first."""


# Named classes (not made on the fly), so that a launcher pickled with the Trainer (start_method="spawn") unpickles.
_RECOVERING: dict[type[_Launcher], type[_Launcher]] = {
    _SubprocessScriptLauncher: _RecoveringSubprocessScriptLauncher,
    _MultiProcessingLauncher: _RecoveringMultiProcessingLauncher,
    InProcessLauncher: _RecoveringInProcessLauncher,
}


def with_recovery(launcher: _Launcher) -> _Launcher:
    """``launcher`` itself, its class extended by :class:`RecoveringLauncher` (every other behaviour unchanged, so
    Lightning's checks of its type still hold); a launcher of another kind is returned as it is.

    Example::

        strategy._launcher = with_recovery(strategy._launcher)
    """
    recovering = _RECOVERING.get(type(launcher))
    if recovering is not None:
        launcher.__class__ = recovering
    return launcher
