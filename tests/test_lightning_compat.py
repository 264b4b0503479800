"""GradWatchCallback attached to Trainers the way Lightning's own tests build them: gradwatch changes nothing of
Lightning's (its logging, its log directories, copies of the module, its learning-rate finder)."""

from __future__ import annotations

import copy
import glob
import importlib
import io
import json
import os
import subprocess
import sys
import textwrap
import uuid
from typing import Any

import pytest
import torch
from helpers import lightning_namespace, tiny_data, tiny_module, tiny_trainer

lightning_namespace("lightning.pytorch")  # skip the module when Lightning is not installed

import gradwatch  # noqa: E402
from gradwatch.lightning import GradWatchCallback  # noqa: E402
from gradwatch.report.jsonl import is_finding, read_jsonl  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:.*The number of training batches.*",
    "ignore:.*isinstance.*treespec.*",
)

# -- imports and logging ---------------------------------------------------------------------------
# A fresh process: import the namespaces in ``imports`` (and gradwatch.lightning before or after them), fit a
# tiny model in each namespace's Trainer with the callback, and print what a user would check.
_FIT = textwrap.dedent(
    """
    import importlib, logging, sys, warnings
    warnings.filterwarnings("ignore")
    order = sys.argv[1].split(",")
    for name in order:
        importlib.import_module(name)
    from gradwatch.lightning import GradWatchCallback
    import torch

    class Capture(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    namespaces = [n for n in ("lightning.pytorch", "pytorch_lightning") if n in order]
    for ns_name in namespaces or ["lightning.pytorch"]:
        cb = GradWatchCallback(console=False)  # built before any Lightning import when namespaces is empty
        ns = importlib.import_module(ns_name)
        capture = Capture()
        logging.getLogger(ns_name + ".utilities.rank_zero").addHandler(capture)

        class Tiny(ns.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                loss = self.layer(batch[0]).pow(2).mean()
                return loss * float("nan") if batch_idx == 1 else loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def train_dataloader(self):
                data = torch.utils.data.TensorDataset(torch.randn(32, 4))
                return torch.utils.data.DataLoader(data, batch_size=8)

        trainer = ns.Trainer(
            accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
        )
        trainer.fit(Tiny())
        stopped = any("`Trainer.fit` stopped" in m for m in capture.messages)
        kinds = sorted({f.kind for f in cb.findings})
        print(ns_name, "stopped-logged" if stopped else "stopped-missing", ",".join(kinds))
    print("modules", "pytorch_lightning" in sys.modules, "lightning.pytorch" in sys.modules)
    """
)


def _run(order: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", _FIT, order], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()


@pytest.mark.parametrize("gradwatch_first", [False, True])
def test_lightning_pytorch_alone_keeps_its_logger_and_pytorch_lightning_unimported(gradwatch_first: bool) -> None:
    lines = _run("gradwatch,lightning.pytorch" if gradwatch_first else "lightning.pytorch")
    assert lines[0].startswith("lightning.pytorch stopped-logged ") and "nonfinite_loss" in lines[0], lines
    assert lines[-1] == "modules False True"


@pytest.mark.parametrize("gradwatch_first", [False, True])
def test_pytorch_lightning_alone_keeps_its_logger_and_lightning_pytorch_unimported(gradwatch_first: bool) -> None:
    lightning_namespace("pytorch_lightning")
    lines = _run("gradwatch,pytorch_lightning" if gradwatch_first else "pytorch_lightning")
    assert lines[0].startswith("pytorch_lightning stopped-logged ") and "nonfinite_loss" in lines[0], lines
    assert lines[-1] == "modules True False"


def test_both_namespaces_imported_the_callback_works_in_both_trainers() -> None:
    lightning_namespace("pytorch_lightning")
    lines = _run("pytorch_lightning,lightning.pytorch")
    assert [line.split()[0] for line in lines[:2]] == ["lightning.pytorch", "pytorch_lightning"], lines
    assert all("nonfinite_loss" in line for line in lines[:2]), lines  # (the log goes where Lightning puts it)
    assert lines[-1] == "modules True True"


def test_a_callback_built_before_any_lightning_import_is_a_lightning_pytorch_callback() -> None:
    # The rule: built before any Lightning namespace is imported, the callback imports lightning.pytorch (the
    # namespace Lightning documents) and no other.
    lines = _run("gradwatch")
    assert lines[0].startswith("lightning.pytorch stopped-logged ") and "nonfinite_loss" in lines[0], lines
    assert lines[-1] == "modules False True"



def test_imported_after_lightning_the_class_itself_is_a_callback_subclass() -> None:
    # LightningCLI (jsonargparse) checks issubclass(class_path, Callback) before it builds the callback.
    code = (
        "import sys, lightning.pytorch as pl\n"
        "from gradwatch.lightning import GradWatchCallback\n"
        "print(issubclass(GradWatchCallback, pl.Callback), 'pytorch_lightning' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["True", "False"], result.stdout + result.stderr

# -- copies of the module during training ----------------------------------------------------------
def gradwatch_objects(module: torch.nn.Module) -> list[str]:
    """Everything of gradwatch's that ``module`` (or a submodule) holds in its attributes and hook dicts."""

    def of_gradwatch(v: object) -> bool:
        v = getattr(v, "func", v)  # functools.partial
        v = getattr(v, "__self__", v)  # bound method
        owner = v if isinstance(v, type) or (callable(v) and hasattr(v, "__module__")) else type(v)
        return str(getattr(owner, "__module__", "") or "").startswith("gradwatch")

    found = []
    for name, m in module.named_modules():
        for attr, value in vars(m).items():
            values = value.values() if isinstance(value, dict) else [value]
            found += [f"{name}.{attr}" for v in values if of_gradwatch(v) or of_gradwatch(type(v))]
    return found


class _Copies:
    """Manual optimization; every training_step deep-copies and saves the module (an EMA or teacher copy, a
    snapshot), before and after its update. A NaN loss at batch 2 escalates the steps after."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.body = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 1)
        self.copies: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))

    def _copy(self) -> None:
        clone = copy.deepcopy(self)
        buffer = io.BytesIO()
        torch.save(self, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        self.copies.append(gradwatch_objects(clone) + gradwatch_objects(loaded))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if batch_idx == 2:
            loss = loss * float("nan")
        self._copy()  # the forward's graph is alive here
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self._copy()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        return tiny_data()


def _copies_module(ns: Any) -> type:
    """``_Copies`` as a LightningModule of ``ns``, importable by name (``torch.save`` pickles the class)."""
    name = "Copies_" + ns.__name__.replace(".", "_")
    if name not in globals():
        globals()[name] = type(name, (_Copies, ns.LightningModule), {"__module__": __name__})
    return globals()[name]


def test_deepcopy_and_torch_save_of_the_module_in_training_step_carry_nothing_of_gradwatch(
    pl_ns: Any, tmp_path: Any
) -> None:
    cb = GradWatchCallback(console=False)
    checkpoints = pl_ns.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_weights_only=False)
    model = _copies_module(pl_ns)()
    trainer = tiny_trainer(pl_ns, [cb, checkpoints], max_steps=6, enable_checkpointing=True)
    trainer.fit(model)
    # 12 copies from the fit, more from gradwatch's replay of the NaN step's training_step (which ran too)
    assert len(model.copies) > 12 and all(c == [] for c in model.copies), model.copies
    assert ("nonfinite_loss", 2) in {(f.kind, f.step) for f in cb.findings}  # watched all along
    assert cb.engine.escalated or cb.engine.steps_skipped == 1
    assert len(list(tmp_path.glob("*.ckpt"))) >= 1


def test_a_plain_loop_copies_and_saves_the_module_on_every_step_including_escalated_ones() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    copies, escalated = [], []
    with gradwatch.watch(model, opt, console=False) as watcher:
        for step in range(8):
            x = torch.randn(16, 4)
            if step == 3:
                x[0, 0] = float("nan")  # escalates the steps after it
            loss = model(x).pow(2).mean()
            copies.append(copy.deepcopy(model))  # the forward's graph is alive
            loss.backward()
            opt.step()
            opt.zero_grad()
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            copies += [copy.deepcopy(model), torch.load(buffer, weights_only=False)]
            escalated.append(watcher.engine.escalated)
    assert any(escalated)
    assert [gradwatch_objects(c) for c in copies] == [[]] * 24
    assert ("nonfinite_input", 3) in {(f.kind, f.step) for f in watcher.findings}
    assert gradwatch_objects(model) == []  # closed: the model is as it was


def test_the_watched_module_keeps_gradwatch_hooks_while_its_copies_do_not() -> None:
    model = torch.nn.Linear(2, 1)
    watcher = gradwatch.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), console=False)
    assert gradwatch_objects(model) != []
    assert gradwatch_objects(copy.deepcopy(model)) == [] and gradwatch_objects(copy.copy(model)) == []
    watcher.close()
    assert gradwatch_objects(model) == [] and "__reduce_ex__" not in vars(model)


# -- where the records go --------------------------------------------------------------------------
def _records(url: str) -> list[dict[str, Any]]:
    fsspec = pytest.importorskip("fsspec")
    with fsspec.open(url + "/gradwatch.jsonl", "r") as fh:
        return [r for r in map(json.loads, filter(str.strip, fh)) if is_finding(r)]


def test_a_memory_url_root_dir_gets_the_records_through_fsspec_and_no_local_folder(
    pl_ns: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    fsspec = pytest.importorskip("fsspec")
    monkeypatch.chdir(tmp_path)
    root = f"memory://gradwatch-{pl_ns.__name__}-{uuid.uuid4().hex}"
    cb = GradWatchCallback(console=False)
    trainer = tiny_trainer(pl_ns, [cb], default_root_dir=root, logger=True, enable_checkpointing=True)
    trainer.fit(tiny_module(pl_ns, nan_at=2))
    assert str(trainer.log_dir).startswith("memory://") and cb.engine.log_dir == str(trainer.log_dir)
    kinds = {(r["kind"], r["step"]) for r in _records(cb.engine.log_dir)}
    assert ("nonfinite_loss", 2) in kinds, kinds
    assert fsspec.filesystem("memory").exists(cb.engine.log_dir + "/incidents/step_2.md")
    assert os.listdir(tmp_path) == []  # no folder named "memory:"


def test_a_plain_loop_writes_its_records_to_a_memory_url(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"memory://gradwatch-plain-{uuid.uuid4().hex}"
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False, log_dir=url):
        for step in range(4):
            x = torch.randn(8, 4)
            if step == 2:
                x[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert ("nonfinite_grad", 2) in {(r["kind"], r["step"]) for r in _records(url)}
    assert os.listdir(tmp_path) == []


def test_with_a_csv_logger_the_records_go_beside_its_logs(pl_ns: Any, tmp_path: Any) -> None:
    cb = GradWatchCallback(console=False)
    logger = pl_ns.loggers.CSVLogger(str(tmp_path))
    trainer = tiny_trainer(pl_ns, [cb], logger=logger)
    trainer.fit(tiny_module(pl_ns, nan_at=2))
    log_dir = str(trainer.log_dir)
    assert log_dir.startswith(str(tmp_path)) and cb.engine.log_dir == log_dir
    with open(os.path.join(log_dir, "gradwatch.jsonl"), encoding="utf-8") as fh:
        kinds = {(r["kind"], r["step"]) for r in map(json.loads, fh) if is_finding(r)}
    assert ("nonfinite_loss", 2) in kinds, kinds
    assert os.path.exists(os.path.join(log_dir, "incidents", "step_2.md"))
    assert not glob.glob(os.path.join(log_dir, "*tfevents*"))  # gradwatch adds no TensorBoard files there


# -- the learning-rate finder ----------------------------------------------------------------------
def _regression(ns: Any) -> Any:
    class Regression(ns.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = torch.nn.Linear(8, 16)
            self.head = torch.nn.Linear(16, 1)
            self.lr = 0.01

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(x)))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(256, 8, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    return Regression()


def test_the_learning_rate_sweep_of_the_tuner_is_not_reported_and_the_fit_after_it_is_watched(
    pl_ns: Any, tmp_path: Any
) -> None:
    # The sweep drives the loss to Inf/NaN on purpose (learning rates up to 1e3).
    from importlib import import_module

    tuner = import_module(pl_ns.__name__ + ".tuner").Tuner
    cb = GradWatchCallback(console=False, log_dir=str(tmp_path))
    trainer = tiny_trainer(pl_ns, [cb], max_steps=-1, max_epochs=2, default_root_dir=str(tmp_path))
    model = _regression(pl_ns)
    tuner(trainer).lr_find(model, min_lr=1e-3, max_lr=1e3, num_training=30, early_stop_threshold=None)
    model.lr = 0.01
    trainer.fit(model)
    assert cb.findings == [] and cb.engine.steps_checked == 64
    assert not [r for r in read_jsonl(os.path.join(tmp_path, "gradwatch.jsonl")) if is_finding(r)]


def test_a_learning_rate_sweep_between_epochs_is_not_reported(pl_ns: Any, tmp_path: Any) -> None:
    class AtEpochOne(pl_ns.callbacks.LearningRateFinder):  # the documented "LR finder at milestones"
        def on_fit_start(self, *args: Any, **kwargs: Any) -> None:
            return

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.current_epoch == 1:
                self.lr_find(trainer, pl_module)

    cb = GradWatchCallback(console=False, log_dir=str(tmp_path))
    finder = AtEpochOne(min_lr=1e-3, max_lr=1e3, num_training_steps=30, early_stop_threshold=None, update_attr=False)
    trainer = tiny_trainer(pl_ns, [cb, finder], max_steps=-1, max_epochs=3, default_root_dir=str(tmp_path))
    trainer.fit(_regression(pl_ns))
    assert [(f.kind, f.step) for f in cb.findings] == [], [f.message for f in cb.findings]
    assert cb.engine.steps_checked == 96
    assert not [r for r in read_jsonl(os.path.join(tmp_path, "gradwatch.jsonl")) if is_finding(r)]


# -- the loss under fp16 with a GradScaler ---------------------------------------------------------
def test_under_fp16_with_a_growing_grad_scaler_the_recorded_loss_is_the_unscaled_loss(pl_ns: Any) -> None:
    precision = importlib.import_module(pl_ns.__name__ + ".plugins.precision")
    # A scale that starts at 1 and doubles every 2 clean steps: the scaled loss climbs 1000s of times over the run.
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=2)
    seen: list[float] = []

    class Losses(pl_ns.Callback):  # the loss training_step returned, before Lightning scales it
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            seen.append(float(outputs["loss"]))

    cb = GradWatchCallback(console=False, window=200)
    trainer = tiny_trainer(
        pl_ns, [cb, Losses()], max_steps=36, plugins=[precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )
    trainer.fit(tiny_module(pl_ns, lr=0.01, momentum=0.0))
    assert scaler.get_scale() >= 2.0**8  # the scale grew a lot
    recorded = list(cb.engine.history.losses)
    assert len(recorded) >= 30
    # The losses of the checked (not overflowed) steps: each one is a loss the run returned, not ~1e5x more.
    assert max(recorded) < 10 * max(seen) and min(recorded) > min(seen) / 10, (recorded[:5], seen[:5])
    assert [f.kind for f in cb.findings if f.kind in ("loss_diverging", "loss_spike")] == []
