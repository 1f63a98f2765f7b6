"""Worker of tests/test_fsdp.py: trains the reference model under "llmfast_fsdp" on 1, 2 or 4 CPU processes, with
gradient clipping by the global norm, and FSDP2 x expert parallelism with ``--ep N``.

Run as a script (Lightning relaunches it once per rank): ``python fsdp_worker.py DEVICES OUT [--resume CKPT]
[--resume-other CKPT] [--meta [--offload]] [--ep N] [--kill-at STEP]``. ``--resume-other`` resumes a checkpoint of
another run (tag ``"other"``: a SIGKILLed one, or one of another world size); ``--kill-at`` SIGKILLs every rank at the
start of step ``STEP + 1``, after the half-way checkpoint is written. ``--offload`` offloads every layer's saved
activations in the meta-device bf16-mixed run.

Every step's global batch is the same 4 rows for every world size, split evenly over the ranks; every row holds 3
documents, so every rank has the same number of label tokens and the mean of the ranks' per-rank mean losses is the
one-process loss. The router's load-balancing loss depends on how tokens are split over ranks, so its
weight is 0 here. Rank 0 writes ``OUT/result.pt``; every rank writes ``OUT/rank<r>.pt`` (its shard sizes).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.tensor import DTensor

from lightning_llmfast import (
    LLMFastStrategy,
    MoEGPTConfig,
    MoEGPTLightningModule,
    PackedBatch,
    SequenceMetadataCallback,
    SystemMetricsMonitor,
    TokenThroughputMonitor,
)
from lightning_llmfast.models import MoEGPT
from lightning_llmfast.offload import OffloadConfig

ROWS, SEQ_LEN, DOCS_PER_ROW, STEPS, VOCAB = 4, 24, 3, 10, 64
CLIP = 0.5  # gradient clipping by the global norm, active in the first steps
EP = 1  # expert_parallel_size (--ep)
OFFLOAD = OffloadConfig(force=True, min_offload_bytes=0, keep_last_layers=0)  # every layer, whatever its size
CONFIG = {"vocab_size": VOCAB, "hidden_size": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_size": 32}
CONFIG.update(num_experts=4, router_backend="torch")


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        cuts = [
            sorted(torch.randperm(SEQ_LEN - 1, generator=g)[: DOCS_PER_ROW - 1].add(1).tolist()) for _ in range(ROWS)
        ]
        lengths = [b - a for c in cuts for a, b in zip([0, *c], [*c, SEQ_LEN])]
        ids = torch.randint(0, VOCAB, (ROWS, SEQ_LEN), generator=g)
        positions = torch.cat([torch.arange(n) for n in lengths]).view(ROWS, SEQ_LEN)
        labels = torch.cat([ids.flatten()[1:], ids.new_zeros(1)]).view(ROWS, SEQ_LEN)
        labels[torch.cat([positions[:, 1:] == 0, torch.ones(ROWS, 1, dtype=torch.bool)], dim=1)] = -100
        out.append((ids, labels, positions, lengths))
    return out


def rank_batch(step: tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]], rank: int, world: int) -> PackedBatch:
    ids, labels, positions, lengths = step
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    mine = lengths[rows.start * DOCS_PER_ROW : rows.stop * DOCS_PER_ROW]
    cu = torch.tensor([0, *torch.tensor(mine).cumsum(0).tolist()], dtype=torch.int32)
    return PackedBatch(ids[rows], labels[rows], positions[rows], cu, max(mine), ids[rows].numel())


class Batches:
    """The rank's batches, one epoch, resumable mid-epoch: Lightning saves and restores its ``state_dict``."""

    def __init__(self, batches: list[PackedBatch]) -> None:
        self.batches, self.position = batches, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class MetaModule(MoEGPTLightningModule):
    """Builds its model in ``configure_model`` on the meta device."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.config = MoEGPTConfig(**CONFIG)
        self.lr, self.weight_decay, self.aux_loss_coef, self.warmup_steps = 1e-2, 0.1, 0.0, 3

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            with torch.device("meta"):
                self.model = MoEGPT(self.config)
            self.compute_dtypes: set[torch.dtype] = set()
            qkv = self.model.layers[0].attn.qkv
            qkv.register_forward_pre_hook(lambda m, args: self.compute_dtypes.add(m.weight.dtype))


class Killer(L.Callback):
    """SIGKILLs this rank at the start of the step after ``step``: no teardown, no final checkpoint, a crash."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class Recorder(L.Callback):
    def __init__(self, out: Path, tag: str) -> None:
        self.out, self.tag, self.losses, self.norms = out, tag, [], []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item())
        self.norms.append(trainer.callback_metrics["train/grad_norm"].item())

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        full, shards = {}, {}
        optimizer = trainer.optimizers[0]
        for name, p in pl_module.named_parameters():
            is_dt = isinstance(p, DTensor)
            full[name] = (p.full_tensor() if is_dt else p).detach().clone()
            state = optimizer.state[p]
            shards[name] = {
                "dtensor": is_dt,
                "placements": [str(x) for x in p.placements] if is_dt else [],
                "global": tuple(p.shape),
                "local": tuple(p.to_local().shape) if is_dt else tuple(p.shape),
                "opt_local": {k: v.to_local().numel() for k, v in state.items() if isinstance(v, DTensor)},
                "meta": p.is_meta,
                "dtype": p.dtype,
            }
        tied = pl_module.model.lm_head.weight is pl_module.model.embed.weight
        record = {"losses": self.losses, "norms": self.norms, "shards": shards, "world": trainer.world_size}
        record["tied"] = tied
        record["compute_dtypes"] = sorted(str(d) for d in getattr(pl_module, "compute_dtypes", ()))
        record["offload_stats"] = trainer.strategy.offload_stats
        for callback in trainer.callbacks:
            if isinstance(callback, SequenceMetadataCallback):
                record["metadata_builds_last_batch"] = callback.builds_last_batch
            if isinstance(callback, TokenThroughputMonitor):
                record["throughput"] = callback.last_metrics
            if isinstance(callback, SystemMetricsMonitor):
                record["system"] = callback.last_metrics
        torch.save(record, self.out / f"rank{trainer.global_rank}-{self.tag}.pt")
        if trainer.global_rank == 0:
            torch.save({**record, "weights": full}, self.out / f"result-{self.tag}.pt")


def fit(
    devices: int,
    out: Path,
    tag: str,
    module: L.LightningModule,
    steps: int,
    precision: str = "32-true",
    extra: list[L.Callback] | None = None,
    offload: OffloadConfig | None = None,
    **kwargs: Any,
) -> None:
    strategy = LLMFastStrategy(
        **{**StrategyRegistry["llmfast_fsdp"]["init_params"], "offload": offload},
        expert_parallel_size=EP,
        timeout=timedelta(seconds=90),
    )
    callbacks: list[L.Callback] = [Recorder(out, tag), SystemMetricsMonitor(log_every_n_steps=1), *(extra or [])]
    if tag == "meta":  # the package's callbacks on top of FSDP2, unchanged
        callbacks += [SequenceMetadataCallback(), TokenThroughputMonitor(log_every_n_steps=1)]
    if tag in ("fresh", "killed"):
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=STEPS // 2, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks,
        enable_checkpointing=tag in ("fresh", "killed"), precision=precision, gradient_clip_val=CLIP,
    )  # fmt: skip
    world, rank = devices, int(os.environ.get("LOCAL_RANK", 0))
    data = [rank_batch(step, rank, world) for step in global_batches()]
    trainer.fit(module, train_dataloaders=Batches(data), **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("devices", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--resume-other", type=Path, help="a checkpoint of another run (SIGKILLed or resharded)")
    parser.add_argument("--kill-at", type=int, help="SIGKILL every rank after this step (and its checkpoint)")
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--offload", action="store_true", help="activation offload in the --meta run")
    parser.add_argument("--ep", type=int, default=1, help="expert_parallel_size (FSDP2 x EP)")
    args = parser.parse_args()
    global EP
    EP = args.ep
    args.out.mkdir(parents=True, exist_ok=True)

    def module() -> MoEGPTLightningModule:
        torch.manual_seed(0)
        return MoEGPTLightningModule(MoEGPTConfig(**CONFIG), lr=1e-2, aux_loss_coef=0.0, warmup_steps=3)

    if args.kill_at is not None:
        fit(args.devices, args.out, "killed", module(), STEPS, extra=[Killer(args.kill_at)])
    fit(args.devices, args.out, "fresh", module(), STEPS)
    if args.resume is not None:
        fit(args.devices, args.out, "resumed", module(), STEPS, ckpt_path=args.resume)
    if args.resume_other is not None:
        fit(args.devices, args.out, "other", module(), STEPS, ckpt_path=args.resume_other)
    if args.meta:
        torch.manual_seed(0)
        offload = OFFLOAD if args.offload else None
        fit(args.devices, args.out, "meta", MetaModule(), 2, precision="bf16-mixed", offload=offload)


def finish() -> None:
    """Exit once every rank has written its files, skipping interpreter teardown: gloo's threads can abort it
    ("terminate called without an active exception"), which Lightning's launcher would report as a failed rank."""
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    finish()
