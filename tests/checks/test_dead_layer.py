"""dead_layer: a layer whose gradient stays exactly zero while the others' does not, on constructed
statistics."""

from __future__ import annotations

import torch
from _check_steps import run
from torch import nn

from gradwatch.checks import dead_layer
from gradwatch.core.config import Config
from gradwatch.core.stats import StepStats

CONFIG = Config(dead_steps=4)


def _step(step: int, dead_norm: float = 0.0, live_norm: float = 1.0, **extra: object) -> StepStats:
    norms = [dead_norm, live_norm]
    return StepStats(
        step=step, names=["dead.weight", "live.weight"], modules=["dead", "live"], norms=norms,
        total_norm=sum(n * n for n in norms) ** 0.5, extra=dict(extra),
    )


def test_a_layer_at_zero_for_dead_steps_is_flagged_once_at_the_step_it_reaches_them() -> None:
    found = run(dead_layer, [_step(s) for s in range(10)], CONFIG)
    assert [(f.kind, f.step, f.module) for f in found] == [("dead_layer", 3, "dead")]
    assert found[0].params == ("dead.weight",) and "LeakyReLU" in found[0].fix


def test_a_layer_that_comes_back_before_dead_steps_is_not_flagged() -> None:
    steps = [_step(s, dead_norm=0.0 if s % 3 else 0.5) for s in range(10)]
    assert run(dead_layer, steps, CONFIG) == []


def test_every_layer_at_zero_is_not_a_dead_layer() -> None:
    assert run(dead_layer, [_step(s, live_norm=0.0) for s in range(10)], CONFIG) == []


def test_a_frozen_layer_with_a_stale_zero_gradient_is_not_flagged() -> None:
    # requires_grad_(False) after zero_grad(set_to_none=False) left a zero gradient: frozen on purpose
    frozen, live = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(2))
    frozen.requires_grad_(False)
    frozen.grad, live.grad = torch.zeros(2), torch.ones(2)
    assert run(dead_layer, [_step(s, params=[frozen, live]) for s in range(10)], CONFIG) == []
