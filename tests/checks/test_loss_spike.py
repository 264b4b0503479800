"""loss_spike: a loss far above its recent median, on constructed statistics."""

from __future__ import annotations

from _check_steps import run

from gradwatch.checks import loss_spike
from gradwatch.core.stats import StepStats


def _steps(losses: list[float]) -> list[StepStats]:
    return [StepStats(step=s, names=["w"], norms=[1.0], total_norm=1.0, loss=v) for s, v in enumerate(losses)]


def _noisy(n: int) -> list[float]:
    return [1.0 if s % 2 else 1.2 for s in range(n)]


def test_a_loss_far_above_its_median_is_flagged_at_its_step() -> None:
    found = run(loss_spike, _steps(_noisy(30) + [100.0] + _noisy(5)))
    assert [(f.kind, f.step) for f in found] == [("loss_spike", 30)]
    assert "robust spreads" in found[0].explanation.what and "a jump is expected" in found[0].fix


def test_a_noisy_steady_loss_is_not_flagged() -> None:
    assert run(loss_spike, _steps(_noisy(60))) == []


def test_a_falling_loss_is_not_flagged() -> None:
    assert run(loss_spike, _steps([10.0 * 0.9**s for s in range(60)])) == []


def test_a_bump_of_a_few_spreads_is_not_flagged() -> None:
    # Half a loss above the median, within ten robust spreads of it: noise, not a spike.
    losses = _noisy(30) + [1.6] + _noisy(10)
    assert run(loss_spike, _steps(losses)) == []
