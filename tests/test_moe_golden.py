"""The MoE numbers do not move: block outputs, losses and every gradient match a stored golden file.

Bitwise equality of float reductions is a property of one machine (CPU model, vector width), not of the code: the
golden comparison allows a relative 1e-5 in fp32 (two bf16 units in the last place), scaled by each value and its
tensor's magnitude: a margin rounding cannot cross and a real change does (a test scales one weight matrix by
1 + 1e-3 and checks that the comparison fails).
Bitwise checks stay within one run: the same case computed twice in one process is bit-identical.

The golden file (``tests/golden/moe_golden.pt``) holds, per case, the initial state dict, the inputs and the results of
one forward+backward on fixed seeds: the grouped block dropless and with a capacity limit, softmax and sigmoid routing
(bias, groups, scale), shared experts, the sequence and global aux losses, a token mask, bf16 autocast, the Triton
kernels, the transformers adapter on tiny Mixtral/Qwen2-MoE/Qwen3-MoE/DeepSeek-V3 blocks built from configs, and the
reference MoE GPT. Regenerate it (only when a change is *meant* to move the numbers) with
``PYTHONPATH=. TRITON_INTERPRET=1 python tests/test_moe_golden.py --write``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.moe import MoEBlock, MoEConfig, SequenceBoundaries
from lightning_llmfast.moe.adapters import swap_moe_blocks
from lightning_llmfast.moe.kernels import triton_available

GOLDEN = Path(__file__).parent / "golden" / "moe_golden.pt"
H, FFN, E = 16, 32, 8


# The API seam: the only lines that follow the block's construction and per-forward record.
def _block(top_k: int = 2, **options: object) -> MoEBlock:
    options.setdefault("backend", "torch")
    return MoEBlock(MoEConfig.build(H, FFN, E, top_k, **options))


def _stats(block: nn.Module) -> dict[str, Tensor]:
    """aux loss, z loss, counts and dropped pairs of the block's last forward."""
    stats = block.stats
    return {"aux": stats.aux_loss, "z": stats.z_loss, "counts": stats.tokens_per_expert, "dropped": stats.num_dropped}


def _documents(document_ids: Tensor, count: int) -> dict[str, object]:
    """The forward keywords giving the block packed-document boundaries."""
    return {"boundaries": SequenceBoundaries(document_ids, count)}


def _results(module: nn.Module, y: Tensor, x: Tensor, extra: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {"y": y.detach(), "x.grad": x.grad}
    out.update({f"grad.{n}": p.grad for n, p in module.named_parameters() if p.grad is not None})
    out.update({f"buffer.{n}": b.clone() for n, b in module.named_buffers() if b is not None})
    out.update(extra)
    return out


def _run_block(block: MoEBlock, inputs: dict[str, Tensor], train: bool = True, **forward: object) -> dict[str, Tensor]:
    block.train(train)
    x = inputs["x"].detach().clone().requires_grad_()
    y = block(x, token_mask=inputs.get("mask"), **forward)
    stats = _stats(block)
    loss = (y.float() * inputs["g"]).sum() + 0.1 * stats["aux"] + 0.01 * stats["z"]
    loss.backward()
    return _results(block, y, x, {k: v.detach() for k, v in stats.items()})


def _inputs(seed: int, shape: tuple[int, ...], mask: bool = False) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {"x": torch.randn(*shape, H, generator=gen), "g": torch.randn(*shape, H, generator=gen)}
    if mask:
        out["mask"] = torch.rand(shape, generator=gen) > 0.3
    return out


def _block_case(seed: int, shape: tuple[int, ...], mask: bool = False, bias: bool = False, **options: object):
    def build() -> MoEBlock:
        torch.manual_seed(seed)
        block = _block(**options)
        if bias:
            block.expert_bias.normal_(std=0.05)
        return block

    return build, _inputs(seed, shape, mask)


def _cases() -> dict[str, tuple[Callable[[], nn.Module], dict[str, Tensor], Callable[..., dict[str, Tensor]]]]:
    cases = {}
    for name, shape, mask, bias, options in [
        ("dropless", (3, 7), False, False, {}),
        ("dropless_topk1_eval", (1, 13), False, False, {"top_k": 1, "_eval": True}),
        ("capacity_position", (3, 7), False, False, {"capacity_factor": 1.0}),
        ("capacity_score", (2, 11), False, False, {"capacity_factor": 0.5, "drop_policy": "score"}),
        ("capacity_mask", (3, 7), True, False, {"capacity_factor": 1.25}),
        ("dropless_mask", (5, 3), True, False, {}),
        (
            "sigmoid_groups_bias",
            (3, 7),
            False,
            True,
            {
                "top_k": 4,
                "score": "sigmoid",
                "expert_bias": True,
                "num_groups": 4,
                "topk_groups": 2,
                "route_scale": 2.5,
                "bias_update": "forward",
            },
        ),
        ("sigmoid_unnormalized", (2, 5), False, False, {"score": "sigmoid", "normalize": False}),
        ("shared_sequence", (3, 7), False, False, {"num_shared_experts": 2, "aux_loss": "sequence"}),
        (
            "shared_width_global",
            (3, 7),
            False,
            False,
            {"num_shared_experts": 1, "shared_ffn_size": 24, "aux_loss": "global"},
        ),
        ("capacity_bias_step", (3, 7), False, True, {"capacity_factor": 1.0, "expert_bias": True}),
    ]:
        options = dict(options)
        train = not options.pop("_eval", False)
        build, inputs = _block_case(len(cases) + 1, shape, mask, bias, **options)
        cases[name] = (build, inputs, lambda b, i, t=train: _run_block(b, i, t))
    build, inputs = _block_case(40, (21,), False, False, aux_loss="sequence")
    # Packed documents of lengths 5, 1 and 15 (the sequence aux loss per document).
    inputs["document_ids"] = torch.tensor([0] * 5 + [1] + [2] * 15)
    cases["sequence_documents"] = (build, inputs, _run_with_documents)
    build, inputs = _block_case(41, (3, 7), False, False, capacity_factor=1.0)
    cases["autocast_bf16_capacity"] = (build, inputs, _run_autocast)
    build, inputs = _block_case(42, (3, 7), False, False)
    cases["autocast_bf16_dropless"] = (build, inputs, _run_autocast)
    if triton_available(torch.device("cpu")):
        for name, options in [("triton_dropless", {}), ("triton_capacity", {"capacity_factor": 0.75})]:
            build, inputs = _block_case(50 + len(name), (2, 5), False, False, backend="triton", **options)
            cases[name] = (build, inputs, lambda b, i: _run_block(b, i))
    for package, block_name, config_name, kwargs in _HF:
        cases[f"hf_{block_name}"] = (
            _hf_builder(package, block_name, config_name, kwargs),
            _inputs(60, (2, 9)),
            _run_hf,
        )
    for name, overrides in [("moegpt_dropless", {}), ("moegpt_capacity", {"capacity_factor": 1.0})]:
        cases[name] = (_gpt_builder(overrides), _gpt_inputs(), _run_gpt)
    return cases


def _run_with_documents(block: MoEBlock, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    return _run_block(block, inputs, **_documents(inputs["document_ids"], 3))


def _run_autocast(block: MoEBlock, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _run_block(block, inputs)


_HF = [
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
    ("qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeConfig", {"moe_intermediate_size": FFN, "num_experts": E}),
    (
        "deepseek_v3",
        "DeepseekV3MoE",
        "DeepseekV3Config",
        {
            "moe_intermediate_size": FFN,
            "n_routed_experts": E,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
        },
    ),
]


def _hf_builder(package: str, block_name: str, config_name: str, kwargs: dict[str, object]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        transformers = pytest.importorskip("transformers")
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        config = getattr(transformers, config_name)(hidden_size=H, num_experts_per_tok=2, hidden_act="silu", **kwargs)
        config._experts_implementation = "eager"
        torch.manual_seed(7)
        block = getattr(module, block_name)(config)
        for p in block.parameters():  # transformers leaves them uninitialised until a PreTrainedModel inits them
            nn.init.normal_(p, std=0.3)
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(std=0.1)
        holder = nn.Sequential(block)
        assert swap_moe_blocks(holder, backend="torch") == 1
        return holder

    return build


def _run_hf(holder: nn.Module, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    holder.train()
    x = inputs["x"].detach().clone().requires_grad_()
    y = holder(x)
    stats = _stats(holder[0])
    ((y * inputs["g"]).sum() + 0.1 * stats["aux"] + 0.01 * stats["z"]).backward()
    return _results(holder, y, x, {k: v.detach() for k, v in stats.items()})


def _gpt_builder(overrides: dict[str, object]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(3)
        config = MoEGPTConfig(
            vocab_size=64,
            hidden_size=32,
            n_layers=2,
            n_heads=2,
            n_kv_heads=1,
            ffn_size=32,
            num_experts=4,
            top_k=2,
            router_backend="torch",
            **overrides,
        )
        return MoEGPT(config)

    return build


def _gpt_inputs() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 64, (2, 12), generator=gen)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    return {"ids": ids, "positions": positions, "labels": torch.randint(0, 64, (2, 12), generator=gen)}


def _run_gpt(model: MoEGPT, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    model.train()
    logits = model(inputs["ids"], inputs["positions"])
    ce = nn.functional.cross_entropy(logits.flatten(0, 1), inputs["labels"].flatten())
    (ce + 0.01 * model.aux_loss()).backward()
    out = {"logits": logits.detach(), "aux": model.aux_loss().detach()}
    out.update({f"grad.{n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    return out


@contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread: CPU reductions then add in one fixed order whatever the machine's core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _compute(name: str, state: dict[str, Tensor] | None = None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    build, inputs, run = _cases()[name]
    module = build()
    if state is not None:
        module.load_state_dict(state)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    with _one_thread():
        return state, run(module, inputs)


def write() -> None:
    golden = {}
    for name in _cases():
        state, results = _compute(name)
        golden[name] = {"state": state, "results": results}
    GOLDEN.parent.mkdir(exist_ok=True)
    torch.save(golden, GOLDEN)
    print(f"wrote {len(golden)} cases to {GOLDEN}")


# How far rounding moves a value across CPU models (relative to itself and to its tensor's largest magnitude: a sum
# of cancelling terms keeps the rounding of its terms); counts, ids and masks must be equal.
_RELATIVE = {torch.float32: 1e-5, torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}


def _mismatches(results: dict[str, Tensor], expected: dict[str, Tensor]) -> list[str]:
    """The keys whose values differ from the golden ones by more than rounding can explain."""
    out = []
    for key, value in expected.items():
        got = results[key]
        if got.dtype != value.dtype or got.shape != value.shape:
            out.append(f"{key}: {got.dtype}{tuple(got.shape)} != {value.dtype}{tuple(value.shape)}")
        elif not value.is_floating_point():
            if not torch.equal(got, value):
                out.append(f"{key}: differs")
        else:
            error = (got.double() - value.double()).abs()
            scale = value.double().abs().max().clamp_min(1.0) if value.numel() else torch.tensor(1.0)
            limit = _RELATIVE[value.dtype] * (value.double().abs() + scale * 0.1)
            if error.numel() and bool((error > limit).any()):
                out.append(f"{key}: max abs {error.max():.3g}")
    return out


@pytest.mark.parametrize("name", list(_cases()))
def test_outputs_and_gradients_match_the_golden_file(name: str) -> None:
    golden = torch.load(GOLDEN, weights_only=True)
    assert name in golden, f"case {name!r} is not in the golden file: regenerate it only if the numbers may move"
    _, results = _compute(name, golden[name]["state"])
    expected = golden[name]["results"]
    assert sorted(results) == sorted(expected)
    assert not _mismatches(results, expected), f"{name}: {_mismatches(results, expected)}"


@pytest.mark.parametrize("name", ["dropless", "capacity_position", "autocast_bf16_dropless", "moegpt_dropless"])
def test_outputs_and_gradients_are_bit_identical_within_one_run(name: str) -> None:
    golden = torch.load(GOLDEN, weights_only=True)
    _, first = _compute(name, golden[name]["state"])
    _, second = _compute(name, golden[name]["state"])
    for key, value in first.items():
        assert torch.equal(value, second[key]), f"{name}: {key} differs between two runs in one process"


@pytest.mark.parametrize("name", ["dropless", "autocast_bf16_dropless", "moegpt_dropless"])
def test_the_golden_comparison_catches_a_real_change(name: str) -> None:
    golden = torch.load(GOLDEN, weights_only=True)
    state = {k: v.clone() for k, v in golden[name]["state"].items()}
    weight = [k for k, v in state.items() if v.is_floating_point() and v.dim() >= 2][-1]
    state[weight] *= 1 + 1e-3  # one weight matrix moved by a relative 1e-3
    _, results = _compute(name, state)
    assert _mismatches(results, golden[name]["results"]), f"{name}: a 1e-3 change to {weight} went unnoticed"


def test_golden_file_covers_every_case() -> None:
    golden = torch.load(GOLDEN, weights_only=True)
    assert set(golden) == set(_cases())


if __name__ == "__main__" and "--write" in sys.argv:
    write()
