"""Triton routing kernels (interpreted on CPU, compiled on CUDA) against their PyTorch references and loop oracles."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# Triton decides at decoration time whether kernels are interpreted: set this before anything imports them.
# On a CUDA machine the compiled kernels are what is worth testing, so the interpreter stays off there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.moe import kernels
from lightning_llmfast.moe.routing import route
from lightning_llmfast.moe.token_rows import permute, plan_indices, unpermute

CPU = torch.device("cpu")
needs_interpreter = pytest.mark.skipif(
    not kernels.triton_available(CPU), reason="Triton interpreter off (TRITON_INTERPRET=1 must precede the import)"
)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def loop_counting_sort(keys: torch.Tensor, num_bins: int) -> tuple[list[int], list[int]]:
    """Oracle: counts by a loop, destinations by walking the bins in order and each bin's members by index."""
    values = keys.tolist()
    counts = [0] * num_bins
    for v in values:
        counts[v] += 1
    dest = [0] * len(values)
    position = 0
    for b in range(num_bins):
        for i, v in enumerate(values):
            if v == b:
                dest[i] = position
                position += 1
    return counts, dest


def random_keys(n: int, num_bins: int, seed: int, *, skewed: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if skewed:  # one bin gets almost everything: long runs of equal keys across blocks
        keys = torch.full((n,), num_bins - 1, dtype=torch.int64)
        keys[torch.rand(n, generator=gen) < 0.05] = 0
        return keys
    return torch.randint(0, num_bins, (n,), generator=gen)


@needs_interpreter
@pytest.mark.parametrize("n", [0, 1, 7, 33, 130, 1000])
@pytest.mark.parametrize("num_bins", [1, 2, 8, 64, 160, 320])
@pytest.mark.parametrize("skewed", [False, True])
def test_counting_sort_matches_loop_oracle(n, num_bins, skewed):
    keys = random_keys(n, num_bins, seed=n * 7 + num_bins, skewed=skewed)
    counts, dest = loop_counting_sort(keys, num_bins)
    for fn in (kernels.stable_counting_sort_reference, kernels.stable_counting_sort_triton):
        got_counts, got_dest, got_order = fn(keys, num_bins)
        assert got_counts.dtype == got_dest.dtype == got_order.dtype == torch.int64
        assert got_counts.tolist() == counts, fn.__name__
        assert got_dest.tolist() == dest, fn.__name__
        assert got_order.tolist() == sorted(range(n), key=dest.__getitem__), fn.__name__


@needs_interpreter
def test_counting_sort_accepts_int32_keys():
    keys = random_keys(300, 5, seed=1)
    ref = kernels.stable_counting_sort_reference(keys, 5)
    for backend in ("torch", "triton"):
        got = kernels.stable_counting_sort(keys.int(), 5, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize(
    ("keys", "num_bins", "match"),
    [
        (torch.tensor([0, 5]), 3, r"keys must be in \[0, num_bins=3\), got a key 5"),
        (torch.tensor([0, -1, 2], dtype=torch.int32), 3, r"keys must be in \[0, num_bins=3\), got a key -1"),
        (torch.tensor([0.0, 1.0]), 3, "keys must be an integer tensor, got torch.float32"),
        (torch.tensor([True, False]), 3, "keys must be an integer tensor, got torch.bool"),
        (torch.zeros(2, 2, dtype=torch.int64), 3, r"keys must be a 1-D integer tensor, got \(2, 2\)"),
        ([0, 1], 3, "keys must be a 1-D integer tensor, got list"),
        (torch.tensor([0, 1]), 0, "num_bins must be an int >= 1, got 0"),
        (torch.tensor([0, 1]), True, "num_bins must be an int >= 1, got True"),
    ],
)
def test_counting_sort_rejects_bad_keys(backend, keys, num_bins, match):
    with pytest.raises(RoutingError, match=match):
        kernels.stable_counting_sort(keys, num_bins, backend=backend)


def test_counting_sort_rejects_unknown_backend():
    with pytest.raises(RoutingError, match=r"backend must be one of \['auto', 'torch', 'triton'\], got 'foo'"):
        kernels.stable_counting_sort(torch.tensor([0, 1]), 2, backend="foo")
    auto = kernels.stable_counting_sort(torch.tensor([1, 0, 1]), 2, backend="auto")
    assert [t.tolist() for t in auto] == [[1, 2], [1, 0, 2], [1, 0, 2]]


@needs_interpreter
def test_counting_sort_triton_never_writes_out_of_bounds_for_bad_keys():
    """validate=False with keys outside [0, num_bins): the kernels mask them instead of writing out of bounds."""
    code = (
        "import torch\n"
        "from lightning_llmfast.moe.kernels import stable_counting_sort\n"
        "keys = torch.tensor([0, 5, 1, -3, 0, 2**40, -(2**40)])\n"
        "counts, dest, _ = stable_counting_sort(keys, 3, backend='triton', validate=False)\n"
        "print(counts.tolist(), dest.tolist())\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # Valid keys are sorted as usual; the bad ones are skipped (dest -1).
    assert done.stdout.split() == ["[2,", "1,", "0]", "[0,", "-1,", "2,", "-1,", "1,", "-1,", "-1]"]


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise for float32/float64; within one bfloat16 step otherwise (the Triton interpreter truncates when it
    casts to bfloat16 where PyTorch rounds to nearest)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype in (torch.float32, torch.float64):
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("hidden", [1, 37, 300])
@pytest.mark.parametrize("num_valid", [None, 0, 11, 25])
@pytest.mark.parametrize("scaled", [False, True])
def test_gather_rows_matches_loop(dtype, hidden, num_valid, scaled):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(10, hidden, generator=gen).to(dtype)
    src = torch.randint(0, 10, (25,), generator=gen)
    scale = torch.rand(25, generator=gen) if scaled else None
    valid = None if num_valid is None else torch.tensor(num_valid)
    expected = torch.zeros(25, hidden, dtype=dtype)
    for r in range(25 if num_valid is None else num_valid):
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        expected[r] = (x[src[r]].to(acc) * (1.0 if scale is None else scale[r].to(acc))).to(dtype)
    assert torch.equal(kernels.gather_rows_reference(x, src, valid, scale), expected)
    assert_same(kernels.gather_rows_triton(x, src, valid, scale), expected)


def loop_combine(rows: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    out = torch.zeros(positions.shape[0], rows.shape[1], dtype=torch.float64)
    for t in range(positions.shape[0]):
        for s in range(positions.shape[1]):
            w = 1.0 if weights is None else float(weights[t, s])
            out[t] += w * rows[positions[t, s]].double()
    return out


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("num_tokens", "top_k", "hidden"), [(0, 2, 8), (1, 1, 1), (7, 3, 37), (33, 8, 300)])
@pytest.mark.parametrize("weighted", [False, True])
def test_combine_rows_and_pair_dots_match_loops(dtype, num_tokens, top_k, hidden, weighted):
    gen = torch.Generator().manual_seed(num_tokens * 31 + hidden)
    num_rows = max(num_tokens * top_k, 1)
    rows = torch.randn(num_rows, hidden, generator=gen).to(dtype)
    positions = torch.randint(0, num_rows, (num_tokens, top_k), generator=gen)
    weights = torch.rand(num_tokens, top_k, generator=gen) if weighted else None
    expected = loop_combine(rows, positions, weights)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype != torch.bfloat16 else {"rtol": 2**-7, "atol": 2**-6}
    reference = kernels.combine_rows_reference(rows, positions, weights)
    triton_out = kernels.combine_rows_triton(rows, positions, weights)
    for got in (reference, triton_out):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, **tol)
    if dtype == torch.float32:  # same float32 sums in the same order
        torch.testing.assert_close(triton_out, reference, rtol=1e-6, atol=1e-6)

    grad = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    expected_dots = torch.zeros(num_tokens, top_k, dtype=torch.float64)
    for t in range(num_tokens):
        for s in range(top_k):
            expected_dots[t, s] = rows[positions[t, s]].double() @ grad[t].double()
    for got in (kernels.pair_dots_reference(rows, grad, positions), kernels.pair_dots_triton(rows, grad, positions)):
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(got.double(), expected_dots, rtol=1e-5, atol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("num_tokens", "top_k", "hidden"), [(0, 2, 8), (1, 1, 1), (7, 3, 37), (31, 8, 300)])
def test_combine_rows_backward_matches_loops(dtype, num_tokens, top_k, hidden):
    gen = torch.Generator().manual_seed(num_tokens * 17 + top_k)
    num_rows = num_tokens * top_k
    # A consistent layout, as a plan makes one: row r holds pair perm[r], positions is the inverse.
    perm = torch.randperm(num_rows, generator=gen)
    src = perm // top_k
    positions = torch.empty_like(perm).scatter_(0, perm, torch.arange(num_rows)).view(num_tokens, top_k)
    rows = torch.randn(num_rows, hidden, generator=gen).to(dtype)
    grad = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    scale = torch.rand(num_rows, generator=gen)
    scale[: num_rows // 3] = 0  # dropped pairs have weight 0
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    expected_rows = torch.zeros(num_rows, hidden, dtype=dtype)
    for r in range(num_rows):
        expected_rows[r] = (grad[src[r]].to(acc) * scale[r].to(acc)).to(dtype)
    expected_dots = torch.zeros(num_tokens, top_k, dtype=torch.float64)
    for t in range(num_tokens):
        for s in range(top_k):
            expected_dots[t, s] = rows[positions[t, s]].double() @ grad[t].double()
    reference = kernels.combine_rows_backward_reference(grad, rows, src, scale, positions)
    triton_out = kernels.combine_rows_backward_triton(grad, rows, src, scale, positions)
    for _, got_dots in (reference, triton_out):
        assert got_dots.dtype == acc and got_dots.shape == (num_tokens, top_k)
        torch.testing.assert_close(got_dots.double(), expected_dots, rtol=1e-5, atol=1e-4)
    assert torch.equal(reference[0], expected_rows)  # the same float products, rounded once
    assert_same(triton_out[0], expected_rows)
    for backend, expected in (("torch", reference), ("triton", triton_out)):
        got = kernels.combine_rows_backward(grad, rows, src, scale, positions, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


@needs_interpreter
def test_gather_rows_strided_and_empty():
    x = torch.randn(6, 40)[:, ::2]  # non-contiguous rows
    src = torch.tensor([5, 0, 3])
    assert torch.equal(kernels.gather_rows_triton(x, src), x[src])
    empty = kernels.gather_rows_triton(x, torch.empty(0, dtype=torch.int64))
    assert empty.shape == (0, 20)


def assert_plans_equal(a, b) -> None:
    """Integers equal; floats (the fused Triton routing sums in another order) equal to rounding."""
    for name, x, y in zip(a._fields, a, b):
        if name in ("positions", "row_tokens"):  # only the fused routing keeps them; the dispatcher derives them
            derived = [plan_indices(p) for p in (a, b)]
            field = "positions" if name == "positions" else "tokens"
            assert torch.equal(getattr(derived[0], field), getattr(derived[1], field)), name
        elif name == "row_weights":  # only the fused routing makes them: each row's pair weight, 0 when dropped
            for plan in (p for p in (a, b) if getattr(p, name) is not None):
                kept_weights = plan.weights * plan.kept
                expected = kept_weights.reshape(-1)[plan.permutation[: plan.num_rows].long()]
                torch.testing.assert_close(getattr(plan, name), expected, rtol=0, atol=0)
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            assert x.dtype == y.dtype and x.shape == y.shape, name
            torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-7, msg=name)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert x == y, name


@needs_interpreter
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 33, 130])
@pytest.mark.parametrize(
    ("num_experts", "top_k"), [(1, 1), (2, 2), (8, 1), (8, 2), (8, 8), (64, 2), (64, 8), (160, 1), (160, 8)]
)
@pytest.mark.parametrize(("capacity_factor", "drop_policy"), [(None, "position"), (1.0, "position"), (0.6, "score")])
def test_route_triton_matches_torch(num_tokens, num_experts, top_k, capacity_factor, drop_policy):
    gen = torch.Generator().manual_seed(num_tokens + 13 * num_experts + top_k)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    kwargs = dict(capacity_factor=capacity_factor, drop_policy=drop_policy, validate=False)
    assert_plans_equal(
        route(logits, top_k, backend="triton", **kwargs), route(logits, top_k, backend="torch", **kwargs)
    )


@needs_interpreter
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_permute_unpermute_triton_match_torch(capacity_factor):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(33, 8, generator=gen)
    x = torch.randn(33, 20, generator=gen)
    probe = torch.randn(33, 20, generator=gen)
    results = []
    for backend in ("torch", "triton"):
        leaf_logits, leaf_x = logits.clone().requires_grad_(), x.clone().requires_grad_()
        plan = route(leaf_logits, 2, capacity_factor=capacity_factor)
        rows = permute(leaf_x, plan, backend=backend)
        scaled = rows * torch.arange(rows.shape[0], dtype=torch.float32).unsqueeze(1)
        out = unpermute(scaled, plan, backend=backend)
        (out * probe).sum().backward()
        results.append((rows.detach(), out.detach(), leaf_x.grad, leaf_logits.grad))
    (rows_a, out_a, gx_a, gl_a), (rows_b, out_b, gx_b, gl_b) = results
    assert torch.equal(rows_a, rows_b)
    torch.testing.assert_close(out_a, out_b, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gx_a, gx_b, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gl_a, gl_b, rtol=1e-5, atol=1e-5)


def test_backend_resolution(monkeypatch):
    assert kernels.resolve_backend("auto", CPU) == "torch"
    assert kernels.resolve_backend("torch", CPU) == "torch"
    with pytest.raises(RoutingError, match="backend must be one of"):
        kernels.resolve_backend("cuda", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RoutingError, match="backend='triton' cannot run on cpu"):
        route(torch.randn(4, 3), 1, backend="triton")
    with pytest.raises(RoutingError, match="backend='triton'"):
        permute(torch.randn(4, 2), route(torch.randn(4, 3), 1), backend="triton")


# ---------------------------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 1, 1), (4099, 160, 8), (65536, 64, 8)])
@pytest.mark.parametrize(("capacity_factor", "drop_policy"), [(None, "position"), (1.0, "position"), (0.8, "score")])
def test_cuda_triton_matches_reference(num_tokens, num_experts, top_k, capacity_factor, drop_policy):
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kwargs = dict(capacity_factor=capacity_factor, drop_policy=drop_policy, validate=False)
    plan = route(logits, top_k, backend="triton", **kwargs)
    assert_plans_equal(plan, route(logits, top_k, backend="torch", **kwargs))
    cpu_plan = route(logits.cpu(), top_k, backend="torch", **kwargs)
    for name in ("tokens_per_expert", "offsets", "permutation", "kept"):
        assert torch.equal(getattr(plan, name).cpu(), getattr(cpu_plan, name)), name
    x = torch.randn(num_tokens, 64, device="cuda")
    rows = permute(x, plan, backend="triton")
    assert torch.equal(rows, permute(x, plan, backend="torch"))
    torch.testing.assert_close(unpermute(rows, plan, backend="triton"), unpermute(rows, plan, backend="torch"))


@pytest.mark.cuda
@cuda
def test_cuda_route_permute_sync_free_and_deterministic():
    logits = torch.randn(8192, 64, device="cuda", requires_grad=True)
    x = torch.randn(8192, 128, device="cuda", requires_grad=True)
    results = []
    for _ in range(2):
        logits.grad = x.grad = None
        with SyncCounter() as counter:
            plan = route(logits, 8, capacity_factor=1.25, validate=False, backend="auto")
            out = unpermute(permute(x, plan).sin(), plan)
            (out.square().sum() + plan.aux_loss).backward()
        assert counter.num_syncs == 0, counter.syncs
        results.append((out.detach(), x.grad.clone(), logits.grad.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["auto", "Triton", "foo", None])
def test_row_kernels_reject_a_backend_that_is_not_resolved(backend: object) -> None:
    """They took anything but "triton" as the PyTorch reference: "auto" (meant for resolve_backend) or a typo ran
    torch silently, also on CUDA."""
    x, rows, grad = torch.randn(3, 4), torch.randn(6, 4), torch.randn(3, 4)
    src, positions, scale = torch.tensor([0, 0, 1, 1, 2, 2]), torch.arange(6).view(3, 2), torch.rand(6)
    calls = [
        lambda: kernels.gather_rows(x, src, backend=backend),
        lambda: kernels.combine_rows(rows, positions, backend=backend),
        lambda: kernels.pair_dots(rows, grad, positions, backend=backend),
        lambda: kernels.combine_rows_backward(grad, rows, src, scale, positions, backend=backend),
    ]
    for call in calls:
        with pytest.raises(RoutingError, match="backend must be 'torch' or 'triton' here"):
            call()
    assert torch.equal(kernels.gather_rows(x, src, backend="torch"), x[src])  # the resolved names still work
