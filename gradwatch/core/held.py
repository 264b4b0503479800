"""Findings held until the step's gradients are final, for words that depend on clipping after the check.

Lightning runs the callbacks' ``on_before_optimizer_step`` (where gradwatch checks) before the LightningModule's
own ``on_before_optimizer_step``: a module that clips there (``clip_grad_norm_(self.parameters(), 1.0)``) does
so after the check. A finding whose words depend on whether the update is clipped (an exploding gradient: "clip
gradients" or "clipping is in place") is held when nothing was known to clip at the check, and released at the
optimizer step, when the gradients are final: their total norm is measured then (one read, on such a step
only), and when clipping scaled them down, the finding is worded again from that measured clip ratio (the
kinds that can be, and how, are the ``CLIPPED_AFTER_CHECK`` tables of the check modules).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gradwatch.core.clipping import clipping_in_place, note_clipped_after_check
from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats

#: kind -> ``(finding, stats with the measured clipping, history) -> the finding worded again``.
Reword = Callable[[Finding, StepStats, History], Finding]

#: The final total norm at most this fraction of the checked one: the gradients were scaled down (clipped).
CLIPPED_BELOW = 1.0 - 1e-3


class HeldFindings:
    """One step's findings waiting for the step's final gradients (see the module docstring)."""

    def __init__(self, rewords: dict[str, Reword]) -> None:
        self.rewords = rewords
        self._held: tuple[StepStats, list[Finding]] | None = None

    def wants(self, stats: StepStats, findings: list[Finding]) -> bool:
        """A finite step with a finding worded by whether the update is clipped, and no clipping known yet."""
        if stats.is_nonfinite or not stats.names or not (stats.total_norm > 0 and math.isfinite(stats.total_norm)):
            return False
        return any(f.kind in self.rewords for f in findings) and clipping_in_place(stats) is None

    def hold(self, stats: StepStats, findings: list[Finding]) -> None:
        self._held = (stats, list(findings))

    @property
    def holding(self) -> bool:
        return self._held is not None

    def release(self, history: History, measure: bool = True, owner: Any = None) -> list[tuple[Finding, Finding]]:
        """The held findings as ``(held, to report)``, worded again when the gradients were clipped since the
        check (``measure``: the gradients now are this step's final ones). Nothing held: []."""
        held, self._held = self._held, None
        if held is None:
            return []
        stats, findings = held
        try:
            ratio = _final_ratio(stats) if measure else None
            if ratio is None or ratio > CLIPPED_BELOW:
                return [(f, f) for f in findings]
            note_clipped_after_check(stats, ratio)
            return [(f, self.rewords[f.kind](f, stats, history) if f.kind in self.rewords else f) for f in findings]
        except Exception as exc:  # noqa: BLE001 - the findings are reported as they were worded
            internal_warning("held findings", exc, owner=owner)
            return [(f, f) for f in findings]


def _final_ratio(stats: StepStats) -> float | None:
    """The total norm of the step's gradients now over the one checked (before clipping), or None when they
    cannot be compared (a gradient gone, or sharded: a DTensor's norm is its shard's)."""
    params: Any = stats.extra.get("params") or ()
    grads = [p.grad for p in params]
    if not grads or not all(type(g) is torch.Tensor and not g.is_sparse for g in grads):
        return None
    now = float(torch.nn.utils.get_total_norm(grads, norm_type=2.0))  # the one read, on a held step only
    return now / stats.total_norm if math.isfinite(now) else None
