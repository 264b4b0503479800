"""vanishing_grad: a layer orders of magnitude below ``vanishing_ratio`` is reported within a few checked
steps; layers whose tiny gradients are legitimate (a bias feeding a BatchNorm) stay quiet."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwatch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Shift(nn.Module):
    """A learned offset of its own (``x + b``), as a layer written by hand."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.b = nn.Parameter(0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b


def _train(model: nn.Module, steps: int) -> gradwatch.Watcher:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(steps):
            x = torch.randn(32, 16, generator=g)
            loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw


def _sigmoid_mlp(depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.Sigmoid()]
    return nn.Sequential(*layers, nn.Linear(16, 2))


def test_a_layer_orders_of_magnitude_below_the_ratio_is_reported_within_a_few_steps() -> None:
    # 20 sigmoid layers: the first layers' relative gradients are ~1e-11 of the typical layer's from step 0,
    # 1e7x below vanishing_ratio=1e-4; reported at the 5th checked step, not the 50th.
    gw = _train(_sigmoid_mlp(20), 12)
    found = [f for f in gw.findings if f.kind == "vanishing_grad"]
    assert found and found[0].step == 4, [(f.kind, f.step) for f in gw.findings]
    assert found[0].data["layers"][0] == "0" and "For the last 5 checked steps" in found[0].message


def test_the_fast_report_is_not_repeated_by_the_window_rule() -> None:
    gw = _train(_sigmoid_mlp(20), 60)
    layers = [layer for f in gw.findings if f.kind == "vanishing_grad" for layer in f.data["layers"]]
    assert len(layers) == len(set(layers)) and "0" in layers, [(f.kind, f.step) for f in gw.findings]


@pytest.mark.parametrize("bias", ["linear_bias", "own_layer"])
def test_a_bias_feeding_a_batchnorm_is_not_vanishing(bias: str) -> None:
    # BatchNorm subtracts the batch mean: the bias before it gets a gradient of zero up to rounding (~1e-9).
    torch.manual_seed(0)
    first: list[nn.Module] = [nn.Linear(16, 32)] if bias == "linear_bias" else [nn.Linear(16, 32, bias=False), Shift(32)]
    model = nn.Sequential(*first, nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    gw = _train(model, 60)
    assert [(f.kind, f.step) for f in gw.findings] == []
