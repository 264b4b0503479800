"""Mixed precision, torch.compile, custom autograd Functions and gradient checkpointing as users report them,
in plain training loops on tiny CPU models: the healthy loop stays silent, the broken one is named once, with
its fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import kinds, no_internal_failures, plain_console, single_thread
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradwatch


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 32)
        self.l2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


class Reciprocal(nn.Module):
    """1 / (|h| + 2e-3): finite values, but a local gradient up to 2.5e5 that overflows float16 at any scale."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 32)
        self.l2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(1.0 / (self.l1(x).abs() + 2e-3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 8)
    return x, x.sum(1, keepdim=True)


def _amp_run(model: nn.Module, steps: int, dtype: torch.dtype = torch.float16, **scaler_kw: Any) -> Any:
    """The documented fp16 recipe: scale, backward, unscale_, clip, step, update."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", **scaler_kw)
    x, y = _data()
    gen = torch.Generator().manual_seed(0)
    with single_thread(), no_internal_failures():
        with gradwatch.watch(model, opt, log_dir=None, console=plain_console()) as gw:
            for _ in range(steps):
                idx = torch.randint(0, 64, (16,), generator=gen)
                with torch.autocast("cpu", dtype=dtype):
                    loss = F.mse_loss(model(x[idx]).float(), y[idx])
                opt.zero_grad()
                gw.observe_loss(loss)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
    return gw


def _plain_run(model: nn.Module, opt: torch.optim.Optimizer, steps: int, batch: Callable[[int], Any]) -> Any:
    _, y = _data()
    with single_thread(), no_internal_failures():
        with gradwatch.watch(model, opt, log_dir=None, console=plain_console()) as gw:
            for i in range(steps):
                loss = F.mse_loss(model(*batch(i)).float(), y[:16].to(torch.float32))
                opt.zero_grad()
                gw.observe_loss(loss)
                loss.backward()
                opt.step()
    return gw


# -- fp16 autocast + GradScaler -------------------------------------------------------------------------
@pytest.mark.parametrize("init_scale", [65536.0, 2.0**24])
def test_healthy_fp16_scaler_loop_reports_only_the_scalers_early_overflows(init_scale: float) -> None:
    torch.manual_seed(0)
    gw = _amp_run(MLP(), steps=200, init_scale=init_scale)
    assert kinds(gw, info=False) == []
    assert {f.kind for f in gw.findings} <= {"amp_overflow"}


def test_backward_overflow_below_scale_one_is_one_warning_not_one_per_streak() -> None:
    torch.manual_seed(0)
    gw = _amp_run(Reciprocal(), steps=80)
    persistent = [f for f in gw.findings if f.kind == "amp_overflow_persistent"]
    assert len(persistent) == 1
    (warning,) = persistent
    assert "fell below 1" in warning.message and "overflow float16 even unscaled" in warning.message
    assert "float32" in warning.fix
    later_infos = [f for f in gw.findings if f.kind == "amp_overflow" and f.step > warning.step]
    assert later_infos == []


# -- model.half() without master weights ------------------------------------------------------------------
def test_half_model_with_adams_default_eps_is_named_at_step_0() -> None:
    torch.manual_seed(0)
    model = MLP().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, _ = _data()
    gw = _plain_run(model, opt, steps=3, batch=lambda i: (x[:16].half(),))
    first = gw.findings[0]
    assert (first.kind, first.step) == ("nonfinite_update", 0)
    assert "eps" in first.fix
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- bf16 autocast -----------------------------------------------------------------------------------------
def test_bf16_autocast_with_the_loss_inside_it_is_silent() -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data()
    with single_thread(), no_internal_failures():
        with gradwatch.watch(model, opt, log_dir=None, console=plain_console()) as gw:
            for i in range(150):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = (model(x[(i % 4) * 16 : (i % 4 + 1) * 16]) - y[:16]).pow(2).mean()
                opt.zero_grad()
                gw.observe_loss(loss)
                loss.backward()
                opt.step()
    assert gw.findings == []


# -- torch.compile -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("watch_first", [False, True])
def test_compiled_model_healthy_then_nan_batch_is_named_and_skipped(backend: str, watch_first: bool) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, _ = _data()
    compiled = torch.compile(model, backend=backend)

    def batch(i: int) -> tuple[torch.Tensor]:
        b = x[:16].clone()
        if i == 5:
            b[3, 2] = float("nan")
        return (b,)

    with single_thread(), no_internal_failures():
        gw = gradwatch.watch(model if watch_first else compiled, opt, log_dir=None, console=plain_console())
        with gw:
            for i in range(12):
                loss = F.mse_loss(compiled(*batch(i)), x[:16].sum(1, keepdim=True))
                opt.zero_grad()
                gw.observe_loss(loss)
                loss.backward()
                opt.step()
    assert {k for k, s in kinds(gw)} == {"nonfinite_loss", "nonfinite_grad", "nonfinite_input"}
    assert {s for k, s in kinds(gw)} == {5}
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- custom autograd Functions -----------------------------------------------------------------------------
class ScaleNoWeightGrad(torch.autograd.Function):
    """x * w whose backward forgets w's gradient (returns None for an input that needs one)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (w,) = ctx.saved_tensors
        return grad * w, None


class LayerScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.gamma = nn.Parameter(torch.ones(8))  # LayerScale's usual init: x * gamma == x at step 0
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(ScaleNoWeightGrad.apply(self.enc(x), self.gamma))


def test_gradcheck_names_a_weight_whose_gradient_is_none_even_at_its_init_of_ones() -> None:
    torch.manual_seed(0)
    result = gradwatch.gradcheck(LayerScale(), torch.randn(16, 4))
    assert result.skipped == []
    (finding,) = result.findings
    assert (finding.kind, finding.op) == ("bad_backward", "ScaleNoWeightGradBackward")
    assert finding.data["wrong_inputs"] == ["w"]
    assert "returns None" in finding.message


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


def test_gradcheck_still_skips_a_gradient_reversal() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    model[0].register_forward_hook(lambda m, i, o: GradReverse.apply(o))
    result = gradwatch.gradcheck(model, torch.randn(16, 4))
    assert result.findings == [] and [s.function for s in result.skipped] == ["GradReverse"]


class Sqrt(torch.autograd.Function):
    """A hand-written sqrt: its backward 0.5 / sqrt(x) is Inf at 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.sqrt(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * 0.5 / y


class PairwiseDistance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        return self.head(Sqrt.apply(((h[:, None] - h[None]) ** 2).sum(-1)))  # 0 on the diagonal


def test_nan_from_a_custom_backward_names_the_function() -> None:
    torch.manual_seed(0)
    model = PairwiseDistance()
    x, _ = _data()
    gw = _plain_run(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=1, batch=lambda i: (x[:16],))
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert origin.op == "SqrtBackward" and origin.data["custom_function"]
    assert "Sqrt.backward" in origin.fix and "gradwatch.gradcheck" in origin.fix


# -- gradient checkpointing --------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(self.norm(self.lin(x)) + shift)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.out = nn.Linear(16, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, shift, use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_nan_inside_a_checkpointed_segment_names_its_module(reentrant: bool) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    x, _ = _data()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gw = _plain_run(model, opt, steps=30, batch=lambda i: (x[:16], torch.tensor(-10.0 if i == 7 else 10.0)))
    assert {s for _, s in kinds(gw)} == {7}
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert (origin.module, origin.op) == ("blocks.0", "SqrtBackward0")
    assert all(torch.isfinite(p).all() for p in model.parameters())
