"""exploding_grad: a gradient norm far too large (overflow, absolute bound, against the weights, a spike),
on constructed statistics."""

from __future__ import annotations

import math

import torch
from _check_steps import run
from torch import nn

from gradwatch.checks import exploding
from gradwatch.core.config import Config
from gradwatch.core.stats import StepStats


def _step(step: int, norm: float, **extra: object) -> StepStats:
    return StepStats(
        step=step, names=["enc.weight", "head.weight"], modules=["enc", "head"], norms=[norm, norm / 10],
        total_norm=math.hypot(norm, norm / 10), extra=dict(extra),
    )


def test_a_gradient_far_above_the_weights_is_flagged_at_step_zero() -> None:
    torch.manual_seed(0)
    params = [nn.Linear(16, 8).weight, nn.Linear(8, 1).weight]
    stats = _step(0, 1e7, params=params, param_norms={"enc": 1.0, "head": 0.5})
    (f,) = run(exploding, [stats])
    assert (f.kind, f.step, f.severity, f.data["reasons"]) == ("exploding_grad", 0, "warning", ["ratio"])
    assert f.module == "enc" and "clip_grad_norm_" in f.fix
    assert stats.extra[exploding.APPLIED]["step"] == 0  # named by the non-finite steps that may follow


def test_a_norm_above_exploding_norm_names_the_layer_over_it() -> None:
    (f,) = run(exploding, [_step(0, 100.0)], Config(exploding_norm=50.0))
    assert f.data["reasons"] == ["bound"] and f.module == "enc" and "exploding_norm=50" in f.message


def test_a_norm_that_overflows_float32_is_an_error_that_names_the_policy() -> None:
    stats = _step(0, 1.0)
    stats.overflow_norm = ("head.weight",)
    (f,) = run(exploding, [stats], Config(on_nonfinite="skip"))
    assert (f.severity, f.module) == ("error", "head") and "gradwatch skipped this update" in f.message


def test_a_spike_far_above_the_runs_median_is_flagged_once() -> None:
    norms = [1.0 + 0.1 * (s % 3) for s in range(30)] + [1e4, 2e4, 1e4]
    found = run(exploding, [_step(s, v) for s, v in enumerate(norms)])
    assert [(f.step, f.data["reasons"]) for f in found] == [(30, ["spike"])]
    assert "its median of" in found[0].explanation.what


def test_a_noisy_healthy_run_is_not_flagged() -> None:
    norms = [0.5 + 1.5 * ((s * 7) % 11) / 10 for s in range(80)]
    assert run(exploding, [_step(s, v) for s, v in enumerate(norms)]) == []


def test_a_small_init_judged_at_a_default_inits_scale_is_not_flagged() -> None:
    # weights drawn near zero grow into a default init's scale: a gradient 1e5x them is no explosion
    torch.manual_seed(0)
    params = [nn.Linear(64, 64).weight]
    stats = _step(0, 10.0, params=params, param_norms={"enc": 1e-4, "head": 1e-4})
    assert run(exploding, [stats]) == []


def test_init_scale_is_the_norm_of_a_default_initialization() -> None:
    params = [nn.Linear(16, 8).weight, nn.Linear(8, 4).bias]  # vectors are left out
    assert exploding.init_scale(params) == math.sqrt(8 / 3)
    assert exploding.init_scale([]) == 0.0
