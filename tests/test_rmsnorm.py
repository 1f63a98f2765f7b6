"""Memory-lean RMSNorm: forward and both gradients against a float64 reference; what it saves for backward."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_llmfast.errors import ConfigError
from lightning_llmfast.models.rmsnorm import RMSNorm, add_rms_norm, rms_norm, swap_rms_norms
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 5, 13), (2, 31, 64), (97, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_gradients_match_float64(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).requires_grad_()
    w = torch.randn(shape[-1], generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(*shape, generator=g).to(dtype)
    y = rms_norm(x, w, 1e-5)
    gx, gw = torch.autograd.grad(y, (x, w), upstream)
    x_ref, w_ref = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y_ref = _reference(x_ref, w_ref, 1e-5)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x_ref, w_ref), upstream.double())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}
    torch.testing.assert_close(y.double(), y_ref, **tol)
    torch.testing.assert_close(gx.double(), gx_ref, **tol)
    torch.testing.assert_close(gw.double(), gw_ref, **tol)


def test_bf16_input_keeps_fp32_statistics_and_dtype() -> None:
    x = (torch.randn(4, 33) * 50).bfloat16().requires_grad_()
    w = torch.ones(33, dtype=torch.bfloat16, requires_grad=True)
    y = rms_norm(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _reference(x.detach(), w.detach(), 1e-5), rtol=1e-2, atol=1e-2)
    gx, gw = torch.autograd.grad(y.float().sum(), (x, w))
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16 and torch.isfinite(gx.float()).all()


def _saved_storages(fn: Callable[[], object]) -> dict[int, int]:
    """Bytes of each storage that ``fn``'s forward saves for backward, by address."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_saves_the_input_and_inverse_rms_only() -> None:
    x = torch.randn(64, 128, requires_grad=True)
    w = torch.randn(128, requires_grad=True)
    saved = _saved_storages(lambda: rms_norm(x, w, 1e-5))
    # x itself (a parameter-like leaf here), the weight and the (64, 1) inverse RMS: no (64, 128) normalised copy
    assert sorted(saved.values()) == sorted([64 * 128 * 4, 128 * 4, 64 * 4])


# ---------------------------------------------------------------------------------------------- add_rms_norm
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 5, 13), (2, 31, 64)])
@pytest.mark.parametrize("branch_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("uses", ["both", "normed", "sum"])
def test_add_rms_norm_is_bitwise_the_unfused_ops(shape: tuple[int, ...], branch_dtype: torch.dtype, uses: str) -> None:
    """Outputs and the residual, branch and weight gradients, to the bit, whichever outputs backward reaches (the
    sum's gradient alone, the norm's alone, or both added); and the norm's values against float64."""
    g = torch.Generator().manual_seed(sum(shape) + len(uses))
    base = [torch.randn(*shape, generator=g) * 3, torch.randn(*shape, generator=g), torch.rand(shape[-1], generator=g)]
    grads = [torch.randn(*shape, generator=g) for _ in range(2)]
    results = []
    for fused in (False, True):
        residual, branch, w = (t.clone() for t in base)
        branch = branch.to(branch_dtype)
        for t in (residual, branch, w):
            t.requires_grad_()
        if fused:
            normed, h = add_rms_norm(residual, branch, w, 1e-5)
        else:
            h = residual + branch
            normed = rms_norm(h, w, 1e-5)
        h.retain_grad()  # the sum's own gradient: both consumers' parts, as hooks on it see them
        outputs = [(normed, grads[0])] * (uses != "sum") + [(h, grads[1])] * (uses != "normed")
        torch.autograd.backward([t for t, _ in outputs], [g.to(t.dtype) for t, g in outputs])
        results.append([normed.detach(), h.detach(), residual.grad, branch.grad, w.grad, h.grad])
    for unfused, fused in zip(*results):
        if unfused is None:  # the weight, when backward reaches the sum only
            assert fused is None and uses == "sum"
        else:
            assert fused.dtype == unfused.dtype and torch.equal(fused, unfused)
    h64 = base[0].double() + base[1].to(branch_dtype).double()
    torch.testing.assert_close(results[1][0].double(), _reference(h64, base[2], 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("branch_dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_saves_a_narrower_branch_not_the_sum(branch_dtype: torch.dtype) -> None:
    residual = torch.randn(64, 128, requires_grad=True)
    branch = torch.randn(64, 128).to(branch_dtype).requires_grad_()
    w = torch.randn(128, requires_grad=True)
    outputs: list[torch.Tensor] = []
    saved = _saved_storages(lambda: outputs.extend(add_rms_norm(residual, branch, w, 1e-5)))
    h = outputs[1]
    if branch_dtype == torch.bfloat16:
        assert h.untyped_storage().data_ptr() not in saved
        assert sorted(saved.values()) == sorted([64 * 128 * 4, 64 * 128 * 2, 128 * 4, 64 * 4])
    else:  # an fp32 branch is as wide as the sum: the norm keeps the sum, as rms_norm does
        assert branch.untyped_storage().data_ptr() not in saved
        assert sorted(saved.values()) == sorted([64 * 128 * 4, 128 * 4, 64 * 4])


def test_add_rms_norm_detects_an_in_place_change_of_what_it_saves() -> None:
    residual = torch.randn(4, 8, requires_grad=True)
    branch = torch.randn(4, 8, requires_grad=True).bfloat16()  # narrower than the sum; a non-leaf, changeable
    normed, _ = add_rms_norm(residual, branch, torch.ones(8), 1e-5)
    branch.mul_(2)  # the norm's backward would add the changed branch to the residual
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        normed.sum().backward()


def test_add_rms_norm_compiles_and_leaves_the_weight_gradient_none_when_only_the_sum_is_used() -> None:
    norm = RMSNorm(8, 1e-5)
    residual, branch = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8).bfloat16()

    def only_sum(r: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return norm(b, residual=r)[1].square().sum()

    for fn in (only_sum, torch.compile(only_sum, fullgraph=True, backend="aot_eager")):
        residual.grad = None
        fn(residual, branch).backward()
        assert norm.weight.grad is None and torch.equal(residual.grad, 2 * (residual + branch).detach())


def test_add_rms_norm_rejects_a_broadcast() -> None:
    with pytest.raises(ConfigError, match="one shape"):
        add_rms_norm(torch.randn(4, 8), torch.randn(1, 8), torch.ones(8), 1e-5)


def test_rms_norm_module_with_residual_returns_the_norm_and_the_sum() -> None:
    norm = RMSNorm(8, 1e-5)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    normed, h = norm(x, residual=residual)
    assert torch.equal(h, residual + x) and torch.equal(normed, norm(residual + x))


# ---------------------------------------------------------------------------------------------- swap_rms_norms
class _GemmaStyleRMSNorm(nn.Module):
    """``(1 + weight)`` scaling: not the function ``rms_norm`` computes, so it must stay."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight.float())).to(x.dtype)


def test_swap_rms_norms_replaces_transformers_norms_with_the_same_function_and_parameters() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    torch.manual_seed(0)
    model = nn.Sequential(llama.LlamaRMSNorm(24, eps=1e-5), nn.Sequential(mixtral.MixtralRMSNorm(24)))
    for norm in (model[0], model[1][0]):
        nn.init.normal_(norm.weight)
    before = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    x = torch.randn(3, 7, 24)
    expected = [model(x.to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
    assert swap_rms_norms(model) == 2
    assert isinstance(model[0], RMSNorm) and isinstance(model[1][0], RMSNorm) and model[0].eps == 1e-5
    after = model.state_dict(keep_vars=True)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # same Parameter objects
    for dtype, ref in zip((torch.float32, torch.bfloat16), expected):
        assert torch.equal(model(x.to(dtype)), ref)
    assert swap_rms_norms(model) == 0  # idempotent


def test_swap_rms_norms_leaves_other_norms_with_a_warning() -> None:
    model = nn.Sequential(_GemmaStyleRMSNorm(8), nn.LayerNorm(8))
    with pytest.warns(UserWarning, match="_GemmaStyleRMSNorm.*left as is"):
        assert swap_rms_norms(model) == 0
    assert isinstance(model[0], _GemmaStyleRMSNorm)


def test_swapped_norm_outputs_are_rebuilt_by_the_offloader() -> None:
    """The point of the swap: under the offloader a matmul's saved copy of the norm's output is rebuilt."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(1)
    layers = nn.ModuleList(nn.Sequential(llama.LlamaRMSNorm(16), nn.Linear(16, 16)) for _ in range(2))
    swap_rms_norms(layers)
    off = ActivationOffloader(
        layers, OffloadConfig(min_offload_bytes=0, keep_last_layers=0, force=True, offload_layers=0)
    )
    x = torch.randn(4, 16, requires_grad=True)
    with off:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            y = layers[1](layers[0](x))
        y.float().sum().backward()
    assert off.stats["rebuilt_tensors"] == 2 and x.grad is not None
    off.close()


def test_swap_leaves_a_weight_then_cast_norm_alone_output_dtype() -> None:
    """Olmo2RMSNorm computes ``(weight * x_hat).to(input_dtype)``: a bf16 input gives a bf16 output, ours float32
    (``torch.equal`` alone would promote the dtypes and pass)."""
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    model = nn.Sequential(olmo2.Olmo2RMSNorm(16))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    before = model(x)
    with pytest.warns(UserWarning, match="Olmo2RMSNorm"):
        assert swap_rms_norms(model) == 0
    after = model(x)
    assert after.dtype == before.dtype == torch.bfloat16


def test_swap_leaves_a_weight_then_cast_norm_alone_values_after_the_weight_changes() -> None:
    """With the ones weight of a fresh model (bf16 here, so no dtype difference) ``(w * x_hat).to(bf16)`` and
    ``x_hat.to(bf16) * w`` agree bit for bit; once the weight trains (or a checkpoint is loaded) they do not."""
    olmo2 = pytest.importorskip("transformers.models.olmo2.modeling_olmo2")
    torch.manual_seed(0)
    model = nn.Sequential(olmo2.Olmo2RMSNorm(64)).to(torch.bfloat16)
    original = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="Olmo2RMSNorm"):
        swap_rms_norms(model)
    with torch.no_grad():
        original[0].weight.normal_()
        model[0].weight.copy_(original[0].weight)  # e.g. load_state_dict after the swap
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    assert torch.equal(model(x), original(x))


def test_swap_keeps_float64_outputs() -> None:
    """LlamaRMSNorm takes its statistics in float32 even for float64 inputs (rms_norm would keep float64): the
    replacement does too."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(0)
    model = nn.Sequential(llama.LlamaRMSNorm(16)).double()
    original = copy.deepcopy(model)
    assert swap_rms_norms(model) == 1
    x = torch.randn(4, 16, dtype=torch.float64)
    assert torch.equal(model(x), original(x))


def test_swap_leaves_a_norm_with_hooks_alone() -> None:
    """Its hooks (activation capture, accelerate's) would be lost with the module: it stays, and is not even probed."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    model = nn.Sequential(llama.LlamaRMSNorm(16), nn.Linear(16, 16))
    seen: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda _m, _args, out: seen.append(out))
    with pytest.warns(UserWarning, match="has hooks"):
        assert swap_rms_norms(model) == 0
    model(torch.randn(2, 16))
    assert len(seen) == 1


def test_swap_keeps_a_norm_registered_under_two_names_one_module() -> None:
    """The same norm object under two attribute names: ``named_children`` yields it once, so one alias keeps the
    old module, and the documented "0 on a second call" does not hold."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    parent = nn.Module()
    parent.a = parent.b = llama.LlamaRMSNorm(16)
    assert swap_rms_norms(parent) == 1
    assert parent.a is parent.b and isinstance(parent.b, RMSNorm)
    assert swap_rms_norms(parent) == 0


def test_swap_keeps_a_norm_shared_by_two_parents_one_module() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    shared = llama.LlamaRMSNorm(16)
    model = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared))
    assert swap_rms_norms(model) == 1  # one norm
    assert model[0][0] is model[1][0]


def test_torch_compile_fullgraph_forward_and_gradients() -> None:
    """Marking the output rebuildable stays out of traced graphs: the norm compiles whole and matches eager."""
    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-5)
    nn.init.normal_(norm.weight)
    x = torch.randn(4, 16, requires_grad=True)
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    results = []
    for module in (norm, compiled):
        norm.zero_grad()
        x.grad = None
        y = module(x)
        y.square().sum().backward()
        results.append((y.detach(), x.grad, norm.weight.grad.clone()))
    for eager, traced in zip(*results):
        torch.testing.assert_close(traced, eager)


# ---------------------------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: rms_norm(torch.arange(8).view(1, 8), torch.ones(8), 1e-5), r"rms_norm: x must be a floating-point"),
        (lambda: rms_norm(torch.tensor(1.0), torch.ones(1), 1e-5), r"x must be a floating-point tensor \(\.\.\., H\)"),
        (lambda: rms_norm([[1.0, 2.0]], torch.ones(2), 1e-5), r"x must be a floating-point tensor.*list"),
        (lambda: rms_norm(torch.randn(2, 8), torch.ones(4), 1e-5), r"weight must be a tensor of shape \(H,\) = \(8,\)"),
        (lambda: rms_norm(torch.randn(2, 8), torch.ones(2, 8), 1e-5), r"weight .* got shape \(2, 8\)"),
        (lambda: rms_norm(torch.zeros(1, 4), torch.ones(4), -1.0), r"rms_norm: eps must be a finite number >= 0"),
        (lambda: rms_norm(torch.zeros(1, 4), torch.ones(4), float("nan")), r"eps must be a finite number >= 0"),
        (lambda: rms_norm(torch.zeros(1, 4), torch.ones(4), None), r"eps must be a finite number"),
        (
            lambda: add_rms_norm(torch.arange(8).view(1, 8), torch.ones(1, 8).long(), torch.ones(8), 1e-5),
            r"add_rms_norm: residual must be a floating-point",
        ),
        (lambda: add_rms_norm(torch.randn(1, 8), torch.randn(1, 8), torch.ones(8), -1e-5), r"add_rms_norm: eps"),
        (lambda: RMSNorm(-1, 1e-5), r"RMSNorm: dim must be an int >= 1, got -1"),
        (lambda: RMSNorm(0, 1e-5), r"RMSNorm: dim must be an int >= 1, got 0"),
        (lambda: RMSNorm(8.0, 1e-5), r"RMSNorm: dim must be an int"),
        (lambda: RMSNorm(8, -1e-5), r"RMSNorm: eps must be a finite number >= 0"),
        (lambda: RMSNorm(8, float("nan")), r"RMSNorm: eps must be a finite number >= 0"),
    ],
)
def test_rms_norm_rejects_bad_arguments(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        call()


def test_rms_norm_module_rejects_integer_input_and_a_resized_weight() -> None:
    norm = RMSNorm(8, 1e-5)
    with pytest.raises(ConfigError, match=r"x must be a floating-point tensor .*torch.int64"):
        norm(torch.arange(8).view(1, 8))  # was [0, 0, 0, 0, 0, 1, 1, 1]: normalised then cast back to int64
    norm.weight = nn.Parameter(torch.ones(4))
    with pytest.raises(ConfigError, match=r"weight must be a tensor of shape \(H,\) = \(8,\)"):
        norm(torch.randn(2, 8))


def test_rms_norm_accepts_zero_eps() -> None:
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(rms_norm(x, torch.ones(8, dtype=torch.float64), 0.0), _reference(x, torch.ones(8), 0.0))
