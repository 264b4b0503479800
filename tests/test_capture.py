"""Capture facts: which captured inputs hold NaN/Inf, and what the step's inputs look like."""

from __future__ import annotations

import torch

from gradwatch.diagnose.capture import Call, bad_data, nonfinite_inputs, step_inputs


def test_bad_data_counts_each_tensor_once_and_spares_a_minus_inf_mask() -> None:
    x = torch.tensor([float("nan"), 1.0, float("inf")])
    mask = torch.tensor([0.0, float("-inf")])
    assert bad_data([("x", x), ("again", x), ("mask", mask)]) == [("x", 1, 1)]
    assert bad_data([("x", x), ("mask", mask)], minus_inf=True) == [("mask", 0, 1)]


def test_nonfinite_inputs_name_the_micro_batch_that_held_them() -> None:
    good, bad = torch.ones(2), torch.tensor([float("nan"), 0.0])
    calls = [Call((good,), {}, None), Call((bad,), {}, None)]
    assert nonfinite_inputs(calls) == [("args[0] of the step's forward call 2", 1, 0)]


def test_a_tensor_fed_to_every_pass_is_named_without_its_pass() -> None:
    bad = torch.tensor([float("nan")])
    calls = [Call((bad,), {}, None), Call((bad,), {}, None)]
    assert nonfinite_inputs(calls) == [("args[0]", 1, 0)]


def test_step_inputs_count_grad_and_batch_sizes() -> None:
    adv = torch.zeros(3, 2, requires_grad=True)
    inputs = step_inputs([((torch.zeros(4, 2),), {}), ((adv,), {})], count=5)
    assert inputs.as_tuple() == (5, True, frozenset({3, 4}))
