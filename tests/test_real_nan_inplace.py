"""NaN sources and autograd in-place errors as users report them, in plain training loops on tiny CPU models:
each names the step, the module or op and the right fix, and its healthy neighbour stays silent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import kinds, no_internal_failures, plain_console, single_thread
from torch import nn

import gradwatch


def _run(model: nn.Module, step: Callable[[int, Any, torch.optim.Optimizer], None], steps: int) -> Any:
    """``steps`` steps of a plain SGD loop under watch(); returns the watcher."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with single_thread(), no_internal_failures():
        with gradwatch.watch(model, opt, log_dir=None, console=plain_console()) as gw:
            for i in range(steps):
                step(i, gw, opt)
    return gw


def _regression_step(model: nn.Module, batch: Callable[[int], Any]) -> Callable[[int, Any, Any], None]:
    def step(i: int, gw: Any, opt: torch.optim.Optimizer) -> None:
        loss = model(batch(i)).pow(2).mean()
        opt.zero_grad()
        gw.observe_loss(loss)
        loss.backward()
        opt.step()

    return step


def _origins(gw: Any) -> list[Any]:
    return [f for f in gw.findings if f.kind == "nan_origin"]


# -- torch.where(x > 0, w * x.log(), 0) on count features with zeros: 0 * (-inf) in the backward --------
class LogCounts(nn.Module):
    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.out = nn.Linear(4, 1)
        self.safe = safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.safe:
            x_safe = torch.where(x > 0, x, torch.ones_like(x))
            feats = torch.where(x > 0, self.w * torch.log(x_safe), torch.zeros_like(x))
        else:
            feats = torch.where(x > 0, self.w * torch.log(x), torch.zeros_like(x))
        return self.out(feats)


def _counts(i: int) -> torch.Tensor:
    counts = torch.arange(64, dtype=torch.float32).reshape(16, 4) % 3  # zeros in every column
    return counts + i


def test_masked_log_of_zero_counts_blames_the_log_not_the_learning_rate() -> None:
    torch.manual_seed(0)
    model = LogCounts(safe=False)
    gw = _run(model, _regression_step(model, lambda i: _counts(0)), steps=1)
    assert ("nonfinite_grad", 0) in kinds(gw)
    (origin,) = _origins(gw)
    assert (origin.step, origin.op, origin.module) == (0, "MulBackward0", "<root>")
    assert origin.data["masked_inf"]["forward_op"] == "torch.log"
    assert "self.w * torch.log(x)" in origin.data["masked_inf"]["code"]
    assert "The Inf among its forward inputs was made by op torch.log at " in origin.message
    assert origin.fix.startswith("log of 0 or of a negative number")
    assert "0 * inf = NaN" in origin.fix and "x_safe = torch.where(mask, x, 1.0)" in origin.fix
    assert "lower the learning rate" not in origin.fix


def test_masked_log_of_a_safe_input_is_silent() -> None:
    torch.manual_seed(0)
    model = LogCounts(safe=True)
    gw = _run(model, _regression_step(model, _counts), steps=20)
    assert gw.findings == []


# -- distances of identical embeddings: sqrt at 0 in the loss code ------------------------------------------
@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_triplet_distance_of_identical_embeddings(eps: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def step(i: int, gw: Any, opt: torch.optim.Optimizer) -> None:
        anchor, negative = torch.randn(16, 8), torch.randn(16, 8)
        positive = anchor.clone() if i == 3 else anchor + 0.1 * torch.randn(16, 8)
        ea, ep, en = model(anchor), model(positive), model(negative)
        d_pos = (((ea - ep) ** 2).sum(-1) + eps).sqrt()
        d_neg = (((ea - en) ** 2).sum(-1) + eps).sqrt()
        loss = F.relu(d_pos - d_neg + 1.0).mean()
        opt.zero_grad()
        gw.observe_loss(loss)
        loss.backward()
        opt.step()

    gw = _run(model, step, steps=6)
    if eps:
        assert gw.findings == []
        return
    assert kinds(gw) == [("nonfinite_grad", 3), ("nan_origin", 3)]
    (origin,) = _origins(gw)
    assert origin.data["phase"] == "loss" and origin.data["loss_ops"] == ["SqrtBackward0", "SqrtBackward0"]
    assert origin.fix.startswith("the derivative of sqrt is infinite at 0")


# -- whitening by a batch std that is 0 on a constant batch ----------------------------------------------
class Whiten(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = (h - h.mean(0, keepdim=True)) / (h.std(0, keepdim=True) + self.eps)
        return self.head(h)


@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_whitening_a_constant_batch(eps: float) -> None:
    torch.manual_seed(0)
    model = Whiten(eps)
    gw = _run(model, _regression_step(model, lambda i: torch.ones(8, 6) if i == 2 else torch.randn(8, 6)), steps=5)
    if eps:
        assert gw.findings == []
        return
    assert {k for k, s in kinds(gw)} == {"nonfinite_loss", "nonfinite_grad", "nan_origin"}
    assert {s for k, s in kinds(gw)} == {2}
    (origin,) = _origins(gw)
    assert (origin.op, origin.module) == ("DivBackward0", "<root>")
    assert origin.fix.startswith("division by zero")


# -- attention over a row whose keys are all masked ---------------------------------------------------
class Attention(nn.Module):
    def __init__(self, fill: float) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.fill = fill

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 8**0.5
        scores = scores.masked_fill(~keep[:, None, :], self.fill)
        return scores.softmax(-1) @ self.v(x)


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
def test_attention_with_a_fully_masked_row(fill: float) -> None:
    torch.manual_seed(0)
    model = Attention(fill)

    def step(i: int, gw: Any, opt: torch.optim.Optimizer) -> None:
        keep = torch.ones(4, 5, dtype=torch.bool)
        keep[:, 3:] = False  # padding: at least one key kept in every row
        if i == 2:
            keep[1] = False  # an all-padding sample
        loss = model(torch.randn(4, 5, 8), keep).pow(2).mean()
        opt.zero_grad()
        gw.observe_loss(loss)
        loss.backward()
        opt.step()

    gw = _run(model, step, steps=5)
    if fill != float("-inf"):
        assert gw.findings == []
        return
    (origin,) = _origins(gw)
    assert (origin.step, origin.op, origin.data["phase"]) == (2, "SoftmaxBackward0", "forward")
    assert origin.fix.startswith("a fully masked row (every logit -inf) makes softmax NaN")


# -- in-place errors ----------------------------------------------------------------------------------
class SigmoidThenWrite(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 1)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.lin(x))
        if self.how == "relu_":
            h = torch.relu_(h)
        elif self.how == "setitem":
            h[:, 0] = 0
        else:  # healthy: a residual sum and an in-place ReLU on a Linear's output, which nothing saved
            h = self.lin(x)
            h += x
            h = F.relu(h, inplace=True)
        return self.out(h)


@pytest.mark.parametrize(("how", "modifier"), [("relu_", "relu_"), ("setitem", "x[idx] = ..."), ("residual", None)])
def test_inplace_write_on_a_saved_sigmoid_output(how: str, modifier: str | None) -> None:
    torch.manual_seed(0)
    model = SigmoidThenWrite(how)
    if modifier is None:
        assert _run(model, _regression_step(model, lambda i: torch.randn(8, 4)), steps=5).findings == []
        return
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _run(model, _regression_step(model, lambda i: torch.randn(8, 4)), steps=2)
    gw = gradwatch.watch(model, torch.optim.SGD(model.parameters(), lr=0.01), log_dir=None, console=False)
    try:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        with pytest.raises(RuntimeError) as raised:
            loss.backward()
        finding = gw.explain(raised.value)
    finally:
        gw.close()
    assert finding is not None and finding.kind == "inplace_error" and finding.op == "Sigmoid"
    assert f"Modified by: {modifier} in module " in finding.message


def test_truncated_bptt_without_detach_is_backward_twice_at_step_one() -> None:
    torch.manual_seed(0)
    rnn, head = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 1)
    model = nn.ModuleDict({"rnn": rnn, "head": head})
    state: dict[str, Any] = {"h": None}

    def step(i: int, gw: Any, opt: torch.optim.Optimizer) -> None:
        out, state["h"] = rnn(torch.randn(2, 5, 4), state["h"])
        loss = F.mse_loss(head(out), torch.randn(2, 5, 1))
        opt.zero_grad()
        gw.observe_loss(loss)
        loss.backward()
        opt.step()

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        with gradwatch.watch(model, opt, log_dir=None, console=plain_console()) as gw:
            for i in range(3):
                step(i, gw, opt)
    (finding,) = gw.findings
    assert (finding.kind, finding.step, finding.module) == ("backward_twice", 1, "rnn")
    assert "hidden = hidden.detach()" in finding.fix


# -- torch.where in the loss code: a relative log error only where the prediction is positive -----------
def test_masked_log_in_the_loss_code_keeps_its_suspects_in_the_escalated_steps() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def step(i: int, gw: Any, opt: torch.optim.Optimizer) -> None:
        pred, target = model(torch.randn(32, 4)).squeeze(-1), torch.rand(32) + 0.5
        loss = torch.where(pred > 0, (torch.log(pred) - torch.log(target)) ** 2, pred**2).mean()
        opt.zero_grad()
        gw.observe_loss(loss)
        loss.backward()
        opt.step()

    gw = _run(model, step, steps=3)
    origins = _origins(gw)
    assert [(f.step, f.data["phase"], f.data["replayed"]) for f in origins] == [
        (0, "loss", True), (1, "loss", False), (2, "loss", False)
    ]
    for origin in origins:
        assert origin.data["loss_ops"] == ["LogBackward0"]
        assert origin.fix.startswith("log of 0 or of a negative number")
    escalated = origins[1].message
    assert "if it recurs in the next (escalated) steps" not in escalated
    assert "x_safe = torch.where(mask, x, 1.0)" in escalated
