"""nonfinite_update: finite gradients whose float16 update would be NaN/Inf, on constructed statistics."""

from __future__ import annotations

from _check_steps import run

from gradwatch.checks import nonfinite_update
from gradwatch.core.config import Config
from gradwatch.core.stats import StepStats


def _step(step: int, **extra: object) -> StepStats:
    return StepStats(step=step, names=["w"], norms=[1.0], total_norm=1.0, extra=dict(extra))


def test_a_non_finite_update_of_finite_gradients_is_flagged_once_per_optimizer() -> None:
    steps = [_step(s, update_nonfinite=True, update_nonfinite_eps=[1e-8]) for s in range(3)]
    found = run(nonfinite_update, steps)
    assert [(f.kind, f.step) for f in found] == [("nonfinite_update", 0)]
    assert "eps=1e-08" in found[0].explanation.what and "eps=1e-4" in found[0].fix


def test_the_policy_is_named() -> None:
    (f,) = run(nonfinite_update, [_step(0, update_nonfinite=True)], Config(on_nonfinite="warn"))
    assert "It was applied (on_nonfinite='warn')" in f.explanation.what


def test_a_finite_update_is_not_flagged() -> None:
    assert run(nonfinite_update, [_step(s) for s in range(3)]) == []


def test_a_step_whose_gradients_are_already_non_finite_is_left_to_nonfinite_grad() -> None:
    stats = StepStats(step=0, names=["w"], nonfinite=("w",), extra={"update_nonfinite": True})
    assert run(nonfinite_update, [stats]) == []


def test_an_eps_of_zero_is_named_as_such_with_its_fix_not_float16s_rounding() -> None:
    (f,) = run(nonfinite_update, [_step(0, update_nonfinite=True, update_nonfinite_eps=[0.0])])
    assert "its eps is 0" in f.explanation.what and "float16" not in f.explanation.what
    assert "positive eps" in f.fix
