"""Context parallelism inside Lightning: ranks that split the positions of every packed batch train the reference
MoE GPT exactly as one process holding the whole batch (losses logged on every rank, weights after four AdamW steps),
with DDP, FSDP2 x dp, expert parallelism drawn from the cp ranks (flat, and hierarchical across two nodes), the
sequence-level balance loss, activation offload and compiled layers (one graph for every document layout); and so
do tiny transformers Qwen3-MoE (cp=4) and DeepSeek-V3 (multi-head latent attention gathering its latent) read from
``save_pretrained`` directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parents[1]
sys.path.insert(0, str(SCRIPTS))
from _pretrained import save_tiny  # noqa: E402
from cp_steps import VOCAB, batches, fit, module  # noqa: E402

from lightning_llmfast.bench.processes import free_port  # noqa: E402


def _max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b if b[k].is_floating_point() and b[k].norm() > 0)


_REFERENCES: dict[tuple[int, str], tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}


def _one_process(
    dp: int, pretrained: str | None = None, aux_loss: str = "micro_batch"
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses, final weights and first-step gradients of one process accumulating the micro-batches of ``dp`` streams
    per step (memoised: one fit per ``dp`` and balance loss of the reference model)."""
    if pretrained is not None or (dp, aux_loss) not in _REFERENCES:
        model, log, _ = fit("llmfast", 1, dp, pretrained, aux_loss=aux_loss)
        found = (log.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, log.grads)
        if pretrained is not None:
            return found
        _REFERENCES[dp, aux_loss] = found
    return _REFERENCES[dp, aux_loss]


def _launch(tmp_path: Path, args: list[str], nodes: int = 1) -> None:
    """``cp_steps.py`` with ``args``: one script per Lightning node (``NODE_RANK``; Lightning starts the node's other
    processes), all joined on one free port."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = [sys.executable, str(SCRIPTS / "cp_steps.py"), *args, "--nodes", str(nodes)]
    procs = []
    for node in range(nodes):
        node_env = {**env, "NODE_RANK": str(node)}
        procs.append(subprocess.Popen(command, cwd=tmp_path, text=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, env=node_env))  # fmt: skip
    errors = [proc.communicate(timeout=300)[1] for proc in procs]
    for proc, error in zip(procs, errors):
        assert proc.returncode == 0, error[-4000:]


@pytest.mark.parametrize(
    ("devices", "nodes", "cp", "sharding", "ep", "options"),
    [(2, 1, 2, "ddp", 1, ("--compile", "aot_eager")), (2, 1, 2, "ddp", 2, ()), (4, 1, 2, "fsdp", 1, ()),
     (4, 1, 4, "ddp", 1, ("--aux-loss", "sequence")), (2, 1, 2, "ddp", 1, ("--offload",)),
     (1, 2, 2, "ddp", 2, ("--ep-dispatch", "hierarchical"))],
    ids=["cp2-compiled", "cp2-ep2", "fsdp-dp2-cp2", "cp4-sequence-loss", "cp2-offload", "cp2-ep2-hierarchical-2-nodes"],
)  # fmt: skip
def test_context_parallel_fit_equals_one_process(
    tmp_path: Path, devices: int, nodes: int, cp: int, sharding: str, ep: int, options: tuple[str, ...]
) -> None:
    out = tmp_path / "cp"
    args = ["--out", str(out), "--devices", str(devices), "--cp", str(cp), "--sharding", sharding, "--ep", str(ep)]
    _launch(tmp_path, [*args, *options], nodes)
    world = devices * nodes
    dp = world // cp
    aux_loss = "sequence" if "sequence" in options else "micro_batch"
    losses, state, _ = _one_process(dp, aux_loss=aux_loss)
    for rank in range(world):
        saved = torch.load(f"{out}.rank{rank}", weights_only=True)
        # Every rank logs its cp group's batch loss: the one-process loss of that stream's micro-batch.
        assert saved["losses"] == pytest.approx(losses[rank // cp :: dp], rel=1e-5, abs=1e-6)
        assert _max_relative_difference(saved["state"], state) < 1e-5
        # every layer's saved activations went through the offloader
        assert (saved["offloaded"] > 0) == ("--offload" in options)
        hierarchical = "hierarchical" in options
        assert ("HierarchicalDispatcher" in saved["dispatchers"]) == hierarchical, saved["dispatchers"]
        if "--compile" in options:
            # Compiled layers (both share one code object): one graph for the four document layouts, not one per
            # layout (the attention is one custom op whose plan travels as host tensors of dynamic sizes).
            assert saved["graphs"] == 1, saved["graphs"]
    assert _max_relative_difference(module().state_dict(), state) > 1e-2  # the steps moved the weights
    if aux_loss == "sequence":  # the per-document loss steers other weights than the batch's
        assert _max_relative_difference(_one_process(dp)[1], state) > 1e-6


@pytest.mark.parametrize(("family", "cp"), [("qwen3_moe", 4), ("deepseek_v3", 2)])
def test_transformers_context_parallel_fit_equals_one_process(tmp_path: Path, family: str, cp: int) -> None:
    """A cp group of ``cp`` ranks: RoPE from the shard's positions inside each document, the balance losses over the
    cp group, DeepSeek-V3's attention swapped to gather the compressed latent."""
    pretrained = str(save_tiny(family, tmp_path / family, vocab_size=VOCAB))
    out = tmp_path / "cp"
    _launch(tmp_path, ["--out", str(out), "--devices", str(cp), "--cp", str(cp), "--pretrained", pretrained])
    losses, state, grads = _one_process(1, pretrained)
    for rank in range(cp):
        saved = torch.load(f"{out}.rank{rank}", weights_only=True)
        assert saved["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        # DeepSeek-V3's 3 MLA modules were swapped at setup to gather the latent.
        assert saved["latent_attention"] == (3 if family == "deepseek_v3" else 0)
        assert _max_relative_difference(saved["grads"], grads) < 1e-5  # measured 1.3e-6 (Qwen3-MoE)
        # Four AdamW steps: the first step's update is lr * sign(grad) where a gradient is near zero, so float32
        # rounding in a few experts' near-zero gradients moves their weights apart more than the gradients differ
        # (measured 4.5e-5 in one expert tensor of Qwen3-MoE, 1e-6 elsewhere).
        assert _max_relative_difference(saved["state"], state) < 1e-4
    initial = module(pretrained)
    initial.materialize()
    assert _max_relative_difference(initial.state_dict(), state) > 1e-2  # the steps moved the weights


def _cp_run(tmp_path: Path, name: str, *args: str) -> dict[str, torch.Tensor]:
    """Two ranks of one cp group run ``cp_steps.py`` with ``args``; rank 0's final weights."""
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "cp_steps.py"), "--out", str(out), "--devices", "2", "--cp", "2", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(f"{out}.rank0", weights_only=True)["state"]


def test_a_cp2_checkpoint_resumes_in_one_process_and_back(tmp_path: Path) -> None:
    # Context parallelism holds no state: a checkpoint written by a cp group is the one process's, and resumes there.
    _cp_run(tmp_path, "first", "--steps", "2", "--save", str(tmp_path / "cp.ckpt"))
    fit("llmfast", 1, steps=2, save=str(tmp_path / "one.ckpt"))
    cp_ckpt, one_ckpt = (torch.load(tmp_path / n, weights_only=False) for n in ("cp.ckpt", "one.ckpt"))
    assert _max_relative_difference(cp_ckpt["state_dict"], one_ckpt["state_dict"]) < 1e-5
    moments = [
        {f"{i}.{k}": v for i, s in cp["optimizer_states"][0]["state"].items() for k, v in s.items() if k != "step"}
        for cp in (cp_ckpt, one_ckpt)
    ]
    assert _max_relative_difference(*moments) < 1e-5
    reference = fit("llmfast", 1, resume=str(tmp_path / "one.ckpt"))[0].state_dict()
    from_cp = fit("llmfast", 1, resume=str(tmp_path / "cp.ckpt"))[0].state_dict()
    assert _max_relative_difference(from_cp, reference) < 1e-5
    back = _cp_run(tmp_path, "back", "--resume", str(tmp_path / "one.ckpt"))  # a one-process checkpoint at cp=2
    assert _max_relative_difference(back, reference) < 1e-5
    assert _max_relative_difference(one_ckpt["state_dict"], reference) > 1e-3  # the resumed steps moved the weights


@pytest.mark.parametrize("mode", ["dense", "per_layer"])
def test_a_shard_is_refused_by_attention_that_reads_its_positions(mode: str) -> None:
    # Masks built from a shard's positions would attend only this rank's keys: silent wrong output, so refused.
    from lightning_llmfast import MoEGPTLightningModule
    from lightning_llmfast.errors import ConfigError

    config = module().model.config
    model = MoEGPTLightningModule(type(config)(**{**vars(config), "attention_metadata": mode}))
    shard = batches()[1].context_shard(0, 2, None)
    with pytest.raises(ConfigError, match=f"attention_metadata='{mode}'.*'cached'"):
        model(shard)
