"""Mixed precision: a GradScaler's overflow steps are reported as such, never as NaN incidents."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import kinds, plain_console, tiny_module, tiny_trainer
from torch import nn

import gradwatch

if not hasattr(torch.amp, "GradScaler"):
    pytest.skip("torch.amp.GradScaler is needed", allow_module_level=True)

CALIBRATION = 2.0**24  # a few fp16 overflow steps at the start of a healthy run, then a settled scale


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def amp_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    steps: int,
    *,
    nan_loss_from: int | None = None,
    nan_grad_at: int | None = None,
    on_step: Any = None,
) -> None:
    for step in range(steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).pow(2).mean()
        if nan_loss_from is not None and step >= nan_loss_from:
            loss = loss * float("nan")
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step == nan_grad_at:
            scaler.unscale_(opt)
            model[2].bias.grad[0] = float("nan")  # after the scaler's inf check: it will not skip
        if on_step is not None:
            on_step(step, "before")
        scaler.step(opt)
        scaler.update()
        if on_step is not None:
            on_step(step, "after")


# -- plain loop ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("hand_scaler", [True, False], ids=["scaler-handed", "scaler-found"])
def test_overflow_steps_of_a_healthy_run_are_one_info_finding(hand_scaler: bool) -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=CALIBRATION)
    extra = {"scaler": scaler} if hand_scaler else {}
    with gradwatch.watch(model, opt, console=plain_console(), **extra) as gw:
        amp_loop(model, opt, scaler, 16)
    (f,) = gw.findings
    assert (f.kind, f.severity, f.step) == ("amp_overflow", "info", 0)
    assert f.data["overflow_steps"] == 9 and f.data["steps"] == list(range(9))
    assert f.data["new_scale"] == scaler.get_scale() == 2.0**15
    assert gw.engine.steps_skipped == 0


def test_step_numbers_count_the_steps_the_scaler_skipped() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=CALIBRATION)
    with gradwatch.watch(model, opt, console=plain_console(), scaler=scaler) as gw:
        amp_loop(model, opt, scaler, 16, nan_grad_at=12)
    assert ("nonfinite_grad", 12) in kinds(gw.findings)  # iteration 12, although only 4 updates went through
    assert gw.summary().steps == 16


def _scaled_loop(gw: Any, scaler: torch.amp.GradScaler, steps: int, *, overflow_at: tuple[int, ...] = (),
                 nan_batch_at: int | None = None) -> list[bool]:
    """fp32 model under a GradScaler; an overflow is simulated by an Inf gradient, a bad batch by a NaN input."""
    model, opt = gw.engine.model, gw.engine.optimizers[0]
    applied = []
    for step in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        if step == nan_batch_at:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        gw.observe_loss(loss)
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step in overflow_at:
            model[0].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        applied.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return applied


def _scaled_watch(growth_interval: int) -> tuple[Any, torch.amp.GradScaler]:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=growth_interval)
    return gradwatch.watch(model, opt, console=plain_console(), scaler=scaler), scaler


@pytest.mark.parametrize("growth_interval", [1, 100], ids=["scale-grows-every-step", "scale-steady"])
def test_nan_batch_dropped_by_the_scaler_is_reported_at_its_step_and_the_next_update_applied(growth_interval: int) -> None:
    gw, scaler = _scaled_watch(growth_interval)
    with gw:
        applied = _scaled_loop(gw, scaler, 10, nan_batch_at=5)
    assert applied == [True] * 5 + [False] + [True] * 4  # only the NaN step is dropped (by the scaler)
    assert gw.engine.steps_skipped == 0
    found = kinds(gw.findings)
    assert ("nonfinite_loss", 5) in found and ("nonfinite_input", 5) in found
    assert ("amp_overflow", 5) in found
    assert not [f for f in gw.findings if f.step != 5], found
    assert "not a normal overflow" in next(f.message for f in gw.findings if f.kind == "nonfinite_loss")


def test_nan_batch_on_the_last_step_dropped_by_the_scaler_is_reported_at_close() -> None:
    gw, scaler = _scaled_watch(100)
    with gw:
        _scaled_loop(gw, scaler, 8, nan_batch_at=7)
    assert ("nonfinite_loss", 7) in kinds(gw.findings)


def test_overflow_right_after_the_scale_grew_is_counted_and_steps_stay_aligned() -> None:
    # growth_interval=1: every update doubles the scale, so an overflow right after one leaves the scale
    # where it was (x2 then x0.5).
    gw, scaler = _scaled_watch(1)
    with gw:
        _scaled_loop(gw, scaler, 12, overflow_at=(4, 8), nan_batch_at=11)
    found = kinds(gw.findings)
    assert [s for k, s in found if k == "amp_overflow"] == [4, 8, 11]
    assert ("nonfinite_loss", 11) in found
    assert gw.summary().steps == 12


def test_skip_stays_exact_under_amp() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=CALIBRATION)
    seen: dict[str, Any] = {}

    def on_step(step: int, when: str) -> None:
        if step == 12:
            seen[when] = (
                [p.detach().clone() for p in model.parameters()],
                [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()],
            )

    with gradwatch.watch(model, opt, console=plain_console(), scaler=scaler) as gw:
        amp_loop(model, opt, scaler, 14, nan_grad_at=12, on_step=on_step)
    (params_before, momentum_before), (params_after, momentum_after) = seen["before"], seen["after"]
    assert all(torch.equal(a, b) for a, b in zip(params_before, params_after))
    assert all(torch.equal(a, b) for a, b in zip(momentum_before, momentum_after))
    assert gw.engine.steps_skipped == 1


def test_overflow_that_persists_after_the_scale_settled_is_a_warning() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=CALIBRATION)
    console = plain_console()
    with gradwatch.watch(model, opt, console=console, scaler=scaler) as gw:
        amp_loop(model, opt, scaler, 30, nan_loss_from=14)
    assert not [f for f in gw.findings if f.kind.startswith("nonfinite") or f.severity == "error"]
    (w,) = [f for f in gw.findings if f.kind == "amp_overflow_persistent"]
    assert w.severity == "warning" and w.step == 14 + 8 - 1
    assert (
        "The gradient scaler keeps skipping updates: 8 overflow steps in a row up to step 21" in console.file.getvalue()
    )
    last = [f for f in gw.findings if f.kind == "amp_overflow"][-1]
    assert last.data["steps"] == list(range(14, 30))  # counted at close: no update went through since


def test_scaler_that_never_lets_an_update_through_is_a_warning() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    with gradwatch.watch(model, opt, console=plain_console(), scaler=scaler) as gw:
        amp_loop(model, opt, scaler, 12, nan_loss_from=0)
    (w,) = [f for f in gw.findings if f.kind == "amp_overflow_persistent"]
    assert w.data["new_scale"] < 1.0 and "No update has gone through yet" in w.message


# https://github.com/IDEA-Research/DN-DETR/issues/18 (where zero_grad goes in an AMP loop)
def test_forgotten_zero_grad_under_a_scaler_is_reported_while_every_update_is_dropped() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=CALIBRATION)
    with gradwatch.watch(model, opt, console=plain_console(), scaler=scaler) as gw:
        for step in range(14):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()  # no zero_grad(): the first overflow's Inf never leaves .grad
            scaler.step(opt)
            scaler.update()
            if step == 8:
                found = [f for f in gw.findings if f.kind == "zero_grad_missing"]
                assert [(f.step, f.severity) for f in found] == [(7, "error")], kinds(gw.findings)
    (f,) = [f for f in gw.findings if f.kind == "zero_grad_missing"]
    assert "steps 0-7" in f.message and "optimizer.zero_grad()" in f.message
    assert not [f for f in gw.findings if f.kind == "amp_overflow_persistent"]


def _classifier_amp_loop(scaler: torch.amp.GradScaler, steps: int, clear_every: int) -> list[gradwatch.Finding]:
    """scaler.step()/update() every batch, zero_grad() every ``clear_every`` batches (1: the healthy loop)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, console=plain_console(), scaler=scaler) as gw:
        for i in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if (i + 1) % clear_every == 0:
                opt.zero_grad()
    return gw.findings


def test_zero_grad_every_few_steps_behind_scaler_dropped_steps_is_missing_zero_grad_naming_an_applied_update() -> None:
    # Reproduces a tester's report: the bug (zero_grad every 4th batch, the scaler steps every batch) was
    # called zero_grad_in_accumulation at step 16 (the passes "thrown away" were the scaler's dropped steps
    # 13-15), then zero_grad_missing "not cleared after the update of step 13", a dropped step.
    findings = _classifier_amp_loop(torch.amp.GradScaler("cpu", init_scale=2.0**30), 24, clear_every=4)
    assert [f.kind for f in findings if f.severity != "info"] == ["zero_grad_missing"], kinds(findings)
    (f,) = [f for f in findings if f.kind == "zero_grad_missing"]
    assert (f.step, f.data["previous_step"]) == (17, 16) and "after the update of step 16" in f.message
    assert ("amp_overflow", 13) in kinds(findings)  # steps 13-15 dropped


def test_runs_of_scaler_dropped_steps_in_a_healthy_loop_are_not_zero_grad_in_accumulation() -> None:
    # Must not flag: zero_grad() every batch; the scale grows after every update (growth_interval=1) and
    # overflows again for a few batches. Those batches' passes, cleared before the next, were the dropped
    # steps' own: two such checks in a row were called zero_grad_in_accumulation.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_factor=4096.0, backoff_factor=0.125,
                                  growth_interval=1)
    findings = _classifier_amp_loop(scaler, 40, clear_every=1)
    assert [f.kind for f in findings if f.severity != "info"] == [], kinds(findings)
    assert len([f for f in findings if f.kind == "amp_overflow"]) >= 3


def test_amp_accumulation_recipe_whose_first_update_is_a_flushed_remainder_is_silent() -> None:
    # Must not flag: the AMP docs' accumulation recipe (k=3, the epoch's last 2 batches flushed); the scaler
    # drops the first 13 updates, so the first one applied is a 2-batch flush and later windows sum 3:
    # that is not an epoch's remainder carried into the next update (accumulation_remainder).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g) * 3, torch.randint(0, 4, (8,), generator=g)) for _ in range(20)]
    with gradwatch.watch(model, opt, console=plain_console(), scaler=scaler) as gw:
        for _ in range(3):
            for i, (x, y) in enumerate(data):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss / 3).backward()
                if (i + 1) % 3 == 0 or i + 1 == len(data):
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
    assert kinds(gw.findings) == [("amp_overflow", 0)]
    assert gw.findings[0].data["overflow_steps"] == 13


def test_fused_optimizer_norms_are_of_unscaled_gradients() -> None:
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=CALIBRATION)
    reference: list[float] = []
    reported: list[float] = []

    def on_step(step: int, when: str) -> None:
        if when == "before" and step >= 9:
            grads = [p.grad for p in model.parameters()]
            reference.append(torch.nn.utils.get_total_norm(grads).item() / scaler.get_scale())
        if when == "after" and step >= 9:
            reported.append(gw.engine.history.last[0].total_norm)

    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        amp_loop(model, opt, scaler, 14, on_step=on_step)
    assert reported == pytest.approx(reference, rel=1e-4)
    assert kinds(gw.findings) == [("amp_overflow", 0)] and gw.findings[0].data["overflow_steps"] == 9


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradient_norms_accumulate_in_float32(dtype: torch.dtype) -> None:
    weight = nn.Parameter(torch.zeros(300, dtype=dtype))
    model = nn.Module()
    model.weight = weight
    opt = torch.optim.SGD([weight], lr=0.0)
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        weight.grad = torch.full((300,), 1e3, dtype=dtype)  # sum of squares 3e8 overflows fp16
        opt.step()
    assert gw.findings == []
    assert gw.engine.history.last[0].total_norm == pytest.approx(math.sqrt(300) * 1e3, rel=1e-2)


# -- Lightning -----------------------------------------------------------------------------------------
def _lightning() -> Any:
    return pytest.importorskip("lightning.pytorch")


@pytest.mark.parametrize("fused", [False, True], ids=["unscaled-in-hook", "fused-still-scaled"])
def test_lightning_16_mixed_overflow_steps_are_info_and_norms_unscaled(fused: bool) -> None:
    pl = _lightning()
    from lightning.pytorch.plugins import MixedPrecision

    from gradwatch.lightning import GradWatchCallback

    scaler = torch.amp.GradScaler("cpu", init_scale=CALIBRATION)
    reference: list[float] = []
    reported: list[float] = []

    class Record(pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad for p in pl_module.parameters()]
            divide = scaler.get_scale() if fused else 1.0
            reference.append(torch.nn.utils.get_total_norm(grads).item() / divide)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            reported.append(cb.engine.history.last[0].total_norm)

    cb = GradWatchCallback(console=plain_console())
    model = tiny_module(pl)
    if fused:
        model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    trainer = tiny_trainer(pl, [cb, Record()], max_steps=14, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    trainer.fit(model)
    (f,) = cb.findings
    assert (f.kind, f.step, f.data["overflow_steps"]) == ("amp_overflow", 0, 10)
    assert cb.engine.steps_skipped == 0 and trainer.global_step == 14
    assert reported[10:] == pytest.approx(reference[10:], rel=1e-4)


# https://github.com/ecmwf/WeatherGenerator/issues/2724: under a GradScaler a NaN loss was only "the scaler
# silently rejecting the step".
def test_lightning_16_mixed_nan_loss_is_a_nonfinite_loss_not_a_normal_overflow() -> None:
    pl = _lightning()
    from lightning.pytorch.plugins import MixedPrecision

    from gradwatch.lightning import GradWatchCallback

    scaler = torch.amp.GradScaler("cpu", init_scale=CALIBRATION)
    cb = GradWatchCallback(console=plain_console())
    trainer = tiny_trainer(pl, [cb], max_steps=14, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    trainer.fit(tiny_module(pl, nan_at=12))
    found = kinds(cb.findings)
    assert ("nonfinite_loss", 12) in found, found
    assert "not a normal overflow" in next(f.message for f in cb.findings if f.kind == "nonfinite_loss")
    assert cb.engine.steps_skipped == 0  # the scaler dropped it; gradwatch had nothing left to skip


def test_nan_batch_dropped_by_the_scaler_without_an_observed_loss_is_reported() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, console=False, scaler=scaler) as gw:
        for step in range(8):
            x = torch.randn(8, 4, generator=g)
            if step == 5:
                x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()  # not observed
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    found = kinds(gw.findings)
    assert ("nonfinite_input", 5) in found and ("nonfinite_grad", 5) in found, found


def test_lightning_bf16_mixed_nan_is_skipped_as_usual() -> None:
    pl = _lightning()
    from gradwatch.lightning import GradWatchCallback

    cb = GradWatchCallback(console=plain_console(), escalate=False)
    trainer = tiny_trainer(pl, [cb], max_steps=5, precision="bf16-mixed")
    trainer.fit(tiny_module(pl, nan_at=2))
    assert {(f.kind, f.step) for f in cb.findings} == {("nonfinite_loss", 2), ("nonfinite_grad", 2)}
    assert cb.engine.steps_skipped == 1


# https://discuss.pytorch.org/t/adam-half-precision-nans/1765 (model.half() with Adam: eps=1e-8 is 0 in fp16)
def _train(model: nn.Module, opt: Any, loss_of: Any, steps: int, watched: bool,
           **config: Any) -> tuple[nn.Module, list[gradwatch.Finding]]:
    """``steps`` plain updates of ``loss_of(generator)``, watched or not: the model and gradwatch's findings."""
    g = torch.Generator().manual_seed(0)
    gw = gradwatch.watch(model, opt, console=False, **config) if watched else None
    for _ in range(steps):
        loss = loss_of(g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if gw is None:
        return model, []
    gw.close()
    return model, gw.findings


def _half_run(make_opt: Any, watched: bool, steps: int = 4) -> tuple[nn.Module, list[gradwatch.Finding]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    return _train(model, make_opt(model.parameters()),
                  lambda g: (model(torch.randn(16, 8, generator=g).half()).float() - 1).pow(2).mean(), steps, watched)


@pytest.mark.parametrize(
    "make_opt",
    [lambda p: torch.optim.Adam(p, lr=1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3),
     lambda p: torch.optim.RMSprop(p, lr=1e-3, eps=1e-8)],
    ids=["Adam", "AdamW", "RMSprop"],
)
def test_float16_parameters_with_an_eps_that_rounds_to_zero_are_not_updated_with_nan(make_opt: Any) -> None:
    bare, _ = _half_run(make_opt, watched=False)
    assert not all(torch.isfinite(p).all() for p in bare.parameters())  # what happens unwatched
    torch.manual_seed(0)
    before = [p.detach().clone() for p in nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half().parameters()]
    model, findings = _half_run(make_opt, watched=True)
    assert [(f.kind, f.step) for f in findings] == [("nonfinite_update", 0)]
    assert "eps=1e-08 rounds to 0 in float16" in findings[0].message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # every such step skipped


def test_float16_parameters_with_an_eps_float16_holds_are_updated_silently() -> None:
    bare, _ = _half_run(lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-4), watched=False)
    model, findings = _half_run(lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-4), watched=True)
    assert findings == []
    assert all(torch.equal(a, b) for a, b in zip(bare.parameters(), model.parameters()))


def _unused_rows_run(eps: float, watched: bool) -> tuple[nn.Module, list[gradwatch.Finding]]:
    """float32 Adam over an embedding whose rows 10..19 no batch reads: their gradient is exactly 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    return _train(model, opt, lambda g: model(torch.randint(0, 10, (8, 4), generator=g)).pow(2).mean(), 4, watched,
                  max_skips=None)


def test_float32_adam_with_eps_zero_is_not_updated_with_nan_where_a_gradient_stayed_zero() -> None:
    bare, _ = _unused_rows_run(0.0, watched=False)
    assert not torch.isfinite(bare[0].weight[10:]).all()  # unwatched: 0 / 0 in the rows no batch read
    torch.manual_seed(0)
    before = [p.detach().clone() for p in nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(32, 1)).parameters()]
    model, findings = _unused_rows_run(0.0, watched=True)
    assert [(f.kind, f.step) for f in findings] == [("nonfinite_update", 0)]
    assert "its eps is 0" in findings[0].message and "eps=1e-8" in findings[0].fix
    assert "0.weight" in findings[0].params  # the embedding, whose unread rows keep a zero second moment
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # every such step skipped


def test_float32_adam_with_its_default_eps_and_rows_never_read_is_silent() -> None:
    bare, _ = _unused_rows_run(1e-8, watched=False)
    model, findings = _unused_rows_run(1e-8, watched=True)
    assert findings == []
    assert all(torch.equal(a, b) for a, b in zip(bare.parameters(), model.parameters()))


def test_scaler_created_mid_run_is_found_by_a_later_check() -> None:
    """The plain loop's GradScaler is looked for on the first checks and then every SCAN_EVERY-th one
    (a stack walk per step costs ~20 us): one created at step 40 is found, and its overflow steps are
    no incident."""
    from gradwatch.observe.amp import SCAN_EVERY, AmpMonitor

    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        for step in range(40):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        (amp,) = [e for e in gw.engine.extensions if isinstance(e, AmpMonitor)]
        assert amp.scaler is None
        scaler = torch.amp.GradScaler("cpu", init_scale=CALIBRATION)
        amp_loop(model, opt, scaler, SCAN_EVERY + 12)
        assert amp.scaler is scaler
    assert not [f for f in gw.findings if f.severity == "error"]
    assert gw.engine.steps_skipped == 0


# -- several optimizers sharing one scaler (a GAN) -----------------------------------------------------
def _gan_scaler_loop(watched: bool, steps: int, *, nan_real_at: int | None = None, observe_g: bool = False,
                     fp16: bool = False, init_scale: float = 1024.0) -> tuple[Any, list[bool], torch.Tensor]:
    """DCGAN-style loop: one watcher over ``ModuleDict{G, D}`` with ``[opt_d, opt_g]``, one GradScaler stepped
    and updated per optimizer (as Fabric's "16-mixed" does); ``errD`` is observed (``errG`` too if asked).
    Returns the watcher, whether G's update was applied at each iteration, and every weight at the end."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=100)
    gw = gradwatch.watch(nn.ModuleDict({"G": G, "D": D}), [opt_d, opt_g], console=plain_console()) if watched else None
    crit = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    g_applied = []

    def step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for it in range(steps):
        real, noise = torch.randn(16, 8, generator=g).tanh(), torch.randn(16, 4, generator=g)
        if it == nan_real_at:
            real[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            D.zero_grad()
            out, fake = D(real).float(), G(noise)
            out2 = D(fake.detach()).float()
            err_d = crit(out, torch.ones_like(out)) + crit(out2, torch.zeros_like(out2))
        if gw is not None:
            gw.observe_loss(err_d)
        step(opt_d, err_d)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            G.zero_grad()
            out3 = D(fake).float()
            err_g = crit(out3, torch.ones_like(out3))
        if gw is not None and observe_g:
            gw.observe_loss(err_g)
        before = [p.detach().clone() for p in G.parameters()]
        step(opt_g, err_g)
        g_applied.append(any(not torch.equal(b, p) for b, p in zip(before, G.parameters())))
    if gw is not None:
        gw.close()
    return gw, g_applied, torch.cat([p.detach().flatten() for p in [*G.parameters(), *D.parameters()]])


@pytest.mark.parametrize("observe_g", [False, True], ids=["errD-observed", "both-observed"])
def test_gan_nan_batch_dropped_for_d_by_a_shared_scaler_never_skips_g(observe_g: bool) -> None:
    # Reported by a tester: GAN, one watcher over {G, D} with [opt_d, opt_g] and one GradScaler, only errD
    # observed; a NaN real batch made the scaler drop D's step, and gradwatch held D's NaN loss against G's
    # healthy update and skipped it ("every gradient is finite"): the watched run diverged.
    _, applied_ref, ref = _gan_scaler_loop(False, 8, nan_real_at=5)
    gw, applied, got = _gan_scaler_loop(True, 8, nan_real_at=5, observe_g=observe_g)
    assert applied == applied_ref == [True] * 8  # G's update at 5 went through, as without gradwatch
    assert torch.equal(ref, got)
    assert gw.engine.steps_skipped == 0
    (loss,) = [f for f in gw.findings if f.kind == "nonfinite_loss"]
    assert (loss.step, loss.data["optimizer"], loss.data["dropped_by_scaler"]) == (5, 0, True)  # D's dropped step
    assert not [f for f in gw.findings if f.severity == "error" and f.step != 5], kinds(gw.findings)


@pytest.mark.parametrize("observe_g", [False, True], ids=["errD-observed", "both-observed"])
def test_healthy_fp16_gan_with_calibration_overflows_under_a_shared_scaler_is_quiet(observe_g: bool) -> None:
    # Must not flag: the scaler's first steps overflow (init_scale 2**24) for D and G alike.
    _, _, ref = _gan_scaler_loop(False, 24, fp16=True, init_scale=CALIBRATION)
    gw, _, got = _gan_scaler_loop(True, 24, fp16=True, init_scale=CALIBRATION, observe_g=observe_g)
    assert torch.equal(ref, got)
    assert gw.engine.steps_skipped == 0
    assert [f.kind for f in gw.findings if f.severity != "info"] == [], kinds(gw.findings)
    assert any(f.kind == "amp_overflow" for f in gw.findings)  # overflow steps did happen


# -- clip_grad_norm_(error_if_nonfinite=True) on the scaler's overflow ---------------------------------
def clip_loop(model: nn.Module, opt: Any, scaler: Any, steps: int, gw: Any, *, unscale: bool = True,
              nan_batch_at: int | None = None) -> None:
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(16, 4, generator=g)
        if step == nan_batch_at:
            x[0, 0] = float("nan")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        gw.observe_loss(loss)
        opt.zero_grad()
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        scaler.step(opt)
        scaler.update()


# A known pitfall (Lightning PR #16715 review, lightly-ai/lightly-train#255): clipping with
# error_if_nonfinite=True crashes fp16 training on the GradScaler's normal first overflow.
@pytest.mark.parametrize("how", ["scaler-handed", "scaler-on-traceback", "clipped-before-unscale"])
def test_clip_raising_on_the_scalers_first_overflow_is_explained_as_the_overflow(how: str) -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=CALIBRATION)
    # Not handed: the overflow comes before any scaler.step() could show it; the loop's variable is found.
    extra = {"scaler": scaler} if how == "scaler-handed" else {}
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped") as raised:
        with gradwatch.watch(model, opt, console=plain_console(), **extra) as gw:
            clip_loop(model, opt, scaler, 4, gw, unscale=how != "clipped-before-unscale")
    assert raised.value.__traceback__ is not None and "error_if_nonfinite=False" in str(raised.value)  # untouched
    (f,) = gw.findings
    assert (f.kind, f.severity, f.step) == ("amp_overflow", "error", 0)
    assert f.data["raised"] == "RuntimeError" and f.data["scale"] == CALIBRATION
    assert "overflow" in f.message and "error_if_nonfinite=False" in f.message and "scaler.unscale_" in f.message
    assert "log/sqrt" not in f.message
    assert ("still scaled" in f.message) == (how == "clipped-before-unscale")


def test_clip_raising_on_a_nan_batch_under_a_scaler_is_not_called_an_overflow() -> None:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with pytest.raises(RuntimeError, match="cannot be clipped"):
        with gradwatch.watch(model, opt, console=plain_console(), scaler=scaler) as gw:
            clip_loop(model, opt, scaler, 6, gw, nan_batch_at=3)
    assert "amp_overflow" not in gw.summary().kind_counts
    assert kinds(gw.findings) == [("nonfinite_grad", 3), ("nonfinite_input", 3)]  # the batch is named


# -- streaks of dropped updates that are not calibration ---------------------------------------------------
def _drops(init_scale: float, steps: int, hand_scaler: bool) -> list[gradwatch.Finding]:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    extra = {"scaler": scaler} if hand_scaler else {}
    with gradwatch.watch(model, opt, console=plain_console(), **extra) as gw:
        amp_loop(model, opt, scaler, steps)
    return gw.findings


@pytest.mark.parametrize("hand_scaler", [True, False], ids=["scaler-handed", "scaler-found"])
def test_run_that_ends_while_the_scaler_drops_every_update_is_a_warning_at_close(hand_scaler: bool) -> None:
    # init_scale 2**60: every fp16 gradient overflows for far more than the run's 20 steps (the scale only
    # halves once per step), so no update ever goes through.
    (f,) = _drops(2.0**60, 20, hand_scaler)
    assert (f.kind, f.severity, f.step, f.data["overflow_steps"]) == ("amp_overflow", "warning", 19, 20)
    assert f.data["open_at_end"] and "no update went through at all" in f.message
    assert "init_scale" in f.message.split("Fix:")[1]


@pytest.mark.parametrize("hand_scaler", [True, False], ids=["scaler-handed", "scaler-found"])
def test_most_updates_dropped_by_a_far_too_high_init_scale_is_a_warning_not_normal(hand_scaler: bool) -> None:
    # init_scale 2**40 where about 2**15 fits: about 25 of the run's 30 updates are dropped before one goes through.
    (f,) = _drops(2.0**40, 30, hand_scaler)
    assert (f.kind, f.severity, f.step) == ("amp_overflow", "warning", 0)
    assert 16 <= f.data["overflow_steps"] < 30 and "normal" not in f.message


@pytest.mark.parametrize("hand_scaler", [True, False], ids=["scaler-handed", "scaler-found"])
def test_a_far_too_high_init_scale_is_reported_while_the_run_goes_on_not_only_at_close(hand_scaler: bool) -> None:
    # init_scale 2**60: no update can go through for ~45 steps. No optimizer step ever runs, so no check of
    # gradwatch's either; the warning comes from backward, after 32 dropped updates, naming init_scale.
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    extra = {"scaler": scaler} if hand_scaler else {}
    with gradwatch.watch(model, opt, console=plain_console(), **extra) as gw:
        amp_loop(model, opt, scaler, 36)
        during = list(gw.findings)
    (f,) = during
    assert (f.kind, f.severity, f.step) == ("amp_overflow_persistent", "warning", 31)
    assert "No update has gone through yet" in f.message and "init_scale" in f.message.split("Fix:")[1]
    assert [g.kind for g in gw.findings] == ["amp_overflow_persistent", "amp_overflow"]  # and the streak at close


def test_a_training_script_s_module_level_scaler_is_found_at_close(tmp_path: Any) -> None:
    # A script's top-level frame holds its variables twice (its locals are its globals): one scaler, not two.
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        "import gradwatch\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "scaler = torch.amp.GradScaler('cpu', init_scale=2.0**60)\n"
        "gw = gradwatch.watch(model, opt, console=False)\n"
        "for step in range(20):\n"
        "    with torch.autocast('cpu', dtype=torch.float16):\n"
        "        loss = model(torch.randn(16, 4)).pow(2).mean()\n"
        "    opt.zero_grad()\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
        "gw.close()\n"
    )
    import runpy

    found = runpy.run_path(str(script), run_name="__main__")["gw"].findings
    assert [(f.kind, f.severity, f.data["overflow_steps"]) for f in found] == [("amp_overflow", "warning", 20)]


def test_lightning_fit_that_ends_while_the_scaler_drops_every_update_is_a_warning() -> None:
    pl = _lightning()
    from lightning.pytorch.plugins import MixedPrecision

    from gradwatch.lightning import GradWatchCallback

    cb = GradWatchCallback(console=plain_console())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    trainer = tiny_trainer(pl, [cb], max_steps=20, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    trainer.fit(tiny_module(pl))
    warnings = [f for f in cb.findings if f.kind == "amp_overflow" and f.severity == "warning"]
    assert len(warnings) == 1 and warnings[0].data["overflow_steps"] == 20 and warnings[0].data["open_at_end"]
