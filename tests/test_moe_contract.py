"""The typed MoE contract: configs validated at construction, the dispatcher seam, one stats record per forward read
through the ``MoELayer`` protocol, and the package's structure (no duck-typed markers, no ``last_*`` writes, no
contract lookups by ``getattr``, no private names across subpackages, ``moe/`` importing no upper layer)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_llmfast.errors import ConfigError, RoutingError
from lightning_llmfast.models import MoEGPT, MoEGPTConfig
from lightning_llmfast.moe import (
    ExpertRows,
    LocalDispatcher,
    MoEBlock,
    MoEConfig,
    MoELayer,
    MoEStats,
    NaiveMoEBlock,
    RoutingConfig,
    RoutingPlan,
    SequenceBoundaries,
    TokenDispatcher,
    route,
)
from lightning_llmfast.moe.adapters import HFGroupedMoeBlock, swap_moe_blocks
from lightning_llmfast.seqmeta import SequenceMetadata, SequenceMetadataCache, activate_cache

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_llmfast"
H, FFN, E = 8, 16, 4


def _sources(sub: str = "") -> list[Path]:
    return sorted((PACKAGE / sub).rglob("*.py"))


# ---------------------------------------------------------------------------------------------------------- structure
def test_no_marker_attribute_and_no_last_attribute_writes_in_the_package() -> None:
    """No ``_llmfast_grouped`` anywhere; no ``last_*`` write in moe/, nor of an MoE record's fields anywhere."""
    marker, writes = [], []
    any_last = re.compile(r"\.last_\w+\s*(:[^=\n]*)?=(?!=)")
    moe_record = re.compile(
        r"\.last_(plan|aux_loss|z_loss|tokens_per_expert|router_logits|nonfinite|send_rows|recv_rows|global_stats)"
        r"\s*(:[^=\n]*)?=(?!=)"
    )
    for path in _sources():
        text = path.read_text()
        if "_llmfast_grouped" in text:
            marker.append(path.name)
        pattern = any_last if path.is_relative_to(PACKAGE / "moe") else moe_record
        writes += [f"{path.name}: {line.strip()}" for line in text.splitlines() if pattern.search(line)]
    assert not marker, f"the duck-typed marker is back in {marker}"
    assert not writes, f"last_* attribute writes outside the stats record: {writes}"


def test_no_getattr_contract_lookups_on_blocks() -> None:
    lookup = re.compile(r"getattr\([^)]*[\"'](finish_step|dispatcher|expert_dispatch|last_\w+)[\"']")
    hits = [f"{p.name}: {m.group(0)}" for p in _sources() for m in lookup.finditer(p.read_text())]
    assert not hits, hits


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ``import``/``from ... import`` in ``path``, at any depth (TYPE_CHECKING too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_private_name_is_imported_across_subpackages() -> None:
    bad = []
    for path in _sources():
        parts = path.relative_to(PACKAGE).parts
        mine = parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")
        for module, names in _imports(path):
            if module.startswith("lightning_llmfast.") and _subpackage(module) != mine:
                bad += [f"{path.relative_to(PACKAGE)}: {module}.{n}" for n in names if n.startswith("_")]
    assert not bad, bad


def test_moe_and_data_import_only_downward() -> None:
    """moe/ imports nothing from seqmeta/, callbacks/, models/ or Lightning; data/ nothing from seqmeta/."""
    rules = {
        "moe": ("lightning_llmfast.seqmeta", "lightning_llmfast.callbacks", "lightning_llmfast.models", "lightning."),
        "data": ("lightning_llmfast.seqmeta", "lightning."),
    }
    bad = [
        f"{sub}/{path.name}: {module}"
        for sub, upper in rules.items()
        for path in _sources(sub)
        for module, _ in _imports(path)
        if module.startswith(upper) or module in ("lightning", "torchmetrics")
    ]
    assert not bad, bad


def test_no_production_class_derives_from_the_naive_reference() -> None:
    from lightning_llmfast.moe import naive

    bases = {naive.NaiveMoEBlock, naive.SwiGLUExperts}
    import lightning_llmfast.moe.adapters  # noqa: F401  (registers every class below)

    def subclasses(cls: type) -> set[type]:
        return set(cls.__subclasses__()).union(*(subclasses(c) for c in cls.__subclasses__()))

    derived = {c for b in bases for c in subclasses(b) if c.__module__.startswith("lightning_llmfast")}
    assert not derived, derived


# ------------------------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 0}, "top_k must be an int >= 1, got 0"),
        ({"top_k": 2, "score": "tanh"}, "score must be one of"),
        ({"top_k": 2, "capacity_factor": -1.0}, "capacity_factor must be a finite number > 0"),
        ({"top_k": 2, "min_capacity": 3}, "min_capacity needs a capacity_factor"),
        ({"top_k": 2, "num_groups": 2}, "num_groups and topk_groups go together"),
        ({"top_k": 2, "group_topk": 1}, "group_topk needs num_groups"),
        ({"top_k": 2, "route_scale": 0.0}, "route_scale must be a finite number > 0"),
        ({"top_k": 2, "backend": "cuda"}, "backend must be one of"),
        ({"top_k": 2, "normalize": "yes"}, "normalize must be True or False"),
    ],
)
def test_routing_config_rejects_bad_settings_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RoutingConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"routing": RoutingConfig(top_k=5)}, r"top_k must be an int in \[1, num_experts=4\]"),
        ({"routing": RoutingConfig(top_k=2, num_groups=3, topk_groups=1)}, "num_groups=3 must divide num_experts=4"),
        ({"routing": {"top_k": 2}}, "routing must be a RoutingConfig"),
        ({"aux_loss": "token"}, "aux_loss must be one of"),
        ({"bias_update": "epoch"}, "bias_update must be one of"),
        ({"shared_ffn_size": 8}, "shared_ffn_size needs num_shared_experts"),
        ({"expert_bias": 1}, "expert_bias must be True or False"),
    ],
)
def test_moe_config_rejects_bad_settings_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MoEConfig(H, FFN, E, **kwargs)


def test_keyword_forms_build_the_same_configs() -> None:
    config = MoEConfig.build(H, FFN, E, 2, capacity_factor=1.25, score="sigmoid", num_shared_experts=1)
    assert config == MoEConfig(H, FFN, E, RoutingConfig(2, "sigmoid", capacity_factor=1.25), num_shared_experts=1)
    with pytest.raises(ConfigError, match=r"unknown MoE option\(s\) \['capcity_factor'\]"):
        MoEConfig.build(H, FFN, E, 2, capcity_factor=1.0)
    logits = torch.randn(7, E)
    by_keywords = route(logits, 2, capacity_factor=1.0, drop_policy="score")
    by_config = route(logits, RoutingConfig(top_k=2, capacity_factor=1.0, drop_policy="score"))
    for a, b in zip(by_keywords, by_config, strict=True):
        assert a == b if not isinstance(a, Tensor) else torch.equal(a, b)
    with pytest.raises(RoutingError, match="not both"):
        route(logits, RoutingConfig(top_k=2), capacity_factor=1.0)
    with pytest.raises(RoutingError, match="unknown routing option"):
        route(logits, 2, capacity=3)


def test_configs_are_frozen() -> None:
    config = MoEConfig.build(H, FFN, E, 2)
    with pytest.raises(AttributeError):
        config.num_experts = 8  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.routing.top_k = 3  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------------- dispatcher
class _LoopDispatcher(TokenDispatcher):
    """An independent dispatcher: materialised rows in the plan's order, weights applied in a per-token loop."""

    def __init__(self) -> None:
        self.calls = 0

    def dispatch(self, x: Tensor, plan: RoutingPlan, *, x_compute: Tensor | None = None) -> tuple[ExpertRows, Any]:
        self.calls += 1
        pairs = plan.permutation.long()[: plan.num_rows]
        rows = x[pairs // plan.top_k]
        return ExpertRows(rows, plan.offsets, plan.padded, "torch"), (plan, pairs)

    def combine(self, rows: Tensor, ctx: Any) -> Tensor:
        plan, pairs = ctx
        out = rows.new_zeros(plan.num_tokens, rows.shape[1])
        weights = (plan.weights * plan.kept).reshape(-1)
        for r, pair in enumerate(pairs.tolist()):
            if r < int(plan.offsets[-1]):
                out[pair // plan.top_k] += weights[pair] * rows[r]
        return out


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_the_block_runs_the_dispatcher_it_was_given(capacity_factor: float | None) -> None:
    torch.manual_seed(1)
    config = MoEConfig.build(H, FFN, E, 2, capacity_factor=capacity_factor, backend="torch")
    local = MoEBlock(config)
    looped = MoEBlock(config, dispatcher=_LoopDispatcher())
    looped.load_state_dict(local.state_dict())
    x = torch.randn(2, 7, H, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = local(x), looped(x2)
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-6)
    (y.square().sum()).backward()
    (y2.square().sum()).backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-6)
    for (name, p), p2 in zip(local.named_parameters(), looped.parameters(), strict=True):
        torch.testing.assert_close(p2.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert looped.dispatcher.calls == 1 and isinstance(local.dispatcher, LocalDispatcher)


def test_set_dispatcher_takes_only_a_token_dispatcher() -> None:
    block = MoEBlock(MoEConfig.build(H, FFN, E, 2))
    with pytest.raises(ConfigError, match="dispatcher must be a TokenDispatcher, got function"):
        block.set_dispatcher(lambda x, plan: x)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="config must be an MoEConfig, got dict"):
        MoEBlock({"hidden_size": H})  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------------- stats + protocol
def test_every_moe_layer_records_one_stats_per_forward() -> None:
    torch.manual_seed(2)
    grouped = MoEBlock(MoEConfig.build(H, FFN, E, 2, capacity_factor=0.5, backend="torch"))
    naive = NaiveMoEBlock(H, FFN, E, 2)
    for block in (grouped, naive):
        assert isinstance(block, MoELayer) and block.stats is None
        x = torch.randn(3, 5, H)
        block(x)
        stats = block.stats
        assert isinstance(stats, MoEStats)
        assert stats.tokens_per_expert.shape == (E,) and stats.tokens_per_expert.dtype == torch.int32
        assert stats.router_logits.shape == (15, E) and stats.num_pairs == 30
        assert stats.aux_loss.requires_grad and stats.z_loss.requires_grad
    plan = grouped.stats.plan
    assert int(grouped.stats.num_dropped) == 30 - int(plan.tokens_per_expert.sum()) > 0  # capacity dropped some
    assert grouped.last_aux_loss is grouped.stats.aux_loss
    with pytest.raises(AttributeError):
        grouped.last_aux_loss = torch.zeros(())  # type: ignore[misc]  (read-only: the stats record is the one place)
    assert not isinstance(torch.nn.Linear(2, 2), MoELayer)


def test_swapped_transformers_block_is_the_core_block() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E)
    holder = torch.nn.Sequential(MixtralSparseMoeBlock(config))
    assert swap_moe_blocks(holder, backend="torch") == 1 and swap_moe_blocks(holder) == 0
    block = holder[0]
    assert isinstance(block, HFGroupedMoeBlock) and isinstance(block, MoELayer)
    assert block.config == MoEConfig(H, FFN, E, RoutingConfig(top_k=2, backend="torch"))
    holder(torch.randn(2, 3, H))
    assert block.stats.plan.num_tokens == 6


def test_the_model_passes_document_boundaries_to_a_sequence_aux_loss() -> None:
    torch.manual_seed(4)
    model = MoEGPT(MoEGPTConfig(vocab_size=32, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_size=16,
                                num_experts=E, top_k=2, router_backend="torch"))  # fmt: skip
    block = MoEBlock(MoEConfig.build(16, 16, E, 2, aux_loss="sequence", backend="torch"))
    model.layers[0].ffn = block
    ids = torch.randint(0, 32, (1, 9))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    documents = SequenceBoundaries(torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2]), 3)
    model(ids, positions)
    by_documents = block.stats.plan.sequence_aux_loss(documents)
    torch.testing.assert_close(block.stats.aux_loss, by_documents)
    assert not torch.allclose(
        by_documents, block.stats.plan.sequence_aux_loss(SequenceBoundaries.rows(1, 9, ids.device))
    )
    cache = SequenceMetadataCache()
    meta = SequenceMetadata.from_position_ids(positions)
    with cache.batch({"cu_seqlens": meta.cu_seqlens}), activate_cache(cache):
        model(ids, positions)
    torch.testing.assert_close(block.stats.aux_loss, block.stats.plan.sequence_aux_loss(documents))


def test_names_moved_to_expert_parallel_resolve_from_their_old_homes_with_a_deprecation_warning() -> None:
    import lightning_llmfast.comm as comm
    import lightning_llmfast.moe as moe
    from lightning_llmfast import expert_parallel
    from lightning_llmfast.moe import token_rows

    for name in ("shard_experts", "AllToAllDispatcher", "AllToAllDroplessDispatcher", "AllToAllCapacityDispatcher"):
        with pytest.warns(DeprecationWarning, match=f"moe.{name} moved to lightning_llmfast.expert_parallel"):
            assert getattr(moe, name) is getattr(expert_parallel, name)
    with pytest.warns(DeprecationWarning, match="comm.DispatchPayload moved"):
        assert comm.DispatchPayload is expert_parallel.DispatchPayload
    assert moe.permute is token_rows.permute and moe.unpermute is token_rows.unpermute  # public, not moved
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        moe.missing  # noqa: B018
