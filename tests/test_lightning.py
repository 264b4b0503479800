"""GradWatchCallback in real (tiny, CPU) Lightning runs, in both Lightning namespaces."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from helpers import lightning_namespace, manual_module, panels, tiny_module, tiny_trainer

pl = lightning_namespace("lightning.pytorch")  # skip the module when Lightning is not installed

import gradwatch  # noqa: E402
from gradwatch.lightning import GradWatchCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers.*",
    "ignore:.*The number of training batches.*",
    "ignore:.*isinstance.*treespec.*",
    "ignore:.*`training_step` returned `None`.*",
    "ignore:.*resuming from a checkpoint that ended before the epoch ended.*",
)


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


class Recorder:
    """Records parameters and SGD momentum buffers at the start and end of every batch."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.momentum_before: dict[int, list[torch.Tensor]] = {}
        self.momentum_after: dict[int, list[torch.Tensor]] = {}

    def callback(self, ns: Any) -> Any:
        rec = self

        class _Recorder(ns.Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                rec.before[trainer.global_step] = _params(pl_module)
                rec.momentum_before[trainer.global_step] = rec._momentum(pl_module)

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
                step = trainer.global_step - 1
                rec.after[step] = _params(pl_module)
                rec.momentum_after[step] = rec._momentum(pl_module)

        return _Recorder()

    @staticmethod
    def _momentum(pl_module: Any) -> list[torch.Tensor]:
        opt = pl_module.opt
        return [opt.state[p]["momentum_buffer"].clone() for p in pl_module.parameters() if p in opt.state]


# -- import and namespaces -------------------------------------------------------------------------
def test_import_gradwatch_does_not_import_lightning() -> None:
    code = (
        "import sys, gradwatch\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_without_lightning_names_the_pip_command() -> None:
    code = (
        "import sys\n"
        "sys.modules['lightning'] = None\n"
        "sys.modules['pytorch_lightning'] = None\n"
        "try:\n"
        "    import gradwatch.lightning\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    sys.exit(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Install it with: pip install lightning" in result.stdout
    assert "gradwatch[lightning]" not in result.stdout  # no package index holds gradwatch


def test_callback_is_a_callback_of_both_namespaces_when_both_are_imported() -> None:
    namespaces = [lightning_namespace(name) for name in ("lightning.pytorch", "pytorch_lightning")]
    cb = GradWatchCallback(console=False)
    for ns in namespaces:
        assert isinstance(cb, ns.Callback), ns.__name__


def test_unknown_keyword_is_rejected_with_the_known_ones() -> None:
    with pytest.raises(TypeError, match=r"unknown gradwatch option 'on_nan'.*known options: on_nonfinite"):
        GradWatchCallback(on_nan="skip")


def test_bad_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="on_nonfinite='ignore' is not one of 'warn', 'skip', 'raise'"):
        GradWatchCallback(on_nonfinite="ignore")  # type: ignore[arg-type]


# -- non-finite steps ------------------------------------------------------------------------------
def test_nan_step_is_skipped_and_training_continues(pl_ns: Any, text_console: Any) -> None:
    rec = Recorder()
    cb = GradWatchCallback(on_nonfinite="skip", console=text_console)
    model = tiny_module(pl_ns, nan_at=3)
    trainer = tiny_trainer(pl_ns, [cb, rec.callback(pl_ns)], max_steps=6)
    trainer.fit(model)

    assert trainer.global_step == 6
    for name, before in rec.before[3].items():
        assert torch.equal(rec.after[3][name], before), name
        assert torch.isfinite(rec.after[3][name]).all(), name
    assert all(torch.equal(a, b) for a, b in zip(rec.momentum_after[3], rec.momentum_before[3]))
    assert any(not torch.equal(rec.after[5][n], rec.before[5][n]) for n in rec.before[5])  # later steps train
    assert {("nonfinite_loss", 3), ("nonfinite_grad", 3)} <= {(f.kind, f.step) for f in cb.findings}
    assert {f.step for f in cb.findings} == {3}
    assert cb.engine is not None and cb.engine.steps_skipped == 1 and cb.engine.steps_checked == 6
    assert "gradwatch skipped this update" in text_console.file.getvalue()


def test_raise_policy_makes_fit_raise(pl_ns: Any) -> None:
    cb = GradWatchCallback(on_nonfinite="raise", console=False)
    trainer = tiny_trainer(pl_ns, [cb])
    with pytest.raises(gradwatch.GradWatchError, match="stopped training at step 2") as info:
        trainer.fit(tiny_module(pl_ns, nan_at=2))
    assert {"nonfinite_loss", "nonfinite_grad"} <= {f.kind for f in info.value.findings}
    assert cb.engine is not None and cb.engine.closed


def test_warn_policy_reports_and_applies_the_update(lightning_pytorch: Any) -> None:
    cb = GradWatchCallback(on_nonfinite="warn", console=False, max_skips=None)
    model = tiny_module(lightning_pytorch, nan_at=1)
    tiny_trainer(lightning_pytorch, [cb], max_steps=2).fit(model)
    assert not torch.isfinite(model.body.weight).all()
    assert ("nonfinite_grad", 1) in {(f.kind, f.step) for f in cb.findings}
    assert cb.engine is not None and cb.engine.steps_skipped == 0


# -- healthy runs stay silent ----------------------------------------------------------------------
def test_gradient_accumulation_raises_no_false_alarm(lightning_pytorch: Any) -> None:
    cb = GradWatchCallback(console=False)
    trainer = tiny_trainer(lightning_pytorch, [cb], max_steps=5, accumulate_grad_batches=4)
    trainer.fit(tiny_module(lightning_pytorch))
    assert cb.findings == []
    assert cb.engine is not None
    assert cb.engine.steps_checked == 5  # once per accumulation cycle, not per batch
    assert cb.engine.step_counts == [5]


def test_accumulated_loss_is_reported_unscaled(lightning_pytorch: Any) -> None:
    losses: list[float] = []

    class LossLog(lightning_pytorch.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            losses.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)  # outputs hold loss / 4

    cb = GradWatchCallback(console=False)
    tiny_trainer(lightning_pytorch, [cb, LossLog()], max_steps=1, accumulate_grad_batches=4).fit(
        tiny_module(lightning_pytorch)
    )
    assert cb.engine is not None
    assert cb.engine.history.losses[-1] == pytest.approx(sum(losses) / 4, rel=1e-5)


# https://lightning.ai/docs/pytorch/stable/common/trainer.html#accumulate-grad-batches (a schedule)
def test_loss_under_a_gradient_accumulation_schedule_is_reported_unscaled(lightning_pytorch: Any) -> None:
    losses: list[float] = []

    class LossLog(lightning_pytorch.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            losses.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)

    schedule = lightning_pytorch.callbacks.GradientAccumulationScheduler(scheduling={0: 4, 1: 1})
    cb = GradWatchCallback(console=False)
    trainer = tiny_trainer(lightning_pytorch, [schedule, cb, LossLog()], max_epochs=3, max_steps=-1,
                           limit_train_batches=8)
    trainer.fit(tiny_module(lightning_pytorch))
    assert cb.engine is not None
    first = cb.engine.history.losses[0]
    assert first == pytest.approx(sum(losses[:4]) / 4, rel=1e-5)  # epoch 0: 4 batches per step
    assert cb.engine.history.losses[-1] == pytest.approx(losses[-1], rel=1e-5)
    assert [f for f in cb.findings if f.severity != "info"] == []


def test_one_callback_reused_by_a_second_trainer_starts_afresh(lightning_pytorch: Any) -> None:
    cb = GradWatchCallback(console=False)
    tiny_trainer(lightning_pytorch, [cb], max_steps=20).fit(tiny_module(lightning_pytorch, lr=0.001))
    first_run = list(cb.findings)
    # A sweep: another Trainer and a model whose gradients are 100x larger.
    model = tiny_module(lightning_pytorch, lr=0.001)
    with torch.no_grad():
        model.head.weight.mul_(100.0)
    tiny_trainer(lightning_pytorch, [cb], max_steps=6).fit(model)
    assert first_run == [] and cb.findings == [], [(f.kind, f.step) for f in cb.findings]
    assert cb.engine is not None and cb.engine.step_counts == [6]


def test_training_step_returning_none_is_not_a_missing_gradient(lightning_pytorch: Any) -> None:
    cb = GradWatchCallback(console=False)
    trainer = tiny_trainer(lightning_pytorch, [cb], max_steps=5)
    trainer.fit(tiny_module(lightning_pytorch, none_at=2))
    assert cb.findings == []
    assert cb.engine is not None and cb.engine.steps_checked == 4 and cb.engine.step_counts == [5]


def test_manual_optimization_with_two_optimizers(pl_ns: Any) -> None:
    cb = GradWatchCallback(console=False)
    trainer = tiny_trainer(pl_ns, [cb], max_steps=8)
    trainer.fit(manual_module(pl_ns))
    assert cb.findings == []
    assert cb.engine is not None
    assert len(cb.engine.optimizers) == 2
    assert cb.engine.step_counts == [4, 4]
    assert cb.engine.steps_checked == 8


def test_manual_optimization_skips_nan_for_both_optimizers(lightning_pytorch: Any) -> None:
    cb = GradWatchCallback(on_nonfinite="skip", console=False)
    model = manual_module(lightning_pytorch, nan_at=1)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}

    class Snap(lightning_pytorch.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            snapshots[batch_idx] = _params(pl_module)

    tiny_trainer(lightning_pytorch, [cb, Snap()], max_steps=8).fit(model)  # 4 batches, 2 steps each
    assert all(torch.equal(snapshots[1][n], snapshots[2][n]) for n in snapshots[1])  # batch 1 changed nothing
    assert not torch.equal(snapshots[2]["head.weight"], snapshots[3]["head.weight"])  # batch 2 trained
    nonfinite = [(f.step, f.data["optimizer"]) for f in cb.findings if f.kind == "nonfinite_grad"]
    assert nonfinite == [(2, 0), (3, 1)]  # global_step counts both optimizers' steps
    assert cb.engine is not None and cb.engine.steps_skipped == 2


def test_every_keeps_a_cadence_per_optimizer(lightning_pytorch: Any) -> None:
    cb = GradWatchCallback(console=False, every=2)
    tiny_trainer(lightning_pytorch, [cb], max_steps=8).fit(manual_module(lightning_pytorch))
    assert cb.engine is not None
    assert cb.engine.steps_checked == 4  # steps 0 and 2 of each optimizer
    assert sorted(cb.engine.history.last) == [0, 1]


def test_amp_scaler_skipped_steps_are_counted(lightning_pytorch: Any) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu")  # fp16 on CPU: the first steps overflow and the scaler skips them
    cb = GradWatchCallback(console=False)
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    trainer = tiny_trainer(lightning_pytorch, [cb], max_steps=5, plugins=[plugin])
    trainer.fit(tiny_module(lightning_pytorch))
    assert scaler.get_scale() < 2.0**16  # some steps really were skipped by the scaler
    assert cb.engine is not None
    assert cb.engine.step_counts == [5] and cb.engine.steps_checked == 5
    assert cb.engine.steps_skipped == 0  # the scaler skipped them, not gradwatch


# -- what gets named -------------------------------------------------------------------------------
def test_unused_submodule_is_named(lightning_pytorch: Any, text_console: Any) -> None:
    cb = GradWatchCallback(console=text_console)
    tiny_trainer(lightning_pytorch, [cb], max_steps=3).fit(tiny_module(lightning_pytorch, unused=True))
    none_grad = [f for f in cb.findings if f.kind == "none_grad"]
    assert len(none_grad) == 1
    assert none_grad[0].step == 0
    assert none_grad[0].params == ("aux_head.weight", "aux_head.bias")
    assert none_grad[0].module == "aux_head"
    assert "aux_head.weight, aux_head.bias" in text_console.file.getvalue()


# -- logging ---------------------------------------------------------------------------------------
def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_logger_receives_the_tags(pl_ns: Any) -> None:
    logger_cls = pl_ns.loggers.TensorBoardLogger
    cb = GradWatchCallback(console=False)
    logger = None

    def run(tmp: str) -> str:
        nonlocal logger
        logger = logger_cls(save_dir=tmp, name="run")
        tiny_trainer(pl_ns, [cb], max_steps=5, logger=logger).fit(tiny_module(pl_ns, nan_at=2, unused=True))
        return str(logger.log_dir)

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        log_dir = run(tmp)
        assert cb.engine is not None and cb.engine.log_dir == log_dir
        assert len(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))) == 1  # the logger's run, no second
        scalars = _scalars(log_dir)
        assert [s for s, _ in scalars["gradwatch/grad_norm/total"]] == [0, 1, 3, 4]  # step 2 is non-finite
        for tag in ("gradwatch/grad_norm/body", "gradwatch/grad_norm/head", "gradwatch/loss"):
            assert tag in scalars, sorted(scalars)
        # 0 at step 0 and repeated at step 1 (a step, not a ramp, at the skip), 1 at every step from step 2
        assert scalars["gradwatch/skipped_steps"] == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)]
        assert scalars["gradwatch/findings/none_grad"][0] == (0, 1.0)
        with open(os.path.join(log_dir, "gradwatch.jsonl"), encoding="utf-8") as fh:
            kinds = {json.loads(line).get("kind") for line in fh}
        assert {"none_grad", "nonfinite_loss", "nonfinite_grad"} <= kinds


def test_clip_ratio_is_logged_from_pre_clip_norms_into_log_dir(lightning_pytorch: Any, tmp_path: Any) -> None:
    csv = lightning_pytorch.loggers.CSVLogger(save_dir=str(tmp_path / "csv"))
    cb = GradWatchCallback(console=False, log_dir=tmp_path / "gw")
    trainer = tiny_trainer(lightning_pytorch, [cb], max_steps=4, gradient_clip_val=0.05, logger=csv)
    trainer.fit(tiny_module(lightning_pytorch))
    scalars = _scalars(str(tmp_path / "gw"))
    norms = dict(scalars["gradwatch/grad_norm/total"])
    ratios = dict(scalars["gradwatch/clip_ratio"])
    assert sorted(ratios) == [0, 1, 2, 3]
    for step, ratio in ratios.items():
        assert norms[step] > 0.05  # the pre-clip norm, not the clipped one
        assert ratio == pytest.approx(min(1.0, 0.05 / norms[step]), rel=1e-4)


def test_logger_false_writes_no_files(lightning_pytorch: Any, tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    cb = GradWatchCallback(console=False)
    tiny_trainer(lightning_pytorch, [cb], max_steps=2, default_root_dir=str(tmp_path)).fit(
        tiny_module(lightning_pytorch, unused=True)
    )
    assert [f.kind for f in cb.findings] == ["none_grad"]
    assert cb.engine is not None and cb.engine.log_dir is None
    assert os.listdir(tmp_path) == []


# -- console and progress bars ---------------------------------------------------------------------
@pytest.mark.parametrize("bar", ["RichProgressBar", "TQDMProgressBar"])
def test_findings_print_with_a_progress_bar(lightning_pytorch: Any, bar: str, capsys: Any) -> None:
    cb = GradWatchCallback(on_nonfinite="skip")  # rich's global console, as users get it
    progress = getattr(lightning_pytorch.callbacks, bar)()
    trainer = tiny_trainer(lightning_pytorch, [cb, progress], max_steps=4, enable_progress_bar=True)
    trainer.fit(tiny_module(lightning_pytorch, nan_at=1))
    captured = capsys.readouterr()
    assert trainer.global_step == 4
    assert "Epoch 0" in captured.out + captured.err  # the bar itself rendered
    assert any("nonfinite_grad" in k and step == 1 for k, step in panels(captured.out))
    assert "gradwatch skipped this update" in " ".join(captured.out.replace("│", " ").split())


# -- exceptions and teardown -----------------------------------------------------------------------
def test_hooks_are_removed_after_fit(lightning_pytorch: Any) -> None:
    cb = GradWatchCallback(console=False)
    model = tiny_module(lightning_pytorch)
    tiny_trainer(lightning_pytorch, [cb], max_steps=2).fit(model)
    assert model.opt is not None
    assert len(model.opt._optimizer_step_pre_hooks) == 0 and len(model.opt._optimizer_step_post_hooks) == 0
    assert cb.engine is not None and cb.engine.closed


def test_exception_in_training_closes_and_removes_hooks(lightning_pytorch: Any) -> None:
    anomaly = torch.is_anomaly_enabled()
    cb = GradWatchCallback(console=False)
    model = tiny_module(lightning_pytorch, raise_at=2)
    with pytest.raises(ValueError, match="broken batch"):
        tiny_trainer(lightning_pytorch, [cb], max_steps=4).fit(model)
    assert cb.engine is not None and cb.engine.closed
    assert model.opt is not None
    assert len(model.opt._optimizer_step_pre_hooks) == 0 and len(model.opt._optimizer_step_post_hooks) == 0
    assert torch.is_anomaly_enabled() == anomaly


# -- checkpoints -----------------------------------------------------------------------------------
def test_resume_from_checkpoint_keeps_counters(lightning_pytorch: Any, tmp_path: Any) -> None:
    first = GradWatchCallback(console=False)
    trainer = tiny_trainer(lightning_pytorch, [first], max_steps=4)
    trainer.fit(tiny_module(lightning_pytorch, nan_at=2))
    ckpt = str(tmp_path / "run.ckpt")
    trainer.save_checkpoint(ckpt)

    second = GradWatchCallback(console=False)
    resumed = tiny_trainer(lightning_pytorch, [second], max_steps=7)
    resumed.fit(tiny_module(lightning_pytorch), ckpt_path=ckpt)
    assert second.engine is not None
    assert second.engine.step_counts == [7]
    assert second.engine.steps_checked == 7
    assert second.engine.steps_skipped == 1
    assert {("nonfinite_loss", 2), ("nonfinite_grad", 2)} <= {(f.kind, f.step) for f in second.findings}
    assert {f.step for f in second.findings} == {2}  # restored from the first run, nothing new


def test_a_fit_resumed_into_the_same_log_dir_is_summarized_as_one_run(lightning_pytorch: Any, tmp_path: Any) -> None:
    from gradwatch.cli import summarize

    def logger() -> Any:  # the same directory for both fits: version_0
        return lightning_pytorch.loggers.TensorBoardLogger(str(tmp_path), name="pl", version=0)

    trainer = tiny_trainer(lightning_pytorch, [GradWatchCallback(console=False)], max_steps=4, logger=logger())
    trainer.fit(tiny_module(lightning_pytorch, nan_at=2))
    ckpt = str(tmp_path / "run.ckpt")
    trainer.save_checkpoint(ckpt)
    resumed = tiny_trainer(lightning_pytorch, [GradWatchCallback(console=False)], max_steps=7, logger=logger())
    resumed.fit(tiny_module(lightning_pytorch, nan_at=5), ckpt_path=ckpt)

    (report,) = summarize(str(tmp_path / "pl" / "version_0"), all_runs=True)
    assert len(report.runs_in_dir) == 1 and report.earlier_runs == 0
    assert report.skipped_steps == 2 and report.steps == 7
    steps = {k.kind: (k.first_step, k.last_step, k.count) for k in report.findings}
    assert steps["nonfinite_loss"] == (2, 5, 2)  # before and after the resume


def test_state_dict_round_trips_before_fit() -> None:
    cb = GradWatchCallback(console=False)
    state = {"steps_checked": 3, "steps_skipped": 1, "step_counts": [3]}
    cb.load_state_dict(state)
    assert cb.state_dict() == state
    assert cb.state_key == "GradWatchCallback"


# -- bad input -------------------------------------------------------------------------------------
def test_class_instead_of_instance_gets_a_clear_error(lightning_pytorch: Any) -> None:
    trainer = tiny_trainer(lightning_pytorch, [GradWatchCallback])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"got the class GradWatchCallback instead of an instance"):
        trainer.fit(tiny_module(lightning_pytorch))


def test_one_callback_in_two_running_trainers_is_an_error(lightning_pytorch: Any) -> None:
    cb = GradWatchCallback(console=False)
    inner_trainer = tiny_trainer(lightning_pytorch, [cb], max_steps=1)
    inner_error: list[BaseException] = []

    class NestedFit(lightning_pytorch.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            try:
                inner_trainer.fit(tiny_module(lightning_pytorch))
            except RuntimeError as e:
                inner_error.append(e)

    outer = tiny_trainer(lightning_pytorch, [cb, NestedFit()], max_steps=3)
    outer.fit(tiny_module(lightning_pytorch))
    assert len(inner_error) == 1
    assert "already attached to another Trainer" in str(inner_error[0])
    assert cb.engine is not None and cb.engine.steps_checked == 3  # the first run was not disturbed


def test_model_without_trainable_parameters_warns_once(lightning_pytorch: Any) -> None:
    cb = GradWatchCallback(console=False)
    model = tiny_module(lightning_pytorch, frozen=True, none_at=None)
    model.training_step = lambda batch, batch_idx: None  # nothing to backpropagate
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_trainer(lightning_pytorch, [cb], max_steps=2).fit(model)
    ours = [w for w in caught if "gradwatch" in str(w.message)]
    assert len(ours) == 1
    assert "has no trainable parameters" in str(ours[0].message)
    assert cb.engine is None and cb.findings == []


# https://lightning.ai/docs/pytorch/stable/common/optimization.html (stepping every other batch)
def test_nan_loss_on_a_batch_that_makes_no_step_does_not_skip_the_next_healthy_update() -> None:
    pl = lightning_namespace("lightning.pytorch")

    class EveryOther(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            return loss * float("nan") if batch_idx == 3 else loss

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any) -> None:
            if batch_idx % 2 == 0:
                optimizer.step(closure=optimizer_closure)
            else:
                optimizer_closure()  # loss and backward, no step: the next closure zeroes the gradients

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(8)]
    changed: dict[int, bool] = {}

    class Changes(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
            self.before = _params(pl_module)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            after = _params(pl_module)
            changed[i] = any(not torch.equal(after[k], self.before[k]) for k in after)

    cb = GradWatchCallback(console=False)
    trainer = tiny_trainer(pl, [Changes(), cb], max_steps=-1, max_epochs=1)
    trainer.fit(EveryOther(), torch.utils.data.DataLoader(data, batch_size=None))
    assert changed == {0: True, 1: False, 2: True, 3: False, 4: True, 5: False, 6: True, 7: False}
    assert cb.engine.steps_skipped == 0
    (f,) = cb.findings
    assert (f.kind, f.severity, f.data["no_update"]) == ("nonfinite_loss", "warning", True)


@pytest.mark.parametrize("bug", [True, False])
def test_manual_accumulation_with_zero_grad_in_every_batch_is_flagged(pl_ns: Any, bug: bool) -> None:
    # Manual optimization accumulating over 4 batches; the bug clears the gradients in every batch.
    class Accumulating(pl_ns.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(8, 1)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            if bug:
                opt.zero_grad()
            x, y = batch
            self.manual_backward(torch.nn.functional.mse_loss(self.net(x), y) / 4)
            if batch_idx % 4 == 3:
                opt.step()
                if not bug:
                    opt.zero_grad()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    from helpers import tiny_data

    cb = GradWatchCallback(console=False)
    tiny_trainer(pl_ns, [cb], max_steps=-1, max_epochs=1).fit(Accumulating(), tiny_data())
    found = [(f.kind, f.step, f.severity) for f in cb.findings]
    assert found == ([("zero_grad_in_accumulation", 0, "warning")] if bug else [])


def test_manual_gan_with_the_generator_accumulating_under_toggle_optimizer_is_silent(pl_ns: Any) -> None:
    # Must not flag (grads_span_other_step was reported on G): D steps every batch on its own loss, G
    # accumulates over 2 batches (manual_backward(g_loss / 2)), each phase inside toggle_optimizer.
    class Gan(pl_ns.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
            self.disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> None:
            x, _ = batch
            opt_g, opt_d = self.optimizers()
            bce = torch.nn.functional.binary_cross_entropy_with_logits
            ones, zeros = torch.ones(len(x), 1), torch.zeros(len(x), 1)
            z = torch.randn(len(x), 4)
            self.toggle_optimizer(opt_d)
            d_loss = bce(self.disc(x), ones) + bce(self.disc(self.gen(z).detach()), zeros)
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
            self.untoggle_optimizer(opt_d)
            self.toggle_optimizer(opt_g)
            self.manual_backward(bce(self.disc(self.gen(z)), ones) / 2)
            if batch_idx % 2 == 1:
                opt_g.step()
                opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)

        def configure_optimizers(self) -> Any:
            return (torch.optim.Adam(self.gen.parameters(), 2e-3), torch.optim.Adam(self.disc.parameters(), 2e-3))

    from helpers import tiny_data

    cb = GradWatchCallback(console=False)
    tiny_trainer(pl_ns, [cb], max_steps=-1, max_epochs=1).fit(Gan(), tiny_data())
    assert [f.kind for f in cb.findings if f.severity != "info"] == []


# Manual optimization stepping torch's optimizers directly (https://github.com/Lightning-AI/pytorch-lightning/issues/16143):
# Lightning's on_before_optimizer_step never runs; nothing was checked and the NaN reached the weights.
@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_manual_optimization_with_raw_optimizers_is_checked_and_the_nan_step_skipped(namespace: str) -> None:
    ns = lightning_namespace(namespace)
    cb = GradWatchCallback(console=False)
    model = manual_module(ns, nan_at=3, raw=True)
    trainer = tiny_trainer(ns, [cb], max_steps=-1, max_epochs=1, limit_train_batches=6)
    trainer.fit(model)
    kinds = {(f.kind, f.step) for f in cb.findings}
    assert ("nonfinite_loss", 3) in kinds, kinds
    assert cb.engine.steps_skipped == 2  # both optimizers' updates of that batch
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_sam_under_manual_optimization_is_watched_through_its_base_optimizer() -> None:
    from test_optimizer_setups import SAM

    class SamModule(pl.LightningModule):  # first_step / second_step, as in the issue above
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            x, y = batch
            if batch_idx == 3:
                x = x.clone()
                x[0, 0] = float("nan")
            self.manual_backward(torch.nn.functional.mse_loss(self.body(x), y))
            opt.first_step(zero_grad=True)
            self.manual_backward(torch.nn.functional.mse_loss(self.body(x), y))
            opt.second_step(zero_grad=True)

        def configure_optimizers(self) -> Any:
            return SAM(self.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)

        def train_dataloader(self) -> Any:
            from helpers import tiny_data

            return tiny_data()

    cb = GradWatchCallback(console=False)
    model = SamModule()
    tiny_trainer(pl, [cb], max_steps=-1, max_epochs=1, limit_train_batches=6).fit(model)
    assert ("nonfinite_grad", 3) in {(f.kind, f.step) for f in cb.findings}, [(f.kind, f.step) for f in cb.findings]
    assert cb.engine.steps_skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())  # SAM restores the weights, gradwatch skips


def test_callback_with_a_console_object_pickles_for_ddp_spawn(lightning_pytorch: Any, tmp_path: Any) -> None:
    # strategy="ddp_spawn" pickles the callbacks for its processes: a rich Console (it holds a lock) made
    # fit() raise "cannot pickle '_thread.RLock' object" before training started.
    import pickle

    from rich.console import Console

    cb = GradWatchCallback(console=Console(stderr=True), on_nonfinite="skip", log_dir=str(tmp_path))
    trainer = tiny_trainer(lightning_pytorch, [cb], max_steps=3)
    trainer.fit(tiny_module(lightning_pytorch, nan_at=1))
    copy = pickle.loads(pickle.dumps(cb))
    assert copy.config.console is True and copy.engine is None
    assert copy.config.on_nonfinite == "skip" and copy.config.log_dir == str(tmp_path)
    again = tiny_trainer(lightning_pytorch, [copy], max_steps=3)  # the copy watches a run of its own
    again.fit(tiny_module(lightning_pytorch, nan_at=1))
    assert [(f.kind, f.step) for f in copy.findings if f.kind == "nonfinite_grad"] == [("nonfinite_grad", 1)]


def _spiking_module(ns: Any, clip_override: bool = False) -> Any:
    class Spiking(ns.LightningModule):  # type: ignore[misc,name-defined]
        """Healthy regression, then one batch whose loss is 1e5x (a spiky batch) at batch 30."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            return loss * 1e5 if self.global_step == 30 else loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            from helpers import tiny_data

            return tiny_data(n=320)

        if clip_override:
            def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                            gradient_clip_algorithm: Any = None) -> None:
                if self.current_epoch >= 0:  # the Lightning docs' example clips after a warm-up epoch
                    self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                                        gradient_clip_algorithm=gradient_clip_algorithm)

    return Spiking()


@pytest.mark.parametrize("clipping", ["norm", "value", "override", "none"])
def test_exploding_grad_and_loss_spike_under_lightning_clipping_say_it_is_in_place(lightning_pytorch: Any,
                                                                                   clipping: str) -> None:
    # With Trainer(gradient_clip_val=...) both findings told the user to add clipping, and that the update
    # threw the weights far, although Lightning had scaled it down to gradient_clip_val.
    ns = lightning_pytorch
    kwargs: dict[str, Any] = {"max_steps": 32}
    if clipping != "none":
        kwargs["gradient_clip_val"] = 0.3
    if clipping == "value":
        kwargs["gradient_clip_algorithm"] = "value"
    cb = GradWatchCallback(console=False)
    tiny_trainer(ns, [cb], **kwargs).fit(_spiking_module(ns, clip_override=clipping == "override"))
    found = {f.kind: f for f in cb.findings}
    assert {"exploding_grad", "loss_spike"} <= set(found), [(f.kind, f.step) for f in cb.findings]
    for kind in ("exploding_grad", "loss_spike"):
        f = found[kind]
        assert f.step == 30
        why, fix = f.message.split("Why it matters:")[1].split("Fix:")
        assert "clip_grad_norm_" not in f.message
        if clipping == "none":
            assert "Trainer(gradient_clip_val=1.0)" in fix
        else:
            assert "clipping is in place" in fix and fix.index("learning rate") < fix.index("batch")
            assert {"norm": "scaled this step's gradient down", "value": "+-0.3",
                    "override": "configure_gradient_clipping"}[clipping] in why
            assert "throws the weights far" not in why
