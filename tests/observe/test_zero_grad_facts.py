"""The zero-grad tracker's after-sync decisions as pure functions (see also test_zero_grad_decisions.py)."""

from __future__ import annotations

from gradwatch.observe.zero_grad import baseline_was_dropped, partly_cleared


def test_a_baseline_taken_at_the_first_dropped_step_moves_with_the_step_number() -> None:
    assert baseline_was_dropped((4, 2), 4)
    assert not baseline_was_dropped((4, 2), 3)
    assert not baseline_was_dropped(None, 4)


def test_an_accumulated_gradient_with_a_cleared_sentinel_waits_for_the_next_check() -> None:
    assert partly_cleared(True, {"sentinel_cleared": True}, has_snapshot=False)


def test_nothing_waits_once_the_parameters_are_named_or_a_snapshot_is_taken() -> None:
    assert not partly_cleared(True, {"sentinel_cleared": True, "kept_params": ("a",)}, has_snapshot=False)
    assert not partly_cleared(True, {"sentinel_cleared": True}, has_snapshot=True)
    assert not partly_cleared(True, {}, has_snapshot=False)
    assert not partly_cleared(False, {"sentinel_cleared": True}, has_snapshot=False)
