"""A run's record across checkpoints and at its end: the engine's counters and findings as plain data.

``state_of``/``load_state`` are the engine's ``state_dict``/``load_state_dict`` (a Lightning checkpoint
keeps them, so a resumed run goes on counting, and writing ``gradwatch.jsonl`` records under its own run
id); ``summary_of`` is what the console prints when the run closes.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Finding
from gradwatch.report.jsonl import JsonlReporter
from gradwatch.report.summary import RunSummary

if TYPE_CHECKING:
    from gradwatch.core.engine import Engine

#: Findings a checkpoint keeps (the latest).
FINDINGS_KEPT = 1000


def summary_of(engine: Engine, norm_samples: list[float]) -> RunSummary:
    """The run's summary: steps, skips, findings per kind (with the first step of each), norm range."""
    samples = sorted(norm_samples)
    return RunSummary(
        steps=sum(engine.step_counts),
        steps_checked=engine.steps_checked,
        steps_skipped=engine.steps_skipped,
        kind_counts=dict(engine.kind_counts),
        first_step={k: min(f.step for f in engine.findings if f.kind == k) for k in engine.kind_counts},
        norm_min=samples[0] if samples else None,
        norm_median=samples[len(samples) // 2] if samples else None,
        norm_max=samples[-1] if samples else None,
        log_dir=engine.log_dir,
    )


def state_of(engine: Engine) -> dict[str, Any]:
    return {
        "steps_checked": engine.steps_checked,
        "steps_skipped": engine.steps_skipped,
        "consecutive_skips": engine.consecutive_skips,
        "step_counts": list(engine.step_counts),
        "kind_counts": dict(engine.kind_counts),
        "findings": [f.to_dict() for f in engine.findings[-FINDINGS_KEPT:]],
        "history": engine.history.state_dict(),
        "run": engine.run_id,
    }


def load_state(engine: Engine, state: dict[str, Any]) -> None:
    engine.steps_checked = int(state.get("steps_checked", 0))
    engine.steps_skipped = int(state.get("steps_skipped", 0))
    engine.consecutive_skips = int(state.get("consecutive_skips", 0))
    counts = list(state.get("step_counts", []))
    for i in range(min(len(counts), len(engine.step_counts))):
        engine.step_counts[i] = int(counts[i])
    engine.kind_counts = Counter({str(k): int(v) for k, v in state.get("kind_counts", {}).items()})
    engine.findings = [Finding.from_dict(d) for d in state.get("findings", [])]
    engine.history.load_state_dict(state.get("history", {}))
    run = state.get("run")
    if isinstance(run, str) and run != engine.run_id:
        _continue_run(engine, run)


def _continue_run(engine: Engine, run: str) -> None:
    """A run resumed from its checkpoint: gradwatch.jsonl records go on under the checkpoint's run id."""
    engine.run_id = run
    jsonl = engine.reporters.of_type(JsonlReporter)
    if jsonl is None:
        return
    try:
        jsonl.continue_run(run, at_step=min(engine.step_counts))
    except Exception as exc:  # noqa: BLE001 - a record that cannot be written must not stop the resume
        internal_warning("JsonlReporter.continue_run", exc, owner=jsonl, key="JsonlReporter")
