"""Routing kernels in Triton, each with a plain-PyTorch reference: counting sort, permute gather, combine.

Each Triton launcher has a readable PyTorch reference beside it with the same signature; the reference is the CPU
path and the test oracle. Integer results (counts, positions, permutations) and plain copies agree bit for bit;
floating-point combines agree to rounding (both accumulate in float32 in a fixed order, without atomics, so each is
bitwise reproducible run to run). Nothing here reads a device value on the host: every output size is a function
of input shapes only.

Modules: :mod:`.backend` (backend choice), :mod:`.sort` (the router's stable counting sort), :mod:`.rows` (permute
gather and weighted combine), :mod:`.dots` (per-pair dot products and the combine's backward).

Example::

    keys = torch.tensor([2, 0, 2, 1, 0])
    counts, dest, order = stable_counting_sort(keys, num_bins=3)
"""

from lightning_llmfast.moe.kernels.backend import BACKENDS, cuda_code_path, resolve_backend, triton_available
from lightning_llmfast.moe.kernels.dots import (
    combine_rows_backward,
    combine_rows_backward_reference,
    combine_rows_backward_triton,
    pair_dots,
    pair_dots_reference,
    pair_dots_triton,
    row_dots,
)
from lightning_llmfast.moe.kernels.rows import (
    combine_rows,
    combine_rows_reference,
    combine_rows_triton,
    gather_rows,
    gather_rows_reference,
    gather_rows_triton,
)
from lightning_llmfast.moe.kernels.sort import (
    stable_counting_sort,
    stable_counting_sort_reference,
    stable_counting_sort_triton,
)

__all__ = [
    "BACKENDS",
    "combine_rows",
    "combine_rows_backward",
    "combine_rows_backward_reference",
    "combine_rows_backward_triton",
    "combine_rows_reference",
    "combine_rows_triton",
    "cuda_code_path",
    "gather_rows",
    "gather_rows_reference",
    "gather_rows_triton",
    "pair_dots",
    "pair_dots_reference",
    "pair_dots_triton",
    "resolve_backend",
    "row_dots",
    "stable_counting_sort",
    "stable_counting_sort_reference",
    "stable_counting_sort_triton",
    "triton_available",
]
