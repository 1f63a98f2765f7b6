"""SequenceMetadataCallback in real Lightning fits: one build per batch, validation, shape changes, accumulation."""

from __future__ import annotations

import random
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_llmfast
from lightning_llmfast import ConfigError, MetadataError
from lightning_llmfast.bench.counters import SyncCounter
from lightning_llmfast.callbacks.seqmeta import SequenceMetadataCallback
from lightning_llmfast.data import pack_documents
from lightning_llmfast.seqmeta import SequenceMetadata, SequenceMetadataCache, active_cache, varlen_attention

HIDDEN, HEADS = 8, 2


class TinyLayer(nn.Module):
    """Attention-only block that reads its metadata from the active cache (as a "cached" model layer does)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.seen: list[SequenceMetadata] = []

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        meta = active_cache().get(x)
        self.seen.append(meta)
        q, k, v = self.qkv(x).reshape(-1, 3, HEADS, HIDDEN // HEADS).unbind(1)
        return x + varlen_attention(q, k, v, meta).reshape(x.shape)


class TinyModule(L.LightningModule):
    def __init__(self, n_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, HIDDEN)
        self.blocks = nn.ModuleList(TinyLayer() for _ in range(n_layers))
        self.head = nn.Linear(HIDDEN, 256)
        self.batches: list[tuple[int, int]] = []  # (distinct metadata objects in the batch, layer calls)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            block.seen.clear()
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids)
        seen = [m for block in self.blocks for m in block.seen]
        self.batches.append((len({id(m) for m in seen}), len(seen)))
        return self.head(x)

    def _loss(self, batch) -> torch.Tensor:
        if isinstance(batch, (tuple, list)):  # (input_ids, position_ids) batches carry no cu_seqlens
            input_ids, position_ids = batch
            logits = self(input_ids, position_ids)
            return logits.float().logsumexp(-1).mean()
        logits = self(batch.input_ids)
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten())

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _batches(shapes: list[tuple[int, int]], seed: int = 0) -> list:
    rng = random.Random(seed)
    out = []
    for rows, seq_len in shapes:
        docs = [[rng.randrange(1, 256) for _ in range(rng.randint(1, seq_len + 3))] for _ in range(3 * rows)]
        out.append(next(pack_documents(docs, seq_len=seq_len, batch_size=rows)))
    return out


def _loader(batches: list) -> DataLoader:
    return DataLoader(batches, batch_size=None, shuffle=False)


def _trainer(tmp_path: Path, callback: SequenceMetadataCallback, **kwargs) -> L.Trainer:
    defaults = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": tmp_path,
    }
    return L.Trainer(callbacks=[callback], **{**defaults, **kwargs})


def test_fit_with_validation_builds_once_per_batch_and_logs(tmp_path: Path) -> None:
    module = TinyModule(n_layers=3)
    callback = lightning_llmfast.SequenceMetadataCallback()
    # Batch size and row length change mid-epoch: each batch gets its own, correct metadata.
    train = _batches([(2, 16), (2, 16), (3, 16), (1, 24), (2, 9)])
    val = _batches([(2, 16), (1, 7)], seed=1)
    trainer = _trainer(tmp_path, callback, limit_val_batches=2)
    trainer.fit(module, train_dataloaders=_loader(train), val_dataloaders=_loader(val))
    assert module.batches == [(1, 3)] * (len(train) + len(val))
    assert callback.cache.stats["builds"] == len(train) + len(val)
    assert callback.cache.stats["version"] == len(train) + len(val)
    assert trainer.logged_metrics["seqmeta/builds_per_step"] == 1.0
    assert active_cache() is None and not callback.cache.is_open
    # Hooks are removed at teardown.
    assert all(not block._forward_pre_hooks for block in module.blocks)


class LateModule(TinyModule):
    """Builds its layers in ``configure_model``, which Lightning runs after the callbacks' ``setup``."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.batches = []

    def configure_model(self) -> None:
        if not hasattr(self, "blocks"):
            self.embed = nn.Embedding(256, HIDDEN)
            self.blocks = nn.ModuleList(TinyLayer() for _ in range(2))
            self.head = nn.Linear(HIDDEN, 256)


class FailingModule(TinyModule):
    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)  # inside the batch's open metadata version
        if batch_idx == 1:
            raise RuntimeError("out of memory (simulated)")
        return loss


def test_layers_built_in_configure_model_are_found(tmp_path: Path) -> None:
    module = LateModule()
    callback = SequenceMetadataCallback(layers="blocks")
    _trainer(tmp_path, callback).fit(module, train_dataloaders=_loader(_batches([(2, 8), (1, 5)])))
    assert module.batches == [(1, 2), (1, 2)] and callback.cache.stats["builds"] == 2


def test_a_fit_that_raises_leaves_no_open_cache_and_no_hooks(tmp_path: Path) -> None:
    """Lightning skips teardown when fit raises; an open cache would serve that batch's metadata to every later
    forward of the model in this process."""
    module = FailingModule(n_layers=2)
    callback = SequenceMetadataCallback()
    with pytest.raises(RuntimeError, match="out of memory"):
        _trainer(tmp_path, callback).fit(module, train_dataloaders=_loader(_batches([(2, 8)] * 3)))
    assert active_cache() is None and not callback.cache.is_open
    assert all(not block._forward_pre_hooks for block in module.blocks)
    (other,) = _batches([(1, 5)], seed=3)
    with SequenceMetadataCache().batch(other):  # the model works on another batch afterwards
        module(other.input_ids)


def test_gradient_accumulation_and_validate_modes(tmp_path: Path) -> None:
    for validate in ("every_layer", "off"):
        module = TinyModule(n_layers=4)
        callback = SequenceMetadataCallback(validate=validate, layers="blocks")
        train = _batches([(2, 8)] * 4 + [(3, 5)] * 2, seed=2)
        trainer = _trainer(tmp_path, callback, accumulate_grad_batches=2, limit_val_batches=0)
        trainer.fit(module, train_dataloaders=_loader(train))
        assert module.batches == [(1, 4)] * len(train)
        assert callback.cache.stats["builds"] == len(train)
        if validate == "every_layer":
            # each of the 3 later layers checks, plus the first layer's get and every layer's own get
            assert callback.cache.stats["checks"] == len(train) * (3 + 1 + 4)


def test_position_ids_fallback_from_first_layer(tmp_path: Path) -> None:
    module = TinyModule(n_layers=2)
    callback = SequenceMetadataCallback(layers=module.blocks)
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]])
    batches = [(torch.randint(0, 256, (2, 5)), pos), (torch.randint(0, 256, (1, 4)), torch.tensor([[0, 1, 0, 1]]))]
    trainer = _trainer(tmp_path, callback, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    assert module.batches == [(1, 2), (1, 2)]
    assert callback.cache.stats["builds"] == 2


def test_every_layer_check_catches_a_mismatched_layer() -> None:
    module = TinyModule(n_layers=3)
    callback = SequenceMetadataCallback(validate="every_layer")
    (batch,) = _batches([(2, 8)])
    callback.on_train_batch_start(None, module, batch, 0)  # type: ignore[arg-type]  # installs the hooks
    x = module.embed(batch.input_ids)
    module.blocks[0](x)
    with pytest.raises(MetadataError, match=r"hidden: holds 8 tokens .* describes 16"):
        module.blocks[1](x[:1])
    callback.teardown(None, module, "fit")  # type: ignore[arg-type]
    assert not module.blocks[1]._forward_pre_hooks and not callback.cache.is_open


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match=r"validate: must be one of"):
        SequenceMetadataCallback(validate="sometimes")  # type: ignore[arg-type]
    plain = L.LightningModule()
    plain.net = nn.Linear(2, 2)
    (batch,) = _batches([(1, 4)])
    # raised at the first batch, before any forward (layers built in configure_model exist by then)
    with pytest.raises(ConfigError, match=r"layers: no nn.ModuleList of identical blocks"):
        SequenceMetadataCallback().on_train_batch_start(None, plain, batch, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"layers: TinyModule has no attribute path 'model.layers'"):
        SequenceMetadataCallback(layers="model.layers").on_train_batch_start(None, TinyModule(), batch, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"layers: expected a module list"):
        SequenceMetadataCallback(layers="head").on_train_batch_start(None, TinyModule(), batch, 0)  # type: ignore[arg-type]
    assert active_cache() is None


def test_default_finds_largest_identical_module_list() -> None:
    module = TinyModule(n_layers=3)
    module.mixed = nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU()])  # larger, not identical
    module.small = nn.ModuleList([nn.Linear(2, 2)])
    callback = SequenceMetadataCallback()
    (batch,) = _batches([(1, 4)])
    callback.on_train_batch_start(None, module, batch, 0)  # type: ignore[arg-type]
    assert module.blocks[0]._forward_pre_hooks and not module.small[0]._forward_pre_hooks
    callback.teardown(None, module, "fit")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the reference model (MoEGPT)

models = pytest.importorskip("lightning_llmfast.models")


def _tiny_config(n_layers: int, attention_metadata: str = "cached"):
    return models.MoEGPTConfig(
        hidden_size=16,
        n_layers=n_layers,
        n_heads=2,
        n_kv_heads=1,
        ffn_size=16,
        num_experts=2,
        top_k=1,
        attention_metadata=attention_metadata,
        router_backend="torch",
    )


@pytest.mark.parametrize("n_layers", [2, 8, 32])
def test_reference_model_builds_once_per_step(tmp_path: Path, n_layers: int) -> None:
    module = models.MoEGPTLightningModule(_tiny_config(n_layers), warmup_steps=1)
    callback = SequenceMetadataCallback()
    train = _batches([(2, 16), (1, 16), (2, 12)], seed=n_layers)
    trainer = _trainer(tmp_path, callback, limit_val_batches=0)
    builds = []
    original_end = callback.cache.end

    def spy_end() -> None:
        builds.append(callback.builds_last_batch)
        original_end()

    callback.cache.end = spy_end  # type: ignore[method-assign]
    trainer.fit(module, train_dataloaders=_loader(train))
    assert builds[: len(train)] == [1] * len(train)
    assert callback.cache.stats["hits"] >= len(train) * n_layers  # every layer reused the first layer's build


def _forward_backward(model, batch) -> None:
    logits = model(batch.input_ids, batch.position_ids)
    nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).backward()


@pytest.mark.parametrize("n_layers", [2, 5])
def test_reference_model_sync_counts_cached_vs_per_layer(n_layers: int) -> None:
    (batch,) = _batches([(2, 16)], seed=n_layers)
    cached = models.MoEGPT(_tiny_config(n_layers, "cached"))  # with the sync-free "torch" router
    per_layer = models.MoEGPT(_tiny_config(n_layers, "per_layer"))
    per_layer.load_state_dict(cached.state_dict())
    callback = SequenceMetadataCallback()
    callback.on_train_batch_start(None, cached, batch, 0)  # type: ignore[arg-type]
    with SyncCounter(host=batch.cu_seqlens_cpu) as cached_syncs:  # the collator's host copy
        _forward_backward(cached, batch)
    with SyncCounter() as per_layer_syncs:
        _forward_backward(per_layer, batch)
    callback.teardown(None, cached, "fit")  # type: ignore[arg-type]
    # Forward and backward of the whole cached model: not one host sync.
    assert cached_syncs.num_syncs == 0, cached_syncs.syncs
    assert callback.cache.stats["builds"] == 1
    assert per_layer_syncs.counts["_local_scalar_dense"] >= n_layers
    assert per_layer_syncs.counts["nonzero"] >= n_layers


def test_layers_of_another_type_name_the_argument() -> None:
    (batch,) = _batches([(1, 4)])
    with pytest.raises(ConfigError, match="layers: expected a module list, an attribute path or None, got 5"):
        SequenceMetadataCallback(layers=5).on_train_batch_start(None, TinyModule(), batch, 0)  # type: ignore[arg-type]
