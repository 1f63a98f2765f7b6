"""Adapters for transformers' MoE blocks: same parameters, same outputs, router logits and gradients after a swap.

Every model is a tiny randomly initialised one built from a config: nothing is downloaded.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.errors import RoutingError
from lightning_llmfast.models import swap_rms_norms
from lightning_llmfast.moe.adapters import HFGroupedMoeBlock, get_moe_adapter, swap_moe_blocks
from lightning_llmfast.offload import ActivationOffloader, OffloadConfig

pytest.importorskip("transformers")

H, FFN, E, K = 16, 32, 8, 2

# (model package, block class, config class, tiny config kwargs besides hidden_size / num_experts_per_tok)
_BLOCKS = [
    ("mixtral", "MixtralSparseMoeBlock", "MixtralConfig", {"intermediate_size": FFN, "num_local_experts": E}),
    (
        "qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
        "Qwen2MoeConfig",
        {
            "moe_intermediate_size": FFN,
            "shared_expert_intermediate_size": 24,
            "num_experts": E,
            "norm_topk_prob": False,
        },
    ),
    (
        "qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeConfig",
        {"moe_intermediate_size": FFN, "num_experts": E, "norm_topk_prob": True},
    ),
    ("olmoe", "OlmoeSparseMoeBlock", "OlmoeConfig", {"intermediate_size": FFN, "num_experts": E}),
]


def _available() -> list[object]:
    params = []
    for package, block_name, config_name, kwargs in _BLOCKS:
        try:
            module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
            config_cls = getattr(importlib.import_module("transformers"), config_name)
        except ImportError:
            continue
        block_cls = getattr(module, block_name, None)
        if block_cls is not None:
            params.append(pytest.param(block_cls, config_cls, kwargs, id=block_name))
    return params


def _tiny_block(block_cls: type, config_cls: type, kwargs: dict[str, object], seed: int) -> nn.Module:
    config = config_cls(hidden_size=H, num_experts_per_tok=K, **kwargs)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    block = block_cls(config)
    for p in block.parameters():  # HF leaves them uninitialised (empty) until a PreTrainedModel inits them
        nn.init.normal_(p, std=0.3)
    return block


def _run(
    block: nn.Module, x: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    block.zero_grad()
    x = x.detach().requires_grad_()
    y = block(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


@pytest.mark.parametrize(("block_cls", "config_cls", "kwargs"), _available())
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_block_swap_same_parameters_outputs_grads(
    block_cls: type, config_cls: type, kwargs: dict[str, object], num_tokens: int
) -> None:
    block = _tiny_block(block_cls, config_cls, kwargs, seed=num_tokens)
    container = nn.Sequential(block)
    x, g = torch.randn(2, num_tokens, H), torch.randn(2, num_tokens, H)
    before = _run(block, x, g)
    state = container.state_dict()
    params = dict(container.named_parameters())

    assert get_moe_adapter(block) is not None
    assert swap_moe_blocks(container, backend="torch") == 1
    swapped = container[0]
    assert isinstance(swapped, HFGroupedMoeBlock)
    new_state = container.state_dict()
    assert list(new_state) == list(state)
    assert all(new_state[k].data_ptr() == state[k].data_ptr() for k in state)
    assert all(p is params[n] for n, p in container.named_parameters())

    with SyncCounter() as counter:
        after = _run(swapped, x, g)
    assert counter.num_syncs == 0, counter.syncs
    torch.testing.assert_close(after[0], before[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[1], before[1], rtol=1e-5, atol=1e-5)
    assert after[2].keys() == before[2].keys()
    for name in before[2]:
        torch.testing.assert_close(after[2][name], before[2][name], rtol=1e-5, atol=1e-5, msg=name)
    logits = x.reshape(-1, H) @ swapped.gate.weight.detach().T
    torch.testing.assert_close(swapped.last_router_logits.detach(), logits)
    assert swapped.last_tokens_per_expert.sum() == 2 * num_tokens * K
    assert swap_moe_blocks(container) == 0  # idempotent


def _tiny_causal_lm(name: str, **kwargs: object) -> nn.Module:
    transformers = importlib.import_module("transformers")
    config = getattr(transformers, f"{name}Config")(
        vocab_size=64,
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts_per_tok=K,
        max_position_embeddings=64,
        output_router_logits=True,
        **kwargs,
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(config)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("Mixtral", {"intermediate_size": FFN, "num_local_experts": E, "router_aux_loss_coef": 0.02}),
        (
            "Qwen2Moe",
            {
                "intermediate_size": FFN,
                "moe_intermediate_size": FFN,
                "shared_expert_intermediate_size": 24,
                "num_experts": E,
            },
        ),
    ],
)
def test_causal_lm_swap_logits_router_logits_and_training_step(name: str, kwargs: dict[str, object]) -> None:
    if not hasattr(importlib.import_module("transformers"), f"{name}ForCausalLM"):
        pytest.skip(f"transformers has no {name}ForCausalLM")
    model = _tiny_causal_lm(name, **kwargs)
    ids = torch.randint(0, 64, (2, 9))

    def step() -> tuple[object, dict[str, torch.Tensor]]:
        model.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    before, grads_before = step()
    keys = list(model.state_dict())
    assert swap_moe_blocks(model, backend="torch") == 2
    assert list(model.state_dict()) == keys
    after, grads_after = step()

    torch.testing.assert_close(after.logits, before.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after.loss, before.loss)
    torch.testing.assert_close(after.aux_loss, before.aux_loss)
    assert len(after.router_logits) == len(before.router_logits) == 2  # still recorded through the router hooks
    for a, b in zip(after.router_logits, before.router_logits):
        torch.testing.assert_close(a, b)
    assert grads_after.keys() == grads_before.keys()
    for n in grads_before:
        torch.testing.assert_close(grads_after[n], grads_before[n], rtol=1e-4, atol=1e-5, msg=n)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.step()
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_mixtral_router_jitter_draws_the_same_noise() -> None:
    module = importlib.import_module("transformers.models.mixtral.modeling_mixtral")
    config_cls = importlib.import_module("transformers").MixtralConfig
    kwargs = {"intermediate_size": FFN, "num_local_experts": E, "router_jitter_noise": 0.2}
    block = _tiny_block(module.MixtralSparseMoeBlock, config_cls, kwargs, seed=3).train()
    x = torch.randn(2, 5, H)
    torch.manual_seed(7)
    before = block(x.clone())  # the HF block scales its input in place
    container = nn.Sequential(block)
    swap_moe_blocks(container, backend="torch")
    torch.manual_seed(7)
    after = container(x.clone())
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(container.eval()(x), after)  # the jitter did change the routing input


def test_swapped_causal_lm_under_the_offloader_is_bit_identical_and_rebuilds() -> None:
    """A transformers model with swapped MoE blocks and RMSNorms, under bf16 autocast as Lightning runs it: the
    offloader (layer 0 offloaded, norms' outputs and, with ``rebuild="norms+gemms"``, the experts' gate/up outputs
    rebuilt) gives the same gradients to the bit as the same model without it."""
    if not hasattr(importlib.import_module("transformers"), "Qwen2MoeForCausalLM"):
        pytest.skip("transformers has no Qwen2MoeForCausalLM")
    model = _tiny_causal_lm(
        "Qwen2Moe", intermediate_size=FFN, moe_intermediate_size=FFN, shared_expert_intermediate_size=24, num_experts=E
    )
    assert swap_moe_blocks(model, backend="torch") == 2 and swap_rms_norms(model) == 5  # 2 per layer and the final
    ids = torch.randint(0, 64, (2, 9))

    def grads(off: ActivationOffloader | None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with off if off is not None else torch.enable_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected = grads(None)
    rebuilt = {}
    for gemms in (False, True):
        config = OffloadConfig(
            min_offload_bytes=0, keep_last_layers=1, force=True, rebuild="norms+gemms" if gemms else "norms"
        )
        off = ActivationOffloader(model.model.layers, config)
        got = grads(off)
        assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in expected)
        assert off.stats["offloaded_bytes"] > 0 and off.stats["checked_out"] == 0
        rebuilt[gemms] = off.stats["rebuilt_tensors"]
        off.close()
    assert rebuilt[False] > 0 and rebuilt[True] == rebuilt[False] + 2  # one gate/up output per layer


@pytest.mark.parametrize(("block_cls", "config_cls", "kwargs"), _available())
def test_swapped_block_rejects_input_of_another_width_or_dtype(
    block_cls: type, config_cls: type, kwargs: dict[str, object]
) -> None:
    container = nn.Sequential(_tiny_block(block_cls, config_cls, kwargs, seed=5))
    swap_moe_blocks(container, backend="torch")
    assert isinstance(container[0], HFGroupedMoeBlock)
    with pytest.raises(RoutingError, match=rf"^hidden_states must have shape .*hidden_size={H}"):
        container(torch.randn(2, 3, 2 * H))  # was silently read as twice the tokens
    with pytest.raises(RoutingError, match=r"dtype torch\.float64"):
        container(torch.randn(2, 3, H, dtype=torch.float64))
