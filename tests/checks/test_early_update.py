"""lr_too_high: a learning rate orders of magnitude too large is named within the first 10 updates, with no
observed loss, whether the loop clips or its gradients stop at 0."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import lightning_namespace
from torch import nn

import gradwatch


def _first(findings: list[gradwatch.Finding], kind: str = "lr_too_high") -> gradwatch.Finding | None:
    return next((f for f in findings if f.kind == kind), None)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def _regression(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor], steps: int = 30,
                scheduler: Any = None, target: float = 1.0) -> list[gradwatch.Finding]:
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(32, 8, generator=g)
            loss = loss_fn(model(x), target * x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
    return gw.findings


def _tiny_gpt() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(32, 32),
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
        nn.Linear(32, 32),
    )


def _gpt_loop(lr: float, steps: int = 30, warmup: int = 0) -> list[gradwatch.Finding]:
    model = _tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    data = torch.randint(0, 32, (64, 17), generator=torch.Generator().manual_seed(1))
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(steps):
            if warmup:
                for group in opt.param_groups:
                    group["lr"] = lr * min(1.0, (step + 1) / warmup)
            chunk = data[(step * 8) % 64 : (step * 8) % 64 + 8]
            logits = model(chunk[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 32), chunk[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return gw.findings


def test_gpt_style_loop_that_clips_with_a_learning_rate_1e4x_too_large() -> None:
    f = _first(_gpt_loop(6e-4 * 1e4))
    assert f is not None and f.step <= 10
    assert "lower the learning rate" in f.message and "lr=6" in f.message


def test_smooth_l1_regression_with_a_learning_rate_1e4x_too_large() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2 * 1e4)
    f = _first(_regression(model, opt, nn.functional.smooth_l1_loss, steps=10, target=10.0))
    assert f is not None and f.step <= 10


def test_gan_whose_discriminator_saturates_after_one_update() -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8), nn.Tanh())
    disc = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
    gan = nn.ModuleDict({"gen": gen, "disc": disc})
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4 * 1e4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4 * 1e4, betas=(0.5, 0.999))
    bce = nn.BCELoss()
    zero_after = []
    with gradwatch.watch(gan, [opt_d, opt_g], console=False) as gw:
        for step in range(12):
            g = torch.Generator().manual_seed(step)
            real = torch.randn(16, 8, generator=g) * 0.5 + 1.0
            fake = gen(torch.randn(16, 4, generator=g))
            opt_d.zero_grad()
            d_loss = bce(disc(real), torch.ones(16, 1)) + bce(disc(fake.detach()), torch.zeros(16, 1))
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(disc(fake), torch.ones(16, 1)).backward()
            zero_after.append(all(float(p.grad.abs().max()) == 0.0 for p in gan.parameters() if p.grad is not None))
            opt_g.step()
    assert all(zero_after[2:])  # the construction: every gradient of both networks is exactly 0 from then on
    f = _first(gw.findings)
    assert f is not None and f.step <= 10 and f.data["optimizer"] == 0


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),  # large, no warm-up
    lambda ps: torch.optim.Adam(ps, lr=3e-2),  # large for Adam, no warm-up
], ids=["sgd_momentum_0.1", "adam_3e-2"])
def test_large_but_normal_early_updates_are_not_lr_too_high(make: Any) -> None:
    model = _mlp()
    findings = _regression(model, make(list(model.parameters())), nn.functional.mse_loss)
    assert _first(findings) is None, [f.kind for f in findings]


def test_one_cycle_schedule_is_not_lr_too_high() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)
    findings = _regression(model, opt, nn.functional.mse_loss, steps=40, scheduler=sched)
    assert _first(findings) is None, [f.kind for f in findings]


def test_gpt_style_loop_with_warm_up_is_not_lr_too_high() -> None:
    assert _first(_gpt_loop(1e-3, warmup=10)) is None


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_gan_under_manual_optimization_with_a_learning_rate_1e4x_too_large(namespace: str) -> None:
    pl = lightning_namespace(namespace)
    from gradwatch.lightning import GradWatchCallback

    class GAN(pl.LightningModule):
        def __init__(self, lr: float) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.lr = lr
            torch.manual_seed(0)
            self.gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
            self.disc = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (real,) = batch
            opt_g, opt_d = self.optimizers()
            bce = nn.functional.binary_cross_entropy_with_logits
            z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
            fake = self.gen(z)
            g_loss = bce(self.disc(fake), torch.ones(real.shape[0], 1))
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            d_loss = bce(self.disc(real), torch.ones(real.shape[0], 1)) + bce(
                self.disc(fake.detach()), torch.zeros(real.shape[0], 1)
            )
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
            return d_loss

        def configure_optimizers(self) -> Any:
            return (torch.optim.Adam(self.gen.parameters(), lr=self.lr, betas=(0.5, 0.999)),
                    torch.optim.Adam(self.disc.parameters(), lr=self.lr, betas=(0.5, 0.999)))

    def fit(lr: float) -> list[gradwatch.Finding]:
        real = torch.randn(160, 8, generator=torch.Generator().manual_seed(0)) * 0.5 + 1.0
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(real), batch_size=16)
        cb = GradWatchCallback(console=False)
        trainer = pl.Trainer(max_epochs=1, callbacks=[cb], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        trainer.fit(GAN(lr), train_dataloaders=data)
        return cb.findings

    f = _first(fit(2e-4 * 1e4))
    assert f is not None and f.step <= 10 and "lower the learning rate" in f.message
    assert _first(fit(2e-4)) is None
