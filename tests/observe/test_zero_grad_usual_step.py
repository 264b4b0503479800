"""The zero-grad tracker's usual-step shortcut decides exactly as the general path.

Each loop runs twice: once as shipped, once with the shortcut (``ZeroGradTracker._usual_step``) turned off so that
every check takes the general path. After every iteration the tracker's state and the facts of the latest checked
step must be the same, and so must every finding; healthy loops must take the shortcut on most checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import EncoderHead
from torch import nn

import gradwatch
from gradwatch.observe.zero_grad import ZeroGradTracker

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 12


Net = EncoderHead


def _x(step: int, k: int = 0) -> torch.Tensor:
    return torch.randn(16, 4, generator=torch.Generator().manual_seed(100 * step + k))


def _loss(model: nn.Module, step: int, k: int = 0) -> torch.Tensor:
    return model(_x(step, k)).pow(2).mean()


# -- one iteration of each loop: (step, model, optimizers, scaler) ------------------------------------------
def _healthy(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad()
    _loss(model, step).backward()
    opts[0].step()


def _in_place(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad(set_to_none=False)
    _loss(model, step).backward()
    opts[0].step()


def _through_data(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.zero_()
    _loss(model, step).backward()
    opts[0].step()


def _forgotten_from_5(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    if step < 5:
        opts[0].zero_grad()
    _loss(model, step).backward()
    opts[0].step()


def _head_only_from_4(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    (model.head if step >= 4 else model).zero_grad()
    _loss(model, step).backward()
    opts[0].step()


def _encoder_only_from_4(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    (model.encoder if step >= 4 else model).zero_grad()
    _loss(model, step).backward()
    opts[0].step()


def _cleared_before_step_at_6(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad()
    _loss(model, step).backward()
    if step == 6:
        opts[0].zero_grad()
    opts[0].step()


def _two_passes(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad()
    for k in range(2):
        (_loss(model, step, k) / 2).backward()
    opts[0].step()


def _cleared_in_loop(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    for k in range(3 if 3 <= step < 8 else 1):
        opts[0].zero_grad()
        _loss(model, step, k).backward()
    opts[0].step()


def _between_passes_at_5(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad()
    _loss(model, step, 0).backward()
    if step == 5:
        model.head.bias.grad = None
        _loss(model, step, 1).backward()
    opts[0].step()


def _no_backward_at_4_and_5(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    if step not in (4, 5):
        opts[0].zero_grad()
        _loss(model, step).backward()
    opts[0].step()


def _replaced_without_backward_at_6(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    """No backward pass at step 4 (the re-pick that follows holds off the next one), and at step 6 new gradient
    tensors without one: cleared since the previous check, though no backward pass reached them."""
    if step == 6:
        for p in model.parameters():
            p.grad = p.grad.clone()
    elif step != 4:
        opts[0].zero_grad()
        _loss(model, step).backward()
    opts[0].step()


def _replaced_by_hand(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad()
    _loss(model, step).backward()
    if step in (3, 7):
        for p in model.parameters():
            p.grad = p.grad.clone()
    opts[0].step()


def _scaler_drops(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    if step % 3 != 2:  # every third batch keeps what the one before accumulated
        opts[0].zero_grad()
    scaler.scale(_loss(model, step)).backward()
    if step in (3, 4, 8):
        model.encoder[0].weight.grad[0, 0] = float("inf")  # an overflow: the scaler drops the step
    scaler.step(opts[0])
    scaler.update()


def _two_optimizers(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad()
    if step % 4 != 3:  # the head's optimizer forgets its zero_grad now and then
        opts[1].zero_grad()
    _loss(model, step).backward()
    opts[0].step()
    opts[1].step()


def _clipped(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad()
    _loss(model, step).backward()
    if step % 2:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # in place, after the last pass
    opts[0].step()


def _zeroed_in_place_before_step_from_6(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad()
    _loss(model, step).backward()
    if step >= 6:
        opts[0].zero_grad(set_to_none=False)
    opts[0].step()


def _gan(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    """The generator's loss goes through the discriminator (the head), whose gradient is not cleared before
    its own pass from step 4 on: the head's step spans the encoder's."""
    opts[0].zero_grad()
    if step < 4:
        opts[1].zero_grad()
    _loss(model, step).backward()
    opts[0].step()
    if step >= 4:
        model.head(model.encoder(_x(step, 1)).detach()).pow(2).mean().backward()
    opts[1].step()
    if step >= 4:
        opts[1].zero_grad()


def _zeroed_in_place_before_step_at_6(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad()
    _loss(model, step).backward()
    if step == 6:  # the next check reads the gradient right after backward (armed), then disarms
        opts[0].zero_grad(set_to_none=False)
    opts[0].step()


def _head_in_place_from_4(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    (model.head if step >= 4 else model).zero_grad(set_to_none=False)
    _loss(model, step).backward()
    opts[0].step()


def _encoder_only_at_4(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    (model.encoder if step == 4 else model).zero_grad()  # the next check names what accumulated
    _loss(model, step).backward()
    opts[0].step()


def _healthy_scaler_drops(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    opts[0].zero_grad()
    scaler.scale(_loss(model, step)).backward()
    if step in (3, 4, 8):
        model.encoder[0].weight.grad[0, 0] = float("inf")
    scaler.step(opts[0])
    scaler.update()


def _loss_side(step: int, model: Net, opts: list[Any], scaler: Any) -> None:
    """The optimizer also trains a temperature the model does not own (the representative); model.zero_grad()
    from step 5 on leaves it alone."""
    (model if step >= 5 else opts[0]).zero_grad()
    temperature = opts[0].param_groups[-1]["params"][0]
    (_loss(model, step) * temperature).backward()
    opts[0].step()


LOOPS: dict[str, Callable[[int, Net, list[Any], Any], None]] = {
    "healthy": _healthy,
    "in_place": _in_place,
    "through_data": _through_data,
    "forgotten": _forgotten_from_5,
    "head_only": _head_only_from_4,
    "encoder_only": _encoder_only_from_4,
    "cleared_before_step": _cleared_before_step_at_6,
    "two_passes": _two_passes,
    "cleared_in_loop": _cleared_in_loop,
    "between_passes": _between_passes_at_5,
    "no_backward": _no_backward_at_4_and_5,
    "replaced_by_hand": _replaced_by_hand,
    "replaced_without_backward": _replaced_without_backward_at_6,
    "scaler_drops": _scaler_drops,
    "two_optimizers": _two_optimizers,
    "clipped": _clipped,
    "zeroed_before_step": _zeroed_in_place_before_step_from_6,
    "gan": _gan,
    "zeroed_before_step_once": _zeroed_in_place_before_step_at_6,
    "head_in_place": _head_in_place_from_4,
    "encoder_only_once": _encoder_only_at_4,
    "healthy_scaler_drops": _healthy_scaler_drops,
    "loss_side": _loss_side,
}
#: Loops whose checks are mostly the usual step: how many of them at least (every check of each optimizer but
#: the first, which compares with no baseline; for two_optimizers, also the head's three forgotten zero_grad).
USUAL = {
    "healthy": STEPS - 1,
    "two_passes": STEPS - 1,
    "in_place": STEPS - 1,
    "two_optimizers": 2 * (STEPS - 1) - 3,
}


def _ref_is(ref: Any, t: Any) -> bool | None:
    return None if ref is None else ref() is t


def _tracker_state(t: Any) -> tuple[Any, ...]:
    """Everything a later check reads (the shortcut's own mark, ``usual_facts``, left out)."""
    rep_grad = t.rep.grad if t.rep is not None else None
    sentinel_grad = t.sentinel.grad if t.sentinel is not None else None
    return (
        t.rep_name,
        t.sentinel_name,
        t.base_step,
        t.base_version,
        _ref_is(t.base_ref, rep_grad),
        t.sentinel_version,
        _ref_is(t.sentinel_ref, sentinel_grad),
        t.accumulations,
        t.kept_passes,
        t.cleared,
        len(t.old_nonzero),
        t.post_nonzero is None,
        t.watch_after_backward,
        t.sampled is None,
        t.sample_of is None,
        t.snapshot is None,
        t.swap_after,
        t.repick_after,
    )


def _step_facts(gw: Any) -> list[tuple[Any, ...]]:
    out = []
    for i, stats in sorted(gw.engine.history.last.items()):
        extra = stats.extra
        zero_grad = dict(extra.get("zero_grad") or {})
        out.append(
            (
                i,
                stats.step,
                tuple(zero_grad.items()),  # keys in order too
                extra.get("zero_grad_missing"),
                extra.get("grads_cleared_before_step"),
                extra.get("cleared_between_backwards"),
            )
        )
    return out


def _run(name: str, monkeypatch: pytest.MonkeyPatch, *, shortcut: bool, **config: Any) -> tuple[list[Any], int]:
    """The loop's record (per iteration: tracker states and latest facts; then the findings) and how many
    checks took the shortcut."""
    taken = 0
    usual_step = ZeroGradTracker._usual_step

    def counted(self: ZeroGradTracker, ctx: Any, stats: Any, t: Any) -> bool:
        nonlocal taken
        done = usual_step(self, ctx, stats, t) if shortcut else False
        taken += done
        return done

    monkeypatch.setattr(ZeroGradTracker, "_usual_step", counted)
    torch.manual_seed(0)
    model = Net()
    if name in ("two_optimizers", "gan"):
        opts: list[Any] = [
            torch.optim.SGD(model.encoder.parameters(), lr=0.01),
            torch.optim.SGD(model.head.parameters(), lr=0.01),
        ]
    elif name == "loss_side":
        temperature = nn.Parameter(torch.ones(()))
        opts = [torch.optim.SGD([{"params": model.parameters()}, {"params": [temperature]}], lr=0.01)]
    else:
        opts = [torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)]
    scaled = name in ("scaler_drops", "healthy_scaler_drops")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
    extra = {"scaler": scaler} if scaler is not None else {}
    record: list[Any] = []
    with gradwatch.watch(model, opts if len(opts) > 1 else opts[0], console=False, **extra, **config) as gw:
        tracker = gw.engine.extension(ZeroGradTracker)
        for step in range(STEPS):
            LOOPS[name](step, model, opts, scaler)
            record.append(([_tracker_state(t) for t in tracker.trackers], _step_facts(gw)))
    record.append([(f.kind, f.step, f.message) for f in gw.findings])
    monkeypatch.undo()
    return record, taken


@pytest.mark.parametrize("deferred", [False, True], ids=["read-now", "deferred"])
@pytest.mark.parametrize("name", list(LOOPS))
def test_the_usual_step_shortcut_decides_as_the_general_path(
    name: str, deferred: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {"deferred": True, "on_nonfinite": "warn"} if deferred else {}
    fast, taken = _run(name, monkeypatch, shortcut=True, **config)
    general, _ = _run(name, monkeypatch, shortcut=False, **config)
    for step, (a, b) in enumerate(zip(fast, general)):
        assert a == b, f"{name}: iteration {step} differs"
    assert len(fast) == len(general)
    checks = STEPS * (2 if name in ("two_optimizers", "gan") else 1)
    if name in USUAL:
        assert taken >= USUAL[name], (name, taken)
    else:
        # (.data.zero_(): a lazy read decides; a loss-side representative: the model's gradient is compared too)
        assert 0 < taken < checks or name in ("through_data", "loss_side"), (name, taken)


def test_the_loops_plant_what_they_say() -> None:
    """The faulty loops do reach the general path's findings (so the comparison covers them)."""

    def kinds(name: str) -> set[str]:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        with gradwatch.watch(model, opt, console=False) as gw:
            for step in range(STEPS):
                LOOPS[name](step, model, [opt], None)
        return {f.kind for f in gw.findings}

    assert "zero_grad_missing" in kinds("forgotten")
    assert "zero_grad_missing" in kinds("head_only")
    assert "zero_grad_missing" in kinds("encoder_only")
    assert "grads_cleared_before_step" in kinds("cleared_before_step")
    assert "zero_grad_in_accumulation" in kinds("cleared_in_loop")
    assert "grads_cleared_before_step" in kinds("zeroed_before_step")


def test_a_generator_loss_through_the_discriminator_is_found_with_the_shortcut_on() -> None:
    torch.manual_seed(0)
    model = Net()
    opts = [torch.optim.SGD(model.encoder.parameters(), lr=0.01), torch.optim.SGD(model.head.parameters(), lr=0.01)]
    with gradwatch.watch(model, opts, console=False) as gw:
        for step in range(STEPS):
            _gan(step, model, opts, None)
    assert "grads_span_other_step" in {f.kind for f in gw.findings}
