"""Custom ``torch.autograd.Function`` backward bugs: a backward that returns None for a trainable weight
(``none_grad``, naming the Function), and a backward that returns a gradient of the wrong shape
(``gradwatch.gradcheck``'s ``bad_backward``, naming the input and both shapes)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.autograd import Function

import gradwatch


class NoWeightGradLinear(Function):
    """``x @ w.t()`` whose backward forgets the weight: returns ``grad_x, None``."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        _x, w = ctx.saved_tensors
        return g @ w, None


class GoodLinear(Function):
    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


class GradReverse(Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return -g


class RoundSTE(Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g


class FnLayer(nn.Module):
    def __init__(self, fn: type[Function], d_in: int = 8, d_out: int = 8) -> None:
        super().__init__()
        self.fn = fn
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(x, self.weight)


def _net(fn: type[Function] = NoWeightGradLinear) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), FnLayer(fn), nn.Tanh(), nn.Linear(8, 1))


def _train(model: nn.Module, steps: int = 6, params: object = None,
           after_backward: Callable[[int], None] | None = None) -> gradwatch.Watcher:
    opt = torch.optim.SGD(model.parameters() if params is None else params, lr=0.05)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(steps):
            loss = model(torch.randn(16, 4, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if after_backward is not None:
                after_backward(step)
            opt.step()
    return gw


def _blaming_a_function(gw: gradwatch.Watcher) -> list[gradwatch.Finding]:
    return [f for f in gw.findings if f.kind == "none_grad" and f.data.get("custom_function")]


# -- 1. a backward that returns None for a trainable weight ------------------------------------------------
def test_a_backward_returning_none_for_a_weight_is_none_grad_naming_the_function() -> None:
    model = _net()
    gw = _train(model)
    assert model[2].weight.grad is None
    (f,) = [f for f in gw.findings if f.kind == "none_grad"]
    assert f.params == ("2.weight",)
    assert f.module == "2"
    assert f.op == "NoWeightGradLinearBackward"
    assert f.data["custom_function"].endswith("NoWeightGradLinear")
    assert "NoWeightGradLinear" in f.explanation.what and "returned None" in f.explanation.what
    assert "return" in f.fix and "gradwatch.gradcheck" in f.fix
    assert f.step <= 2  # confirmed at the next checked step after the one it was first seen


def test_the_check_it_suggests_confirms_it() -> None:
    (f,) = gradwatch.gradcheck(_net(), torch.randn(16, 4)).findings
    assert f.kind == "bad_backward" and f.data["wrong_inputs"] == ["w"]


def test_a_weight_fed_to_the_function_through_other_ops_is_blamed_on_it() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.enc, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
            self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.weight * 0.5 + 0.1  # not the leaf itself: its AccumulateGrad is two nodes below
            return self.head(torch.tanh(NoWeightGradLinear.apply(torch.tanh(self.enc(x)), w)))

    (f,) = [f for f in _train(Scaled()).findings if f.kind == "none_grad"]
    assert f.params == ("weight",) and f.op == "NoWeightGradLinearBackward"


def test_an_unused_weight_and_a_weight_the_function_drops_are_two_findings() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.enc, self.layer, self.unused = nn.Linear(4, 8), FnLayer(NoWeightGradLinear), nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.layer(torch.tanh(self.enc(x)))))

    found = {f.params: f for f in _train(Net()).findings if f.kind == "none_grad"}
    assert set(found) == {("unused.weight", "unused.bias"), ("layer.weight",)}
    assert found[("unused.weight", "unused.bias")].step == 0 and not found[("unused.weight", "unused.bias")].op
    assert found[("layer.weight",)].module == "layer"


def test_a_weight_reached_both_through_the_function_and_around_it_is_not_pinned_on_it() -> None:
    from gradwatch.diagnose.capture import Call
    from gradwatch.diagnose.graph_walk import gated_leaves

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    both, only = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    out = NoWeightGradLinear.apply(x @ both, only) + x @ both.t()
    call = Call((x,), {}, None)
    call.nodes, call.node_index = (out.grad_fn,), (0,)
    gates = {id(t): gate for t, gate in gated_leaves([call]) or []}
    assert gates[id(both)] is None
    assert gates[id(only)] == ("NoWeightGradLinearBackward", f"{__name__}.NoWeightGradLinear")


def test_the_verdict_of_a_watched_parameter() -> None:
    from gradwatch.core.grad_gates import gate_verdict

    assert gate_verdict(fired=False, got=False) == "pending"  # no backward reached it yet
    assert gate_verdict(fired=True, got=False) == "blocked"  # backward left its .grad None
    assert gate_verdict(fired=True, got=True) == "dropped"  # backward gave one; the loop dropped it


def test_the_watch_leaves_no_hook_on_the_weight() -> None:
    model = _net()
    _train(model)
    assert not getattr(model[2].weight, "_post_accumulate_grad_hooks", None)


def test_a_frozen_weight_behind_that_function_is_silent() -> None:
    model = _net()
    model[2].weight.requires_grad_(False)
    gw = _train(model)
    assert not [f for f in gw.findings if f.kind == "none_grad"]


def test_a_weight_the_forward_never_uses_is_none_grad_without_a_function() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.enc, self.layer, self.unused = nn.Linear(4, 8), FnLayer(GoodLinear), nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.layer(torch.tanh(self.enc(x)))))

    gw = _train(Net())
    (f,) = [f for f in gw.findings if f.kind == "none_grad"]
    assert set(f.params) == {"unused.weight", "unused.bias"} and not f.data.get("custom_function")


def test_gradient_reversal_and_straight_through_functions_are_silent() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.enc, self.layer, self.head = nn.Linear(4, 8), FnLayer(GoodLinear), nn.Linear(8, 1)
            self.adv = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = RoundSTE.apply(torch.tanh(self.enc(x)) * 4) / 4
            h = torch.tanh(self.layer(h))
            return self.head(h) + 0.1 * self.adv(GradReverse.apply(h))

    gw = _train(Net())
    assert not [f for f in gw.findings if f.kind == "none_grad"]


def test_a_weight_detached_on_purpose_is_not_blamed_on_the_function() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.enc, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
            self.target = nn.Parameter(torch.randn(8, 8) * 0.3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.enc(x))
            return self.head(GoodLinear.apply(h, self.target.detach()))

    model = Net()
    gw = _train(model, params=[p for n, p in model.named_parameters() if n != "target"])
    assert not [f for f in gw.findings if f.kind == "none_grad"]
    gw = _train(Net())  # in the optimizer: unused by backward, reported as such, with no Function named
    assert not _blaming_a_function(gw)


def test_a_function_run_under_no_grad_is_not_blamed() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.enc, self.head, self.teacher = nn.Linear(4, 8), nn.Linear(8, 1), FnLayer(NoWeightGradLinear)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.enc(x))
            with torch.no_grad():
                t = self.teacher(h)
            return self.head(h) + 0.0 * t.mean()

    gw = _train(Net())
    assert not _blaming_a_function(gw)


def test_a_gan_with_custom_functions_is_silent() -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), FnLayer(GoodLinear), nn.Tanh(), nn.Linear(8, 2))
    disc = nn.Sequential(nn.Linear(2, 8), nn.LeakyReLU(0.2), FnLayer(GoodLinear), nn.Tanh(), nn.Linear(8, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    with gradwatch.watch(model, [opt_d, opt_g], console=False) as gw:
        for _ in range(8):
            real = torch.randn(16, 2, generator=g) + 2
            fake = gen(torch.randn(16, 4, generator=g))
            d_loss = bce(disc(real), torch.ones(16, 1)) + bce(disc(fake.detach()), torch.zeros(16, 1))
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = bce(disc(fake), torch.ones(16, 1))
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
    assert not [f for f in gw.findings if f.kind == "none_grad"]


def test_gradient_accumulation_with_a_custom_function_is_silent() -> None:
    model = _net(GoodLinear)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with gradwatch.watch(model, opt, console=False) as gw:
        for micro in range(16):
            (model(torch.randn(16, 4, generator=g)).pow(2).mean() / 4).backward()
            if micro % 4 == 3:
                opt.step()
                opt.zero_grad()
    assert not [f for f in gw.findings if f.kind == "none_grad"]


def test_a_gradient_dropped_on_purpose_behind_a_custom_function_is_silent() -> None:
    # DINO's cancel_gradients_last_layer, on a layer that is a custom Function: backward gave the weight a
    # gradient, the training code set it to None for the first epoch.
    model = _net(GoodLinear)

    def drop(step: int) -> None:
        if step < 20:
            model[2].weight.grad = None

    gw = _train(model, steps=24, after_backward=drop)
    assert not [f for f in gw.findings if f.kind == "none_grad"]


# -- 2. gradcheck: a backward that returns a gradient of the wrong shape -----------------------------------
class HalfGradScale(Function):
    """``x * w`` (w of shape [8]) whose backward returns a [4] gradient for w."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)[:4]


class ScaleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.w = nn.Linear(4, 8), nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return HalfGradScale.apply(self.enc(x), self.w).sum(1)


def test_gradcheck_reports_a_gradient_of_the_wrong_shape_as_bad_backward() -> None:
    result = gradwatch.gradcheck(ScaleNet(), torch.randn(16, 4))
    assert not result.skipped
    (f,) = result.findings
    assert f.kind == "bad_backward" and f.op == "HalfGradScaleBackward"
    assert f.data["wrong_inputs"] == ["w"]
    (shape,) = f.data["wrong_shapes"]
    assert shape == {"input": "w", "index": 1, "expected": [8], "returned": [4]}
    assert "argument 1" in f.explanation.what and "[4]" in f.explanation.what and "[8]" in f.explanation.what
    assert "gradwatch.gradcheck" in f.fix


def test_gradcheck_still_accepts_a_gradient_autograd_sums_to_the_input_shape() -> None:
    class Broadcast(Function):
        @staticmethod
        def forward(ctx, x, w):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            x, w = ctx.saved_tensors
            return g * w, g * x  # [16, 8] for w of [8]: autograd sums it over the batch

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.enc, self.w = nn.Linear(4, 8), nn.Parameter(torch.randn(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Broadcast.apply(self.enc(x), self.w).sum(1)

    result = gradwatch.gradcheck(Net(), torch.randn(16, 4))
    assert result.ok and result.checked == ["Broadcast"] and not result.skipped
