"""Findings whose words must fit the user's set-up: a fix that says to add what the run already has, a flag
that is already set, or a step other than the one where things went wrong, is untrue for that user.

Real tiny training loops on CPU (plain loops, Lightning, two-process DDP on gloo); no mocks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import lightning_namespace, plain_console, tiny_data, tiny_trainer
from torch import nn

import gradwatch

pytestmark = pytest.mark.usefixtures("no_internal_failures")


# == gradients clipped by the user's own code: an exploding gradient is not "add clipping" ============
SCALE_FROM = 20  # the loss is weighted 1e4x from this step on (a loss-weight typo switched on by a schedule)


class _ClipsInItsOwnHook:
    """A LightningModule that clips in its own on_before_optimizer_step (which Lightning runs after the
    callbacks'), or not at all (``clip=False``)."""

    def __init__(self, clip: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.clip = clip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        return loss * (1e4 if self.global_step >= SCALE_FROM else 1.0)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(ns: Any, clip: bool) -> tuple[list[Any], str]:
    from gradwatch.lightning import GradWatchCallback

    module = type("ClipsInItsOwnHook", (_ClipsInItsOwnHook, ns.LightningModule), {})(clip=clip)
    console = plain_console(width=400)
    cb = GradWatchCallback(console=console)
    tiny_trainer(ns, [cb], max_steps=SCALE_FROM + 4).fit(module, tiny_data(n=256))
    return list(cb.findings), console.file.getvalue()


def _exploding_at_scale_step(findings: list[Any]) -> Any:
    first = next(f for f in findings if f.kind == "exploding_grad")
    assert first.step == SCALE_FROM
    return first


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_module_clipping_in_its_own_hook_is_not_told_to_add_clipping(namespace: str) -> None:
    findings, console = _fit(lightning_namespace(namespace), clip=True)
    f = _exploding_at_scale_step(findings)
    assert "gradient_clip_val" not in f.fix and "clip gradients" not in f.fix
    assert f.fix.startswith("clipping is in place (keep it); lower the learning rate")
    # the measured clip ratio of this step (norm ~6.7e4 clipped to 1): the update was bounded
    assert "scaled down" in f.explanation.why and "the weights did not move by this gradient's size" in f.explanation.why
    assert "a loss term that blew up" in f.explanation.why
    (spike,) = [s for s in findings if s.kind == "loss_spike"]
    assert spike.fix.startswith("clipping is in place (keep it)") and "gradient_clip_val" not in spike.fix
    # what the console printed is the worded-again finding, not the first words
    assert "clipping is in place (keep it); lower the learning rate or lengthen its warm-up" in console
    assert "Trainer(gradient_clip_val=1.0)" not in console


def test_lightning_module_that_does_not_clip_is_still_told_to_clip() -> None:
    findings, console = _fit(lightning_namespace("lightning.pytorch"), clip=False)
    f = _exploding_at_scale_step(findings)
    assert "clip gradients (Trainer(gradient_clip_val=1.0)" in f.fix
    assert "Trainer(gradient_clip_val=1.0)" in console


def test_plain_loop_that_clips_is_not_told_to_add_clipping() -> None:
    """The plain loop's own clip_grad_norm_ (measured between backward and step): the words Lightning now
    matches."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with gradwatch.watch(net, opt, console=plain_console()) as gw:
        for step in range(SCALE_FROM + 4):
            xb, yb = x[step * 8 : step * 8 + 8], y[step * 8 : step * 8 + 8]
            loss = F.mse_loss(net(xb), yb) * (1e4 if step >= SCALE_FROM else 1.0)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
    f = _exploding_at_scale_step(list(gw.findings))
    assert f.fix.startswith("clipping is in place (keep it); lower the learning rate")
    assert "scaled this step's gradient down" in f.explanation.why


# == DDP(find_unused_parameters=True) with a layer that forward never calls ===========================
REAL_DIST_WORKER = os.path.join(os.path.dirname(__file__), "_real_dist_worker.py")


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)
def test_none_grad_under_ddp_with_find_unused_parameters_does_not_ask_for_it(tmp_path: Any) -> None:
    import test_distributed

    codes, logs = test_distributed.launch(str(tmp_path), "unused_dynamic", timeout=60, worker=REAL_DIST_WORKER)
    assert codes == [0, 0], f"a rank failed or hung: {codes}\n" + "\n".join(logs)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())["unused_dynamic"]
        assert not isinstance(result.get("error"), str), result.get("error")
        (f,) = [f for f in result["findings"] if f["kind"] == "none_grad"]
        assert f["params"] == ["aux.weight", "aux.bias"]
        why, fix = f["explanation"]["why"], f["explanation"]["fix"]
        # It is set already: asking for it is untrue; what is true is that the layer is unused every step.
        assert "require find_unused_parameters=True" not in why
        assert "already has find_unused_parameters=True" in why and "unused on every step" in why
        assert "traverse the autograd graph after every forward" in why
        assert fix.startswith("remove them from the model, or use them in forward")


# == loss_diverging: the step where the loss left its range ===========================================
def _regression_batches(n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x @ torch.randn(8, 1, generator=g)


def test_loss_diverging_names_the_step_the_loss_left_its_range() -> None:
    """The loss weighted 1000x from step 15 (a loss-weight typo switched on by a schedule): the finding still
    comes once its last 10 checked losses are all up (step 24), and names step 15, where the loss jumped."""
    x, y = _regression_batches()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with gradwatch.watch(net, opt, console=plain_console()) as gw:
        for step in range(30):
            xb, yb = x[step * 8 : step * 8 + 8], y[step * 8 : step * 8 + 8]
            loss = F.mse_loss(net(xb), yb) * (1000.0 if step >= 15 else 1.0)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "loss_diverging"]
    assert f.step == 24  # when it fires is unchanged: the last 10 checked losses are all above 3x the start
    assert f.data["since"] == 15
    assert f.explanation is not None and f.explanation.what.startswith("The loss is diverging since step 15,")
