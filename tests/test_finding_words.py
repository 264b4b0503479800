"""Words of findings: no function named as a module, no op named twice, no "optimizer 0" without an
optimizer, and ``module`` set when one module holds every non-finite gradient."""

from __future__ import annotations

import torch
from torch import nn

import gradwatch


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bad: bool = False) -> torch.Tensor:
        if bad:
            x = x / torch.zeros(())  # on the input, which requires no grad: an op with no backward node
        return self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head = Encoder(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, bad: bool = False) -> torch.Tensor:
        return self.head(self.enc(x, bad))


def test_an_op_without_a_backward_node_is_named_once() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(4):
            loss = model(torch.randn(8, 4), bad=step == 2).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert "op Tensor.div in module enc" in origin.message and "(Tensor.div)" not in origin.message


def test_non_finite_findings_name_the_one_module_that_holds_every_non_finite_gradient() -> None:
    # sqrt of a negative number of the encoder's output: a NaN loss whose NaN gradient reaches enc.a and enc.b
    # only (the head's gradient comes from the finite term).
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(4):
            h = model.enc(torch.randn(8, 4))
            loss = model.head(h.detach()).pow(2).mean() + h.mean()
            if step == 2:
                loss = loss + torch.sqrt(-1.0 - h.abs().sum())
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = {f.kind: f for f in gw.findings if f.step == 2}
    assert set(found["nonfinite_grad"].params) == {"enc.a.weight", "enc.a.bias", "enc.b.weight", "enc.b.bias"}
    assert found["nonfinite_grad"].module == "enc" and found["nonfinite_loss"].module == "enc"


def test_without_an_optimizer_no_optimizer_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model.add_module("aux", nn.Linear(2, 2))  # never called
    with gradwatch.watch(model, console=False) as gw:
        for step in range(3):
            loss = model[1](model[0](torch.randn(8, 4))).pow(2).mean()
            model.zero_grad()
            loss.backward()
            if step == 0:
                model.zero_grad(set_to_none=False)  # the bug: between backward and the update
            gw.check()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.01 * p.grad
    text = {f.kind: f.message for f in gw.findings}
    assert set(text) == {"none_grad", "grads_cleared_before_step"}
    assert all("optimizer 0" not in t and "optimizer.step()" not in t for t in text.values()), text
    assert text["none_grad"].startswith("2 trainable parameter(s) of the model got no gradient at step 0")
    assert text["grads_cleared_before_step"].startswith("gw.check() at step 0 found every gradient all zero")
