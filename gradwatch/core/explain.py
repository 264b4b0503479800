"""Explaining an exception the training code raised: which findings say what went wrong.

An autograd error is explained by :mod:`gradwatch.diagnose.autograd`; an error raised on a NaN/Inf
that no check saw yet (``clip_grad_norm_(error_if_nonfinite=True)``, a user's assert) is localized like a
checked step's incident; an error raised before any backward is matched against NaN/Inf data by the
escalation. The engine records the findings and remembers the exception it explained.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gradwatch.core.closure_guard import nonfinite_now
from gradwatch.core.findings import Finding
from gradwatch.core.stats import StepStats
from gradwatch.diagnose.escalation import Escalation
from gradwatch.observe.amp import AmpMonitor

if TYPE_CHECKING:
    from gradwatch.core.engine import Engine

#: ``(exception, step, the anomaly-mode finding) -> findings``: a NaN born in the forward pass, localized.
ForwardBorn = Callable[[BaseException, int, Finding], list[Finding]]


def exception_findings(engine: Engine, exc: BaseException, step: int, forward_born: ForwardBorn) -> list[Finding]:
    """The findings that explain ``exc``, raised at ``step``, first the main one (may be empty)."""
    from gradwatch.diagnose import autograd

    finding = autograd.explain(exc, engine=engine, step=step)
    esc = engine.extension(Escalation)
    if finding is not None and finding.kind == "no_grad_graph" and esc is not None:
        finding = esc.explain_no_graph(finding)  # a reentrant checkpoint cut the graph, not frozen layers
    if finding is not None and finding.data.get("loss_nonfinite"):
        found = forward_born(exc, step, finding)
    else:
        found = [finding] if finding is not None else unchecked_nonfinite(engine, exc, step)
    if not found and esc is not None:
        # Raised before any backward (a loss that refuses a NaN input): NaN/Inf data named anyway.
        found = [f for f in [esc.forward_error(exc, step)] if f is not None]
    return found


def unchecked_nonfinite(engine: Engine, exc: BaseException, step: int) -> list[Finding]:
    """The training code raised before gradwatch checked the step (``clip_grad_norm_`` with
    ``error_if_nonfinite=True``, a user's own NaN assert): a NaN/Inf it met is still named, then localized
    like a checked step's (the error path: a few syncs, a replay)."""
    from gradwatch.checks import nonfinite

    if engine.blocked_at == sum(engine.step_counts):
        return []  # this step's check found them (and said so); no update ran since
    losses = engine.ledger.losses
    bad_loss, bad, counts, total = nonfinite_now(engine.index, list(range(len(engine.index.per_optimizer))), losses)
    if bad_loss is None and not bad:
        return []
    observed = bool(losses)
    engine.drop_losses()
    amp = engine.extension(AmpMonitor)
    if amp is not None and bad_loss is None:
        # A GradScaler's overflow (Inf of the scaled backward) is no NaN incident: say so, and how to clip.
        overflow = amp.raised_on_overflow(exc, step, bad, counts, total, observed)
        if overflow is not None:
            return [overflow]
    finding = nonfinite.raised_before_check(step, exc, bad_loss, bad, counts, total)
    # The pre-step hook that localizes an incident never ran: localize it here, the same way (the NaN
    # batch named as nonfinite_input, or the op as nan_origin). The exception itself is left as it is.
    stats = StepStats(step=step, loss=bad_loss, loss_nonfinite=bad_loss is not None, nonfinite=tuple(bad),
                      nan_counts=dict(counts[0]), inf_counts=dict(counts[1]))
    stats.extra["raised"] = type(exc).__name__
    found = [finding]
    found += engine.incident(stats, found)  # may restate ``finding`` in place
    return found
