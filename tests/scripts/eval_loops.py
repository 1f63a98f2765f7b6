"""``trainer.validate``, ``test`` and ``predict`` (under ``inference_mode=True``) with ``SequenceMetadataCallback`` and
``PackedDataModule``, and the same losses computed by hand on every rank's batches, bypassing the cache.

Run in-process by tests/test_eval_loops.py for one process, and as a script with ``--devices 2`` (Lightning launches
the second rank, gloo, timeouts on every collective); each rank saves its results to ``--out/rank{r}.pt``.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from lightning_llmfast import (
    LLMFastStrategy,
    MoEGPTConfig,
    MoEGPTLightningModule,
    PackedDataModule,
    SequenceMetadataCallback,
)
from lightning_llmfast.bench.processes import leave_world
from lightning_llmfast.data import IGNORE_INDEX, PackedBatch
from lightning_llmfast.seqmeta import SequenceMetadata


def module() -> MoEGPTLightningModule:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=258, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=32,
                          num_experts=4, top_k=2, router_backend="torch")  # fmt: skip
    return MoEGPTLightningModule(config)


def datamodule(num_workers: int) -> PackedDataModule:
    return PackedDataModule(corpus="synthetic", seq_len=29, batch_size=2, num_workers=num_workers,
                            synthetic_num_docs=60, synthetic_mean_len=11, val_fraction=0.2, test_fraction=0.2,
                            limit_val_batches=3, limit_test_batches=3)  # fmt: skip


def _token_losses(model: MoEGPTLightningModule, batch: PackedBatch) -> torch.Tensor:
    """Per-token cross entropy of ``batch``, the metadata given explicitly (no cache, no callback)."""
    with torch.no_grad():
        logits = model.model(batch.input_ids, batch.position_ids, metadata=SequenceMetadata.from_batch(batch))
    return F.cross_entropy(
        logits.flatten(0, 1).double(), batch.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )


def reference(model: MoEGPTLightningModule, batches: list[PackedBatch]) -> dict[str, Any]:
    """Summed token loss and label-token count over ``batches``, and each real sequence's mean loss."""
    total, count, documents, losses = 0.0, 0, [], []
    for batch in batches:
        token = _token_losses(model, batch)
        labelled = batch.labels.flatten() != IGNORE_INDEX
        total += float(token[labelled].sum())
        count += int(labelled.sum())
        cu = batch.cu_seqlens_cpu.tolist()
        assert batch.documents is not None
        for i, document in enumerate(batch.documents):
            if document >= 0:
                piece, keep = token[cu[i] : cu[i + 1]], labelled[cu[i] : cu[i + 1]]
                documents.append(document)
                losses.append(float(piece[keep].sum()) / max(int(keep.sum()), 1))
    return {"total": total, "count": count, "documents": documents, "losses": losses}


def run(devices: int, num_workers: int) -> dict[str, Any]:
    """The three loops on a fresh Trainer each, and the hand-computed reference on this rank's batches."""
    model, data = module(), datamodule(num_workers)
    results: dict[str, Any] = {}
    for loop in ("validate", "test", "predict"):
        strategy = LLMFastStrategy(timeout=timedelta(seconds=60)) if devices > 1 else "auto"
        trainer = L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, inference_mode=True, logger=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[SequenceMetadataCallback()],
        )  # fmt: skip
        out = getattr(trainer, loop)(model, datamodule=data)
        results[loop] = out if loop == "predict" else out[0][f"{'val' if loop == 'validate' else 'test'}/loss"]
        results["rank"] = trainer.global_rank
    split = {"val": data.val_dataloader().dataset, "test": data.test_dataloader().dataset}
    for name, dataset in split.items():
        results[f"ref_{name}"] = reference(model.eval(), list(dataset))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = run(2, args.workers)
    torch.save(results, Path(args.out) / f"rank{results['rank']}.pt")


if __name__ == "__main__":
    main()
    leave_world()  # every rank done: out without the interpreter teardown gloo's threads can abort
