"""GroupedRouterMixin (block swap from configure_model), register_moe_adapter, and ExpertLoadMonitor in a Trainer."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_llmfast import ExpertLoadMonitor, GroupedRouterMixin, RoutingError, register_moe_adapter
from lightning_llmfast.errors import ConfigError
from lightning_llmfast.moe import MoEBlock, MoEConfig, NaiveMoEBlock

H = 8


class UnknownSparseMoeBlock(nn.Module):
    """Looks like an MoE block (experts + gate) but has no adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, 2, bias=False)
        self.experts = nn.ModuleList([nn.Linear(H, H) for _ in range(2)])

    def forward(self, x: Tensor) -> Tensor:
        return x


class Module(GroupedRouterMixin, L.LightningModule):
    def __init__(self, num_layers: int = 2, unknown: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([NaiveMoEBlock(H, 12, 4, 2) for _ in range(num_layers)])
        self.head = nn.Sequential(nn.Linear(H, H), NaiveMoEBlock(H, 12, 3, 1))  # nested one level deeper
        self.extra = UnknownSparseMoeBlock() if unknown else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.extra(self.head(x))

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_swap_count_parameters_outputs_and_idempotence() -> None:
    module = Module()
    x = torch.randn(2, 5, H)
    before = module(x)
    state = module.state_dict()
    params = dict(module.named_parameters())
    assert module.swap_moe_blocks(backend="torch") == 3
    assert all(isinstance(m, MoEBlock) for m in [*module.layers, module.head[1]])
    assert list(module.state_dict()) == list(state)
    assert all(p is params[n] for n, p in module.named_parameters())
    torch.testing.assert_close(module(x), before, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for our own (already grouped) blocks either
        assert module.swap_moe_blocks() == 0


def test_unknown_moe_block_warns_with_its_class() -> None:
    module = Module(num_layers=1, unknown=True)
    with pytest.warns(UserWarning, match=r"UnknownSparseMoeBlock at 'extra'"):
        assert module.swap_moe_blocks() == 2
    assert isinstance(module.extra, UnknownSparseMoeBlock)


def test_bad_backend_raises() -> None:
    with pytest.raises(ConfigError, match="backend"):
        Module().swap_moe_blocks(backend="cuda")


def test_register_moe_adapter_for_a_user_class() -> None:
    class MyMoE(NaiveMoEBlock):  # a subclass: matched through the naive adapter too, unless it has its own
        pass

    calls = []

    def adapter(block: nn.Module, backend: str = "auto") -> nn.Module:
        calls.append(backend)
        grouped = MoEBlock(
            MoEConfig.build(block.hidden_size, block.ffn_size, block.num_experts, block.top_k, backend=backend)
        )
        grouped.router, grouped.experts.gate_up_proj = block.router, block.experts.gate_up_proj
        grouped.experts.down_proj = block.experts.down_proj
        return grouped

    module = Module(num_layers=1)
    module.layers[0] = MyMoE(H, 12, 4, 2)
    register_moe_adapter(MyMoE, adapter)
    assert module.swap_moe_blocks(backend="torch") == 2
    assert calls == ["torch"]

    class OneArg(NaiveMoEBlock):
        pass

    module.layers[0] = OneArg(H, 12, 4, 2)
    register_moe_adapter(OneArg, lambda block: adapter(block, backend="auto"))  # plain adapter(block) works too
    assert module.swap_moe_blocks() == 1
    assert calls == ["torch", "auto"] and isinstance(module.layers[0], MoEBlock)
    with pytest.raises(ConfigError, match="block_class"):
        register_moe_adapter(object, adapter)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="adapter"):
        register_moe_adapter(MyMoE, "not callable")  # type: ignore[arg-type]


def _fit(module: L.LightningModule, data: Tensor, monitor: ExpertLoadMonitor, tmp_path: object) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[monitor],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=4))
    return trainer


def test_fit_swaps_in_configure_model_and_monitor_logs(tmp_path: object) -> None:
    module = Module()
    trainer = _fit(module, torch.randn(8, 3, H), ExpertLoadMonitor(), tmp_path)
    assert isinstance(module.layers[0], MoEBlock)
    metrics = trainer.callback_metrics
    assert {"moe/load_imbalance", "moe/dropped_fraction", "moe/load_entropy"} <= set(metrics)
    assert 1.0 <= float(metrics["moe/load_imbalance"]) <= 4.0
    assert float(metrics["moe/dropped_fraction"]) == 0.0
    assert 0.0 < float(metrics["moe/load_entropy"]) <= float(torch.log(torch.tensor(4.0)))


def test_monitor_raises_for_nonfinite_router_logits(tmp_path: object) -> None:
    data = torch.randn(8, 3, H)
    data[5, 1, 0] = float("nan")  # second batch
    with pytest.raises(RoutingError, match=r"layers\.0"):
        _fit(Module(), data, ExpertLoadMonitor(log_every_n_steps=2), tmp_path)


@pytest.mark.parametrize("period", [0, -1, 1.5, "5", True])
def test_monitor_rejects_bad_period(period: object) -> None:
    with pytest.raises(ConfigError, match=rf"log_every_n_steps must be an int >= 1, got {period!r}"):
        ExpertLoadMonitor(log_every_n_steps=period)
