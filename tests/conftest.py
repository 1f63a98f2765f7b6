"""Fixtures shared by the test modules."""

from __future__ import annotations

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
