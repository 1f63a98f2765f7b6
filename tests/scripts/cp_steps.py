"""Four AdamW steps of the reference MoE GPT on awkward packed batches, every rank of a context-parallel group
holding a share of each batch's positions.

Run by tests/test_context_parallel_fit.py with ``--devices N --cp C [--sharding S] [--ep E]`` (Lightning launches
the other ranks; with ``--nodes M`` the test starts one script per node, ``NODE_RANK`` set), ``--aux-loss sequence``
for DeepSeek-V3's per-document balance loss in every MoE block, ``--ep-dispatch hierarchical`` for the expert
dispatch across nodes, ``--compile BACKEND`` for the layers compiled (``torch.compile``), with ``--pretrained DIR``
a transformers model's ``HFCausalLMModule`` instead; every rank writes ``<out>.rank<r>``: its logged ``train/loss``
per step, the final weights (gathered under FSDP), under DDP without expert parallelism the first step's gradients,
and what the run used (dispatchers, offloaded tensors, compiled graphs). The test compares them with one process
training on the same batches.
"""

from __future__ import annotations

import argparse
import dataclasses
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from lightning_llmfast import HFCausalLMModule, LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.bench.processes import leave_world
from lightning_llmfast.data import PackedBatch, pack_documents
from lightning_llmfast.expert_parallel import expert_dtensor_state_dict
from lightning_llmfast.hf.context import LatentGatherAttention
from lightning_llmfast.moe import MoEBlock
from lightning_llmfast.offload import OffloadConfig

STEPS = 4
SEQ_LEN = 16
ROWS = 2
VOCAB = 64


def batches() -> list[PackedBatch]:
    """A batch of two documents of exactly ``T``; one of length-1 and prime-length documents; one document longer
    than a row (cut at the row end: it spans every rank); random lengths."""
    gen = torch.Generator().manual_seed(7)

    def doc(length: int) -> list[int]:
        return torch.randint(1, VOCAB, (length,), generator=gen).tolist()

    layouts = [[16, 16], [1, 1, 2, 3, 5, 7, 11, 1], [32], [int(n) for n in torch.randint(1, 12, (5,), generator=gen)]]
    out = []
    for lengths in layouts:
        packed = list(pack_documents([doc(n) for n in lengths], SEQ_LEN, ROWS, vocab_size=VOCAB, lookahead=8))
        out.append(packed[0])
        assert packed[0].input_ids.shape == (ROWS, SEQ_LEN), lengths
    return out


def module(
    pretrained: str | None = None, aux_loss: str = "micro_batch", compile: bool | str = False
) -> L.LightningModule:
    """The reference MoE GPT (its MoE blocks' balance loss ``aux_loss``, its layers compiled with ``compile``), or the
    ``HFCausalLMModule`` of a tiny transformers model's ``save_pretrained``."""
    torch.manual_seed(0)
    if pretrained is not None:
        return HFCausalLMModule.from_pretrained(pretrained, lr=1e-2, warmup_steps=2, aux_loss_coef=0.01)
    config = MoEGPTConfig(vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=32,
                          num_experts=4, top_k=2)  # fmt: skip
    model = MoEGPTLightningModule(config, lr=1e-2, warmup_steps=2, aux_loss_coef=0.01, compile=compile)
    for block in model.modules():
        if isinstance(block, MoEBlock):
            block.config = dataclasses.replace(block.config, aux_loss=aux_loss)
    return model


class LossLog(L.Callback):
    """The logged ``train/loss`` of every step and the gradients the first optimizer step took (DDP's all-reduced
    sums, token-weighted: read before the second step zeroes them)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_zero_grad(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def streams(dp: int) -> list[PackedBatch]:
    """The micro-batches one process accumulates to see what ``dp`` streams of batches see (each the share of one cp
    group, from the sampler Lightning injects with the strategy's ``distributed_sampler_kwargs``: shuffled with seed
    0, one permutation per epoch): step by step, stream by stream."""
    data, out, epoch = batches(), [], 0
    while len(out) < STEPS * dp:
        samplers = [DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=0) for r in range(dp)]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        orders = [list(sampler) for sampler in samplers]
        out += [data[orders[r][i]] for i in range(len(orders[0])) for r in range(dp)]
        epoch += 1
    return out[: STEPS * dp]


def fit(
    strategy: Any,
    devices: int,
    dp: int = 1,
    pretrained: str | None = None,
    steps: int = STEPS,
    save: str | None = None,
    resume: str | None = None,
    aux_loss: str = "micro_batch",
    nodes: int = 1,
    compile: bool | str = False,
) -> tuple[L.LightningModule, LossLog, L.Trainer]:
    """Trains to ``steps`` steps (from the checkpoint ``resume``, if given; writes the checkpoint ``save`` at the end):
    several ranks read :func:`batches` through the sampler Lightning injects, one process accumulates the ``dp``
    streams' micro-batches of every step (:func:`streams`)."""
    torch.set_num_threads(1)
    model, log = module(pretrained, aux_loss, compile), LossLog()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy, max_steps=steps, callbacks=[log],
        accumulate_grad_batches=1 if devices * nodes > 1 else dp, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = batches() if devices * nodes > 1 else streams(dp)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=None), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return model, log, trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--cp", type=int, required=True)
    parser.add_argument("--sharding", default="ddp")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--pretrained", default=None)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--save", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--offload", action="store_true", help="offload every layer's saved activations (forced)")
    parser.add_argument("--aux-loss", default="micro_batch")
    parser.add_argument("--nodes", type=int, default=1, help="Lightning nodes of --devices processes each")
    parser.add_argument("--ep-dispatch", default="flat")
    parser.add_argument("--compile", default=False, help="a torch.compile backend for the layers")
    args = parser.parse_args()
    strategy = LLMFastStrategy(
        sharding=args.sharding, context_parallel_size=args.cp, expert_parallel_size=args.ep,
        ep_dispatch=args.ep_dispatch,
        offload=OffloadConfig(force=True, keep_last_layers=0, min_offload_bytes=0) if args.offload else None,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    _, log, trainer = fit(
        strategy, args.devices, pretrained=args.pretrained, steps=args.steps, save=args.save, resume=args.resume,
        aux_loss=args.aux_loss, nodes=args.nodes, compile=args.compile,
    )  # fmt: skip
    state = full_state(trainer)
    grads = log.grads if args.sharding == "ddp" and args.ep == 1 else {}  # whole tensors only
    latent = sum(isinstance(m, LatentGatherAttention) for m in trainer.lightning_module.modules())
    offloaded = (trainer.strategy.offload_stats or {}).get("offloaded_tensors", 0)
    dispatchers = sorted({type(block.dispatcher).__name__ for block in trainer.lightning_module.modules()
                          if isinstance(block, MoEBlock)})  # fmt: skip
    saved = {"losses": log.losses, "state": state, "grads": grads, "latent_attention": latent, "offloaded": offloaded,
             "dispatchers": dispatchers, "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}  # fmt: skip
    torch.save(saved, f"{args.out}.rank{trainer.global_rank}")


def full_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank: FSDP's and expert parallelism's shards gathered."""
    strategy, module = trainer.strategy, trainer.lightning_module
    dims = getattr(strategy, "parallel_dims", None)
    if getattr(strategy, "sharding", "ddp") != "ddp":
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    else:
        state = module.state_dict()
        if dims is not None and dims.ep_enabled:
            state = expert_dtensor_state_dict(module, state, dims.ep_mesh)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


if __name__ == "__main__":
    main()
    dist.barrier()
    leave_world()
