"""The expert-bias update once per optimizer step under Lightning: ExpertBalanceCallback with gradient accumulation,
one process and DDP on 2 gloo processes, against a float64 loop of the aux-loss-free rule on the same global batch;
and the "global" aux loss summed over micro-batches and ranks in the same runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

H, E, K, STEPS, ACCUMULATE, MICRO_BATCH, RATE = 8, 8, 2, 10, 2, 8, 0.05

_SCRIPT = textwrap.dedent(
    f"""
    import json, sys
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from lightning_llmfast.callbacks import ExpertBalanceCallback
    from lightning_llmfast.moe import MoEBlock, MoEConfig

    devices, out = int(sys.argv[1]), sys.argv[2]
    H, E, K, STEPS, ACCUMULATE, MICRO_BATCH, RATE = {H}, {E}, {K}, {STEPS}, {ACCUMULATE}, {MICRO_BATCH}, {RATE}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.block = MoEBlock(MoEConfig.build(
                H, 8, E, K, expert_bias=True, bias_update_rate=RATE, aux_loss="global", backend="torch"
            ))
            self.aux = []
            self.block.router.requires_grad_(False)  # routing depends on the data and the bias only: exact

        def training_step(self, batch, batch_idx):
            out = self.block(batch).square().mean()
            self.aux.append(float(self.block.stats.aux_loss))
            return out

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

        def train_dataloader(self):
            x = torch.randn(STEPS * ACCUMULATE * MICRO_BATCH, H, generator=torch.Generator().manual_seed(1))
            rank, world = self.trainer.global_rank, self.trainer.world_size
            rows = [i for i in range(len(x)) if i % world == rank]  # each global micro-batch split over the ranks
            return DataLoader(x[rows], batch_size=MICRO_BATCH // world)

    module = Module()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="llmfast", max_steps=STEPS, accumulate_grad_batches=ACCUMULATE,
        callbacks=[ExpertBalanceCallback()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(module)
    with open(f"{{out}}.{{trainer.global_rank}}", "w") as f:
        json.dump({{"bias": module.block.expert_bias.tolist(), "router": module.block.router.weight.tolist(),
                   "aux": module.aux, "world": trainer.world_size}}, f)
    from lightning_llmfast.bench.processes import leave_world

    leave_world()  # every rank done: out without the interpreter teardown gloo's threads can abort
    """
)


def _oracle_bias(router: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's rule once per step: ``b_i += rate * sign(mean load - load_i)`` over the step's whole batch."""
    x = torch.randn(STEPS * ACCUMULATE * MICRO_BATCH, H, generator=torch.Generator().manual_seed(1)).double()
    bias = torch.zeros(E, dtype=torch.float64)
    per_step = ACCUMULATE * MICRO_BATCH
    for step in range(STEPS):
        load = torch.zeros(E, dtype=torch.float64)
        for t in range(step * per_step, (step + 1) * per_step):
            sel = (x[t] @ router.double().T).softmax(-1) + bias
            for e in sel.argsort(descending=True)[:K].tolist():
                load[e] += 1
        bias = bias + RATE * torch.sign(load.mean() - load)
    return bias


def test_bias_once_per_step_same_on_both_ranks_and_as_one_process(tmp_path: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(_SCRIPT)
    results = {}
    for devices in (1, 2):
        out = tmp_path / f"out{devices}"
        proc = subprocess.run(
            [sys.executable, str(script), str(devices), str(out)],
            cwd=tmp_path, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[devices] = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(devices)]
    assert [r["world"] for r in results[2]] == [2, 2]
    one, (rank0, rank1) = results[1][0], results[2]
    assert rank0["bias"] == rank1["bias"]  # identical, not merely close: one all-reduce of integer counts
    assert rank0["bias"] == one["bias"]
    want = _oracle_bias(torch.tensor(one["router"]))
    torch.testing.assert_close(torch.tensor(one["bias"], dtype=torch.float64), want, rtol=0, atol=1e-6)
    assert bool((want != 0).any()) and want.abs().max() <= STEPS * RATE + 1e-9  # moved, one step of RATE at a time
    # aux_loss="global": f from the counts of the step so far summed over the ranks, P from each rank's tokens; with
    # equal shards the mean over the ranks is the one-process loss of the same global micro-batches.
    assert len(one["aux"]) == len(rank0["aux"]) == STEPS * ACCUMULATE
    mean = (torch.tensor(rank0["aux"]) + torch.tensor(rank1["aux"])) / 2
    torch.testing.assert_close(mean, torch.tensor(one["aux"]), rtol=1e-5, atol=1e-6)
    assert rank0["aux"] != rank1["aux"]  # each rank's own P: the check compares more than one number twice
