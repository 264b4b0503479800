"""Run boundaries in one log directory: which findings, TensorBoard event files and incident reports belong
to which run, when several runs wrote to the same ``log_dir`` (a re-run script, a resumed fit).

Read from the ``run_start`` and ``run_continued`` records of ``gradwatch.jsonl`` (see
:mod:`gradwatch.report.jsonl`). Files of gradwatch versions that wrote no such records, and files no
record names (another TensorBoard writer), are given to the run that was running when they were last
written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from gradwatch.report.jsonl import RUN_CONTINUED, RUN_START, is_finding


@dataclass
class Run:
    """One run's share of a log directory.

    Attributes:
        id: The run id of its records (``None``: records of a version that wrote none).
        started: When it started (seconds since the epoch), if a ``run_start`` record says so.
        findings: Its finding records, in order; findings of steps a resume made again appear once.
        event_files: Names of its TensorBoard event files in the directory.
        incidents: Its incident reports (``incidents/step_<N>.md``, relative to the directory).
        last: Position of its latest record in the file (the most recently active run has the largest).
        aliases: The fresh ids it was resumed under (see ``run_continued``).
    """

    id: str | None
    started: float | None = None
    findings: list[dict[str, Any]] = field(default_factory=list)
    event_files: list[str] = field(default_factory=list)
    incidents: list[str] = field(default_factory=list)
    last: int = -1
    aliases: set[str] = field(default_factory=set)


def split_runs(records: list[dict[str, Any]]) -> list[Run]:
    """The runs of a ``gradwatch.jsonl`` file, in the order they started."""
    runs: dict[str | None, Run] = {}
    alias: dict[str, str] = {}  # the fresh id a resumed run started under -> the id it continues
    for position, record in enumerate(records):
        rid = record.get("run") if isinstance(record.get("run"), str) else None
        rid = alias.get(rid, rid) if rid is not None else None
        if record.get("event") == RUN_CONTINUED and isinstance(record.get("from"), str) and rid is not None:
            _continue(runs, alias, rid, record)
        run = runs.setdefault(rid, Run(rid))
        run.last = position
        if record.get("event") == RUN_START:
            run.started = run.started if run.started is not None else _number(record.get("time"))
            run.event_files += [str(f) for f in record.get("event_files") or [] if isinstance(f, str)]
        elif is_finding(record):
            run.findings.append(record)
    return list(runs.values())


def _continue(runs: dict[str | None, Run], alias: dict[str, str], rid: str, record: dict[str, Any]) -> None:
    """A resumed run: the fresh id's records join the run it continues, whose findings at the resumed
    step or later were made again after the resume (they are dropped from the earlier part)."""
    fresh = str(record["from"])
    alias[fresh] = rid
    run = runs.setdefault(rid, Run(rid))
    at = record.get("at_step")
    if isinstance(at, int):
        run.findings = [f for f in run.findings if not isinstance(f.get("step"), int) or f["step"] < at]
    run.aliases.add(fresh)
    moved = runs.pop(fresh, None)
    if moved is not None:
        run.aliases |= moved.aliases
        run.findings += moved.findings
        run.event_files += moved.event_files
        run.started = run.started if run.started is not None else moved.started


def assign_files(runs: list[Run], directory: str, event_files: list[str]) -> None:
    """Give each event file and incident report of ``directory`` to its run (``runs`` in start order)."""
    named = {name: run for run in runs for name in run.event_files}
    for name in event_files:
        owner = named.get(name) or _running_at(runs, _mtime(os.path.join(directory, name)))
        if owner is not None and name not in owner.event_files:
            owner.event_files.append(name)
    by_id = {i: run for run in runs for i in (run.id, *run.aliases)}
    incidents = os.path.join(directory, "incidents")
    names = sorted(os.listdir(incidents)) if os.path.isdir(incidents) else []
    for name in names:
        if not name.endswith(".md"):
            continue
        path = os.path.join(incidents, name)
        run_id = _incident_run(path[: -len(".md")] + ".json")
        owner = by_id.get(run_id) if run_id is not None else None
        owner = owner or _running_at(runs, _mtime(path))
        if owner is not None:
            owner.incidents.append(os.path.join("incidents", name))


def _running_at(runs: list[Run], when: float | None) -> Run | None:
    """The run that was running at ``when``: the latest to start before it. Without start times (files of
    an older gradwatch), the latest run."""
    started = [r for r in runs if r.started is not None]
    if not started or when is None:
        return runs[-1] if runs else None
    before = [r for r in started if r.started is not None and r.started <= when]
    if before:
        return max(before, key=lambda r: r.started or 0.0)
    unstarted = [r for r in runs if r.started is None]  # older records, before the first run_start
    return unstarted[-1] if unstarted else min(started, key=lambda r: r.started or 0.0)


def _incident_run(json_path: str) -> str | None:
    try:
        with open(json_path, encoding="utf-8") as fh:
            run = json.load(fh).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def _mtime(path: str) -> float | None:
    try:
        return os.path.getmtime(path)
    except OSError:
        return None


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

