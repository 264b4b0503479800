"""Walks of the captured step's graph."""

from __future__ import annotations

import torch
from torch import nn

from gradwatch.diagnose.capture import Call
from gradwatch.diagnose.graph_walk import graph_leaves, loss_ops, unowned_params


def _call(model: nn.Module, x: torch.Tensor) -> tuple[Call, torch.Tensor]:
    call = Call((x,), {}, None)
    out = model(x)
    call.nodes, call.node_index = (out.grad_fn,), (0,)
    return call, out


def test_graph_leaves_are_the_parameters_the_output_came_from() -> None:
    model = nn.Linear(2, 1)
    call, _out = _call(model, torch.ones(3, 2))
    leaves = graph_leaves([call]) or []
    assert {id(t) for t in leaves} == {id(p) for p in model.parameters()}
    assert graph_leaves([]) is None


def test_unowned_params_are_parameters_the_model_does_not_know() -> None:
    model = nn.Linear(2, 1)
    stray = nn.Parameter(torch.ones(1))
    call = Call((torch.ones(3, 2),), {}, None)
    out = model(call.args[0]) * stray
    call.nodes, call.node_index = (out.grad_fn,), (0,)
    assert unowned_params([call], {id(p) for p in model.parameters()}) == [stray]


def test_loss_ops_name_the_loss_codes_risky_ops_only() -> None:
    model = nn.Linear(2, 1)
    call, out = _call(model, torch.ones(3, 2))
    call.losses = [(out.exp() + 1).log().mean()]
    assert set(loss_ops([call])) == {"ExpBackward0", "LogBackward0"}
    call.losses = [out.sum()]
    assert loss_ops([call]) == []  # the walk reached the model's outputs through nothing risky
