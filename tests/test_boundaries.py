"""Package boundaries: the plain-PyTorch layers import and work without Lightning or torchmetrics installed, and the
top-level package registers the strategies where Lightning is installed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A fresh interpreter in which Lightning, pytorch_lightning and torchmetrics cannot be imported (as if not installed).
_BLOCKED = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = {"lightning", "pytorch_lightning", "torchmetrics", "lightning_fabric", "lightning_utilities"}


    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None


    sys.meta_path.insert(0, Block())
    """
)

_PLAIN_PYTORCH_RUN = textwrap.dedent(
    """
    import torch

    import lightning_llmfast
    from lightning_llmfast.data import pack_documents
    from lightning_llmfast.moe import MoEBlock, permute, route, unpermute
    from lightning_llmfast.offload import ActivationOffloader, OffloadConfig
    from lightning_llmfast.seqmeta import SequenceMetadata

    # data + seqmeta: two awkward documents in rows of 5; the metadata matches the lengths counted by hand
    batch = next(pack_documents([[3, 4, 5, 6, 7, 8, 9], [10, 11]], seq_len=5, batch_size=2))
    meta = SequenceMetadata.from_batch(batch)
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    assert sum(lengths) == 10 and meta.max_seqlen == max(lengths), (lengths, meta.max_seqlen)

    # moe: route + permute/unpermute against a per-token loop of the published top-k softmax formula
    g = torch.Generator().manual_seed(5)
    logits, x = torch.randn(7, 3, generator=g), torch.randn(7, 4, generator=g)
    plan = route(logits, top_k=2)
    y = unpermute(permute(x, plan) * 2.0, plan)
    probs = logits.double().softmax(-1)
    for t in range(7):
        top = probs[t].topk(2)
        assert sorted(plan.expert_ids[t].tolist()) == sorted(top.indices.tolist())
        want = 2.0 * x[t].double() * (top.values / top.values.sum()).sum()
        torch.testing.assert_close(y[t].double(), want, rtol=1e-5, atol=1e-6)
    assert plan.tokens_per_expert.sum().item() == 14

    # offload: gradients through offloaded layers equal those without the offloader
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([MoEBlock(hidden_size=8, ffn_size=16, num_experts=3, top_k=2) for _ in range(3)])
    inp = torch.randn(2, 5, 8)

    def grads(offloader):
        layers.zero_grad(set_to_none=True)
        h = inp
        if offloader is None:
            for layer in layers:
                h = layer(h)
            h.square().mean().backward()
        else:
            with offloader:
                for layer in layers:
                    h = layer(h)
                h.square().mean().backward()
        return [p.grad.clone() for p in layers.parameters()]

    expected = grads(None)
    off = ActivationOffloader(layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True))
    got = grads(off)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert off.stats["offloaded_tensors"] > 0, off.stats
    off.close()

    # the metric that needs torchmetrics says so instead of half-importing
    try:
        lightning_llmfast.moe.ExpertLoadMetric
    except ModuleNotFoundError as err:
        assert "torchmetrics" in str(err), err
    else:
        raise AssertionError("ExpertLoadMetric resolved without torchmetrics")

    import sys

    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
    assert not loaded, loaded
    assert not lightning_llmfast._LIGHTNING_AVAILABLE
    print("OK")
    """
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )


@pytest.mark.slow
def test_plain_pytorch_layers_work_without_lightning_or_torchmetrics() -> None:
    result = _run(_BLOCKED + _PLAIN_PYTORCH_RUN)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-4000:]


def test_the_blocker_really_blocks_lightning() -> None:
    # Guards the test above against a finder that lets Lightning through.
    result = _run(_BLOCKED + "import lightning\n")
    assert result.returncode != 0 and "blocked by the test" in result.stderr, result.stderr[-2000:]


def test_importing_the_package_registers_the_strategies() -> None:
    code = textwrap.dedent(
        """
        import lightning_llmfast
        from lightning.pytorch.strategies import StrategyRegistry

        assert lightning_llmfast._LIGHTNING_AVAILABLE
        assert {"llmfast", "llmfast_offload"} <= set(StrategyRegistry), sorted(StrategyRegistry)
        assert type(StrategyRegistry.get("llmfast")).__name__ == "LLMFastStrategy"
        print("OK")
        """
    )
    result = _run(code)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-4000:]


def test_a_broken_import_inside_the_package_is_not_taken_for_missing_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    import lightning_llmfast

    def fail(name: str) -> None:
        raise ModuleNotFoundError("No module named 'lightning_llmfast.nope'", name="lightning_llmfast.nope")

    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(ModuleNotFoundError, match=r"lightning_llmfast\.nope"):
        lightning_llmfast._register_strategies()


def test_expert_load_metric_keeps_its_import_paths() -> None:
    from lightning_llmfast.callbacks import ExpertLoadMetric
    from lightning_llmfast.moe import ExpertLoadMetric as from_moe
    from lightning_llmfast.moe.metrics import ExpertLoadMetric as from_module

    assert ExpertLoadMetric is from_moe is from_module
