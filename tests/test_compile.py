"""torch.compile: findings name the user's module paths, and watching adds no graph break."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import plain_console, tiny_module, tiny_trainer
from torch import nn

import gradwatch

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters

BACKEND = "aot_eager"  # the graph capture under test is Dynamo's; inductor's C++ build adds only time


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 8)  # never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def train(compiled: nn.Module, opt: torch.optim.Optimizer, gw: Any, steps: int, nan_at: int | None = None) -> None:
    for step in range(steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        loss = compiled(x).pow(2).mean()
        if step == nan_at:
            loss = loss * float("nan")
        if gw is not None:
            gw.observe_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    counters.clear()
    yield
    dynamo.reset()


def compiled_net() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = Net()
    try:
        compiled = torch.compile(model, backend=BACKEND)
        compiled(torch.zeros(16, 4)).sum().backward()
    except Exception as exc:  # noqa: BLE001 - no compiler on this platform
        pytest.skip(f"torch.compile is unavailable here: {exc}")
    model.zero_grad(set_to_none=True)
    return model, compiled


def test_findings_name_the_original_module_paths() -> None:
    model, compiled = compiled_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(compiled, opt, console=plain_console(), escalate=False) as gw:
        train(compiled, opt, gw, 5, nan_at=3)
    by_kind = {f.kind: f for f in gw.findings}
    assert by_kind["none_grad"].params == ("aux.weight", "aux.bias")
    assert by_kind["nonfinite_grad"].params == ("encoder.0.weight", "encoder.0.bias", "head.weight", "head.bias")
    assert not any("_orig_mod" in p for f in gw.findings for p in f.params)


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def test_watching_a_compiled_model_adds_no_graph_break() -> None:
    model, compiled = compiled_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dynamo.reset()
    counters.clear()
    train(compiled, opt, None, 3)
    alone = (graph_breaks(), counters["stats"]["unique_graphs"])
    dynamo.reset()
    counters.clear()
    with gradwatch.watch(compiled, opt, console=plain_console()) as gw:
        train(compiled, opt, gw, 3)
    assert alone == (0, 1)
    assert (graph_breaks(), counters["stats"]["unique_graphs"]) == alone


def test_lightning_fit_of_a_compiled_module_names_the_original_paths() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from gradwatch.lightning import GradWatchCallback

    cb = GradWatchCallback(console=plain_console(), escalate=False)
    model = tiny_module(pl, unused=True)
    trainer = tiny_trainer(pl, [cb], max_steps=2)
    trainer.fit(torch.compile(model, backend=BACKEND))
    (f,) = [f for f in cb.findings if f.kind == "none_grad"]
    assert f.params == ("aux_head.weight", "aux_head.bias")


def test_escalation_window_after_an_incident_adds_no_graph_break() -> None:
    model, compiled = compiled_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dynamo.reset()
    counters.clear()
    with gradwatch.watch(compiled, opt, console=plain_console()) as gw:
        for step in range(7):  # a NaN batch at step 2; steps 3-5: the escalation window
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
            if step == 2:
                x[0, 0] = float("nan")
            loss = compiled(x).pow(2).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert ("nonfinite_input", 2) in [(f.kind, f.step) for f in gw.findings]
    assert (graph_breaks(), counters["stats"]["unique_graphs"]) == (0, 1)


class LogNet(nn.Module):
    """log(h) of a clamped activation; a batch with a negative row makes it NaN (born in the forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.log(self.lin(x).abs() + x[:, :1].clamp(max=0) * 1e6 + 1.0))


def test_watching_the_original_model_of_a_compiled_one_adds_no_graph_break_after_an_incident() -> None:
    torch.manual_seed(0)
    model = LogNet()
    compiled = torch.compile(model, backend=BACKEND)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dynamo.reset()
    counters.clear()
    with gradwatch.watch(model, opt, console=plain_console()) as gw:  # the original module, run compiled
        for step in range(7):  # NaN batches at steps 2 and 4: the second falls in the escalation window
            x = torch.rand(16, 4, generator=torch.Generator().manual_seed(step))
            if step in (2, 4):
                x[0, 0] = -1.0
            loss = compiled(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert graph_breaks() == 0
    assert [f.step for f in gw.findings if f.kind == "nan_origin"] == [2, 4]


def compiled_step_loop(opt: torch.optim.Optimizer, model: nn.Module, gw: Any, steps: int, *, zero: bool = True,
                       nan_at: int | None = None) -> None:
    step = torch.compile(opt.step, backend=BACKEND)  # the compiled-optimizer recipe
    for i in range(steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(i))
        loss = model(x).pow(2).mean()
        if i == nan_at:
            loss = loss * float("nan")
        if zero:
            opt.zero_grad()
        loss.backward()
        step()


# https://pytorch.org/tutorials/recipes/compiling_optimizer.html
def test_compiled_optimizer_step_is_checked_eagerly_with_no_graph_break() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    compiled_step_loop(opt, model, None, 3)
    alone = (graph_breaks(), counters["stats"]["unique_graphs"])
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        compiled_step_loop(opt, model, gw, 3)
    assert graph_breaks() <= alone[0] and counters["stats"]["unique_graphs"] == alone[1]
    assert [f.kind for f in gw.findings if f.severity != "info"] == ["none_grad"]  # aux is never used
    assert gw.summary().steps_checked == 3


@pytest.mark.parametrize("bug", ["no_zero_grad", "nan"])
def test_compiled_optimizer_step_finds_a_forgotten_zero_grad_and_skips_a_nan(bug: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=plain_console()) as gw:
        compiled_step_loop(opt, model, gw, 5, zero=bug != "no_zero_grad", nan_at=3 if bug == "nan" else None)
    kinds = [(f.kind, f.step) for f in gw.findings if f.severity == "error"]
    if bug == "nan":
        assert ("nonfinite_grad", 3) in kinds, kinds
        assert all(torch.isfinite(p).all() for p in model.parameters())
    else:
        assert ("zero_grad_missing", 1) in kinds, kinds


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.certain = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.lin(h))
        return torch.log(p * 0.0 if self.certain else p)  # log(0) when the scorer is "certain"


class Scored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(4, 8)
        self.scorer = Scorer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scorer(torch.tanh(self.enc(x)))


def test_nan_origin_in_a_compiled_model_names_the_users_module_path() -> None:
    model = Scored()
    compiled = torch.compile(model, backend=BACKEND)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(compiled, opt, console=plain_console()) as gw:
        for step in range(4):
            model.scorer.certain = step == 2
            loss = -compiled(torch.randn(16, 4, generator=torch.Generator().manual_seed(step))).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = [f for f in gw.findings if f.kind == "nan_origin"]
    assert origin and (origin[0].step, origin[0].op, origin[0].module) == (2, "LogBackward0", "scorer")
    assert "_orig_mod" not in origin[0].message
