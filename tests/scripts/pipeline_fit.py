"""A pipelined fit of the reference MoE GPT under ``LLMFastStrategy(pipeline_parallel_size=2)`` on CPU ranks.

Run by tests/test_pipeline_fit.py and tests/test_pipeline_compose.py (:func:`launch`) with ``--devices 2`` (one
pipeline) or ``4`` (two ranks per stage, each reading its own batches through Lightning's sampler: replicas, FSDP2
shards with ``--sharding fsdp``, expert-parallel ranks with ``--ep 2``, or with ``--cp 2`` two context-parallel ranks
per stage splitting every microbatch's positions, on :data:`AWKWARD` batches); Lightning launches the other ranks.
Every batch joins ``MICRO`` consecutive micro-batches of :func:`micro_batches` (the pipeline's microbatches), so one
process accumulating the micro-batches is the reference (:func:`one_process_fit`). Each rank writes
``<out>.rank<r>.pt``: its logged ``train/loss``, ``pipeline/bubble`` and ``train/grad_norm`` per step, the index of
every batch it trained on, its parameters by name (whole), what it holds, and its ``val/loss``; the run ends with a
DCP checkpoint at ``<out>.ckpt``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.bench.processes import leave_world
from lightning_llmfast.data import PackedBatch, SyntheticCorpus, pack_documents
from lightning_llmfast.expert_parallel import expert_dtensor, expert_parameters, sharded_moe_blocks
from lightning_llmfast.offload import OffloadConfig

STEPS, MICRO, ROWS = 3, 2, 2
REPLICAS = 2  # batches for up to this many data-parallel replicas
PREDICT = 2  # batches trainer.predict runs


# Awkward micro-batches of (ROWS, 16) for context parallelism: documents of exactly a row (split over the cp ranks),
# length-1 and prime-length documents, one document longer than a row, padding tails.
AWKWARD = [[16, 16], [1, 1, 2, 3, 5, 7, 11, 1], [32], [5, 1, 9, 13], [1, 15, 3, 4], [12, 7, 2, 2]]


def micro_batches(equal: bool = False, awkward: bool = False) -> list[PackedBatch]:
    """Packed micro-batches of documents of many lengths, or (``equal``) of one 16-token document per row: every
    micro-batch then has as many label tokens (expert parallelism's balance loss covers the ranks of a stage, whose
    shares one process reproduces on their joined micro-batches when each weighs the same), or (``awkward``) those of
    :data:`AWKWARD`."""
    count = MICRO * STEPS * REPLICAS
    if awkward:
        gen = torch.Generator().manual_seed(3)
        out = []
        for lengths in AWKWARD:
            docs = [torch.randint(1, 64, (n,), generator=gen).tolist() for n in lengths]
            (packed,) = pack_documents(docs, 16, ROWS, vocab_size=64, lookahead=8)
            out.append(packed)
        return out
    if equal:
        g = torch.Generator().manual_seed(11)
        docs = [torch.randint(0, 64, (16,), generator=g) for _ in range(count * ROWS)]
        return [next(pack_documents(docs[i : i + ROWS], 16, ROWS)) for i in range(0, len(docs), ROWS)]
    corpus = SyntheticCorpus(80, mean_len=14, seed=5, distribution="exponential", vocab_size=64)
    return list(pack_documents(corpus, 16, ROWS, vocab_size=64, lookahead=2))[:count]


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
        documents=[d for p in parts for d in p.documents or []],
    )


def batches(equal: bool = False, awkward: bool = False) -> list[PackedBatch]:
    micro = micro_batches(equal, awkward)
    return [joined(micro[i : i + MICRO]) for i in range(0, len(micro), MICRO)]


def module() -> MoEGPTLightningModule:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=64, hidden_size=32, n_layers=4, n_heads=2, n_kv_heads=1, ffn_size=24,
                          num_experts=4, top_k=2, router_backend="torch")  # fmt: skip
    return MoEGPTLightningModule(config, lr=1e-2, warmup_steps=2, aux_loss_coef=0.05)


class Record(L.Callback):
    """The logged values of every training step, and which batch of :func:`batches` it trained on."""

    def __init__(self, known: list[PackedBatch] | None = None) -> None:
        self.known = [b.input_ids for b in (known if known is not None else batches())]
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
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
        if "train/grad_norm" in metrics:
            self.grad_norms.append(float(metrics["train/grad_norm"]))
        if not isinstance(batch, PackedBatch):  # under context parallelism: the microbatches' shards
            return
        self.seen.extend(i for i, ids in enumerate(self.known) if torch.equal(ids, batch.input_ids))


def launch(tmp: Path, devices: int, *args: str, out: str = "run") -> list[dict[str, Any]]:
    """Run this script on ``devices`` CPU processes in ``tmp`` (1F1B unless ``args`` say otherwise); every rank's
    result."""
    proc = subprocess.run(
        [sys.executable, __file__, "--out", out, "--schedule", "1f1b", "--devices", str(devices), *args], cwd=tmp,
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp / f"{out}.rank{r}.pt", weights_only=True) for r in range(devices)]


def one_process_trainer(**kwargs: Any) -> L.Trainer:
    """The one-process Trainer the pipelined fits are compared with (clipping as theirs)."""
    return L.Trainer(
        accelerator="cpu", devices=1, strategy="llmfast", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.5, **kwargs,
    )  # fmt: skip


def one_process_fit(
    order: list[list[int]], *, equal: bool = False, awkward: bool = False, joint: bool = False
) -> tuple[MoEGPTLightningModule, list[float]]:
    """One process accumulating the micro-batches of the batches each optimizer step's replicas trained on
    (``order``: per step, the batch of every replica); returns the module and the loss of every group of ``MICRO``
    micro-batches (token-weighted).

    ``joint``: micro-batch ``k`` of a step joins micro-batch ``k`` of every replica's batch, as the ranks of a stage
    run it together under expert parallelism (its balance loss covers their tokens); a group is then a step.
    """
    torch.set_num_threads(1)
    single, record = module(), Record()
    micro = micro_batches(equal, awkward)
    if joint:
        chosen = [joined([micro[MICRO * b + k] for b in step]) for step in order for k in range(MICRO)]
    else:
        chosen = [micro[MICRO * b + k] for step in order for b in step for k in range(MICRO)]
    trainer = one_process_trainer(max_steps=len(order), accumulate_grad_batches=len(chosen) // len(order),
                                  callbacks=[record])  # fmt: skip
    trainer.fit(single, train_dataloaders=DataLoader(chosen, batch_size=None))
    counts = [float((b.labels != -100).sum()) for b in chosen]
    # A group's loss is its micro-batches' losses weighted by their label tokens.
    losses = [
        sum(record.losses[i] * counts[i] for i in range(s, s + MICRO)) / sum(counts[s : s + MICRO])
        for s in range(0, len(chosen), MICRO)
    ]
    return single, losses


def whole_parameters(trainer: L.Trainer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters by name, whole: FSDP2 shards gathered over the stage, local experts over "ep"."""
    dims = trainer.strategy.parallel_dims
    experts = {id(p) for _, p, _ in expert_parameters(model)}
    out = {}
    for name, param in model.named_parameters():
        value = param.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        elif id(param) in experts:
            value = expert_dtensor(value, dims.ep_mesh).full_tensor()
        out[name] = value.clone()
    return out


def _predictor(args: argparse.Namespace) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=args.devices, logger=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=LLMFastStrategy(pipeline_parallel_size=args.pp, pipeline_microbatches=max(MICRO, args.pp),
                                 pipeline_schedule=args.schedule, timeout=timedelta(seconds=60)),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--sharding", default="ddp")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--offload", action="store_true", help="offload every layer's saved activations (CPU copies)")
    parser.add_argument("--equal", action="store_true", help="equal label tokens in every micro-batch")
    parser.add_argument("--cp", type=int, default=1, help="context parallelism (then on the awkward batches)")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from (then only its weights are saved)")
    parser.add_argument("--predict-only", action="store_true", help="only trainer.predict of the untrained model")
    parser.add_argument("--predict", action="store_true", help="also trainer.predict after the fit and alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.predict_only:
        trainer = _predictor(args)
        predicted = trainer.predict(module(), DataLoader(batches()[:PREDICT], batch_size=None))
        torch.save({"predicted_alone": predicted}, f"{args.out}.rank{trainer.global_rank}.pt")
        return
    model = module()
    data = batches(args.equal, awkward=args.cp > 1)
    record = Record(data)
    strategy = LLMFastStrategy(
        pipeline_parallel_size=args.pp, pipeline_microbatches=max(MICRO, args.pp), pipeline_schedule=args.schedule,
        sharding=args.sharding, expert_parallel_size=args.ep, context_parallel_size=args.cp,
        timeout=timedelta(seconds=60),
        offload=OffloadConfig(force=True, min_offload_bytes=0, keep_last_layers=0) if args.offload else None,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=STEPS // args.accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
        gradient_clip_val=0.5, limit_val_batches=1, num_sanity_val_steps=0, accumulate_grad_batches=args.accumulate,
    )  # fmt: skip
    rank = trainer.global_rank
    if args.resume is not None:  # restored, nothing left to train: the weights as the checkpoint holds them
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None), ckpt_path=args.resume)
        params = whole_parameters(trainer, model)
        adam_steps = [int(state["step"]) for state in trainer.optimizers[0].state.values()]
        torch.save({"params": params, "step": trainer.global_step, "adam": adam_steps}, f"{args.out}.rank{rank}.pt")
        return
    trainer.fit(
        model,
        train_dataloaders=DataLoader(data, batch_size=None),
        val_dataloaders=DataLoader(data[:1], batch_size=None),
    )
    trainer.save_checkpoint(f"{args.out}.ckpt")
    params = whole_parameters(trainer, model)
    val = trainer.validate(model, DataLoader(data[:1], batch_size=None), verbose=False)[0]["val/loss"]
    result = {"losses": record.losses, "bubbles": record.bubbles, "seen": record.seen, "params": params, "val": val}
    result["stage_ms"], result["grad_norms"] = record.stage_ms, record.grad_norms
    # What this rank holds: parameter elements (FSDP2: its shards) and every MoE block's exchange overlap.
    result["held"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    result["overlap"] = [dispatcher.overlap_chunks for _, _, dispatcher in sharded_moe_blocks(model)]
    result["offload"] = dict(trainer.strategy.offload_stats or {})
    if args.predict:
        result["predicted"] = trainer.predict(model, DataLoader(data[:PREDICT], batch_size=None))
        # predict alone, on a fresh trainer and an untrained model
        result["predicted_alone"] = _predictor(args).predict(module(), DataLoader(data[:PREDICT], batch_size=None))
    torch.save(result, f"{args.out}.rank{rank}.pt")


if __name__ == "__main__":
    main()
    dist.barrier()
    atexit._run_exitfuncs()
    leave_world()
