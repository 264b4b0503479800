"""``gradwatch.gradcheck``: custom autograd.Functions checked against finite differences (``bad_backward``)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import panels
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradwatch
from gradwatch.gradcheck import SKIP_REASONS

ROOT = Path(__file__).resolve().parents[1]


# -- Functions with a wrong backward -------------------------------------------------------------------
class Cube(torch.autograd.Function):
    """x ** 3 whose backward forgets the chain rule: grad * 2 instead of grad * 3 * x ** 2."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class GoodCube(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * 3 * x**2


class MatMul(torch.autograd.Function):
    """x @ w whose weight gradient is transposed (w is square, so the shape fits and nothing raises)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        return grad @ w.t(), (x.t() @ grad).t()


class Mul(torch.autograd.Function):
    """a * b whose gradient for b is the one for a."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _a, b = ctx.saved_tensors
        return grad * b, grad * b  # the second should be grad * a


class ScaledSoftmax(torch.autograd.Function):
    """softmax(x * scale, dim) with a float and an int argument; ``wrong`` drops the scale in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float, dim: int, wrong: bool) -> torch.Tensor:
        y = torch.softmax(x * scale, dim)
        ctx.save_for_backward(y)
        ctx.scale, ctx.dim, ctx.wrong = scale, dim, wrong
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (y,) = ctx.saved_tensors
        gx = y * (grad - (grad * y).sum(ctx.dim, keepdim=True))
        return (gx if ctx.wrong else gx * ctx.scale), None, None, None


class NoneGrad(torch.autograd.Function):
    """a * b whose backward returns None for b, which requires grad."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _a, b = ctx.saved_tensors
        return grad * b, None


# -- Functions whose backward is right (or different by design) ----------------------------------------
class Swish(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


class Relu(torch.autograd.Function):
    """A correct ReLU, fed activations that are exactly 0 in many places (a kink)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp_min(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * (x > 0).to(grad.dtype)


class Dropout(torch.autograd.Function):
    """A correct dropout drawing its own mask: the check must see one mask, not noise."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        mask = (torch.rand_like(x) > 0.5).to(x.dtype) * 2
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        return grad * mask


class Float32Inside(torch.autograd.Function):
    """Computes in float32 whatever it is given: float64 finite differences at 1e-6 measure rounding."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.tanh(x.float()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * (1 - torch.tanh(x) ** 2)


class RoundSTE(torch.autograd.Function):
    """Straight-through rounding: the identity backward of a flat forward, on purpose."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ClampSTE(torch.autograd.Function):
    """clamp(-1, 1) whose backward passes every gradient through (PACT/LSQ-style), on purpose."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class GradReverse(torch.autograd.Function):
    """The DANN gradient reversal layer: identity forward, negated backward, on purpose."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class OnceCube(torch.autograd.Function):
    """A wrong backward behind @once_differentiable: a first-order check still applies."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


# -- Functions that cannot be checked ------------------------------------------------------------------
class Bucketize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return (x * 4).floor().long()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return None


class SortIndices(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.argsort(-1).to(x.dtype)
        ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return None


class Float32Only(torch.autograd.Function):
    """A kernel that only takes float32 (as many fused CUDA kernels do)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"expected float32, got {x.dtype}")
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class Apply(nn.Module):
    """Calls one Function (extra arguments after the activation)."""

    def __init__(self, fn: Any, *extra: Any) -> None:
        super().__init__()
        self.fn, self.extra = fn, extra

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(h, *self.extra)


def net(*middle: nn.Module, width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), *middle, nn.Linear(width, 1))


def batch(n: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def wrong(result: Any) -> list[tuple[str, str | None, list[str]]]:
    return [(f.op, f.module, f.data["wrong_inputs"]) for f in result.findings]


# -- wrong backwards are named -------------------------------------------------------------------------
def test_a_cube_whose_backward_returns_grad_times_2_is_named_with_its_line_module_and_errors() -> None:
    result = gradwatch.gradcheck(net(Apply(Cube)), batch())
    (f,) = result.findings
    assert (f.kind, f.severity, f.op, f.module) == ("bad_backward", "error", "CubeBackward", "1")
    assert f.data["wrong_inputs"] == ["x"] and f.data["code"] == "return self.fn.apply(h, *self.extra)"
    assert f.data["source"].startswith(__file__) and "gradwatch.gradcheck(" in f.message
    (row,) = f.data["table"]
    assert row["ok"] == "NO" and row["max_rel_err"] > 0.5 and row["max_abs_err"] > 1.0
    assert result.checked == ["Cube"] and not result.ok


def test_a_wrong_backward_carries_its_words_as_an_explanation() -> None:
    (f,) = gradwatch.gradcheck(net(Apply(Cube)), batch()).findings
    assert f.explanation is not None and f.message == f.explanation.render()
    assert f.explanation.what.startswith("Cube.backward returns a wrong gradient for `x` (argument 0)")
    assert f.explanation.fix.startswith("derive Cube.backward again from forward")
    assert f.fix == f.explanation.fix


def test_a_transposed_weight_gradient_of_a_matmul_names_the_weight_only() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8))
    model = net(Apply(MatMul, w))
    model.w = w  # registered, so it trains
    assert wrong(gradwatch.gradcheck(model, batch())) == [("MatMulBackward", "1", ["w"])]


def test_of_two_inputs_only_the_one_whose_gradient_is_wrong_is_named() -> None:
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.value, self.gate = nn.Linear(4, 8), nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Mul.apply(torch.tanh(self.value(x)), self.gate(x))

    result = gradwatch.gradcheck(nn.Sequential(Gate(), nn.Linear(8, 1)), batch())
    (f,) = result.findings
    assert f.data["wrong_inputs"] == ["b"] and [r["ok"] for r in f.data["table"]] == ["yes", "NO"]
    assert "`b` (argument 1)" in f.message and "`a`" not in f.message


def test_a_function_with_float_int_and_bool_arguments_is_checked_through_them() -> None:
    bad = gradwatch.gradcheck(net(Apply(ScaledSoftmax, 3.0, -1, True)), batch())
    good = gradwatch.gradcheck(net(Apply(ScaledSoftmax, 3.0, -1, False)), batch())
    assert wrong(bad) == [("ScaledSoftmaxBackward", "1", ["x"])]
    assert good.ok and good.checked == ["ScaledSoftmax"]


def test_a_backward_returning_none_for_an_input_that_requires_grad_is_named() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.full((8,), 2.0))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return NoneGrad.apply(h, self.s)

    (f,) = gradwatch.gradcheck(net(Scale()), batch()).findings
    assert f.data["wrong_inputs"] == ["b"] and "returns None" in f.message


def test_a_wrong_backward_behind_once_differentiable_is_still_checked() -> None:
    assert wrong(gradwatch.gradcheck(net(Apply(OnceCube)), batch())) == [("OnceCubeBackward", "1", ["x"])]


def test_a_function_in_the_loss_code_is_checked_with_loss_fn() -> None:
    model = net()
    assert gradwatch.gradcheck(model, batch()).checked == []
    result = gradwatch.gradcheck(model, batch(), loss_fn=lambda out: Cube.apply(out).mean())
    assert wrong(result) == [("CubeBackward", None, ["x"])]


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_function_inside_a_checkpoint_segment_is_found_and_checked(reentrant: bool) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return Cube.apply(self.lin(h))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.enc, self.block, self.head = nn.Linear(4, 8), Block(), nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, self.enc(x), use_reentrant=reentrant))

    assert wrong(gradwatch.gradcheck(Net(), batch())) == [("CubeBackward", "block", ["x"])]


def test_one_call_per_line_is_checked_and_the_others_are_counted() -> None:
    model = net(Apply(Cube), nn.Linear(8, 8), Apply(Cube))  # one Apply line, two modules
    (f,) = gradwatch.gradcheck(model, batch()).findings
    assert f.module == "1" and f.data["calls"] == 2 and "ran 2 times" in f.message


# -- healthy Functions and torch's own ops: no finding ------------------------------------------------
def test_correct_functions_and_torch_ops_give_no_finding() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), Apply(Relu), Apply(Swish), Apply(GoodCube), nn.LayerNorm(8), Apply(Dropout),
        nn.Dropout(0.5), nn.Linear(8, 1),
    )
    result = gradwatch.gradcheck(model.train(), batch(64))
    assert result.ok and result.checked == ["Relu", "Swish", "GoodCube", "Dropout"], str(result)
    assert result.skipped == []
    assert gradwatch.gradcheck(net(nn.Tanh(), nn.GELU()), batch()).checked == []


def test_a_function_computing_in_float32_inside_is_not_flagged() -> None:
    result = gradwatch.gradcheck(net(Apply(Float32Inside)), batch(64))
    assert result.ok and result.checked == ["Float32Inside"], str(result)


def test_straight_through_and_gradient_reversal_functions_are_skipped_as_by_design() -> None:
    result = gradwatch.gradcheck(net(Apply(RoundSTE), Apply(GradReverse)), batch())
    assert result.ok, str(result)
    reasons = {s.function: s.reason for s in result.skipped}
    assert reasons == {
        "RoundSTE (input `x`)": SKIP_REASONS["flat"].format(name="x"),
        "GradReverse": SKIP_REASONS["identity"],
    }


def test_a_clamp_whose_backward_passes_every_gradient_is_not_flagged() -> None:
    model = net(Apply(ClampSTE))
    with torch.no_grad():
        model[0].weight.mul_(4)  # half of the activations beyond the clamp
    result = gradwatch.gradcheck(model, batch(64))
    assert result.ok and result.checked == ["ClampSTE"], str(result)


# -- skipped, with the reason --------------------------------------------------------------------------
def test_functions_that_cannot_be_checked_are_skipped_with_the_reason() -> None:
    class Parts(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            buckets = Bucketize.apply(h)
            order = SortIndices.apply(h)
            with torch.no_grad():
                frozen = Cube.apply(h)
            return h * 2 + Float32Only.apply(h.float()) + 0 * (buckets + order + frozen)

    result = gradwatch.gradcheck(net(Parts()), batch())
    assert result.ok and result.checked == []
    reasons = {s.function: s.reason for s in result.skipped}
    assert reasons == {
        "Bucketize": SKIP_REASONS["integer_output"],
        "SortIndices": SKIP_REASONS["non_differentiable"],
        "Cube": SKIP_REASONS["no_grad_input"],
        "Float32Only": SKIP_REASONS["forward_failed"].format(error="TypeError: expected float32, got torch.float64"),
    }
    assert all(s.module == "1" and s.source and s.source.startswith(__file__) for s in result.skipped)


# -- the model is left as it was -----------------------------------------------------------------------
def test_parameters_grads_buffers_mode_and_random_state_are_unchanged_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), Apply(Dropout), Apply(Cube), nn.Dropout(0.3), nn.Linear(8, 1)
    )
    model(batch()).pow(2).mean().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    rng, py_rng = torch.get_rng_state(), random.getstate()
    result = gradwatch.gradcheck(model, batch(seed=1), loss_fn=lambda out: GoodCube.apply(out).sum())
    assert wrong(result) == [("CubeBackward", "3", ["x"])]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state()) and py_rng == random.getstate()
    assert model.training and Function_apply_is_torchs()


def Function_apply_is_torchs() -> bool:
    from torch.autograd.function import Function

    return Function.__dict__["apply"].__func__.__module__ == "torch.autograd.function"


# -- from a watcher ------------------------------------------------------------------------------------
def _loop(model: nn.Module, steps: int, **kw: Any) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, **kw) as gw:
        for step in range(steps):
            opt.zero_grad()
            model(batch(seed=step)).pow(2).mean().backward()
            opt.step()
    return gw


def test_gw_gradcheck_after_a_plain_loop_checks_the_last_steps_batch() -> None:
    model = net(Apply(GoodCube), Apply(Cube))
    gw = _loop(model, 3)
    assert not any(f.kind == "bad_backward" for f in gw.findings)  # nothing per step
    result = gw.gradcheck()
    assert [(f.step, f.op) for f in result.findings] == [(2, "CubeBackward")]
    assert result.checked == ["GoodCube", "Cube"]
    assert gw.gradcheck(batch()).findings[0].op == "CubeBackward"  # a batch of one's own


def test_gw_gradcheck_between_steps_and_before_any_step() -> None:
    model = net(Apply(Cube))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        with pytest.raises(RuntimeError, match="no step to check"):
            gw.gradcheck()
        for step in range(2):
            opt.zero_grad()
            model(batch(seed=step)).pow(2).mean().backward()
            opt.step()
            (f,) = gw.gradcheck().findings
            assert f.step == step
    assert [f.kind for f in gw.findings] == []  # its own forward calls were not taken for steps


def test_gw_gradcheck_without_escalation_asks_for_a_batch() -> None:
    gw = _loop(net(Apply(Cube)), 2, escalate=False)
    with pytest.raises(RuntimeError, match=r"escalate=True .* gw.gradcheck\(x\)"):
        gw.gradcheck()
    assert not gw.gradcheck(batch()).ok


def test_an_empty_input_is_checked_without_positions() -> None:
    result = gradwatch.gradcheck(net(Apply(GoodCube)), torch.zeros(0, 4))
    assert result.ok and result.checked == ["GoodCube"], str(result)


def test_gw_gradcheck_does_not_change_the_training_that_follows() -> None:
    def run(check: bool) -> list[torch.Tensor]:
        model = net(Apply(GoodCube), nn.Dropout(0.2))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with gradwatch.watch(model, opt, console=False) as gw:
            for step in range(4):
                opt.zero_grad()
                model(batch(seed=step)).pow(2).mean().backward()
                opt.step()
                if check:
                    assert gw.gradcheck().ok
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


# -- escalation: a NaN born in a custom Function's backward -------------------------------------------
class NaNBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, broken: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.broken = broken
        return torch.tanh(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        g = grad * (1 - torch.tanh(x) ** 2)
        return (g / 0.0 if ctx.broken else g), None


def test_a_nan_born_in_a_custom_backward_suggests_gradwatch_gradcheck() -> None:
    model = net(Apply(NaNBackward, False))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(3):
            model[1].extra = (step == 1,)
            opt.zero_grad()
            model(batch(seed=step)).pow(2).mean().backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert (origin.step, origin.op) == (1, "NaNBackwardBackward")
    assert origin.data["custom_function"] == "NaNBackward" and origin.data["check_with"] == "gradwatch.gradcheck"
    assert "gradwatch.gradcheck(model, batch)" in origin.message


# -- reports -------------------------------------------------------------------------------------------
def test_the_result_renders_a_panel_per_finding_and_lists_the_skipped(text_console: Any) -> None:
    class Parts(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return Cube.apply(h) + 0 * Bucketize.apply(h)

    text_console.print(gradwatch.gradcheck(net(Parts()), batch()))
    out = text_console.file.getvalue()
    assert panels(out) == [(["bad_backward"], 0)]
    assert re.search(r"input\s+ok\s+positions\s+max_abs_err\s+max_rel_err\s+backward\s+numerical", out)
    assert "1 custom autograd.Function(s) checked, 1 with a wrong backward, 1 skipped" in out
    assert f"skipped Bucketize: {SKIP_REASONS['integer_output']}" in out


def test_a_bad_backward_finding_round_trips_through_json() -> None:
    (f,) = gradwatch.gradcheck(net(Apply(Cube)), batch()).findings
    back = gradwatch.Finding.from_dict(__import__("json").loads(f.to_json()))
    assert (back.kind, back.op, back.data["wrong_inputs"]) == ("bad_backward", "CubeBackward", ["x"])


def test_the_docs_page_example_runs_as_written(capsys: Any) -> None:
    text = (ROOT / "docs" / "gradcheck.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/gradcheck.md", "exec"), {"__name__": "__main__"})  # noqa: S102 - our own docs
    assert "bad_backward CubeBackward ['x']" in capsys.readouterr().out


def test_torch_functional_is_not_a_custom_function() -> None:
    assert gradwatch.gradcheck(net(), batch(), loss_fn=lambda out: F.mse_loss(out, out.detach() + 1)).checked == []


class TransposedMatMul(torch.autograd.Function):
    """x @ w.t() taking w as a transposed (non-contiguous) view; the backward for w is not transposed back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, wt)
        return x @ wt

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, wt = ctx.saved_tensors
        return grad @ wt.t(), (x.t() @ grad).t()


def test_non_contiguous_inputs_are_perturbed_where_they_are_read() -> None:
    class Lin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return TransposedMatMul.apply(h.t().contiguous().t(), self.w.t())

    assert wrong(gradwatch.gradcheck(net(Lin()), batch())) == [("TransposedMatMulBackward", "1", ["wt"])]
