"""amp_overflow and amp_overflow_persistent: a gradient scaler's dropped updates, on constructed statistics."""

from __future__ import annotations

from typing import Any

from _check_steps import kinds, run

from gradwatch.checks import amp_overflow
from gradwatch.core.stats import StepStats


def _step(step: int, **amp: Any) -> StepStats:
    return StepStats(step=step, names=["w"], norms=[1.0], total_norm=1.0, extra={"amp": amp})


def test_an_early_overflow_step_is_information_not_a_warning() -> None:
    (f,) = run(amp_overflow, [_step(3, overflow_steps=1, first_step=3, scale=65536.0, new_scale=32768.0)])
    assert (f.kind, f.step, f.severity) == ("amp_overflow", 3, "info")
    assert "lowered the loss scale to 32768" in f.message and "need no action" in f.message and not f.fix


def test_an_overflow_on_a_non_finite_loss_points_to_the_loss() -> None:
    (f,) = run(amp_overflow, [_step(3, overflow_steps=1, first_step=3, new_scale=1.0, loss_nonfinite=True)])
    assert "see the nonfinite_loss finding" in f.message


def test_most_of_the_run_dropped_is_a_warning() -> None:
    amp = {"overflow_steps": 16, "first_step": 2, "scale": 2.0**40, "new_scale": 2.0**24, "run_steps": 20, "total": 18}
    (f,) = run(amp_overflow, [_step(2, **amp)])
    assert (f.kind, f.severity) == ("amp_overflow", "warning") and "init_scale" in f.fix


def test_a_long_streak_in_a_long_run_stays_information() -> None:
    amp = {"overflow_steps": 16, "first_step": 2, "new_scale": 1.0, "run_steps": 1000, "total": 16}
    assert [f.severity for f in run(amp_overflow, [_step(2, **amp)])] == ["info"]


def test_persistent_overflow_with_gradients_never_cleared_is_a_missing_zero_grad() -> None:
    amp = {"persistent": True, "grads_never_cleared": True, "consecutive": 8, "first_step": 1, "new_scale": 1.0}
    assert kinds(run(amp_overflow, [_step(9, **amp)])) == ["zero_grad_missing"]


def test_persistent_overflow_is_a_warning() -> None:
    (f,) = run(amp_overflow, [_step(9, persistent=True, consecutive=8, first_step=1, new_scale=1.0)])
    assert (f.kind, f.severity) == ("amp_overflow_persistent", "warning") and "bf16" in f.fix


def test_a_step_without_overflow_or_without_a_scaler_is_not_flagged() -> None:
    assert run(amp_overflow, [_step(0, overflow_steps=0, scale=65536.0)]) == []
    assert run(amp_overflow, [StepStats(step=0, names=["w"], norms=[1.0], total_norm=1.0)]) == []
