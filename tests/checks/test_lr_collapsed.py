"""``lr_collapsed``: every learning rate fell to nothing while the run goes on (a per-epoch scheduler per batch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.checks.lr_collapsed import EVERY, STEPS


def _run(make_sched: Any, steps: int, groups: str = "one") -> list[gradwatch.Finding]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if groups == "frozen_group":  # a group kept at lr=0 on purpose, next to a live one
        params: Any = [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters()}]
    else:
        params = model.parameters()
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    sched = make_sched(opt)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(steps):
            x = torch.randn(16, 8, generator=g)
            loss = nn.functional.mse_loss(model(x), x[:, :1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
    return gw.findings


def test_an_epoch_scheduler_stepped_every_batch_is_reported_once_when_every_update_is_nothing() -> None:
    # StepLR(step_size=20, gamma=0.05) called per batch: 0.05 * 0.05**8 = 2e-12 < 1e-10 * 0.05 from step 160 on
    # (0.05 * 0.05**7 = 4e-11 before it: well above). Looked at every EVERY-th step: STEPS // EVERY looks from 160.
    found = _run(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=20, gamma=0.05), 160 + STEPS + 60)
    (f,) = [f for f in found if f.kind == "lr_collapsed"]
    assert (f.severity, f.step, f.data["since"]) == ("warning", 160 + STEPS - EVERY, 160)
    assert "per batch" in f.message and "once per epoch" in f.fix


@pytest.mark.parametrize(
    "schedule",
    ["cosine_to_zero_over_the_run", "one_cycle", "warmup_then_constant", "frozen_group", "plateau", "none"],
)
def test_schedules_that_keep_training_are_not_reported(schedule: str) -> None:
    steps = 400
    make: dict[str, Any] = {
        "cosine_to_zero_over_the_run": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps),
        "one_cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=steps),
        "warmup_then_constant": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1e-3, total_iters=50),
        "frozen_group": lambda o: None,
        "plateau": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=100, gamma=0.1),  # 3 drops: 1e-3 of it
        "none": lambda o: None,
    }
    found = _run(make[schedule], steps, groups="frozen_group" if schedule == "frozen_group" else "one")
    assert "lr_collapsed" not in [f.kind for f in found]
