"""The zero-grad tracker's decisions as pure functions: what came after the last backward pass, whether to
sample, which parameter to re-pick. The end-to-end behaviour is in test_zero_grad.py."""

from __future__ import annotations

import dataclasses

import pytest

from gradwatch.observe.zero_grad import (
    CHANGED_AFTER_BACKWARD,
    CLEARED_BEFORE_STEP,
    CLEARED_BETWEEN_BACKWARDS,
    FRESH,
    MOST_WRITTEN,
    SAMPLE_PASSES,
    SMALLEST,
    GradObservation,
    after_backward_verdict,
    repick_rule,
    sampling_armed,
)

HEALTHY = GradObservation(
    backward_passes=1,
    kept_passes=1,
    state=FRESH,
    has_grad=True,
    any_grads=True,
    reached_this_step=True,
    changed_after_backward=False,
    last_backward_grad=True,
)


def seen(**changes: object) -> GradObservation:
    return dataclasses.replace(HEALTHY, **changes)


def test_a_healthy_step_has_no_verdict() -> None:
    assert after_backward_verdict(HEALTHY) is None


def test_no_gradient_at_all_after_a_backward_pass_is_cleared_before_the_step() -> None:
    assert after_backward_verdict(seen(any_grads=False, has_grad=False)) == CLEARED_BEFORE_STEP


def test_representative_set_to_none_after_a_pass_of_this_step_is_cleared_between_backwards() -> None:
    assert after_backward_verdict(seen(has_grad=False, last_backward_grad=False)) == CLEARED_BETWEEN_BACKWARDS


def test_representative_without_gradient_reached_before_the_previous_step_has_no_verdict() -> None:
    assert after_backward_verdict(seen(has_grad=False, reached_this_step=False)) is None


def test_gradient_changed_in_place_after_the_last_pass() -> None:
    assert after_backward_verdict(seen(changed_after_backward=True)) == CHANGED_AFTER_BACKWARD


@pytest.mark.parametrize("changes", [{"any_grads": False}, {"has_grad": False}, {"changed_after_backward": True}])
def test_no_verdict_when_no_backward_pass_reached_the_representative(changes: dict[str, bool]) -> None:
    assert after_backward_verdict(seen(backward_passes=0, **changes)) is None


def test_sampling_is_armed_by_a_step_of_passes_each_clearing_the_one_before() -> None:
    assert sampling_armed((SAMPLE_PASSES, 1), kept_passes=1)
    assert not sampling_armed((SAMPLE_PASSES - 1, 1), kept_passes=1)
    assert not sampling_armed((SAMPLE_PASSES, 0), kept_passes=1)
    assert not sampling_armed((SAMPLE_PASSES, 1), kept_passes=2)
    assert not sampling_armed(None, kept_passes=1)


def test_repick_takes_the_smallest_parameter_when_the_representative_holds_no_gradient() -> None:
    assert repick_rule(any_grads=True, has_grad=False, unreached=False, swapped=False) == SMALLEST
    assert repick_rule(any_grads=True, has_grad=False, unreached=True, swapped=False) == SMALLEST


def test_repick_takes_the_most_written_parameter_when_no_pass_reached_the_representative() -> None:
    assert repick_rule(any_grads=True, has_grad=True, unreached=True, swapped=False) == MOST_WRITTEN


@pytest.mark.parametrize(
    ("any_grads", "has_grad", "unreached", "swapped"),
    [(False, False, True, False), (True, False, True, True), (True, True, False, False)],
)
def test_no_repick(any_grads: bool, has_grad: bool, unreached: bool, swapped: bool) -> None:
    assert repick_rule(any_grads, has_grad, unreached, swapped) is None
