"""``no_optimizer_step``: a run whose backward passes filled an optimizer's gradients while that optimizer never
stepped (``optimizer.step()`` forgotten; ``if (i + 1) % k == 0`` over a loader of fewer than k batches; Lightning
manual optimization without ``opt.step()``). Reported once, when the run ends normally; silent when it stepped,
when an exception ended it, and for a single backward pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import kinds, lightning_namespace, tiny_data, tiny_trainer
from torch import nn

import gradwatch
from gradwatch.lightning import GradWatchCallback


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2)


def _accumulate(model: nn.Module, opt: torch.optim.Optimizer, batches: int, k: int = 4, epochs: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(batches)]
    for _ in range(epochs):
        for i, (x, y) in enumerate(data):
            (nn.functional.mse_loss(model(x), y) / k).backward()
            if (i + 1) % k == 0:
                opt.step()
                opt.zero_grad()


def test_accumulation_window_longer_than_the_loader_never_steps() -> None:
    model, opt = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with gradwatch.watch(model, opt, console=False) as gw:
        _accumulate(model, opt, batches=3)
    assert kinds(gw) == [("no_optimizer_step", 0)]
    f = gw.findings[0]
    assert f.data["backward_passes"] == 9
    assert f.params == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert "len(loader)" in f.fix
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # what the finding says


def test_silent_when_the_loop_steps() -> None:
    model, opt = _model()
    with gradwatch.watch(model, opt, console=False) as gw:
        _accumulate(model, opt, batches=8)
    assert kinds(gw) == []


def test_silent_when_an_exception_ends_the_run_before_the_first_step() -> None:
    model, opt = _model()
    with pytest.raises(KeyboardInterrupt), gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(3):
            model(torch.randn(4, 6)).pow(2).mean().backward()
        raise KeyboardInterrupt
    assert kinds(gw) == []


def test_silent_for_one_backward_pass() -> None:
    model, opt = _model()
    with gradwatch.watch(model, opt, console=False) as gw:
        model(torch.randn(4, 6)).pow(2).mean().backward()
    assert kinds(gw) == []


def test_names_only_the_optimizer_that_never_stepped() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    body, head = torch.optim.SGD(model[0].parameters(), lr=1e-2), torch.optim.SGD(model[2].parameters(), lr=1e-2)
    with gradwatch.watch(model, [body, head], console=False) as gw:
        for _ in range(4):
            body.zero_grad()
            head.zero_grad()
            model(torch.randn(4, 6)).pow(2).mean().backward()
            head.step()  # body.step() forgotten
    assert [(f.kind, f.data["optimizer"]) for f in gw.findings] == [("no_optimizer_step", 0)]


def _manual_class(ns: Any) -> type:
    class ManualAccumulation(ns.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            self.manual_backward(nn.functional.mse_loss(self.layer(batch[0]), batch[1]) / 8)
            if (batch_idx + 1) % 8 == 0:  # an epoch has 3 batches: never holds
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return ManualAccumulation


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_manual_accumulation_that_never_steps(namespace: str) -> None:
    ns = lightning_namespace(namespace)
    cb = GradWatchCallback(console=False)
    tiny_trainer(ns, [cb], max_steps=-1, max_epochs=2).fit(_manual_class(ns)(), tiny_data(n=24))
    assert kinds(cb) == [("no_optimizer_step", 0)]
    assert "num_training_batches" in cb.findings[0].fix
