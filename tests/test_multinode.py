"""Two nodes on localhost: two ``torchrun --nnodes 2`` invocations of ``tests/hsdp_worker.py`` (2 processes each, gloo)
under ``Trainer(num_nodes=2, devices=2, strategy=LLMFastStrategy(sharding="hsdp"))``, as docs/multinode.md shows.

Both invocations succeed; the 4 ranks report the same finite losses and gradient norms (means over the world), the
first loss is one process's on the same global batch (to 1e-5), each rank holds half of the model (sharded over its
node's 2 processes, replicated across the nodes), and the DCP checkpoint written after the first step resumes to the
uninterrupted run's second loss. The example CLI's command lines of docs/multinode.md parse to the same layout.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import hsdp_worker as worker
import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast import MoEGPTConfig, MoEGPTLightningModule
from lightning_llmfast.bench.processes import free_port

TIMEOUT = 240.0
ROOT = Path(__file__).resolve().parents[1]


def _torchrun(node: int, port: int, out: Path) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(worker.NODES), "--node-rank", str(node),
        "--nproc-per-node", str(worker.DEVICES), "--master-addr", "127.0.0.1", "--master-port", str(port),
        worker.__file__, str(out),
    ]  # fmt: skip
    # The workers import the package from this checkout, installed or not.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    with open(out / f"node{node}.log", "w") as log:  # the child writes through its own copy of the descriptor
        return subprocess.Popen(
            command, cwd=Path(worker.__file__).parent, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip


@pytest.mark.slow
def test_two_torchrun_nodes_train_hsdp_with_equal_losses_on_every_rank(tmp_path: Path) -> None:
    port = free_port()
    nodes = [_torchrun(node, port, tmp_path) for node in range(worker.NODES)]
    try:
        codes = [node.wait(timeout=TIMEOUT) for node in nodes]
    finally:
        for node in nodes:  # a failed or hung node: end both, and every rank they started
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    logs = "\n".join((tmp_path / f"node{i}.log").read_text()[-3000:] for i in range(worker.NODES))
    assert codes == [0, 0], logs
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert [(r["rank"], r["node"], r["world"]) for r in records] == [(0, 0, 4), (1, 0, 4), (2, 1, 4), (3, 1, 4)]
    first = records[0]
    assert len(first["losses"]) == worker.STEPS and all(math.isfinite(x) for x in first["losses"] + first["norms"])
    assert first["norms"][0] > worker.CLIP  # clipping was active
    torch.manual_seed(0)  # one process, the same initial weights and the whole first global batch
    one = MoEGPTLightningModule(MoEGPTConfig(**worker.CONFIG))
    batch = worker.rank_batch(worker.global_batches()[0], 0, 1)
    with torch.no_grad():
        loss = F.cross_entropy(one(batch).flatten(0, 1), batch.labels.flatten(), ignore_index=-100).item()
    assert abs(first["losses"][0] - loss) <= 1e-5 * loss, (first["losses"][0], loss)
    for record in records[1:]:
        assert (record["losses"], record["norms"]) == (first["losses"], first["norms"])
    for record in records:
        share = record["share"]
        assert share["dp_mesh"] == ["dp_replicate", "dp_shard"] and share["held"] * 2 == share["full"], share
        assert record["resumed_losses"] == first["losses"][1:]  # resumed after step 1: the same step 2


def _cli_commands() -> list[str]:
    """The ``examples/train_moe.py fit ...`` part of every command in docs/multinode.md's "The example CLI"."""
    text = (ROOT / "docs" / "multinode.md").read_text()
    section = text.split("### The example CLI", 1)[1].split("\n### ", 1)[0]
    blocks = [block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]
    return [block[block.index("examples/train_moe.py") :].strip() for block in blocks]


@pytest.mark.slow
def test_the_documented_cli_flags_parse_to_hsdp_on_two_nodes() -> None:
    commands = _cli_commands()
    assert len(commands) == 2
    for command in commands:
        proc = subprocess.run(
            [sys.executable, *shlex.split(command), "--print_config"], cwd=ROOT, capture_output=True, text=True,
            timeout=TIMEOUT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "sharding: hsdp" in proc.stdout and "num_nodes: 2" in proc.stdout, proc.stdout[-3000:]
