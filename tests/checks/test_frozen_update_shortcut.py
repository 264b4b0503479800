"""frozen_param_updated's short path for the usual step (every parameter holding a gradient requires one: no memo,
no optimizer state read) finds what the general path does, over random layers frozen and unfrozen mid-run with
real optimizers that keep momentum, weight decay, both or neither."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from gradwatch.checks import frozen_update
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

OPTIMIZERS = [
    (torch.optim.SGD, {}),
    (torch.optim.SGD, {"momentum": 0.9}),
    (torch.optim.SGD, {"weight_decay": 0.1}),
    (torch.optim.AdamW, {}),
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("opt_class", "kwargs"), OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_the_short_path_finds_what_the_general_path_does(seed: int, opt_class: type, kwargs: dict) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = opt_class(model.parameters(), lr=0.1, **kwargs)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    history = History()
    seen = {"short": 0, "general": 0}
    for step in range(30):
        if rng.random() < 0.3:
            rng.choice(params).requires_grad_(rng.random() < 0.5)
        model(torch.randn(5, 3)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # the frozen keep a zero gradient tensor
        stats = StepStats(step=step, names=names, modules=[n.split(".")[0] for n in names],
                          extra={"params": params, "optimizer": opt})
        general = frozen_update._frozen_moved.__wrapped__(stats, history)  # type: ignore[attr-defined]
        assert frozen_update._moved(stats, history) == general
        seen["short" if all(p.requires_grad for p in params) else "general"] += 1
        frozen_update.check(stats, history, None)  # type: ignore[arg-type]
        frozen_update.remember(stats, history)
        history.record(stats, skipped=False)
    assert seen["short"] and seen["general"]
