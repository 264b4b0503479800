"""An exception that leaves the watched loop while the step's inputs or the model's outputs hold NaN/Inf:
a nonfinite_input finding names them, and the exception propagates unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import lightning_namespace
from torch import nn

import gradwatch


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid())


def _batch(step: int, nan_at: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 4, generator=g)
    if step == nan_at:
        x[5, 2] = float("nan")  # one missing value in the batch
    return x, (x[:, :1] > 0).float()


def test_nan_batch_that_makes_bce_loss_raise_in_the_forward_is_named() -> None:
    model = _classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watched = gradwatch.watch(model, opt, console=False)
    with pytest.raises(RuntimeError, match="between 0 and 1") as raised, watched as gw:
        for step in range(6):
            x, y = _batch(step, nan_at=3)
            loss = nn.functional.binary_cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert type(raised.value) is RuntimeError and "between 0 and 1" in str(raised.value)  # unchanged
    (f,) = [f for f in gw.findings if f.kind == "nonfinite_input"]
    assert f.step == 3 and f.data["inputs"][0]["nan"] == 1
    assert "RuntimeError" in f.message and "between 0 and 1" in f.message


def test_model_output_made_nan_by_the_weights_is_named_when_the_loss_raises() -> None:
    model = _classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="between 0 and 1"), gradwatch.watch(model, opt, console=False) as gw:
        for step in range(6):
            x, y = _batch(step, nan_at=None)
            if step == 3:
                with torch.no_grad():
                    model[2].bias.fill_(float("nan"))  # the weights, not the batch
            loss = nn.functional.binary_cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "nonfinite_input"]
    assert f.step == 3 and f.data["outputs"] and not f.data["inputs"]


def test_an_exception_with_finite_data_adds_no_nonfinite_input() -> None:
    model = _classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="user's own"), gradwatch.watch(model, opt, console=False) as gw:
        for step in range(6):
            x, y = _batch(step, nan_at=None)
            loss = nn.functional.binary_cross_entropy(model(x), y)
            if step == 3:
                raise ValueError("user's own")
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [f.kind for f in gw.findings] == []


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_fit_whose_nan_batch_makes_bce_loss_raise_is_named(namespace: str) -> None:
    pl = lightning_namespace(namespace)
    from gradwatch.lightning import GradWatchCallback

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _classifier()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.binary_cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    batches = [_batch(step, nan_at=3) for step in range(6)]
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    data = torch.utils.data.DataLoader(dataset, batch_size=16)
    cb = GradWatchCallback(console=False)
    trainer = pl.Trainer(max_steps=6, callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with pytest.raises(RuntimeError, match="between 0 and 1"):
        trainer.fit(Classifier(), train_dataloaders=data)
    (f,) = [f for f in cb.findings if f.kind == "nonfinite_input"]
    assert f.step == 3
