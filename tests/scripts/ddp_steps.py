"""Six AdamW steps of the reference MoE GPT: rank ``r`` trains on micro-batch ``2 * step + r`` of ``batches()``.

Run by tests/test_dp_equivalence.py with ``--devices 2`` (Lightning launches the second rank); rank 0 saves the
final weights to ``--out``. The test compares them with one process that accumulates the same micro-batches.
Each rank also writes ``<out>.exit<rank>``: whether a process group was still up when its last exit handler ran
(the handlers run as at a normal exit; the interpreter's teardown is then skipped, see ``leave_world``).
"""

from __future__ import annotations

import argparse
import atexit
from datetime import timedelta

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_llmfast import LLMFastStrategy, MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.bench.processes import leave_world
from lightning_llmfast.data import PackedBatch, SyntheticCorpus, pack_documents

STEPS = 6


def batches() -> list[PackedBatch]:
    """Micro-batches of unequal label-token counts (documents of very different lengths)."""
    corpus = SyntheticCorpus(80, mean_len=14, seed=5, distribution="exponential", vocab_size=64)
    return list(pack_documents(corpus, 24, 2, vocab_size=64, lookahead=2))[: 2 * STEPS]


def module(aux_loss_coef: float = 0.01) -> MoEGPTLightningModule:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_size=32,
                          num_experts=4, top_k=2)  # fmt: skip
    return MoEGPTLightningModule(config, lr=1e-2, warmup_steps=2, aux_loss_coef=aux_loss_coef)


class _PerRank(MoEGPTLightningModule):
    def train_dataloader(self) -> DataLoader[PackedBatch]:
        return DataLoader(batches()[self.trainer.global_rank :: 2], batch_size=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = module()
    model.__class__ = _PerRank  # the same weights, plus a per-rank train_dataloader
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=LLMFastStrategy(timeout=timedelta(seconds=60)), max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip

    def _record_exit_state() -> None:  # registered first, so it runs after every handler the fit registers
        with open(f"{args.out}.exit{trainer.global_rank}", "w") as f:
            f.write(f"initialized={dist.is_initialized()}")

    atexit.register(_record_exit_state)
    trainer.fit(model)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
    dist.barrier()  # both ranks done before either shuts the group down
    atexit._run_exitfuncs()  # as at a normal exit: the strategy's process-group shutdown, then _record_exit_state
    leave_world()  # out without the interpreter teardown, which gloo's threads can abort
