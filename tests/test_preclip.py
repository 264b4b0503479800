"""Plain loops: gradwatch's norms are the gradients backward produced, before the loop clips them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gradwatch


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True) * 0.3


def _clipped_run(clip: Any, steps: int = 120, weight_from: int | None = 80, **config: Any) -> gradwatch.Watcher:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, **config) as gw:
        for step in range(steps):
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            if weight_from is not None and step >= weight_from:
                loss = loss * 1e4  # a loss weighted 1e4x by mistake
            opt.zero_grad()
            loss.backward()
            clip(model.parameters())
            opt.step()
    return gw


def _norm_clip(params: Any) -> None:
    torch.nn.utils.clip_grad_norm_(params, 1.0)


def _value_clip(params: Any) -> None:
    torch.nn.utils.clip_grad_value_(params, 0.01)


@pytest.mark.parametrize("clip", [_norm_clip, _value_clip], ids=["clip_grad_norm_", "clip_grad_value_"])
def test_loss_weighted_1e4x_is_exploding_although_the_loop_clips(clip: Any) -> None:
    gw = _clipped_run(clip)
    exploding = [f for f in gw.findings if f.kind == "exploding_grad"]
    assert exploding, [f.kind for f in gw.findings]
    assert min(f.step for f in exploding) >= 80


def test_pre_clip_total_norm_and_clip_ratio_reach_tensorboard(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _clipped_run(_norm_clip, steps=100, log_dir=str(tmp_path))
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    total = {e.step: e.value for e in acc.Scalars("gradwatch/grad_norm/total")}
    ratio = {e.step: e.value for e in acc.Scalars("gradwatch/clip_ratio")}
    assert total[95] > 100.0  # far above the max_norm of 1.0 that the loop clips to
    assert ratio[95] < 0.01
    assert ratio[95] == pytest.approx(1.0 / total[95], rel=1e-3)


def _nan_run(plant: str) -> gradwatch.Watcher:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    poisoned = [False]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if not poisoned[0]:
            return grad
        grad = grad.clone()
        grad[0] = float("nan")
        return grad

    model[2].bias.register_hook(poison)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(6):
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            poisoned[0] = step == 3 and plant == "backward"
            loss.backward()
            if step == 3 and plant == "loop":
                model[2].bias.grad[0] = float("nan")  # written by the loop after backward
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # spreads one NaN to every gradient
            opt.step()
    return gw


def test_nan_gradient_is_named_before_clip_grad_norm_spreads_it() -> None:
    gw = _nan_run("backward")
    nonfinite = [f for f in gw.findings if f.kind == "nonfinite_grad"]
    assert [f.step for f in nonfinite] == [3]
    assert nonfinite[0].params == ("2.bias",)


def test_nan_written_after_backward_still_blocks_the_update() -> None:
    gw = _nan_run("loop")
    nonfinite = [f for f in gw.findings if f.kind == "nonfinite_grad"]
    assert [f.step for f in nonfinite] == [3]  # skipped: the weights stay finite, step 4 is clean
    assert gw.engine.steps_skipped == 1


def test_grad_scaler_unscaled_then_clipped_shows_unscaled_pre_clip_norms(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    norms = []
    with gradwatch.watch(model, opt, console=False, log_dir=str(tmp_path)):
        for step in range(10):
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y) * 1e3
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            scaler.step(opt)
            scaler.update()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    total = {e.step: e.value for e in acc.Scalars("gradwatch/grad_norm/total")}
    for step, norm in enumerate(norms):
        assert total[step] == pytest.approx(norm, rel=1e-3)


def test_healthy_gpt_style_loop_clipping_every_step_is_silent() -> None:
    torch.manual_seed(0)
    vocab, width, seq = 32, 32, 16
    model = nn.Sequential(
        nn.Embedding(vocab, width),
        nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True),
        nn.Linear(width, vocab),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    data = torch.randint(0, vocab, (64, seq + 1), generator=torch.Generator().manual_seed(1))
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(60):
            for group in opt.param_groups:
                group["lr"] = 1e-3 * min(1.0, (step + 1) / 10)
            chunk = data[(step * 8) % 64 : (step * 8) % 64 + 8]
            logits = model(chunk[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), chunk[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert [f.kind for f in gw.findings] == []


def test_accumulating_loop_that_clips_sees_the_accumulated_pre_clip_norm(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    norms = []
    with gradwatch.watch(model, opt, console=False, log_dir=str(tmp_path)):
        for step in range(8):
            opt.zero_grad()
            for micro in range(3):
                x, y = _batch(10 * step + micro)
                (nn.functional.mse_loss(model(x), y) * 100).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
            opt.step()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    total = {e.step: e.value for e in acc.Scalars("gradwatch/grad_norm/total")}
    for step, norm in enumerate(norms):
        assert total[step] == pytest.approx(norm, rel=1e-3)


def test_grad_scaler_without_clipping_shows_unscaled_norms_and_no_clip_ratio(tmp_path: Any) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    norms = []
    with gradwatch.watch(model, opt, console=False, log_dir=str(tmp_path)) as gw:
        for step in range(6):
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])) / 1024.0)
            scaler.step(opt)
            scaler.update()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    total = {e.step: e.value for e in acc.Scalars("gradwatch/grad_norm/total")}
    assert all(total[step] == pytest.approx(norm, rel=1e-3) for step, norm in enumerate(norms))
    assert "gradwatch/clip_ratio" not in acc.Tags()["scalars"] and gw.findings == []
