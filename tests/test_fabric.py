"""Lightning Fabric: ``gradwatch.watch`` on what ``fabric.setup`` returns (or on the model and optimizer
before it) checks every update, names the user's own parameters, and raises no false alarm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import free_port, plain_console
from torch import nn

import gradwatch

L = pytest.importorskip("lightning")


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def fabric_loop(fabric, model, opt, steps: int, *, nan_at: int | None = None, accumulate: int = 1) -> None:
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            if step == nan_at and micro == 0:
                x[0, 0] = float("nan")
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(nn.functional.mse_loss(model(x), y) / accumulate)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("when", ["after_setup", "before_setup"])
def test_nan_batch_under_fabric_is_skipped_and_named_without_wrapper_segments(when: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, opt = net(), None
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if when == "before_setup":
        gw = gradwatch.watch(model, opt, console=plain_console())
        fmodel, fopt = fabric.setup(model, opt)
    else:
        fmodel, fopt = fabric.setup(model, opt)
        gw = gradwatch.watch(fmodel, fopt, console=plain_console())
    with gw:
        fabric_loop(fabric, fmodel, fopt, 30, nan_at=20)
    assert [(f.kind, f.step) for f in gw.findings if f.severity != "info"] == [
        ("nonfinite_grad", 20), ("nonfinite_input", 20)
    ]  # no unwatched_optimizer: Fabric's wrapper steps the watched Adam
    (grad,) = [f for f in gw.findings if f.kind == "nonfinite_grad"]
    assert set(grad.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert gw.engine.steps_skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_healthy_fabric_run_with_accumulation_is_quiet() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = net()
    fmodel, fopt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    with gradwatch.watch(fmodel, fopt, console=plain_console()) as gw:
        fabric_loop(fabric, fmodel, fopt, 60, accumulate=4)
    assert gw.findings == []
    assert gw.engine.steps_checked == 60


def test_fabric_checkpoint_holds_the_watcher_and_a_resumed_run_keeps_its_step_numbers(tmp_path) -> None:
    """``fabric.save(path, {"model": ..., "optimizer": ..., "gradwatch": gw})`` raised "cannot pickle
    '_thread.RLock'": the watcher had no state_dict, so Fabric pickled the whole object."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = net()
    fmodel, fopt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    path = tmp_path / "ckpt.pt"
    with gradwatch.watch(fmodel, fopt, console=plain_console()) as gw:
        fabric_loop(fabric, fmodel, fopt, 10)
        fabric.save(path, {"model": fmodel, "optimizer": fopt, "gradwatch": gw})
    assert path.exists()

    fabric2 = L.Fabric(accelerator="cpu", devices=1)
    model2 = net()
    fmodel2, fopt2 = fabric2.setup(model2, torch.optim.Adam(model2.parameters(), lr=1e-3))
    with gradwatch.watch(fmodel2, fopt2, console=plain_console()) as gw2:
        fabric2.load(path, {"model": fmodel2, "optimizer": fopt2, "gradwatch": gw2})
        assert gw2.engine.steps_checked == 10
        fabric_loop(fabric2, fmodel2, fopt2, 5, nan_at=1)
    assert [(f.kind, f.step) for f in gw2.findings if f.kind == "nonfinite_grad"] == [("nonfinite_grad", 11)]


# A known pitfall (Lightning PR #16715 review, lightly-ai/lightly-train#255): fabric.clip_gradients (whose
# error_if_nonfinite is True by default) crashes "16-mixed" training on the GradScaler's normal first overflow.
def test_fabric_clip_gradients_raising_on_the_scalers_overflow_is_explained_as_the_overflow() -> None:
    from lightning.fabric.plugins.precision.amp import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # a CPU scaler stands in for a GPU's
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=MixedPrecision("16-mixed", "cpu", scaler=scaler))
    model = net()
    fmodel, fopt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    with pytest.raises(RuntimeError, match="cannot be clipped"):
        with gradwatch.watch(fmodel, fopt, console=plain_console()) as gw:
            for _ in range(4):
                x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
                loss = nn.functional.mse_loss(fmodel(x).float(), y)
                fopt.zero_grad()
                fabric.backward(loss)
                fabric.clip_gradients(fmodel, fopt, max_norm=1.0)
                fopt.step()
    (f,) = gw.findings
    assert (f.kind, f.severity, f.step) == ("amp_overflow", "error", 0)
    assert "fabric.clip_gradients(model, optimizer, max_norm=..., error_if_nonfinite=False)" in f.message


def set_up(cls: type, lr: float) -> tuple:
    """A fresh Fabric on the CPU and ``cls()`` (seeded) set up with SGD: (fabric, module, wrapper, optimizer)."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    raw = cls()
    fmodel, fopt = fabric.setup(raw, torch.optim.SGD(raw.parameters(), lr=lr))
    return fabric, raw, fmodel, fopt


class StepModule(L.LightningModule):
    """A LightningModule run by a loop of one's own (Fabric's "build your own trainer"): the loop calls
    ``training_step`` (or a method marked with ``mark_forward_method``) on what ``fabric.setup`` returned."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.k = 1.0
        self.s = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        m = h.mean(1, keepdim=True)
        # k == 0: log(0), -inf in the forward; s == 0: sqrt(0) is finite, its gradient is not (born in backward)
        return self.head(h) + torch.log(m * self.k) + torch.sqrt(m * self.s)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def compute_loss(self, x, y):
        return nn.functional.mse_loss(self(x), y)


def step_loop(fabric, raw, fmodel, fopt, gw, steps: int, *, fault: str = "", at: int = 4, method: str = "training_step",
              accumulate: int = 1, zero_grad: str = "after_step") -> None:
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            raw.k = 0.0 if (fault == "log0" and step == at) else 1.0
            raw.s = 0.0 if (fault == "sqrt0" and step == at) else 1.0
            if fault == "nan_batch" and step == at:
                x[1, 1] = float("nan")
            if fault == "nan_target" and step == at:
                y[1, 0] = float("nan")
            if zero_grad == "every_micro_batch" or (zero_grad == "last_micro_batch" and micro == accumulate - 1):
                fopt.zero_grad()  # inside the accumulation loop: a bug
            loss = fmodel.compute_loss(x, y) if method == "compute_loss" else fmodel.training_step((x, y), step)
            gw.observe_loss(loss)
            fabric.backward(loss)
        fopt.step()
        if zero_grad != "every_micro_batch":
            fopt.zero_grad()


# Fabric's build-your-own-trainer pattern (Lightning-AI/pytorch-lightning#17424), watched after fabric.setup: Fabric
# runs training_step on the module it wraps, never through the wrapper's __call__, so a log(0) in forward got no
# nan_origin, only a warning to "call the watched model itself".
@pytest.mark.parametrize("fault", ["log0", "sqrt0"])
@pytest.mark.parametrize("method", ["training_step", "compute_loss"])
def test_training_step_called_through_fabric_is_localized_like_a_plain_loop(method: str, fault: str) -> None:
    fabric, raw, fmodel, fopt = set_up(StepModule, lr=1e-3)
    if method == "compute_loss":
        fmodel.mark_forward_method("compute_loss")
    with gradwatch.watch(fmodel, fopt, console=plain_console()) as gw:
        step_loop(fabric, raw, fmodel, fopt, gw, 8, fault=fault, method=method)
    kinds = [(f.kind, f.severity, f.step) for f in gw.findings if f.kind != "nonfinite_loss"]
    assert kinds == [("nonfinite_grad", "error", 4), ("nan_origin", "error", 4)]
    origin = gw.findings[-1]
    if fault == "log0":
        assert (origin.op, origin.data["phase"]) == ("LogBackward0", "forward")
        assert "torch.log(m * self.k)" in origin.message
    else:
        assert (origin.op, origin.data["phase"]) == ("SqrtBackward0", "backward")
        assert "torch.sqrt(m * self.s)" in origin.message
    assert "call the watched model itself" not in origin.message
    assert gw.engine.steps_skipped == 1


def test_nan_batch_through_fabric_training_step_is_named_as_input() -> None:
    fabric, raw, fmodel, fopt = set_up(StepModule, lr=1e-3)
    with gradwatch.watch(fmodel, fopt, console=plain_console()) as gw:
        step_loop(fabric, raw, fmodel, fopt, gw, 8, fault="nan_batch")
    assert [(f.kind, f.step) for f in gw.findings] == [
        ("nonfinite_loss", 4), ("nonfinite_grad", 4), ("nonfinite_input", 4)
    ]
    assert "args[0] (1 NaN, 0 Inf)" in gw.findings[-1].message


@pytest.mark.parametrize("zero_grad", ["every_micro_batch", "last_micro_batch"])
def test_zero_grad_inside_accumulation_with_fabric_training_step_is_flagged(zero_grad: str) -> None:
    fabric, raw, fmodel, fopt = set_up(StepModule, lr=1e-3)
    with gradwatch.watch(fmodel, fopt, console=plain_console()) as gw:
        step_loop(fabric, raw, fmodel, fopt, gw, 6, accumulate=4, zero_grad=zero_grad)
    assert {f.kind for f in gw.findings} == {"zero_grad_in_accumulation"}


class NetStep(L.LightningModule):
    """training_step calls a submodule directly: the module's own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def test_fabric_training_step_around_forward_gets_advice_for_training_step() -> None:
    # The loop is Fabric's documented one: the advice is about training_step, never "call the watched model".
    fabric, raw, fmodel, fopt = set_up(NetStep, lr=1e-3)
    with gradwatch.watch(fmodel, fopt, console=plain_console()) as gw:
        step_loop(fabric, raw, fmodel, fopt, gw, 6, fault="nan_batch")
    (origin,) = [f for f in gw.findings if f.kind == "nan_origin"]
    assert origin.severity == "warning" and origin.data["no_forward"]
    assert "NetStep.__call__" in origin.message and "_FabricModule" not in origin.message
    assert "in training_step call the model itself, `self(x)`" in origin.message
    assert "call the watched model itself" not in origin.message


class InplaceStep(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.enc(x))
        h += 1  # in place on the output sigmoid saved for backward
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


def test_inplace_error_in_fabric_training_step_is_traced_to_its_line() -> None:
    fabric, _raw, fmodel, fopt = set_up(InplaceStep, lr=0.1)
    gw = gradwatch.watch(fmodel, fopt, console=plain_console())
    with pytest.raises(RuntimeError, match="inplace operation"), gw:
        fabric.backward(fmodel.training_step((torch.randn(8, 4), torch.randn(8, 1)), 0))
    (finding,) = gw.findings
    assert finding.kind == "inplace_error" and finding.data["module_exact"]
    assert finding.data["modified_at"].endswith("h += 1  # in place on the output sigmoid saved for backward")
    assert finding.module == finding.data["modified_in"] == "<root InplaceStep>"  # not the wrapper's class


def test_healthy_fabric_training_step_run_is_quiet() -> None:
    fabric, raw, fmodel, fopt = set_up(StepModule, lr=1e-3)
    with gradwatch.watch(fmodel, fopt, console=plain_console()) as gw:
        step_loop(fabric, raw, fmodel, fopt, gw, 30, accumulate=2)
    assert gw.findings == []


DDP_WORKER = textwrap.dedent(
    """
    import io, json, sys
    import torch, lightning as L, gradwatch
    from rich.console import Console
    sys.path.insert(0, sys.argv[2])
    from test_fabric import StepModule, step_loop

    fault, when = sys.argv[1], sys.argv[3]
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    raw = StepModule()
    opt = torch.optim.SGD(raw.parameters(), lr=1e-3)
    watch = lambda m, o: gradwatch.watch(m, o, console=Console(file=io.StringIO()))
    gw = watch(raw, opt) if when == "before" else None
    fmodel, fopt = fabric.setup(raw, opt)
    gw = gw or watch(fmodel, fopt)
    if fault.endswith("micro_batch"):
        step_loop(fabric, raw, fmodel, fopt, gw, 6, accumulate=4, zero_grad=fault)
    else:
        step_loop(fabric, raw, fmodel, fopt, gw, 6, fault=fault)
    gw.close()
    print(json.dumps([(f.kind, f.step, f.op, f.data.get("phase"), f.message) for f in gw.findings]))
    torch.distributed.destroy_process_group()
    """
)


# The same under Fabric's DDP: there Fabric reaches training_step by patching the module's forward and calling it
# through DistributedDataParallel (the module's __call__ runs twice: training_step, then self(x) inside it).
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="gloo")
@pytest.mark.parametrize(
    ("fault", "when"),
    [
        ("log0", "after"), ("sqrt0", "after"), ("sqrt0", "before"), ("nan_target", "after"),
        ("every_micro_batch", "after"),
    ],
)
def test_training_step_through_fabric_ddp_is_localized(fault: str, when: str, tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(DDP_WORKER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's gradwatch
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, str(script), fault, os.path.dirname(__file__), when],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if fault in ("log0", "sqrt0"):
        op, line = ("LogBackward0", "torch.log(m * self.k)") if fault == "log0" else ("SqrtBackward0", "torch.sqrt(m * self.s)")
        assert [(k, s, o) for k, s, o, _p, _m in found if k != "nonfinite_loss"] == [
            ("nonfinite_grad", 4, None), ("nan_origin", 4, op)
        ]
        assert line in found[-1][4]
    elif fault == "nan_target":
        # Born in the loss (y is NaN), not in the model's input: the training_step call DDP ran is no forward.
        assert [(k, p) for k, _s, _o, p, _m in found if k == "nan_origin"] == [("nan_origin", "loss")]
        assert not any("before the model ran" in m for *_r, m in found)
        # The loop's y, found past the frames of Fabric's optimizer step.
        (named,) = [m for k, *_r, m in found if k == "nonfinite_input"]
        assert "y (in step_loop() at " in named
    else:
        assert {k for k, *_ in found} == {"zero_grad_in_accumulation"}


class RNNish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8)
        self.inp = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.h: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.h is None:
            self.h = torch.zeros(x.shape[0], 8)
        self.h = torch.tanh(self.cell(self.h) + self.inp(x))  # never detached: step 1's backward needs step 0's graph
        return self.head(self.h)


# A recurrent state kept on the model across steps under Fabric: the explanation named `_forward_module.h` and the
# module `_forward_module` (the plain loop says `h` and `<root RNNish>`).
def test_autograd_error_under_fabric_names_the_users_module_not_the_wrapper() -> None:
    fabric, _raw, fmodel, fopt = set_up(RNNish, lr=0.01)
    gw = gradwatch.watch(fmodel, fopt, console=plain_console())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"), gw:
        for _ in range(3):
            loss = nn.functional.mse_loss(fmodel(torch.randn(8, 4)), torch.randn(8, 1))
            fopt.zero_grad()
            fabric.backward(loss)
            fopt.step()
    (finding,) = gw.findings
    assert finding.kind == "backward_twice"
    assert finding.module == "<root RNNish>"
    assert finding.data["state_attributes"] == ["h"]
    assert "_forward_module" not in finding.message and "_FabricModule" not in finding.message


# A NaN target held by the training loop is named (variable and line) in a plain loop; under Fabric opt.step() runs
# through lightning.fabric's frames, and the loop's frame was never reached.
@pytest.mark.parametrize("when", ["after_setup", "before_setup"])
def test_nan_target_held_by_a_fabric_loop_is_named(when: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gw = gradwatch.watch(model, opt, console=plain_console()) if when == "before_setup" else None
    fmodel, fopt = fabric.setup(model, opt)
    gw = gw or gradwatch.watch(fmodel, fopt, console=plain_console())
    g = torch.Generator().manual_seed(1)
    with gw:
        for step in range(6):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            if step == 4:
                y[2, 0] = float("nan")
            loss = nn.functional.mse_loss(fmodel(x), y)
            gw.observe_loss(loss)
            fopt.zero_grad()
            fabric.backward(loss)
            fopt.step()
    assert [(f.kind, f.severity, f.step) for f in gw.findings] == [
        ("nonfinite_loss", "error", 4), ("nonfinite_grad", "error", 4), ("nonfinite_input", "warning", 4),
        ("nan_origin", "error", 4),
    ]
    (named,) = [f for f in gw.findings if f.kind == "nonfinite_input"]
    assert "y (in test_nan_target_held_by_a_fabric_loop_is_named() at " in named.message
    assert gw.findings[-1].data["phase"] == "loss"
