"""The incident: pure decisions on what a localized (or not) incident reports, the per-layer table, and the
incident report written to ``log_dir/incidents/``.

The decisions are functions of facts (:func:`origin_verdict`, :func:`replay_note`, :func:`restate_checks`);
:class:`~gradwatch.diagnose.escalation.Escalation` gathers the facts and acts on the verdicts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Finding
from gradwatch.diagnose.capture import Batch, Call
from gradwatch.diagnose.localize import ROOT
from gradwatch.diagnose.op_fixes import fix_for
from gradwatch.diagnose.replay import ReplayResult
from gradwatch.report.incidents import incident_paths, write_incident

#: Incident reports written per run at most (a run that stays non-finite would write one per step).
MAX_REPORTS = 20


def layer_table(stats: Any) -> list[dict[str, Any]]:
    """Per-layer rows (layer, grad norm, NaN count, Inf count) in model order, from a step's statistics."""
    order: list[str] = []
    acc: dict[str, float] = {}
    nan: dict[str, int] = {}
    inf: dict[str, int] = {}
    norms = stats.norms if len(stats.norms) == len(stats.names) else [float("nan")] * len(stats.names)
    for name, module, v in zip(stats.names, stats.modules, norms):
        key = ROOT if module == "" else ("<foreign>" if module is None else module)
        if key not in acc:
            order.append(key)
            acc[key] = 0.0
            nan[key] = 0
            inf[key] = 0
        acc[key] += v * v
        nan[key] += int(stats.nan_counts.get(name, 0))
        inf[key] += int(stats.inf_counts.get(name, 0))
    return [
        {"layer": k, "grad_norm": math.sqrt(acc[k]) if math.isfinite(acc[k]) else acc[k], "nan": nan[k], "inf": inf[k]}
        for k in order
    ]


# -- decisions ----------------------------------------------------------------------------------------
def origin_verdict(has_result: bool, stale_buffers: bool) -> str | None:
    """Which finding a localization ends in: ``"stale"`` (buffers an earlier step poisoned, looked for only
    when the replay named no op: this step's own forward may have written them after the NaN was born where
    the replay found it), ``"origin"`` (the ``nan_origin`` of the replay), or None (nothing was replayed)."""
    if stale_buffers:
        return "stale"
    return "origin" if has_result else None


def needs_loop_scan(plain: bool, result: ReplayResult | None) -> bool:
    """Born after the model, in the loss code (plain loop): does a tensor the loop holds for this batch (the
    target, a per-sample weight or mask) carry it? Lightning checks its whole batch instead."""
    return plain and result is not None and result.loss_born


def replay_note(localized: bool, collective: str | None) -> str | None:
    """The incident report's note when the replay found nothing (``localized``: a replay result or bad inputs
    explain the incident): stopped at a collective, or finite."""
    if localized:
        return None
    if collective is not None:
        return (
            f"The replay of this step stopped at torch.distributed.{collective} in the forward: a replay "
            "runs on this rank alone, where a collective would wait for the other ranks or pair with another "
            "of their collectives. The origin was not found before it. The next steps run escalated."
        )
    return (
        "The replay of this step's forward and backward on its inputs was finite: the non-finite "
        "value did not come from the model's autograd graph on this batch (look at code that "
        "changes .grad between backward() and step(), at the loss outside the model, or at "
        "randomness such as dropout). The next steps run escalated."
    )


def restate_checks(findings: list[Finding], step: int, origin: Any) -> tuple[Finding | None, list[Finding]]:
    """The checks' guess at the cause of a NaN loss with finite gradients ("a mean over zero elements") would
    contradict the op named here: the first finding of ``step`` that defers to ``origin``, restated (the engine
    puts it in the original's place), and ``findings`` with it in place (without its ``restates`` mark) for
    the report."""
    from gradwatch.checks.nonfinite import defer_to_origin

    fix = fix_for(origin.op, origin.forward_op, origin.input_op)
    for i, f in enumerate(findings):
        restated = defer_to_origin(f, origin.op, origin.module, fix) if f.step == step else None
        if restated is not None:
            plain = dataclasses.replace(restated, data={k: v for k, v in restated.data.items() if k != "restates"})
            return restated, [*findings[:i], plain, *findings[i + 1:]]
    return None, findings


# -- the report -----------------------------------------------------------------------------------------
def saved_inputs(sources: Sequence[Call | Batch], culprit: Any) -> dict[str, Any] | None:
    """The inputs a report saves (``save_batch=True``): the culprit's (else the last source's), and every
    source's when the step had several."""
    chosen = next((s for s in sources if s is culprit), sources[-1] if sources else None)
    if isinstance(chosen, Batch):
        inputs: dict[str, Any] = {"batch": chosen.batch, "batch_idx": chosen.batch_idx}
        if len(sources) > 1:
            inputs["batches"] = [{"batch": b.batch, "batch_idx": b.batch_idx} for b in sources]  # type: ignore[union-attr]
        return inputs
    if chosen is None:
        return None
    inputs = {"args": chosen.args, "kwargs": chosen.kwargs}
    if len(sources) > 1:
        inputs["calls"] = [{"args": c.args, "kwargs": c.kwargs} for c in sources]  # type: ignore[union-attr]
    return inputs


def _replay_trace(result: ReplayResult | None) -> tuple[str | None, str | None]:
    """The forward traceback and anomaly mode's error of a replay, for the report."""
    if result is None:
        return None, None
    origin = result.loc.origin
    traceback = (origin.traceback if origin is not None else None) or result.anomaly_traceback
    return traceback, result.anomaly_error


@dataclasses.dataclass
class ReportFacts:
    """What an incident report holds besides the step's statistics."""

    findings: list[Finding]
    layers: list[dict[str, Any]]
    result: ReplayResult | None
    note: str | None
    sources: Sequence[Call | Batch]
    culprit: Any


def write_report(engine: Any, reports: list[str], stats: Any, facts: ReportFacts) -> None:
    """Write the incident report of ``stats``'s step (``.md``, ``.json``, ``.pt`` with ``save_batch``) and
    append its path to ``reports``; link it from the step's ``nan_origin``/``nonfinite_input`` findings."""
    log_dir = engine.log_dir  # None when the log directory could not be written (already reported)
    if not log_dir or not engine.rank_zero or len(reports) >= MAX_REPORTS:
        return
    save = bool(engine.config.save_batch)
    paths = incident_paths(log_dir, stats.step, stats.optimizer_index, save_batch=save)
    for f in facts.findings:
        if f.kind in ("nan_origin", "nonfinite_input") and f.step == stats.step:
            f.data["report"] = paths.markdown
    traceback, anomaly_error = _replay_trace(facts.result)
    inputs = saved_inputs(facts.sources, facts.culprit) if save else None
    try:
        write_incident(
            paths,
            step=stats.step,
            findings=facts.findings,
            layers=facts.layers,
            traceback=traceback,
            anomaly_error=anomaly_error,
            inputs=inputs,
            note=facts.note,
            run=engine.run_id,
        )
        reports.append(paths.markdown)
    except Exception as exc:  # noqa: BLE001
        internal_warning("incident report", exc, owner=engine)
