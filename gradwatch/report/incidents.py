"""Incident reports: ``log_dir/incidents/step_<N>.md`` and ``.json`` (and ``.pt`` with ``save_batch``).

One report per localized non-finite incident: the findings of the step, the forward traceback that anomaly
mode recorded for the origin op (if any), the per-layer gradient statistics and, with ``save_batch=True``,
the inputs of the step so the incident can be reproduced::

    blob = torch.load("runs/exp1/incidents/step_7.pt")
    model(*blob["args"], **blob["kwargs"])          # plain loop
    pl_module.training_step(blob["batch"], blob["batch_idx"])   # Lightning
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from gradwatch.core.findings import Finding, display_order, jsonable
from gradwatch.report import fs


@dataclass(frozen=True)
class IncidentPaths:
    """Where one incident's files go (``batch`` is None without ``save_batch``)."""

    markdown: str
    json: str
    batch: str | None


def incident_paths(log_dir: str, step: int, optimizer_index: int = 0, *, save_batch: bool = False) -> IncidentPaths:
    """The file names of the report for ``step`` (``step_<N>``, ``_opt<k>`` for a second optimizer)."""
    stem = f"step_{step}" + (f"_opt{optimizer_index}" if optimizer_index else "")
    base = fs.join(log_dir, "incidents", stem)
    return IncidentPaths(base + ".md", base + ".json", base + ".pt" if save_batch else None)


def write_incident(
    paths: IncidentPaths,
    *,
    step: int,
    findings: list[Finding],
    layers: list[dict[str, Any]],
    traceback: str | None,
    anomaly_error: str | None,
    inputs: dict[str, Any] | None,
    note: str | None = None,
    run: str | None = None,
) -> None:
    """Write the report files (creating ``incidents/``); raises OSError if they cannot be written. ``run``
    is the run id of the ``gradwatch.jsonl`` records, so ``gradwatch summary`` lists the report with its run."""
    fs.makedirs(os.path.dirname(paths.markdown))
    batch_file = None
    if paths.batch is not None and inputs is not None:
        with fs.open_file(paths.batch, "wb") as fh:
            torch.save(tree_map(_to_cpu, inputs), fh)
        batch_file = os.path.basename(paths.batch)
    record = {
        "step": step,
        "findings": [f.to_dict() for f in findings],
        "layers": jsonable(layers),
        "forward_traceback": traceback,
        "anomaly_error": anomaly_error,
        "batch_file": batch_file,
        "note": note,
        "run": run,
    }
    with fs.open_file(paths.json, "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=2, allow_nan=False)
    with fs.open_file(paths.markdown, "w", encoding="utf-8") as fh:
        fh.write(_markdown(step, findings, layers, traceback, anomaly_error, batch_file, note))


def _to_cpu(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", copy=True)
    return v


def _markdown(
    step: int,
    findings: list[Finding],
    layers: list[dict[str, Any]],
    traceback: str | None,
    anomaly_error: str | None,
    batch_file: str | None,
    note: str | None,
) -> str:
    out = [f"# gradwatch incident at step {step}", ""]
    if note:
        out += [note, ""]
    for f in display_order(findings):  # the console's order: where the NaN came from first
        out += [f"## {f.title}", "", f"Severity: {f.severity}", "", f.message, ""]
        details = {k: v for k, v in f.data.items() if k != "table"}
        if details:
            out += ["```json", json.dumps(jsonable(details), indent=2), "```", ""]
    if traceback:
        out += ["## Forward traceback of the origin op (anomaly mode)", "", "```", traceback.rstrip(), "```", ""]
    if anomaly_error:
        out += ["## Anomaly mode", "", "```", anomaly_error.rstrip(), "```", ""]
    if layers:
        columns = list(layers[0].keys())
        out += ["## Per-layer gradients", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in layers:
            out.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
        out.append("")
    if batch_file:
        out += [
            "## Inputs",
            "",
            f"Saved to `{batch_file}`: `torch.load(...)` gives the step's inputs to reproduce the incident.",
            "",
        ]
    return "\n".join(out)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
