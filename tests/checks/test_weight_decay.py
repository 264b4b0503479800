"""weight_decay_too_large: lr * weight_decay of 1 or more, on real optimizers."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from _check_steps import run
from torch import nn

from gradwatch.checks import weight_decay
from gradwatch.core.stats import StepStats


def _steps(opt: torch.optim.Optimizer, n: int = 3) -> list[StepStats]:
    return [StepStats(step=s, names=["weight", "bias"], extra={"optimizer": opt}) for s in range(n)]


def test_a_weight_decay_typo_in_sgd_is_flagged_once() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, weight_decay=5e2)
    found = run(weight_decay, _steps(opt))
    assert [(f.kind, f.step) for f in found] == [("weight_decay_too_large", 0)]
    assert found[0].data["weight_decay"] == 5e2 and "5e2 for 5e-4" in found[0].fix


def test_a_warm_up_that_crosses_the_limit_later_is_flagged_when_it_does() -> None:
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1e-3, weight_decay=10.0)

    def steps() -> Iterator[StepStats]:
        for s in range(4):
            if s == 2:
                opt.param_groups[0]["lr"] = 0.2  # the warm-up writes the group's lr: 0.2 * 10 >= 1
            yield StepStats(step=s, names=["weight", "bias"], extra={"optimizer": opt})

    assert [f.step for f in run(weight_decay, steps())] == [2]


def test_usual_weight_decay_is_not_flagged() -> None:
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    assert run(weight_decay, _steps(opt)) == []


def test_coupled_l2_of_adam_is_not_flagged() -> None:
    # Adam's weight decay is added to the gradient and normalized with it: no multiplicative shrink.
    opt = torch.optim.Adam(nn.Linear(2, 2).parameters(), lr=1.0, weight_decay=5.0)
    assert run(weight_decay, _steps(opt)) == []
