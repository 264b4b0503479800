"""The policy alone: ``decide(stats, config, consecutive_skips) -> Verdict`` on a table of steps.

The engine only carries the verdict out (``Engine._act``); what it does with each action is pinned by the
end-to-end tests (test_watch.py, test_reliability.py, the golden files).
"""

from __future__ import annotations

from typing import Any

import pytest

from gradwatch.core.config import make_config
from gradwatch.core.findings import GradWatchError
from gradwatch.core.history import History
from gradwatch.core.policy import Verdict, decide, error_text, is_blocked, needs_incident, too_many_skips
from gradwatch.core.stats import StepStats

NAN = float("nan")


def _stats(**facts: Any) -> StepStats:
    extra = facts.pop("extra", {})
    stats = StepStats(**{"step": 7, "names": ["w"], "norms": [1.0], "total_norm": 1.0, "loss": 0.5, **facts})
    stats.extra.update(extra)
    return stats


HEALTHY: dict[str, Any] = {}
NAN_GRAD = {"nonfinite": ("w",), "nan_counts": {"w": 3}}
NAN_LOSS = {"loss": NAN, "loss_nonfinite": True}
OVERFLOW = {"overflow_norm": ("w",)}
OTHER_RANK = {"extra": {"any_rank_nonfinite": True}}
HALF_UPDATE = {"extra": {"update_nonfinite": True}}

# (step facts, on_nonfinite, max_skips, skips in a row before, expected verdict)
CASES = [
    (HEALTHY, "skip", 10, 0, Verdict("continue", "finite", False, 0)),
    (HEALTHY, "skip", 10, 4, Verdict("continue", "finite", False, 0)),  # a finite step ends a streak
    (HEALTHY, "raise", 10, 0, Verdict("continue", "finite", False, 0)),
    (NAN_GRAD, "skip", 10, 0, Verdict("skip", "on_nonfinite='skip'", True, 1)),
    (NAN_LOSS, "skip", 10, 0, Verdict("skip", "on_nonfinite='skip'", True, 1)),
    (OVERFLOW, "skip", 10, 0, Verdict("skip", "on_nonfinite='skip'", True, 1)),
    (OTHER_RANK, "skip", 10, 0, Verdict("skip", "on_nonfinite='skip'", True, 1)),
    (HALF_UPDATE, "skip", 10, 0, Verdict("skip", "on_nonfinite='skip'", True, 1)),
    (NAN_GRAD, "skip", 10, 9, Verdict("skip", "on_nonfinite='skip'", True, 10)),  # the max-th skip still skips
    (NAN_GRAD, "skip", 10, 10, Verdict("escalate", "max_skips=10", True, 11)),
    (NAN_GRAD, "skip", 0, 0, Verdict("escalate", "max_skips=0", True, 1)),
    (NAN_GRAD, "skip", None, 10_000, Verdict("skip", "on_nonfinite='skip'", True, 10_001)),
    (NAN_GRAD, "raise", 10, 0, Verdict("raise", "on_nonfinite='raise'", True, 0)),
    (NAN_LOSS, "raise", 10, 3, Verdict("raise", "on_nonfinite='raise'", True, 3)),  # the count stays
    (NAN_GRAD, "warn", 10, 0, Verdict("continue", "on_nonfinite='warn'", True, 0)),
    (NAN_GRAD, "warn", 10, 5, Verdict("continue", "on_nonfinite='warn'", True, 0)),
]


@pytest.mark.parametrize(("facts", "on_nonfinite", "max_skips", "before", "expected"), CASES)
def test_decide(facts: dict[str, Any], on_nonfinite: str, max_skips: int | None, before: int, expected: Verdict) -> None:
    config = make_config(on_nonfinite=on_nonfinite, max_skips=max_skips)
    assert decide(_stats(**dict(facts)), config, before) == expected


@pytest.mark.parametrize(
    ("facts", "blocked", "incident"),
    [
        (HEALTHY, False, False),
        (NAN_GRAD, True, True),
        (NAN_LOSS, True, True),
        (OTHER_RANK, True, True),
        (OVERFLOW, True, False),  # finite gradients, overflowing norm: blocked, nothing to localize
        (HALF_UPDATE, True, False),
    ],
)
def test_blocked_and_incident(facts: dict[str, Any], blocked: bool, incident: bool) -> None:
    stats = _stats(**dict(facts))
    assert is_blocked(stats) is blocked
    assert needs_incident(stats) is incident


def test_decide_leaves_the_statistics_as_they_were() -> None:
    stats = _stats(**dict(NAN_GRAD))
    before = (stats.nonfinite, stats.loss, dict(stats.extra))
    decide(stats, make_config(on_nonfinite="skip", max_skips=0), 5)
    assert (stats.nonfinite, stats.loss, dict(stats.extra)) == before


@pytest.mark.parametrize(
    ("facts", "fix"),
    [
        (NAN_GRAD, "Fix: the cause is persistent, not a rare bad batch"),
        (OVERFLOW, "Fix: the cause is persistent: the gradients are finite but their norm overflows float32"),
    ],
)
def test_too_many_skips_words(facts: dict[str, Any], fix: str) -> None:
    stats = _stats(**dict(facts))
    finding = too_many_skips(stats, History(window=10), make_config(max_skips=3), 4)
    assert (finding.kind, finding.step, finding.severity) == ("too_many_skips", 7, "error")
    assert finding.message.startswith(
        "4 optimizer steps in a row were non-finite (max_skips=3); skipping further would only stall the run.\n"
    )
    assert fix in finding.message
    assert finding.message.endswith("Raise max_skips (or set it to None) to keep skipping.")
    assert finding.data == {"consecutive_skips": 4, "after_exploding": None}
    text = error_text(stats, [finding], "max_skips=3")
    assert text.startswith("gradwatch stopped training at step 7 (max_skips=3):\n  ")
    assert isinstance(GradWatchError(text, [finding]), Exception)
