"""``gradwatch summary RUN_DIR``: a health report of a finished or running run, from its logs.

Reads every directory under ``RUN_DIR`` that holds gradwatch data: TensorBoard event files with
``gradwatch/`` scalars, ``gradwatch.jsonl`` (findings) and ``incidents/*.md``. Prints, per run: steps,
skipped updates, findings by kind with first and last step, per-layer gradient-norm statistics, a
sparkline of the total gradient norm and the incidents. ``--json`` prints the same as JSON.

Several runs may have written to one directory (a re-run script, a fit resumed from a checkpoint): every
figure of a report comes from one run (see :mod:`gradwatch.report.runs`). By default the latest run is
reported and the others are listed; ``--run N`` reports the N-th (1 = the first, -1 = the latest),
``--all`` every one.

Exit codes: 0 on success, 2 when ``RUN_DIR`` does not exist, holds no gradwatch data or no run ``N``.

Example:
    $ gradwatch summary runs/exp1
    $ gradwatch summary runs/exp1 --run 1
    $ python -m gradwatch summary runs/exp1 --json | jq '.runs[0].findings'
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from gradwatch.report.jsonl import FILENAME as JSONL_NAME
from gradwatch.report.jsonl import read_jsonl
from gradwatch.report.runs import Run, assign_files, split_runs

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
    #: Which run of the directory this is: its id, its number (1 = the first to start) and start time.
    run_id: str | None = None
    run_number: int = 1
    started: str | None = None
    #: Runs of the same directory that started before this one (each reachable with ``--run N``).
    earlier_runs: int = 0
    #: Every run of the directory: number, id, start time, steps and findings (this one marked "shown").
    runs_in_dir: list[dict[str, Any]] = field(default_factory=list)
    #: The run that wrote to the directory last (the one reported by default).
    latest: bool = True

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

        parts: list[Any] = [self._head()]
        if self.findings:
            parts.append(_findings_table(self.findings))
        if self.layers:
            parts.append(_layers_table(self.layers))
        if len(self.runs_in_dir) > 1:
            parts.append(_runs_table(self.runs_in_dir))
        if self.incidents:
            parts.append(_incidents_table(self.incidents))
        return Group(*parts)

    def _head(self) -> Any:
        """The grid at the top: run, steps, skipped updates, loss, grad norm and the verdict."""
        from rich.table import Table

        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        for label, value in self._head_rows():
            head.add_row(label, value)
        head.add_row("verdict", self._verdict())
        return head

    def _head_rows(self) -> list[tuple[str, str]]:
        rows = [("run", self.run_dir)]
        if len(self.runs_in_dir) > 1:
            started = f", started {self.started}" if self.started else ""
            rows.append(
                ("", f"run {self.run_number} of {len(self.runs_in_dir)} in this log_dir{started}: every figure below is this run's")
            )
        rows.append(("steps", f"{self.steps} ({self.steps_logged} checked steps logged)"))
        rows.append(("skipped updates", str(self.skipped_steps)))
        if self.nonfinite_steps:
            rows.append(("steps with non-finite grads", str(self.nonfinite_steps)))
        if self.loss_first is not None and self.loss_last is not None:
            rows.append(("loss", f"{self.loss_first:.4g} -> {self.loss_last:.4g}"))
        return rows + self._norm_rows()

    def _norm_rows(self) -> list[tuple[str, str]]:
        norms = [v for _, v in self.total_norm]
        if not norms:
            return []
        st = _stats(norms)
        first, last = self.total_norm[0][0], self.total_norm[-1][0]
        return [
            ("grad norm", f"min {st['min']:.3g}  median {st['median']:.3g}  max {st['max']:.3g}  last {norms[-1]:.3g}"),
            ("grad norm trend", self.sparkline(48)),
            ("", f"(total norm, log scale, max per bucket, steps {first} to {last})"),
        ]

    def _verdict(self) -> Any:
        from rich.text import Text

        if self.healthy:
            return Text("healthy: no findings, no skipped updates", style="green")
        return Text(f"{sum(k.count for k in self.findings)} finding(s) of {len(self.findings)} kind(s)", style="yellow")


def _findings_table(findings: list[KindSummary]) -> Any:
    from rich.table import Table

    t = Table(title="findings by kind", title_justify="left", expand=False)
    for c, j in (
        ("kind", "left"), ("count", "right"), ("first step", "right"), ("last step", "right"), ("severity", "left"),
        ("where (first)", "left"),
    ):
        t.add_column(c, justify=j)  # type: ignore[arg-type]
    for k in findings:
        t.add_row(k.kind, str(k.count), _opt(k.first_step), _opt(k.last_step), k.severity or "", k.where or "")
    return t


def _layers_table(layers: list[LayerSummary]) -> Any:
    from rich.table import Table

    t = Table(title="gradient norm per layer", title_justify="left", expand=False)
    t.add_column("layer")
    for c in ("min", "median", "max", "last"):
        t.add_column(c, justify="right")
    show_ratio = any(layer.update_ratio is not None for layer in layers)
    if show_ratio:
        t.add_column("update/weight", justify="right")
    for layer in layers[:MAX_LAYERS_SHOWN]:
        row = [layer.layer, f"{layer.min:.3g}", f"{layer.median:.3g}", f"{layer.max:.3g}", f"{layer.last:.3g}"]
        if show_ratio:
            row.append("" if layer.update_ratio is None else f"{layer.update_ratio:.2g}")
        t.add_row(*row)
    if len(layers) > MAX_LAYERS_SHOWN:
        t.add_row(f"... {len(layers) - MAX_LAYERS_SHOWN} more (see --json)", "", "", "", "")
    return t


def _incidents_table(incidents: list[dict[str, str]]) -> Any:
    from rich.table import Table

    t = Table(title="incidents", title_justify="left", expand=False)
    t.add_column("file")
    t.add_column("title")
    for inc in incidents:
        t.add_row(inc["file"], inc["title"])
    return t

def _runs_table(runs: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(
        title="runs in this log_dir (gradwatch summary DIR --run N for another, --all for every one)",
        title_justify="left", expand=False,
    )
    for c, j in (("run", "right"), ("started", "left"), ("steps", "right"), ("findings", "right"), ("", "left")):
        t.add_column(c, justify=j)  # type: ignore[arg-type]
    for r in runs:
        shown = "shown" if r["shown"] else ""
        t.add_row(str(r["number"]), r["started"] or "", str(r["steps"]), str(r["findings"]), shown)
    return t


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


def summarize(run_dir: str, run: int | None = None, all_runs: bool = False) -> list[RunReport]:
    """One :class:`RunReport` per directory under ``run_dir``: of its latest run, of run number ``run``
    (1 = the first, -1 = the latest; directories without it are left out) or, with ``all_runs``, of each.

    Raises:
        NoGradwatchData: ``run_dir`` does not exist or holds no gradwatch data (or no run ``run``).
    """
    if not os.path.isdir(run_dir):
        raise NoGradwatchData(f"{run_dir!r} is not a directory")
    found = [rs for rs in (_summarize_dir(d) for d in find_runs(run_dir)) if rs]
    if not found:
        raise NoGradwatchData(
            f"no gradwatch data in {run_dir!r}: no TensorBoard event files with gradwatch/ scalars and no "
            f"{JSONL_NAME} under it. Pass the log_dir given to gradwatch.watch(...) (or Lightning's logger "
            "directory)."
        )
    if all_runs:
        return [r for reports in found for r in reports]
    if run is None:
        return [next(r for r in reports if r.latest) for reports in found]
    picked = [reports[run - 1 if run > 0 else run] for reports in found if run and -len(reports) <= run <= len(reports)]
    if not picked:
        counts = ", ".join(f"{reports[0].run_dir}: {len(reports)}" for reports in found)
        raise NoGradwatchData(
            f"no run {run} in {run_dir!r} (runs per directory: {counts}); runs are numbered from 1, -1 is the latest"
        )
    return picked


def _summarize_dir(d: str) -> list[RunReport]:
    """One report per run of directory ``d`` (in start order); none without gradwatch data."""
    jsonl_path = os.path.join(d, JSONL_NAME)
    has_jsonl = os.path.isfile(jsonl_path)
    records = list(read_jsonl(jsonl_path)) if has_jsonl else []
    runs = split_runs(records) or [Run(None)]
    event_files = [name for name in sorted(os.listdir(d)) if "tfevents" in name]
    scalars_by_file = {name: sc for name in event_files if (sc := _read_scalars(os.path.join(d, name)))}
    assign_files(runs, d, list(scalars_by_file))
    if not has_jsonl and not scalars_by_file:
        return []
    reports = []
    for number, run in enumerate(runs, start=1):
        scalars = _merge([scalars_by_file[f] for f in sorted(set(run.event_files)) if f in scalars_by_file])
        rep = _report(d, run, scalars, from_counters=not has_jsonl)
        rep.run_number, rep.earlier_runs = number, number - 1
        reports.append(rep)
    listing = [
        {
            "number": r.run_number, "run": r.run_id, "started": r.started, "steps": r.steps,
            "findings": sum(k.count for k in r.findings), "shown": False,
        }
        for r in reports
    ]
    latest = max(range(len(runs)), key=lambda i: runs[i].last)  # the run that wrote last (resumed or new)
    for i, r in enumerate(reports):
        r.latest = i == latest
        r.runs_in_dir = [{**row, "shown": row["number"] == r.run_number} for row in listing]
    return reports


def _report(d: str, run: Run, scalars: dict[str, list[tuple[int, float]]], *, from_counters: bool) -> RunReport:
    """The figures of one run: its findings, its event files' scalars, its incident reports."""
    totals = sorted(
        ((s, v) for tag, pts in scalars.items() if tag.startswith(PREFIX + "grad_norm/total") for s, v in pts),
        key=lambda sv: sv[0],
    )
    loss_first, loss_last = _loss_ends(scalars)
    return RunReport(
        run_dir=d,
        run_id=run.id,
        started=_when(run.started),
        total_norm=totals,
        steps=_steps(scalars, run.findings),
        steps_logged=len({s for s, _ in totals}),
        skipped_steps=_skipped_steps(scalars),
        nonfinite_steps=sum(1 for _, v in scalars.get(PREFIX + "nonfinite_grads") or () if v > 0),
        loss_first=loss_first,
        loss_last=loss_last,
        findings=_kinds(run.findings, scalars if from_counters else {}),
        layers=_layers(scalars),
        incidents=[{"file": rel, "title": _first_line(os.path.join(d, rel))} for rel in run.incidents],
    )


def _steps(scalars: dict[str, list[tuple[int, float]]], records: list[dict[str, Any]]) -> int:
    """How many steps the run made: one past the last step any scalar or finding was logged at."""
    steps = [s for pts in scalars.values() for s, _ in pts] + [int(r.get("step", 0)) for r in records]
    return max(0, max(steps) + 1) if steps else 0


def _skipped_steps(scalars: dict[str, list[tuple[int, float]]]) -> int:
    skipped = scalars.get(PREFIX + "skipped_steps")
    return int(max(v for _, v in skipped)) if skipped else 0


def _loss_ends(scalars: dict[str, list[tuple[int, float]]]) -> tuple[float | None, float | None]:
    """The first and last loss logged (the first optimizer's, with several)."""
    loss = scalars.get(PREFIX + "loss") or next(
        (pts for tag, pts in sorted(scalars.items()) if tag.startswith(PREFIX + "loss_opt")), None
    )
    return (loss[0][1], loss[-1][1]) if loss else (None, None)


def _layers(scalars: dict[str, list[tuple[int, float]]]) -> list[LayerSummary]:
    ratio_prefix = PREFIX + "update_ratio/"
    ratios = {tag[len(ratio_prefix) :]: pts for tag, pts in scalars.items() if tag.startswith(ratio_prefix)}
    layers = []
    for tag, pts in scalars.items():
        if not tag.startswith(PREFIX + "grad_norm/") or tag.startswith(PREFIX + "grad_norm/total"):
            continue
        layer = tag[len(PREFIX + "grad_norm/") :]
        vals = [v for _, v in pts]
        st = _stats(vals)
        r = ratios.get(layer)
        layers.append(
            LayerSummary(
                layer, st["min"], st["median"], st["max"], vals[-1], _stats([v for _, v in r])["median"] if r else None
            )
        )
    return layers


def _read_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    """The ``gradwatch/`` scalars of one event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    try:
        acc.Reload()
    except Exception:  # noqa: BLE001 - a torn or foreign file: no scalars from it
        return {}
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags().get("scalars", []):
        if tag.startswith(PREFIX):
            out[tag] = sorted({e.step: float(e.value) for e in acc.Scalars(tag)}.items())
    return out


def _merge(files: list[dict[str, list[tuple[int, float]]]]) -> dict[str, list[tuple[int, float]]]:
    """One run's scalars over its event files (a resumed fit writes a new one; a later file's value of a
    step wins: the resume made that step again)."""
    merged: dict[str, dict[int, float]] = {}
    for scalars in files:
        for tag, pts in scalars.items():
            merged.setdefault(tag, {}).update(pts)
    return {tag: sorted(pts.items()) for tag, pts in merged.items()}


def _kinds(records: list[dict[str, Any]], scalars: dict[str, list[tuple[int, float]]]) -> list[KindSummary]:
    kinds: dict[str, KindSummary] = {}
    for r in records:
        kind = r.get("kind")
        if not isinstance(kind, str):
            continue  # not a finding record
        step = int(r.get("step", 0))
        k = kinds.get(kind)
        if k is None:
            kinds[kind] = KindSummary(kind, 1, step, step, r.get("severity"), _where(r))
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


def _where(record: dict[str, Any]) -> str | None:
    """Where a finding record points: the op and the source line when it names them (``nan_origin``:
    ``LogBackward0 in block, model.py:9``), else the module, else the parameters."""
    data = record.get("data") if isinstance(record.get("data"), dict) else {}
    op = record.get("op") or data.get("op")
    module = record.get("module")
    line = _short_source(data.get("source"))
    if op or line:
        place = f" in {'the model' if module in ('', '<root>') else module}" if module is not None else ""
        return ", ".join(p for p in (f"{op or 'op'}{place}", line) if p)
    params = record.get("params") or []
    if module:
        return str(module)
    return params[0] + (f" (+{len(params) - 1})" if len(params) > 1 else "") if params else None


def _short_source(source: Any) -> str | None:
    """``/long/path/model.py:9 in forward`` -> ``model.py:9``."""
    if not isinstance(source, str) or not source:
        return None
    location = source.split(" in ", 1)[0]
    path, sep, line = location.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if sep and line.isdigit() else os.path.basename(location)


def _when(t: float | None) -> str | None:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t is not None else None


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
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--run", type=int, metavar="N",
        help="report the N-th run that wrote to the directory (1 = the first, -1 = the latest; default: the "
        "latest run, with the others listed)",
    )
    which.add_argument("--all", action="store_true", help="report every run that wrote to the directory")
    args = parser.parse_args(argv)
    try:
        reports = summarize(args.run_dir, run=args.run, all_runs=args.all)
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
    from gradwatch.version import __version__

    return __version__


def _json_default(v: Any) -> Any:
    return str(v)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
