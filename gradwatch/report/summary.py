"""The run summary: a result object that renders itself (console table at close, ``gradwatch summary``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RunSummary:
    """Totals of one watched run.

    Attributes:
        steps: Optimizer steps seen (all optimizers).
        steps_checked: Steps gradwatch checked.
        steps_skipped: Updates gradwatch skipped (non-finite).
        kind_counts: Findings per kind.
        first_step: First step of each kind.
        norm_min, norm_median, norm_max: Total gradient norm over healthy checked steps.
        log_dir: Where TensorBoard events and gradwatch.jsonl went, if anywhere.
    """

    steps: int = 0
    steps_checked: int = 0
    steps_skipped: int = 0
    kind_counts: dict[str, int] = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)
    norm_min: float | None = None
    norm_median: float | None = None
    norm_max: float | None = None
    log_dir: str | None = None

    @property
    def healthy(self) -> bool:
        return not self.kind_counts and not self.steps_skipped

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        t = Table(title="gradwatch summary", title_justify="left", show_header=True, expand=False)
        t.add_column("", style="bold")
        t.add_column("value", justify="right")
        t.add_row("steps watched", str(self.steps))
        t.add_row("steps checked", str(self.steps_checked))
        t.add_row("updates skipped", str(self.steps_skipped))
        if self.norm_median is not None:
            t.add_row(
                "grad norm min / median / max",
                f"{self.norm_min:.3g} / {self.norm_median:.3g} / {self.norm_max:.3g}",
            )
        if self.kind_counts:
            for kind, n in sorted(self.kind_counts.items(), key=lambda kv: self.first_step.get(kv[0], 0)):
                t.add_row(f"findings: {kind}", f"{n} (first at step {self.first_step.get(kind, '?')})")
        else:
            t.add_row("findings", "none: gradients healthy")
        if not self.log_dir:
            return t
        # Below the table, not in a cell: a cell cuts a long path ("…/pl_healthy/vers…") to its width,
        # while text folds onto the next line, so the whole path is always there to copy.
        logs = Text.assemble(("logs: ", "bold"), f"tensorboard --logdir {self.log_dir}", overflow="fold")
        return Group(t, logs)
