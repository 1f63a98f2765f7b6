"""Token-weighted losses: plain mean without a trainer, exact step weighting under gradient accumulation."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_llmfast import DataError, causal_lm_loss, scale_by_token_share

V = 11


def _reference_mean(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token loss from the published formula, in float64, with a loop over positions."""
    flat, targets = logits.double().reshape(-1, logits.shape[-1]), labels.reshape(-1).tolist()
    terms = [torch.logsumexp(flat[i], 0) - flat[i, t] for i, t in enumerate(targets) if t != ignore_index]
    return torch.stack(terms).mean() if terms else torch.zeros((), dtype=torch.float64)


def _labels(shape: tuple[int, ...], generator: torch.Generator, ignore_share: float = 0.3) -> torch.Tensor:
    labels = torch.randint(0, V, shape, generator=generator)
    return labels.masked_fill(torch.rand(shape, generator=generator) < ignore_share, -100)


def test_without_a_trainer_it_is_the_plain_mean_over_label_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, V, generator=g, dtype=torch.float64).float().requires_grad_()
    labels = _labels((3, 7), g)
    loss = causal_lm_loss(logits, labels)
    torch.testing.assert_close(loss.double(), _reference_mean(logits.detach(), labels), rtol=1e-6, atol=1e-7)
    loss.backward()  # the gradient of a plain mean
    reference = logits.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(_reference_mean(reference, labels), [reference])
    torch.testing.assert_close(logits.grad.double(), expected, rtol=1e-5, atol=1e-7)
    # a different ignore_index, 1-D inputs, and no label at all (0, not NaN)
    row = labels[0].masked_fill(labels[0] == -100, 5)
    torch.testing.assert_close(
        causal_lm_loss(logits[0], row, ignore_index=5).double(), _reference_mean(logits[0].detach(), row, 5)
    )
    assert causal_lm_loss(logits, torch.full((3, 7), -100)).item() == 0.0
    aux = torch.tensor(0.25)
    assert scale_by_token_share(aux, labels) is aux


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: causal_lm_loss(torch.randn(2, 3, V), torch.zeros(2, 4, dtype=torch.long)), "shape"),
        (lambda: causal_lm_loss(torch.randn(2, 3, V), torch.zeros(2, 3)), "integer"),
        (lambda: causal_lm_loss(torch.zeros(2, 3, V, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)), "float"),
        (lambda: scale_by_token_share(torch.ones(2), torch.zeros(2, dtype=torch.long)), "0-d"),
        (lambda: scale_by_token_share(torch.ones(()), [1, 2]), "integer"),
    ],
)
def test_bad_inputs_raise_our_error(call: Any, match: str) -> None:
    with pytest.raises(DataError, match=match):
        call()


class _TinyLM(L.LightningModule):
    """Embedding + head; ``mode`` picks the loss: the helpers, or a naive per-micro-batch mean."""

    def __init__(self, mode: str = "weighted") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, 8)
        self.head = nn.Linear(8, V)
        self.mode = mode
        self.values: list[float] = []
        self.grads: list[list[torch.Tensor]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        input_ids, labels = batch
        logits = self.head(torch.tanh(self.embed(input_ids)))
        # a nonlinear per-micro-batch term, standing in for a router aux loss
        aux = self.head.weight.square().mean() * logits.float().mean().exp()
        if self.mode == "naive":
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()) + 0.5 * aux
        else:
            ce = causal_lm_loss(logits, labels, module=self)
            self.values.append(float(ce.detach()))
            loss = ce + 0.5 * scale_by_token_share(aux, labels, module=self)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.grads.append([p.grad.detach().clone() for p in self.parameters()])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _micro_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = []
    for i in range(n):
        rows = 2 + i % 2  # different shapes and label counts per micro-batch
        batches.append((torch.randint(0, V, (rows, 5), generator=g), _labels((rows, 5), g, 0.1 + 0.5 * (i % 2))))
    return batches


def _fit(module: _TinyLM, batches: list[Any], accumulate: int) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return trainer


def _reference_step_grads(module: _TinyLM, batches: list[Any]) -> list[torch.Tensor]:
    """sum of token-loss grads / step label tokens + 0.5 * sum_m (n_m / n) grad aux_m, in float64."""
    model = {name: p.detach().double().requires_grad_() for name, p in module.named_parameters()}
    total = sum(int((labels != -100).sum()) for _, labels in batches)
    loss = torch.zeros((), dtype=torch.float64)
    for input_ids, labels in batches:
        logits = torch.tanh(model["embed.weight"][input_ids]) @ model["head.weight"].T + model["head.bias"]
        n = int((labels != -100).sum())
        loss = loss + _reference_mean(logits, labels) * n / total
        aux = model["head.weight"].square().mean() * logits.mean().exp()
        loss = loss + 0.5 * aux * n / total
    return list(torch.autograd.grad(loss, list(model.values())))


def test_accumulation_gives_the_token_weighted_gradient_of_the_whole_step() -> None:
    batches = _micro_batches(4)
    module = _TinyLM()
    start = _TinyLM()  # the same initial weights
    _fit(module, batches, accumulate=2)
    assert len(module.grads) == 2
    # the first step's gradients: both micro-batches weighted by their label tokens, against float64
    for got, want in zip(module.grads[0], _reference_step_grads(start, batches[:2])):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    # the value (what is logged) is the first micro-batch's own mean, as without a trainer
    input_ids, labels = batches[0]
    with torch.no_grad():
        first = causal_lm_loss(start.head(torch.tanh(start.embed(input_ids))), labels)
    assert module.values[0] == pytest.approx(float(first), rel=1e-6)
    # the naive per-micro-batch mean is measurably different (the test above can fail)
    naive = _TinyLM("naive")
    _fit(naive, batches, accumulate=2)
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(naive.grads[0], module.grads[0]))
    assert diff > 1e-2


def test_accumulate_two_equals_one_step_on_both_batches_together() -> None:
    # Without the nonlinear aux term, accumulation over micro-batches equals one step on their union.
    batches = _micro_batches(6)
    pairs = [
        (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(batches[::2], batches[1::2])
    ]  # rows 2 + 3: the same token rows, in one batch

    class _NoAux(_TinyLM):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            logits = self.head(torch.tanh(self.embed(batch[0])))
            return causal_lm_loss(logits, batch[1], module=self)

    accumulated, joint = _NoAux(), _NoAux()
    _fit(accumulated, batches, accumulate=2)
    _fit(joint, pairs, accumulate=1)
    assert len(accumulated.grads) == len(joint.grads) == 3
    for a, b in zip(accumulated.parameters(), joint.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(accumulated.head.weight, _NoAux().head.weight)  # training moved the weights


def test_the_weighting_adds_no_host_sync() -> None:
    from types import SimpleNamespace

    from lightning_llmfast.bench.counters import SyncCounter
    from lightning_llmfast.modules.losses import _StepTokenWeighting

    g = torch.Generator().manual_seed(3)
    param = nn.Parameter(torch.randn(V, generator=g))
    weighting = _StepTokenWeighting()
    module = SimpleNamespace()  # stands in for the LightningModule: only the trainer's numbers are read
    trainer = SimpleNamespace(strategy=SimpleNamespace(reduce=lambda t, reduce_op: t), world_size=2,
                              accumulate_grad_batches=3)  # fmt: skip
    seen = []
    with SyncCounter() as counter:
        for _ in range(2):
            weighting.on_train_batch_start(trainer, module, None, 0)  # type: ignore[arg-type]
            seen.append(_labels((4, 5), g))
            weighting.count_micro_batch((seen[-1] != -100).sum())
            weighting.count_micro_batch((seen[-1] != -100).sum())  # a second loss of the same micro-batch
            logits = param.expand(4, 5, V)
            nn.functional.cross_entropy(logits.flatten(0, 1), seen[-1].flatten(), reduction="sum").backward()
        before = param.grad.clone()
        optimizer = SimpleNamespace(param_groups=[{"params": [param]}])
        weighting.on_before_optimizer_step(trainer, module, optimizer)  # type: ignore[arg-type]
    assert counter.num_syncs == 0, counter.syncs
    # the gradient sums are rescaled by world_size * accumulate / label tokens of the step, each counted once
    total = sum(int((labels != -100).sum()) for labels in seen)
    torch.testing.assert_close(param.grad, before * (2 * 3 / total))


def test_the_step_count_is_reduced_over_the_layouts_data_parallel_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under LLMFastStrategy the count goes through one all-reduce on ``ParallelDims.dp_group`` (a spy on
    ``torch.distributed.all_reduce`` sees it; the strategy's world-group ``reduce`` is not called), and the gradient
    factor uses the layout's data-parallel size. Torch's fake process group gives a 4-rank FSDP2 x EP(2) layout in
    this process (its all-reduce is a no-op: the total is this rank's count). The layout's "dp_shard" spans every
    rank, so torch hands out the default group for it; the spy proves which object the weighting asks for."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_llmfast.modules.losses import _StepTokenWeighting
    from lightning_llmfast.parallel import ParallelDims

    def world_reduce(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the count was reduced over the world group")

    calls: list[Any] = []
    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(
        dist, "all_reduce", lambda t, group=None, **kw: calls.append(group) or real_all_reduce(t, group=group, **kw)
    )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        dims = ParallelDims(4, "fsdp", 2)
        dims.build_mesh("cpu")
        trainer = SimpleNamespace(strategy=SimpleNamespace(parallel_dims=dims, reduce=world_reduce), world_size=4,
                                  accumulate_grad_batches=1)  # fmt: skip
        g = torch.Generator().manual_seed(4)
        param = nn.Parameter(torch.randn(V, generator=g))
        param.grad = torch.randn(V, generator=g)
        labels = _labels((3, 7), g)
        weighting = _StepTokenWeighting()
        weighting.on_train_batch_start(trainer, SimpleNamespace(), None, 0)  # type: ignore[arg-type]
        weighting.count_micro_batch((labels != -100).sum())
        before = param.grad.clone()
        optimizer = SimpleNamespace(param_groups=[{"params": [param]}])
        weighting.on_before_optimizer_step(trainer, SimpleNamespace(), optimizer)  # type: ignore[arg-type]
        assert calls == [dims.dp_group] and dist.get_world_size(dims.dp_group) == dims.dp_shard == 4
        torch.testing.assert_close(param.grad, before * (4 / int((labels != -100).sum())))
    finally:
        dist.destroy_process_group()
