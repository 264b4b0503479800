"""TensorBoard reporter: scalars under ``gradwatch/``, findings as text.

Scalars of one step are written as a single event with many values, built on a background thread, so
the training thread only appends a tuple of floats to a list, handed to that thread every
``HANDOFF_STEPS`` steps (and at every flush and at close). Non-finite values are left out of the
scalars (they would break charts); the number of non-finite gradients is logged instead. The dashboard's
own series (incident markers, running totals drawn as steps, one-line-per-run summaries of the per-layer
scalars) are derived on that thread too (:class:`gradwatch.report.dashboard.ChartSeries`).
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Finding
from gradwatch.report import dir_identity, recreate_log_dir
from gradwatch.report.dashboard import ChartSeries, DashboardWriter

_STOP = object()
#: Steps of scalars handed to the writer thread at once: one wake-up (and GIL hand-over) per batch.
HANDOFF_STEPS = 16


class TensorBoardReporter(DashboardWriter):
    """Writes into a ``SummaryWriter``: its own (from ``log_dir``) or one it is handed (Lightning's).

    Args:
        log_dir: Directory for a new writer; ignored when ``writer`` is given.
        writer: An existing ``torch.utils.tensorboard.SummaryWriter`` to write into (not closed by us).
        flush_every: Flush to disk every N scalar events.
    """

    def __init__(self, log_dir: str | None = None, writer: Any = None, flush_every: int = 50) -> None:
        self._owns_writer = writer is None
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=log_dir)
        self.writer = writer
        self.log_dir: str = str(getattr(writer, "log_dir", None) or writer.get_logdir())
        self._dir_identity = dir_identity(self.log_dir)
        self.flush_every = flush_every
        self._events = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: list[tuple[int, dict[str, float], float]] = []
        self._handoff = max(1, min(HANDOFF_STEPS, flush_every))
        self._series = ChartSeries()  # the dashboard's derived series, kept on the writer thread
        self._thread = threading.Thread(target=self._run, name="gradwatch-tensorboard", daemon=True)
        self._thread.start()
        self._closed = False

    # -- training thread ---------------------------------------------------------------------------
    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self._closed:
            self._pending.append((step, values, time.time()))
            if len(self._pending) >= self._handoff:
                self._hand_off()

    def _hand_off(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self._queue.put(batch)

    def finding(self, finding: Finding) -> None:
        if not self._closed:
            self._queue.put(lambda w: w.add_text("gradwatch/findings", _markdown(finding), finding.step))

    def submit(self, fn: Callable[[Any], None]) -> None:
        """Run ``fn(writer)`` on the writer thread (custom layouts, histograms, ...)."""
        if not self._closed:
            self._queue.put(fn)

    def event_files(self) -> list[str]:
        """The name of the event file this reporter's writer writes (none when it cannot be told)."""
        try:
            name = self.writer._get_file_writer().event_writer._file_name  # torch's SummaryWriter
        except Exception:  # noqa: BLE001 - another writer (tensorboardX): the summary matches files by time
            return []
        return [os.path.basename(str(name))] if name else []

    def flush(self, timeout: float = 10.0) -> None:
        """Block until everything queued so far is written to disk."""
        if self._closed:
            return
        done = threading.Event()
        self._hand_off()

        def _flush(w: Any) -> None:
            try:
                w.flush()
            finally:  # a broken writer must not keep the training thread waiting
                done.set()

        self._queue.put(_flush)
        done.wait(timeout)

    def close(self, summary: Any = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._hand_off()
        self._queue.put(_STOP)
        self._thread.join(timeout=30)
        try:
            if self._owns_writer:
                self._ensure_log_dir()
                self.writer.close()
            else:
                self.writer.flush()
        except Exception as exc:  # noqa: BLE001
            internal_warning("TensorBoardReporter.close", exc, owner=self, key="TensorBoardReporter")

    # -- writer thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                if self._owns_writer:
                    self._ensure_log_dir()
                if callable(item):
                    item(self.writer)
                else:
                    for step, values, walltime in item:
                        for at, derived in self._series.derive(step, values):
                            self._write_scalars(at, derived, walltime)
            except Exception as exc:  # noqa: BLE001 - the writer thread must survive a full disk
                try:
                    where = "TensorBoardReporter (writer thread)"
                    internal_warning(where, exc, owner=self, key="TensorBoardReporter")
                except Exception:  # noqa: BLE001 - warnings turned into errors must not kill the thread
                    pass

    def _ensure_log_dir(self) -> None:
        # TensorBoard appends to its event file by path: a log_dir removed during the run would kill its
        # writer thread (with a traceback on stderr). One stat per event, on this thread, avoids that.
        if not os.path.isdir(self.log_dir):
            recreate_log_dir(self.log_dir, self._dir_identity)

    def _write_scalars(self, step: int, values: dict[str, float], walltime: float | None = None) -> None:
        finite = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
        if not finite:
            return
        file_writer = getattr(self.writer, "_get_file_writer", None)
        if file_writer is not None:
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in finite.items()])
            file_writer().add_summary(summary, step, walltime)
        else:  # tensorboardX or another writer: the public path
            for k, v in finite.items():
                self.writer.add_scalar(k, v, step, walltime=walltime)
        self._events += 1
        if self._events % self.flush_every == 0:
            self.writer.flush()


def _markdown(f: Finding) -> str:
    lines = [f"**{f.severity}: {f.kind}** at step {f.step}"]
    if f.where:
        lines.append(f"*where:* {f.where}")
    lines.append("")
    lines.extend(f.message.splitlines())
    if f.params:
        lines.append("")
        lines.append("parameters: " + ", ".join(f"`{p}`" for p in f.params[:20]))
    return "  \n".join(lines)
