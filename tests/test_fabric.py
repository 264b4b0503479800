"""Lightning Fabric: ``gradwatch.watch`` on what ``fabric.setup`` returns (or on the model and optimizer
before it) checks every update, names the user's own parameters, and raises no false alarm."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console
from torch import nn

import gradwatch

L = pytest.importorskip("lightning")


def text_console() -> Console:
    return Console(file=io.StringIO(), width=120, color_system=None)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def fabric_loop(fabric, model, opt, steps: int, *, nan_at: int | None = None, accumulate: int = 1) -> None:
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            if step == nan_at and micro == 0:
                x[0, 0] = float("nan")
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(nn.functional.mse_loss(model(x), y) / accumulate)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("when", ["after_setup", "before_setup"])
def test_nan_batch_under_fabric_is_skipped_and_named_without_wrapper_segments(when: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, opt = net(), None
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if when == "before_setup":
        gw = gradwatch.watch(model, opt, console=text_console())
        fmodel, fopt = fabric.setup(model, opt)
    else:
        fmodel, fopt = fabric.setup(model, opt)
        gw = gradwatch.watch(fmodel, fopt, console=text_console())
    with gw:
        fabric_loop(fabric, fmodel, fopt, 30, nan_at=20)
    assert [(f.kind, f.step) for f in gw.findings if f.severity != "info"] == [
        ("nonfinite_grad", 20), ("nonfinite_input", 20)
    ]  # no unwatched_optimizer: Fabric's wrapper steps the watched Adam
    (grad,) = [f for f in gw.findings if f.kind == "nonfinite_grad"]
    assert set(grad.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert gw.engine.steps_skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_healthy_fabric_run_with_accumulation_is_quiet() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = net()
    fmodel, fopt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    with gradwatch.watch(fmodel, fopt, console=text_console()) as gw:
        fabric_loop(fabric, fmodel, fopt, 60, accumulate=4)
    assert gw.findings == []
    assert gw.engine.steps_checked == 60


def test_fabric_checkpoint_holds_the_watcher_and_a_resumed_run_keeps_its_step_numbers(tmp_path) -> None:
    """``fabric.save(path, {"model": ..., "optimizer": ..., "gradwatch": gw})`` raised "cannot pickle
    '_thread.RLock'": the watcher had no state_dict, so Fabric pickled the whole object."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = net()
    fmodel, fopt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    path = tmp_path / "ckpt.pt"
    with gradwatch.watch(fmodel, fopt, console=text_console()) as gw:
        fabric_loop(fabric, fmodel, fopt, 10)
        fabric.save(path, {"model": fmodel, "optimizer": fopt, "gradwatch": gw})
    assert path.exists()

    fabric2 = L.Fabric(accelerator="cpu", devices=1)
    model2 = net()
    fmodel2, fopt2 = fabric2.setup(model2, torch.optim.Adam(model2.parameters(), lr=1e-3))
    with gradwatch.watch(fmodel2, fopt2, console=text_console()) as gw2:
        fabric2.load(path, {"model": fmodel2, "optimizer": fopt2, "gradwatch": gw2})
        assert gw2.engine.steps_checked == 10
        fabric_loop(fabric2, fmodel2, fopt2, 5, nan_at=1)
    assert [(f.kind, f.step) for f in gw2.findings if f.kind == "nonfinite_grad"] == [("nonfinite_grad", 11)]


# A known pitfall (Lightning PR #16715 review, lightly-ai/lightly-train#255): fabric.clip_gradients (whose
# error_if_nonfinite is True by default) crashes "16-mixed" training on the GradScaler's normal first overflow.
def test_fabric_clip_gradients_raising_on_the_scalers_overflow_is_explained_as_the_overflow() -> None:
    from lightning.fabric.plugins.precision.amp import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # a CPU scaler stands in for a GPU's
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=MixedPrecision("16-mixed", "cpu", scaler=scaler))
    model = net()
    fmodel, fopt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    with pytest.raises(RuntimeError, match="cannot be clipped"):
        with gradwatch.watch(fmodel, fopt, console=text_console()) as gw:
            for _ in range(4):
                x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
                loss = nn.functional.mse_loss(fmodel(x).float(), y)
                fopt.zero_grad()
                fabric.backward(loss)
                fabric.clip_gradients(fmodel, fopt, max_norm=1.0)
                fopt.step()
    (f,) = gw.findings
    assert (f.kind, f.severity, f.step) == ("amp_overflow", "error", 0)
    assert "fabric.clip_gradients(model, optimizer, max_norm=..., error_if_nonfinite=False)" in f.message
