"""``clip_before_unscale``: ``clip_grad_norm_`` called on gradients a GradScaler still scales."""

from __future__ import annotations

import pytest
import torch
from helpers import plain_console
from torch import nn

import gradwatch


def _run(order: str, max_norm: float = 1.0, steps: int = 12, fused: bool = False) -> list[gradwatch.Finding]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    # A fused optimizer unscales inside its own step (the scaler hands it the scale): no unscale stage to read.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused else torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=order != "no-scaler")
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(32, 16, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), x[:, :1] * 2)
            opt.zero_grad()
            scaler.scale(loss).backward()
            if order == "clip-then-unscale":
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                scaler.unscale_(opt)
            elif order == "clip-scaled":  # scaler.step() unscales afterwards
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            elif order in ("unscale-then-clip", "no-scaler"):
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            elif order == "unscale-then-clip-value":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            scaler.step(opt)
            scaler.update()
    return gw.findings


@pytest.mark.parametrize(("order", "fused"), [("clip-scaled", False), ("clip-then-unscale", False), ("clip-scaled", True)])
def test_clipping_before_unscaling_is_reported_once_with_the_order_that_fixes_it(order: str, fused: bool) -> None:
    found = [f for f in _run(order, fused=fused) if f.kind == "clip_before_unscale"]
    (f,) = found
    assert (f.severity, f.step) == ("warning", 0)
    assert f.data["scale"] == 65536.0 and 0.5 < f.data["max_norm"] < 2.0  # the max_norm=1.0 the loop set
    assert f.data["update_grad_norm"] < 1e-4
    assert "scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_" in f.message.split("Fix:")[1]


@pytest.mark.parametrize(
    ("order", "max_norm"),
    [
        ("unscale-then-clip", 1.0),
        ("unscale-then-clip", 0.05),  # clips every step, to a small but usual max_norm
        ("unscale-then-clip-value", 1.0),
        ("no-scaler", 1.0),
        ("none", 1.0),
        ("clip-scaled", 1e12),  # in the wrong place but never clips: harmless
    ],
)
def test_clipping_the_unscaled_gradients_is_not_reported(order: str, max_norm: float) -> None:
    assert "clip_before_unscale" not in [f.kind for f in _run(order, max_norm)]


@pytest.mark.parametrize("order", ["unscale-then-clip", "none"])
def test_a_fused_optimizer_whose_gradients_were_unscaled_before_clipping_is_not_reported(order: str) -> None:
    assert "clip_before_unscale" not in [f.kind for f in _run(order, fused=True)]
