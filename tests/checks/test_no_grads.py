"""no_grads: an optimizer step with no gradient at all, on constructed statistics."""

from __future__ import annotations

from _check_steps import run

from gradwatch.checks import no_grads
from gradwatch.core.stats import StepStats


def test_a_step_where_no_parameter_has_a_gradient_is_flagged_once() -> None:
    found = run(no_grads, [StepStats(step=s, none_grad=("fc.weight", "fc.bias")) for s in range(3)])
    assert [(f.kind, f.step) for f in found] == [("no_grads", 0)]
    assert found[0].params == ("fc.weight", "fc.bias") and "loss.backward()" in found[0].fix


def test_a_step_with_some_gradients_is_not_flagged() -> None:
    assert run(no_grads, [StepStats(step=0, names=["fc.weight"], none_grad=("fc.bias",))]) == []


def test_gradients_cleared_before_the_step_are_left_to_the_zero_grad_check() -> None:
    stats = StepStats(step=0, none_grad=("fc.weight",), extra={"grads_cleared_before_step": True})
    assert run(no_grads, [stats]) == []


def test_an_optimizer_built_for_another_model_is_left_to_foreign_params() -> None:
    stats = StepStats(step=0, none_grad=("<other>",), foreign=("<other>",))
    assert run(no_grads, [stats]) == []
