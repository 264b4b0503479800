"""Report: a TensorBoard dashboard that opens ready, and optional gradient histograms.

:class:`Dashboard` is an extension attached for both integrations. When the run logs to TensorBoard it

- writes a **"gradwatch" layout into the Custom Scalars tab** at the first checked step (:data:`CHARTS`),
  one question per chart at TensorBoard's default settings (smoothing 0.6, outliers ignored in the y
  range), one or two lines per run: total gradient norm and loss, each with a marker at the steps where
  something happened; the spread of the per-layer gradient norms; the median update / weight ratio; skipped
  updates so far; findings so far, stacked by kind. The series the charts need beyond the engine's scalars
  are derived on the TensorBoard writer thread (:class:`ChartSeries`). TensorBoard keeps one layout per run (the last one written wins), so a layout already in the
  run's event files (e.g. written by you before training) is read back and merged: your categories
  first, then ours. A layout you write *after* the first step replaces ours; to keep both, include
  :func:`layout` in yours: ``writer.add_custom_scalars({**your_layout, **gradwatch.report.dashboard.layout()})``.
- with ``histogram_every=N`` (off by default: ``add_histogram`` costs ~22 ms per million values), writes
  ``gradwatch/grad_hist/<layer>`` every N checked steps. NaN/Inf values are filtered out (an all-NaN
  tensor would make ``add_histogram`` raise) and counted in ``gradwatch/grad_hist_nonfinite/<layer>``.

All writing happens on the TensorBoard reporter's writer thread (``submit``); the training thread only
queues a copy of the gradients on their own device (no device-to-host sync).
"""

from __future__ import annotations

import glob
import math
import os
import re
import statistics
from collections.abc import Callable
from typing import Any

import torch

from gradwatch.core.stats import layer_key

#: Title of the Custom Scalars category gradwatch writes.
CATEGORY = "gradwatch"

#: Chart title -> tag regular expressions (TensorBoard matches them with Python's ``re.match``). One
#: question per chart, one scale per chart, a line or two per run (per-layer detail is in the Scalars tab).
#: Counts are running totals (smoothing only delays their steps); findings are stacked so that kinds found
#: at the same step stay apart; ``gradwatch/incidents/*`` are markers, written only at steps with a finding,
#: a skipped update or a NaN/Inf, near the top of the line's usual range (:class:`ChartSeries`).
CHARTS: dict[str, list[str]] = {
    "gradient norm (total)": [r"gradwatch/grad_norm/total(_opt\d+)?$", r"gradwatch/incidents/grad_norm(_opt\d+)?$"],
    "loss": [r"gradwatch/loss(_opt\d+)?$", r"gradwatch/incidents/loss(_opt\d+)?$"],
    "layer gradient spread (largest / smallest layer norm)": [r"gradwatch/layer_norm_spread$"],
    "update / weight ratio (median layer)": [r"gradwatch/update_ratio_median$"],
    "skipped updates (running total)": [r"gradwatch/skipped_steps$"],
    "findings so far, stacked by kind": [r"gradwatch/findings_stacked/.*"],
}

#: Scalars written by the engine as running totals (drawn as steps: the old value is repeated at the step
#: before a change, so a chart shows a step, not a ramp from the last written point).
_RUNNING_TOTALS = ("gradwatch/skipped_steps", "gradwatch/findings/")
_FINDINGS = "gradwatch/findings/"
_STACKED = "gradwatch/findings_stacked/"
#: Running totals written at every step once above zero (the engine writes counters when they change).
_CARRIED = ("gradwatch/skipped_steps", _STACKED)
_LINE = re.compile(r"gradwatch/(grad_norm/total|loss)(_opt\d+)?$")
_LAYER_NORM = re.compile(r"gradwatch/grad_norm/(?!total(_opt\d+)?$)")

_CONFIG_TAG = "custom_scalars__config__"


def layout() -> dict[str, dict[str, list[Any]]]:
    """gradwatch's Custom Scalars layout in ``SummaryWriter.add_custom_scalars`` form.

    Example:
        >>> list(layout()["gradwatch"])[0]
        'gradient norm (total)'
    """
    return {CATEGORY: {title: ["Multiline", list(tags)] for title, tags in CHARTS.items()}}


def layout_proto() -> Any:
    """gradwatch's layout as a ``tensorboard`` ``Layout`` protocol buffer (one category)."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    charts = [
        layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=tags))
        for title, tags in CHARTS.items()
    ]
    return layout_pb2.Layout(category=[layout_pb2.Category(title=CATEGORY, chart=charts)])


def read_layout(log_dir: str) -> Any | None:
    """The last Custom Scalars layout written in the event files directly in ``log_dir`` (or None)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.plugins.custom_scalar import layout_pb2

    found = None
    for path in sorted(glob.glob(os.path.join(glob.escape(log_dir), "*tfevents*")), key=_event_file_order):
        try:
            for raw in RawEventFileLoader(path).Load():
                if _CONFIG_TAG.encode() not in raw:
                    continue  # cheap pre-filter: most events are scalars
                event = Event.FromString(raw)
                for v in event.summary.value:
                    if v.tag == _CONFIG_TAG and v.tensor.string_val:
                        found = layout_pb2.Layout.FromString(v.tensor.string_val[0])
        except Exception:  # noqa: BLE001 - a torn file being written: use what was read
            continue
    return found


def _event_file_order(path: str) -> tuple[int, int, str]:
    """Creation order of ``events.out.tfevents.<time>.<host>.<pid>.<n>`` files: by time, then by the
    process's writer counter as a number (as text, writer 10 sorts before writer 9)."""
    parts = os.path.basename(path).split(".")
    try:
        when = int(parts[parts.index("tfevents") + 1])
    except (ValueError, IndexError):
        when = 0
    last = parts[-1]
    return when, int(last) if last.isdigit() else 0, path


def merge_layouts(existing: Any | None, ours: Any) -> Any:
    """``existing`` categories first (kept as they are), then ours unless a category of that title exists.

    A category of our title whose charts all draw ``gradwatch/`` tags only was written by gradwatch (an
    earlier version, in a run resumed into the same directory): ours replaces it where it stands.
    """
    from tensorboard.plugins.custom_scalar import layout_pb2

    mine = {c.title: c for c in ours.category}
    merged = layout_pb2.Layout()
    titles: set[str] = set()
    if existing is not None:
        for c in existing.category:
            merged.category.add().CopyFrom(mine[c.title] if c.title in mine and _written_by_gradwatch(c) else c)
            titles.add(c.title)
    for c in ours.category:
        if c.title not in titles:
            merged.category.add().CopyFrom(c)
    return merged


def _written_by_gradwatch(category: Any) -> bool:
    tags = [t for chart in category.chart for t in chart.multiline.tag]
    return bool(tags) and all(t.startswith("gradwatch/") for t in tags)


def write_layout(writer: Any) -> None:
    """Write gradwatch's layout into ``writer``'s run, merged with a layout already there.

    Runs on the writer thread. Flushes first so a layout queued by the same writer is on disk.
    """
    log_dir = getattr(writer, "log_dir", None) or writer.get_logdir()
    file_writer = getattr(writer, "_get_file_writer", None)
    if file_writer is None:  # another writer class: the public call (replaces any layout)
        writer.add_custom_scalars(layout())
        return
    writer.flush()
    merged = merge_layouts(read_layout(str(log_dir)), layout_proto())
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="custom_scalars"))
    tensor = TensorProto(dtype="DT_STRING", string_val=[merged.SerializeToString()], tensor_shape=TensorShapeProto())
    file_writer().add_summary(Summary(value=[Summary.Value(tag=_CONFIG_TAG, tensor=tensor, metadata=meta)]))
    writer.flush()


class ChartSeries:
    """The dashboard's own series, derived from one step's scalars on the TensorBoard writer thread.

    ``derive(step, values)`` returns the ``(step, values)`` events to write, in order:

    - ``gradwatch/incidents/grad_norm`` and ``gradwatch/incidents/loss`` (``_opt{i}`` with several
      optimizers): written only at a step with a new finding, a skipped update or a NaN/Inf gradient norm
      or loss, near the top of that line's usual range as TensorBoard draws it (:class:`SmoothedSample`):
      above the line where it is low, inside the chart on linear and log axes (a NaN itself is not drawn);
    - ``gradwatch/findings_stacked/<kind>``: findings so far of this kind and of the kinds found before it
      (first found, lowest): kinds found at the same step, as often, are drawn apart; before the first
      finding, ``gradwatch/findings_stacked/none_yet`` at 0;
    - ``gradwatch/layer_norm_spread``: largest / smallest per-layer gradient norm, on per-layer steps;
    - ``gradwatch/update_ratio_median``: median of the per-layer update / weight ratios, when measured;
    - running totals (``skipped_steps``, ``findings/<kind>``, ``findings_stacked/<kind>``) repeat their old
      value (0, or the stack below, for a new kind) at the step before a change: a chart draws a step there,
      not a ramp from the last written point. Once above zero, ``skipped_steps`` and the stack are written
      at every step (the engine writes counters when they change, and every ``layer_every`` steps): smoothing
      then only delays their steps, the last value drawn is the count, and the counts are common enough
      among the chart's values that TensorBoard's outlier-ignoring y range (5th to 95th percentile) keeps
      them in view.
    """

    def __init__(self) -> None:
        self._last: dict[str, float] = {}  # running total -> its last value
        self._written: dict[str, int] = {}  # running total or stack tag -> the last step it was written at
        self._smoothed: dict[str, SmoothedSample] = {}  # line tag -> its smoothed values so far
        self._kinds: list[str] = []  # finding kinds in the order found: the stacking order
        self._counts: dict[str, float] = {}

    def derive(self, step: int, values: dict[str, float]) -> list[tuple[int, dict[str, float]]]:
        values = dict(values)
        before = self._stack(values)
        increased = self._running_totals(values, before)
        lines = _lines(values)
        nonfinite = values.get("gradwatch/nonfinite_grads", 0.0) > 0
        if increased or nonfinite or not all(map(math.isfinite, lines.values())):
            values.update(self._markers(lines))
        self._remember(lines)
        self._carry(values)
        values.update(_summaries(values))
        before = {t: v for t, v in before.items() if self._written.get(t, -1) < step - 1}
        self._written.update({t: step for t in values if t.startswith(_RUNNING_TOTALS + _CARRIED)})
        return [(step - 1, before), (step, values)] if before else [(step, values)]

    def _stack(self, values: dict[str, float]) -> dict[str, float]:
        """Adds the stacked findings to ``values``; returns the stacked values that change, as they were.
        Until the first finding, a zero line (``findings_stacked/none_yet``, at the engine's cadence for
        counters) says so: a healthy run's chart is not empty."""
        found = {t[len(_FINDINGS) :]: v for t, v in values.items() if t.startswith(_FINDINGS)}
        if not found:
            if not self._kinds and "gradwatch/skipped_steps" in values:
                values[_STACKED + "none_yet"] = 0.0
            return {}
        old = dict(self._counts)
        self._kinds.extend(sorted(k for k in found if k not in self._counts))
        self._counts.update(found)
        below_old = below_new = 0.0
        before: dict[str, float] = {}
        for kind in self._kinds:
            below_old += old.get(kind, 0.0)
            below_new += self._counts[kind]
            values[_STACKED + kind] = below_new
            if below_new != below_old:
                before[_STACKED + kind] = below_old
        return before

    def _running_totals(self, values: dict[str, float], before: dict[str, float]) -> bool:
        """Whether a running total went up at this step (a finding, a skipped update); its old value goes
        into ``before``."""
        increased = False
        for tag, v in values.items():
            if tag.startswith(_RUNNING_TOTALS):
                last = self._last.get(tag, 0.0)
                if v > last:
                    increased = True
                    before[tag] = last
                self._last[tag] = v
        return increased

    def _carry(self, values: dict[str, float]) -> None:
        for tag, v in values.items():
            if tag.startswith(_CARRIED):
                self._last[tag] = v
        for tag, v in self._last.items():
            if tag.startswith(_CARRIED) and v > 0:
                values.setdefault(tag, v)

    def _markers(self, lines: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for tag, v in lines.items():
            seen = self._smoothed.get(tag)
            height = seen.upper() if seen is not None else (v if math.isfinite(v) else 1.0)
            out["gradwatch/incidents/" + tag[len("gradwatch/") :].replace("/total", "")] = height
        return out

    def _remember(self, lines: dict[str, float]) -> None:
        for tag, v in lines.items():
            if math.isfinite(v):
                self._smoothed.setdefault(tag, SmoothedSample()).add(v)


class SmoothedSample:
    """A line as TensorBoard draws it at its default smoothing (EMA of weight 0.6, debiased), kept as a
    bounded sample of the smoothed values: where an incident marker shows without leaving the chart."""

    WEIGHT = 0.6
    SIZE = 512

    def __init__(self) -> None:
        self._ema = 0.0
        self._n = 0
        self._stride = 1
        self.sample: list[float] = []

    def add(self, value: float) -> None:
        self._ema = self._ema * self.WEIGHT + (1 - self.WEIGHT) * value
        self._n += 1
        if (self._n - 1) % self._stride == 0:
            self.sample.append(self._ema / (1 - self.WEIGHT**self._n))
            if len(self.sample) >= self.SIZE:
                self.sample = self.sample[::2]
                self._stride *= 2

    def upper(self) -> float:
        """The 90th percentile of the smoothed line so far: near the top of its usual range, so a marker
        stands above the line where the line is low, inside the y range TensorBoard draws while it ignores
        outliers (the 5th to 95th percentile of the smoothed values, padded by 5% of that span)."""
        ordered = sorted(self.sample)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _lines(values: dict[str, float]) -> dict[str, float]:
    """The step's total gradient norms and losses: the lines that get incident markers."""
    return {t: v for t, v in values.items() if _LINE.match(t)}


def _summaries(values: dict[str, float]) -> dict[str, float]:
    """One line per run for the per-layer questions: the spread of layer norms, the median update ratio."""
    out: dict[str, float] = {}
    norms = [v for t, v in values.items() if _LAYER_NORM.match(t) and math.isfinite(v) and v > 0]
    if len(norms) > 1:
        out["gradwatch/layer_norm_spread"] = max(norms) / min(norms)
    ratios = [v for t, v in values.items() if t.startswith("gradwatch/update_ratio/") and math.isfinite(v)]
    if ratios:
        out["gradwatch/update_ratio_median"] = statistics.median(ratios)
    return out


def _write_histograms(step: int, layers: dict[str, torch.Tensor]) -> Any:
    def write(writer: Any) -> None:
        for layer, values in layers.items():
            v = values.detach().to("cpu", torch.float32)
            finite = torch.isfinite(v)
            bad = int(v.numel() - int(finite.sum()))
            if bad:
                v = v[finite]
                writer.add_scalar(f"gradwatch/grad_hist_nonfinite/{layer}", float(bad), step)
            if v.numel():
                writer.add_histogram(f"gradwatch/grad_hist/{layer}", v, step)

    return write


class DashboardWriter:
    """Where the dashboard's jobs go: ``submit(fn)`` runs ``fn(summary_writer)`` on a writer thread.

    :class:`gradwatch.report.tensorboard.TensorBoardReporter` is one; :class:`Dashboard` finds it among the
    engine's reporters by this type, so the dashboard does not depend on the TensorBoard reporter's module.
    """

    def submit(self, fn: Callable[[Any], None]) -> None:
        raise NotImplementedError


class Dashboard:
    """Writes the Custom Scalars layout once and, when enabled, gradient histograms.

    Logged:
        ``custom_scalars__config__``: the layout (once per run, at the first checked step).
        ``gradwatch/grad_hist/<layer>``: gradient histogram every ``histogram_every`` checked steps.
        ``gradwatch/grad_hist_nonfinite/<layer>``: NaN/Inf values left out of that histogram (if any).
    """

    def __init__(self) -> None:
        self._reporter: Any = None
        self._layout_written = False
        self._every = 0
        self._checked = 0

    def attach(self, engine: Any) -> None:
        self._reporter = engine.reporters.of_type(DashboardWriter)
        self._every = int(engine.config.histogram_every)

    def before_sync(self, ctx: Any) -> None:
        if self._reporter is None or self._every <= 0:
            return
        self._checked += 1
        if (self._checked - 1) % self._every != 0 or not ctx.grads:
            return
        grouped: dict[str, list[torch.Tensor]] = {}
        for g, m in zip(ctx.grads, ctx.stats.modules):
            if g.is_sparse or g.is_meta or not (g.is_floating_point() or g.is_complex()):
                continue
            grouped.setdefault(layer_key(m), []).append(g.detach().reshape(-1).abs() if g.is_complex() else g.detach().reshape(-1))
        # A copy on the gradients' device: the user's zero_grad/next backward cannot change what we write.
        layers = {k: torch.cat(v) if len(v) > 1 else v[0].clone() for k, v in grouped.items()}
        self._reporter.submit(_write_histograms(ctx.stats.step, layers))

    def after_step(self, stats: Any, decision: str) -> None:
        if self._layout_written or self._reporter is None:
            return
        self._layout_written = True
        self._reporter.submit(write_layout)


__all__ = [
    "CATEGORY",
    "CHARTS",
    "ChartSeries",
    "Dashboard",
    "DashboardWriter",
    "layout",
    "layout_proto",
    "merge_layouts",
    "read_layout",
    "write_layout",
]
