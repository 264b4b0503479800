"""Escalation in the plain loop: the op and module where a NaN/Inf was born, on the step it appears."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import panels
from torch import nn

import gradwatch
from gradwatch.diagnose.capture import MAX_GRADS
from gradwatch.diagnose.escalation import Escalation

BAD_STEP = 2


class Source(nn.Module):
    """A bias-free identity projection followed by one op that goes non-finite on a crafted batch."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(4, 4, bias=False)
        nn.init.eye_(self.proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.kind == "log":
            return torch.log(h)
        if self.kind == "sqrt":
            return torch.sqrt(h.pow(2).sum(-1, keepdim=True))  # a hand-written norm: d sqrt/dx = inf at 0
        if self.kind == "div":
            return h / h.norm(dim=-1, keepdim=True)
        if self.kind == "exp":
            return torch.exp(h)
        if self.kind == "pow":
            return h.pow(1.5)
        raise ValueError(self.kind)


# kind -> (submodule name, expected op, bad batch)
SOURCES: dict[str, tuple[str, str]] = {
    "log": ("logscale", "LogBackward0"),
    "sqrt": ("distance", "SqrtBackward0"),
    "div": ("normalize", "DivBackward0"),
    "exp": ("gate", "ExpBackward0"),
    "pow": ("power", "PowBackward0"),
}


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        name = SOURCES[kind][0]
        self.encoder = nn.Sequential(OrderedDict([(name, Source(kind))]))
        width = 1 if kind == "sqrt" else 4
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def batch(step: int, kind: str, bad_step: int | tuple[int, ...] = BAD_STEP) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.rand(8, 4, generator=g) + 0.5  # healthy: every op above is finite and smooth here
    bad = (bad_step,) if isinstance(bad_step, int) else bad_step
    if step in bad:
        x = x.clone()
        if kind == "exp":
            x[3] = 200.0  # exp(200) overflows float32
        elif kind == "pow":
            x[3] = -1.0  # (-1) ** 1.5 is NaN
        else:
            x[3] = 0.0  # log(0), sqrt'(0), 0 / 0
    return x


def train(
    model: nn.Module,
    kind: str,
    steps: int = 5,
    bad_step: int | tuple[int, ...] = BAD_STEP,
    loss_fn: Any = None,
    anomaly_seen: list[bool] | None = None,
    **config: Any,
) -> gradwatch.Watcher:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config.setdefault("console", False)
    with gradwatch.watch(model, opt, **config) as gw:
        for step in range(steps):
            out = model(batch(step, kind, bad_step))
            if anomaly_seen is not None:
                anomaly_seen.append(torch.is_anomaly_enabled())
            loss = loss_fn(out) if loss_fn is not None else out.pow(2).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw


def origins(gw: gradwatch.Watcher) -> list[gradwatch.Finding]:
    return [f for f in gw.findings if f.kind == "nan_origin"]


# -- the op and module, on the step the NaN first appears ----------------------------------------------
@pytest.mark.parametrize("policy", ["warn", "skip"])
@pytest.mark.parametrize("kind", list(SOURCES))
def test_origin_named_on_first_nonfinite_step(kind: str, policy: str) -> None:
    gw = train(Net(kind), kind, on_nonfinite=policy)
    first = origins(gw)[0]
    name, op = SOURCES[kind]
    assert first.step == BAD_STEP
    assert first.op == op
    assert first.module == f"encoder.{name}"
    assert first.data["source"].startswith(__file__)
    assert first.data["code"] is not None and first.data["code"] in Path(__file__).read_text()


def test_backward_only_nan_is_localized_in_backward_phase() -> None:
    gw = train(Net("sqrt"), "sqrt", on_nonfinite="skip")
    first = origins(gw)[0]
    assert first.data["phase"] == "backward"
    assert first.data["incoming"]["forward_min_abs"] == 0.0  # sqrt evaluated at 0
    assert first.data["outgoing"]["inf"] is True


def test_forward_inf_reports_input_magnitudes_and_first_module() -> None:
    gw = train(Net("exp"), "exp", on_nonfinite="skip")
    first = origins(gw)[0]
    assert first.data["phase"] == "forward"
    assert first.data["incoming"]["max_abs"] >= 199.0
    assert first.data["first_nonfinite_module"] == "encoder.gate"
    assert "clamp" in first.message


def test_skip_run_survives_with_finite_weights() -> None:
    model = Net("div")
    gw = train(model, "div", steps=6, on_nonfinite="skip")
    assert gw.engine.steps_skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_raise_carries_op_and_module_in_error() -> None:
    with pytest.raises(gradwatch.GradWatchError) as info:
        train(Net("sqrt"), "sqrt", on_nonfinite="raise")
    assert "SqrtBackward0" in str(info.value)
    assert "encoder.distance" in str(info.value)
    assert any(f.kind == "nan_origin" and f.op == "SqrtBackward0" for f in info.value.findings)
    assert not torch.is_anomaly_enabled()


def log_of_zero(out: torch.Tensor) -> torch.Tensor:
    return torch.log(out - out.detach()).mean()  # log(0) in the loss, the model itself is finite


def test_nan_born_in_loss_is_attributed_to_loss() -> None:
    gw = train(Net("log"), "log", bad_step=(), loss_fn=log_of_zero, on_nonfinite="skip")
    first = origins(gw)[0]
    assert first.step == 0
    assert first.data["phase"] == "loss"
    assert "loss computation" in first.message


def test_nan_born_in_loss_code_recurring_in_window_is_named_with_its_line() -> None:
    gw = train(Net("log"), "log", steps=2, bad_step=(), loss_fn=log_of_zero, on_nonfinite="skip")
    second = origins(gw)[1]
    assert (second.step, second.op, second.module) == (1, "LogBackward0", None)
    assert (second.data["phase"], second.data["replayed"]) == ("loss", False)
    assert (
        second.data["code"]
        == "return torch.log(out - out.detach()).mean()  # log(0) in the loss, the model itself is finite"
    )
    assert second.data["incoming"]["forward_min_abs"] == 0.0  # log evaluated at 0
    assert "Born in the loss computation of step 1, outside the model" in second.message


def test_first_loss_step_lists_the_loss_ops_that_can_turn_nonfinite() -> None:
    gw = train(Net("log"), "log", steps=1, bad_step=(), loss_fn=log_of_zero, on_nonfinite="skip")
    first = origins(gw)[0]
    assert (first.step, first.op, first.data["phase"]) == (0, None, "loss")
    assert first.data["loss_ops"] == ["LogBackward0"]
    assert "the loss runs LogBackward0:" in first.message


def test_loss_ops_leave_out_integer_powers() -> None:
    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return (out * float("inf")).pow(2).mean()  # Inf from a constant; x ** 2 cannot make one

    gw = train(Net("log"), "log", steps=1, bad_step=(), loss_fn=loss_fn, on_nonfinite="skip")
    assert origins(gw)[0].data["loss_ops"] == []


def test_nan_target_is_not_blamed_on_a_loss_op() -> None:
    target = torch.full((8, 1), float("nan"))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).mean()  # the NaN comes with the target: no op made it

    gw = train(Net("log"), "log", steps=2, bad_step=(), loss_fn=loss_fn, on_nonfinite="skip")
    assert [(f.step, f.op, f.data["phase"]) for f in origins(gw)] == [(0, None, "loss"), (1, None, "loss")]


# -- the layer table and the data ----------------------------------------------------------------------
def test_per_layer_table_lists_norm_nan_and_inf_counts() -> None:
    gw = train(Net("sqrt"), "sqrt", on_nonfinite="skip")
    rows = {r["layer"]: r for r in origins(gw)[0].data["table"]}
    assert set(rows) == {"encoder.distance.proj", "head"}
    assert rows["encoder.distance.proj"]["nan"] + rows["encoder.distance.proj"]["inf"] > 0
    assert rows["head"]["nan"] == rows["head"]["inf"] == 0 and rows["head"]["grad_norm"] >= 0


def test_nonfinite_batch_reported_as_input_not_model() -> None:
    model = Net("log")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        x = batch(0, "log")
        x[1, 2] = float("nan")
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    mine = [f for f in gw.findings if f.kind in ("nonfinite_input", "nan_origin")]
    assert [f.kind for f in mine] == ["nonfinite_input"]
    assert mine[0].data["inputs"] == [{"input": "args[0]", "nan": 1, "inf": 0}]


# -- escalation window and anomaly mode ------------------------------------------------------------
def test_anomaly_mode_on_only_during_window() -> None:
    seen: list[bool] = []
    gw = train(Net("log"), "log", steps=8, on_nonfinite="skip", escalate_steps=3, anomaly_seen=seen)
    assert seen == [False, False, False, True, True, True, False, False]
    assert not torch.is_anomaly_enabled()
    assert gw.engine.escalated is False


def test_user_anomaly_setting_is_restored_after_window() -> None:
    seen: list[bool] = []
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        train(Net("log"), "log", steps=7, on_nonfinite="skip", escalate_steps=2, anomaly_seen=seen)
        assert torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled()
    assert seen == [True] * 7
    assert not torch.is_anomaly_enabled()


def test_anomaly_off_after_run_closed_inside_window() -> None:
    seen: list[bool] = []
    train(Net("log"), "log", steps=4, on_nonfinite="skip", escalate_steps=5, anomaly_seen=seen)
    assert seen[-1] is True  # the run ended inside the window
    assert not torch.is_anomaly_enabled()


def test_recurrence_in_window_is_localized_from_the_live_step() -> None:
    gw = train(Net("sqrt"), "sqrt", steps=5, bad_step=(2, 3), on_nonfinite="skip")
    by_step = {f.step: f for f in origins(gw)}
    assert by_step[2].data["replayed"] is True
    assert by_step[3].data["replayed"] is False
    assert (by_step[3].op, by_step[3].module) == ("SqrtBackward0", "encoder.distance")
    assert by_step[3].data["forward_traceback"] and "torch.sqrt" in by_step[3].data["forward_traceback"]


def test_no_module_hooks_outside_window() -> None:
    model = Net("log")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counts = []
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip", escalate_steps=2):
        for step in range(6):
            loss = model(batch(step, "log")).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            counts.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()))
    healthy = counts[0]
    window = healthy + 2 * len(list(model.modules())) + 1  # localizer enter/exit per module + window end
    assert counts == [healthy, healthy, window, window, healthy, healthy]
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0


def test_escalate_false_no_replay_no_anomaly() -> None:
    seen: list[bool] = []
    gw = train(Net("log"), "log", steps=5, on_nonfinite="skip", escalate=False, anomaly_seen=seen)
    assert [f.kind for f in gw.findings] == ["nonfinite_loss", "nonfinite_grad"]
    assert seen == [False] * 5
    assert gw.engine.extension(Escalation).localizations == []


# -- the replay leaves no trace --------------------------------------------------------------------
class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.3)
        self.encoder = nn.Sequential(OrderedDict([("distance", Source("sqrt"))]))
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.drop(self.bn(x)) * 0 + x))


def _run_until_bad(watch: bool) -> dict[str, Any]:
    model = NormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(123)
    gw = gradwatch.watch(model, opt, console=False, on_nonfinite="warn") if watch else None
    state: dict[str, Any] = {}
    try:
        for step in range(BAD_STEP + 1):
            loss = model(batch(step, "sqrt")).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if step == BAD_STEP:
                state["grads_before"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            if watch or step < BAD_STEP:
                opt.step()
        state["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
        state["rng"] = torch.get_rng_state()
        state["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        state["findings"] = list(gw.findings) if gw is not None else []
    finally:
        if gw is not None:
            gw.close()
    return state


def test_replay_leaves_buffers_rng_and_grads_untouched() -> None:
    plain = _run_until_bad(watch=False)
    watched = _run_until_bad(watch=True)
    assert any(f.kind == "nan_origin" and f.data["replayed"] for f in watched["findings"])
    for name, b in plain["buffers"].items():
        assert torch.equal(watched["buffers"][name], b), name
    assert torch.equal(watched["rng"], plain["rng"])
    for name, g in plain["grads_before"].items():
        torch.testing.assert_close(watched["grads"][name], g, rtol=0, atol=0, equal_nan=True)


# -- incident reports ------------------------------------------------------------------------------
def test_incident_files_written_and_readable(tmp_path: Any) -> None:
    gw = train(Net("div"), "div", on_nonfinite="skip", log_dir=str(tmp_path), save_batch=True)
    base = tmp_path / "incidents" / f"step_{BAD_STEP}"
    record = json.loads((base.with_suffix(".json")).read_text())
    kinds = [f["kind"] for f in record["findings"]]
    assert "nan_origin" in kinds and "nonfinite_grad" in kinds
    origin = next(f for f in record["findings"] if f["kind"] == "nan_origin")
    assert (origin["op"], origin["module"]) == ("DivBackward0", "encoder.normalize")
    assert record["layers"][0]["layer"] == "encoder.normalize.proj"
    text = (base.with_suffix(".md")).read_text()
    assert "DivBackward0" in text and "encoder.normalize" in text
    blob = torch.load(base.with_suffix(".pt"))
    assert torch.equal(blob["args"][0], batch(BAD_STEP, "div"))
    assert origins(gw)[0].data["report"] == os.fspath(base.with_suffix(".md"))


def test_incident_report_orders_findings_as_the_console_does(tmp_path: Any, text_console: Any) -> None:
    train(Net("div"), "div", on_nonfinite="skip", log_dir=str(tmp_path), console=text_console)
    text = (tmp_path / "incidents" / f"step_{BAD_STEP}.md").read_text()
    in_report = [line.split("]", 1)[0].lstrip("# [") for line in text.splitlines() if line.startswith("## [")]
    panel = text_console.file.getvalue().split(f"at step {BAD_STEP}", 1)[1]
    also = [line.split("- ", 1)[1].split(":", 1)[0] for line in panel.splitlines() if "│ - " in line]
    assert in_report[0] == "nan_origin"
    assert in_report == ["nan_origin", *also]


def test_no_batch_file_without_save_batch(tmp_path: Any) -> None:
    train(Net("div"), "div", on_nonfinite="skip", log_dir=str(tmp_path))
    files = sorted(os.listdir(tmp_path / "incidents"))
    assert files == [f"step_{BAD_STEP}.json", f"step_{BAD_STEP}.md"]


def test_origin_panel_in_console(text_console: Any) -> None:
    train(Net("pow"), "pow", on_nonfinite="skip", console=text_console)
    out = text_console.file.getvalue()
    # One panel for the incident, led by where the NaN was born; the consequences follow by their first line.
    assert (["nan_origin", "nonfinite_loss", "nonfinite_grad"], 2) in panels(out)
    assert out.count("╭─ gradwatch") == 1 and "Also at step 2:" in out
    assert out.index("PowBackward0") < out.index("- nonfinite_grad: ")
    assert "Born in the forward pass of step 2: op PowBackward0 (Tensor.pow) in module encoder.power" in out
    assert "return h.pow(1.5)" in out
    assert "values from -1 to" in out  # the negative base


# -- loop shapes -------------------------------------------------------------------------------------
def test_bad_micro_batch_found_under_gradient_accumulation() -> None:
    model = Net("sqrt")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for step in range(3):
            opt.zero_grad()
            for micro in range(4):
                x = batch(step * 10 + micro, "sqrt", bad_step=(10,))  # first micro-batch of step 1
                (model(x).pow(2).mean() / 4).backward()
            opt.step()
    assert [(f.step, f.op, f.module) for f in origins(gw)] == [(1, "SqrtBackward0", "encoder.distance")]


def accumulate(
    model: nn.Module, kind: str, bad_micro: int, micro: int = 8, loss_fn: Any = None, **config: Any
) -> tuple[gradwatch.Watcher, list[list[bool]]]:
    """Two steps of ``micro`` micro-batches; micro-batch ``bad_micro`` of step 1 is the bad one.

    Also returns, per step, which micro-batches' output gradients were still alive at ``opt.step()``.
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    alive: list[list[bool]] = []
    config.setdefault("console", False)
    with gradwatch.watch(model, opt, on_nonfinite="skip", **config) as gw:
        for step in range(2):
            opt.zero_grad()
            refs: list[Any] = []
            for m in range(micro):
                bad_input = 100 + bad_micro if loss_fn is None else ()  # a bad loss: the model stays finite
                out = model(batch(step * 100 + m, kind, bad_step=bad_input))
                out.register_hook(lambda g, refs=refs: refs.append(weakref.ref(g)))
                bad = step == 1 and m == bad_micro
                loss = loss_fn(out) if loss_fn is not None and bad else out.pow(2).mean()
                (loss / micro).backward()
            alive.append([r() is not None for r in refs])
            opt.step()
    return gw, alive


def test_backward_only_nan_in_an_early_micro_batch_of_a_long_accumulation_is_localized() -> None:
    gw, _alive = accumulate(Net("sqrt"), "sqrt", bad_micro=0)
    assert [(f.step, f.op, f.module) for f in origins(gw)] == [(1, "SqrtBackward0", "encoder.distance")]


def test_loss_nan_in_an_early_micro_batch_of_a_long_accumulation_is_attributed_to_the_loss() -> None:
    gw, _alive = accumulate(Net("log"), "log", bad_micro=1, loss_fn=log_of_zero)  # no observe_loss()
    assert [(f.step, f.data["phase"]) for f in origins(gw)] == [(1, "loss")]


def test_long_accumulation_holds_only_the_last_output_gradients() -> None:
    _gw, alive = accumulate(Net("sqrt"), "sqrt", bad_micro=0)
    assert alive[0] == [False] * (8 - MAX_GRADS) + [True] * MAX_GRADS


def test_saved_batch_of_a_long_accumulation_is_the_micro_batch_that_went_nonfinite(tmp_path: Any) -> None:
    accumulate(Net("exp"), "exp", bad_micro=2, log_dir=str(tmp_path), save_batch=True)
    blob = torch.load(tmp_path / "incidents" / "step_1.pt")
    assert torch.equal(blob["args"][0], batch(102, "exp", bad_step=102))
    assert len(blob["calls"]) == 8


def test_two_optimizers_one_origin_finding_per_step() -> None:
    model = Net("div")
    opt_a = torch.optim.SGD(model.encoder.parameters(), lr=0.01)
    opt_b = torch.optim.Adam(model.head.parameters(), lr=0.01)
    with gradwatch.watch(model, [opt_a, opt_b], console=False, on_nonfinite="skip") as gw:
        for step in range(4):
            loss = model(batch(step, "div")).pow(2).mean()
            opt_a.zero_grad()
            opt_b.zero_grad()
            loss.backward()
            opt_a.step()
            opt_b.step()
    assert [(f.step, f.op) for f in origins(gw)] == [(BAD_STEP, "DivBackward0")]


def test_poisoned_weights_after_warn_update_reported_once() -> None:
    gw = train(Net("log"), "log", steps=6, on_nonfinite="warn")
    later = [f for f in origins(gw) if f.step > BAD_STEP]
    assert [(f.step, f.data["phase"]) for f in later] == [(BAD_STEP + 1, "weights")]
    assert "encoder.logscale.proj.weight" in later[0].params


def test_nan_batch_through_batchnorm_is_blamed_on_the_input() -> None:
    model = NormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for step in range(3):
            x = batch(step, "sqrt", bad_step=())
            if step == 1:
                x[0, 0] = float("nan")  # also poisons the BatchNorm running statistics in this forward
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    mine = [(f.kind, f.step) for f in gw.findings if f.kind in ("nonfinite_input", "nan_origin")]
    assert mine[0] == ("nonfinite_input", 1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(4, 1, batch_first=True)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x, key_padding_mask=pad)
        return self.head(out)


def test_fully_masked_attention_row_names_the_softmax_inside_attention() -> None:
    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        for step in range(3):
            x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(step))
            pad = torch.zeros(2, 5, dtype=torch.bool)
            pad[1, :] = step == 1  # sequence 1 is all padding at step 1
            loss = model(x, pad).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    first = origins(gw)[0]
    assert (first.step, first.module) == (1, "attn")
    assert first.op == "SoftmaxBackward0"
    assert "aten._softmax" in first.data["forward_op"]


def test_a_watched_step_keeps_no_output_or_loss_alive_after_it():
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refs = []
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(5):
            out = model(torch.randn(16, 4))
            loss = out.pow(2).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            refs += [weakref.ref(out), weakref.ref(loss)]
            del out, loss
        gc.collect()
        # the output's gradient hook and the kept loss must not form a cycle through the autograd graph
        assert [r() is None for r in refs] == [True] * len(refs)


class RunningScale(nn.Module):
    """Divides by a running estimate of the input scale, kept in a buffer (like a fake-quant observer)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.mul_(0.9).add_(0.1 * x.abs().mean())
        return x / self.scale


class ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = RunningScale()
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.enc(self.norm(x))))


# A NaN batch poisons a running statistic kept in a buffer for good (fake-quant observers in QAT do this).
def test_buffer_poisoned_by_a_nan_batch_is_named_on_the_steps_after() -> None:
    model = ScaledNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, max_skips=None) as gw:
        for step in range(7):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
            if step == 3:
                x[0, 0] = float("nan")  # its forward writes NaN into norm.scale
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    (first,) = [f for f in gw.findings if f.kind == "nonfinite_input"]
    assert first.step == 3 and first.data["poisoned_buffers"] == ["norm.scale"]  # said at the NaN step
    later = [f for f in gw.findings if f.kind == "nan_origin" and f.step > 3]
    assert later and all("norm.scale" in f.message for f in later), [(f.kind, f.step) for f in gw.findings]
    assert not any("could not reproduce" in f.message or "Born in" in f.message for f in later)


class FlakyGrad(torch.autograd.Function):
    """Identity forward; a backward with a bug on some inputs (here: a flag) that returns NaN."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, broken: bool) -> torch.Tensor:
        ctx.broken = broken
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        if ctx.broken:
            g = g.clone()
            g[0, 0] = float("nan")
        return g, None


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.broken = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return FlakyGrad.apply(h, self.broken)


class WithCustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(4, 8)
        self.mid = Middle()
        self.proj = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.mid(self.enc(x))))


# A custom autograd.Function whose backward has a bug on some inputs: its apply() is invisible to op tracing.
def test_nan_returned_by_a_custom_function_backward_names_the_function_and_its_module() -> None:
    model = WithCustomFunction()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(4):
            model.mid.broken = step == 2
            opt.zero_grad()
            model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert (origin.step, origin.op, origin.module) == (2, "FlakyGradBackward", "mid")
    assert "custom autograd.Function FlakyGrad" in origin.message and "FlakyGrad.apply" in origin.message


class SentinelWriter(nn.Module):
    """Writes a NaN sentinel into an activation in place (``h[i] = float("nan")``) on chosen steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        if self.poison:
            h[0, 0] = float("nan")
        return self.head(torch.tanh(h))


def test_nan_written_in_place_into_an_activation_names_the_write() -> None:
    model = SentinelWriter()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(4):
            model.poison = step == 2
            opt.zero_grad()
            model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert (origin.step, origin.op, origin.data["phase"]) == (2, "Tensor.__setitem__", "forward")
    assert 'h[0, 0] = float("nan")' in origin.message and origin.data["explicit_operand"] is True


class LegacyWeightNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated, still widely used
            self.enc = torch.nn.utils.weight_norm(nn.Linear(4, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.enc(x)))


def test_nan_born_in_a_modules_own_pre_hook_is_named_in_that_module() -> None:
    model = LegacyWeightNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, max_skips=None) as gw:
        for step in range(4):
            if step == 2:
                with torch.no_grad():
                    model.enc.weight_v[0].zero_()  # a zero direction row: 0/0 in the pre-hook's weight
            opt.zero_grad()
            model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            opt.step()
    origin = [f for f in gw.findings if f.kind == "nan_origin"]
    assert origin and (origin[0].step, origin[0].module) == (2, "enc"), [(f.step, f.module) for f in origin]


def test_an_op_in_the_root_models_own_forward_is_named_alike_on_replayed_and_escalated_steps() -> None:
    # A CLIP-style temperature driven to 0: the division sits in the root module's own forward.
    class Clip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(8, 8)
            self.logit_scale = nn.Parameter(torch.tensor(1.0))

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            za = nn.functional.normalize(self.enc(a), dim=-1)
            zb = nn.functional.normalize(self.enc(b), dim=-1)
            return za @ zb.t() / self.logit_scale

    torch.manual_seed(0)
    model = Clip()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False, max_skips=None) as gw:
        for step in range(4):
            if step == 1:
                with torch.no_grad():
                    model.logit_scale.zero_()
            a = torch.randn(8, 8)
            loss = nn.functional.cross_entropy(model(a, a + 0.1 * torch.randn(8, 8)), torch.arange(8))
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [(f.step, f.op, f.module, f.data["replayed"]) for f in gw.findings if f.kind == "nan_origin"]
    assert found == [(1, "DivBackward0", "<root>", True), (2, "DivBackward0", "<root>", False),
                     (3, "DivBackward0", "<root>", False)]


def test_a_replayed_op_of_a_built_in_module_is_not_placed_at_the_optimizer_step_line() -> None:
    # nn.Sequential of torch layers: no user line runs the op; the replay (inside opt.step()) must not
    # name the training loop's opt.step() line as its source.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(3):
            x = torch.full((8, 4), 3e38) if step >= 1 else torch.randn(8, 4)  # the first Linear overflows
            loss = nn.functional.mse_loss(model(x), torch.zeros(8, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [f for f in gw.findings if f.kind == "nan_origin"]
    assert found and found[0].data["replayed"] is True
    assert "opt.step()" not in (found[0].data.get("code") or "")
    assert found[0].module is not None


# https://github.com/pytorch/pytorch/issues/4320 (std of one element is NaN: advantage normalization)
@pytest.mark.filterwarnings("ignore:std\\(\\)")
def test_loss_code_std_of_one_element_is_named_with_its_line_when_it_happens_again() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with gradwatch.watch(model, opt, console=False, max_skips=None) as gw:
        for step in range(4):
            v = model(torch.randn(8 if step == 0 else 1, 8))[:, 0]  # from step 1 on: batches of one
            adv = (v - v.mean()) / (v.std() + 1e-8)  # normalized advantages
            loss = (adv**2).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [f for f in gw.findings if f.kind == "nan_origin"]
    assert [(f.step, f.data["phase"]) for f in found] == [(1, "loss"), (2, "loss"), (3, "loss")]
    assert found[0].data["loss_ops"] == ["DivBackward0", "StdBackward0"]  # replayed: the suspects
    assert [f.op for f in found[1:]] == ["StdBackward0", "StdBackward0"]  # escalated: the op and its line
    assert "adv = (v - v.mean())" in (found[1].data.get("code") or "")
    assert "Its forward result holds NaN although its inputs were finite" in found[1].message


# https://github.com/pytorch/pytorch/issues/68425 (torch.where: NaN gradient through the masked branch)
def test_the_where_nan_trap_is_explained_with_the_safe_input_fix() -> None:
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return self.head(torch.where(h > 0, h.sqrt(), torch.zeros_like(h)))  # finite forward

    torch.manual_seed(0)
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        out = model(torch.randn(8, 4))
        assert torch.isfinite(out).all()
        opt.zero_grad()
        out.pow(2).mean().backward()
        opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert (origin.step, origin.op) == (0, "SqrtBackward0")
    assert "never reached the model's output" in origin.message and "x_safe = torch.where" in origin.message


def test_weights_poisoned_on_an_unchecked_step_say_so_and_suggest_checking_every_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, every=5, max_skips=None) as gw:
        for step in range(6):
            x = torch.randn(8, 4)
            if step == 2:  # not a checked step: applied
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert (origin.step, origin.data["phase"]) == (5, "weights")
    assert "every=5" in origin.message and "every=1" in origin.message
    assert "see the first nan_origin" not in origin.message  # there is none before it


# HF transformers resize_token_embeddings reports: new vocabulary rows left uninitialized (NaN) in the table
def test_embedding_table_with_a_nan_row_names_the_row_and_does_not_say_every_step_is_non_finite() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(32, 1))
    with torch.no_grad():
        model[0].weight[7] = float("nan")  # one row of the table, e.g. torch.empty after a resize
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(5):
            ids = torch.randint(8, 20, (6, 4))
            if step == 3:
                ids[2, 1] = 7  # the only batch that looks the bad row up
            opt.zero_grad()
            model(ids).pow(2).mean().backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert (origin.step, origin.data["phase"], origin.params) == (3, "weights", ("0.weight",))
    assert "row 7 (1 of 20)" in origin.message and "re-initialize those rows" in origin.message, origin.message
    assert "every step is non-finite" not in origin.message  # steps 0-2 were finite
    assert gw.engine.steps_skipped == 1


@dataclasses.dataclass
class _Output:
    pred: torch.Tensor
    aux: torch.Tensor


class _DataclassNet(nn.Module):
    """Returns a dataclass (as many model libraries do); sqrt at exactly 0 on an armed step: a NaN born in
    the backward pass only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        self.armed = False

    def forward(self, x: torch.Tensor) -> _Output:
        h = self.fc1(x)
        if self.armed:
            h = torch.cat([h[:, :1] * 0.0, h[:, 1:]], 1)
        h = torch.sqrt(h.pow(2))
        return _Output(self.fc2(h), h.mean())


def test_a_model_returning_a_dataclass_gets_its_backward_nan_origin() -> None:
    torch.manual_seed(0)
    model = _DataclassNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(6):
            model.armed = step == 3
            out = model(torch.randn(16, 8))
            loss = nn.functional.mse_loss(out.pred, torch.randn(16, 1)) + out.aux
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [(f.step, f.op, f.data["phase"]) for f in gw.findings if f.kind == "nan_origin"]
    assert found == [(3, "SqrtBackward0", "backward")]


class _WordDropoutBag(nn.Module):
    """Word dropout inside the model, averaged over the kept tokens: 0/0 when every token is dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(tok.shape) > 0.5).float().unsqueeze(-1)
        return self.head((self.emb(tok) * keep).sum(1) / keep.sum(1))


def _word_dropout_run(watch: bool) -> tuple[list[Any], list[bool], torch.Tensor, torch.Tensor]:
    torch.manual_seed(4)  # step 0 drops every token of a sample; a fresh mask would not (the replay said "loss")
    model = _WordDropoutBag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(0)
    nan_outputs = []
    gw = gradwatch.watch(model, opt, console=False, max_skips=None) if watch else None
    for _ in range(4):
        out = model(torch.randint(0, 20, (2, 3), generator=data))
        nan_outputs.append(not bool(torch.isfinite(out).all()))
        loss = nn.functional.cross_entropy(out, torch.randint(0, 2, (2,), generator=data))
        if gw is not None:
            gw.observe_loss(loss)
        opt.zero_grad()
        loss.backward()
        if gw is not None or not nan_outputs[-1]:
            opt.step()  # unwatched: the same skip by hand, to compare the runs
    if gw is not None:
        gw.close()
    return (gw.findings if gw else []), nan_outputs, torch.rand(3), model.head.weight.detach().clone()


# The mask-count NaN of https://github.com/allenai/OLMo-core/pull/452: a random mask that drops everything.
def test_a_nan_from_a_random_mask_in_the_forward_is_replayed_with_the_same_mask() -> None:
    findings, nan_outputs, after_rng, weight = _word_dropout_run(watch=True)
    assert nan_outputs[0]  # the model's own output went NaN at step 0 (all tokens of a sample dropped)
    origin = [f for f in findings if f.kind == "nan_origin" and f.step == 0]
    assert len(origin) == 1, [(f.kind, f.step, f.message[:200]) for f in findings]
    assert origin[0].data["phase"] == "forward" and origin[0].op == "DivBackward0", origin[0].message
    assert "born in the loss" not in origin[0].message
    # The replay drew its random numbers from a saved state: the run's own random stream is untouched.
    _, bare_nan, bare_rng, bare_weight = _word_dropout_run(watch=False)
    assert nan_outputs == bare_nan
    assert torch.equal(after_rng, bare_rng) and torch.equal(weight, bare_weight)


def test_a_loss_that_overflows_from_a_huge_but_finite_output_says_the_loss_went_first() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i in range(5):
            x = torch.randn(8, 4)
            if i == 3:
                x = x.abs() * 1e21  # an unscaled feature batch: the output is huge but finite
            loss = ((model(x) - 1.0) ** 2).mean()  # inf in the forward: the square overflows
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = [f for f in gw.findings if f.kind == "nan_origin"]
    assert [f.step for f in origin] == [3]
    assert origin[0].data["loss_nonfinite_first"] is True
    assert "already non-finite in the forward pass" in origin[0].message
    assert "unscaled features" in origin[0].message and "(the forward pass was finite)" not in origin[0].message


def test_an_infinite_ctc_loss_gets_the_ctc_fix() -> None:
    # https://github.com/meijieru/crnn.pytorch/issues/235: CTC loss inf, input shorter than the target needs.
    torch.manual_seed(0)
    model = nn.Linear(8, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctc = nn.CTCLoss()
    with gradwatch.watch(model, opt, console=False) as gw:
        for i in range(3):
            logp = model(torch.randn(12, 2, 8)).log_softmax(-1)  # (T=12, N=2, C=5)
            target_len = 13 if i == 1 else 4  # 13 labels cannot fit in 12 frames: inf
            targets = torch.randint(1, 5, (2, target_len))
            loss = ctc(logp, targets, torch.full((2,), 12), torch.full((2,), target_len))
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = [f for f in gw.findings if f.kind == "nan_origin"]
    assert [f.step for f in origin] == [1]
    assert "zero_infinity=True" in origin[0].message, origin[0].message


def test_a_nan_when_the_loop_calls_submodules_directly_says_why_it_was_not_localized() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"features": nn.Sequential(nn.Linear(4, 8), nn.ReLU()), "head": nn.Linear(8, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for i in range(4):
            x = torch.randn(8, 4)
            if i == 2:
                x[0, 0] = float("nan")
            loss = model["head"](model["features"](x)).pow(2).mean()  # the root's forward never runs
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = [f for f in gw.findings if f.kind == "nan_origin"]
    assert [(f.step, f.severity) for f in origin] == [(2, "warning")]
    assert "did not run this step" in origin[0].message and "model(x)" in origin[0].message


def test_incident_on_a_deep_model_fits_one_screen(text_console: Any) -> None:
    # A 24-layer MLP whose loss takes log(softmax) (inf at an underflowed probability): one step's three
    # findings printed as three panels of 68 lines, the op that caused it in the middle of the third.
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=text_console) as gw:
        for step in range(4):
            x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
            logits = model(x) * (1e4 if step == 2 else 1.0)  # saturated logits (a temperature bug)
            loss = -torch.log(torch.softmax(logits, dim=1)).gather(1, y[:, None]).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert {f.kind for f in gw.findings if f.step == 2} >= {"nan_origin", "nonfinite_grad"}
    out = text_console.file.getvalue()
    incident = out[: out.index("gradwatch summary")]
    assert incident.count("╭─ gradwatch") == 1
    assert len(incident.splitlines()) <= 36, incident
    assert incident.index("LogBackward0") < incident.index("- nonfinite_grad: ")
    assert "... 3 more" in incident  # 13 layer rows, 10 shown


class _SpectralNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.enc(x)
        affinity = torch.exp(-((z[:, None] - z[None]) ** 2).sum(-1))
        laplacian = torch.diag(affinity.sum(1)) - affinity
        return torch.linalg.eigh(laplacian)[1][:, 1:3]  # a spectral embedding


def test_eigh_with_repeated_eigenvalues_gets_the_eigengap_fix() -> None:
    # A batch of duplicate samples gives a Laplacian with repeated eigenvalues: eigh's backward divides by
    # their gaps (pytorch/pytorch#47599). The fix said "lower the learning rate, clip gradients".
    torch.manual_seed(0)
    model = _SpectralNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(5):
            x = torch.randn(1, 6).expand(10, 6).clone() if step == 3 else torch.randn(10, 6)
            loss = (model(x).abs().sum(1) - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert (origin.step, origin.op) == (3, "LinalgEighBackward0")
    assert "eigvalsh" in origin.message and "jitter" in origin.message


def test_half_precision_overflow_says_so_in_its_fix() -> None:
    # An unnormalized batch under float16 autocast overflows a Linear (65504 is float16's largest value);
    # the fix suggested clipping gradients, which cannot help with an Inf.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(4):
            x = torch.rand(8, 64) * (255 * 40 if step == 2 else 1)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = (out.float() - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert origin.step == 2 and "float16, whose largest finite value is 65504" in origin.message


class _HalfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.qk, self.out = nn.Linear(8, 16), nn.Linear(16, 32), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        q, k = self.qk(h).chunk(2, -1)
        return self.out((q @ k.transpose(-2, -1)).softmax(-1) @ h).mean(1)


# HF transformers #10956-style (T5 / LLaMA fine-tuned with model.half()): attention scores pass 65504 -> Inf
def test_a_model_half_overflow_names_float16_in_its_fix_not_only_values_out_of_range() -> None:
    torch.manual_seed(0)
    model = _HalfAttention().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(4):
            x = torch.randn(4, 6, 8) * (3000.0 if step == 2 else 1.0)  # outlier activations at step 2
            loss = nn.functional.cross_entropy(model(x.half()).float(), torch.zeros(4, dtype=torch.long))
            opt.zero_grad()
            loss.backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert (origin.step, origin.data["phase"]) == (2, "forward"), origin.message
    assert "model.half()" in origin.message and "65504" in origin.message, origin.message


# HF accelerate / transformers "loss nan with gradient accumulation" reports: one corrupt sample in one micro-batch
@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "fp16-grad-scaler"])
def test_a_bad_micro_batch_under_accumulation_is_named_by_its_forward_call(scaler: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=scaler)
    with gradwatch.watch(model, opt, console=False, scaler=amp if scaler else None) as gw:
        for update in range(5):
            for k in range(4):
                x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
                if update == 3 and k == 2:
                    x[1, 4] = float("inf")  # the third micro-batch of update 3
                with torch.autocast("cpu", dtype=torch.float16, enabled=scaler):
                    loss = nn.functional.cross_entropy(model(x), y) / 4
                gw.observe_loss(loss)
                amp.scale(loss).backward()
            amp.step(opt)
            amp.update()
            opt.zero_grad()
    (found,) = [f for f in gw.findings if f.kind == "nonfinite_input"]
    assert found.step == 3 and found.data["inputs"] == [
        {"input": "args[0] of the step's forward call 3", "nan": 0, "inf": 1}
    ], found.message


class _SafeLog(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.log(x.clamp_min(1e-12))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g / x  # not clamped like the forward: Inf at 0


def test_a_custom_function_in_the_loss_code_is_a_suspect_at_the_first_incident() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(5):
            x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
            probs = torch.relu(torch.tanh(model(x))) * (0.0 if step == 3 else 1.0)
            loss = -_SafeLog.apply(probs.gather(1, y[:, None]).squeeze(1) + 0.0).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert origin.step == 3 and "_SafeLogBackward" in origin.message and "gradcheck" in origin.message


class _Angle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos = torch.tanh(self.proj(x)) * 1.0000002  # a cosine a rounding error pushed past 1
        return torch.acos(cos)


def test_an_acos_input_just_past_one_is_shown_with_the_digits_that_matter() -> None:
    # The range read "|x| from 1 to 1", hiding that the input had left acos's domain (1.0000002).
    torch.manual_seed(0)
    model = _Angle()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False) as gw:
        for step in range(3):
            x = torch.randn(4, 4) * (100.0 if step == 1 else 0.1)  # saturated tanh at step 1
            loss = model(x).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert origin.step == 1 and origin.op == "AcosBackward0"
    assert "1.00000024" in origin.message


class _SqrtBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t + self.fc(t).abs().sqrt())


class _CheckpointedNet(nn.Module):
    """Blocks run through torch.utils.checkpoint with use_reentrant=True (HF's gradient checkpointing, older
    code); a block whose weights are all zero takes sqrt at 0 (an Inf derivative, then NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_SqrtBlock() for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return self.out(h)


def _checkpointed_run(watched: bool, *, dead_block_at: int | None, nan_batch_at: int | None) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = _CheckpointedNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    gw = gradwatch.watch(model, opt, console=False) if watched else None
    for step in range(7):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        if step == dead_block_at:
            with torch.no_grad():
                model.blocks[1].fc.weight.zero_()
                model.blocks[1].fc.bias.zero_()
        if step == nan_batch_at:
            x[0, 0] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        if not watched and not torch.isfinite(loss):
            continue  # what gradwatch's skip does: no update
        loss.backward()
        opt.step()
        opt.zero_grad()
    if gw is not None:
        gw.close()
    return model, gw


# huggingface/transformers gradient checkpointing (use_reentrant=True): the NaN was blamed on
# CheckpointFunctionBackward ("check CheckpointFunction.backward's formula") or not localized at all.
def test_nan_inside_a_reentrant_checkpoint_is_localized_in_the_segment() -> None:
    _, gw = _checkpointed_run(True, dead_block_at=3, nan_batch_at=None)
    origins = [f for f in gw.findings if f.kind == "nan_origin"]
    assert [f.step for f in origins] == [3, 4, 5, 6]  # the incident's replay, then the escalation window
    for f in origins:
        assert f.module == "blocks.1" and "SqrtBackward0" in f.message, f.message
        assert "CheckpointFunction" not in f.message


def test_escalation_window_through_a_reentrant_checkpoint_leaves_training_unchanged() -> None:
    from torch.utils.checkpoint import CheckpointFunction

    watched, gw = _checkpointed_run(True, dead_block_at=None, nan_batch_at=2)
    bare, _ = _checkpointed_run(False, dead_block_at=None, nan_batch_at=2)
    assert {f.step for f in gw.findings if f.severity == "error"} == {2}
    assert gw.engine.steps_skipped == 1
    for a, b in zip(watched.state_dict().values(), bare.state_dict().values()):
        assert torch.equal(a, b)
    assert "apply" not in CheckpointFunction.__dict__  # the swap is undone


class _LoRALinear(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(4, d) * 0.01)
        self.B = nn.Parameter(torch.zeros(d, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.A.t() @ self.B.t()


class _LoRALM(nn.Module):
    """Frozen embedding and base weights, LoRA adapters inside checkpointed blocks."""

    def __init__(self, reentrant: bool, head_trainable: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(40, 16).requires_grad_(False)
        self.layers = nn.ModuleList(_LoRALinear(16) for _ in range(2))
        self.head = nn.Linear(16, 40).requires_grad_(head_trainable)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.emb(tok)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=self.reentrant)
        return self.head(x)


def _lora_run(reentrant: bool, head_trainable: bool) -> tuple[gradwatch.Watcher, BaseException | None]:
    torch.manual_seed(0)
    model = _LoRALM(reentrant, head_trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    raised = None
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("default")  # torch's "None of the inputs have requires_grad=True", as users see it
        try:
            with gradwatch.watch(model, opt, console=False) as gw:
                for _ in range(3):
                    tok = torch.randint(0, 40, (4, 9))
                    loss = nn.functional.cross_entropy(model(tok[:, :-1]).reshape(-1, 40), tok[:, 1:].reshape(-1))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        except RuntimeError as exc:
            raised = exc
    return gw, raised


# huggingface/peft#137, transformers#23170: LoRA with gradient checkpointing (use_reentrant=True) and a frozen
# embedding; gradwatch said "the layers the loss goes through are frozen... Unfreeze the layers".
def test_no_graph_through_reentrant_checkpoint_with_frozen_input_names_the_checkpoint() -> None:
    gw, raised = _lora_run(reentrant=True, head_trainable=False)
    assert raised is not None and "does not require grad" in str(raised)
    (f,) = gw.findings
    assert f.kind == "no_grad_graph" and f.data["cause"] == "reentrant_checkpoint", f.message
    assert set(f.data["reentrant_checkpoint"]) == {"layers.0", "layers.1"}
    assert "use_reentrant=False" in f.message and "enable_input_require_grads" in f.message
    assert "Unfreeze" not in f.message
    from torch.utils.checkpoint import CheckpointFunction

    assert "apply" not in CheckpointFunction.__dict__  # the recording swap is undone


def test_none_grad_inside_reentrant_checkpoint_with_frozen_input_names_the_checkpoint() -> None:
    gw, raised = _lora_run(reentrant=True, head_trainable=True)
    assert raised is None
    (f,) = gw.findings
    assert f.kind == "none_grad" and set(f.params) == {f"layers.{i}.{n}" for i in (0, 1) for n in "AB"}
    assert f.data["reentrant_checkpoint"] and "use_reentrant=False" in f.message, f.message
    assert "Fix: use them in forward" not in f.message


class _CountingNet(nn.Module):
    """A forward with Python-side state (a call counter, as a stateful RNN keeps its hidden state) and an
    unused head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.body(x)


def test_none_grad_report_does_not_replay_a_model_without_reentrant_checkpoints() -> None:
    # The reentrant-checkpoint explanation replays the forward: never for a plain unused head. (Its gate is
    # torch's own warning, process-wide: forget the ones earlier tests of this file raised.)
    import torch.utils.checkpoint as cp

    getattr(cp, "__warningregistry__", {}).clear()
    torch.manual_seed(0)
    model = _CountingNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        for _ in range(3):
            loss = model(torch.randn(2, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [f.kind for f in gw.findings] == ["none_grad"]
    assert model.calls == 3


@pytest.mark.parametrize("head_trainable", [False, True])
def test_lora_under_non_reentrant_checkpoint_is_silent(head_trainable: bool) -> None:
    gw, raised = _lora_run(reentrant=False, head_trainable=head_trainable)
    assert raised is None and gw.findings == []


def test_frozen_segments_in_reentrant_checkpoint_keep_the_frozen_explanation() -> None:
    torch.manual_seed(0)
    model = _LoRALM(True, False)
    for layer in model.layers:
        layer.requires_grad_(False)
    extra = nn.Linear(16, 16)  # trainable, but not on the loss path
    model.extra = extra
    opt = torch.optim.AdamW(extra.parameters(), lr=1e-3)
    with warnings.catch_warnings(), pytest.raises(RuntimeError):
        warnings.simplefilter("ignore")
        with gradwatch.watch(model, opt, console=False) as gw:
            tok = torch.randint(0, 40, (4, 9))
            loss = nn.functional.cross_entropy(model(tok[:, :-1]).reshape(-1, 40), tok[:, 1:].reshape(-1))
            loss.backward()
    (f,) = gw.findings
    assert f.kind == "no_grad_graph" and f.data["cause"] != "reentrant_checkpoint", f.message


class _L2Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        return h / h.norm(dim=1, keepdim=True)  # 0 / 0 for an all-zero row; relu stops its gradient


# A hand-written L2 normalization of a zero vector: nan_origin named the Div, while the bundled
# nonfinite_loss said "the NaN/Inf is in the loss value only... a mean over zero elements, 0*log(0)".
def test_nonfinite_loss_with_finite_gradients_defers_to_the_origin_named(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), _L2Head())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    protos = nn.functional.normalize(torch.randn(3, 4), dim=1)
    with gradwatch.watch(model, opt, console=False, log_dir=str(tmp_path)) as gw:
        for step in range(4):
            x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
            if step == 2:
                x[3] = 0.0
            loss = nn.functional.cross_entropy(model(x) @ protos.t(), y)
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    at2 = [f for f in gw.findings if f.step == 2]
    assert [f.kind for f in at2] == ["nonfinite_loss", "nan_origin"], [f.kind for f in at2]
    loss_f, origin = at2
    assert origin.op == "DivBackward0" and loss_f.data["grads_finite"]
    assert "DivBackward0" in loss_f.message and "mean over zero elements" not in loss_f.message
    assert "restates" not in loss_f.data and "clamp_min" in loss_f.message
    with open(origin.data["report"]) as fh:
        assert "mean over zero elements" not in fh.read()


class GatherLike(nn.Module):
    """Fills a buffer made with torch.empty (a gather target) before reading it; NaN comes from log(-x) later."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.garbage_was_nan: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        poison = torch.full((1024,), float("nan"))
        del poison  # the allocator hands this block to the next request of its size: torch.empty shows NaN
        buf = torch.empty(1024)
        self.garbage_was_nan.append(bool(torch.isnan(buf).any()))
        buf.copy_(torch.linspace(0, 1, 1024))
        return torch.log(h - 1e3) + buf.mean()


def test_uninitialized_memory_of_torch_empty_is_never_named_as_the_origin() -> None:
    model = GatherLike()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        loss = model(torch.randn(8, 4)).mean()
        gw.observe_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if not any(model.garbage_was_nan):
        pytest.skip("the allocator gave torch.empty fresh memory: the case is not reproduced")
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert origin.op == "LogBackward0" and "torch.empty" not in origin.message, origin.message
