"""Forgotten ``zero_grad`` and autograd errors through a Lightning ``Trainer``: the same findings as in a
plain loop, detected from the gradients themselves (manual optimization never fires
``on_before_zero_grad``), and the original exception re-raised by ``trainer.fit``."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from helpers import tiny_data, tiny_trainer
from torch import nn

pl = pytest.importorskip("lightning.pytorch")
from gradwatch.lightning import GradWatchCallback

ZERO_KINDS = ("zero_grad_missing", "grads_cleared_before_step")


def net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Sigmoid(), nn.ReLU(), nn.Linear(16, 1))


class Manual(pl.LightningModule):
    """Manual optimization, one optimizer; ``zero`` says where zero_grad is called."""

    def __init__(self, zero: str = "before_backward") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.net = net()
        self.zero = zero

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.zero == "before_backward":
            opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return tiny_data()


class Automatic(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = net()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> Any:
        return tiny_data()


class Gan(pl.LightningModule):
    """D steps twice per G step; G's backward also fills D's gradients; each zeroed on its own schedule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.disc = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_d, opt_g = self.optimizers()
        x, _ = batch
        for _ in range(2):
            opt_d.zero_grad()
            fake = self.gen(torch.randn_like(x)).detach()
            self.manual_backward(self.disc(fake).mean() - self.disc(x).mean())
            opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(-self.disc(self.gen(torch.randn_like(x))).mean())
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.disc.parameters(), lr=0.01), torch.optim.SGD(self.gen.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return tiny_data()


class DocsGan(pl.LightningModule):
    """The Lightning docs' basic GAN (manual optimization), with or without toggle_optimizer."""

    def __init__(self, toggle: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.toggle = toggle
        self.generator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        if self.toggle:
            self.toggle_optimizer(opt_g)
        fake = self.generator(torch.randn_like(x))
        g_loss = bce(self.discriminator(fake), torch.ones(x.shape[0], 1))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        if self.toggle:
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
        real = bce(self.discriminator(x), torch.ones(x.shape[0], 1))
        fake_loss = bce(self.discriminator(fake.detach()), torch.zeros(x.shape[0], 1))
        self.manual_backward((real + fake_loss) / 2)
        opt_d.step()
        opt_d.zero_grad()
        if self.toggle:
            self.untoggle_optimizer(opt_d)

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.generator.parameters(), lr=2e-4),
                torch.optim.Adam(self.discriminator.parameters(), lr=2e-4))

    def train_dataloader(self) -> Any:
        return tiny_data()


def test_a_gan_without_toggle_optimizer_is_found_at_the_discriminators_first_step() -> None:
    # The generator's backward fills the discriminator's gradients; without toggle_optimizer (or a
    # zero_grad() before D's backward) D's step applies them on top of its own loss's
    # (Lightning-AI/pytorch-lightning#557, CompVis/taming-transformers#27). Nothing was reported.
    cb = fit(DocsGan(toggle=False), max_steps=8)
    (f,) = [f for f in cb.findings if f.kind == "grads_span_other_step"]
    assert f.step == 1 and f.data["optimizer"] == 1 and "toggle_optimizer" in f.message


def test_the_docs_gan_with_toggle_optimizer_is_silent() -> None:
    assert [f.kind for f in fit(DocsGan(toggle=True), max_steps=8).findings if f.severity != "info"] == []


def fit(module: Any, **trainer_kwargs: Any) -> GradWatchCallback:
    cb = GradWatchCallback(console=False)
    tiny_trainer(pl, [cb], **trainer_kwargs).fit(module)
    return cb


def zero_kinds(cb: GradWatchCallback) -> list[tuple[str, int]]:
    return [(f.kind, f.step) for f in cb.findings if f.kind in ZERO_KINDS]


# -- zero_grad -------------------------------------------------------------------------------------
def test_manual_optimization_without_zero_grad_is_flagged_at_step_1() -> None:
    cb = fit(Manual(zero="never"), max_steps=4)
    assert zero_kinds(cb) == [("zero_grad_missing", 1)]
    f = cb.findings[0]
    assert set(f.params) == {"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"}


def test_manual_optimization_without_zero_grad_gets_the_manual_fix() -> None:
    # Lightning discussions: "loss doesn't decrease with automatic_optimization=False" (opt.zero_grad() forgotten).
    cb = fit(Manual(zero="never"), max_steps=4)
    (f,) = [f for f in cb.findings if f.kind == "zero_grad_missing"]
    fix = f.message.split("Fix:")[1]
    assert "opt = self.optimizers()" in fix and "opt.zero_grad() right after opt.step()" in fix
    assert "self.manual_backward" in fix and "loss.backward()" not in fix


class SkipsZeroGrad(Automatic):
    """An optimizer_zero_grad override meant to accumulate by hand: it clears every other batch only."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if batch_idx % 2 == 0:
            optimizer.zero_grad()


def test_an_optimizer_zero_grad_override_that_keeps_the_gradients_gets_the_lightning_fix() -> None:
    cb = fit(SkipsZeroGrad(), max_steps=4)
    (f,) = [f for f in cb.findings if f.kind == "zero_grad_missing"]
    assert f.step == 1
    fix = f.message.split("Fix:")[1]
    assert "optimizer_zero_grad" in fix and "Trainer(accumulate_grad_batches=k)" in fix
    assert "loss.backward()" not in fix


def test_manual_optimization_with_zero_grad_is_silent() -> None:
    assert fit(Manual(), max_steps=4).findings == []


def test_gan_with_optimizers_zeroed_on_their_own_schedules_is_silent() -> None:
    assert fit(Gan(), max_steps=9).findings == []


def test_accumulate_grad_batches_is_silent() -> None:
    assert fit(Automatic(), max_steps=3, accumulate_grad_batches=3).findings == []


def test_gradient_clipping_is_silent() -> None:
    assert fit(Automatic(), max_steps=4, gradient_clip_val=1e-3).findings == []


class ClearsInItsHook(Automatic):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        optimizer.zero_grad()  # runs after the callbacks' on_before_optimizer_step


def test_gradients_cleared_in_the_modules_on_before_optimizer_step_are_found() -> None:
    # The module's hook runs after the callback's, where gradwatch checked: every update was empty and
    # nothing was reported (the same call in on_after_backward was caught).
    cb = fit(ClearsInItsHook())
    assert zero_kinds(cb) == [("grads_cleared_before_step", 0)]
    (f,) = [f for f in cb.findings if f.kind == "grads_cleared_before_step"]
    assert "on_before_optimizer_step" in f.message and f.data["after_check"]
    assert f.explanation is not None and f.message == f.explanation.render()
    assert f.explanation.why == "the step applies no gradient; the model does not learn."
    assert f.fix.startswith("remove optimizer.zero_grad() (or p.grad = None) from that hook")


def test_the_modules_own_clipping_in_its_hook_is_silent() -> None:
    class Clips(Automatic):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.1)

    assert zero_kinds(fit(Clips())) == []


def test_the_modules_own_clipping_raising_on_a_nan_step_is_reported_once() -> None:
    # clip_grad_norm_(error_if_nonfinite=True) in the module's hook raises after gradwatch's check of the same
    # step (the callback's hook runs first): one nonfinite_grad for the step, not a second from the raise.
    class ClipsAndRaises(Automatic):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if self.global_step == 2 else loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0, error_if_nonfinite=True)

    cb = GradWatchCallback(console=False)
    with pytest.raises(RuntimeError, match="non-finite"):
        tiny_trainer(pl, [cb]).fit(ClipsAndRaises())
    assert [(f.kind, f.step) for f in cb.findings if f.kind == "nonfinite_grad"] == [("nonfinite_grad", 2)]


# -- autograd errors -------------------------------------------------------------------------------
class Broken(Automatic):
    def __init__(self, bug: str) -> None:
        super().__init__()
        self.bug = bug
        self.kept: torch.Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.bug == "inplace":
            self.net[2].inplace = True  # ReLU(inplace=True) right after the Sigmoid
        if self.bug == "no_grad":
            with torch.no_grad():
                return nn.functional.mse_loss(self.net(x), y)
        if self.bug == "sqrt_negative" and self.global_step == 2:
            x = torch.cat([torch.sqrt(x[:, :1] - 10), x[:, 1:]], 1)  # sqrt of a negative: NaN in the forward
        out = self.net(x)
        if self.bug == "nonscalar":
            return out
        loss = nn.functional.mse_loss(out, y)
        if self.bug == "sqrt_zero" and self.global_step == 2:
            loss = loss + torch.sqrt(out - out.detach()).sum()  # sqrt(0): an infinite derivative
        if self.bug == "running_total":
            self.kept = loss if self.kept is None else self.kept + loss
            return self.kept
        if self.bug == "inf_then_nan" and batch_idx == 2:
            loss = loss + torch.exp(self.net[3].bias + 200).sum()  # Inf only: anomaly mode lets it pass
        if self.bug == "inf_then_nan" and batch_idx == 4:
            loss = loss + torch.sqrt((out - out.detach()).pow(2).sum())  # sqrt(0): a NaN born in backward
        if self.bug == "backward_in_step":
            loss.backward()  # code from a plain loop: Lightning backpropagates the returned loss itself
        return loss


def test_inplace_error_names_the_module_and_fit_reraises_it() -> None:
    cb = GradWatchCallback(console=False)
    with pytest.raises(RuntimeError, match=re.escape("which is output 0 of Sigmoid, is at version 1")) as raised:
        tiny_trainer(pl, [cb], max_steps=3).fit(Broken("inplace"))
    assert type(raised.value) is RuntimeError
    [f] = [f for f in cb.findings if f.kind == "inplace_error"]
    assert (f.step, f.op, f.module) == (0, "Sigmoid", "net.1")
    assert f.data["modified_in"] == "net.2"


def test_backward_twice_from_a_running_total_is_explained() -> None:
    cb = GradWatchCallback(console=False)
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        tiny_trainer(pl, [cb], max_steps=3).fit(Broken("running_total"))
    [f] = [f for f in cb.findings if f.kind == "backward_twice"]
    assert (f.step, f.data["cause"]) == (1, "running_total")


def test_backward_called_in_training_step_is_explained_the_lightning_way() -> None:
    # training_step calls loss.backward() and returns the loss (VinAIResearch/PSENet-Image-Enhancement#1:
    # "the loss.backward() will be handled automatically by the library"; Lightning-AI/pytorch-lightning#1771).
    # The fix was the plain loop's "add the losses, or pass retain_graph=True", which doubles the gradients.
    cb = GradWatchCallback(console=False)
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        tiny_trainer(pl, [cb], max_steps=3).fit(Broken("backward_in_step"))
    [f] = [f for f in cb.findings if f.kind == "backward_twice"]
    assert (f.step, f.data["cause"]) == (0, "backward_in_training_step")
    assert "remove loss.backward() from training_step" in f.message


class TwoManualBackwards(pl.LightningModule):
    """Manual optimization: two losses of one forward, each through self.manual_backward, no retain_graph."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = net()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        out = self.net(batch[0])
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(out, batch[1]))
        self.manual_backward(out.abs().mean())  # the first call freed the graph both losses share
        opt.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return tiny_data()


def test_manual_backward_twice_through_one_graph_is_the_users_own_backward() -> None:
    # In manual optimization Lightning runs no backward of its own: the words for automatic optimization
    # ("remove loss.backward() from training_step ... set self.automatic_optimization = False") were wrong here.
    cb = GradWatchCallback(console=False)
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        tiny_trainer(pl, [cb], max_steps=3).fit(TwoManualBackwards())
    [f] = [f for f in cb.findings if f.kind == "backward_twice"]
    assert (f.step, f.data["cause"]) == (0, "same_step")
    assert "automatic_optimization" not in f.message


def test_loss_computed_under_no_grad_is_explained() -> None:
    cb = GradWatchCallback(console=False)
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        tiny_trainer(pl, [cb], max_steps=3).fit(Broken("no_grad"))
    [f] = [f for f in cb.findings if f.kind == "no_grad_graph"]
    assert (f.step, f.data["cause"]) == (0, "forward_under_no_grad")


# https://github.com/Lightning-AI/pytorch-lightning/issues/8313 (detect_anomaly on the Trainer for debugging)
def test_trainer_detect_anomaly_error_is_explained_as_the_nan_origin() -> None:
    cb = GradWatchCallback(console=False)
    with pytest.raises(RuntimeError, match="returned nan values") as raised:
        tiny_trainer(pl, [cb], max_steps=4, detect_anomaly=True).fit(Broken("sqrt_zero"))
    assert type(raised.value) is RuntimeError
    [f] = [f for f in cb.findings if f.kind == "nan_origin"]
    assert (f.step, f.data["phase"]) == (2, "backward") and f.op in raised.value.args[0]
    assert "an Inf reached it from an earlier backward op" in f.message  # sqrt's Inf, NaN at a matmul


def test_trainer_detect_anomaly_on_a_nan_born_in_the_forward_names_the_forward_op() -> None:
    # The loss was NaN already: anomaly mode stops at the first backward op (MseLossBackward0), which only
    # carries it. gradwatch said "an Inf reached it from an earlier backward op" and blamed that op.
    cb = GradWatchCallback(console=False)
    with pytest.raises(RuntimeError, match="returned nan values") as raised:
        tiny_trainer(pl, [cb], max_steps=4, detect_anomaly=True).fit(Broken("sqrt_negative"))
    assert type(raised.value) is RuntimeError
    [f] = [f for f in cb.findings if f.kind == "nan_origin"]
    assert (f.step, f.data["phase"], f.data["op"]) == (2, "forward", "torch.sqrt"), f.message
    assert "torch.sqrt(x[:, :1] - 10)" in f.message and "Inf reached it" not in f.message
    assert f.data["raised"] and "Training stopped with PyTorch's error" in f.message
    assert not torch.is_anomaly_enabled()


def test_detect_anomaly_still_stops_at_a_nan_inside_gradwatchs_escalation_window() -> None:
    # Trainer(detect_anomaly=True): an Inf at batch 2 opened gradwatch's escalation window, which ran anomaly
    # mode with check_nan=False; the NaN of batch 4 then no longer stopped fit() as the user asked.
    cb = GradWatchCallback(console=False)
    with pytest.raises(RuntimeError, match="returned nan values"):
        tiny_trainer(pl, [cb], max_steps=7, detect_anomaly=True).fit(Broken("inf_then_nan"))
    assert [(f.kind, f.step) for f in cb.findings if f.kind == "nan_origin"] == [("nan_origin", 2), ("nan_origin", 4)]
    assert not torch.is_anomaly_enabled()  # restored after the fit


def test_nonscalar_loss_is_explained() -> None:
    cb = GradWatchCallback(console=False)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        tiny_trainer(pl, [cb], max_steps=3).fit(Broken("nonscalar"))
    [f] = [f for f in cb.findings if f.kind == "nonscalar_backward"]
    assert f.data["shape"] == [8, 1]
    assert f.module == "net.3"


def test_two_optimizers_zeroed_each_step_are_silent_in_either_namespace(pl_ns: Any) -> None:
    from helpers import manual_module

    cb = GradWatchCallback(console=False)
    tiny_trainer(pl_ns, [cb], max_steps=6).fit(manual_module(pl_ns))
    assert [f.kind for f in cb.findings if f.kind in ZERO_KINDS] == []


def test_lbfgs_in_automatic_optimization_is_silent() -> None:
    class WithLbfgs(Automatic):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)

    cb = fit(WithLbfgs(), max_steps=3)
    assert [f.kind for f in cb.findings if f.kind in ZERO_KINDS] == []
    assert cb.engine is not None and cb.engine.steps_checked == 3
