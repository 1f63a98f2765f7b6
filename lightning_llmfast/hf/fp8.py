"""Block-FP8 checkpoints as DeepSeek-V3/R1 are released: ``float8_e4m3fn`` weights scaled per block of 128 x 128.

Such a directory says so in ``config.json``: ``"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], ...}``. Every quantized matrix ``<name>.weight`` ``(R, C)`` has a float32 companion
``<name>.weight_scale_inv`` ``(ceil(R / 128), ceil(C / 128))``; the real weight is the fp8 value times its block's
scale (DeepSeek's ``weight_dequant``, torch DCP's ``QuantizedHuggingFaceStorageReader``; the last row and column of
blocks are partial when a size is not a multiple of 128). Norms, the router, embeddings and ``lm_head`` stay in
bf16. :func:`dequantize` turns any rectangle of a quantized matrix into real values given only the scale rows that
cover it, so a rank reads just the blocks of its slice.

Example::

    block = block_size(json.loads(Path(directory, "config.json").read_text()))  # (128, 128), or None
    values = dequantize(fp8_rows[:, 64:300], scale_rows, block, row=256, col=64)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_llmfast.errors import CheckpointError

__all__ = ["FP8_DTYPES", "SCALE_SUFFIX", "block_size", "dequantize", "scale_key", "scale_shape"]

SCALE_SUFFIX = "_scale_inv"
"""Appended to a quantized weight's key to name its block scales (``...weight`` -> ``...weight_scale_inv``)."""
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Dtypes of quantized weights."""


def block_size(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The ``(rows, cols)`` block of a block-FP8 checkpoint's ``config.json``, or ``None`` for an unquantized one.

    Raises:
        CheckpointError: a ``quantization_config`` of another method than ``"fp8"`` or without a 2-D block size.

    Example::

        block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})  # (128, 128)
    """
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
    block = quantization.get("weight_block_size") if isinstance(quantization, Mapping) else None
    if method != "fp8" or not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"config.json: unsupported quantization_config {quantization!r} (supported: quant_method 'fp8' with a "
            "2-D weight_block_size, as DeepSeek-V3 is released)"
        )
    return block[0], block[1]


def scale_key(weight_key: str) -> str:
    """The key of a quantized weight's block scales.

    Example::

        scale_key("model.layers.3.mlp.experts.7.up_proj.weight")  # "...up_proj.weight_scale_inv"
    """
    return weight_key + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of the block scales of a quantized matrix of ``shape``.

    Example::

        scale_shape((300, 129), (128, 128))  # (3, 2)
    """
    rows, cols = shape
    return -(-rows // block[0]), -(-cols // block[1])


def dequantize(weight: Tensor, scale_inv: Tensor, block: tuple[int, int], *, row: int, col: int) -> Tensor:
    """Real values (float32) of a rectangle of a quantized matrix.

    Args:
        weight: the rectangle's fp8 values, ``(r, c)``, starting at ``(row, col)`` of the matrix.
        scale_inv: the scale rows ``row // block[0]`` up to the one covering row ``row + r - 1``, all scale columns
            (or at least up to the one covering column ``col + c - 1``).
        block: the block size.
        row: the rectangle's first row in the matrix.
        col: its first column.

    Example::

        dequantize(w[:, 5:9], s[0:2], (128, 128), row=0, col=5)  # rows 0..255, columns 5..8
    """
    rows, cols = weight.shape
    first_row, first_col = row // block[0] * block[0], col // block[1]
    scales = scale_inv[:, first_col : -(-(col + cols) // block[1])].float()
    scales = scales.repeat_interleave(block[0], 0)[row - first_row : row - first_row + rows]
    scales = scales.repeat_interleave(block[1], 1)[:, col - first_col * block[1] : col - first_col * block[1] + cols]
    return weight.float() * scales
