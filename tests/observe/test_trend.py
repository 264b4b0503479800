"""The trend decisions the checks share (gradwatch.core.trend), tested alone."""

from __future__ import annotations

import math

from gradwatch.core.history import History
from gradwatch.core.trend import EARLY_LOSS, converged, median, newly_sustained, quantile, robust_spread


def test_median_skips_non_finite_values() -> None:
    assert median([3.0, math.nan, 1.0, math.inf, 2.0]) == 2.0
    assert median([1.0, 4.0]) == 2.5
    assert math.isnan(median([math.nan]))


def test_robust_spread_is_the_scaled_mad() -> None:
    m, spread = robust_spread([1.0, 2.0, 3.0, 4.0, 100.0])
    assert m == 3.0
    assert spread == 1.4826


def test_quantile_is_the_nearest_rank() -> None:
    assert quantile(range(11), 0.9) == 9
    assert math.isnan(quantile([], 0.5))


def test_newly_sustained_fires_once_at_the_crossing() -> None:
    held = bool
    assert newly_sustained([False, True, True], True, held, 3)
    assert not newly_sustained([True, True, True], True, held, 3)  # already sustained
    assert not newly_sustained([False, False, True], True, held, 3)  # not long enough yet
    assert not newly_sustained([True, True], False, held, 3)


def test_a_run_whose_loss_fell_a_hundredfold_has_converged() -> None:
    history = History()
    history.memory[EARLY_LOSS] = 1.0
    history.losses.extend([0.001] * 5)
    assert converged(history, 0) == "loss"
    history.losses.extend([0.5] * 10)
    assert converged(history, 0) is None
