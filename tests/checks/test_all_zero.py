"""grads_all_zero: the whole model's gradient exactly 0 for several steps, told without an observed loss."""

from __future__ import annotations

import torch
from torch import nn

import gradwatch


def _saturated_gan(lr: float, steps: int = 12) -> list[gradwatch.Finding]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8), nn.Tanh())
    disc = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())
    opt_d = torch.optim.Adam(disc.parameters(), lr=lr, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(gen.parameters(), lr=lr, betas=(0.5, 0.999))
    bce = nn.BCELoss()
    with gradwatch.watch(nn.ModuleDict({"gen": gen, "disc": disc}), [opt_d, opt_g], console=False) as gw:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            real = torch.randn(16, 8, generator=g) * 0.5 + 1.0
            fake = gen(torch.randn(16, 4, generator=g))
            opt_d.zero_grad()
            (bce(disc(real), torch.ones(16, 1)) + bce(disc(fake.detach()), torch.zeros(16, 1))).backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(disc(fake), torch.ones(16, 1)).backward()
            opt_g.step()
    return gw.findings


def test_gan_whose_discriminator_saturates_has_every_gradient_zero_in_both_networks() -> None:
    found = [f for f in _saturated_gan(2e-4 * 1e4) if f.kind == "grads_all_zero"]
    assert sorted(f.data["optimizer"] for f in found) == [0, 1]
    assert all(f.step <= 10 for f in found)
    assert all("lower learning rate" in f.message or "lower the learning rate" in f.message for f in found)


def test_healthy_gan_is_not_grads_all_zero() -> None:
    assert not [f for f in _saturated_gan(2e-4, steps=20) if f.kind == "grads_all_zero"]


def test_gradients_cleared_between_backward_and_step_are_not_grads_all_zero() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(12):
            loss = model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).pow(2).mean()
            loss.backward()
            opt.zero_grad(set_to_none=False)  # the bug zero_grad's own check names
            opt.step()
    kinds = [f.kind for f in gw.findings]
    assert "grads_all_zero" not in kinds and "grads_cleared_before_step" in kinds


def test_a_frozen_backbone_with_a_live_head_is_not_grads_all_zero() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(12):
            loss = model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "grads_all_zero" not in [f.kind for f in gw.findings]


def test_a_loss_through_round_has_every_gradient_zero_while_the_loss_is_not() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(8):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            loss = (torch.round(model(x)) - 3.0).pow(2).mean()  # round: gradient exactly 0 everywhere
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "grads_all_zero"]
    assert f.step == 4


def test_a_margin_loss_at_zero_is_not_grads_all_zero() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(8):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            out = model(x)
            loss = torch.relu(out[:, 0] - out[:, 0] - 1.0).mean()  # every margin holds: exactly 0
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "grads_all_zero" not in [f.kind for f in gw.findings]
