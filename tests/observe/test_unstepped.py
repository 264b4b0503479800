"""``no_optimizer_step``: a plain loop whose gradients are cleared pass after pass and never applied."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import plain_console
from torch import nn

import gradwatch
from gradwatch.observe.unstepped import AT_CLOSE, DURING_RUN


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = _batch(i)
    return nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_loop_that_never_calls_optimizer_step_is_reported_while_it_runs(set_to_none: bool) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    before = [p.detach().clone() for p in model.parameters()]
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for i in range(DURING_RUN + 10):
            opt.zero_grad(set_to_none=set_to_none)
            _loss(model, i).backward()
            with warnings.catch_warnings():  # torch's own "lr_scheduler.step() before optimizer.step()"
                warnings.simplefilter("ignore")
                sched.step()  # in place of optimizer.step(): the classic slip
            if i == DURING_RUN:
                during = list(gw.findings)
    (f,) = during
    assert (f.kind, f.severity) == ("no_optimizer_step", "warning")
    assert f.data["cleared"] == DURING_RUN and "optimizer.step()" in f.message.split("Fix:")[1]
    assert [g.kind for g in gw.findings] == ["no_optimizer_step"]  # once
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # gradwatch changed nothing


def test_a_short_run_without_any_update_is_reported_at_close() -> None:
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for i in range(AT_CLOSE + 2):
            opt.zero_grad()
            _loss(model, i).backward()
        assert not gw.findings
    assert [f.kind for f in gw.findings] == ["no_optimizer_step"]


def _attack_then_step(model: nn.Module, opt: torch.optim.Optimizer, i: int, attack_steps: int) -> None:
    """Adversarial training with ``loss.backward()`` attack steps: gradients computed and cleared, then one update."""
    x, y = _batch(i)
    delta = torch.zeros_like(x, requires_grad=True)
    for _ in range(attack_steps):
        nn.functional.mse_loss(model(x + delta), y).backward()
        with torch.no_grad():
            delta += 0.01 * delta.grad.sign()
        delta.grad = None
        model.zero_grad()
    opt.zero_grad()
    nn.functional.mse_loss(model(x + delta.detach()), y).backward()
    opt.step()


@pytest.mark.parametrize(
    "loop",
    ["accumulation", "accumulation_no_step_at_close", "adversarial", "lbfgs", "saliency_after_training"],
)
def test_loops_that_step_or_accumulate_are_not_reported(loop: str) -> None:
    model = _net()
    opt: Any = torch.optim.LBFGS(model.parameters(), max_iter=20) if loop == "lbfgs" else torch.optim.SGD(
        model.parameters(), lr=0.01
    )
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        if loop.startswith("accumulation"):
            passes = DURING_RUN + 20 if loop == "accumulation" else AT_CLOSE + 4
            for i in range(passes):  # one long accumulation window (full-batch gradient descent)
                (_loss(model, i) / passes).backward()
            if loop == "accumulation":
                opt.step()
                opt.zero_grad()
        elif loop == "adversarial":
            for i in range(20):
                _attack_then_step(model, opt, i, attack_steps=10)
        elif loop == "lbfgs":
            for i in range(5):

                def closure(i: int = i) -> torch.Tensor:
                    opt.zero_grad()
                    loss = _loss(model, i)
                    loss.backward()
                    return loss

                opt.step(closure)  # up to 20 evaluations, each cleared, inside the first step
        else:
            for i in range(10):
                opt.zero_grad()
                _loss(model, i).backward()
                opt.step()
            model.eval()
            for i in range(DURING_RUN + 10):  # saliency maps of a trained model: gradients on purpose
                x, y = _batch(i)
                x.requires_grad_(True)
                nn.functional.mse_loss(model(x), y).backward()
                model.zero_grad()
    assert "no_optimizer_step" not in [f.kind for f in gw.findings]


def test_a_scaler_that_drops_every_update_is_not_called_a_forgotten_step() -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # every update overflows for ~90 steps
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for i in range(DURING_RUN + 10):
            x, y = _batch(i)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    found = [f.kind for f in gw.findings]
    assert "no_optimizer_step" not in found and "amp_overflow_persistent" in found
