"""A float16 overflow born in the forward pass on every step: the scaler drops every update, no check ever runs,
and the persistent-overflow report still names the op, module and line where the overflow is born."""

from __future__ import annotations

import pytest
import torch
from helpers import kinds, plain_console
from torch import nn

import gradwatch

if not hasattr(torch.amp, "GradScaler"):
    pytest.skip("torch.amp.GradScaler is needed", allow_module_level=True)


class ExpNet(nn.Module):
    """exp(20 * x) overflows float16 (above exp(11)) for any input of this scale, on every step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.exp(self.lin(x) * 20))


class TanhNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)))


def run(model: nn.Module, steps: int, init_scale: float = 2.0**16) -> gradwatch.Watcher:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    with gradwatch.watch(model, opt, console=plain_console(), scaler=scaler) as gw:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g) * 3, torch.randn(16, 1, generator=g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x).float() - y) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return gw


# 30 steps: localized at the forward after the persistent overflow is found; 17: the run ends first (at close).
@pytest.mark.parametrize("steps", [30, 17])
def test_overflow_on_every_step_names_the_op_and_module(steps: int) -> None:
    torch.manual_seed(0)
    gw = run(ExpNet(), steps)
    found = kinds(gw)
    assert ("amp_overflow_persistent", 16) in found
    origin = [f for f in gw.findings if f.kind == "nan_origin"]
    assert len(origin) == 1, found
    f = origin[0]
    assert f.step == 16
    assert f.data["op"] == "ExpBackward0"
    assert "torch.exp" in (f.data.get("code") or "") + f.explanation.what
    assert "autocast" in f.explanation.fix and "float32" in f.explanation.fix
    assert f.data["module"] == "<root>"


def test_healthy_amp_run_with_early_overflows_localizes_nothing() -> None:
    torch.manual_seed(0)
    model = TanhNet()
    gw = run(model, 30, init_scale=2.0**24)
    found = kinds(gw)
    assert ("amp_overflow", 0) in found  # the scaler finding its scale
    assert not [k for k, _ in found if k in ("nan_origin", "amp_overflow_persistent", "nonfinite_loss")], found
    assert not model._forward_pre_hooks  # nothing left behind, nothing added on the way
