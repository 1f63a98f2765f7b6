"""The fused Triton routing (scores, top-k, weights, probabilities and both losses in one launch, the plan in the
counting pass, one backward launch) against a float64 reference written from the formulas, forward and every
gradient, and against the PyTorch composition; the configurations it leaves to the composition."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from lightning_llmfast.bench.kernels import KernelCounter
from lightning_llmfast.moe import RoutingConfig, route
from lightning_llmfast.moe.fused_routing import fused_route_supported
from lightning_llmfast.moe.kernels import triton_available
from lightning_llmfast.moe.token_rows import plan_indices

needs_interpreter = pytest.mark.skipif(
    not triton_available(torch.device("cpu")), reason="Triton kernels need TRITON_INTERPRET=1 on CPU"
)

# (T, E, k, options): awkward sizes (one token, one expert, primes, k not a power of two) and every option
CASES = [
    (1, 1, 1, {}),
    (1, 8, 2, {"capacity_factor": 1.0}),
    (7, 5, 3, {"score": "sigmoid"}),
    (13, 64, 8, {"normalize": False, "route_scale": 2.5}),
    (37, 11, 6, {"score": "sigmoid", "bias": True, "route_scale": 1.7, "capacity_factor": 0.8}),
    (29, 8, 2, {"bias": True, "capacity_factor": 1.25}),
    (31, 8, 2, {"one_expert": True, "capacity_factor": 1.0}),
    (23, 160, 4, {"score": "sigmoid", "normalize": False}),
    # group-limited (DeepSeek-V3): one group kept, all groups kept, groups of one expert, a prime group count
    (17, 8, 2, {"num_groups": 4, "topk_groups": 2}),
    (1, 12, 3, {"num_groups": 3, "topk_groups": 1, "group_topk": 4}),
    (19, 6, 3, {"num_groups": 6, "topk_groups": 6, "capacity_factor": 1.0}),
    (41, 35, 5, {"score": "sigmoid", "bias": True, "num_groups": 7, "topk_groups": 3, "route_scale": 2.5}),
    (33, 64, 8, {"score": "sigmoid", "bias": True, "num_groups": 8, "topk_groups": 4, "capacity_factor": 0.9}),
    (29, 16, 2, {"one_expert": True, "num_groups": 4, "topk_groups": 1, "group_topk": 2}),
    # token masks: a random one, every token masked, one valid token, with groups, bias and capacity
    (23, 8, 2, {"mask": "random"}),
    (5, 4, 2, {"mask": "none_valid", "capacity_factor": 1.0}),
    (13, 6, 3, {"mask": "one_valid", "score": "sigmoid", "bias": True}),
    (37, 12, 4, {"mask": "random", "capacity_factor": 0.7, "num_groups": 3, "topk_groups": 2, "route_scale": 1.5}),
]


def _token_mask(kind: str | None, num_tokens: int, gen: torch.Generator) -> Tensor | None:
    if kind is None:
        return None
    mask = torch.rand(num_tokens, generator=gen) > 0.35 if kind == "random" else torch.zeros(num_tokens, dtype=bool)
    if kind == "one_valid":
        mask[num_tokens // 2] = True
    return mask


def _reference(logits: Tensor, config: RoutingConfig, bias: Tensor | None, mask: Tensor | None) -> dict[str, Tensor]:
    """Float64 routing from the published formulas (Switch balance loss, ST-MoE z-loss, DeepSeek-V3 scores); a masked
    token's logits count as 0 and it counts in no loss."""
    num_experts = logits.shape[1]
    valid = torch.ones(logits.shape[0], dtype=torch.bool) if mask is None else mask
    logits = logits.masked_fill(~valid[:, None], 0.0)
    scores = logits.softmax(-1) if config.score == "softmax" else logits.sigmoid()
    selection = scores.detach() + (0 if bias is None else bias.double())
    if config.num_groups is not None:
        selection = _group_limited(selection, config)
    # A stable descending sort: equal scores keep the lower expert first.
    ids = torch.sort(selection, dim=-1, descending=True, stable=True).indices[:, : config.top_k]
    weights = scores.gather(1, ids)
    if config.normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if config.score == "sigmoid" else 0))
    weights = weights * config.route_scale
    probs = scores if config.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
    valid_ids = ids[valid].reshape(-1)
    ones = torch.ones(valid_ids.numel(), dtype=torch.float64)
    counts = torch.zeros(num_experts, dtype=torch.float64).index_add_(0, valid_ids, ones)
    tokens = max(int(valid.sum()), 1)
    aux = num_experts * (counts / max(valid_ids.numel(), 1) * probs[valid].sum(0) / tokens).sum()
    z = (logits.logsumexp(-1)[valid] ** 2).sum() / tokens
    return {"ids": ids, "weights": weights, "probs": probs, "aux": aux, "z": z}


def _group_limited(selection: Tensor, config: RoutingConfig) -> Tensor:
    """DeepSeek-V3's node-limited routing, one token at a time: a group's score is the sum of its ``group_topk`` best
    selection scores (default ``max(1, k // topk_groups)``, at most the group size); experts outside the token's
    ``topk_groups`` best groups get ``-inf``."""
    num_experts, groups, keep = selection.shape[1], config.num_groups, config.topk_groups
    size = num_experts // groups
    per_group = config.group_topk or min(max(1, config.top_k // keep), size)
    out = selection.clone()
    for row in out:
        group_scores = [sorted(row[g * size : (g + 1) * size].tolist(), reverse=True) for g in range(groups)]
        group_scores = [best[:per_group] for best in group_scores]
        ranked = sorted(range(groups), key=lambda g: (-sum(group_scores[g]), g))
        for g in ranked[keep:]:
            row[g * size : (g + 1) * size] = float("-inf")
    return out


def _loss(out: dict[str, Tensor], rows: Tensor, seeds: dict[str, Tensor]) -> Tensor:
    """A weighted sum of every differentiable output, the per-row weights included."""
    total = (out["weights"] * seeds["weights"]).sum() + (out["probs"] * seeds["probs"]).sum()
    return total + (rows * seeds["rows"]).sum() + seeds["aux"] * out["aux"] + seeds["z"] * out["z"]


@needs_interpreter
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "options"), CASES)
def test_fused_routing_matches_the_float64_formulas_forward_and_backward(num_tokens, num_experts, top_k, options):
    options = dict(options)
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    if options.pop("one_expert", False):
        logits[:, 3] += 30  # every token's first choice is expert 3
    bias = torch.randn(num_experts, generator=gen) * 0.1 if options.pop("bias", False) else None
    mask = _token_mask(options.pop("mask", None), num_tokens, gen)
    config = RoutingConfig(top_k=top_k, backend="triton", **options)
    assert fused_route_supported(config, num_experts, mask)
    leaf = logits.clone().requires_grad_()
    plan = route(leaf, config, expert_bias=bias, token_mask=mask, validate=None)
    assert plan.row_weights is not None  # the fused path made the plan
    seeds = {
        "weights": torch.randn(num_tokens, top_k, generator=gen),
        "probs": torch.randn(num_tokens, num_experts, generator=gen),
        "rows": torch.randn(plan.num_rows, generator=gen),
        "aux": torch.randn((), generator=gen),
        "z": torch.randn((), generator=gen),
    }
    got = {"weights": plan.weights, "probs": plan.router_probs, "aux": plan.aux_loss, "z": plan.z_loss}
    _loss(got, plan.row_weights, seeds).backward()
    leaf64 = logits.double().requires_grad_()
    expected = _reference(leaf64, config, bias, mask)
    # a row's weight is its pair's when kept, else 0
    rows = (expected["weights"] * plan.kept).reshape(-1)[plan.permutation.long()[: plan.num_rows]]
    _loss(expected, rows, {k: v.double() for k, v in seeds.items()}).backward()
    valid = slice(None) if mask is None else mask  # a masked token's experts are ties of equal scores: any order
    assert torch.equal(plan.expert_ids.long()[valid], expected["ids"][valid])
    for name in ("weights", "probs", "aux", "z"):
        torch.testing.assert_close(got[name].double(), expected[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(leaf.grad.double(), leaf64.grad, rtol=1e-4, atol=1e-5)
    # the PyTorch composition gives the same plan
    composition = dataclasses.replace(config, backend="torch")
    torch_plan = route(logits, composition, expert_bias=bias, token_mask=mask, validate=None)
    assert torch.equal(plan.expert_ids[valid], torch_plan.expert_ids[valid]) and plan.token_mask is mask
    for name in ("tokens_per_expert", "offsets", "permutation", "kept", "num_dropped", "routed_per_expert"):
        assert torch.equal(getattr(plan, name), getattr(torch_plan, name)), name
    derived = plan_indices(torch_plan)  # what the dispatcher derives on the PyTorch path
    assert torch.equal(plan.positions, derived.positions) and torch.equal(plan.row_tokens, derived.tokens)


@needs_interpreter
def test_fused_routing_gradient_of_the_losses_alone_and_bf16_logits():
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(19, 8, generator=gen) * 3).to(torch.bfloat16)
    results = []
    for backend in ("triton", "torch"):
        leaf = logits.clone().requires_grad_()
        plan = route(leaf, RoutingConfig(top_k=2, backend=backend), validate=None)
        (plan.aux_loss + 0.1 * plan.z_loss).backward()
        results.append((plan.aux_loss, plan.z_loss, leaf.grad))
    for got, expected in zip(*results):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-3)


@needs_interpreter
def test_groups_and_a_token_mask_add_no_launch_to_the_fused_router():
    """KernelCounter over route() forward and backward: group-limited routing and a token mask run inside the
    router kernel, the counting sort and the backward kernel, as plain top-k does."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(37, 12, generator=gen)
    mask = torch.rand(37, generator=gen) > 0.3

    def launches(mask: Tensor | None, **options) -> tuple[int, dict[str, int]]:
        leaf = logits.clone().requires_grad_()
        with KernelCounter() as counter:
            config = RoutingConfig(top_k=3, backend="triton", capacity_factor=1.0, **options)
            plan = route(leaf, config, token_mask=mask, validate=None)
            (plan.weights.sum() + plan.aux_loss + plan.z_loss).backward()
        return counter.kernels, dict(counter.triton_launches)

    plain = launches(None)
    assert plain[1]["_topk_scores_kernel"] == plain[1]["_topk_scores_backward_kernel"] == 1
    assert launches(None, num_groups=3, topk_groups=2) == plain
    assert launches(mask) == plain
    assert launches(mask, num_groups=4, topk_groups=1, score="sigmoid") == plain


@pytest.mark.parametrize(
    ("options", "masked", "supported"),
    [
        ({}, False, True),
        ({"capacity_factor": 1.0}, False, True),
        ({"capacity_factor": 1.0, "drop_policy": "score"}, False, False),
        ({"num_groups": 4, "topk_groups": 2, "capacity_factor": 1.0}, False, True),
        ({"num_groups": 4, "topk_groups": 2}, True, True),
        ({"capacity_factor": 1.0, "drop_policy": "score"}, True, False),
    ],
)
def test_configurations_left_to_the_composition(options, masked, supported):
    config = RoutingConfig(top_k=2, **options)
    mask = torch.ones(4, dtype=torch.bool) if masked else None
    assert fused_route_supported(config, 8, mask) is supported
    assert not fused_route_supported(RoutingConfig(top_k=2), 4096, None)  # more experts than the kernel holds


@needs_interpreter
@pytest.mark.parametrize("capacity", [None, 2])
def test_fused_route_ops_pass_opcheck(capacity):
    """The forward's schema, fake and autograd registration, and the backward op in full (as a compiled backward
    traces it). The forward's AOT check is left out: opcheck sums every output into one tensor, integers first."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 6, generator=gen, requires_grad=True)
    forward = torch.ops.lightning_llmfast.fused_route.default
    mask = torch.rand(9, generator=gen) > 0.3
    args = (logits, torch.randn(6, generator=gen), 2, True, True, 2.0, capacity, [3, 2, 1], mask)
    torch.library.opcheck(forward, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    outputs = forward(*args)
    ids, routed, positions, kept = outputs[0], outputs[5], outputs[9], outputs[11]
    grads = (torch.randn(9, 2, generator=gen), None, torch.randn(9, 6, generator=gen), torch.randn(()), None)
    backward_args = (logits.detach(), ids, *grads, positions, kept, routed, True, True, 2.0, mask)
    torch.library.opcheck(torch.ops.lightning_llmfast.fused_route_backward.default, backward_args)
