"""A pipelined fit of the reference MoE GPT under ``LLMFastStrategy(pipeline_parallel_size=2)`` on CPU ranks.

Run by tests/test_pipeline_fit.py with ``--devices 2`` (one pipeline) or ``4`` (two replicas of it reading their
own batches through Lightning's sampler, or with ``--cp 2`` two context-parallel ranks per stage splitting every
microbatch's positions, on :data:`AWKWARD` batches); Lightning launches the other ranks. Every batch joins ``MICRO``
consecutive micro-batches of :func:`micro_batches` (the pipeline's microbatches), so one process accumulating the
micro-batches is the reference. Each rank writes ``<out>.rank<r>.pt``: its logged ``train/loss`` and
``pipeline/bubble`` per step, the index of every batch it trained on, its parameters by name, and its ``val/loss``;
the run ends with a DCP checkpoint at ``<out>.ckpt``.
"""

from __future__ import annotations

import argparse
import atexit
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.bench.processes import leave_world
from lightning_llmfast.data import PackedBatch, SyntheticCorpus, pack_documents

STEPS, MICRO, ROWS = 3, 2, 2
REPLICAS = 2  # batches for up to this many data-parallel replicas


# Awkward micro-batches of (ROWS, 16) for context parallelism: documents of exactly a row (split over the cp ranks),
# length-1 and prime-length documents, one document longer than a row, padding tails.
AWKWARD = [[16, 16], [1, 1, 2, 3, 5, 7, 11, 1], [32], [5, 1, 9, 13], [1, 15, 3, 4], [12, 7, 2, 2]]


def micro_batches(awkward: bool = False) -> list[PackedBatch]:
    if not awkward:
        corpus = SyntheticCorpus(80, mean_len=14, seed=5, distribution="exponential", vocab_size=64)
        return list(pack_documents(corpus, 16, ROWS, vocab_size=64, lookahead=2))[: MICRO * STEPS * REPLICAS]
    gen = torch.Generator().manual_seed(3)
    out = []
    for lengths in AWKWARD:
        docs = [torch.randint(1, 64, (n,), generator=gen).tolist() for n in lengths]
        (packed,) = pack_documents(docs, 16, ROWS, vocab_size=64, lookahead=8)
        out.append(packed)
    return out


def joined(parts: list[PackedBatch]) -> PackedBatch:
    """One batch holding the rows of ``parts`` (boundaries shifted)."""
    cu, offset = [parts[0].cu_seqlens], parts[0].cu_seqlens[-1]
    for part in parts[1:]:
        cu.append(part.cu_seqlens[1:] + offset)
        offset = offset + part.cu_seqlens[-1]
    return PackedBatch(
        input_ids=torch.cat([p.input_ids for p in parts]),
        labels=torch.cat([p.labels for p in parts]),
        position_ids=torch.cat([p.position_ids for p in parts]),
        cu_seqlens=torch.cat(cu),
        max_seqlen=max(p.max_seqlen for p in parts),
        num_tokens=sum(p.num_tokens for p in parts),
    )


def batches(awkward: bool = False) -> list[PackedBatch]:
    micro = micro_batches(awkward)
    return [joined(micro[i : i + MICRO]) for i in range(0, len(micro), MICRO)]


def module() -> MoEGPTLightningModule:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=64, hidden_size=32, n_layers=4, n_heads=2, n_kv_heads=1, ffn_size=24,
                          num_experts=4, top_k=2, router_backend="torch")  # fmt: skip
    return MoEGPTLightningModule(config, lr=1e-2, warmup_steps=2, aux_loss_coef=0.05)


class Record(L.Callback):
    """The logged values of every training step, and which batch of :func:`batches` it trained on."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.bubbles: list[float] = []
        self.seen: list[int] = []
        self.stage_ms: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: PackedBatch, *args: Any) -> None:
        metrics = trainer.callback_metrics
        self.losses.append(float(metrics["train/loss"]))
        if "pipeline/bubble" in metrics:
            self.bubbles.append(float(metrics["pipeline/bubble"]))
        if "pipeline/stage_ms" in metrics:
            self.stage_ms.append(float(metrics["pipeline/stage_ms"]))
        if not isinstance(batch, PackedBatch):  # under context parallelism: the microbatches' shards
            return
        known = [b.input_ids for b in batches()]
        self.seen.extend(i for i, ids in enumerate(known) if torch.equal(ids, batch.input_ids))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=1, help="context parallelism (then on the awkward batches)")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from (then only its weights are saved)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = module()
    record = Record()
    strategy = LLMFastStrategy(
        pipeline_parallel_size=args.pp, pipeline_microbatches=max(MICRO, args.pp), pipeline_schedule=args.schedule,
        context_parallel_size=args.cp, timeout=timedelta(seconds=60),
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=STEPS // args.accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
        gradient_clip_val=0.5, limit_val_batches=1, num_sanity_val_steps=0, accumulate_grad_batches=args.accumulate,
    )  # fmt: skip
    data = batches(awkward=args.cp > 1)
    rank = trainer.global_rank
    if args.resume is not None:  # restored, nothing left to train: the weights as the checkpoint holds them
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None), ckpt_path=args.resume)
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        adam_steps = [int(state["step"]) for state in trainer.optimizers[0].state.values()]
        torch.save({"params": params, "step": trainer.global_step, "adam": adam_steps}, f"{args.out}.rank{rank}.pt")
        return
    trainer.fit(
        model,
        train_dataloaders=DataLoader(data, batch_size=None),
        val_dataloaders=DataLoader(data[:1], batch_size=None),
    )
    trainer.save_checkpoint(f"{args.out}.ckpt")
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    val = trainer.validate(model, DataLoader(data[:1], batch_size=None), verbose=False)[0]["val/loss"]
    result = {"losses": record.losses, "bubbles": record.bubbles, "seen": record.seen, "params": params, "val": val}
    result["stage_ms"] = record.stage_ms
    torch.save(result, f"{args.out}.rank{rank}.pt")


if __name__ == "__main__":
    main()
    dist.barrier()
    atexit._run_exitfuncs()
    leave_world()
