"""What the run's clipping means for a finding's words (gradwatch.core.clipping), one row of its table each."""

from __future__ import annotations

from typing import Any

import pytest

from gradwatch.core.clipping import clipping_in_place
from gradwatch.core.stats import StepStats


def _stats(how: str | None, ratio: Any = None) -> StepStats:
    extra: dict[str, Any] = {"clipping": {"how": how, "clip_val": 0.5}} if how else {}
    if ratio is not None:
        extra["clip_ratio"] = ratio
    return StepStats(step=0, extra=extra)


@pytest.mark.parametrize(
    ("how", "ratio", "this_step", "start"),
    [
        ("norm", 0.25, True, "Lightning's gradient clipping (gradient_clip_val=0.5) scaled this step's gradient down 4x"),
        ("norm", None, False, "Lightning's gradient clipping (gradient_clip_val=0.5) bounds the norm of every update"),
        ("value", None, True, "Lightning's gradient clipping clamps every gradient element to +-0.5"),
        ("loop", 0.5, True, "the training loop scaled this step's gradient down 2x"),
        ("loop", None, False, "the training loop clips the gradients between backward() and optimizer.step()"),
        ("module", None, True, "the LightningModule's configure_gradient_clipping clips the gradients"),
    ],
)
def test_each_way_of_clipping_has_its_clause(how: str, ratio: Any, this_step: bool, start: str) -> None:
    clause = clipping_in_place(_stats(how, ratio), this_step)
    assert clause is not None and clause.startswith(start)


@pytest.mark.parametrize(("how", "ratio"), [("norm", 1.0), ("norm", None), ("loop", 1.0), ("other", 0.5), (None, 0.5)])
def test_no_clause_when_nothing_clipped_this_step_or_nothing_is_known(how: str | None, ratio: Any) -> None:
    assert clipping_in_place(_stats(how, ratio)) is None
