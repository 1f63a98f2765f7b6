"""The NVMe tier: storages past the pinned pool's budget go to files and come back bit-identically; files never
outlive their step, the tier, an exception or the process; a full disk keeps what it failed to write on the device,
recomputes the layers left in the step, and warns."""

from __future__ import annotations

import dataclasses
import errno
import gc
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_llmfast.errors import OffloadError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig, nvme
from lightning_llmfast.offload.nvme import NvmeTier, read_file, write_file

VOCAB = 32


@pytest.mark.parametrize("nbytes", [1, 7, 4096, 4097, 65537])
def test_files_round_trip_through_aligned_buffers(tmp_path: Path, nbytes: int) -> None:
    data = bytes(random.Random(nbytes).randrange(256) for _ in range(nbytes))
    write_file(str(tmp_path / "f.bin"), memoryview(data))
    assert os.path.getsize(tmp_path / "f.bin") % nvme.ALIGN == 0  # padded for O_DIRECT
    assert read_file(str(tmp_path / "f.bin"), nbytes).numpy().tobytes() == data


def test_tier_spills_reads_discards_and_removes_its_directory(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path / "nvme")
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (3, 5000, 1)]
    spills = [tier.write(s) for s in sources]
    for spill in spills:
        tier.read_ahead(spill)
    assert all(torch.equal(tier.data(sp), s) for sp, s in zip(spills, sources)) and tier.files() == 3
    tier.discard(spills[0])
    assert tier.files() == 2
    tier.close()
    assert not os.path.exists(tier.path) and os.listdir(tmp_path / "nvme") == []
    tier.close()  # idempotent


def test_a_dropped_tier_removes_its_files_when_collected(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path)
    tier.data(tier.write(torch.ones(10, dtype=torch.uint8)))
    path = tier.path
    del tier
    gc.collect()
    assert not os.path.exists(path)


def test_bad_nvme_settings_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(OffloadError, match="go together"):
        OffloadConfig(nvme_dir=str(tmp_path))
    with pytest.raises(OffloadError, match="go together"):
        OffloadConfig(pinned_budget="1GiB")
    with pytest.raises(OffloadError, match="pinned_budget"):
        OffloadConfig(nvme_dir=str(tmp_path), pinned_budget=0.5)
    with pytest.raises(OffloadError, match="nvme_dir"):
        OffloadConfig(nvme_dir="", pinned_budget=1)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OffloadError, match="cannot be used"):
        NvmeTier(blocker / "sub")


# ---------------------------------------------------------------------------------------------- training
def _model(n_layers: int = 3) -> MoEGPT:
    torch.manual_seed(0)
    config = MoEGPTConfig(vocab_size=VOCAB, hidden_size=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, ffn_size=32,
                          num_experts=4)  # fmt: skip
    return MoEGPT(config)


def _step(model: MoEGPT, off: ActivationOffloader | None, seq: int, fail: bool = False) -> list[torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seq))
    model.zero_grad(set_to_none=True)
    with off if off is not None else torch.enable_grad():
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()) + 0.01 * model.aux_loss()
        if fail:
            loss.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom in backward")))
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _offloader(model: MoEGPT, directory: Path, pinned_budget: int = 1) -> ActivationOffloader:
    config = OffloadConfig(min_offload_bytes=0, force=True, nvme_dir=str(directory), pinned_budget=pinned_budget)
    return ActivationOffloader(model.layers, config)


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("steps", [40, pytest.param(400, marks=pytest.mark.slow)])
def test_a_pinned_budget_below_one_layer_gives_bit_identical_gradients_from_files_with_flat_rss_and_fds(
    tmp_path: Path, steps: int
) -> None:
    # The parameters stay fixed (no optimizer step), so the reference gradients of each batch shape are computed once
    # and every step is compared; a step through files costs ~10x a plain one on this model (a file per storage).
    ref, model = _model(), _model()
    off = _offloader(model, tmp_path)  # 1 byte of pinned pool: every offloaded storage goes to a file
    shapes = (7, 24, 13)
    expected = {seq: _step(ref, None, seq) for seq in shapes}
    fds, rss = [], []
    for step in range(steps):
        seq = shapes[step % 3]
        assert all(torch.equal(a, b) for a, b in zip(expected[seq], _step(model, off, seq))), step
        stats = off.stats
        assert stats["spilled_bytes"] > 0 and stats["offloaded_bytes"] == stats["spilled_bytes"]
        assert stats["pool_bytes"] == 0 and stats["nvme_failures"] == 0
        fds.append(_open_files())
        rss.append(_rss())
    warm = steps // 4
    assert max(fds[warm:]) <= fds[warm]  # flat: no file descriptor outlives its read or write
    assert rss[-1] - rss[warm] < 8 << 20, (rss[warm], rss[-1])  # flat within allocator noise
    off.close()
    assert os.listdir(tmp_path) == []  # the tier's directory is gone


def test_no_file_is_left_after_an_exception_in_backward(tmp_path: Path) -> None:
    model = _model()
    off = _offloader(model, tmp_path)
    _step(model, off, 11)
    with pytest.raises(RuntimeError, match="boom in backward"):
        _step(model, off, 11, fail=True)
    tier = off.packer.nvme
    assert tier is not None and off.stats["checked_out"] == 0
    deadline = time.monotonic() + 30  # a write still running on a worker removes its file as soon as it ends
    while tier.files() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.files() == 0
    _step(model, off, 11)  # and the next step works
    off.close()
    assert os.listdir(tmp_path) == []


def test_a_full_disk_keeps_the_rest_of_the_step_on_the_device_and_warns_once(tmp_path: Path) -> None:
    ref, model = _model(), _model()
    off = _offloader(model, tmp_path)
    writes = {"n": 0}

    def failing_writer(path: str, data: Any) -> None:
        writes["n"] += 1
        if writes["n"] % 4 == 3:  # the third write of every four: ENOSPC
            raise OSError(errno.ENOSPC, "No space left on device", path)
        write_file(path, data)

    _step(ref, None, 9), _step(model, off, 9)  # makes the tier
    assert off.packer.nvme is not None
    off.packer.nvme._writer = failing_writer
    with pytest.warns(RuntimeWarning, match="No space left on device") as caught:
        for seq in (9, 17, 9):
            assert all(torch.equal(a, b) for a, b in zip(_step(ref, None, seq), _step(model, off, seq)))
    assert len([w for w in caught if "No space left" in str(w.message)]) == 1
    stats = off.stats
    assert stats["nvme_failures"] >= 1 and stats["spilled_bytes"] > 0 and stats["nvme_files"] == 0
    off.close()
    assert os.listdir(tmp_path) == []


def test_after_a_failed_write_the_layers_left_in_the_step_recompute_instead_of_spilling(tmp_path: Path) -> None:
    ref, model = _model(5), _model(5)
    off = _offloader(model, tmp_path)  # every offloaded storage goes to a file
    expected = _step(ref, None, 9)
    assert all(torch.equal(a, b) for a, b in zip(expected, _step(model, off, 9)))
    calls: list[int] = []

    def full_disk(path: str, data: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", path)

    def wait_for_the_writes(module: torch.nn.Module, args: Any) -> None:
        # the writes run on worker threads: let layer 0's fail before layer 1 runs, so layer 1's end sees the failure
        for seg in off.calls.segments:
            for block in seg.blocks:
                if block.spill is not None:
                    block.spill.written.exception(timeout=30)
        calls.append(len(off._recomputed))

    assert off.packer.nvme is not None
    off.packer.nvme._writer = full_disk
    hook = model.layers[1].register_forward_pre_hook(wait_for_the_writes)
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        grads = _step(model, off, 9)
    hook.remove()
    assert all(torch.equal(a, b) for a, b in zip(expected, grads))  # recomputation is bit-identical
    # the offloading layers after layer 1 (all but the kept last one) had not run when the failure was seen at layer
    # 1's end: they recomputed, spilling nothing
    assert off.calls.eligible == 4
    assert calls == [0] and off.stats["recompute_layers"] == 2 and off.stats["nvme_files"] == 0
    assert all(model.layers[i].__dict__.get("forward") is None for i in range(5))  # unwrapped at the step's end
    # the next step spills again (a disk that has room again)
    off.packer.nvme._writer = write_file
    assert all(torch.equal(a, b) for a, b in zip(expected, _step(model, off, 9)))
    assert off.stats["recompute_layers"] == 0 and off.stats["spilled_bytes"] > 0
    off.close()
    assert os.listdir(tmp_path) == []


def test_a_memory_plan_with_a_small_pinned_budget_sends_layers_to_the_nvme_tier(tmp_path: Path) -> None:
    ref, model = _model(6), _model(6)
    config = OffloadConfig(min_offload_bytes=0, force=True, plan="auto", budget=10_000_000, nvme_dir=str(tmp_path),
                           pinned_budget=1, profile_steps=1)  # fmt: skip
    off = ActivationOffloader(model.layers, config)
    for seq in (9, 9, 9, 9):  # warm-up, measured, planned x2
        assert all(torch.equal(a, b) for a, b in zip(_step(ref, None, seq), _step(model, off, seq)))
    plan = off.memory_plan
    assert plan is not None and plan.profile.nvme_bandwidth_bytes_per_ms is not None
    assert not plan.layers("offload")  # nothing fits one byte of pinned memory
    off.close()
    # a budget below what keeping and recomputing reach: the plan must use the NVMe tier
    budget = int(0.5 * plan.profile.saved_bytes)
    model = _model(6)
    off = ActivationOffloader(model.layers, dataclasses.replace(config, budget=budget))
    for seq in (9, 9, 9):
        assert all(torch.equal(a, b) for a, b in zip(_step(ref, None, seq), _step(model, off, seq)))
    plan = off.memory_plan
    assert plan is not None and plan.layers("nvme") and off.stats["spilled_bytes"] > 0
    assert off.step_metrics()["measured_peak"] <= budget
    off.close()
    assert os.listdir(tmp_path) == []
