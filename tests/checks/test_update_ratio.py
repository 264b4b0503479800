"""update_ratio_high and update_ratio_low: measured update-to-weight ratios out of band, on constructed
statistics."""

from __future__ import annotations

from _check_steps import run

from gradwatch.checks import update_ratio
from gradwatch.core.stats import StepStats


def _steps(ratios: list[dict[str, float]]) -> list[StepStats]:
    return [
        StepStats(step=s, names=["a.weight"], modules=["a"], norms=[1.0], total_norm=1.0, extra={"update_ratio": r})
        for s, r in enumerate(ratios)
    ]


def test_a_ratio_above_the_band_for_patience_measurements_is_flagged_once() -> None:
    found = run(update_ratio, _steps([{"a": 0.5, "b": 1e-3}] * (update_ratio.PATIENCE + 3)))
    assert [(f.kind, f.step, f.module) for f in found] == [("update_ratio_high", update_ratio.PATIENCE - 1, "a")]


def test_a_ratio_below_the_band_is_flagged() -> None:
    found = run(update_ratio, _steps([{"a": 1e-9}] * update_ratio.PATIENCE))
    assert [f.kind for f in found] == ["update_ratio_low"] and "raise the learning rate" in found[0].fix


def test_usual_ratios_and_a_short_excursion_are_not_flagged() -> None:
    ratios = [{"a": 1e-3}] * 3 + [{"a": 0.5}] * (update_ratio.PATIENCE - 1) + [{"a": 1e-3}] * 3
    assert run(update_ratio, _steps(ratios)) == []


def test_exactly_zero_updates_are_ignored() -> None:
    # frozen by lr=0, or a skipped step: nothing moved, which says nothing about the learning rate
    assert run(update_ratio, _steps([{"a": 0.0}] * (update_ratio.PATIENCE + 2))) == []
