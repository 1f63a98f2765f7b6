"""Rebuilt outputs (``llmfast_rebuild``) in awkward places: layouts, in-place changes, checkpoint, threads, stats.

Every test compares gradients against the same model without the offloader (``torch.equal`` on all parameter
gradients). CPU only (``force=True``).
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_llmfast.bench import OpCounter
from lightning_llmfast.bench.steps import PeakMemory
from lightning_llmfast.errors import OffloadError
from lightning_llmfast.models.rmsnorm import rms_norm
from lightning_llmfast.moe import LocalDispatcher, expert_swiglu, route
from lightning_llmfast.moe.dispatcher import compute_copy
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig, mark_rebuildable


def _grads(model: nn.Module, x: torch.Tensor, off: ActivationOffloader | None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with off if off is not None else torch.enable_grad():
        model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _offloader(layers: Any, **kwargs: Any) -> ActivationOffloader:
    kwargs = {"min_offload_bytes": 0, "keep_last_layers": 0, "force": True, "offload_layers": 0, **kwargs}
    return ActivationOffloader(layers, OffloadConfig(**kwargs))


def _assert_same_grads(ref: nn.Module, model: nn.Module, x: torch.Tensor, off: ActivationOffloader) -> None:
    expected = _grads(ref, x, None)
    got = _grads(model, x, off)
    assert off.stats["rebuilt_tensors"] > 0  # the rebuild path is exercised
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


# --------------------------------------------------------------------------------------------------------------------
class _NormBlock(nn.Module):
    """The parameters of the norm-then-matmul blocks below: the norm's weight and an (8, 8) matmul weight."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.rand(8) + 0.5)
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)


# --------------------------------------------------------------------------------------------------------------------
# 1. A contiguous-format copy of a norm output that is itself not contiguous (norm of a transposed input).
class _SeqFirstBlock(_NormBlock):
    """Sequence-first block: the norm runs on ``x.transpose(0, 1)``, so its output keeps that (non-contiguous)
    layout; the matmul's bf16 input is an explicit contiguous-format copy of it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, H)
        y = rms_norm(x.transpose(0, 1), self.norm, 1e-5)  # (T, B, H), strides of the transpose
        h = y.to(torch.bfloat16, memory_format=torch.contiguous_format)  # contiguous: passes the pack checks
        return x + (h @ self.weight.to(torch.bfloat16)).float().transpose(0, 1)


def test_contiguous_copy_of_a_non_contiguous_norm_output_is_rebuilt_with_its_values() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(_SeqFirstBlock(), _SeqFirstBlock())
    model = copy.deepcopy(ref)
    off = _offloader(list(model))
    _assert_same_grads(ref, model, torch.randn(3, 5, 8), off)
    off.close()


# --------------------------------------------------------------------------------------------------------------------
# 2. The norm output changed in place (without autograd recording it) before a later op saves it.
class _ClampedNormBlock(_NormBlock):
    def __init__(self, how: str, copy_to_bf16: bool) -> None:
        super().__init__()
        self.how, self.copy_to_bf16 = how, copy_to_bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.norm, 1e-5)
        if self.how == "no_grad":
            with torch.no_grad():
                y.clamp_(-0.5, 0.5)  # grad_fn stays RMSNormFunctionBackward, the version counter moves
        else:
            y.detach().clamp_(-0.5, 0.5)  # shares y's version counter too
        if self.copy_to_bf16:
            return x + (y.to(torch.bfloat16) @ self.weight.to(torch.bfloat16)).float()
        return x + y @ self.weight  # mm saves (a view of) the clamped y


@pytest.mark.parametrize("copy_to_bf16", [False, True])
@pytest.mark.parametrize("how", ["no_grad", "detach"])
def test_norm_output_changed_in_place_before_it_is_saved_is_not_rebuilt_from_the_stale_recipe(
    how: str, copy_to_bf16: bool
) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(_ClampedNormBlock(how, copy_to_bf16), _ClampedNormBlock(how, copy_to_bf16))
    model = copy.deepcopy(ref)
    off = _offloader(list(model))
    x = torch.randn(3, 8, 8)
    expected = _grads(ref, x, None)  # the reference runs fine: nothing saved was modified after it was saved
    got = _grads(model, x, off)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    off.close()


# --------------------------------------------------------------------------------------------------------------------
# 3. The norm's saved tensors are held by torch.utils.checkpoint (which allows one unpack per graph task).
class _PostNormBlock(_NormBlock):
    """Post-norm block ``norm(x + tanh(x @ W))``: its output, a norm output, is what the next block saves."""

    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        self.ckpt = ckpt

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x + torch.tanh(x @ self.weight), self.norm, 1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._inner, x, use_reentrant=False) if self.ckpt else self._inner(x)


class _PostNormStack(nn.Module):
    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(_PostNormBlock(ckpt) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(
    ("ckpt", "kwargs"),
    [
        (True, {"keep_last_layers": 1, "offload_layers": None}),  # checkpoint inside each block, offloading
        (False, {"keep_last_layers": 1, "offload_layers": 0, "recompute": "selective"}),
        (False, {"keep_last_layers": 1, "offload_layers": 1, "recompute": "selective"}),
    ],
)
def test_post_norm_blocks_under_checkpoint_or_selective_recompute(ckpt: bool, kwargs: dict[str, Any]) -> None:
    """A norm whose saved tensors belong to torch.utils.checkpoint (one unpack only) is not rebuilt."""
    torch.manual_seed(0)
    ref = _PostNormStack(ckpt)
    model = copy.deepcopy(ref)
    off = _offloader(model.layers, **kwargs)
    x = torch.randn(3, 8, 8)
    assert all(torch.equal(a, b) for a, b in zip(_grads(ref, x, None), _grads(model, x, off)))
    assert off.stats["checked_out"] == 0
    off.close()


class _CheckpointedNormBlock(_NormBlock):
    """Only the norm is checkpointed; the matmul that saves its output runs outside the checkpoint."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = checkpoint(rms_norm, x, self.norm, 1e-5, use_reentrant=False)
        return x + (y.to(torch.bfloat16) @ self.weight.to(torch.bfloat16)).float()


def test_checkpointed_norm_with_its_consumer_outside_the_checkpoint() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(_CheckpointedNormBlock(), _CheckpointedNormBlock())
    model = copy.deepcopy(ref)
    off = _offloader(list(model))
    x = torch.randn(3, 8, 8)
    assert all(torch.equal(a, b) for a, b in zip(_grads(ref, x, None), _grads(model, x, off)))
    assert off.stats["rebuilt_tensors"] == 0
    off.close()


# --------------------------------------------------------------------------------------------------------------------
# 4. Concurrent backward over one retained graph: the re-entrancy guard is per thread.
class _NormOfNormBlock(nn.Module):
    """A Python-Function consumer (as the MoE's permute_grouped_mm custom op is) saves a norm output."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.n1 = nn.Parameter(torch.rand(d) + 0.5)
        self.n2 = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(rms_norm(x, self.n1, 1e-5), self.n2, 1e-5)  # the second norm saves the first's output


def test_concurrent_backward_on_a_retained_graph_does_not_report_a_self_saving_function() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_NormOfNormBlock(1024))
    off = _offloader(list(model))
    x = torch.randn(2048, 1024)
    errors: list[BaseException] = []
    with off:
        loss = model(x).square().sum()
        (expected,) = torch.autograd.grad(loss, [model[0].n2], retain_graph=True)
        barrier = threading.Barrier(4)

        def work() -> None:
            for _ in range(20):
                try:
                    barrier.wait()
                    (got,) = torch.autograd.grad(loss, [model[0].n2], retain_graph=True)
                    assert torch.equal(got, expected)
                except BaseException as e:  # collected for the main thread
                    errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert off.stats["rebuilt_tensors"] == 1
    off.close()
    assert not errors, f"{len(errors)} of 80 concurrent backward calls failed: {errors[0]!r}"


# --------------------------------------------------------------------------------------------------------------------
# 5. rebuilt_bytes: bytes once per storage, while a freed storage's address may come back for the next one.
class _FourNormsBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n = nn.Parameter(torch.rand(64) + 0.5)
        self.w = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, norms = x, []
        for i in range(4):  # four norm outputs, four distinct bf16 copies, each saved once by its matmul
            norms.append(rms_norm(x * (i + 1), self.n, 1e-5))  # alive while saved: checked for in-place changes
            h = norms[-1].to(torch.bfloat16)
            out = out + (h @ self.w.to(torch.bfloat16)).float()
            del h  # freed right after the matmul: the recipe does not keep it, so its address can come back
        return out


def test_rebuilt_bytes_count_every_rebuilt_storage() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_FourNormsBlock())
    off = _offloader(list(model))
    x = torch.randn(4, 64, 64)
    _grads(model, x, off)
    assert off.stats["rebuilt_tensors"] == 4
    assert off.stats["rebuilt_bytes"] == 4 * x.numel() * 2  # four bf16 storages of x's size
    off.close()


# --------------------------------------------------------------------------------------------------------------------
# 6. A cast copy changed in place before it is saved.
class _CastThenMaskBlock(_NormBlock):
    """The matmul input is a cast copy of the norm output, changed in place (under no_grad) before it is used."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.norm, 1e-5)
        h = y.to(torch.float64)
        with torch.no_grad():
            h.mul_(2)  # bumps h's version; h.grad_fn stays ToCopyBackward0 -> the norm node; y is untouched
        return x + (h @ self.weight.double()).float()


def test_cast_copy_changed_in_place_before_it_is_saved_is_not_rebuilt_from_the_norm() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(_CastThenMaskBlock(), _CastThenMaskBlock())
    model = copy.deepcopy(ref)
    x = torch.randn(2, 4, 8)
    expected = _grads(ref, x, None)
    off = _offloader(list(model))
    got = _grads(model, x, off)
    # The matmul saw 2 * y; a rebuild would give y.to(float64), and halve the weight gradients.
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert off.stats["rebuilt_tensors"] == 0
    off.close()


# --------------------------------------------------------------------------------------------------------------------
# 7. The routed experts' gate/up GEMM output (``rebuild="norms+gemms"``), under awkward routings.
class _RoutedBlock(nn.Module):
    """Residual routed SwiGLU experts; ``skew`` sends every token's first choice to expert 0."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float | None, skew: bool, backend: str) -> None:
        super().__init__()
        self.top_k, self.capacity_factor, self.skew, self.backend = top_k, capacity_factor, skew, backend
        self.router = nn.Parameter(torch.randn(16, num_experts) / 4)
        self.gate_up = nn.Parameter(torch.randn(num_experts, 16, 48) / 4)
        self.down = nn.Parameter(torch.randn(num_experts, 24, 16) / 5)
        self.rows = 0  # rows of the last gate/up output: (plan.num_rows, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 16)
        x_compute = compute_copy(x)
        logits = (x_compute @ self.router.to(x_compute.dtype)).float()
        if self.skew:
            logits = logits + (torch.arange(logits.shape[1]) == 0) * 30.0
        plan = route(logits, self.top_k, capacity_factor=self.capacity_factor, validate=False)
        self.rows = plan.num_rows
        dispatcher = LocalDispatcher(self.backend)
        rows, ctx = dispatcher.dispatch(x, plan, x_compute=x_compute)
        y = dispatcher.combine(expert_swiglu(rows, self.gate_up, self.down), ctx)
        return x + y.float()


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "capacity_factor", "skew"),
    [(1, 1, 1, None, False), (13, 4, 2, None, False), (31, 5, 1, None, True), (29, 4, 2, 0.3, True)],
)
@pytest.mark.parametrize("bf16", [False, True])
def test_gate_up_output_rebuilt_only_with_rebuild_gemms_and_bit_identically(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float | None,
    skew: bool,
    bf16: bool,
    kernel_backend: str,
) -> None:
    """Token, router and both expert weights' gradients to the bit, and the rebuilt bytes are exactly the gate/up
    outputs (padding rows of a capacity plan included)."""
    torch.manual_seed(num_tokens)
    ref = nn.Sequential(*(_RoutedBlock(num_experts, top_k, capacity_factor, skew, kernel_backend) for _ in range(2)))
    x = torch.randn(num_tokens, 16)
    expected, rebuilt = None, {}
    for gemms in (None, False, True):
        model = copy.deepcopy(ref)
        off = None if gemms is None else _offloader(list(model), rebuild="norms+gemms" if gemms else "norms")
        model.zero_grad(set_to_none=True)
        with off if off is not None else torch.enable_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
                loss = model(x.clone().requires_grad_()).square().mean()
            loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        if off is None:
            expected = grads
            continue
        assert all(torch.equal(a, b) for a, b in zip(expected, grads))
        rebuilt[gemms] = off.stats["rebuilt_bytes"]
        off.close()
    element = 2 if bf16 else 4
    assert rebuilt[True] - rebuilt[False] == sum(block.rows * 48 * element for block in model)


class _NoRebuild(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.exp()
        mark_rebuildable(ctx, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def test_mark_rebuildable_without_a_rebuild_names_the_problem() -> None:
    with pytest.raises(OffloadError, match="llmfast_rebuild") as info:
        _NoRebuild.apply(torch.randn(3, requires_grad=True))
    assert isinstance(info.value, ValueError)


# --------------------------------------------------------------------------------------------------------------------
# 8. A Function with two outputs that marks its second: only that one is rebuilt, never the first with its recipe.
class _SinCos(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x)
        sin, cos = x.sin(), x.cos()
        mark_rebuildable(ctx, cos, lambda ctx, x: x.cos())
        return sin, cos

    @staticmethod
    def backward(ctx: Any, grad_sin: torch.Tensor, grad_cos: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad_sin * x.cos() - grad_cos * x.sin()


class _SinCosBlock(nn.Module):
    def __init__(self, saved: int) -> None:
        super().__init__()
        self.saved = saved
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = _SinCos.apply(x * 1.0)
        return x + outputs[self.saved] @ self.weight + outputs[1 - self.saved].sum()  # the matmul saves one output


@pytest.mark.parametrize(("saved", "rebuilt"), [(0, 0), (1, 1)])
def test_only_the_marked_output_of_a_two_output_function_is_rebuilt(saved: int, rebuilt: int) -> None:
    torch.manual_seed(saved)
    ref = nn.Sequential(_SinCosBlock(saved), _SinCosBlock(saved))
    model = copy.deepcopy(ref)
    x = torch.randn(4, 8, requires_grad=True)  # so that the first block's outputs have a grad_fn too
    expected = _grads(ref, x, None)
    off = _offloader(list(model))
    assert all(torch.equal(a, b) for a, b in zip(expected, _grads(model, x, off)))
    assert off.stats["rebuilt_tensors"] == 2 * rebuilt
    off.close()


# --------------------------------------------------------------------------------------------------------------------
# 9. One output saved by two consumers (the router's and the experts' shared bf16 input): rebuilt once, and a consumer
# that changes its copy in place does not hand the change to the other.
class _TwoConsumers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.rand(8) + 0.5)
        self.a = nn.Parameter(torch.randn(8, 5) / 3)
        self.b = nn.Parameter(torch.randn(8, 3) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.norm, 1e-5)
        return x + (y @ self.a).sum(-1, keepdim=True) * (y @ self.b).mean(-1, keepdim=True)  # both matmuls save y


class _ScaleInPlaceInBackward(torch.autograd.Function):
    """``y @ w`` whose backward scales its saved ``y`` in place after use (allowed for a tensor it owns alone)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y, w)
        return y @ w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, w = ctx.saved_tensors
        grads = grad @ w.T, y.T @ grad
        y.mul_(2)
        return grads


class _InPlaceConsumer(_TwoConsumers):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.norm, 1e-5)
        other = (y @ self.a).sum(-1, keepdim=True)
        first = _ScaleInPlaceInBackward.apply(y, self.b)  # created last of the two: its backward runs first
        return x + other + first.mean(-1, keepdim=True)


@pytest.mark.parametrize("n_layers", [1, 3])
def test_an_output_two_consumers_save_is_rebuilt_once(n_layers: int) -> None:
    torch.manual_seed(n_layers)
    ref = nn.Sequential(*(_TwoConsumers() for _ in range(n_layers)))
    model = copy.deepcopy(ref)
    off = _offloader(list(model))
    _assert_same_grads(ref, model, torch.randn(2, 7, 8), off)
    assert off.stats["rebuilt_tensors"] == 2 * n_layers and off.stats["rebuilds"] == n_layers
    off.close()


def test_a_consumer_changing_its_rebuilt_copy_in_place_leaves_the_other_consumer_the_rebuilt_values() -> None:
    ref = _InPlaceConsumer()
    model = copy.deepcopy(ref)
    x = torch.randn(7, 8)  # (tokens, hidden): the Function's backward transposes y
    off = _offloader([model])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _grads(ref, x, None)  # without the offloader autograd's version check catches the change
    got = _grads(model, x, off)
    assert off.stats["rebuilds"] == 2  # the change was seen: rebuilt for the second consumer instead of shared
    # The values each consumer needed: gradients as if nobody changed anything.
    expected = _grads(_TwoConsumersNoChange(ref), x, None)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    off.close()


class _TwoConsumersNoChange(nn.Module):
    """``_InPlaceConsumer``'s function without the in-place change (its parameters)."""

    def __init__(self, source: _InPlaceConsumer) -> None:
        super().__init__()
        self.norm, self.a, self.b = (nn.Parameter(p.detach().clone()) for p in (source.norm, source.a, source.b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.norm, 1e-5)
        return x + (y @ self.a).sum(-1, keepdim=True) + (y @ self.b).mean(-1, keepdim=True)


class _DeadSecondConsumer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.rand(64) + 0.5)
        self.w = nn.Parameter(torch.randn(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, self.norm, 1e-5)
        _ = y @ self.w  # saves y too, but its result is dropped: that node dies in forward, never unpacking
        return x + y * self.w


def test_a_rebuilt_tensor_one_saver_never_reads_is_not_held_past_its_reader() -> None:
    model = _DeadSecondConsumer()
    off = _offloader([model])
    x = torch.randn(64, 64)
    with off, PeakMemory(torch.device("cpu")) as mem:
        model(x).sum().backward()
        assert off.stats["rebuilt_tensors"] == 2 and off.stats["rebuilds"] == 1
        # What backward left: the two small gradients and aliases of parameters, not the (64, 64) rebuilt y, which
        # its reader's node released (nothing else, such as a map of this step, keeps it).
        assert mem._live_bytes < x.nbytes
    off.close()


def test_reading_a_saved_tensor_in_forward_neither_counts_as_its_consumer_nor_holds_it() -> None:
    torch.manual_seed(0)
    ref = _TwoConsumers()
    model = copy.deepcopy(ref)
    x = torch.randn(5, 8)
    expected = _grads(ref, x, None)
    off = _offloader([model])
    model.zero_grad(set_to_none=True)
    with off, PeakMemory(torch.device("cpu")) as mem:
        out = model(x)
        node = next(n for n, _ in out.grad_fn.next_functions if n is not None and n.name() == "MulBackward0")
        first = next(n for n, _ in node.next_functions if n is not None and n.name() == "SumBackward1")
        live = mem._live_bytes
        read = first.next_functions[0][0]._saved_self  # the matmul's saved y, rebuilt on the spot
        assert read.shape == (5, 8) and mem._live_bytes > live
        nbytes = read.untyped_storage().nbytes()
        del read
        # Not held for the rest of forward. (The probe counts a detached alias of the norm's weight, made by the
        # rebuild's read of the norm's saved tensors, as new: 32 bytes of a parameter, not an activation.)
        assert mem._live_bytes - live < nbytes
        out.square().mean().backward()
        assert off.stats["rebuilds"] == 2  # the read in forward, then once for both consumers in backward
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    off.close()


class _CastBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (x.to(torch.bfloat16) @ self.w.to(torch.bfloat16)).float()


class _ScaledCopyBlock(_CastBlock):
    """A weight copy changed in place (no grad) before a matmul saves it: not the parameter's cast any more."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w16 = self.w.to(torch.bfloat16)
        with torch.no_grad():
            w16.mul_(2)
        return x + (x.to(torch.bfloat16) @ w16).float()


def test_a_weight_copy_changed_in_place_before_it_is_saved_is_kept_not_recast() -> None:
    torch.manual_seed(0)
    ref = _ScaledCopyBlock()
    model = copy.deepcopy(ref)
    x = torch.randn(4, 8, requires_grad=True)
    expected = _grads(ref, x, None)
    off = _offloader([model])
    assert all(torch.equal(a, b) for a, b in zip(expected, _grads(model, x, off)))
    assert off.stats["recast_casts"] == 0
    off.close()


def test_a_parameter_replaced_between_steps_is_recognised_in_the_next() -> None:
    """The layers' parameters are read again after a module registers one (not walked every step)."""
    torch.manual_seed(0)
    model = nn.Sequential(_CastBlock(), _CastBlock())
    off = _offloader(list(model))
    x = torch.randn(4, 8, requires_grad=True)  # so that the first matmul saves its weight copy too
    _grads(model, x, off)
    assert off.stats["recast_casts"] == 2
    model[0].w = nn.Parameter(torch.randn(8, 8))  # a new parameter: its copy is a parameter's copy too
    model[1].register_buffer("extra", torch.zeros(3))  # registering a buffer also counts
    ref = copy.deepcopy(model)
    assert all(torch.equal(a, b) for a, b in zip(_grads(ref, x, None), _grads(model, x, off)))
    assert off.stats["recast_casts"] == 2 and off.stats["offloaded_tensors"] == 0
    with torch.no_grad():
        model[1].w.data = model[1].w.data.clone()  # a new storage without any registration: read every step
    assert all(torch.equal(a, b) for a, b in zip(_grads(ref, x, None), _grads(model, x, off)))
    assert off.stats["recast_casts"] == 2
    off.close()


class _BufferBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.register_buffer("mix", torch.randn(8, 8) / 3)
        self.extra = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "extra"):
            x = self.extra(x)
        return x + torch.tanh(x @ self.w) @ self.mix  # the second matmul saves the buffer: never offloaded


@pytest.mark.parametrize("change", ["double", "delete"])
def test_buffers_replaced_in_place_and_deleted_submodules_are_seen_without_a_registration(change: str) -> None:
    """`.double()` swaps buffers inside the modules' dicts and `del` removes a submodule; neither registers anything,
    yet the offloader treats the layers' tensors exactly as a new offloader would, and keeps nothing deleted alive."""
    torch.manual_seed(0)
    model = nn.Sequential(_BufferBlock(), _BufferBlock())
    off = _offloader(list(model), offload_layers=None)
    x = torch.randn(4, 8)
    _grads(model, x, off)
    if change == "double":
        model.double()
        x = x.double()
    else:
        gone = weakref.ref(model[0].extra)
        del model[0].extra
    got = _grads(model, x, off)
    fresh = _offloader(list(model), offload_layers=None)
    expected = _grads(model, x, fresh)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert off.stats["offloaded_bytes"] == fresh.stats["offloaded_bytes"] > 0
    if change == "delete":
        assert gone() is None
    off.close()
    fresh.close()


class _WholeAndViewedCopies(nn.Module):
    """The elementwise product saves the scale's bf16 copy whole; the matmul saves a transpose view of the weight's."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(8) + 0.5)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.bfloat16) * self.scale.to(torch.bfloat16)
        return x + (h @ self.w.to(torch.bfloat16).t()).float()


def test_a_dropped_tensor_saved_whole_is_rebuilt_without_a_view_op() -> None:
    """Only a saved view of a dropped tensor costs an ``as_strided`` in backward (one dispatch per read: host time)."""
    torch.manual_seed(0)
    model = nn.Sequential(_WholeAndViewedCopies(), _WholeAndViewedCopies())
    ref = copy.deepcopy(model)
    x = torch.randn(5, 8, requires_grad=True)
    off = _offloader(list(model))
    as_strided = {}
    for name, m, o in (("ref", ref, None), ("rebuild", model, off)):
        m.zero_grad(set_to_none=True)
        with o if o is not None else torch.enable_grad():
            loss = m(x).square().mean()
            with OpCounter() as ops:
                loss.backward()
        as_strided[name] = ops.counts.get("as_strided", 0)
    assert off.stats["recast_casts"] == 4  # two copies a layer: the scale's (whole) and the weight's (viewed)
    assert as_strided["rebuild"] - as_strided["ref"] == 2  # the weight copies' transposes only
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), model.parameters()))
    off.close()
