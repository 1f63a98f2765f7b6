"""Host-side input checks shared by the MoE blocks and the expert computations: shapes, dtypes, devices and
(when asked) offset values, each raising :class:`~lightning_llmfast.errors.RoutingError` naming the problem.

Example::

    check_block_input(x, hidden_size=64, *block.parameters())
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor

from lightning_llmfast.errors import RoutingError

__all__ = ["check_block_input", "check_offsets_meta", "check_offsets_values", "check_swiglu_inputs"]


def check_block_input(x: Tensor, hidden_size: int, *weights: Tensor, name: str = "x") -> None:
    """Validate an MoE block's input against its configuration and weights (metadata only: no sync).

    ``x`` (called ``name`` in the errors) must be a float ``(..., hidden_size)`` tensor on the weights' device, in the
    weights' dtype unless autocast is on for that device and ``x`` is not float64 (autocast then picks the compute
    dtype).

    Raises:
        RoutingError: naming the mismatch.
    """
    if not isinstance(x, Tensor):
        raise RoutingError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != hidden_size:
        raise RoutingError(f"{name} must have shape (..., hidden_size={hidden_size}), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise RoutingError(f"{name} must be floating point, got {x.dtype}")
    for weight in weights:
        if x.device != weight.device:
            raise RoutingError(f"{name} is on {x.device} but the block's weights are on {weight.device}")
        # Autocast casts float32/16-bit matmul inputs (never float64) to its dtype: those may differ from the block.
        # (Asked only on a mismatch: the autocast query costs more than the other checks together.)
        if x.dtype != weight.dtype and (x.dtype == torch.float64 or not torch.is_autocast_enabled(x.device.type)):
            hint = "" if x.dtype == torch.float64 else ", or run under torch.autocast"
            raise RoutingError(
                f"{name} has dtype {x.dtype} but the block's weights are {weight.dtype}: cast {name} or the block "
                f"(block.to(dtype)){hint}"
            )


def check_swiglu_inputs(x: Tensor, gate_up: Tensor, down: Tensor) -> None:
    """Check the shapes of SwiGLU experts' inputs: ``x`` ``(M, H)``, ``gate_up`` ``(E, H, 2F)``, ``down`` ``(E, F, H)``.

    Metadata only (shapes, dtypes, devices): no device value is read, so it costs no sync.

    Raises:
        RoutingError: naming the tensor and the shape it should have.
    """
    for name, value in (("x", x), ("gate_up", gate_up), ("down", down)):
        if not isinstance(value, Tensor):
            raise RoutingError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if not value.is_floating_point():
            raise RoutingError(f"{name} must be floating point, got {value.dtype}")
    x_shape, gate_up_shape = x.shape, gate_up.shape
    if len(x_shape) != 2:
        raise RoutingError(f"x must be 2-D (M, H), got shape {tuple(x_shape)}")
    hidden = x_shape[1]
    if len(gate_up_shape) != 3 or gate_up_shape[1] != hidden:
        raise RoutingError(f"gate_up must have shape (E, H={hidden}, 2F), got {tuple(gate_up_shape)}")
    num_experts, ffn2 = gate_up_shape[0], gate_up_shape[2]
    if ffn2 % 2:
        raise RoutingError(f"gate_up's last dim must be even (2F: the gate half, then the up half), got {ffn2}")
    if down.shape != (num_experts, ffn2 // 2, hidden):
        raise RoutingError(
            f"down must have shape (E={num_experts}, F={ffn2 // 2}, H={hidden}) to match gate_up "
            f"{tuple(gate_up.shape)}, got {tuple(down.shape)}"
        )
    if not x.device == gate_up.device == down.device:
        devices = f"{x.device}, {gate_up.device}, {down.device}"
        raise RoutingError(f"x, gate_up and down must be on one device, got {devices}")


def check_offsets_meta(offsets: Tensor, num_experts: int) -> None:
    if not isinstance(offsets, Tensor):
        raise RoutingError(f"offsets must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.is_floating_point() or offsets.is_complex() or offsets.dtype == torch.bool:
        raise RoutingError(f"offsets must be an integer tensor, got {offsets.dtype}")
    if tuple(offsets.shape) != (num_experts + 1,):
        raise RoutingError(
            f"offsets must have shape (E+1,) = ({num_experts + 1},) for E={num_experts} experts, "
            f"got {tuple(offsets.shape)}"
        )


def check_offsets_values(bounds: list[int], num_rows: int, padded: bool) -> None:
    if bounds[0] != 0:
        raise RoutingError(f"offsets must start at 0, got offsets[0]={bounds[0]}")
    for e, (start, end) in enumerate(pairwise(bounds)):
        if end < start:
            raise RoutingError(f"offsets must be non-decreasing, got offsets[{e}]={start} > offsets[{e + 1}]={end}")
    if padded and bounds[-1] > num_rows:
        raise RoutingError(f"offsets[-1] must be <= M={num_rows} (the number of rows), got offsets[-1]={bounds[-1]}")
    if not padded and bounds[-1] != num_rows:
        raise RoutingError(
            f"offsets must end at M={num_rows} (the number of rows), got offsets[-1]={bounds[-1]} "
            "(pass padded=True if the rows from offsets[-1] on are padding)"
        )
