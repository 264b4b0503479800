"""``no_optimizer_step``: a run whose backward passes filled an optimizer's gradients while that optimizer never
stepped (``optimizer.step()`` forgotten; ``if (i + 1) % k == 0`` over a loader of fewer than k batches; Lightning
manual optimization without ``opt.step()``). Reported once, when the run ends normally; silent when it stepped,
when an exception ended it, and for a single backward pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import kinds, lightning_namespace, tiny_data, tiny_trainer
from torch import nn

import gradwatch
from gradwatch.lightning import GradWatchCallback


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2)


def _accumulate(model: nn.Module, opt: torch.optim.Optimizer, batches: int, k: int = 4, epochs: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(batches)]
    for _ in range(epochs):
        for i, (x, y) in enumerate(data):
            (nn.functional.mse_loss(model(x), y) / k).backward()
            if (i + 1) % k == 0:
                opt.step()
                opt.zero_grad()


def test_accumulation_window_longer_than_the_loader_never_steps() -> None:
    model, opt = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with gradwatch.watch(model, opt, console=False) as gw:
        _accumulate(model, opt, batches=3)
    assert kinds(gw) == [("no_optimizer_step", 0)]
    f = gw.findings[0]
    assert f.data["backward_passes"] == 9
    assert f.params == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert "len(loader)" in f.fix
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # what the finding says


def test_silent_when_the_loop_steps() -> None:
    model, opt = _model()
    with gradwatch.watch(model, opt, console=False) as gw:
        _accumulate(model, opt, batches=8)
    assert kinds(gw) == []


def test_silent_when_an_exception_ends_the_run_before_the_first_step() -> None:
    model, opt = _model()
    with pytest.raises(KeyboardInterrupt), gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(3):
            model(torch.randn(4, 6)).pow(2).mean().backward()
        raise KeyboardInterrupt
    assert kinds(gw) == []


def test_silent_for_one_backward_pass() -> None:
    model, opt = _model()
    with gradwatch.watch(model, opt, console=False) as gw:
        model(torch.randn(4, 6)).pow(2).mean().backward()
    assert kinds(gw) == []


def test_names_only_the_optimizer_that_never_stepped() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    body, head = torch.optim.SGD(model[0].parameters(), lr=1e-2), torch.optim.SGD(model[2].parameters(), lr=1e-2)
    with gradwatch.watch(model, [body, head], console=False) as gw:
        for _ in range(4):
            body.zero_grad()
            head.zero_grad()
            model(torch.randn(4, 6)).pow(2).mean().backward()
            head.step()  # body.step() forgotten
    assert [(f.kind, f.data["optimizer"]) for f in gw.findings] == [("no_optimizer_step", 0)]


def _manual_class(ns: Any) -> type:
    class ManualAccumulation(ns.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            self.manual_backward(nn.functional.mse_loss(self.layer(batch[0]), batch[1]) / 8)
            if (batch_idx + 1) % 8 == 0:  # an epoch has 3 batches: never holds
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return ManualAccumulation


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_manual_accumulation_that_never_steps(namespace: str) -> None:
    ns = lightning_namespace(namespace)
    cb = GradWatchCallback(console=False)
    tiny_trainer(ns, [cb], max_steps=-1, max_epochs=2).fit(_manual_class(ns)(), tiny_data(n=24))
    assert kinds(cb) == [("no_optimizer_step", 0)]
    assert "num_training_batches" in cb.findings[0].fix


# -- while the run goes on (plain loops) -------------------------------------------------------------------
def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = _batch(i)
    return nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_loop_that_never_steps_is_told_while_it_runs_and_after_it_is_stopped_by_hand(set_to_none: bool) -> None:
    import warnings

    from gradwatch.observe.unstepped import DURING_RUN

    model, opt = _model()
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    with pytest.raises(KeyboardInterrupt), gradwatch.watch(model, opt, console=False) as gw:
        for i in range(DURING_RUN + 10):
            opt.zero_grad(set_to_none=set_to_none)
            _loss(model, i).backward()
            with warnings.catch_warnings():  # torch's own "lr_scheduler.step() before optimizer.step()"
                warnings.simplefilter("ignore")
                sched.step()  # in place of optimizer.step()
            if i == DURING_RUN:
                during = kinds(gw)
        raise KeyboardInterrupt  # the user stops a run whose loss does not go down
    assert during == [("no_optimizer_step", 0)]
    assert kinds(gw) == during  # once, and not dropped by the interrupt
    f = gw.findings[0]
    assert f.data["backward_passes"] == DURING_RUN + 1 and "so far" in f.message and "optimizer.step()" in f.fix


def _attack_then_step(model: nn.Module, opt: torch.optim.Optimizer, i: int, attack_steps: int) -> None:
    """Adversarial training whose attack steps call loss.backward(): gradients computed and cleared, then one update."""
    x, y = _batch(i)
    delta = torch.zeros_like(x, requires_grad=True)
    for _ in range(attack_steps):
        nn.functional.mse_loss(model(x + delta), y).backward()
        with torch.no_grad():
            delta += 0.01 * delta.grad.sign()
        delta.grad = None
        model.zero_grad()
    opt.zero_grad()
    nn.functional.mse_loss(model(x + delta.detach()), y).backward()
    opt.step()


@pytest.mark.parametrize("loop", ["full_batch_accumulation", "adversarial", "lbfgs", "saliency_after_training"])
def test_loops_that_step_or_only_accumulate_are_not_told(loop: str) -> None:
    from gradwatch.observe.unstepped import DURING_RUN

    model, opt = _model()
    if loop == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters(), max_iter=20)
    with gradwatch.watch(model, opt, console=False) as gw:
        if loop == "full_batch_accumulation":
            passes = DURING_RUN + 20
            for i in range(passes):  # one accumulation window over the whole data set
                (_loss(model, i) / passes).backward()
            opt.step()
        elif loop == "adversarial":
            for i in range(12):
                _attack_then_step(model, opt, i, attack_steps=10)
        elif loop == "lbfgs":
            for i in range(4):

                def closure(i: int = i) -> torch.Tensor:
                    opt.zero_grad()
                    loss = _loss(model, i)
                    loss.backward()
                    return loss

                opt.step(closure)  # up to 20 evaluations inside each step, each cleared
        else:
            for i in range(5):
                opt.zero_grad()
                _loss(model, i).backward()
                opt.step()
            for i in range(DURING_RUN + 10):  # saliency maps of the trained model: gradients on purpose
                x, y = _batch(i)
                nn.functional.mse_loss(model(x.requires_grad_(True)), y).backward()
                model.zero_grad()
    assert "no_optimizer_step" not in [f.kind for f in gw.findings]


def test_a_scaler_that_drops_every_update_is_not_called_a_forgotten_step() -> None:
    from gradwatch.observe.unstepped import DURING_RUN

    model, opt = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # every update overflows for ~90 steps
    with gradwatch.watch(model, opt, console=False) as gw:
        for i in range(DURING_RUN + 10):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(model, i).float()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    found = [f.kind for f in gw.findings]
    assert "no_optimizer_step" not in found and "amp_overflow_persistent" in found


def test_with_two_optimizers_that_never_step_the_second_is_told_at_close_after_the_first_was_told_while_running() -> None:
    from gradwatch.observe.unstepped import DURING_RUN

    model, _ = _model()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=1e-2)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=1e-2)
    with gradwatch.watch(model, [opt_a, opt_b], console=False) as gw:
        for i in range(DURING_RUN + 5):
            opt_a.zero_grad()
            opt_b.zero_grad()
            _loss(model, i).backward()
    found = [(f.kind, f.data["optimizer"]) for f in gw.findings]
    assert found == [("no_optimizer_step", 0), ("no_optimizer_step", 1)]
