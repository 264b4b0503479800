"""The AMP monitor's facts and words as pure functions: the scaler's stage for an optimizer, and the words
of a raise on an overflow step. The end-to-end behaviour is in test_amp.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.core.findings import Explanation
from gradwatch.observe.amp import RaisedOnOverflow, _overflow_stage, _scaling_state, raised_on_overflow_explanation


def _overflowed(unscale: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """A tiny model whose scaled backward overflowed (an Inf gradient), optionally unscaled."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")
    if unscale:
        scaler.unscale_(opt)
    return model, opt, scaler


@pytest.mark.parametrize(("unscale", "stage"), [(False, "READY"), (True, "UNSCALED")])
def test_the_stage_of_an_overflowed_optimizer_says_whether_it_was_unscaled(unscale: bool, stage: str) -> None:
    model, opt, scaler = _overflowed(unscale)
    with gradwatch.watch(model, opt, console=False) as gw:
        (op,) = gw.engine.index.per_optimizer
        assert _overflow_stage(scaler, op, ["weight"]) == stage
        assert _overflow_stage(scaler, op, ["another.weight"]) == "READY"  # not concerned


def test_an_unscaled_finite_gradient_was_made_non_finite_after_the_scaling() -> None:
    model, opt, scaler = _overflowed(unscale=False)
    model.weight.grad[0, 0] = 0.0
    scaler.unscale_(opt)
    with gradwatch.watch(model, opt, console=False) as gw:
        assert _overflow_stage(scaler, gw.engine.index.per_optimizer[0], ["weight"]) == "FINITE"


def test_the_scaling_state_after_unscale_is_the_found_inf_flag() -> None:
    _model, opt, scaler = _overflowed(unscale=True)
    grad_scale, found_inf, scaled_unknown = _scaling_state(scaler, opt, "plain")
    assert grad_scale is None and not scaled_unknown
    assert float(found_inf) > 0


def test_before_unscale_a_plain_loop_has_no_scaling_state_to_read() -> None:
    _model, opt, scaler = _overflowed(unscale=False)
    assert _scaling_state(scaler, opt, "plain") == (None, None, False)


def _facts(clipper: str, unscaled: bool) -> RaisedOnOverflow:
    return RaisedOnOverflow(
        step=0, raised="RuntimeError", first_line="cannot be clipped", scale=65536.0, bad=1, total=2, nan=0, inf=1,
        names="weight", unscaled=unscaled, seen=("loss",), clipper=clipper,
    )


def test_the_words_of_a_raise_on_an_overflow_name_the_exception_and_the_scale() -> None:
    words = raised_on_overflow_explanation(_facts("torch", unscaled=True))
    assert words == Explanation(
        what="At step 0 the training code stopped with RuntimeError (\"cannot be clipped\") on the gradient scaler's "
        "overflow, a normal event, not a NaN incident: 1 of 2 gradients of the scaled backward (loss scale 65536) "
        "held 0 NaN, 1 Inf (weight); the loss was finite.",
        why="at the start of fp16 training the scaler overflows a few times while it finds its scale, and "
        "scaler.step() drops such an update and lowers the scale; raising on it ends a healthy run.",
        fix="scaler.unscale_(optimizer), then torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=False), then "
        "scaler.step(optimizer): it skips the step when the gradients are non-finite.",
    )


@pytest.mark.parametrize(
    ("clipper", "unscaled", "in_fix"),
    [
        ("fabric", False, "fabric.clip_gradients"),
        ("torch", False, "applies to gradients 65536 times too large"),
        ("", False, "do not stop on non-finite gradients"),
    ],
)
def test_the_fix_follows_what_raised(clipper: str, unscaled: bool, in_fix: str) -> None:
    assert in_fix in raised_on_overflow_explanation(_facts(clipper, unscaled)).fix
