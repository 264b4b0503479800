"""Lightning set-ups users report, watched by ``GradWatchCallback``: the healthy ones stay silent, the buggy
ones are found where they happen.

Each LightningModule is written once as a mixin and combined with the ``LightningModule`` of the namespace
under test (``lightning.pytorch`` or ``pytorch_lightning``). Every fit runs a few dozen steps at most.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import plain_console, tiny_trainer
from torch import nn

pytest.importorskip("lightning.pytorch")
pytest.importorskip("pytorch_lightning")

from gradwatch import Finding
from gradwatch.lightning import GradWatchCallback

pytestmark = pytest.mark.usefixtures("no_internal_failures")

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


# -- helpers ---------------------------------------------------------------------------------------
def callback() -> GradWatchCallback:
    return GradWatchCallback(console=plain_console())


def show(findings: list[Finding]) -> str:
    return "\n".join(f"  {f.kind}@{f.step} [{f.severity}] module={f.module}" for f in findings) or "  (none)"


def problems(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity in ("warning", "error")]


def trainer(ns: Any, callbacks: list[Any], **kwargs: Any) -> Any:
    """``tiny_trainer`` for 8 steps unless told otherwise."""
    return tiny_trainer(ns, callbacks, **{"max_steps": 8, **kwargs})


def loader(n: int = 64, batch_size: int = 8, seed: int = 0) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


_BUILT: dict[tuple[str, type], type] = {}


def build(ns: Any, mixin: type, **kwargs: Any) -> Any:
    key = (ns.__name__, mixin)
    if key not in _BUILT:
        _BUILT[key] = type(mixin.__name__, (mixin, ns.LightningModule), {})
    return _BUILT[key](**kwargs)


# == clipping done by the LightningModule's own code, before the callback's check ==================
class ManualClipping:
    """Manual optimization clipping with ``self.clip_gradients`` between ``manual_backward`` and
    ``opt.step()`` (the Lightning docs' recipe); from ``scale_from`` on, the loss is weighted 1e4x (a loss
    weight typo switched on by a schedule)."""

    def __init__(self, scale_from: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.scale_from = scale_from

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.scale_from is not None and self.global_step >= self.scale_from:
            loss = loss * 1e4
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> Any:
        return loader()


class ClipInOnAfterBackward:
    """Automatic optimization clipping in ``on_after_backward`` (before ``on_before_optimizer_step``);
    ``clip=False`` leaves clipping to the Trainer."""

    def __init__(self, scale_from: int | None = None, clip: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.scale_from, self.clip = scale_from, clip

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.scale_from is not None and self.global_step >= self.scale_from:
            loss = loss * 1e4
        return loss

    def on_after_backward(self) -> None:
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=1.0)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> Any:
        return loader()


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("module", [ManualClipping, ClipInOnAfterBackward], ids=["clip_gradients", "on_after_backward"])
def test_clipping_in_the_module_with_healthy_training_is_silent(namespace: str, module: type) -> None:
    ns = pytest.importorskip(namespace)
    cb = callback()
    trainer(ns, [cb], max_steps=24).fit(build(ns, module))
    assert problems(cb.findings) == [], show(cb.findings)


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("module", [ManualClipping, ClipInOnAfterBackward], ids=["clip_gradients", "on_after_backward"])
def test_loss_weighted_1e4x_is_exploding_on_the_norms_before_the_modules_own_clipping(
    namespace: str, module: type
) -> None:
    # The module clips to norm 1 before the callback's check: measured there, the gradient never looks
    # large. gradwatch takes the norms at the end of backward, as in a plain loop.
    ns = pytest.importorskip(namespace)
    cb = callback()
    trainer(ns, [cb], max_steps=16).fit(build(ns, module, scale_from=12))
    exploding = [f for f in cb.findings if f.kind == "exploding_grad"]
    assert [f.step for f in exploding] == [12], show(cb.findings)
    text = exploding[0].message
    # The user clips already: told so, with the factor, not told to add Trainer(gradient_clip_val=...).
    assert "the LightningModule's own code" in text and "scaled this step's gradient down" in text
    assert "clipping is in place (keep it)" in text
    assert "gradient_clip_val" not in text


def test_trainer_gradient_clip_val_is_still_named_as_lightnings_clipping() -> None:
    # Trainer(gradient_clip_val=...) clips after the check: the words stay those of Lightning's clipping.
    ns = pytest.importorskip("lightning.pytorch")
    cb = callback()
    module = build(ns, ClipInOnAfterBackward, scale_from=12, clip=False)
    trainer(ns, [cb], max_steps=16, gradient_clip_val=1.0).fit(module)
    exploding = [f for f in cb.findings if f.kind == "exploding_grad"]
    assert [f.step for f in exploding] == [12], show(cb.findings)
    assert "Lightning's gradient clipping (gradient_clip_val=1)" in exploding[0].message


# == clipping before the GradScaler unscales (16-mixed with a scaler) ==============================
class AmpClipping:
    """Clips to norm 1 under fp16 AMP with a GradScaler: in manual optimization's ``training_step``
    (``where="training_step"``, the Lightning docs' recipe, https://github.com/Lightning-AI/pytorch-lightning/issues/18089),
    in ``on_after_backward`` (automatic optimization), or in ``on_before_optimizer_step`` (after unscaling)."""

    def __init__(self, where: str = "training_step") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = where == "on_after_backward"
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.where = where

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y)
        if self.automatic_optimization and self.where == "on_after_backward":
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self.where == "training_step":
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        return None

    def on_after_backward(self) -> None:
        if self.where == "on_after_backward":
            torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=1.0)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.where == "on_before_optimizer_step":
            self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        return loader()


def _fp16_fit(ns: Any, where: str) -> tuple[GradWatchCallback, float]:
    """A short fp16 fit on CPU (a real GradScaler) and how far the first layer's weight moved."""
    cb = callback()
    module = build(ns, AmpClipping, where=where)
    before = module.net[0].weight.detach().clone()
    plugin = ns.plugins.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer(ns, [cb], max_steps=12, plugins=[plugin]).fit(module)
    return cb, float((module.net[0].weight.detach() - before).norm())


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_manual_clip_gradients_before_opt_step_under_a_grad_scaler_is_clip_before_unscale(namespace: str) -> None:
    ns = pytest.importorskip(namespace)
    cb, moved = _fp16_fit(ns, "training_step")
    assert moved < 1e-3  # the weights barely move: each update is ~scale times too small
    found = [f for f in cb.findings if f.kind == "clip_before_unscale"]
    assert len(found) == 1, show(cb.findings)
    assert "self.clip_gradients" in found[0].message
    assert "def on_before_optimizer_step(self, optimizer)" in found[0].fix
    assert "scaler.unscale_" not in found[0].fix  # Lightning unscales itself; a second unscale_ raises


def test_clip_in_on_after_backward_under_a_grad_scaler_is_clip_before_unscale() -> None:
    ns = pytest.importorskip("lightning.pytorch")
    cb, _ = _fp16_fit(ns, "on_after_backward")
    found = [f for f in cb.findings if f.kind == "clip_before_unscale"]
    assert len(found) == 1, show(cb.findings)
    assert "on_after_backward" in found[0].message and "Trainer(gradient_clip_val=" in found[0].fix


def test_manual_clip_gradients_in_on_before_optimizer_step_under_a_grad_scaler_is_silent() -> None:
    # The fix: Lightning has unscaled by then. (The GradScaler's early dropped steps are amp_overflow infos.)
    ns = pytest.importorskip("lightning.pytorch")
    cb, moved = _fp16_fit(ns, "on_before_optimizer_step")
    assert moved > 0.05
    assert problems(cb.findings) == [], show(cb.findings)
