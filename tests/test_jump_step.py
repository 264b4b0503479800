"""A jump that started inside the history the first judged step compares with is named at its own step.

``loss_spike`` and ``exploding_grad`` wait for MIN_HISTORY checked steps before they judge a spike. A jump
that started before that (a loss weighted 1000x from step 15) is found at the first judged step (20); the
finding is still reported when it was before, but its words and ``data["since"]`` name the step the jump
started.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from helpers import plain_console
from torch import nn

import gradwatch
from gradwatch.checks import exploding, loss_spike
from gradwatch.core.config import Config
from gradwatch.core.findings import Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats


def _run(module: ModuleType, steps: list[StepStats]) -> list[Finding]:
    """check, remember, record: the engine's order for one check."""
    config, found = Config(), []
    history = History(window=config.window)
    for stats in steps:
        found += module.check(stats, history, config)
        module.remember(stats, history)
        history.record(stats, skipped=False)
    return found


def _norm_step(step: int, norm: float) -> StepStats:
    return StepStats(
        step=step, names=["enc.weight", "head.weight"], modules=["enc", "head"], norms=[norm, norm / 10],
        total_norm=math.hypot(norm, norm / 10),
    )


def _loss_step(step: int, loss: float) -> StepStats:
    return StepStats(step=step, names=["w"], norms=[1.0], total_norm=1.0, loss=loss)


def _quiet(s: int) -> float:
    return 1.0 + 0.1 * (s % 3)


def test_a_plain_loop_whose_loss_is_weighted_1000x_from_step_15_names_step_15() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=5e-4)
    with gradwatch.watch(net, opt, console=plain_console()) as gw:
        for step in range(30):
            xb, yb = x[step * 8 : step * 8 + 8], y[step * 8 : step * 8 + 8]
            loss = F.mse_loss(net(xb), yb) * (1000.0 if step >= 15 else 1.0)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (spike,) = [f for f in gw.findings if f.kind == "loss_spike"]
    assert spike.step == 20 and spike.data["since"] == 15  # reported when it was; names where the jump began
    assert spike.explanation is not None and spike.explanation.what.startswith("Loss spike at step 15:")
    assert "over the 15 checked steps before" in spike.explanation.what
    (grad,) = [f for f in gw.findings if f.kind == "exploding_grad"]
    assert grad.step == 23 and grad.data["since"] == 15
    assert grad.explanation is not None and "jumped at step 15 to" in grad.explanation.what
    assert "over the 15 checked steps before" in grad.explanation.what


def test_a_norm_beyond_the_runs_range_at_the_first_judged_step_names_where_its_jump_started() -> None:
    norms = [_quiet(s) for s in range(15)] + [100.0] * 5 + [1e4]
    (f,) = _run(exploding, [_norm_step(s, v) for s, v in enumerate(norms)])
    assert (f.step, f.data["reasons"], f.data["since"]) == (20, ["spike"], 15)
    assert f.explanation is not None and "jumped at step 15 to 100" in f.explanation.what
    assert f.data["median_norm"] < 2.0  # the median of the steps before the jump, not of a window holding it


def test_a_loss_spike_that_waited_to_fall_back_names_where_its_jump_started() -> None:
    losses = [1.0 if s % 2 else 1.2 for s in range(18)] + [100.0, 100.0] + [150.0] * 5
    (f,) = _run(loss_spike, [_loss_step(s, v) for s, v in enumerate(losses)])
    assert f.step > 20 and f.data["since"] == 18
    assert f.explanation is not None and f.explanation.what.startswith("Loss spike at step 18: the loss rose to 100")


def test_a_jump_at_the_first_judged_step_itself_is_named_at_that_step() -> None:
    norms = [_quiet(s) for s in range(20)] + [1e4]
    (f,) = _run(exploding, [_norm_step(s, v) for s, v in enumerate(norms)])
    assert f.step == 20 and "since" not in f.data
    losses = [1.0 if s % 2 else 1.2 for s in range(20)] + [100.0]
    (f,) = _run(loss_spike, [_loss_step(s, v) for s, v in enumerate(losses)])
    assert f.step == 20 and "since" not in f.data and f.explanation is not None
    assert f.explanation.what.startswith("Loss spike at step 20: the loss is 100")
