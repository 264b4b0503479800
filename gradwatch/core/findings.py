"""Findings: what gradwatch reports, as data that renders itself.

A :class:`Finding` names what went wrong (``kind``), when (``step``), where (``params``, ``module``,
``op``), why it matters and how to fix it (``explanation``, rendered as ``message``), plus machine-readable
details (``data``). Reporters (console, TensorBoard, JSON lines) only format findings; they never decide anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "error"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "error")

_SEVERITY_STYLE = {"info": "cyan", "warning": "yellow", "error": "bold red"}

#: How many parameter names a rendered finding lists before it says "and N more".
MAX_NAMES_SHOWN = 8
#: Rows of a finding's table shown on the console (all of them are in ``data["table"]``).
MAX_ROWS_SHOWN = 10

#: Kinds that describe one non-finite incident, in the order the console leads with them: where the NaN
#: came from first, its consequences after.
INCIDENT_KINDS: tuple[str, ...] = (
    "scaler_step_bypassed",  # the gradients still carry a GradScaler's scale: the cause of what follows
    "nonfinite_input",
    "nan_origin",
    "nonfinite_on_other_rank",
    "nonfinite_loss",
    "nonfinite_grad",
    "nonfinite_update",
)


@dataclass(frozen=True)
class Explanation:
    """What a finding says, in parts: what happened (where, when), the likely cause, why it matters, the fix.

    A finding's ``message`` is rendered from it (:meth:`render`), so a program reads the fix from
    ``finding.explanation.fix`` and never parses the message.

    Example:
        >>> Explanation("Loss is NaN at step 3.", fix="lower the learning rate.").render()
        'Loss is NaN at step 3.\\nFix: lower the learning rate.'
    """

    what: str
    why: str = ""
    cause: str = ""
    fix: str = ""

    def render(self) -> str:
        """The message: ``what``, then ``Cause:``, ``Why it matters:`` and ``Fix:`` paragraphs, each if set."""
        labelled = (("Cause: ", self.cause), ("Why it matters: ", self.why), ("Fix: ", self.fix))
        return "\n".join([self.what, *(label + text for label, text in labelled if text)])

    def to_dict(self) -> dict[str, str]:
        return {"what": self.what, "why": self.why, "cause": self.cause, "fix": self.fix}


@dataclass(frozen=True)
class Finding:
    """One thing gradwatch noticed about the run.

    Attributes:
        kind: Stable identifier, e.g. ``"nonfinite_grad"``, ``"none_grad"``.
        step: Index of the optimizer step the finding concerns (optimizer steps completed before it;
            in Lightning ``trainer.global_step``).
        severity: ``"info"``, ``"warning"`` or ``"error"``.
        message: What happened, why it matters and what to change, in plain words.
        params: Qualified names of the parameters concerned.
        module: Qualified name of the module concerned, if one can be named.
        op: Autograd or forward op concerned (e.g. ``"SqrtBackward0"``), if one can be named.
        data: Machine-readable details (counts, norms, rank, ...). JSON-serialisable.
        explanation: The message in parts (what, why, cause, fix), when the finding was built from them;
            ``message`` is then rendered from it. ``None`` for a finding built from a message alone.

    Example:
        >>> f = Finding(kind="none_grad", step=3, severity="warning", message="...", params=("head.bias",))
        >>> f.where
        'head.bias'
    """

    kind: str
    step: int
    severity: Severity
    message: str = ""
    params: tuple[str, ...] = ()
    module: str | None = None
    op: str | None = None
    data: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    explanation: Explanation | None = field(default=None, compare=False, hash=False, repr=False)
    # the explanation ``message`` was rendered from: ``dataclasses.replace(f, explanation=...)`` re-renders it
    _rendered_from: Explanation | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.explanation is None:
            return
        rendered = self.explanation.render()
        stale = self._rendered_from is not None and self.message == self._rendered_from.render()
        if self.message and self.message != rendered and not stale:
            # dataclasses.replace(f, message=...) on an explained finding: change the explanation instead
            raise ValueError(f"Finding {self.kind!r}: give an explanation or a message, not two different texts")
        object.__setattr__(self, "message", rendered)
        object.__setattr__(self, "_rendered_from", self.explanation)

    @property
    def fix(self) -> str:
        """The fix, from the explanation ("" for a finding built from a message alone)."""
        return self.explanation.fix if self.explanation else ""

    @property
    def where(self) -> str:
        """A short human description of where the problem is."""
        parts: list[str] = []
        if self.op:
            parts.append(f"op {self.op}")
        if self.module:
            parts.append(f"module {self.module}")
        if self.params and not self.module:
            parts.append(_names(self.params))
        return ", ".join(parts)

    @property
    def title(self) -> str:
        """One line: kind, step and place."""
        where = self.where
        return f"[{self.kind}] step {self.step}" + (f" — {where}" if where else "")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (non-finite floats become strings)."""
        return {
            "kind": self.kind,
            "step": self.step,
            "severity": self.severity,
            "message": self.message,
            "params": list(self.params),
            "module": self.module,
            "op": self.op,
            "data": jsonable(self.data),
            **({"explanation": self.explanation.to_dict()} if self.explanation else {}),
        }

    def to_json(self) -> str:
        """One line of JSON."""
        return json.dumps(self.to_dict(), allow_nan=False, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        """Inverse of :meth:`to_dict`."""
        parts = d.get("explanation")
        explanation = Explanation(**{k: str(v) for k, v in parts.items()}) if isinstance(parts, dict) else None
        return cls(
            kind=str(d["kind"]),
            step=int(d["step"]),
            severity=d.get("severity", "warning"),
            message="" if explanation else str(d.get("message", "")),
            explanation=explanation,
            params=tuple(d.get("params") or ()),
            module=d.get("module"),
            op=d.get("op"),
            data=dict(d.get("data") or {}),
        )

    def __str__(self) -> str:
        return f"{self.title}\n{self.message}"

    def __rich__(self) -> Any:
        return panel(self, [])

    @property
    def headline(self) -> str:
        """The message's first paragraph: what happened, without the why and the fix."""
        return self.message.split("\n", 1)[0]


def display_order(findings: list[Finding]) -> list[Finding]:
    """One step's findings in the order they are shown (console and incident reports alike): those of one
    non-finite incident first, led by the most severe and, among equals, by where the NaN came from
    (:data:`INCIDENT_KINDS` order); the incident's other findings next, then the rest, each in their order.

    Example:
        >>> grad = Finding(kind="nonfinite_grad", step=5, severity="error", message="...")
        >>> origin = Finding(kind="nan_origin", step=5, severity="error", message="...")
        >>> [f.kind for f in display_order([grad, origin])]
        ['nan_origin', 'nonfinite_grad']
    """
    incident = [f for f in findings if f.kind in INCIDENT_KINDS]
    if not incident:
        return list(findings)
    head = min(incident, key=lambda f: (-SEVERITIES.index(f.severity), INCIDENT_KINDS.index(f.kind)))
    rest = [f for f in findings if f.kind not in INCIDENT_KINDS]
    return [head, *(f for f in incident if f is not head), *rest]


def incident_panel(head: Finding, others: list[Finding]) -> Any:
    """One panel for one step's findings of one incident: ``head`` in full (where it was born, its fix),
    the others by their first paragraph (their tables and generic fixes are in the JSON lines)."""
    return panel(head, others)


def panel(f: Finding, others: list[Finding]) -> Any:
    """The rich panel of finding ``f``: its message and table, then one line per finding of ``others``."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    renderables: list[Any] = [Text(f.message)]
    table = f.data.get("table")
    if isinstance(table, list) and table:
        renderables.append(_table(table))
    if others:
        renderables.append(Text(f"\nAlso at step {f.step}:", style="bold"))
        renderables += [Text(f"- {o.kind}: {o.headline}") for o in others]
    severity = max([f, *others], key=lambda x: SEVERITIES.index(x.severity)).severity
    style = _SEVERITY_STYLE.get(severity, "white")
    also = f" (+{len(others)} related)" if others else ""
    return Panel(
        renderables[0] if len(renderables) == 1 else Group(*renderables),
        title=Text(f"gradwatch {severity}: {f.kind} at step {f.step}{also}", style=style),
        title_align="left",
        border_style=style,
        expand=False,
    )




class GradWatchError(RuntimeError):
    """Raised by gradwatch's ``"raise"`` policy; carries the findings that caused it.

    Attributes:
        findings: The findings of the step that raised.
    """

    def __init__(self, message: str, findings: list[Finding] | tuple[Finding, ...] = ()) -> None:
        super().__init__(message)
        self.findings: tuple[Finding, ...] = tuple(findings)


def _names(names: tuple[str, ...] | list[str], limit: int = MAX_NAMES_SHOWN) -> str:
    shown = ", ".join(names[:limit])
    more = len(names) - limit
    return shown + (f" and {more} more" if more > 0 else "")


def names_text(names: tuple[str, ...] | list[str], limit: int = MAX_NAMES_SHOWN) -> str:
    """Comma-separated names, cut after ``limit`` with "and N more"."""
    return _names(names, limit)


def _table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    columns = list(rows[0].keys())
    t = Table(box=None, pad_edge=False, show_edge=False)
    for c in columns:
        t.add_column(c, justify="left" if c in ("param", "module", "layer", "name") else "right")
    for r in rows[:MAX_ROWS_SHOWN]:
        t.add_row(*[_fmt(r.get(c)) for c in columns])
    if len(rows) > MAX_ROWS_SHOWN:
        t.add_row(f"... {len(rows) - MAX_ROWS_SHOWN} more", *[""] * (len(columns) - 1))
    return t


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.3g}"
    return "" if v is None else str(v)


def jsonable(v: Any) -> Any:
    """``v`` as plain JSON values: NaN and Inf as strings, tuples as lists, keys and other objects as strings."""
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return v
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, (str, int, bool)) or v is None:
        return v
    return str(v)
