"""GradScaler misuses in plain loops: scaled gradients stepped by ``optimizer.step()`` directly, the error
``scaler.update()`` raises after such a step, and ``too_many_skips`` worded by the cause of its skips."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import kinds
from torch import nn
from torch.nn import functional as F

import gradwatch
from gradwatch.core.extensions import default_extensions
from gradwatch.core.findings import GradWatchError
from gradwatch.observe.scaler_bypass import ScalerBypass

if not hasattr(torch.amp, "GradScaler"):
    pytest.skip("torch.amp.GradScaler is needed", allow_module_level=True)

FIX = "scaler.step(optimizer); scaler.update()"

Step = Callable[[torch.Tensor, Any, Any, nn.Module], None]


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def amp_run(step: Step, *, steps: int = 6, init_scale: float = 2.0**16, enabled: bool = True, hand: bool = False,
            make_opt: Callable[[Any], Any] | None = None, **config: Any) -> tuple[Any, list[gradwatch.Finding]]:
    """A plain fp16-autocast loop on the CPU whose optimizer step is ``step(loss, opt, scaler, model)``."""
    model = net()
    opt = make_opt(model.parameters()) if make_opt else torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=enabled)
    extra = {"scaler": scaler} if hand else {}
    g = torch.Generator().manual_seed(0)
    gw = gradwatch.watch(model, opt, console=False, **extra, **config)
    try:
        for _ in range(steps):
            x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), y)
            step(loss, opt, scaler, model)
    finally:
        gw.close()
    return scaler, gw.findings


def bypass(loss: torch.Tensor, opt: Any, scaler: Any, model: nn.Module) -> None:
    scaler.scale(loss).backward()
    opt.step()  # the bug: scaler.step(opt); scaler.update() never called


def bypass_then_update(loss: torch.Tensor, opt: Any, scaler: Any, model: nn.Module) -> None:
    scaler.scale(loss).backward()
    opt.step()
    scaler.update()  # raises: "No inf checks were recorded prior to update."


def healthy(loss: torch.Tensor, opt: Any, scaler: Any, model: nn.Module) -> None:
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def unscale_clip(loss: torch.Tensor, opt: Any, scaler: Any, model: nn.Module) -> None:
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()


def scaler_never_used(loss: torch.Tensor, opt: Any, scaler: Any, model: nn.Module) -> None:
    loss.backward()  # a GradScaler was created, but neither scale() nor step() is called
    opt.step()


def of(findings: list[gradwatch.Finding], kind: str) -> list[gradwatch.Finding]:
    return [f for f in findings if f.kind == kind]


# -- 1. scaled gradients stepped directly ----------------------------------------------------------------
@pytest.mark.parametrize("hand", [True, False], ids=["scaler-handed", "scaler-found"])
def test_scaled_gradients_stepped_directly_are_reported_at_the_first_step_with_the_scaler_fix(hand: bool) -> None:
    _, findings = amp_run(bypass, hand=hand)
    (first,) = of(findings, "scaler_step_bypassed")
    bad = of(findings, "nonfinite_grad")
    # A scaler handed over is asked from the first step; one only the loop holds is looked for at the first
    # step whose gradients overflow (reading the loop's variables earlier would keep its tensors alive).
    assert (first.step, first.severity) == (0 if hand else bad[0].step, "error")
    assert "65536" in first.message and FIX in first.fix
    # The scaled backward overflowed float16 (the scaler would have dropped the update): the nonfinite
    # findings name that cause and take its fix, and no op is blamed for an overflow of the scale.
    assert bad and all(f.fix == first.fix and "65536" in f.explanation.cause for f in bad), kinds(findings)
    assert not of(findings, "nan_origin")
    assert all(f.fix == first.fix for f in of(findings, "exploding_grad") if f.step >= first.step)


def test_finite_scaled_updates_stepped_directly_are_reported_before_anything_overflows() -> None:
    _, findings = amp_run(bypass, init_scale=256.0, steps=1, hand=True)
    assert kinds(findings) == [("scaler_step_bypassed", 0)]
    assert "256 times too large" in findings[0].message and FIX in findings[0].fix


def test_a_scaler_only_the_loop_holds_is_found_at_the_first_overflow_of_its_scale() -> None:
    # Looked for in the loop's variables only once a step is non-finite: a healthy step keeps no reference.
    _, findings = amp_run(bypass, init_scale=256.0, steps=3)
    (first,) = of(findings, "scaler_step_bypassed")
    assert first.step == 1 and "256" in first.message and first.data["overflow"]
    assert all(f.fix == first.fix for f in of(findings, "nonfinite_grad"))


def test_too_many_skips_of_a_bypassed_scaler_repeat_its_fix() -> None:
    scaler = torch.amp.GradScaler("cpu")
    model, g = net(), torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(GradWatchError), gradwatch.watch(model, opt, console=False, max_skips=3) as gw:
        for _ in range(8):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(torch.randn(32, 8, generator=g)).float(), torch.randn(32, 1, generator=g))
            bypass(loss, opt, scaler, model)
    assert len(of(gw.findings, "scaler_step_bypassed")) == 1  # reported once
    (stop,) = of(gw.findings, "too_many_skips")
    assert stop.data["cause"] == "scaler_step_bypassed" and FIX in stop.fix
    assert "lower the learning rate" not in stop.fix


def test_several_optimizers_all_stepped_directly_are_reported_once() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(8, 1), "b": nn.Linear(8, 1)})
    opts = [torch.optim.SGD(model[k].parameters(), lr=0.05) for k in ("a", "b")]
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opts, console=False, scaler=scaler) as gw:
        for _ in range(3):
            for k, opt in zip(("a", "b"), opts):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model[k](torch.randn(16, 8, generator=g)).float().pow(2).mean()
                scaler.scale(loss).backward()
                opt.step()
    (found,) = of(gw.findings, "scaler_step_bypassed")
    assert found.step == 0 and "each of the 2 optimizers' step()" in found.message


# -- 2. the error scaler.update() raises after a direct step ------------------------------------------------
def test_update_after_a_direct_step_raises_and_is_explained_with_the_scaler_fix() -> None:
    model, g = net(), torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"), \
            gradwatch.watch(model, opt, console=False) as gw:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(torch.randn(32, 8, generator=g)).float(), torch.randn(32, 1, generator=g))
        bypass_then_update(loss, opt, scaler, model)
    explained = [f for f in gw.findings if f.data.get("raised") == "AssertionError"]
    assert [(f.kind, f.step) for f in explained] == [("scaler_step_bypassed", 0)], kinds(gw.findings)
    assert "No inf checks were recorded prior to update" in explained[0].message and FIX in explained[0].fix
    assert not of(gw.findings, "amp_overflow")  # not the scaler's normal overflow


# -- what is not it ----------------------------------------------------------------------------------------
def _switch_to_fp32_after_two_steps() -> Step:
    seen = [0]

    def step(loss: torch.Tensor, opt: Any, scaler: Any, model: nn.Module) -> None:
        seen[0] += 1
        if seen[0] <= 2:
            healthy(loss, opt, scaler, model)
        else:
            scaler_never_used(loss, opt, scaler, model)  # the scaler is kept, but no longer used

    return step


@pytest.mark.parametrize(
    ("step", "options"),
    [
        (healthy, {}),
        (healthy, {"hand": True}),
        (unscale_clip, {}),
        (healthy, {"make_opt": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True)}),
        (bypass, {"enabled": False}),  # a disabled scaler scales nothing: stepping directly is right
        (healthy, {"enabled": False}),
        (scaler_never_used, {}),
        (scaler_never_used, {"hand": True}),
        (_switch_to_fp32_after_two_steps(), {}),
    ],
    ids=["healthy", "healthy-handed", "unscale-clip-step", "fused-adam", "disabled-direct", "disabled-step",
         "unused-scaler", "unused-scaler-handed", "scaler-dropped-mid-run"],
)
def test_loops_that_step_through_the_scaler_or_do_not_scale_are_silent(step: Step, options: dict[str, Any]) -> None:
    _, findings = amp_run(step, **options)
    assert not [f for f in findings if f.severity != "info"], kinds(findings)


def test_an_optimizer_stepped_on_an_unscaled_loss_beside_one_the_scaler_steps_is_silent() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"amp": nn.Linear(8, 1), "fp32": nn.Linear(8, 1)})
    opt_amp = torch.optim.SGD(model["amp"].parameters(), lr=0.05)
    opt_fp32 = torch.optim.SGD(model["fp32"].parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, [opt_amp, opt_fp32], console=False) as gw:
        for _ in range(4):
            x = torch.randn(16, 8, generator=g)
            opt_amp.zero_grad()
            opt_fp32.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                scaler.scale(model["amp"](x).float().pow(2).mean()).backward()
            model["fp32"](x).pow(2).mean().backward()
            opt_fp32.step()  # stepped first, on its own unscaled loss, before the scaler steps the other
            scaler.step(opt_amp)
            scaler.update()
    assert not of(gw.findings, "scaler_step_bypassed"), kinds(gw.findings)


def test_a_closure_optimizer_is_left_alone() -> None:
    model = net()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()  # scaler.step() refuses closures
        return loss

    with gradwatch.watch(model, opt, console=False, scaler=scaler) as gw:
        for _ in range(2):
            opt.step(closure)
    assert not of(gw.findings, "scaler_step_bypassed"), kinds(gw.findings)


def test_lightning_drives_its_own_scaler() -> None:
    scaler = torch.amp.GradScaler("cpu")
    assert not any(isinstance(e, ScalerBypass) for e in default_extensions(None, scaler=scaler, integration="lightning"))


# -- 3. too_many_skips takes the fix of the finding that caused the skips -------------------------------------
def test_too_many_skips_after_nonfinite_updates_repeats_their_fix() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)  # eps rounds to 0 in float16
    g = torch.Generator().manual_seed(0)
    with pytest.raises(GradWatchError), gradwatch.watch(model, opt, console=False, max_skips=3) as gw:
        for _ in range(8):
            loss = (model(torch.randn(16, 8, generator=g).half()).float() - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (cause,) = of(gw.findings, "nonfinite_update")
    (stop,) = of(gw.findings, "too_many_skips")
    assert stop.data["cause"] == "nonfinite_update"
    assert cause.fix in stop.fix and "eps=1e-4" in stop.fix
    assert "see the first nonfinite finding" not in stop.fix
