"""nonfinite_loss and nonfinite_grad: NaN/Inf about to reach the weights, on constructed statistics; and
the restatement of a loss-only cause once the op is named (defer_to_origin)."""

from __future__ import annotations

import math

import pytest
from _check_steps import kinds, run

from gradwatch.checks import nonfinite
from gradwatch.core.config import Config
from gradwatch.core.stats import StepStats


def _step(step: int = 0, **kw: object) -> StepStats:
    base: dict = {"names": ["enc.a.weight", "enc.b.weight", "head.weight"], "modules": ["enc.a", "enc.b", "head"],
                  "norms": [1.0, 1.0, 1.0], "total_norm": 3**0.5}
    return StepStats(step=step, **{**base, **kw})


def test_nan_gradients_are_an_error_that_names_the_module_holding_them() -> None:
    stats = _step(4, nonfinite=("enc.a.weight", "enc.b.weight"), nan_counts={"enc.a.weight": 2, "enc.b.weight": 1})
    (f,) = run(nonfinite, [stats])
    assert (f.kind, f.step, f.severity, f.module) == ("nonfinite_grad", 4, "error", "enc")
    assert "(3 NaN, 0 Inf)" in f.explanation.what and "gradwatch skipped this update" in f.explanation.what


def test_a_finite_step_is_not_flagged() -> None:
    assert run(nonfinite, [_step(s, loss=1.0) for s in range(3)]) == []


@pytest.mark.parametrize(
    ("loss", "cause"), [(math.nan, "loss_only"), (math.inf, "loss_only_inf")]
)
def test_a_non_finite_loss_with_finite_gradients_names_causes_in_the_loss_only(loss: float, cause: str) -> None:
    (f,) = run(nonfinite, [_step(2, loss=loss, loss_nonfinite=True)])
    assert (f.kind, f.data["grads_finite"], f.data["cause"]) == ("nonfinite_loss", True, cause)


def test_a_float16_loss_that_overflowed_says_so() -> None:
    (f,) = run(nonfinite, [_step(2, loss=math.inf, loss_nonfinite=True, extra={"loss_dtype": "float16"})])
    assert f.data["cause"] == "float16" and "float32" in f.fix


def test_a_nan_loss_with_nan_gradients_is_reported_twice() -> None:
    stats = _step(2, loss=math.nan, loss_nonfinite=True, nonfinite=("head.weight",), nan_counts={"head.weight": 1})
    assert kinds(run(nonfinite, [stats])) == ["nonfinite_loss", "nonfinite_grad"]


def test_a_skipped_batchs_nan_loss_is_a_warning_and_not_the_steps_own() -> None:
    (f,) = run(nonfinite, [_step(3, loss=1.0, extra={"stale_losses": [math.nan, 1.0], "stale_unused": 0})])
    assert (f.kind, f.severity, f.data["no_update"]) == ("nonfinite_loss", "warning", True)


@pytest.mark.parametrize(
    ("grads_finite", "float16", "loss", "cause"),
    [
        (True, False, math.nan, "loss_only"),
        (True, False, math.inf, "loss_only_inf"),
        (False, False, math.nan, "nonfinite"),
        (True, True, math.inf, "float16"),
        (False, True, math.inf, "float16"),
    ],
)
def test_loss_cause_is_picked_by_the_facts(grads_finite: bool, float16: bool, loss: float, cause: str) -> None:
    facts = nonfinite.LossFacts(step=0, loss=loss, grads_finite=grads_finite, float16_overflow=float16, after="",
                                action="skip")
    assert nonfinite.loss_cause(facts) == cause


@pytest.mark.parametrize("policy", ["skip", "warn", "raise"])
def test_defer_to_origin_restates_a_loss_only_cause_with_the_op(policy: str) -> None:
    (f,) = run(nonfinite, [_step(2, loss=math.nan, loss_nonfinite=True)], Config(on_nonfinite=policy))
    restated = nonfinite.defer_to_origin(f, "SqrtBackward0", "enc", "clamp the input of sqrt.")
    assert restated is not None and restated.fix == "clamp the input of sqrt."
    what = restated.explanation.what
    assert what.startswith("The loss is nan at step 2, but every gradient is finite: the NaN/Inf was born at op ")
    assert "op SqrtBackward0 in module enc" in what and "Usual causes" not in what
    assert what.endswith(nonfinite.action_words(policy, 0))
    assert restated.data["restates"] == "nonfinite_loss" and restated.data["origin_op"] == "SqrtBackward0"
    assert nonfinite.defer_to_origin(restated, "SqrtBackward0", "enc", "fix") is None  # restated once


def test_defer_to_origin_leaves_other_findings_alone() -> None:
    grad, = run(nonfinite, [_step(2, nonfinite=("head.weight",), nan_counts={"head.weight": 1})])
    loss_and_grad = run(nonfinite, [_step(2, loss=math.nan, loss_nonfinite=True, nonfinite=("head.weight",))])
    assert nonfinite.defer_to_origin(grad, "SqrtBackward0", None, "fix") is None
    assert nonfinite.defer_to_origin(loss_and_grad[0], "SqrtBackward0", None, "fix") is None
