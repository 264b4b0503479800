"""Report: a TensorBoard dashboard that opens ready, and optional gradient histograms.

:class:`Dashboard` is an extension attached for both integrations. When the run logs to TensorBoard it

- writes a **"gradwatch" layout into the Custom Scalars tab** at the first checked step: total gradient
  norm, per-layer norms, update-to-weight ratios, loss, skipped steps and non-finite gradients, findings
  by kind. TensorBoard keeps one layout per run (the last one written wins), so a layout already in the
  run's event files (e.g. written by you before training) is read back and merged: your categories
  first, then ours. A layout you write *after* the first step replaces ours; to keep both, include
  :func:`layout` in yours: ``writer.add_custom_scalars({**your_layout, **gradwatch.dashboard.layout()})``.
- with ``histogram_every=N`` (off by default: ``add_histogram`` costs ~22 ms per million values), writes
  ``gradwatch/grad_hist/<layer>`` every N checked steps. NaN/Inf values are filtered out (an all-NaN
  tensor would make ``add_histogram`` raise) and counted in ``gradwatch/grad_hist_nonfinite/<layer>``.

All writing happens on the TensorBoard reporter's writer thread (``submit``); the training thread only
queues a copy of the gradients on their own device (no device-to-host sync).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

from gradwatch.stats import layer_key

#: Title of the Custom Scalars category gradwatch writes.
CATEGORY = "gradwatch"

#: Chart title -> tag regular expressions (TensorBoard matches them with Python's ``re.match``).
CHARTS: dict[str, list[str]] = {
    "gradient norm (total)": [r"gradwatch/grad_norm/total.*"],
    "gradient norm per layer": [r"gradwatch/grad_norm/(?!total).*"],
    "update / weight ratio per layer": [r"gradwatch/update_ratio/.*"],
    "loss": [r"gradwatch/loss(_opt\d+)?$"],
    "skipped steps and non-finite gradients": [r"gradwatch/skipped_steps$", r"gradwatch/nonfinite_grads$"],
    "findings by kind": [r"gradwatch/findings/.*"],
}

_CONFIG_TAG = "custom_scalars__config__"


def layout() -> dict[str, dict[str, list[Any]]]:
    """gradwatch's Custom Scalars layout in ``SummaryWriter.add_custom_scalars`` form.

    Example:
        >>> sorted(layout()["gradwatch"])[0]
        'findings by kind'
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
    """``existing`` categories first (kept as they are), then ours unless a category of that title exists."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    merged = layout_pb2.Layout()
    titles: set[str] = set()
    if existing is not None:
        for c in existing.category:
            merged.category.add().CopyFrom(c)
            titles.add(c.title)
    for c in ours.category:
        if c.title not in titles:
            merged.category.add().CopyFrom(c)
    return merged


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
        from gradwatch.report.tensorboard import TensorBoardReporter

        self._reporter = engine.reporters.of_type(TensorBoardReporter)
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


__all__ = ["CATEGORY", "CHARTS", "Dashboard", "layout", "layout_proto", "merge_layouts", "read_layout", "write_layout"]
