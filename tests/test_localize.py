"""Localizing a non-finite birth: the pure decisions on read-back summaries, and one real recording.

A summary is ``[has_nan, has_inf, min_abs, max_abs, min, max]``; ops are ``(intended, inputs, outputs)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gradwatch.diagnose.birth import absorbed, first_bad_module, first_birth, first_seen, forward_finite, last_finite
from gradwatch.diagnose.localize import Localizer, Site

FINITE = [0.0, 0.0, 0.5, 2.0, -2.0, 2.0]
NAN = [1.0, 0.0, 0.0, 1.0, -1.0, 1.0]
INF = [0.0, 1.0, 0.0, math.inf, 0.0, math.inf]
NEG_INF = [0.0, 1.0, 0.0, math.inf, -math.inf, 1.0]


def test_first_birth_is_the_first_op_going_non_finite_from_finite_inputs() -> None:
    ops = [(False, FINITE, FINITE), (False, FINITE, INF), (False, INF, NAN)]
    assert first_birth(ops) == 1


def test_first_birth_skips_an_intended_mask_and_finds_the_nan_it_makes() -> None:
    # masked_fill(-inf), then softmax over a fully masked row: the NaN is born in the softmax.
    ops = [(True, FINITE, NEG_INF), (False, NEG_INF, NAN)]
    assert first_birth(ops, ["Tensor.masked_fill", "torch.softmax"]) == 1


def test_first_birth_blames_an_explicit_inf_given_to_an_op_that_is_no_mask() -> None:
    ops = [(True, FINITE, INF), (False, INF, NAN)]
    assert first_birth(ops, ["Tensor.mul", "torch.sub"]) == 0


def test_first_birth_without_names_blames_the_nan_not_the_explicit_inf() -> None:
    ops = [(True, FINITE, INF), (False, INF, NAN)]
    assert first_birth(ops) == 1


def test_first_birth_names_a_sentinel_that_reached_the_loss() -> None:
    ops = [(False, FINITE, FINITE), (True, FINITE, INF), (False, INF, INF)]
    assert first_birth(ops, ["torch.add", "Tensor.mul", "torch.sum"]) == 1


def test_first_birth_ignores_an_intended_inf_the_forward_absorbed() -> None:
    ops = [(True, FINITE, NEG_INF), (False, NEG_INF, FINITE)]
    assert first_birth(ops, ["Tensor.masked_fill", "torch.softmax"]) is None


def test_first_birth_of_nothing_is_none() -> None:
    assert first_birth([]) is None
    assert first_birth([(False, FINITE, FINITE), (False, None, None)]) is None


def test_forward_finite_when_every_output_is() -> None:
    assert forward_finite([FINITE, None, FINITE])
    assert forward_finite([])


def test_forward_with_a_nan_is_not_finite() -> None:
    assert not forward_finite([FINITE, NAN, FINITE])


def test_forward_with_only_minus_inf_absorbed_before_the_output_counts_as_finite() -> None:
    assert forward_finite([NEG_INF, FINITE])
    assert not forward_finite([FINITE, NEG_INF])  # not absorbed: the output holds it
    assert not forward_finite([INF, FINITE])  # +inf is no mask


def test_last_finite_is_unknown_without_a_last_summary() -> None:
    assert last_finite([]) is None
    assert last_finite([FINITE, None]) is None
    assert last_finite([NAN, FINITE]) is True
    assert last_finite([FINITE, INF]) is False


def test_absorbed_only_for_an_inf_birth_the_forward_ended_finite_after() -> None:
    assert absorbed({"nan": False, "inf": True}, True)
    assert not absorbed({"nan": True, "inf": False}, True)
    assert not absorbed({"nan": False, "inf": True}, False)
    assert not absorbed({"nan": False, "inf": True}, None)


def test_first_seen_is_the_first_op_reading_a_non_finite_input() -> None:
    a, b, c = Site("torch.add", None), Site("torch.mul", "fc"), Site("torch.sum", None)
    assert first_seen([(a, FINITE), (b, NAN), (c, NAN)]) is b
    assert first_seen([(a, None), (b, FINITE)]) is None


def test_first_bad_module_reports_its_inputs_magnitudes() -> None:
    label, inputs = first_bad_module([("fc1", FINITE, FINITE), ("fc2", FINITE, NAN), ("<root>", FINITE, NAN)])
    assert label == "fc2"
    assert inputs == {"min_abs": 0.5, "max_abs": 2.0, "min": -2.0, "max": 2.0}
    assert first_bad_module([("fc1", FINITE, FINITE)]) == (None, {})


class _LogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.fc(x) * 0.0)


def test_resolve_names_the_forward_op_and_module_where_inf_was_born() -> None:
    model = _LogNet()
    loc = Localizer(model)
    try:
        loc.start()
        out = model(torch.ones(3, 2))
        loc.stop_forward()
        loc.hook_graph([out])
        torch.autograd.grad(out.sum(), list(model.parameters()), allow_unused=True)
        result = loc.resolve()
    finally:
        loc.close()
    assert result.origin is not None
    assert result.origin.phase == "forward"
    assert result.origin.forward_op == "torch.log"
    assert result.origin.module == "<root>"
    assert result.first_module == "<root>"
    assert not result.forward_finite
