"""The magnitude measurement's decisions as pure functions: what a checked step measures of the weights, and
the update-to-weight ratios from measured norms. The end-to-end behaviour is in test_magnitude.py."""

from __future__ import annotations

import math

import pytest

from gradwatch.core.measured import EARLY_UPDATES
from gradwatch.observe.magnitude import (
    MeasurementPlan,
    layer_ratios,
    measures_nothing,
    plan_measurement,
    whole_model_ratio,
)


def test_a_step_on_the_cadence_measures_norms_and_samples_for_every_layer() -> None:
    assert plan_measurement(20, 10, asked=False) == MeasurementPlan(norms=True, sample=True, early=False, takes_wish=False)


def test_a_request_on_the_cadence_is_left_for_a_step_off_it() -> None:
    assert not plan_measurement(20, 10, asked=True).takes_wish


def test_the_first_checks_sample_for_the_whole_model_ratio_only() -> None:
    plan = plan_measurement(EARLY_UPDATES - 1, 100, asked=False)
    assert plan == MeasurementPlan(norms=False, sample=True, early=True, takes_wish=False)


def test_a_step_off_the_cadence_after_the_first_checks_measures_nothing() -> None:
    plan = plan_measurement(EARLY_UPDATES + 1, 100, asked=False)
    assert not plan.norms and not plan.sample


def test_a_request_off_the_cadence_gets_the_norms_without_a_sample() -> None:
    plan = plan_measurement(EARLY_UPDATES + 1, 100, asked=True)
    assert plan == MeasurementPlan(norms=True, sample=False, early=True, takes_wish=True)


@pytest.mark.parametrize("every", [1, 3, 10, 100])
def test_measuring_nothing_is_told_exactly_as_the_plan_would_tell_it(every: int) -> None:
    for count in range(3 * every + EARLY_UPDATES + 2):
        for asked in (False, True):
            plan = plan_measurement(count, every, asked=asked)
            assert measures_nothing(count, every, asked) == (not plan.norms and not plan.sample), (count, asked)


def test_every_step_is_on_the_cadence_of_one() -> None:
    assert all(plan_measurement(n, 1, asked=True) == plan_measurement(0, 1, asked=False) for n in range(30))


def test_whole_model_ratio_is_the_norm_of_all_updates_over_the_norm_of_all_weights_per_step() -> None:
    ratio, weights = whole_model_ratio({"a": 3.0, "b": 4.0}, {"a": 0.3, "b": 0.4}, steps=2)
    assert weights == 5.0
    assert ratio == pytest.approx(0.05)


@pytest.mark.parametrize(("before", "update"), [({"a": 0.0}, {"a": 1.0}), ({"a": math.inf}, {"a": 1.0}),
                                                 ({"a": 1.0}, {"a": math.nan}), ({}, {})])
def test_whole_model_ratio_is_not_measured_without_finite_positive_weights_and_a_finite_update(
    before: dict[str, float], update: dict[str, float]
) -> None:
    assert whole_model_ratio(before, update, steps=1) is None


def test_layer_ratios_skip_layers_without_weights_or_with_a_non_finite_update() -> None:
    before = {"a": 2.0, "b": 0.0, "c": 1.0}
    update = {"a": 0.2, "b": 1.0, "c": math.inf, "d": 1.0}
    assert layer_ratios(before, update, steps=0) == {"a": pytest.approx(0.1)}
