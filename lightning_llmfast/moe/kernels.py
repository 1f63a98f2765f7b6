"""Routing kernels in Triton, each with a plain-PyTorch reference: counting sort, permute gather, combine.

Each Triton launcher has a readable PyTorch reference beside it with the same signature; the reference is the CPU
path and the test oracle. Integer results (counts, positions, permutations) and plain copies agree bit for bit;
floating-point combines agree to rounding (both accumulate in float32 in a fixed order, without atomics, so each is
bitwise reproducible run to run). Nothing here reads a device value on the host: every output size is a function
of input shapes only.

The stable counting sort is the heart of the router. Given one integer key per ``(token, slot)`` pair (its expert),
it returns how many pairs each key has and where each pair lands when the pairs are ordered by key, pairs of one
key staying in ascending index order. The Triton version does this without a global sort:

1. ``_block_histogram_kernel``: every block of ``BLOCK`` pairs counts its keys into its own histogram row
   (integer atomics: exact in any order) and ranks each pair among the earlier pairs of the block with the same
   key;
2. ``_block_scan_kernel``: one program walks the blocks in order and turns the histograms into, for each block
   and key, the number of pairs with that key in all earlier blocks; it also sums the counts and scans them into
   the per-key start offsets;
3. ``_scatter_kernel``: each pair's destination is ``start[key] + earlier_blocks[block, key] + rank_in_block``,
   which is exactly its position in the stable order, so the result does not depend on scheduling; the kernel
   also writes the inverse (the sorted order) with ``order[dest] = index``.

Example::

    keys = torch.tensor([2, 0, 2, 1, 0])
    counts, dest, order = stable_counting_sort(keys, num_bins=3)
    # counts == [2, 1, 2]; dest == [3, 0, 4, 2, 1]; order == [1, 4, 3, 0, 2] (keys[order] == [0, 0, 1, 2, 2])
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from lightning_llmfast._checks import check_int
from lightning_llmfast.errors import RoutingError

try:  # Triton is optional: without it every backend="auto" call takes the PyTorch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on Linux
    triton = None
    tl = None

# Decorating is harmless without Triton (the kernels are then never launched), and keeps the kernels at module
# level where Triton can read their source. Triton decides at decoration time whether a kernel is interpreted.
_jit = triton.jit if triton is not None else (lambda fn: fn)

# Pairs per program of the counting kernels: the in-block rank compares every pair with every other pair of its
# block, so the work per pair is O(BLOCK) whatever the number of experts.
_SORT_BLOCK = 128
# Elements of the (blocks, bins) tile the scan kernel holds at once.
_SCAN_TILE = 8192
# Elements per chunk of the PyTorch references' gathers: 1 MiB of float32, inside a CPU core's L2 with the
# chunk's other operands (measured on this project's CPU: 2**17 to 2**18 are equally fast, 2**19 is slower).
_CHUNK_ELEMENTS = 1 << 18

__all__ = [
    "BACKENDS",
    "combine_rows",
    "combine_rows_backward",
    "combine_rows_backward_reference",
    "combine_rows_backward_triton",
    "combine_rows_reference",
    "combine_rows_triton",
    "gather_rows",
    "gather_rows_reference",
    "gather_rows_triton",
    "pair_dots",
    "pair_dots_reference",
    "pair_dots_triton",
    "resolve_backend",
    "stable_counting_sort",
    "stable_counting_sort_reference",
    "stable_counting_sort_triton",
    "triton_available",
]

BACKENDS: frozenset[str] = frozenset({"auto", "torch", "triton"})


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``.

    On CUDA that needs Triton; on CPU it also needs ``TRITON_INTERPRET=1`` (Triton's interpreter, used in CI).

    Example::

        use_triton = triton_available(logits.device)
    """
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    # The interpreter must have been on when this module was imported: Triton picks compiled or interpreted
    # kernels at decoration time, and compiled ones cannot read CPU memory.
    interpreted = type(_scatter_kernel).__name__ == "InterpretedFunction"
    return device.type == "cpu" and interpreted and os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turns ``"auto"`` into ``"triton"`` (CUDA with Triton installed) or ``"torch"``, and checks the choice.

    Raises:
        RoutingError: for an unknown backend, or ``"triton"`` where the kernels cannot run.

    Example::

        resolve_backend("auto", torch.device("cpu"))  # "torch"
    """
    if backend not in BACKENDS:
        raise RoutingError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton is not None else "torch"
    if backend == "triton" and not triton_available(device):
        why = "Triton is not installed" if triton is None else "set TRITON_INTERPRET=1 to run the kernels on CPU"
        raise RoutingError(f"backend='triton' cannot run on {device.type} tensors: {why}")
    return backend


def _is_triton(backend: str) -> bool:
    """Whether an already resolved ``backend`` is ``"triton"``; anything but ``"torch"`` or ``"triton"`` raises."""
    if backend == "triton":
        return True
    if backend != "torch":
        raise RoutingError(
            f"backend must be 'torch' or 'triton' here (resolve_backend turns 'auto' into one), got {backend!r}"
        )
    return False


# --------------------------------------------------------------------------------------------------------------
# Stable counting sort
# --------------------------------------------------------------------------------------------------------------


def stable_counting_sort_reference(keys: Tensor, num_bins: int) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch reference of the stable counting sort.

    Args:
        keys: ``(n,)`` integer keys in ``[0, num_bins)``.
        num_bins: number of distinct keys.

    Returns:
        ``counts`` ``(num_bins,)`` int64 (elements per key), ``dest`` ``(n,)`` int64 (position of each element in
        the order sorted by key, ties in ascending index order) and its inverse ``order`` ``(n,)`` int64 (the
        element at each sorted position).

    Example::

        counts, dest, order = stable_counting_sort_reference(torch.tensor([1, 0, 1]), 2)
        # [1, 2], [1, 0, 2], [1, 0, 2]
    """
    keys = keys.long()
    n = keys.numel()
    # scatter_add_ into a fixed-size buffer instead of bincount: bincount's output size depends on the data
    # (a host sync on CUDA) unless minlength is given, and this states the shape outright.
    counts = torch.zeros(num_bins, dtype=torch.int64, device=keys.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    # Sorting narrow keys gives the same stable order, faster (2.3 ms -> 0.8 ms for 65536 int64 keys on CPU).
    narrow = torch.int16 if num_bins <= torch.iinfo(torch.int16).max else torch.int64
    order = torch.sort(keys.to(narrow), stable=True).indices
    dest = torch.empty_like(keys).scatter_(0, order, torch.arange(n, device=keys.device))
    return counts, dest, order


@_jit
def _block_histogram_kernel(keys_ptr, hist_ptr, rank_ptr, n, num_bins, BLOCK: tl.constexpr):
    """Per-block histogram ``hist[block, key]`` and each pair's rank among earlier same-key pairs of its block."""
    pid = tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    offs = pid * BLOCK + idx
    in_range = offs < n
    raw = tl.load(keys_ptr + offs, mask=in_range, other=0)
    # A key outside [0, num_bins) (possible only with validate=False) is skipped, never used as an address.
    valid = in_range & (raw >= 0) & (raw < num_bins)
    keys = raw.to(tl.int32)
    # Rank by flattened index: count the earlier valid pairs of the block with the same key. Comparing all pairs
    # of the block (instead of a running count per key) keeps the result independent of thread scheduling.
    same = (keys[:, None] == keys[None, :]) & (idx[None, :] < idx[:, None]) & valid[None, :]
    rank = tl.sum(same.to(tl.int32), axis=1)
    tl.store(rank_ptr + offs, rank, mask=in_range)
    # Integer atomics into this block's own row: exact and order-independent.
    tl.atomic_add(hist_ptr + pid * num_bins + keys, tl.full([BLOCK], 1, tl.int32), mask=valid)


@_jit
def _block_scan_kernel(
    hist_ptr, prefix_ptr, counts_ptr, starts_ptr, num_blocks, num_bins, CHUNK: tl.constexpr, BINS: tl.constexpr
):
    """Exclusive scan of the histograms over blocks, total counts per key, and the keys' start offsets."""
    bins = tl.arange(0, BINS)
    rows = tl.arange(0, CHUNK)
    bin_ok = bins < num_bins
    total = tl.zeros([BINS], dtype=tl.int64)
    # CHUNK blocks per step: a scan inside the tile plus a running total, so the serial loop is num_blocks / CHUNK
    # long instead of num_blocks.
    for start in range(0, num_blocks, CHUNK):
        blocks = start + rows
        ptrs = blocks[:, None].to(tl.int64) * num_bins + bins[None, :]
        ok = (blocks[:, None] < num_blocks) & bin_ok[None, :]
        hist = tl.load(hist_ptr + ptrs, mask=ok, other=0).to(tl.int64)
        inclusive = tl.cumsum(hist, axis=0)
        tl.store(prefix_ptr + ptrs, (inclusive - hist + total[None, :]).to(tl.int32), mask=ok)
        total += tl.sum(hist, axis=0)
    tl.store(counts_ptr + bins, total, mask=bin_ok)
    tl.store(starts_ptr + bins, tl.cumsum(total, axis=0) - total, mask=bin_ok)


@_jit
def _scatter_kernel(keys_ptr, rank_ptr, prefix_ptr, starts_ptr, dest_ptr, order_ptr, n, num_bins, BLOCK: tl.constexpr):
    """``dest = starts[key] + earlier_blocks[block, key] + rank_in_block`` (the stable position); ``order[dest]``."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n
    keys = tl.load(keys_ptr + offs, mask=in_range, other=0).to(tl.int64)
    # Out-of-range keys (validate=False only) are masked out of every key-addressed load and store: their dest
    # is -1 and they write nothing, so a bad key can never make the kernel touch memory out of bounds.
    valid = in_range & (keys >= 0) & (keys < num_bins)
    rank = tl.load(rank_ptr + offs, mask=valid, other=0).to(tl.int64)
    earlier = tl.load(prefix_ptr + pid * num_bins + keys, mask=valid, other=0).to(tl.int64)
    start = tl.load(starts_ptr + keys, mask=valid, other=0)
    dest = tl.where(valid, start + earlier + rank, -1)
    tl.store(dest_ptr + offs, dest, mask=in_range)
    tl.store(order_ptr + dest, offs.to(tl.int64), mask=valid)


def stable_counting_sort_triton(keys: Tensor, num_bins: int) -> tuple[Tensor, Tensor, Tensor]:
    """Triton stable counting sort; same contract and outputs as :func:`stable_counting_sort_reference`.

    Three launches (histogram, scan, scatter) with sizes fixed by ``keys.numel()`` and ``num_bins``; no host sync.

    Example::

        counts, dest, order = stable_counting_sort_triton(expert_ids.reshape(-1), num_experts)
    """
    keys = keys.contiguous()
    n = keys.numel()
    device = keys.device
    if n == 0:  # a launch grid of zero programs is an error
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return torch.zeros(num_bins, dtype=torch.int64, device=device), empty, empty
    num_blocks = triton.cdiv(n, _SORT_BLOCK)
    hist = torch.zeros(num_blocks, num_bins, dtype=torch.int32, device=device)
    rank = torch.empty(n, dtype=torch.int32, device=device)
    _block_histogram_kernel[(num_blocks,)](keys, hist, rank, n, num_bins, BLOCK=_SORT_BLOCK)
    prefix = torch.empty_like(hist)
    counts = torch.empty(num_bins, dtype=torch.int64, device=device)
    starts = torch.empty_like(counts)
    bins = triton.next_power_of_2(num_bins)
    chunk = max(1, min(triton.next_power_of_2(num_blocks), _SCAN_TILE // bins))
    _block_scan_kernel[(1,)](hist, prefix, counts, starts, num_blocks, num_bins, CHUNK=chunk, BINS=bins)
    dest = torch.empty(n, dtype=torch.int64, device=device)
    order = torch.empty_like(dest)
    _scatter_kernel[(num_blocks,)](keys, rank, prefix, starts, dest, order, n, num_bins, BLOCK=_SORT_BLOCK)
    return counts, dest, order


def stable_counting_sort(
    keys: Tensor, num_bins: int, *, backend: str = "torch", validate: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Stable counting sort of integer keys; dispatches to the Triton kernels or the PyTorch reference.

    Args:
        keys: ``(n,)`` integer keys in ``[0, num_bins)``.
        num_bins: number of distinct keys, ``>= 1``.
        backend: ``"torch"``, ``"triton"`` or ``"auto"`` (see :func:`resolve_backend`).
        validate: check that every key is in ``[0, num_bins)`` (one host sync on an accelerator). With ``False``
            (callers that produce the keys, such as :func:`~lightning_llmfast.moe.route`) an out-of-range key
            gives unspecified results: the PyTorch reference raises a torch error, the Triton kernels skip it
            (they never access memory out of bounds).

    Returns:
        ``counts`` ``(num_bins,)`` int64, ``dest`` ``(n,)`` int64 (the position of each key in the stable order)
        and ``order`` ``(n,)`` int64 (its inverse: the index of the key at each sorted position).

    Raises:
        RoutingError: ``keys`` not a 1-D integer tensor, ``num_bins`` not an int >= 1, an unknown ``backend``,
            or (``validate=True``) a key outside ``[0, num_bins)``.

    Example::

        counts, dest, order = stable_counting_sort(torch.tensor([1, 0, 1]), 2)  # [1, 2], [1, 0, 2], [1, 0, 2]
    """
    if not isinstance(keys, Tensor) or keys.dim() != 1:
        got = tuple(keys.shape) if isinstance(keys, Tensor) else type(keys).__name__
        raise RoutingError(f"keys must be a 1-D integer tensor, got {got}")
    if keys.is_floating_point() or keys.is_complex() or keys.dtype == torch.bool:
        raise RoutingError(f"keys must be an integer tensor, got {keys.dtype}")
    check_int("num_bins", num_bins, low=1, error=RoutingError)
    backend = resolve_backend(backend, keys.device)
    if validate and keys.numel():
        # NOTE: host sync (reads the key range); route() passes validate=False for the keys it makes itself.
        low, high = torch.stack(torch.aminmax(keys)).tolist()
        if low < 0 or high >= num_bins:
            bad = low if low < 0 else high
            raise RoutingError(f"keys must be in [0, num_bins={num_bins}), got a key {bad}")
    if backend == "triton":
        return stable_counting_sort_triton(keys, num_bins)
    return stable_counting_sort_reference(keys, num_bins)


# --------------------------------------------------------------------------------------------------------------
# Permute gather, weighted combine and per-pair dot products (the data movement of permute/unpermute)
# --------------------------------------------------------------------------------------------------------------


def _acc_dtype(data: Tensor) -> torch.dtype:
    """Accumulation dtype for activations ``data``: float32, or float64 for float64 data (gradcheck)."""
    return torch.float64 if data.dtype == torch.float64 else torch.float32


def gather_rows_reference(
    x: Tensor, src: Tensor, num_valid: Tensor | None = None, scale: Tensor | None = None
) -> Tensor:
    """PyTorch reference of the permute gather: ``out[r] = scale[r] * x[src[r]]`` for ``r < num_valid``, zero after.

    Args:
        x: ``(num_tokens, hidden)``.
        src: ``(num_rows,)`` int64 row indices into ``x``.
        num_valid: 0-d integer tensor, or ``None`` when every row is valid. Rows from ``num_valid`` on are padding
            that keeps the output size static (capacity routing) and are zeroed.
        scale: optional ``(num_rows,)`` per-row factor, applied in float32 (float64 for float64 ``x``) before
            the cast back.

    Returns:
        ``(num_rows, hidden)`` with the dtype of ``x``.

    Example::

        y = gather_rows_reference(x, torch.tensor([2, 0]))  # rows 2 and 0 of x
    """
    out = x.index_select(0, src)
    if scale is not None:
        _scale_rows_(out, scale)
    if num_valid is not None:
        row_ok = torch.arange(src.numel(), device=src.device) < num_valid
        out.masked_fill_(~row_ok.unsqueeze(1), 0)  # a fill, not a product: inf * 0 would be NaN
    return out


def _scale_rows_(rows: Tensor, scale: Tensor, out: Tensor | None = None) -> Tensor:
    """``out[r] = rows[r] * scale[r]``, in place unless ``out`` is given; ``rows`` ``(n, hidden)``, ``scale`` ``(n,)``.

    One pass: the product is taken in the accumulation dtype (type promotion with the float32 scale) and rounded
    once into ``out``, the same bits as casting ``rows`` up, multiplying and casting back, without the wide copy.
    In place by default because the callers own ``rows`` (a fresh gather or GEMM output): a new ``(n, hidden)``
    buffer would cost a pass of page faults on CPU, where large allocations come fresh from the OS. Under a
    ``create_graph`` backward, where ``out=`` cannot be differentiated, a new tensor with the same bits instead.
    """
    factor = scale.to(_acc_dtype(rows)).unsqueeze(1)
    if torch.is_grad_enabled() and (rows.requires_grad or scale.requires_grad):
        return (rows * factor).to(rows.dtype)
    return torch.mul(rows, factor, out=rows if out is None else out)


def _chunk_size(row_elements: int, length: int) -> int:
    """Rows per chunk so that a chunk of ``row_elements``-element rows stays cache resident.

    The PyTorch references gather, reduce and scale chunk by chunk: each ``(chunk, hidden)`` tile is reused from
    cache instead of streaming a ``(T * k, hidden)`` intermediate through memory (about 2x faster on CPU at
    T=8192, k=8, H=256). ``torch.compile`` never traces these loops: :mod:`~lightning_llmfast.moe.permute` calls
    the references from inside opaque custom ops, so compiled and eager runs execute the same chunked code.
    """
    return max(1, _CHUNK_ELEMENTS // max(row_elements, 1))


@_jit
def _gather_rows_kernel(
    x_ptr,
    src_ptr,
    num_valid_ptr,
    scale_ptr,
    out_ptr,
    num_rows,
    hidden,
    stride_x,
    stride_out,
    HAS_NUM_VALID: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[r, :] = scale[r] * x[src[r], :]`` for a tile of rows and columns; padding rows are written as zeros."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    src = tl.load(src_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    if HAS_NUM_VALID:
        # Padding rows are neither read nor left uninitialised: zeros keep the expert GEMMs finite.
        read_ok = row_ok & (rows < tl.load(num_valid_ptr))
    else:
        read_ok = row_ok
    col_ok = cols < hidden
    vals = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=read_ok[:, None] & col_ok[None, :], other=0)
    if HAS_SCALE:
        factor = tl.load(scale_ptr + rows, mask=row_ok, other=0)
        vals = (vals.to(factor.dtype) * factor[:, None]).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, vals, mask=row_ok[:, None] & col_ok[None, :])


def _tile_sizes(hidden: int) -> tuple[int, int]:
    """(rows, columns) per program: up to 256 columns and about 4096 elements per tile."""
    block_h = min(triton.next_power_of_2(max(hidden, 1)), 256)
    return max(1, min(16, 4096 // block_h)), block_h


def gather_rows_triton(x: Tensor, src: Tensor, num_valid: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """Triton permute gather; same contract and outputs as :func:`gather_rows_reference`.

    Example::

        y = gather_rows_triton(x, plan.permutation.long() // plan.top_k)
    """
    if x.stride(1) != 1:
        x = x.contiguous()
    num_rows, hidden = src.numel(), x.shape[1]
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    if num_rows == 0 or hidden == 0:
        return out
    block_r, block_h = _tile_sizes(hidden)
    grid = (triton.cdiv(num_rows, block_r), triton.cdiv(hidden, block_h))
    _gather_rows_kernel[grid](
        x,
        src.contiguous(),
        num_valid if num_valid is not None else src,  # any tensor: never read when HAS_NUM_VALID is False
        scale.to(_acc_dtype(x)).contiguous() if scale is not None else src,
        out,
        num_rows,
        hidden,
        x.stride(0),
        out.stride(0),
        HAS_NUM_VALID=num_valid is not None,
        HAS_SCALE=scale is not None,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
    )
    return out


def gather_rows(
    x: Tensor, src: Tensor, num_valid: Tensor | None = None, scale: Tensor | None = None, *, backend: str = "torch"
) -> Tensor:
    """Permute gather ``out[r] = scale[r] * x[src[r]]`` (zero from row ``num_valid`` on); Triton or PyTorch.

    Args:
        x: ``(num_tokens, hidden)``.
        src: ``(num_rows,)`` int64 row indices into ``x``.
        num_valid: 0-d integer tensor or ``None`` (all rows valid).
        scale: optional ``(num_rows,)`` per-row factor.
        backend: ``"torch"`` or ``"triton"`` (already resolved).

    Returns:
        ``(num_rows, hidden)`` in the dtype of ``x``.

    Example::

        y = gather_rows(x, torch.tensor([2, 0]))
    """
    if _is_triton(backend):
        return gather_rows_triton(x, src, num_valid, scale)
    return gather_rows_reference(x, src, num_valid, scale)


def combine_rows_reference(
    rows: Tensor, positions: Tensor, weights: Tensor | None = None, out_dtype: torch.dtype | None = None
) -> Tensor:
    """PyTorch reference of the weighted combine: ``out[t] = sum_s weights[t, s] * rows[positions[t, s]]``.

    Summed in float32 (float64 for float64 rows) without atomics: bitwise reproducible. Tokens are processed in
    cache-sized chunks (a ``(chunk, k, hidden)`` gather, then one batched product or sum), so no ``(T, k, hidden)``
    intermediate is materialised.

    Args:
        rows: ``(num_rows, hidden)``.
        positions: ``(num_tokens, k)`` int64 row of each pair.
        weights: ``(num_tokens, k)`` factors, or ``None`` for a plain sum.
        out_dtype: dtype of the result (default: that of ``rows``); a wider one keeps the float32 sums unrounded.

    Returns:
        ``(num_tokens, hidden)`` in ``out_dtype``.

    Example::

        out = combine_rows_reference(rows, torch.tensor([[0, 2], [1, 3]]), torch.full((2, 2), 0.5))
    """
    (num_tokens, top_k), hidden = positions.shape, rows.shape[1]
    if hidden == 0:  # nothing to sum; view(-1, top_k, 0) below could not infer its size
        return rows.new_empty(num_tokens, 0, dtype=out_dtype or rows.dtype)
    acc = _acc_dtype(rows)
    out = torch.empty(num_tokens, hidden, dtype=acc, device=rows.device)
    chunk = _chunk_size(top_k * hidden, num_tokens)
    gathered = rows.new_empty(min(chunk, num_tokens) * top_k, hidden)  # reused by every chunk
    # A plain sum is a product with ones: exact products, and bmm beats sum(dim=1) over a short middle dim.
    factors = (weights if weights is not None else positions.new_ones(positions.shape)).to(acc).unsqueeze(1)
    # split() makes every chunk's views in one call: per-chunk Python overhead matters at small sizes.
    for pos, fac, dst in zip(positions.split(chunk), factors.split(chunk), out.unsqueeze(1).split(chunk)):
        tile = torch.index_select(rows, 0, pos.reshape(-1), out=gathered[: pos.numel()])
        torch.bmm(fac, tile.view(-1, top_k, hidden).to(acc), out=dst)
    return out.to(out_dtype or rows.dtype)


@_jit
def _combine_rows_kernel(
    rows_ptr,
    positions_ptr,
    weights_ptr,
    out_ptr,
    num_tokens,
    hidden,
    stride_rows,
    stride_out,
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One tile of tokens and columns: accumulate the k weighted rows in a fixed order, in registers."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok_ok = tokens < num_tokens
    mask = tok_ok[:, None] & (cols < hidden)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=ACC)
    for s in tl.static_range(TOP_K):
        pair = tokens.to(tl.int64) * TOP_K + s
        pos = tl.load(positions_ptr + pair, mask=tok_ok, other=0)
        vals = tl.load(rows_ptr + pos[:, None] * stride_rows + cols[None, :], mask=mask, other=0).to(ACC)
        if HAS_WEIGHTS:
            vals = vals * tl.load(weights_ptr + pair, mask=tok_ok, other=0).to(ACC)[:, None]
        acc += vals
    out_ptrs = out_ptr + tokens[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_rows_triton(
    rows: Tensor, positions: Tensor, weights: Tensor | None = None, out_dtype: torch.dtype | None = None
) -> Tensor:
    """Triton weighted combine; same contract as :func:`combine_rows_reference` (float32 accumulation in order).

    Reads each pair's row once in its own dtype and writes ``(num_tokens, hidden)`` once: no ``(T, k, H)``
    intermediate.

    Example::

        out = combine_rows_triton(rows, positions, plan.weights)
    """
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    (num_tokens, top_k), hidden = positions.shape, rows.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=out_dtype or rows.dtype, device=rows.device)
    if num_tokens == 0 or hidden == 0:
        return out
    acc = _acc_dtype(rows)
    block_t, block_h = _tile_sizes(hidden)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))
    _combine_rows_kernel[grid](
        rows,
        positions.contiguous(),
        weights.to(acc).contiguous() if weights is not None else positions,  # never read without HAS_WEIGHTS
        out,
        num_tokens,
        hidden,
        rows.stride(0),
        out.stride(0),
        TOP_K=top_k,
        HAS_WEIGHTS=weights is not None,
        ACC=tl.float64 if acc == torch.float64 else tl.float32,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
    )
    return out


def combine_rows(
    rows: Tensor,
    positions: Tensor,
    weights: Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    backend: str = "torch",
) -> Tensor:
    """Weighted combine ``out[t] = sum_s weights[t, s] * rows[positions[t, s]]``; Triton or the PyTorch reference.

    Args:
        rows: ``(num_rows, hidden)``.
        positions: ``(num_tokens, k)`` int64 row of each pair.
        weights: ``(num_tokens, k)`` factors, or ``None`` for a plain sum.
        out_dtype: dtype of the result (default: that of ``rows``).
        backend: ``"torch"`` or ``"triton"`` (already resolved).

    Returns:
        ``(num_tokens, hidden)`` in ``out_dtype``.

    Example::

        out = combine_rows(rows, positions, weights)
    """
    if _is_triton(backend):
        return combine_rows_triton(rows, positions, weights, out_dtype)
    return combine_rows_reference(rows, positions, weights, out_dtype)


def pair_dots_reference(rows: Tensor, grad: Tensor, positions: Tensor) -> Tensor:
    """PyTorch reference of ``dots[t, s] = <rows[positions[t, s]], grad[t]>`` (the combine's weight gradient).

    Args:
        rows: ``(num_rows, hidden)``.
        grad: ``(num_tokens, hidden)``.
        positions: ``(num_tokens, k)`` int64 row of each pair.

    Returns:
        ``(num_tokens, k)`` in float32 (float64 for float64 rows).

    Example::

        grad_weights = pair_dots_reference(rows, grad_out, positions)
    """
    num_tokens, top_k = positions.shape
    acc = _acc_dtype(rows)
    gathered = rows.index_select(0, positions.reshape(-1)).view(num_tokens, top_k, rows.shape[1]).to(acc)
    return torch.bmm(gathered, grad.to(acc).unsqueeze(2)).squeeze(2)


@_jit
def _pair_dots_kernel(
    rows_ptr,
    grad_ptr,
    positions_ptr,
    out_ptr,
    num_pairs,
    hidden,
    stride_rows,
    stride_grad,
    TOP_K: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """A tile of pairs: dot products accumulated over column chunks, in a fixed order."""
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    pair_ok = pairs < num_pairs
    pos = tl.load(positions_ptr + pairs, mask=pair_ok, other=0)
    tokens = (pairs // TOP_K).to(tl.int64)
    acc = tl.zeros([BLOCK_P], dtype=ACC)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = pair_ok[:, None] & (cols < hidden)[None, :]
        a = tl.load(rows_ptr + pos[:, None] * stride_rows + cols[None, :], mask=mask, other=0).to(ACC)
        b = tl.load(grad_ptr + tokens[:, None] * stride_grad + cols[None, :], mask=mask, other=0).to(ACC)
        acc += tl.sum(a * b, axis=1)
    tl.store(out_ptr + pairs, acc, mask=pair_ok)


def pair_dots_triton(rows: Tensor, grad: Tensor, positions: Tensor) -> Tensor:
    """Triton per-pair dot products; same contract as :func:`pair_dots_reference`.

    Example::

        grad_weights = pair_dots_triton(rows, grad_out, positions)
    """
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    grad = grad if grad.stride(1) == 1 else grad.contiguous()
    num_tokens, top_k = positions.shape
    acc = _acc_dtype(rows)
    out = torch.empty(num_tokens, top_k, dtype=acc, device=rows.device)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out
    block_h = min(triton.next_power_of_2(max(rows.shape[1], 1)), 128)
    block_p = 32
    _pair_dots_kernel[(triton.cdiv(num_pairs, block_p),)](
        rows,
        grad,
        positions.contiguous(),
        out,
        num_pairs,
        rows.shape[1],
        rows.stride(0),
        grad.stride(0),
        TOP_K=top_k,
        ACC=tl.float64 if acc == torch.float64 else tl.float32,
        BLOCK_P=block_p,
        BLOCK_H=block_h,
    )
    return out


def pair_dots(rows: Tensor, grad: Tensor, positions: Tensor, *, backend: str = "torch") -> Tensor:
    """Per-pair dot products ``dots[t, s] = <rows[positions[t, s]], grad[t]>``; Triton or the PyTorch reference.

    Args:
        rows: ``(num_rows, hidden)``.
        grad: ``(num_tokens, hidden)``.
        positions: ``(num_tokens, k)`` int64 row of each pair.
        backend: ``"torch"`` or ``"triton"`` (already resolved).

    Returns:
        ``(num_tokens, k)`` in float32 (float64 for float64 rows).

    Example::

        row_dots = pair_dots(a, b, torch.arange(a.shape[0])[:, None])  # (M, 1): <a[r], b[r]>
    """
    if _is_triton(backend):
        return pair_dots_triton(rows, grad, positions)
    return pair_dots_reference(rows, grad, positions)


def combine_rows_backward_reference(
    grad: Tensor, rows: Tensor, src: Tensor, scale: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """PyTorch reference of the combine's backward: both gradients from one gather of ``grad``.

    Equals ``(gather_rows_reference(grad, src, scale=scale), pair_dots_reference(rows, grad, positions))`` when
    ``src[positions[t, s]] == t`` (``positions`` maps each pair to its row and ``src`` each row to its token). Row
    by row, in cache-sized chunks: ``grad[src[r]]`` is gathered straight into the output, dotted with ``rows[r]``,
    then scaled in place. That is one pass over ``(num_rows, hidden)`` memory and one gather, where the separate
    functions make three passes and two gathers (the saving is about half the backward's dispatch time on CPU).

    Args:
        grad: ``(num_tokens, hidden)`` gradient of the combined output.
        rows: ``(num_rows, hidden)`` the combined rows.
        src: ``(num_rows,)`` int64 token of each row.
        scale: ``(num_rows,)`` weight of each row.
        positions: ``(num_tokens, k)`` int64 row of each pair.

    Returns:
        ``grad_rows`` ``(num_rows, hidden)`` in the dtype of ``grad`` and ``grad_weights`` ``(num_tokens, k)`` in
        float32 (float64 for float64 rows).

    Example::

        grad_rows, grad_weights = combine_rows_backward_reference(grad_out, rows, tokens, row_weights, positions)
    """
    (num_rows, hidden), acc = rows.shape, _acc_dtype(rows)
    grad_rows = grad.new_empty(num_rows, hidden)
    dots = torch.empty(num_rows, dtype=acc, device=rows.device)
    chunk = _chunk_size(hidden, num_rows)
    chunks = (t.split(chunk) for t in (src, scale, rows.unsqueeze(1), grad_rows, dots.view(-1, 1, 1)))
    for src_c, scale_c, rows_c, dst, dots_c in zip(*chunks):
        torch.index_select(grad, 0, src_c, out=dst)
        torch.bmm(rows_c.to(acc), dst.to(acc).unsqueeze(2), out=dots_c)
        _scale_rows_(dst, scale_c)
    return grad_rows, dots.index_select(0, positions.reshape(-1)).view(positions.shape)


def combine_rows_backward_triton(
    grad: Tensor, rows: Tensor, src: Tensor, scale: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """Triton combine backward; same contract as :func:`combine_rows_backward_reference`.

    The scaled gather and the per-pair dots read ``grad`` and ``rows`` directly in their kernels, so two launches
    with no intermediate buffer.

    Example::

        grad_rows, grad_weights = combine_rows_backward_triton(grad_out, rows, tokens, row_weights, positions)
    """
    return gather_rows_triton(grad, src, scale=scale), pair_dots_triton(rows, grad, positions)


def combine_rows_backward(
    grad: Tensor, rows: Tensor, src: Tensor, scale: Tensor, positions: Tensor, *, backend: str = "torch"
) -> tuple[Tensor, Tensor]:
    """Gradients of the weighted combine for the rows and the weights; Triton or the PyTorch reference.

    ``grad_rows[r] = scale[r] * grad[src[r]]`` and ``grad_weights[t, s] = <rows[positions[t, s]], grad[t]>``.

    Args:
        grad: ``(num_tokens, hidden)``.
        rows: ``(num_rows, hidden)``.
        src: ``(num_rows,)`` int64 token of each row.
        scale: ``(num_rows,)`` weight of each row.
        positions: ``(num_tokens, k)`` int64 row of each pair.
        backend: ``"torch"`` or ``"triton"`` (already resolved).

    Returns:
        ``grad_rows`` ``(num_rows, hidden)`` (dtype of ``grad``) and ``grad_weights`` ``(num_tokens, k)`` (float32,
        float64 for float64 rows).

    Example::

        grad_rows, grad_weights = combine_rows_backward(grad_out, rows, tokens, row_weights, positions)
    """
    if _is_triton(backend):
        return combine_rows_backward_triton(grad, rows, src, scale, positions)
    return combine_rows_backward_reference(grad, rows, src, scale, positions)
