"""MFU peaks for the Hopper families by device name, where Lightning's table finds nothing."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from lightning_llmfast.callbacks.throughput import PEAK_FLOPS, TokenThroughputMonitor, peak_flops

CUDA = torch.device("cuda")


@pytest.fixture
def device_name(monkeypatch: pytest.MonkeyPatch):
    def set_name(name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return set_name


@pytest.mark.parametrize(
    ("name", "chip"),
    [
        ("NVIDIA H200", "h200 sxm"),
        ("NVIDIA H200 NVL", "h200 nvl"),
        ("NVIDIA GH200 480GB", "h200 sxm"),
        ("NVIDIA H100 80GB HBM3", "h100 sxm"),
        ("NVIDIA H100 PCIe", "h100 pcie"),
        ("NVIDIA H100 NVL", "h100 nvl"),
    ],
)
def test_hopper_names_get_our_dense_peak(device_name, name: str, chip: str) -> None:
    device_name(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning warns that its own table has no entry
        got = peak_flops(CUDA, torch.bfloat16)
    from lightning.fabric.utilities.throughput import get_available_flops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning = get_available_flops(CUDA, torch.bfloat16)
    assert got == (PEAK_FLOPS[chip][torch.bfloat16] if lightning is None else float(lightning))
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None


def test_nvidia_h200_mfu_uses_the_h200_peak(device_name, monkeypatch: pytest.MonkeyPatch) -> None:
    device_name("NVIDIA H200")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert peak_flops(CUDA, torch.bfloat16) == 989.4e12  # half the datasheet's 1979 TFLOPS "with sparsity"
        assert peak_flops(CUDA, torch.float16) == 989.4e12
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
        assert peak_flops(CUDA, torch.float32) == 67e12
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
        assert peak_flops(CUDA, torch.float32) == 494.7e12  # TF32
        device_name("NVIDIA A-Unknown")
        assert peak_flops(CUDA, torch.bfloat16) is None
    # the callback takes it at setup: a trainer under bf16-mixed on a device named "NVIDIA H200"
    device_name("NVIDIA H200")
    monitor = TokenThroughputMonitor()
    trainer = SimpleNamespace(precision="bf16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor.setup(trainer, SimpleNamespace(device=CUDA), "fit")  # type: ignore[arg-type]
    assert monitor._local.available_flops == 989.4e12
    assert TokenThroughputMonitor(peak_flops=1e12).peak_flops == 1e12  # an explicit peak still wins
