"""frozen_param_updated: parameters frozen with requires_grad_(False) that a real optimizer still moves."""

from __future__ import annotations

import torch
from _check_steps import run
from torch import nn

from gradwatch.checks import frozen_update
from gradwatch.core.stats import StepStats


def _frozen_after_one_step(opt_class: type, **kwargs: float) -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    opt = opt_class(layer.parameters(), lr=0.1, **kwargs)
    layer(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # keeps zero gradient tensors in place
    layer.weight.requires_grad_(False)
    return layer, opt


def _steps(layer: nn.Linear, opt: torch.optim.Optimizer) -> list[StepStats]:
    extra = {"params": [layer.weight, layer.bias], "optimizer": opt}
    return [StepStats(step=s, names=["weight", "bias"], modules=["", ""], extra=extra) for s in (1, 2)]


def test_a_frozen_weight_with_momentum_is_flagged_once() -> None:
    layer, opt = _frozen_after_one_step(torch.optim.SGD, momentum=0.9)
    found = run(frozen_update, _steps(layer, opt))
    assert [(f.kind, f.step, f.params) for f in found] == [("frozen_param_updated", 1, ("weight",))]
    assert found[0].data["causes"] == ["momentum"] and "set_to_none=True" in found[0].fix


def test_weight_decay_alone_moves_a_frozen_weight() -> None:
    layer, opt = _frozen_after_one_step(torch.optim.SGD, weight_decay=0.1)
    (f,) = run(frozen_update, _steps(layer, opt))
    assert f.data["causes"] == ["weight decay"]


def test_a_frozen_weight_plain_sgd_does_not_move_is_not_flagged() -> None:
    layer, opt = _frozen_after_one_step(torch.optim.SGD)
    assert run(frozen_update, _steps(layer, opt)) == []


def test_nothing_frozen_is_not_flagged() -> None:
    layer, opt = _frozen_after_one_step(torch.optim.Adam)
    layer.weight.requires_grad_(True)
    assert run(frozen_update, _steps(layer, opt)) == []
