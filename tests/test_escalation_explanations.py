"""Escalation's findings are built from explanations: the message renders from them and nothing parses it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.diagnose.op_fixes import fix_for


class SqrtFeature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([torch.sqrt(x[:, :1]), x[:, 1:]], 1)  # NaN for a negative feature
        return self.out(torch.relu(self.lin(x)))


def _batch(i: int, bad_step: int) -> torch.Tensor:
    x = torch.rand(8, 4) + 0.1
    if i == bad_step:
        x[1, 0] = -2.0
    return x


def test_nan_origin_of_a_forward_op_is_an_explanation_with_the_ops_fix() -> None:
    torch.manual_seed(0)
    model = SqrtFeature()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for i in range(3):
            opt.zero_grad()
            model(_batch(i, 1)).pow(2).mean().backward()
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "nan_origin" and f.step == 1]
    assert f.explanation is not None and f.message == f.explanation.render()
    assert f.fix == fix_for("SqrtBackward0", "torch.sqrt") and "\nFix:" not in f.explanation.what


def test_nan_batch_is_an_explained_nonfinite_input() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        x = torch.ones(8, 4)
        x[2, 1] = float("nan")
        model(x).mean().backward()
        opt.step()
    (f,) = [f for f in gw.findings if f.kind == "nonfinite_input"]
    assert f.explanation is not None and f.message == f.explanation.render()
    assert "args[0] (1 NaN, 0 Inf)" in f.explanation.what and f.fix.startswith("find where the batch is built")


@pytest.mark.filterwarnings("ignore")  # anomaly mode's forward tracebacks
def test_anomaly_mode_stop_adds_its_note_to_what_and_keeps_the_fix() -> None:
    torch.manual_seed(0)
    model = SqrtFeature()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="returned nan values"):
        with gradwatch.watch(model, opt, console=False) as gw:
            for i in range(3):
                opt.zero_grad()
                with torch.autograd.detect_anomaly():
                    model(_batch(i, 2)).pow(2).mean().backward()
                opt.step()
    (f,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert f.explanation is not None and f.message == f.explanation.render()
    assert f.explanation.what.endswith("Training stopped with PyTorch's error.")
    assert f"Anomaly mode stopped backward at {f.data['anomaly_op']}" in f.explanation.what
    assert f.fix == fix_for("SqrtBackward0", "torch.sqrt")
