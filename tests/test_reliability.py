"""gradwatch never hurts the run: its own failures are isolated, and attaching/closing leaves no trace.

Faults are injected into gradwatch's own parts (its reporters, checks, log files and streams), never by
mocking torch. Each test checks that training finishes with the parameters an unwatched run would have,
that the findings are still in memory, and that each broken part is reported once.
"""

from __future__ import annotations

import glob
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import kinds, panels
from rich.console import Console
from torch import nn

import gradwatch
from gradwatch import GradWatchInternalWarning
from gradwatch.report.jsonl import FILENAME, is_finding, read_jsonl
from gradwatch.report.tensorboard import TensorBoardReporter

STEPS = 6
NAN_AT = 3


class Net(nn.Module):
    """Two layers in use and one that forward never uses (a ``none_grad`` finding at step 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def make(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batches(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 4, generator=g) for _ in range(STEPS)]


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    gw: Any = None,
    *,
    nan_at: int | None = NAN_AT,
    between: Callable[[int], None] | None = None,
) -> None:
    """The training loop. Without a watcher the NaN step is not applied (what "skip" must reproduce)."""
    for step, x in enumerate(batches()):
        loss = model(x).pow(2).mean()
        if step == nan_at:
            loss = loss * float("nan")
        if gw is not None:
            gw.observe_loss(loss)
        opt.zero_grad()
        loss.backward()
        if gw is not None or step != nan_at:
            opt.step()
        if between is not None:
            between(step)


def reference_params(nan_at: int | None = NAN_AT) -> list[torch.Tensor]:
    model, opt = make()
    train(model, opt, nan_at=nan_at)
    return [p.detach().clone() for p in model.parameters()]


def assert_same_params(model: nn.Module, expected: list[torch.Tensor]) -> None:
    for (name, p), q in zip(model.named_parameters(), expected):
        assert torch.equal(p, q), f"{name} differs from the unwatched run"


#: The findings gradwatch must keep in memory whatever breaks (other kinds, e.g. from escalation, may
#: come along; :func:`healthy_kinds` gives the full list of a run where nothing of gradwatch is broken).
EXPECTED = [("none_grad", 0), ("nonfinite_loss", NAN_AT), ("nonfinite_grad", NAN_AT)]
_HEALTHY: list[tuple[str, int]] = []


def healthy_kinds() -> list[tuple[str, int]]:
    """The findings of the same run with every part of gradwatch working."""
    if not _HEALTHY:
        model, opt = make()
        with gradwatch.watch(model, opt, console=False) as gw:
            train(model, opt, gw)
        assert all(k in kinds(gw) for k in EXPECTED), kinds(gw)
        _HEALTHY.extend(kinds(gw))
    return list(_HEALTHY)


def internal_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, GradWatchInternalWarning)]


@pytest.fixture
def record() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def text_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=120, color_system=None), buf


class FullDiskFile(io.StringIO):
    """A stream whose every write fails like a full disk."""

    def write(self, s: str) -> int:
        raise OSError(28, "No space left on device")


def closed_stream() -> io.StringIO:
    s = io.StringIO()
    s.close()
    return s


# -- fault isolation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [FullDiskFile, closed_stream], ids=["full-disk", "closed"])
def test_broken_console_stream_is_reported_once_and_training_finishes(stream, record) -> None:
    model, opt = make()
    with gradwatch.watch(model, opt, console=Console(file=stream(), width=120)) as gw:
        train(model, opt, gw)
    assert_same_params(model, reference_params())
    assert kinds(gw) == healthy_kinds()
    messages = internal_warnings(record)
    assert len(messages) == 1 and "ConsoleReporter" in messages[0], messages


def test_closed_stdout_with_the_global_console_does_not_stop_training(monkeypatch, record) -> None:
    monkeypatch.setattr(sys, "stdout", closed_stream())
    model, opt = make()
    with gradwatch.watch(model, opt, console=True) as gw:
        train(model, opt, gw)
    assert_same_params(model, reference_params())
    assert kinds(gw) == healthy_kinds()
    assert len(internal_warnings(record)) == 1


def test_log_dir_that_cannot_be_created_warns_once_and_console_keeps_reporting(tmp_path, record) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    log_dir = blocker / "runs"
    console, buf = text_console()
    model, opt = make()
    with gradwatch.watch(model, opt, console=console, log_dir=str(log_dir)) as gw:
        train(model, opt, gw)
    assert_same_params(model, reference_params())
    assert kinds(gw) == healthy_kinds()
    assert gw.log_dir is None
    messages = internal_warnings(record)
    assert len([m for m in messages if "cannot write logs" in m and str(log_dir) in m]) == 1, messages
    assert all(str(log_dir) in m for m in messages), messages  # nothing else of gradwatch broke
    assert any("nonfinite_grad" in k and step == NAN_AT for k, step in panels(buf.getvalue()))


def test_log_dir_removed_mid_run_is_recreated_with_one_warning(tmp_path, record, capfd) -> None:
    log_dir = tmp_path / "run"
    model, opt = make()
    gw = gradwatch.watch(model, opt, console=False, log_dir=str(log_dir), tb_flush_every=1)
    tb = gw.engine.reporters.of_type(TensorBoardReporter)

    def remove_logs(step: int) -> None:
        if step == 1:
            tb.flush()  # nothing of steps 0-1 still on its way to the files
            shutil.rmtree(log_dir)

    train(model, opt, gw, between=remove_logs)
    gw.close()
    assert_same_params(model, reference_params())
    assert kinds(gw) == healthy_kinds()
    messages = internal_warnings(record)
    assert len(messages) == 1 and "removed during the run" in messages[0], messages
    assert [(r["kind"], r["step"]) for r in read_jsonl(str(log_dir / FILENAME)) if is_finding(r)] == [
        k for k in healthy_kinds() if k[1] > 1
    ]
    assert glob.glob(str(log_dir / "events.out.tfevents.*"))
    assert "Traceback" not in capfd.readouterr().err


def test_full_disk_under_the_tensorboard_writer_is_reported_once(tmp_path, record) -> None:
    log_dir = tmp_path / "run"
    model, opt = make()
    gw = gradwatch.watch(model, opt, console=False, log_dir=str(log_dir), tb_flush_every=1)
    tb = gw.engine.reporters.of_type(TensorBoardReporter)

    def fill_disk(step: int) -> None:
        if step == 0:
            tb.flush()
            (events,) = glob.glob(str(log_dir / "events.out.tfevents.*"))
            os.remove(events)
            os.symlink("/dev/full", events)  # every later append fails with ENOSPC

    train(model, opt, gw, between=fill_disk)
    gw.close()
    assert_same_params(model, reference_params())
    assert kinds(gw) == healthy_kinds()
    messages = internal_warnings(record)
    assert len(messages) == 1 and "TensorBoardReporter" in messages[0], messages
    # The rest of gradwatch keeps working: the JSON lines still get every finding.
    assert [(r["kind"], r["step"]) for r in read_jsonl(str(log_dir / FILENAME)) if is_finding(r)] == healthy_kinds()


def test_full_disk_under_gradwatch_jsonl_is_reported_once(tmp_path, record) -> None:
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    os.symlink("/dev/full", log_dir / FILENAME)
    console, buf = text_console()
    model, opt = make()
    with gradwatch.watch(model, opt, console=console, log_dir=str(log_dir)) as gw:
        train(model, opt, gw)
    assert_same_params(model, reference_params())
    assert kinds(gw) == healthy_kinds()
    messages = internal_warnings(record)
    assert len(messages) == 1 and "JsonlReporter" in messages[0], messages
    assert any("nonfinite_grad" in k and step == NAN_AT for k, step in panels(buf.getvalue()))


class ExplodingReporter:
    def finding(self, finding: Any) -> None:
        raise RuntimeError("reporter bug")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        raise RuntimeError("reporter bug")

    def close(self, summary: Any) -> None:
        raise RuntimeError("reporter bug")


def test_reporter_that_raises_is_reported_once_and_the_others_keep_working(record) -> None:
    console, buf = text_console()
    model, opt = make()
    with gradwatch.watch(model, opt, console=console) as gw:
        gw.engine.reporters.items.append(ExplodingReporter())
        train(model, opt, gw)
    assert_same_params(model, reference_params())
    assert kinds(gw) == healthy_kinds()
    messages = internal_warnings(record)
    assert len(messages) == 1 and "ExplodingReporter" in messages[0], messages
    assert any("nonfinite_grad" in k and step == NAN_AT for k, step in panels(buf.getvalue()))
    assert "gradwatch summary" in buf.getvalue()


def test_check_that_raises_is_reported_once_and_skip_still_protects_the_weights(record) -> None:
    def broken_check(stats: Any, history: Any, config: Any) -> list[Any]:
        raise ZeroDivisionError("check bug")

    def broken_remember(stats: Any, history: Any) -> None:
        raise KeyError("check bug")

    model, opt = make()
    with gradwatch.watch(model, opt, console=False) as gw:
        gw.engine._check_modules.append(("broken", broken_check, broken_remember))
        train(model, opt, gw)
    assert_same_params(model, reference_params())
    assert kinds(gw) == healthy_kinds()
    messages = internal_warnings(record)
    assert len(messages) == 1 and "check broken" in messages[0], messages


def test_each_run_reports_its_own_internal_failures(record) -> None:
    for _ in range(2):
        model, opt = make()
        with gradwatch.watch(model, opt, console=Console(file=closed_stream())) as gw:
            train(model, opt, gw)
    assert len(internal_warnings(record)) == 2


# -- the user's exceptions ---------------------------------------------------------------------------


def test_exception_in_the_training_loop_propagates_unchanged_and_closes_the_watcher() -> None:
    model, opt = make()
    error = ValueError("bad batch")

    def user_code(step: int) -> None:
        if step == 2:
            raise error

    with pytest.raises(ValueError) as info:
        with gradwatch.watch(model, opt, console=False) as gw:
            train(model, opt, gw, between=user_code)
    assert info.value is error
    assert gw.closed
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_exception_in_a_closure_propagates_from_optimizer_step() -> None:
    model, _ = make()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)

    def closure() -> torch.Tensor:
        raise OSError("data loader died")

    with gradwatch.watch(model, opt, console=False) as gw:
        with pytest.raises(OSError, match="data loader died"):
            opt.step(closure)
    assert gw.findings == []


# -- lifecycle ---------------------------------------------------------------------------------------


def test_close_twice_and_exit_after_close_print_one_summary() -> None:
    console, buf = text_console()
    model, opt = make()
    with gradwatch.watch(model, opt, console=console) as gw:
        train(model, opt, gw)
        gw.close()
        gw.close()
    assert buf.getvalue().count("gradwatch summary") == 1


def test_new_watcher_on_the_same_model_and_optimizer_after_close() -> None:
    model, opt = make()
    first = gradwatch.watch(model, opt, console=False)
    train(model, opt, first, nan_at=None)
    first.close()
    before = list(first.findings)
    with gradwatch.watch(model, opt, console=False) as second:
        train(model, opt, second, nan_at=2)
    assert first.findings == before
    assert [(f.kind, f.step) for f in second.findings if f.kind in ("nonfinite_loss", "nonfinite_grad")] == [
        ("nonfinite_loss", 2),
        ("nonfinite_grad", 2),
    ]


def test_two_watchers_on_two_models_do_not_interfere() -> None:
    model_a, opt_a = make(seed=0)
    torch.manual_seed(1)
    model_b = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt_b = torch.optim.Adam(model_b.parameters(), lr=0.01)
    torch.manual_seed(1)
    ref_b = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ref_opt_b = torch.optim.Adam(ref_b.parameters(), lr=0.01)
    gw_a = gradwatch.watch(model_a, opt_a, console=False)
    gw_b = gradwatch.watch(model_b, opt_b, console=False)
    for step, x in enumerate(batches()):  # interleaved: a NaN in A's step must touch nothing of B's
        loss_a = model_a(x).pow(2).mean() * (float("nan") if step == NAN_AT else 1.0)
        gw_a.observe_loss(loss_a)
        opt_a.zero_grad()
        loss_a.backward()
        for m, o, gw in ((model_b, opt_b, gw_b), (ref_b, ref_opt_b, None)):
            loss_b = m(x).pow(2).mean()
            if gw is not None:
                gw.observe_loss(loss_b)
            o.zero_grad()
            loss_b.backward()
            o.step()
        opt_a.step()
    gw_b.close()
    gw_a.close()
    assert kinds(gw_a) == healthy_kinds()
    assert gw_b.findings == []
    assert_same_params(model_a, reference_params())
    assert_same_params(model_b, [p.detach().clone() for p in ref_b.parameters()])


def hook_counts(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Every hook registry gradwatch could touch: optimizer, modules, parameters, and the global ones."""
    from torch.nn.modules import module as mod

    counts: dict[str, int] = {}
    for attr in dir(opt):
        if attr.startswith("_optimizer_") and attr.endswith("_hooks"):
            counts[f"opt.{attr}"] = len(getattr(opt, attr))
    for name, m in model.named_modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
            counts[f"{name}.{attr}"] = len(getattr(m, attr))
    for name, p in model.named_parameters():
        counts[f"{name}._backward_hooks"] = len(p._backward_hooks or {})
        counts[f"{name}._post_accumulate_grad_hooks"] = len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    for attr in dir(mod):
        if attr.startswith("_global_") and attr.endswith("_hooks"):
            counts[f"global.{attr}"] = len(getattr(mod, attr))
    counts["anomaly_mode"] = int(torch.is_anomaly_enabled())
    return counts


def test_close_leaves_no_hook_behind() -> None:
    model, opt = make()
    before = hook_counts(model, opt)
    with gradwatch.watch(model, opt, console=False) as gw:
        train(model, opt, gw)  # a healthy run with a NaN incident exercises every path
        during = hook_counts(model, opt)
    assert during != before  # the comparison can see gradwatch's hooks
    assert hook_counts(model, opt) == before


def test_model_trains_as_if_never_watched_after_close() -> None:
    model, opt = make()
    with gradwatch.watch(model, opt, console=False) as gw:
        train(model, opt, gw, nan_at=None)
    train(model, opt, nan_at=None)
    reference, ref_opt = make()
    train(reference, ref_opt, nan_at=None)
    train(reference, ref_opt, nan_at=None)
    assert_same_params(model, [p.detach().clone() for p in reference.parameters()])


def test_after_close_a_nan_update_is_applied_as_without_gradwatch() -> None:
    model, opt = make()
    with gradwatch.watch(model, opt, console=False):
        pass
    loss = model(batches()[0]).pow(2).mean() * float("nan")
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert torch.isnan(model.head.weight).all()


def test_skip_after_a_failed_closure_step_keeps_the_current_optimizer_state() -> None:
    """A closure that raised must leave nothing behind that a later skipped step could restore."""

    def broken_closure() -> torch.Tensor:
        raise OSError("loader died")

    def run(watched: bool) -> list[torch.Tensor]:
        model, _ = make()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        gw = gradwatch.watch(model, opt, console=False) if watched else None
        for step, x in enumerate(batches()):
            loss = model(x).pow(2).mean() * (float("nan") if step == 4 else 1.0)
            opt.zero_grad()
            loss.backward()
            if step == 1:
                with pytest.raises(OSError):
                    opt.step(broken_closure)
            if watched or step != 4:
                opt.step()
        if gw is not None:
            gw.close()
        return [p.detach().clone() for p in model.parameters()] + [
            t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        ]

    watched, reference = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(watched, reference))


def test_tensorboard_writer_closed_mid_run_keeps_logging(tmp_path, record) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "run"
    model, opt = make()
    gw = gradwatch.watch(model, opt, console=False, log_dir=str(log_dir))
    tb = gw.engine.reporters.of_type(TensorBoardReporter)

    def close_writer(step: int) -> None:
        if step == 1:
            tb.flush()
            tb.writer.close()  # e.g. another library finalising the writer it shares

    train(model, opt, gw, between=close_writer)
    gw.close()
    assert_same_params(model, reference_params())
    assert kinds(gw) == healthy_kinds()
    assert internal_warnings(record) == []
    steps = set()
    for path in glob.glob(str(log_dir / "events.out.tfevents.*")):
        acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0}).Reload()
        if "gradwatch/grad_norm/total" in acc.Tags()["scalars"]:
            steps |= {e.step for e in acc.Scalars("gradwatch/grad_norm/total")}
    assert steps == set(range(STEPS)) - {NAN_AT}  # a NaN norm is left out of the charts


def test_gradients_after_each_step_are_the_ones_backward_produced() -> None:
    """gradwatch only reads gradients: after every step, including a skipped one, they are untouched."""

    def grads_after_each_step(watched: bool) -> list[list[torch.Tensor]]:
        model, opt = make()
        gw = gradwatch.watch(model, opt, console=False) if watched else None
        seen: list[list[torch.Tensor]] = []

        def keep(step: int) -> None:
            seen.append([p.grad.clone() for p in model.parameters() if p.grad is not None])

        train(model, opt, gw, between=keep)
        if gw is not None:
            gw.close()
        return seen

    watched, reference = grads_after_each_step(True), grads_after_each_step(False)
    assert [len(g) for g in watched] == [len(g) for g in reference] == [4] * STEPS
    for a, b in zip(watched, reference):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)  # bit-identical, NaN included


def test_own_warning_from_another_thread_during_a_replay_is_not_lost(record) -> None:
    """An incident replay records warnings process-wide (anomaly mode's noise); a gradwatch warning issued
    meanwhile by another thread (its TensorBoard writer) must still reach the user."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)
            self.engine: Any = None
            self.bad = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.engine is not None and self.engine.replaying:
                t = threading.Thread(target=warnings.warn, args=("from the writer thread", GradWatchInternalWarning))
                t.start()
                t.join()
            out = self.lin(x)
            return torch.sqrt(out - 100.0) if self.bad else out

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradwatch.watch(model, opt, console=False) as gw:
        model.engine = gw.engine
        for step in range(3):
            model.bad = step == 2  # sqrt of a negative: a NaN born in the model, localized by a replay
            loss = model(torch.randn(8, 4)).pow(2).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert any(f.kind == "nan_origin" for f in gw.findings)  # the step was replayed
    assert "from the writer thread" in internal_warnings(record)


# -- the user's own random streams ---------------------------------------------------------------------
_RANDOM_STREAMS = r"""
import random, sys
import numpy as np
import torch
from torch import nn
import gradwatch

class LayerDrop(nn.Module):  # draws from Python's random in forward (a replay would draw again)
    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(2, 2)
    def forward(self, x):
        h = self.a(x)
        return self.b(h if random.random() < 0.9 else h * 0.5)

def run(watched, nan_at):
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    model = LayerDrop()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = gradwatch.watch(model, opt) if watched else None
    for step in range(6):
        x = torch.randn(8, 4) * random.uniform(0.5, 1.5) * float(np.random.uniform(0.5, 1.5))  # augmentation
        if step == nan_at:
            x[0, 0] = 1e30  # finite input, inf loss: the step is replayed to find where

        loss = model(x).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    kinds = sorted({f.kind for f in gw.findings}) if gw else []
    if gw:
        gw.close()
    return random.random(), float(np.random.uniform()), kinds

assert "rich.style" not in sys.modules
for nan_at in (-1, 2):
    plain, watched = run(False, nan_at), run(True, nan_at)
    assert watched[:2] == plain[:2], (nan_at, plain, watched)
    assert ("none_grad" in watched[2]) and ((nan_at < 0) or "nan_origin" in watched[2]), watched
print("ok")
"""


def test_printing_and_replays_leave_the_users_random_streams_alone(tmp_path: Any) -> None:
    # rich's first import (at the first printed finding) drew from Python's random: a seeded run that
    # samples with random (replay buffers, augmentation) took other samples than the unwatched run from
    # then on. A replay of a forward that draws from random drew again. A fresh process: rich unloaded.
    script = tmp_path / "streams.py"
    script.write_text(_RANDOM_STREAMS)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


BROKEN_STREAMS_WORKER = os.path.join(os.path.dirname(__file__), "_broken_streams_worker.py")


@pytest.mark.parametrize("stream", ["closed", "broken-pipe"])
@pytest.mark.parametrize("integration", ["plain", "lightning"])
def test_broken_stdout_and_stderr_never_reach_the_training_loop(tmp_path, integration: str, stream: str) -> None:
    # gradwatch's console print fails, and so does the warning that reports it (Python writes warnings to
    # sys.stderr): in a process of its own, where warnings are shown as in a user's script, not recorded.
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    proc = subprocess.run(
        [sys.executable, BROKEN_STREAMS_WORKER, integration, stream, str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["error"] is None, result["error"]
    assert result["same_weights"] is True
