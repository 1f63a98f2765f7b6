"""The llmfast training step on a GPU: forward+backward under torch.cuda.set_sync_debug_mode("error")."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch

import lightning_llmfast  # noqa: F401  (registers strategy="llmfast")
from lightning_llmfast import MoEGPTLightningModule, SequenceMetadataCallback, TokenThroughputMonitor
from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.bench.e2e import E2ESettings, make_batches

pytestmark = pytest.mark.cuda

SETTINGS = E2ESettings(
    model={"hidden_size": 128, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 256, "num_experts": 8},
    seq_len=512,
    batch_size=2,
    mean_doc_len=100,
)


class _SyncDebug(L.Callback):
    """Step 0 warms up (Triton compilation, lazy init); later steps run forward+backward in "error" mode and under
    the sync counter; the optimizer step runs outside both (AdamW's step counter lives on the host)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.step, self.checked = device, 0, 0
        self.counter: SyncCounter | None = None
        self.syncs: list[dict[str, int]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.step >= 1:
            torch.cuda.synchronize(self.device)
            self.counter = SyncCounter(self.device, host=batch.cu_seqlens_cpu).__enter__()
            torch.cuda.set_sync_debug_mode("error")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.counter is not None:
            torch.cuda.set_sync_debug_mode(0)
            self.counter.__exit__(None, None, None)
            self.syncs.append(dict(self.counter.syncs))
            self.counter = None
            self.checked += 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.step += 1


class _Batches:
    """A sized iterable of ready batches (a plain list would be taken for a list of dataloaders)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        return iter(self.batches)


def test_llmfast_step_is_sync_free_under_cuda_sync_debug_mode(cuda_device: torch.device) -> None:
    batches = [b.pin_memory() for b in make_batches(SETTINGS, 3, SETTINGS.config("before").vocab_size)]
    torch.manual_seed(0)
    module = MoEGPTLightningModule(SETTINGS.config("llmfast"), lr=1e-3)
    probe = _SyncDebug(cuda_device)
    trainer = L.Trainer(
        accelerator="cuda", devices=[cuda_device.index or 0], strategy="llmfast", precision="bf16-mixed",
        max_steps=len(batches), callbacks=[SequenceMetadataCallback(), TokenThroughputMonitor(), probe],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(module, train_dataloaders=_Batches(batches))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert probe.checked == len(batches) - 1
    assert probe.syncs == [{}] * probe.checked  # the counter agrees with CUDA's own detector

    # The detector itself: the "before" model reads the boundaries on the host in every layer.
    before = MoEGPTLightningModule(SETTINGS.config("before")).to(cuda_device)
    batch = batches[0].to(cuda_device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            before(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert any("synchroniz" in str(w.message) for w in caught)
