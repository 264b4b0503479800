"""``gradwatch summary RUN_DIR``: a health report of a finished or running run, from its logs.

Reads every directory under ``RUN_DIR`` that holds gradwatch data: TensorBoard event files with
``gradwatch/`` scalars, ``gradwatch.jsonl`` (findings) and ``incidents/*.md``. Prints, per run: steps,
skipped updates, findings by kind with first and last step, per-layer gradient-norm statistics, a
sparkline of the total gradient norm and the incidents. ``--json`` prints the same as JSON.

Exit codes: 0 on success, 2 when ``RUN_DIR`` does not exist or holds no gradwatch data.

Example:
    $ gradwatch summary runs/exp1
    $ python -m gradwatch summary runs/exp1 --json | jq '.runs[0].findings'
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from gradwatch.report.jsonl import FILENAME as JSONL_NAME
from gradwatch.report.jsonl import read_jsonl

PREFIX = "gradwatch/"
SPARK = "▁▂▃▄▅▆▇█"
#: Per-layer rows shown in the table (all are in --json).
MAX_LAYERS_SHOWN = 25


@dataclass
class KindSummary:
    kind: str
    count: int
    first_step: int | None
    last_step: int | None
    severity: str | None = None
    where: str | None = None


@dataclass
class LayerSummary:
    layer: str
    min: float
    median: float
    max: float
    last: float
    update_ratio: float | None = None


@dataclass
class RunReport:
    """What ``gradwatch summary`` found about one run directory (renders itself with rich)."""

    run_dir: str
    steps: int = 0
    steps_logged: int = 0
    skipped_steps: int = 0
    nonfinite_steps: int = 0
    findings: list[KindSummary] = field(default_factory=list)
    layers: list[LayerSummary] = field(default_factory=list)
    total_norm: list[tuple[int, float]] = field(default_factory=list)
    loss_first: float | None = None
    loss_last: float | None = None
    incidents: list[dict[str, str]] = field(default_factory=list)
    earlier_runs: int = 0  # other watchers' findings in the same gradwatch.jsonl (not counted)

    @property
    def healthy(self) -> bool:
        return not self.findings and not self.skipped_steps

    def sparkline(self, width: int = 60) -> str:
        return sparkline([v for _, v in self.total_norm], width)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_norm"] = [[s, v] for s, v in self.total_norm]
        d["healthy"] = self.healthy
        norms = [v for _, v in self.total_norm]
        d["total_norm_stats"] = _stats(norms) if norms else None
        return d

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = []
        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        head.add_row("run", self.run_dir)
        if self.earlier_runs:
            head.add_row(
                "earlier runs",
                f"{self.earlier_runs} earlier run(s) wrote to this log_dir: the findings below are the latest run's "
                "(the charts of every run share the TensorBoard files; use a new log_dir per run)",
            )
        head.add_row("steps", f"{self.steps} ({self.steps_logged} checked steps logged)")
        head.add_row("skipped updates", str(self.skipped_steps))
        if self.nonfinite_steps:
            head.add_row("steps with non-finite grads", str(self.nonfinite_steps))
        if self.loss_first is not None and self.loss_last is not None:
            head.add_row("loss", f"{self.loss_first:.4g} -> {self.loss_last:.4g}")
        norms = [v for _, v in self.total_norm]
        if norms:
            st = _stats(norms)
            head.add_row(
                "grad norm",
                f"min {st['min']:.3g}  median {st['median']:.3g}  max {st['max']:.3g}  last {norms[-1]:.3g}",
            )
            head.add_row("grad norm trend", self.sparkline(48))
            head.add_row("", f"(total norm, log scale, max per bucket, steps {self.total_norm[0][0]} to {self.total_norm[-1][0]})")
        verdict = Text("healthy: no findings, no skipped updates", style="green") if self.healthy else Text(
            f"{sum(k.count for k in self.findings)} finding(s) of {len(self.findings)} kind(s)", style="yellow"
        )
        head.add_row("verdict", verdict)
        parts.append(head)
        if self.findings:
            t = Table(title="findings by kind", title_justify="left", expand=False)
            for c, j in (("kind", "left"), ("count", "right"), ("first step", "right"), ("last step", "right"), ("severity", "left"), ("where (first)", "left")):
                t.add_column(c, justify=j)  # type: ignore[arg-type]
            for k in self.findings:
                t.add_row(k.kind, str(k.count), _opt(k.first_step), _opt(k.last_step), k.severity or "", k.where or "")
            parts.append(t)
        if self.layers:
            t = Table(title="gradient norm per layer", title_justify="left", expand=False)
            t.add_column("layer")
            for c in ("min", "median", "max", "last"):
                t.add_column(c, justify="right")
            show_ratio = any(layer.update_ratio is not None for layer in self.layers)
            if show_ratio:
                t.add_column("update/weight", justify="right")
            for layer in self.layers[:MAX_LAYERS_SHOWN]:
                row = [layer.layer, f"{layer.min:.3g}", f"{layer.median:.3g}", f"{layer.max:.3g}", f"{layer.last:.3g}"]
                if show_ratio:
                    row.append("" if layer.update_ratio is None else f"{layer.update_ratio:.2g}")
                t.add_row(*row)
            if len(self.layers) > MAX_LAYERS_SHOWN:
                t.add_row(f"... {len(self.layers) - MAX_LAYERS_SHOWN} more (see --json)", "", "", "", "")
            parts.append(t)
        if self.incidents:
            t = Table(title="incidents", title_justify="left", expand=False)
            t.add_column("file")
            t.add_column("title")
            for inc in self.incidents:
                t.add_row(inc["file"], inc["title"])
            parts.append(t)
        return Group(*parts)


class NoGradwatchData(Exception):
    """The directory holds no gradwatch data."""


def sparkline(values: list[float], width: int = 60) -> str:
    """A one-line sparkline of positive values on a log scale (max per bucket, so spikes stay visible)."""
    vals = [v for v in values if math.isfinite(v) and v > 0]
    if not vals:
        return ""
    if len(vals) > width:
        buckets = []
        for i in range(width):
            lo, hi = i * len(vals) // width, (i + 1) * len(vals) // width
            buckets.append(max(vals[lo:hi]))
        vals = buckets
    logs = [math.log10(v) for v in vals]
    lo, hi = min(logs), max(logs)
    if hi - lo < 1e-12:
        return SPARK[len(SPARK) // 2] * len(logs)
    return "".join(SPARK[min(len(SPARK) - 1, int((x - lo) / (hi - lo) * len(SPARK)))] for x in logs)


def find_runs(run_dir: str) -> list[str]:
    """Directories under ``run_dir`` (itself included) holding event files or ``gradwatch.jsonl``."""
    found: list[str] = []
    for root, _dirs, files in os.walk(run_dir):
        if JSONL_NAME in files or any("tfevents" in f for f in files):
            found.append(root)
    return sorted(found)


def summarize(run_dir: str) -> list[RunReport]:
    """One :class:`RunReport` per run under ``run_dir``.

    Raises:
        NoGradwatchData: ``run_dir`` does not exist or holds no gradwatch data.
    """
    if not os.path.isdir(run_dir):
        raise NoGradwatchData(f"{run_dir!r} is not a directory")
    reports = [r for r in (_summarize_one(d) for d in find_runs(run_dir)) if r is not None]
    if not reports:
        raise NoGradwatchData(
            f"no gradwatch data in {run_dir!r}: no TensorBoard event files with gradwatch/ scalars and no "
            f"{JSONL_NAME} under it. Pass the log_dir given to gradwatch.watch(...) (or Lightning's logger "
            "directory)."
        )
    return reports


def _summarize_one(d: str) -> RunReport | None:
    scalars = _read_scalars(d)
    jsonl_path = os.path.join(d, JSONL_NAME)
    records = list(read_jsonl(jsonl_path)) if os.path.isfile(jsonl_path) else []
    if not scalars and not records:
        return None
    rep = RunReport(run_dir=d)
    runs = list(dict.fromkeys(r["run"] for r in records if isinstance(r.get("run"), str)))
    if len(runs) > 1:  # runs that reused this log_dir appended to one file: the latest one's findings
        rep.earlier_runs = len(runs) - 1
        records = [r for r in records if r.get("run") == runs[-1]]
    totals = sorted(
        ((s, v) for tag, pts in scalars.items() if tag.startswith(PREFIX + "grad_norm/total") for s, v in pts),
        key=lambda sv: sv[0],
    )
    rep.total_norm = totals
    steps = [s for pts in scalars.values() for s, _ in pts]
    if steps:
        rep.steps = max(steps) + 1
    rep.steps_logged = len({s for s, _ in totals})
    skipped = scalars.get(PREFIX + "skipped_steps")
    if skipped:
        rep.skipped_steps = int(max(v for _, v in skipped))
    nonfinite = scalars.get(PREFIX + "nonfinite_grads")
    if nonfinite:
        rep.nonfinite_steps = sum(1 for _, v in nonfinite if v > 0)
    loss = scalars.get(PREFIX + "loss") or next(
        (pts for tag, pts in sorted(scalars.items()) if tag.startswith(PREFIX + "loss_opt")), None
    )
    if loss:
        rep.loss_first, rep.loss_last = loss[0][1], loss[-1][1]
    rep.findings = _kinds(records, scalars)
    if records:
        rep.steps = max(rep.steps, max(int(r.get("step", 0)) for r in records) + 1)
    ratios = {tag[len(PREFIX + "update_ratio/") :]: pts for tag, pts in scalars.items() if tag.startswith(PREFIX + "update_ratio/")}
    for tag, pts in scalars.items():
        if not tag.startswith(PREFIX + "grad_norm/") or tag.startswith(PREFIX + "grad_norm/total"):
            continue
        layer = tag[len(PREFIX + "grad_norm/") :]
        vals = [v for _, v in pts]
        st = _stats(vals)
        r = ratios.get(layer)
        rep.layers.append(
            LayerSummary(layer, st["min"], st["median"], st["max"], vals[-1], _stats([v for _, v in r])["median"] if r else None)
        )
    for path in sorted(glob.glob(os.path.join(glob.escape(d), "incidents", "*.md"))):
        rep.incidents.append({"file": os.path.relpath(path, d), "title": _first_line(path)})
    return rep


def _read_scalars(d: str) -> dict[str, list[tuple[int, float]]]:
    if not any("tfevents" in f for f in os.listdir(d)):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(d, size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags().get("scalars", []):
        if tag.startswith(PREFIX):
            pts = sorted({e.step: float(e.value) for e in acc.Scalars(tag)}.items())
            out[tag] = pts
    return out


def _kinds(records: list[dict[str, Any]], scalars: dict[str, list[tuple[int, float]]]) -> list[KindSummary]:
    kinds: dict[str, KindSummary] = {}
    for r in records:
        kind = r.get("kind")
        if not isinstance(kind, str):
            continue  # not a finding record
        step = int(r.get("step", 0))
        k = kinds.get(kind)
        if k is None:
            params = r.get("params") or []
            where = r.get("module") or r.get("op") or (params[0] + (f" (+{len(params) - 1})" if len(params) > 1 else "") if params else None)
            kinds[kind] = KindSummary(kind, 1, step, step, r.get("severity"), where)
        else:
            k.count += 1
            k.first_step = step if k.first_step is None else min(k.first_step, step)
            k.last_step = step if k.last_step is None else max(k.last_step, step)
    if not records:  # no gradwatch.jsonl (e.g. a TensorBoard-only copy): the finding counters
        for tag, pts in scalars.items():
            if tag.startswith(PREFIX + "findings/") and pts:
                first = next((s for s, v in pts if v > 0), None)
                kinds[tag[len(PREFIX + "findings/") :]] = KindSummary(
                    tag[len(PREFIX + "findings/") :], int(pts[-1][1]), first, None
                )
    return sorted(kinds.values(), key=lambda k: (k.first_step if k.first_step is not None else 0, k.kind))


def _stats(vals: list[float]) -> dict[str, float]:
    v = sorted(vals)
    return {"min": v[0], "median": v[len(v) // 2], "max": v[-1]}


def _first_line(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip().lstrip("#").strip()
                if line:
                    return line[:100]
    except OSError:
        pass
    return ""


def _opt(v: int | None) -> str:
    return "" if v is None else str(v)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gradwatch`` console script (and ``python -m gradwatch``)."""
    parser = argparse.ArgumentParser(prog="gradwatch", description="gradwatch: training-health reports from logs")
    parser.add_argument("--version", action="version", version=f"gradwatch {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("summary", help="print a health report of a run directory (event files and gradwatch.jsonl)")
    p.add_argument("run_dir", help="a run's log_dir (searched recursively)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    try:
        reports = summarize(args.run_dir)
    except NoGradwatchData as exc:
        print(f"gradwatch summary: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"runs": [r.to_dict() for r in reports]}, indent=2, default=_json_default))
        return 0
    from rich.console import Console

    console = Console()
    for r in reports:
        console.print(r)
        console.print()
    return 0


def _version() -> str:
    from gradwatch import __version__

    return __version__


def _json_default(v: Any) -> Any:
    return str(v)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
