"""Offload leaks nothing: live autograd nodes and RSS stay flat over many steps in every mode, and no layer outlives
a fit (also one whose backward raised) once the model is deleted."""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Iterator
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.data import SyntheticCorpus, pack_documents
from lightning_llmfast.models import MoEGPT
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig

VOCAB = 32
MODES: dict[str, dict[str, Any]] = {
    "all": {},
    "first_layer": {"offload_layers": 1},
    "auto": {"offload_layers": "auto"},
    "rebuild_only": {"offload_layers": 0},
    "rebuild_gemms": {"rebuild": "norms+gemms"},
    "selective": {"offload_layers": 1, "recompute": "selective"},
}


def _config(hidden: int = 16) -> MoEGPTConfig:
    return MoEGPTConfig(
        vocab_size=VOCAB, hidden_size=hidden, n_layers=3, n_heads=2, n_kv_heads=1, ffn_size=2 * hidden, num_experts=4
    )


def _live_function_nodes() -> int:
    """Backward nodes of custom autograd Functions alive now (Python objects, so the collector sees each one)."""
    gc.collect()
    node = torch.autograd.function.BackwardCFunction
    return sum(issubclass(type(o), node) for o in gc.get_objects())


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _steps(model: MoEGPT, off: ActivationOffloader, n: int, seq_len: int = 24) -> Iterator[int]:
    g = torch.Generator().manual_seed(0)
    for step in range(n):
        ids = torch.randint(0, VOCAB, (2, seq_len), generator=g)
        with off:
            loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
            loss.backward()
        del loss
        model.zero_grad(set_to_none=True)
        yield step


@pytest.mark.parametrize("mode", list(MODES))
def test_live_autograd_nodes_are_flat_in_every_mode(mode: str) -> None:
    torch.manual_seed(0)
    model = MoEGPT(_config())
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True, **MODES[mode]))
    counts = [_live_function_nodes() for step in _steps(model, off, 12) if step in (3, 11)]
    off.close()
    # Only the last step's graph (the routing plans the model keeps for aux_loss) is alive after a step: the same
    # count after 4 steps and after 12 (a leak kept about 6 nodes per step).
    assert counts[0] == counts[1] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_rss_is_flat_over_300_steps_in_every_mode(mode: str) -> None:
    torch.manual_seed(0)
    model = MoEGPT(_config(hidden=64))
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True, **MODES[mode]))
    rss = {}
    for step in _steps(model, off, 300):
        if step in (49, 299):
            gc.collect()
            rss[step] = _rss_bytes()
    off.close()
    assert rss[299] - rss[49] < 5 << 20, f"RSS grew by {(rss[299] - rss[49]) / 2**20:.1f} MB after warm-up"


class _Boom(torch.autograd.Function):
    """Identity whose backward raises: an exception in the middle of backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


def test_no_layer_outlives_the_offloader_and_model_after_a_backward_that_raised() -> None:
    torch.manual_seed(0)
    model = MoEGPT(_config())
    refs = [weakref.ref(layer) for layer in model.layers]
    # The middle layer's output raises in backward: the last layer's backward has run, the others' never will.
    model.layers[1].register_forward_hook(lambda _m, _a, out: _Boom.apply(out))
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True, offload_layers=2))
    ids = torch.randint(0, VOCAB, (2, 24))
    with pytest.raises(RuntimeError, match="boom"), off:
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    del model, off
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def _loader(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    docs = [
        torch.randint(0, VOCAB - 1, (len(d),), generator=g)
        for d in SyntheticCorpus(num_docs=60, mean_len=12, seed=0, vocab_size=VOCAB)
    ]
    return DataLoader(list(pack_documents(docs, 24, 2, pad_id=VOCAB - 1, vocab_size=VOCAB))[:n], batch_size=None)


class _FailingBackward(MoEGPTLightningModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return _Boom.apply(loss) if batch_idx == 1 else loss


@pytest.mark.parametrize("failing", [False, True])
def test_no_layer_outlives_repeated_offloading_fits(failing: bool) -> None:
    refs = []
    for _ in range(2):
        torch.manual_seed(0)
        module = (_FailingBackward if failing else MoEGPTLightningModule)(_config(), lr=1e-2, warmup_steps=1)
        refs += [weakref.ref(layer) for layer in module.model.layers]
        strategy = LLMFastStrategy(offload=OffloadConfig(force=True, min_offload_bytes=0))
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        if failing:
            with pytest.raises(RuntimeError, match="boom"):
                trainer.fit(module, _loader(3))
        else:
            trainer.fit(module, _loader(3))
        assert strategy.offload_stats is not None
        del module, trainer, strategy
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
