"""Escalation under Lightning: training_step replayed on the captured batch names the op and module."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import pytest
import torch
from helpers import lightning_namespace, tiny_trainer
from torch import nn

ns = lightning_namespace("lightning.pytorch")

from test_escalation import BAD_STEP, SOURCES, Source, batch  # noqa: E402

from gradwatch.lightning import GradWatchCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:.*The number of training batches.*",
    "ignore:.*isinstance.*treespec.*",
)


class SourceModule(ns.LightningModule):  # type: ignore[misc,name-defined]
    """The plain-loop test model as a LightningModule; counts real self.log calls and optimizer steps."""

    def __init__(
        self, kind: str, *, manual: bool = False, loss_log: bool = False, loss_inf: bool = False, steps: int = 6
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.loss_log, self.loss_inf, self.steps = kind, loss_log, loss_inf, steps
        self.automatic_optimization = not manual
        self.encoder = nn.Sequential(OrderedDict([(SOURCES[kind][0], Source(kind))]))
        self.head = nn.Linear(1 if kind == "sqrt" else 4, 1)
        self.log_calls = 0
        self.step_calls = 0
        self.training_step_calls = 0
        self.anomaly_seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def log(self, *args: Any, **kwargs: Any) -> None:
        self.log_calls += 1
        super().log(*args, **kwargs)

    def training_step(self, x: torch.Tensor, batch_idx: int) -> Any:
        self.training_step_calls += 1
        out = self(x)
        if self.loss_log and batch_idx == BAD_STEP:
            loss = torch.log(out - out.detach()).mean()  # log(0) in the loss, outside any module
        elif self.loss_inf:  # a sentinel weight that was meant to be masked out
            loss = out.pow(2).mean() * (float("inf") if batch_idx == BAD_STEP else 1.0)
        else:
            loss = out.pow(2).mean()
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.anomaly_seen.append(torch.is_anomaly_enabled())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        opt.register_step_post_hook(lambda *a: setattr(self, "step_calls", self.step_calls + 1))
        return opt

    def train_dataloader(self) -> Any:
        bad = () if self.loss_log or self.loss_inf else BAD_STEP  # the loss test: the model itself stays finite
        data = [batch(i, self.kind, bad) for i in range(self.steps)]
        return torch.utils.data.DataLoader(data, batch_size=None)


def fit(module: SourceModule, **config: Any) -> GradWatchCallback:
    config.setdefault("console", False)
    cb = GradWatchCallback(**config)
    tiny_trainer(ns, [cb], max_steps=module.steps).fit(module)
    return cb


def origins(cb: GradWatchCallback) -> list[Any]:
    return [f for f in cb.findings if f.kind == "nan_origin"]


@pytest.mark.parametrize("kind", list(SOURCES))
def test_origin_named_on_first_nonfinite_step(kind: str) -> None:
    cb = fit(SourceModule(kind), on_nonfinite="skip")
    first = origins(cb)[0]
    name, op = SOURCES[kind]
    assert (first.step, first.op, first.module) == (BAD_STEP, op, f"encoder.{name}")
    assert first.data["replayed"] is True


@pytest.mark.parametrize("kind", ["sqrt", "exp"])
def test_origin_named_under_warn(kind: str) -> None:
    cb = fit(SourceModule(kind), on_nonfinite="warn")
    first = origins(cb)[0]
    assert (first.step, first.op) == (BAD_STEP, SOURCES[kind][1])


def test_replay_does_not_log_nor_step() -> None:
    module = SourceModule("div")
    fit(module, on_nonfinite="skip")
    assert module.log_calls == module.steps
    assert module.step_calls == module.steps


def test_manual_optimization_replay_uses_manual_backward_loss() -> None:
    module = SourceModule("sqrt", manual=True)
    cb = fit(module, on_nonfinite="skip")
    first = origins(cb)[0]
    assert (first.step, first.op, first.module) == (BAD_STEP, "SqrtBackward0", "encoder.distance")
    assert module.step_calls == module.steps  # the replay's opt.step() did not run
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_nan_born_in_training_step_loss_is_named() -> None:
    cb = fit(SourceModule("log", loss_log=True), on_nonfinite="skip")
    first = origins(cb)[0]
    assert first.op == "LogBackward0"
    assert first.module is None
    assert "in training_step" in first.message and "in module training_step" not in first.message


# https://github.com/bigscience-workshop/metadata/pull/193 (an Inf multiplied into the loss)
def test_explicit_inf_operand_in_the_loss_is_named_as_a_forward_birth() -> None:
    cb = fit(SourceModule("log", loss_inf=True), on_nonfinite="skip")
    first = origins(cb)[0]
    assert (first.step, first.op, first.data["phase"]) == (BAD_STEP, "MulBackward0", "forward")
    assert first.data["explicit_operand"] is True
    assert "float('inf')" in first.message and "the forward pass was finite" not in first.message


def test_anomaly_mode_only_in_window_and_off_after_fit() -> None:
    module = SourceModule("log", steps=8)
    fit(module, on_nonfinite="skip", escalate_steps=3)
    assert module.anomaly_seen == [False, False, False, True, True, True, False, False]
    assert not torch.is_anomaly_enabled()


def test_anomaly_off_after_fit_ending_inside_window() -> None:
    module = SourceModule("log", steps=4)
    fit(module, on_nonfinite="skip", escalate_steps=5)
    assert module.anomaly_seen[-1] is True
    assert not torch.is_anomaly_enabled()


def test_raise_names_op_and_module() -> None:
    from gradwatch import GradWatchError

    with pytest.raises(GradWatchError) as info:
        fit(SourceModule("pow"), on_nonfinite="raise")
    assert "PowBackward0" in str(info.value) and "encoder.power" in str(info.value)
    assert not torch.is_anomaly_enabled()


def test_incident_report_written(tmp_path: Any) -> None:
    fit(SourceModule("exp"), on_nonfinite="skip", log_dir=str(tmp_path), save_batch=True)
    base = tmp_path / "incidents" / f"step_{BAD_STEP}"
    record = json.loads(base.with_suffix(".json").read_text())
    origin = next(f for f in record["findings"] if f["kind"] == "nan_origin")
    assert (origin["op"], origin["module"]) == ("ExpBackward0", "encoder.gate")
    blob = torch.load(base.with_suffix(".pt"))
    assert blob["batch_idx"] == BAD_STEP and torch.equal(blob["batch"], batch(BAD_STEP, "exp"))


def test_backward_only_nan_in_one_micro_batch_under_accumulation_is_localized() -> None:
    module = SourceModule("sqrt", steps=8)  # batch BAD_STEP is the third micro-batch of the first step
    cb = GradWatchCallback(console=False, on_nonfinite="skip")
    tiny_trainer(ns, [cb], max_steps=2, accumulate_grad_batches=4).fit(module)
    assert [(f.step, f.op, f.module) for f in origins(cb)] == [(0, "SqrtBackward0", "encoder.distance")]
    assert module.log_calls == 8  # replaying the step's earlier micro-batches logged nothing


def test_under_accumulation_only_the_micro_batch_with_a_nonfinite_loss_is_replayed() -> None:
    module = SourceModule("log", steps=8)  # log(0) in batch BAD_STEP, the third micro-batch: a NaN loss
    cb = GradWatchCallback(console=False, on_nonfinite="skip")
    tiny_trainer(ns, [cb], max_steps=2, accumulate_grad_batches=4).fit(module)
    assert [(f.step, f.op, f.module) for f in origins(cb)] == [(0, "LogBackward0", "encoder.logscale")]
    assert module.training_step_calls == 8 + 1  # training_step ran once more, on that batch alone


@pytest.mark.parametrize("closure", [True, False])
def test_manual_optimization_with_a_closure_gets_the_nan_origin(closure: bool) -> None:
    # The documented manual-optimization closure pattern: opt.step(closure=closure), manual_backward inside.
    ns = lightning_namespace("lightning.pytorch")

    class Manual(ns.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, b: Any, i: int) -> None:
            opt = self.optimizers()

            def step_closure() -> torch.Tensor:
                x, y = b
                out = self.net(x)
                if i == 3:
                    out = torch.log(out - out.detach() - 1)  # log(-1): NaN
                loss = nn.functional.mse_loss(out, y)
                opt.zero_grad()
                self.manual_backward(loss)
                return loss

            if closure:
                opt.step(closure=step_closure)
            else:
                step_closure()
                opt.step()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    from helpers import tiny_data

    cb = GradWatchCallback(console=False)
    model = Manual()
    tiny_trainer(ns, [cb], max_steps=6).fit(model, tiny_data())
    origin = [(f.step, f.op) for f in cb.findings if f.kind == "nan_origin"]
    assert origin == [(3, "LogBackward0")], [(f.kind, f.step) for f in cb.findings]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_explicit_inf_that_a_later_op_turns_into_nan_is_named_at_its_own_line() -> None:
    # `out * float("inf")` (a sentinel, not a mask) makes Inf; binary_cross_entropy_with_logits makes it NaN.
    ns = lightning_namespace("lightning.pytorch")

    class Sentinel(ns.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            x, y = b
            out = self.net(x)
            if i == 3:
                out = out * float("inf")
            return nn.functional.binary_cross_entropy_with_logits(out, (y > 0).float())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    from helpers import tiny_data

    cb = GradWatchCallback(console=False)
    tiny_trainer(ns, [cb], max_steps=6).fit(Sentinel(), tiny_data())
    origin = [f for f in cb.findings if f.kind == "nan_origin"]
    assert [(f.step, f.op) for f in origin] == [(3, "MulBackward0")], [(f.kind, f.step, f.op) for f in cb.findings]
    assert origin[0].data["explicit_operand"] is True
    assert 'out * float("inf")' in (origin[0].data.get("code") or "")
