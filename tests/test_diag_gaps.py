"""Diagnoses that pointed at the wrong thing on real bug reports: the fix of a log keyed on the op that made its
input, the ``op`` of an ``inplace_error`` that names a view, and a module blamed for a NaN it was given."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradwatch


# -- a log's fix, by the op that produced its input ------------------------------------------------------
class LogSigmoidHead(nn.Module):
    """A binary classifier that returns log-probabilities the naive way."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.sigmoid(self.lin(x).squeeze(-1)))


class LogSoftmaxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.lin(x), dim=-1))


def _saturating_batch(i: int) -> torch.Tensor:
    x = torch.randn(8, 4) * 0.1
    if i in (1, 2):
        x[2, 0] = -200.0  # with weights of 1: a logit of about -200, a sigmoid of 0 in float32
    return x


def _unit_weights(lin: nn.Linear) -> None:
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]][: lin.out_features]))
        lin.bias.zero_()


def _origins(gw: gradwatch.Watcher) -> list[gradwatch.Finding]:
    return [f for f in gw.findings if f.kind == "nan_origin"]


def test_log_of_a_saturated_sigmoid_in_the_model_is_told_to_use_logsigmoid() -> None:
    torch.manual_seed(0)
    model = LogSigmoidHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for i in range(3):
            _unit_weights(model.lin)
            opt.zero_grad()
            (-model(_saturating_batch(i)).mean()).backward()
            opt.step()
    origins = _origins(gw)
    assert [f.step for f in origins] == [1, 2]
    for f in origins:
        assert f.op == "LogBackward0" and f.data["input_op"] == "Sigmoid"
        assert "F.logsigmoid(z)" in f.fix and "nn.BCEWithLogitsLoss" in f.fix
        assert "log_softmax" not in f.fix


@pytest.mark.parametrize("complement", [False, True], ids=["log_p", "log_1_minus_p"])
def test_a_hand_written_bce_in_the_loss_code_is_told_to_use_logsigmoid(complement: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for i in range(4):
            _unit_weights(model)
            x = _saturating_batch(i) * (-1 if complement else 1)  # 1 - sigmoid(200) is 0 as well
            p = torch.sigmoid(model(x).squeeze(-1))
            loss = -(torch.log(1 - p) if complement else torch.log(p)).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    suspects, named = _origins(gw)
    # Step 1 (replayed): the loss code's suspects, without the values they saw; step 2 (escalated): the op named.
    assert suspects.data["loss_ops"] == ["LogBackward0"] and named.op == "LogBackward0"
    for f in (suspects, named):
        assert "F.logsigmoid(z)" in f.fix and "F.logsigmoid(-z)" in f.fix and "nn.BCEWithLogitsLoss" in f.fix


def test_log_of_an_underflowed_softmax_keeps_the_log_softmax_fix() -> None:
    torch.manual_seed(0)
    model = LogSoftmaxHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for i in range(3):
            _unit_weights(model.lin)
            opt.zero_grad()
            (-model(_saturating_batch(i))[:, 0].mean()).backward()
            opt.step()
    origins = _origins(gw)
    assert [f.step for f in origins] == [1, 2]
    for f in origins:
        assert f.op == "LogBackward0" and f.data["input_op"] == "Softmax"
        assert "F.log_softmax(x, dim) instead of torch.log(torch.softmax(x, dim))" in f.fix and "logsigmoid" not in f.fix


# -- inplace_error: op is the node that saved the changed tensor -------------------------------------------
def test_gan_discriminator_stepped_before_the_generator_backward_names_the_saving_op() -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8, bias=False), nn.LeakyReLU(0.2), nn.Linear(8, 1, bias=False))
    model = nn.ModuleDict({"G": gen, "D": disc})
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    bce = nn.BCEWithLogitsLoss()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(model, [opt_g, opt_d], console=False) as gw:
            for _ in range(2):
                fake = gen(torch.randn(8, 4))
                d_loss = bce(disc(torch.randn(8, 4)), torch.ones(8, 1)) + bce(disc(fake.detach()), torch.zeros(8, 1))
                g_loss = bce(disc(fake), torch.ones(8, 1))
                opt_d.zero_grad()
                d_loss.backward()
                opt_d.step()  # the bug: D changes before the generator's backward goes through it
                opt_g.zero_grad()
                g_loss.backward()
                opt_g.step()
    (f,) = [f for f in gw.findings if f.kind == "inplace_error"]
    assert f.params[0].startswith("D.") and "optimizer.step()" in f.fix
    assert f.op == f.data["consumer"] and f.op.endswith("Backward0")  # not the view PyTorch names (AsStrided, T)
    assert f"the op that saved it is {f.op}." in f.message and f.op != f.data["node"]


class QueueModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 3)
        self.register_buffer("queue", torch.randn(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.encoder(x)
        logits = q @ self.queue.t()
        with torch.no_grad():
            self.queue[:4] = q.detach()  # enqueued before backward: the saved queue changes
        return logits


def test_a_buffer_written_in_place_names_the_op_that_saved_it_as_op() -> None:
    torch.manual_seed(0)
    model = QueueModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(model, opt, console=False) as gw:
            model(torch.randn(4, 4)).pow(2).mean().backward()
    (f,) = [f for f in gw.findings if f.kind == "inplace_error"]
    assert f.data["buffer"] == "queue" and f.data["modified_by"] == "x[idx] = ..."
    assert f.op == f.data["consumer"] == "MmBackward0" and f"saved it (shape [3, 16]) for {f.op}" in f.message


def test_a_loss_target_refilled_in_place_names_the_op_that_saved_it_as_op() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.BCELoss()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradwatch.watch(model, opt, console=False) as gw:
            label = torch.full((8,), 1.0)
            err_real = criterion(model(torch.randn(8, 4)).view(-1), label)
            label.fill_(0.0)  # the first BCE saved label as its target
            err_fake = criterion(model(torch.randn(8, 4)).view(-1), label)
            (err_real + err_fake).backward()
    (f,) = [f for f in gw.findings if f.kind == "inplace_error"]
    assert f.data["tensor"] == "label" and f.op == "BinaryCrossEntropyBackward0"
    assert f"after {f.op} saved it" in f.message


# -- a NaN made between submodules, in the parent's own forward --------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        h = torch.log(h - 10)  # NaN: enc's outputs are far below 10
        return self.head(h)


def test_a_nan_made_between_submodules_is_placed_in_the_parents_code_not_in_the_next_module() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    (f,) = _origins(gw)
    assert f.module == "<root>" and f.data["first_nonfinite_module"] == "head"
    assert f.data["first_nonfinite_module_given"] == "NaN" and f.data["last_finite_module"] == "enc"
    what = f.explanation.what
    assert "First module with a non-finite output: head" not in what and "from nan to nan" not in what
    assert (
        "The first module with a non-finite output, head, was given NaN and only passed it on: it was made by "
        "the forward code of <root> (Net) itself, after enc (the last module whose output was finite) and "
        "before head" in what
    )


# -- losses that go NaN/Inf by themselves ----------------------------------------------------------------
def test_cross_entropy_with_every_target_ignored_gets_the_reduction_sum_fix() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss(ignore_index=-100)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for i in range(3):
            y = torch.randint(0, 5, (8,))
            if i == 1:
                y[:] = -100  # every target of this batch is padding: the mean is 0/0
            loss = criterion(model(torch.randn(8, 4)), y)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "nonfinite_loss"]
    assert f.step == 1 and f.data["cause"] == "loss_only" and "ignore_index" in f.explanation.what
    assert "reduction='sum' divided by (target != ignore_index).sum().clamp_min(1)" in f.fix


def test_label_smoothing_over_many_classes_in_float16_is_told_to_keep_integer_targets() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 20000).half()  # the smoothing term sums 20000 log-probabilities of about -10
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for i in range(2):
            loss = nn.functional.cross_entropy(
                model(torch.randn(8, 16).half()), torch.randint(0, 20000, (8,)), label_smoothing=0.1 * i
            )
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (f,) = [f for f in gw.findings if f.kind == "nonfinite_loss"]
    assert f.step == 1 and f.data["cause"] == "float16" and "label_smoothing" in f.explanation.what
    # Class indices must stay integers: loss_fn(out.float(), y.float()) would fail in cross_entropy.
    assert "`loss_fn(out.float(), y)`" in f.fix and "y.float() for targets that are values" in f.fix


def test_a_normal_whose_sigma_reached_zero_is_told_to_floor_sigma() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for i in range(4):
            out = model(torch.randn(8, 4))
            sigma = torch.exp(out[:, 1] - (200.0 if i in (1, 2) else 0.0))  # exp(-200) is 0 in float32
            normal = torch.distributions.Normal(out[:, 0], sigma, validate_args=False)
            loss = -normal.log_prob(torch.zeros(8)).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    named = [f for f in _origins(gw) if f.op is not None]
    assert named and named[0].op == "DivBackward0" and "log_prob" in (named[0].data["code"] or "")
    assert "sigma = F.softplus(raw) + 1e-3" in named[0].fix
