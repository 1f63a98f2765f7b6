"""OffloadConfig and the rebuild option, the pinned pool's growth (sized within the first steps, one warning), and the
global hooks an offloader installs (removed on close)."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast import ActivationOffload, LLMFastStrategy
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig
from lightning_llmfast.offload.residents import Residents

VOCAB = 32


def _model(seed: int = 0) -> MoEGPT:
    torch.manual_seed(seed)
    config = MoEGPTConfig(vocab_size=VOCAB, hidden_size=16, n_layers=3, n_heads=2, n_kv_heads=1, ffn_size=32)
    return MoEGPT(config)


def _step(model: MoEGPT, ids: torch.Tensor, off: ActivationOffloader | None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with off if off is not None else torch.enable_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            logits = model(ids).float()
        loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("settings", "copies", "rebuilds", "gemms"),
    [
        ({"rebuild": None}, True, False, False),
        ({"rebuild": None, "offload_layers": 0}, False, False, False),
        ({"rebuild": "norms", "offload_layers": 0}, False, True, False),
        ({"rebuild": "norms+gemms", "offload_layers": 0}, False, True, True),
        ({"rebuild": "norms+gemms", "rebuild_gemm_layers": 1}, True, True, True),
    ],
)
def test_rebuild_is_independent_of_copying_and_gradients_stay_bit_identical(
    settings: dict[str, Any], copies: bool, rebuilds: bool, gemms: bool
) -> None:
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(3))
    expected = _step(_model(), ids, None)
    model = _model()
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True, **settings))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = _step(model, ids, off)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    stats = off.stats
    assert (stats["offloaded_bytes"] > 0) == copies
    assert (stats["rebuilt_tensors"] > 0 and stats["recast_casts"] > 0) == rebuilds
    # the gate/up output's rebuild is one grouped GEMM: more rebuilt bytes than the norms alone
    norms_only = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True, offload_layers=0))
    _step(model, ids, norms_only)
    assert (stats["rebuilt_bytes"] > norms_only.stats["rebuilt_bytes"]) == gemms
    off.close()
    norms_only.close()


def test_config_is_frozen_validated_and_shared_by_offloader_and_strategy() -> None:
    config = OffloadConfig(offload_layers=2, rebuild="norms+gemms", force=True)
    with pytest.raises(AttributeError):
        config.offload_layers = 3  # type: ignore[misc]
    with pytest.raises(OffloadError, match="rebuild_gemm_layers=1 needs rebuild='norms\\+gemms'"):
        OffloadConfig(rebuild_gemm_layers=1)
    off = ActivationOffloader(_model().layers, config)
    assert off.config is config
    off.close()
    strategy = LLMFastStrategy(offload=config)
    assert strategy.offload_config is config
    callback = ActivationOffload(config)
    assert callback.config is config and ActivationOffload().config == OffloadConfig()


@pytest.mark.parametrize("owner", ["offloader", "callback"])
def test_config_is_the_only_configuration(owner: str) -> None:
    """The offload settings as keyword arguments (and the older ``rebuild_gemms``) are gone: one config object."""
    make = (lambda **kw: ActivationOffloader(_model().layers, **kw)) if owner == "offloader" else ActivationOffload
    for removed in ({"min_offload_bytes": 0}, {"rebuild_gemms": True}, {"force": True}):
        with pytest.raises(TypeError, match=next(iter(removed))):
            make(**removed)
    with pytest.raises(OffloadError, match="config must be an OffloadConfig, got dict"):
        make(config={"force": True})


def test_global_registration_hooks_are_removed_when_the_last_offloader_closes() -> None:
    gc.collect()  # offloaders of earlier tests that were never closed release the hooks when collected
    assert not Residents.hooks_installed()
    model = _model()
    first = ActivationOffloader(model.layers, OffloadConfig(force=True))
    second = ActivationOffloader(model.layers, OffloadConfig(force=True))
    assert Residents.hooks_installed()
    first.close()
    first.close()  # twice is harmless
    assert Residents.hooks_installed()
    second.close()
    assert not Residents.hooks_installed()
    third = ActivationOffloader(model.layers, OffloadConfig(force=True))
    assert Residents.hooks_installed()
    del third  # dropped without close()
    gc.collect()
    assert not Residents.hooks_installed()


def test_pool_reaches_its_size_in_the_first_steps_and_warns_once_with_the_total() -> None:
    model = _model()
    off = ActivationOffloader(model.layers, OffloadConfig(min_offload_bytes=0, force=True, pool_headroom=1.25))
    g = torch.Generator().manual_seed(0)
    sizes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(24):
            seq = [9, 23, 16, 31, 12, 27][step % 6] + int(torch.randint(0, 3, (1,), generator=g))
            _step(model, torch.randint(0, VOCAB, (2, seq), generator=g), off)
            sizes.append(off.stats["pool_bytes"])
        during = [w for w in caught if "pool" in str(w.message)]
        off.close()
        pool_warnings = [w for w in caught if "pool" in str(w.message)]
    assert during == []  # nothing while training: a growth warning per step was spam
    grown = [i for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]]
    assert all(i < 8 for i in grown), sizes  # MoE sizes vary per step: the pool settles within the first steps
    assert len(pool_warnings) == (1 if grown and max(grown) > 1 else len(pool_warnings)) <= 1
    if pool_warnings:
        assert "in total" in str(pool_warnings[0].message)
