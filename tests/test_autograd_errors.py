"""Autograd errors in a watched plain loop: each is explained as a finding naming the op and the module,
and the original exception leaves the ``with gradwatch.watch(...)`` block unchanged."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import gradwatch
from gradwatch.observe.tracing import ForwardTracer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.Sigmoid()
        self.post = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.act(self.lin(x)))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Net(nn.Module):
    """``encoder.layers.2.act`` is a Sigmoid; ``encoder.layers.2.post`` a ReLU that can be made in-place."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def break_at(self, step: int, current: int) -> None:
        self.encoder.layers[2].post.inplace = step == current


class Splitter(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=1)
        a.sigmoid_()
        return a + b


class SplitNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.mix = Splitter()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.body(x)))


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 4, generator=g) for _ in range(n)]


def run(
    model: nn.Module, body: Callable[[int, torch.Tensor, torch.optim.Optimizer], None], steps: int = 4, **config: object
) -> gradwatch.Watcher:
    """Run ``body`` for each step inside a watch block; the exception it raises propagates."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config.setdefault("console", False)
    with gradwatch.watch(model, opt, **config) as gw:
        run.gw = gw  # type: ignore[attr-defined]
        for i, x in enumerate(batches(steps)):
            body(i, x, opt)
    return gw


def only(gw: gradwatch.Watcher, kind: str) -> gradwatch.Finding:
    found = [f for f in gw.findings if f.kind == kind]
    assert len(found) == 1, [f.kind for f in gw.findings]
    return found[0]


def standard_step(model: nn.Module) -> Callable[[int, torch.Tensor, torch.optim.Optimizer], None]:
    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    return body


INPLACE_MESSAGE = re.escape("which is output 0 of Sigmoid, is at version 1; expected version 0 instead")


# -- inplace_error ---------------------------------------------------------------------------------
def test_inplace_error_on_the_first_step_names_the_op_module_and_the_inplace_op() -> None:
    torch.manual_seed(0)
    model = Net()
    model.break_at(0, 0)
    with pytest.raises(RuntimeError, match=INPLACE_MESSAGE) as raised:
        run(model, standard_step(model))
    assert type(raised.value) is RuntimeError
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert (f.step, f.op, f.module) == (0, "Sigmoid", "encoder.layers.2.act")
    assert f.data["shape"] == [4, 8]
    assert (f.data["expected_version"], f.data["version"]) == (0, 1)
    assert f.data["modified_in"] == "encoder.layers.2.post"
    assert f.data["modified_by"] == "relu(inplace=True)"
    assert "nn.ReLU(inplace=True)" in f.message


def test_inplace_error_is_printed() -> None:
    buf = io.StringIO()
    torch.manual_seed(0)
    model = Net()
    model.break_at(0, 0)
    with pytest.raises(RuntimeError, match=INPLACE_MESSAGE):
        run(model, standard_step(model), console=Console(file=buf, width=120, color_system=None))
    text = buf.getvalue()
    assert "gradwatch error: inplace_error at step 0" in text
    assert "Where: Sigmoid ran in module encoder.layers.2.act" in text
    assert "Modified by: relu(inplace=True) in module encoder.layers.2.post" in text


def test_inplace_error_in_steady_state_names_the_module_approximately() -> None:
    torch.manual_seed(0)
    model = Net()

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        model.break_at(2, i)
        standard_step(model)(i, x, opt)

    with pytest.raises(RuntimeError, match=INPLACE_MESSAGE):
        run(model, body)
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert (f.step, f.op) == (2, "Sigmoid")
    assert f.data["module_exact"] is False
    assert f.module == "encoder.layers.2.act"  # the only nn.Sigmoid in the model
    assert f.data["follows"] == "encoder.layers.2.lin"
    assert "approximate" in f.message


@pytest.mark.filterwarnings("ignore")  # anomaly mode's forward tracebacks while escalated
def test_inplace_error_while_escalated_names_the_module_exactly() -> None:
    torch.manual_seed(0)
    model = Net()

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        model.break_at(3, i)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if i == 1:
            loss = loss * float("nan")  # an incident: the following steps run escalated
        loss.backward()
        opt.step()

    with pytest.raises(RuntimeError, match=INPLACE_MESSAGE):
        run(model, body, steps=5)
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert f.step == 3
    assert f.data["module_exact"] is True
    assert (f.op, f.module, f.data["modified_in"]) == ("Sigmoid", "encoder.layers.2.act", "encoder.layers.2.post")


def test_inplace_error_from_augmented_assignment_names_the_operator() -> None:
    class AddInPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 8)
            self.out = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.exp(self.lin(x))
            h += 1
            return self.out(h)

    torch.manual_seed(0)
    model = AddInPlace()
    with pytest.raises(RuntimeError, match=re.escape("which is output 0 of Exp, is at version 1")):
        run(model, standard_step(model))
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert (f.op, f.module) == ("Exp", "<root AddInPlace>")
    assert f.data["modified_by"] == "add_"
    assert f.data["modified_at"].endswith("h += 1")


def test_view_modified_inplace_during_forward_names_the_module_and_line() -> None:
    torch.manual_seed(0)
    model = SplitNet()
    with pytest.raises(RuntimeError, match=r"Output 0 of Split\w* is a view and is being modified inplace") as raised:
        run(model, standard_step(model))
    assert type(raised.value) is RuntimeError
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert (f.step, f.op, f.module) == (0, "Split", "mix")
    assert f.data["source"].endswith("a.sigmoid_()")
    assert "split()/chunk()" in f.message


def test_view_modified_inplace_in_the_training_loop_names_that_line_not_the_with() -> None:
    model = nn.Linear(8, 4)
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        with gradwatch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), console=False) as gw:
            _mu, logvar = model(torch.randn(16, 8)).chunk(2, dim=1)
            logvar.exp_()  # refused: a view of chunk()
    f = only(gw, "inplace_error")
    assert f.data["source"].endswith("logvar.exp_()  # refused: a view of chunk()"), f.data["source"]


def test_hand_written_update_outside_no_grad_says_wrap_it_in_no_grad() -> None:
    model = nn.Linear(8, 1)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        with gradwatch.watch(model, console=False) as gw:
            for _ in range(2):
                nn.functional.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1)).backward()
                if gw.check():
                    for p in model.parameters():
                        p -= 0.1 * p.grad  # outside torch.no_grad()
    f = only(gw, "inplace_error")
    assert "p -= 0.1 * p.grad  # outside torch.no_grad()" in f.data["source"]
    assert "with torch.no_grad(): p -= lr * p.grad" in f.message and "forward failed" not in f.message


def test_view_modified_inplace_in_steady_state_names_the_module() -> None:
    torch.manual_seed(0)
    model = SplitNet()
    model.mix.forward = lambda x: x[:, :4] + x[:, 4:]  # type: ignore[method-assign]

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        if i == 2:
            del model.mix.forward  # back to the in-place Splitter.forward
        standard_step(model)(i, x, opt)

    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        run(model, body)
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert (f.step, f.module) == (2, "mix")


def test_optimizer_step_between_forward_and_backward_names_the_parameter() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        out = model(x)
        out.pow(2).mean().backward(retain_graph=True)
        opt.step()
        out.abs().mean().backward()  # its graph saved the weights before the step

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(model, body)
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert f.params == ("2.weight",)
    assert f.module == "2"
    assert "optimizer.step()" in f.message


# -- backward_twice --------------------------------------------------------------------------------
class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNNCell(4, 6)
        self.head = nn.Linear(6, 1)


def test_inplace_write_in_the_loss_code_points_at_the_loss_code() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), console=False) as gw:
            p = torch.sigmoid(model(torch.randn(16, 8)))
            p[:, 0] = 1.0  # into the saved sigmoid output, outside the model
            p.pow(2).mean().backward()
    f = only(gw, "inplace_error")
    assert f.module is None and "Probably in the loss code" in f.message and "p = p.clone()" in f.message


# https://github.com/pytorch/pytorch/issues/39141: D stepped before G_loss.backward(), one watcher per network.
def test_gan_watched_per_network_is_explained_once_by_the_owner_of_the_parameter() -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 15))
    disc = nn.Sequential(nn.Linear(15, 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())
    opt_d, opt_g = torch.optim.Adam(disc.parameters(), 1e-3), torch.optim.Adam(gen.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(gen, opt_g, console=False) as gw_g, gradwatch.watch(disc, opt_d, console=False) as gw_d:
            for _ in range(3):
                pr, pf = disc(torch.randn(8, 15)), disc(gen(torch.randn(8, 5)))
                loss_d = -torch.mean(torch.log(pr) + torch.log(1 - pf))
                loss_g = torch.mean(torch.log(1 - pf))
                opt_d.zero_grad()
                loss_d.backward(retain_graph=True)
                opt_d.step()
                opt_g.zero_grad()
                loss_g.backward()
                opt_g.step()
    assert gw_g.findings == []  # the generator's watcher leaves it to the discriminator's
    f = only(gw_d, "inplace_error")
    assert f.params == ("2.weight",) and "optimizer.step()" in f.message


def test_backward_twice_from_a_carried_hidden_state() -> None:
    torch.manual_seed(0)
    model = Recurrent()
    state = {"h": torch.zeros(4, 6)}

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        state["h"] = model.rnn(x, state["h"])  # not detached
        model.head(state["h"]).pow(2).mean().backward()
        opt.step()

    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time") as raised:
        run(model, body)
    assert type(raised.value) is RuntimeError
    f = only(run.gw, "backward_twice")  # type: ignore[attr-defined]
    assert f.step == 1
    assert f.data["cause"] == "carried_state"
    assert f.module == "rnn"
    assert "hidden = hidden.detach()" in f.message
    assert "retain_graph" in f.message


def test_backward_twice_with_two_optimizers_still_says_carried_state() -> None:
    # Encoder and decoder optimizers stepping back to back: the hidden state of the previous iteration.
    torch.manual_seed(0)
    model = Recurrent()
    opts = [torch.optim.SGD(model.rnn.parameters(), lr=0.01), torch.optim.SGD(model.head.parameters(), lr=0.01)]
    h = torch.zeros(4, 6)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        with gradwatch.watch(model, opts, console=False) as gw:
            for _ in range(3):
                h = model.rnn(torch.randn(4, 4), h)  # not detached
                for o in opts:
                    o.zero_grad()
                model.head(h).pow(2).mean().backward()
                for o in opts:
                    o.step()
    f = only(gw, "backward_twice")
    assert f.data["cause"] == "carried_state" and f.module == "rnn"


# The GAN of https://github.com/pytorch/examples/issues/116 with the discriminator's loss built on `fake`
# without .detach(): lossD.backward() frees the generator's graph before lossG.backward() needs it.
def test_backward_twice_in_a_gan_without_detach_says_detach_the_fake_sample() -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    gan = nn.ModuleDict({"G": gen, "D": disc})
    bce = nn.BCEWithLogitsLoss()
    opt_d = torch.optim.Adam(disc.parameters(), 2e-4)
    opt_g = torch.optim.Adam(gen.parameters(), 2e-4)
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as raised:
        with gradwatch.watch(gan, [opt_d, opt_g], console=False) as gw:
            for _ in range(3):
                real, fake = torch.randn(16, 8), gen(torch.randn(16, 4))
                opt_d.zero_grad()
                loss_d = bce(disc(real), torch.ones(16, 1)) + bce(disc(fake), torch.zeros(16, 1))
                loss_d.backward()
                opt_d.step()
                opt_g.zero_grad()
                bce(disc(fake), torch.ones(16, 1)).backward()
                opt_g.step()
    assert type(raised.value) is RuntimeError
    f = only(gw, "backward_twice")
    assert f.data["cause"] == "freed_by_other_optimizer"
    assert f.module == "G.2"
    assert "D(fake.detach())" in f.message and "hidden.detach()" not in f.message


def test_backward_twice_from_a_tensor_computed_from_parameters_before_the_loop_says_recompute() -> None:
    # Normalized prototypes computed once before the loop: detaching them (the hidden-state fix) would stop
    # the prototypes from training.
    class Protos(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(4, 8)
            self.protos = nn.Parameter(torch.randn(3, 8))

        def forward(self, x: torch.Tensor, protos_n: torch.Tensor) -> torch.Tensor:
            return self.enc(x) @ protos_n.t()

    torch.manual_seed(0)
    model = Protos()
    protos_n = nn.functional.normalize(model.protos, dim=-1)

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        model(x, protos_n).pow(2).mean().backward()
        opt.step()

    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        run(model, body)
    f = only(run.gw, "backward_twice")  # type: ignore[attr-defined]
    assert f.step == 1
    assert "recompute it inside the loop" in f.message


def test_retain_graph_over_a_carried_hidden_state_names_the_state_as_the_cause() -> None:
    torch.manual_seed(0)
    model = Recurrent()
    state = {"h": torch.zeros(4, 6)}

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        state["h"] = model.rnn(x, state["h"])  # not detached; retain_graph "fixes" backward_twice
        model.head(state["h"]).pow(2).mean().backward(retain_graph=True)
        opt.step()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(model, body)
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert f.step == 2 and "rnn.weight_hh" in f.message
    assert "h = h.detach()" in f.message and "retain_graph" in f.message


def test_backward_twice_from_a_running_total_of_losses() -> None:
    torch.manual_seed(0)
    model = Net()
    state = {"total": torch.zeros(())}

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        state["total"] = state["total"] + model(x).pow(2).mean()
        state["total"].backward()
        opt.step()

    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        run(model, body)
    f = only(run.gw, "backward_twice")  # type: ignore[attr-defined]
    assert (f.step, f.data["cause"]) == (1, "running_total")
    assert "loss.item()" in f.message


def test_backward_twice_within_one_step() -> None:
    torch.manual_seed(0)
    model = Net()

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        h = model.encoder(x)
        model.head(h).pow(2).mean().backward()
        model.head(h).abs().mean().backward()  # through the encoder again
        opt.step()

    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        run(model, body)
    f = only(run.gw, "backward_twice")  # type: ignore[attr-defined]
    assert (f.step, f.data["cause"]) == (0, "same_step")
    assert "(loss_a + loss_b).backward()" in f.message


# -- no_grad_graph ---------------------------------------------------------------------------------
NO_GRAD_MESSAGE = "element 0 of tensors does not require grad and does not have a grad_fn"


def test_no_grad_graph_from_a_forward_under_no_grad() -> None:
    torch.manual_seed(0)
    model = Net()

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            out = model(x)
        out.pow(2).mean().backward()

    with pytest.raises(RuntimeError, match=NO_GRAD_MESSAGE) as raised:
        run(model, body)
    assert type(raised.value) is RuntimeError
    f = only(run.gw, "no_grad_graph")  # type: ignore[attr-defined]
    assert f.data["cause"] == "forward_under_no_grad"
    assert "torch.no_grad()" in f.message


def test_no_grad_graph_from_frozen_parameters() -> None:
    torch.manual_seed(0)
    model = Net()

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        model.requires_grad_(False)
        model(x).pow(2).mean().backward()

    with pytest.raises(RuntimeError, match=NO_GRAD_MESSAGE):
        run(model, body)
    f = only(run.gw, "no_grad_graph")  # type: ignore[attr-defined]
    assert f.data["cause"] == "all_frozen"
    assert "requires_grad=False" in f.message


class LinearProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(4, 3).requires_grad_(False)
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.backbone(x)
        return features, self.head(features)


# https://taourl.com/read-2220112.html (the error when fine-tuning with frozen layers)
def test_loss_on_frozen_features_while_the_head_output_has_a_graph_names_both_causes() -> None:
    model = LinearProbe()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="does not require grad"):
        with gradwatch.watch(model, opt, console=False) as gw:
            features, out = model(torch.randn(8, 4))  # noqa: RUF059 - the finding names this variable
            loss = (features - torch.randn(8, 3)).pow(2).mean()  # meant: out
            opt.zero_grad()
            loss.backward()
    f = only(gw, "no_grad_graph")
    assert f.data["cause"] == "frozen_or_detached"
    assert "`out`" in f.message and "backbone.weight" in f.message and ".detach()" in f.message


def test_no_grad_graph_through_frozen_layers_with_another_trainable_parameter_says_frozen() -> None:
    torch.manual_seed(0)
    model = Net()
    model.temperature = nn.Parameter(torch.ones(()))  # trainable, but not on this loss's path

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        model.encoder.requires_grad_(False)
        model.head.requires_grad_(False)
        model(x).pow(2).mean().backward()

    with pytest.raises(RuntimeError, match=NO_GRAD_MESSAGE):
        run(model, body)
    f = only(run.gw, "no_grad_graph")  # type: ignore[attr-defined]
    assert f.data["cause"] == "frozen_path"
    assert "requires_grad=False" in f.message and "head.weight" in f.message


def test_no_grad_graph_from_an_item_round_trip_names_the_variable_with_a_graph() -> None:
    torch.manual_seed(0)
    model = Net()

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        prediction = model(x)
        loss = torch.tensor(prediction.pow(2).mean().item())
        loss.backward()

    with pytest.raises(RuntimeError, match=NO_GRAD_MESSAGE):
        run(model, body)
    f = only(run.gw, "no_grad_graph")  # type: ignore[attr-defined]
    assert f.data["cause"] == "detached"
    assert "`prediction` still has a graph" in f.message
    assert ".item()" in f.message


# -- nonscalar_backward ----------------------------------------------------------------------------
# https://github.com/LZGMatrix/BOP19_CDPN_2019ICCV/issues/4: a loss built from argmax has no grad_fn.
def test_no_grad_graph_from_an_argmax_loss_names_ops_without_a_gradient() -> None:
    model = nn.Linear(8, 3)
    with pytest.raises(RuntimeError, match="does not require grad"):
        with gradwatch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), console=False) as gw:
            loss = (model(torch.randn(16, 8)).argmax(1) != torch.randint(0, 3, (16,))).float().mean()
            loss.backward()
    f = only(gw, "no_grad_graph")
    assert "argmax" in f.message and "cross_entropy on the logits" in f.message


class _NoGradStepSGD(torch.optim.Optimizer):
    """A third-party optimizer whose whole step(), closure call included, runs under no_grad."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(me, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for g in me.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])
        return loss


# The closure-under-no_grad failure of https://github.com/Lightning-AI/pytorch-lightning/issues/18222
def test_closure_inside_a_no_grad_optimizer_step_says_enable_grad() -> None:
    model = nn.Linear(8, 1)
    opt = _NoGradStepSGD(model.parameters())
    x, y = torch.randn(16, 8), torch.randn(16, 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="does not require grad"):
        with gradwatch.watch(model, opt, console=False) as gw:
            opt.step(closure)
    f = only(gw, "no_grad_graph")
    assert f.data["cause"] == "closure_under_no_grad", f.message
    assert "_NoGradStepSGD.step()" in f.message and "torch.enable_grad()" in f.message


def test_nonscalar_backward_of_a_loss_with_reduction_none_names_the_loss() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        with gradwatch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), console=False) as gw:
            nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1), reduction="none").backward()
    f = only(gw, "nonscalar_backward")
    assert "per-element output of MseLoss" in f.message and "no reduction in between" not in f.message


def test_nonscalar_backward_gives_the_shape_and_the_reduction() -> None:
    torch.manual_seed(0)
    model = Net()

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        model(x).backward()

    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs") as raised:
        run(model, body)
    assert type(raised.value) is RuntimeError
    f = only(run.gw, "nonscalar_backward")  # type: ignore[attr-defined]
    assert f.data["shape"] == [4, 1]
    assert f.module == "head"
    assert "loss.mean()" in f.message and "gradient=torch.ones_like(out)" in f.message


# -- never in the way ------------------------------------------------------------------------------
def test_other_exceptions_pass_through_without_a_finding() -> None:
    torch.manual_seed(0)
    model = Net()

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        run(model, body)
    assert run.gw.findings == []  # type: ignore[attr-defined]


def test_explain_returns_the_finding_for_a_caught_error() -> None:
    torch.manual_seed(0)
    model = Net()
    with gradwatch.watch(model, console=False) as gw:
        try:
            model(torch.randn(3, 4)).backward()
        except RuntimeError as e:
            finding = gw.explain(e)
    assert finding is not None and finding.kind == "nonscalar_backward"
    assert gw.findings == [finding]


def test_only_the_first_step_is_traced() -> None:
    torch.manual_seed(0)
    model = Net()
    modes: list[int] = []
    model.head.register_forward_pre_hook(lambda m, a: modes.append(len(_get_current_function_mode_stack())))
    run(model, standard_step(model))
    assert modes == [1, 0, 0, 0]
    assert _get_current_function_mode_stack() == []


def test_a_forward_that_raises_leaves_no_tracing_behind() -> None:
    torch.manual_seed(0)
    model = SplitNet()
    before = dict(torch.nn.modules.module._global_forward_hooks)
    with pytest.raises(RuntimeError):
        run(model, standard_step(model))
    assert _get_current_function_mode_stack() == []
    assert dict(torch.nn.modules.module._global_forward_hooks) == before
    tracer = run.gw.engine.extension(ForwardTracer)  # type: ignore[attr-defined]
    assert tracer.records == {}


def test_tracing_does_not_change_the_training_result() -> None:
    def train(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        gw = gradwatch.watch(model, opt, console=False) if watched else None
        for x in batches(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        if gw is not None:
            gw.close()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False)))


class QueueModel(nn.Module):
    """A MoCo-style queue of keys, enqueued inside forward after the logits were computed from it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 3)
        self.register_buffer("queue", torch.randn(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.encoder(x)
        logits = q @ self.queue.t()
        with torch.no_grad():
            self.queue[:4] = q.detach()  # enqueue before backward: the saved queue changes
        return logits


# https://github.com/facebookresearch/moco/issues/128 (the queue written in place by _dequeue_and_enqueue)
def test_buffer_written_in_place_after_the_forward_used_it_is_named_with_the_line() -> None:
    model = QueueModel()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(model, standard_step(model))
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert f.step == 0 and f.data["buffer"] == "queue"
    assert "buffer queue" in f.message and "self.queue[:4] = q.detach()" in f.message
    assert "not traced" not in f.message and "self.queue.clone()" in f.message


class NormalizeInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.enc(x)
        z /= z.norm(dim=1, keepdim=True)  # the norm saved z; the division overwrites it
        return self.head(z)


# https://discuss.pytorch.org/t/encounter-the-runtimeerror-one-of-the-variables-needed-for-gradient-computation-has-been-modified-by-an-inplace-operation/836
def test_inplace_division_names_the_overwritten_output_not_the_division() -> None:
    model = NormalizeInPlace()
    with pytest.raises(RuntimeError, match="which is output 0 of Div,"):
        run(model, standard_step(model))
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert (f.step, f.op, f.module) == (0, "Addmm", "enc")
    assert f.data["modified_by"] == "div_" and "z /= z.norm" in f.data["modified_at"]


# https://discuss.pytorch.org/t/loss-backward-raises-error-grad-can-be-implicitly-created-only-for-scalar-outputs/12152
def test_loss_reduced_over_one_dimension_only_says_so() -> None:
    model = Net()

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        model(x).pow(2).mean(dim=1).backward()  # one loss per sample

    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        run(model, body)
    f = only(run.gw, "nonscalar_backward")  # type: ignore[attr-defined]
    assert f.data["shape"] == [4] and "reduced (Mean) over some dimensions but not all" in f.message
    assert "no reduction in between" not in f.message


class TiedMaxNorm(nn.Module):
    """nn.Embedding(max_norm=...) with its weight also used directly, before the lookup renormalizes it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8, max_norm=1.0)
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.emb.weight.mul_(3)  # rows above max_norm: the lookup really rewrites them

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        prior = self.proj.weight @ self.emb.weight.t()  # saves the weight ...
        h = self.proj(self.emb(tok))  # ... which the max_norm lookup then renormalizes in place
        return h @ self.emb.weight.t() + prior.sum(0)


# https://github.com/pytorch/pytorch/issues/26596 (max_norm with the embedding weight used elsewhere)
def test_embedding_max_norm_renormalizing_a_saved_weight_is_named_with_its_fix() -> None:
    model = TiedMaxNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(model, opt, console=False) as gw:
            tok = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(0))
            model(tok).sum().backward()
    f = only(gw, "inplace_error")
    assert (f.step, f.params, f.data["modified_by"], f.data["modified_in"]) == (0, ("emb.weight",), "embedding", "emb")
    assert "max_norm" in f.message and "optimizer.step()" not in f.message


_NO_WITH_SCRIPT = """
import torch, torch.nn as nn, gradwatch
from rich.console import Console
model = nn.Sequential(nn.Linear(8, 16), nn.Sigmoid(), nn.ReLU(inplace=True), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gw = gradwatch.watch(model, opt, console=Console(width=200, color_system=None))  # no `with`
loss = model(torch.randn(4, 8)).pow(2).mean()
loss.backward()
"""


def test_an_uncaught_autograd_error_is_explained_without_a_with_block(tmp_path: Any) -> None:
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_NO_WITH_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "modified by an inplace operation" in done.stderr  # Python's own traceback, unchanged
    assert "inplace_error" in done.stdout and "ReLU" in done.stdout, done.stdout[-2000:]


def test_an_error_explained_by_hand_and_re_raised_out_of_the_with_block_is_one_finding() -> None:
    model = nn.Linear(8, 2)
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        with gradwatch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), console=False) as gw:
            try:
                model(torch.randn(4, 8)).backward()
            except RuntimeError as e:
                assert gw.explain(e) is not None
                raise
    assert [f.kind for f in gw.findings] == ["nonscalar_backward"]


@pytest.mark.parametrize("view", [False, True])
def test_writing_into_a_tensor_created_with_requires_grad_gets_the_fix_that_keeps_the_graph(view: bool) -> None:
    # A forward that pools into `torch.zeros(B, 8, requires_grad=True)` with `+=` (or writes `outs[:, t] = h`).
    # The fix said "run it under torch.no_grad()", which cuts the RNN out of the graph (none_grad next run).
    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.head = nn.GRUCell(4, 8), nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.zeros(x.shape[0], 8)
            if view:
                outs = torch.zeros(x.shape[0], x.shape[1], 8, requires_grad=True)
                for t in range(x.shape[1]):
                    h = self.rnn(x[:, t], h)
                    outs[:, t] = h
                return self.head(outs.mean(1))
            pooled = torch.zeros(x.shape[0], 8, requires_grad=True)
            for t in range(x.shape[1]):
                h = self.rnn(x[:, t], h)
                pooled += h / x.shape[1]
            return self.head(pooled)

    model = Pool()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        with gradwatch.watch(model, opt, console=False) as gw:
            loss = model(torch.randn(4, 5, 4)).pow(2).mean()
            loss.backward()
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "inplace_error"]
    name = "outs" if view else "pooled"
    assert f"`{name}`, a tensor created with requires_grad=True (not a parameter)" in f.message
    assert f"create `{name}` without requires_grad" in f.message and "run it under" not in f.message


class _Bank(nn.Module):
    """Instance discrimination with a memory bank buffer (MoCo-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.register_buffer("bank", nn.functional.normalize(torch.randn(64, 8), dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.enc(x), dim=1)


def test_a_memory_bank_written_with_its_graph_before_backward_is_named_with_the_detach_fix() -> None:
    # bank[idx] = feats (no .detach()) between the loss and backward(): autograd saved bank.t() (a view,
    # AsStrided), which the error named instead of the buffer; the fix did not say to detach.
    torch.manual_seed(0)
    model = _Bank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(model, opt, console=False) as gw:
            idx, x = torch.randint(0, 64, (8,)), torch.randn(8, 8)
            feats = model(x)
            loss = nn.functional.cross_entropy(feats @ model.bank.t() / 0.1, idx)
            model.bank[idx] = feats
            loss.backward()
    (f,) = [f for f in gw.findings if f.kind == "inplace_error"]
    assert f.data["buffer"] == "bank" and "self.bank[idx] = feats.detach()" in f.message


class _PopArt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("mean", torch.zeros(1))
        self.register_buffer("std", torch.ones(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h) / self.std + self.mean

    def update(self, target: torch.Tensor) -> None:
        self.mean.mul_(0.9).add_(0.1 * target.mean())
        self.std.mul_(0.9).add_(0.1 * target.std())


def test_running_statistics_updated_before_backward_name_every_buffer_that_matches() -> None:
    # PopArt-style running statistics updated between forward and backward: DivBackward0 saved `std`, but
    # `mean` has the same size and version; only `mean` was named.
    torch.manual_seed(0)
    model = _PopArt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(model, opt, console=False) as gw:
            target = torch.randn(8, 1)
            loss = (model(torch.randn(8, 4)) - target).pow(2).mean()
            model.update(target)
            loss.backward()
    (f,) = [f for f in gw.findings if f.kind == "inplace_error"]
    assert {f.data["buffer"], *f.data["buffers_alike"]} == {"mean", "std"}
    assert "same size and version" in f.message


class _Leaky(nn.Module):
    """A spiking neuron that keeps its membrane potential on the module (snnTorch style), never reset."""

    def __init__(self) -> None:
        super().__init__()
        self.mem: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mem = x if self.mem is None else 0.9 * self.mem + x
        return torch.sigmoid(self.mem - 1.0)


def test_state_kept_on_modules_across_iterations_is_named() -> None:
    # jeshraghian/snntorch#250 pattern: the membrane state lif1.mem carries step 0's graph into step 1.
    # The finding named the nearest parameter's module (fc2) and the RNN `hidden.detach()` fix.
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(4, 8))
    model.add_module("lif1", _Leaky())
    model.add_module("fc2", nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        with gradwatch.watch(model, opt, console=False) as gw:
            for _ in range(2):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    (f,) = [f for f in gw.findings if f.kind == "backward_twice"]
    assert f.step == 1 and f.data["state_attributes"] == ["lif1.mem"] and f.module == "lif1"
    assert "self.mem = self.mem.detach()" in f.message


# -- anomaly mode ----------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore")  # anomaly mode's forward tracebacks
def test_anomaly_mode_on_a_nan_born_in_the_forward_names_the_forward_op() -> None:
    # torch.autograd.detect_anomaly() stops at the first backward op returning NaN, which only carries the NaN
    # of a loss that was NaN already: gradwatch blamed that op ("an Inf reached it from an earlier backward op").
    class SqrtFeature(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 8)
            self.out = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.cat([torch.sqrt(x[:, :1]), x[:, 1:]], 1)  # NaN for a negative feature
            return self.out(torch.relu(self.lin(x)))

    torch.manual_seed(0)
    model = SqrtFeature()

    def body(i: int, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        x = x.clone()
        x[:, 0] = x[:, 0].abs() + 0.1
        if i == 2:
            x[1, 0] = -2.0
        opt.zero_grad()
        with torch.autograd.detect_anomaly():
            model(x).pow(2).mean().backward()
        opt.step()

    with pytest.raises(RuntimeError, match="returned nan values"):
        run(model, body)
    f = only(run.gw, "nan_origin")  # type: ignore[attr-defined]
    assert (f.step, f.data["phase"], f.data["op"], f.module) == (2, "forward", "torch.sqrt", "<root>"), f.message
    assert "torch.sqrt(x[:, :1])" in f.message and "Inf reached it" not in f.message
    assert f.data["raised"] and f.data["anomaly_op"] in f.message
    assert not torch.is_anomaly_enabled()


class PerceptualLoss(nn.Module):
    """A frozen VGG-style feature extractor, sliced at the conv outputs (its ReLU made in-place by the test)."""

    def __init__(self) -> None:
        super().__init__()
        feats = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        feats.requires_grad_(False)
        self.slices = nn.ModuleList([feats[:1], feats[1:]])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = x.new_zeros(())
        for part in self.slices:
            x, y = part(x), part(y)
            loss = loss + nn.functional.mse_loss(x, y)  # saves x; the next slice's ReLU overwrites it
        return loss


# Real-world report: perceptual (VGG) loss whose features use ReLU(inplace=True), blamed on the model's ReLU.
@pytest.mark.parametrize("broken_at", [0, 2])
def test_inplace_relu_in_the_loss_feature_extractor_is_not_blamed_on_the_models_relu(broken_at: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 3, padding=1))
    crit = PerceptualLoss()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="which is output 0 of Relu"):
        with gradwatch.watch(model, opt, console=False) as gw:
            for i in range(4):
                crit.slices[1][0].inplace = i == broken_at  # the ReLU
                clean = torch.rand(2, 3, 6, 6)
                loss = crit(model(clean + 0.1 * torch.randn_like(clean)), clean)
                opt.zero_grad()
                loss.backward()
                opt.step()
    f = only(gw, "inplace_error")
    assert (f.step, f.module, f.op) == (broken_at, None, "Relu")
    assert f.data["outside_model"] is True and f.data["foreign_modules"] == ["crit.slices.1.1"]
    assert "nn.ReLU(inplace=False)" in f.message and "module 1" not in f.message


# Real-world report: mean teacher whose EMA update (in place, under no_grad) runs before loss.backward().
def test_ema_teacher_updated_before_backward_names_the_teachers_parameter() -> None:
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    teacher = copy.deepcopy(model)  # requires_grad left on, not watched
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(model, opt, console=False) as gw:
            for _ in range(3):
                x = torch.randn(16, 8)
                loss = nn.functional.mse_loss(model(x).softmax(-1), teacher(x).softmax(-1))
                with torch.no_grad():
                    for tp, sp in zip(teacher.parameters(), model.parameters()):
                        tp.mul_(0.99).add_(sp, alpha=0.01)
                opt.zero_grad()
                loss.backward()
                opt.step()
    f = only(gw, "inplace_error")
    assert f.data["param"] == "teacher.2.weight" and f.data["outside_model"] is True
    assert f.module is None and "loss code" not in f.message
    assert "EMA" in f.message and "teacher.requires_grad_(False)" in f.message


# Real-world report: micro-batch losses summed for one backward every 4 batches, the total never reset.
def test_summed_micro_batch_losses_never_reset_are_a_running_total_not_a_hidden_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        with gradwatch.watch(model, opt, console=False) as gw:
            acc_loss = 0.0
            for i in range(12):
                acc_loss = acc_loss + nn.functional.mse_loss(model(torch.randn(8, 10)), torch.randn(8, 1)) / 4
                if (i + 1) % 4 == 0:
                    acc_loss.backward()  # type: ignore[union-attr]
                    opt.step()
                    opt.zero_grad()  # acc_loss is never reset
    f = only(gw, "backward_twice")
    assert (f.step, f.data["cause"], f.data["total"]) == (1, "running_total", "acc_loss")
    assert "`acc_loss = 0` right after `acc_loss.backward()`" in f.message and "hidden.detach()" not in f.message


class PreallocRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.cell = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hs = x.new_zeros(x.shape[0], 4, 16)
        for t in range(3):
            hs[:, t + 1] = torch.tanh(self.cell(hs[:, t]) + self.inp(x))  # cell saved hs[:, t]
        return hs[:, 1:].mean(1)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = PreallocRNN()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x))


# https://discuss.pytorch.org/t/encounter-the-runtimeerror-one-of-the-variables-needed-for-gradient-computation-has-been-modified-by-an-inplace-operation/836
def test_preallocated_rnn_states_filled_in_place_name_the_module_and_the_slice_assignment() -> None:
    torch.manual_seed(0)
    model = Tagger()
    with pytest.raises(RuntimeError, match="which is output 0 of AsStrided"):
        run(model, standard_step(model))
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert (f.step, f.module, f.op) == (0, "rnn", "MmBackward0")  # the node that saved the view, as the message says
    assert f.data["modified_by"] == "x[idx] = ..." and f.data["modified_in"] == "rnn"
    assert f.data["modified_at"].endswith("hs[:, t + 1] = torch.tanh(self.cell(hs[:, t]) + self.inp(x))  # cell saved hs[:, t]")
    assert "loss code" not in f.message and "torch.stack(outs, dim=1)" in f.message


class HardSigmoidFn(torch.autograd.Function):
    """A memory-efficient activation that saves its output for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = (x / 6 + 0.5).clamp(0, 1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return g * ((y > 0) & (y < 1)).to(g.dtype) / 6


class FnAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return HardSigmoidFn.apply(x)


class FnResBlock(nn.Module):
    def __init__(self, direct: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = FnAct()
        self.direct = direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = HardSigmoidFn.apply(self.fc(x)) if self.direct else self.act(self.fc(x))
        out += x  # overwrites the output HardSigmoidFn saved
        return out


# Real-world report: a custom autograd.Function saving its output, then `out += identity` in the block.
@pytest.mark.parametrize("direct", [False, True])
def test_custom_function_output_modified_in_place_names_its_module(direct: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), FnResBlock(direct), nn.Linear(4, 1))
    with pytest.raises(RuntimeError, match="which is output 0 of HardSigmoidFn"):
        run(model, standard_step(model))
    f = only(run.gw, "inplace_error")  # type: ignore[attr-defined]
    assert f.op == "HardSigmoidFn" and "loss code" not in f.message
    if direct:  # apply() inside the block's own forward: approximate, from the graph
        assert f.data["follows"] == "1.fc" and f.data["module_exact"] is False
    else:
        assert (f.module, f.data["modified_in"], f.data["modified_by"]) == ("1.act", "1", "add_")
        assert f.data["modified_at"].endswith("out += x  # overwrites the output HardSigmoidFn saved")


# Real-world report: WGAN critic loss D(fake) - D(real) left unreduced, and a per-sample Dice loss.
@pytest.mark.parametrize("loss_kind", ["critic", "dice"])
def test_nonscalar_loss_built_from_several_outputs_names_the_module_and_the_backward_line(loss_kind: str) -> None:
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        with gradwatch.watch(critic, torch.optim.RMSprop(critic.parameters(), 5e-5), console=False) as gw:
            real, fake = torch.randn(16, 8), torch.randn(16, 8)
            if loss_kind == "critic":
                err = critic(fake) - critic(real)  # no .mean()
            else:
                p, t = torch.sigmoid(critic(fake)).flatten(1), (real[:, :1] > 0).float()
                err = 1 - (2 * (p * t).sum(1) + 1) / (p.sum(1) + t.sum(1) + 1)  # one Dice loss per sample
            err.backward()
    f = only(gw, "nonscalar_backward")
    assert f.module == "2" and f.data["module_exact"] is False
    assert f.data["source"].endswith("err.backward()") and "`err.mean()`" in f.message
    assert ("reduced (Sum)" in f.message) is (loss_kind == "dice")


class PadZeroing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 4)
        self.fc = nn.Linear(4, 1)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        self.embedding.weight[0] = 0  # the padding row, zeroed by hand in every forward
        return self.fc(self.embedding(tok).mean(1))


# Real-world reports: WGAN weight clipping outside no_grad; an embedding's padding row zeroed in forward.
@pytest.mark.parametrize("case", ["clip", "pad_row"])
def test_inplace_write_into_a_parameter_names_the_parameter(case: str) -> None:
    torch.manual_seed(0)
    model: nn.Module = PadZeroing() if case == "pad_row" else nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    opt = torch.optim.RMSprop(model.parameters(), 5e-5)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        with gradwatch.watch(model, opt, console=False) as gw:
            for _ in range(2):
                x = torch.randint(0, 20, (8, 5)) if case == "pad_row" else torch.randn(8, 8)
                opt.zero_grad()
                model(x).mean().backward()
                opt.step()
                if case == "clip":
                    for p in model.parameters():
                        p.clamp_(-0.01, 0.01)  # outside torch.no_grad()
    f = only(gw, "inplace_error")
    if case == "clip":
        assert f.params == ("0.weight",) and "with torch.no_grad(): for p in critic.parameters()" in f.message
    else:
        assert f.params == ("embedding.weight",) and "padding_idx=PAD" in f.message


# -- in-place writes of the training code, outside the model's forward -----------------------------------


def _gan_label_refilled(batch: int) -> gradwatch.Watcher:
    """A DCGAN discriminator step that refills its label tensor in place after the first BCE saved it; the
    BatchNorm has 8 channels, so with batch=8 its running_mean has the target's shape (and version)."""
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 1), nn.Sigmoid())
    criterion = nn.BCELoss()
    opt = torch.optim.Adam(disc.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(disc, opt, console=False) as gw:
            for _ in range(2):
                label = torch.full((batch,), 1.0)
                opt.zero_grad()
                err_real = criterion(disc(torch.randn(batch, 4)).view(-1), label)
                label.fill_(0.0)  # the bug: the first BCE saved label as its target
                err_fake = criterion(disc(torch.randn(batch, 4)).view(-1), label)
                (err_real + err_fake).backward()
                opt.step()
    return gw


@pytest.mark.parametrize("batch", [8, 5])
def test_a_loss_target_refilled_in_place_is_named_with_its_line_not_a_same_size_buffer(batch: int) -> None:
    gw = _gan_label_refilled(batch)
    (f,) = [f for f in gw.findings if f.kind == "inplace_error"]
    assert "tensor label (shape" in f.message and "BinaryCrossEntropyBackward0 saved it" in f.message
    assert "running_mean" not in f.message
    assert re.search(r"Modified by: label\.fill_\(\) at .*test_autograd_errors\.py:\d+: label\.fill_\(0\.0\)", f.message)
    assert f.data["tensor"] == "label" and f.data["modified_by"] == "fill_" and f.module is None
    assert "torch.full_like(label, value)" in f.message


def test_an_in_place_clamp_of_a_model_output_after_the_forward_names_the_op_and_its_line() -> None:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3), nn.Softmax(dim=-1))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(policy, opt, console=False) as gw:
            probs = policy(torch.randn(5, 4))
            probs.clamp_(min=1e-6)  # the bug: Softmax saved its output
            actions = torch.multinomial(probs, 1)
            loss = -torch.log(probs.gather(1, actions)).mean()
            opt.zero_grad()
            loss.backward()
    (f,) = [f for f in gw.findings if f.kind == "inplace_error"]
    assert f.op == "Softmax" and f.module == "3"
    assert re.search(r"Modified by: probs\.clamp_\(\) at .*test_autograd_errors\.py:\d+: probs\.clamp_\(min=1e-6\)", f.message)
    assert f.data["modified_by"] == "clamp_" and "probs = probs.clamp(...)" in f.message
