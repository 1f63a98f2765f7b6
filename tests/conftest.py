"""Fixtures shared by the test modules."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_llmfast.moe.kernels import triton_available


@pytest.fixture(
    params=[
        "torch",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                not triton_available(torch.device("cpu")), reason="Triton kernels need TRITON_INTERPRET=1 on CPU"
            ),
        ),
    ]
)
def kernel_backend(request: pytest.FixtureRequest) -> str:
    """Each MoE kernel backend: the PyTorch reference, and Triton (under the interpreter on CPU)."""
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip, naming the reason, where the device they need is not there."""
    device = torch.device(os.environ.get("LLMFAST_TEST_DEVICE", "cuda"))
    if device.type == "cuda" and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device (LLMFAST_TEST_DEVICE={device}; CUDA unavailable)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def cuda_device() -> torch.device:
    """The device of the ``cuda``-marked tests: ``LLMFAST_TEST_DEVICE`` (default ``cuda``), as gpu_check.sh sets it."""
    return torch.device(os.environ.get("LLMFAST_TEST_DEVICE", "cuda"))
