"""Host-side reading and validation of sequence boundaries (NumPy on CPU copies; nothing here reads the device
unless a caller hands it an accelerator tensor, which is copied once)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import MetadataError

__all__ = ["INTEGER_DTYPES", "field", "first_index", "host_int_array", "same_device", "validate_cu_seqlens"]

_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1
INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def host_int_array(value: Any, field: str) -> np.ndarray:
    """Returns ``value`` as a 1-D int64 NumPy array on the host, validating dimensionality and dtype.

    Args:
        value: a tensor (any device), a NumPy array or a sequence of Python ints.
        field: the name used in error messages.

    Returns:
        ``(n,)`` int64 array. A tensor that lives on an accelerator is copied to the host (a sync).
    """
    if isinstance(value, torch.Tensor):
        if value.dtype not in INTEGER_DTYPES:
            raise MetadataError(f"{field}: must have an integer dtype, got {value.dtype}")
        if value.dim() != 1:
            raise MetadataError(f"{field}: must be 1-D, got shape {tuple(value.shape)}")
        # NOTE: host sync when `value` lives on an accelerator; callers that care pass a CPU copy.
        return value.detach().cpu().numpy().astype(np.int64, copy=False)
    if isinstance(value, (str, bytes)):
        raise MetadataError(f"{field}: must be a 1-D integer tensor or sequence, got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (OverflowError, ValueError) as err:
        raise MetadataError(f"{field}: cannot be read as a 1-D integer array ({err})") from err
    if array.dtype == object:
        raise MetadataError(f"{field}: values do not fit int32 (or are not integers)")
    if array.ndim != 1:
        raise MetadataError(f"{field}: must be 1-D, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise MetadataError(f"{field}: must have an integer dtype, got {array.dtype}")
    return array.astype(np.int64, copy=False)


def first_index(flags: np.ndarray) -> int:
    return int(np.argmax(flags))


def validate_cu_seqlens(cu: np.ndarray, num_tokens: int | None, max_seqlen: int | None) -> int:
    """Checks every rule of a ``cu_seqlens`` array on the host and returns the true maximum length.

    Args:
        cu: ``(num_sequences + 1,)`` int64 host array.
        num_tokens: the expected ``cu[-1]`` when known.
        max_seqlen: a caller-provided maximum length, which must not be below the true maximum.

    Returns:
        The longest sequence length (0 when there is no sequence).
    """
    if cu.size == 0:
        raise MetadataError("cu_seqlens: must hold at least one value (cu_seqlens[0] == 0), got an empty array")
    out_of_range = (cu < _INT32_MIN) | (cu > _INT32_MAX)
    if out_of_range.any():
        i = first_index(out_of_range)
        raise MetadataError(f"cu_seqlens: values must fit int32; first offending index {i} (value {int(cu[i])})")
    if cu[0] != 0:
        raise MetadataError(f"cu_seqlens: must start at 0; first offending index 0 (value {int(cu[0])})")
    lengths = np.diff(cu)
    decreasing = lengths < 0
    if decreasing.any():
        i = first_index(decreasing) + 1
        raise MetadataError(
            f"cu_seqlens: must be non-decreasing; first offending index {i} "
            f"(cu_seqlens[{i}]={int(cu[i])} < cu_seqlens[{i - 1}]={int(cu[i - 1])})"
        )
    if num_tokens is not None:
        # True == 1 and 3.0 == 3: without this check either would pass the comparison below.
        expected = int(num_tokens) if isinstance(num_tokens, np.integer) else num_tokens
        check_int("num_tokens", expected, low=0, error=MetadataError)
    if num_tokens is not None and int(cu[-1]) != num_tokens:
        raise MetadataError(
            f"cu_seqlens: last value must equal num_tokens={num_tokens}; "
            f"offending index {cu.size - 1} (value {int(cu[-1])})"
        )
    true_max = int(lengths.max()) if lengths.size else 0
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, np.integer)):
            raise MetadataError(f"max_seqlen: must be a Python int, got {type(max_seqlen).__name__}")
        if max_seqlen < true_max:
            i = first_index(lengths == true_max)
            raise MetadataError(
                f"max_seqlen: {max_seqlen} is below the longest sequence ({true_max} tokens, sequence index {i})"
            )
    return true_max


def same_device(a: torch.device, b: torch.device) -> bool:
    # "cuda" and "cuda:0" name the same device when the current device is 0.
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
        return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
    return a.index == b.index


def field(batch: Any, name: str) -> Any:
    if isinstance(batch, Mapping):
        return batch.get(name)
    return getattr(batch, name, None)
