"""History: what the checks may look back on. Updated by the engine after each checked step."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gradwatch.core.stats import StepStats


@dataclass
class History:
    """Recent statistics per optimizer, kept small (O(window x layers)).

    Attributes:
        window: How many checked steps the rolling windows keep.
        last: The previous checked step's statistics, per optimizer index.
        total_norms: Recent finite total gradient norms, per optimizer index.
        layer_steps: The per-layer gradient norms of recent steps (one dict per checked step, newest
            last), per optimizer index; :meth:`layer_series` reads one layer's values from them.
        losses: Recent finite observed losses.
        reported: Keys of conditions already reported (so a persisting condition is reported once).
        memory: Free-form state for checks that need more than the above, keyed by check name.
    """

    window: int = 50
    last: dict[int, StepStats] = field(default_factory=dict)
    total_norms: dict[int, deque[float]] = field(default_factory=dict)
    layer_steps: dict[int, deque[dict[str, float]]] = field(default_factory=dict)
    losses: deque[float] = field(default_factory=deque)
    reported: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)

    def previous(self, optimizer_index: int) -> StepStats | None:
        return self.last.get(optimizer_index)

    def record(self, stats: StepStats, *, skipped: bool) -> None:
        """Add a checked step. Non-finite values and skipped steps stay out of the rolling windows."""
        i = stats.optimizer_index
        self.last[i] = stats
        if skipped or stats.is_nonfinite:
            return
        if stats.names and math.isfinite(stats.total_norm):
            totals = self.total_norms.get(i)
            if totals is None:  # made on its first use (``setdefault`` would build one every step)
                totals = self.total_norms[i] = deque(maxlen=self.window)
            totals.append(stats.total_norm)
            if stats.layer_norms:  # one append per step, not one per layer: this runs on every step
                layers = self.layer_steps.get(i)
                if layers is None:
                    layers = self.layer_steps[i] = deque(maxlen=self.window)
                layers.append(stats.layer_norms)
        if stats.loss is not None and math.isfinite(stats.loss):
            if self.losses.maxlen != self.window:
                self.losses = deque(self.losses, maxlen=self.window)
            self.losses.append(stats.loss)

    def layer_series(self, optimizer_index: int, layer: str) -> list[float]:
        """One layer's recent finite gradient norms, oldest first."""
        isfinite = math.isfinite
        out = []
        for d in self.layer_steps.get(optimizer_index, ()):
            v = d.get(layer)
            if v is not None and isfinite(v):
                out.append(v)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "total_norms": {k: list(v) for k, v in self.total_norms.items()},
            "layer_steps": {k: [dict(d) for d in v] for k, v in self.layer_steps.items()},
            "losses": list(self.losses),
            # Sets as sorted lists: checkpoints load with torch.load(weights_only=True), which refuses sets.
            "reported": {
                k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in self.reported.items()
            },
            "reported_sets": sorted(k for k, v in self.reported.items() if isinstance(v, (set, frozenset))),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        w = int(state.get("window", self.window))
        self.total_norms = {int(k): deque(v, maxlen=w) for k, v in state.get("total_norms", {}).items()}
        self.layer_steps = {
            int(k): deque((dict(d) for d in v), maxlen=w) for k, v in state.get("layer_steps", {}).items()
        }
        self.losses = deque(state.get("losses", []), maxlen=w)
        self.reported = dict(state.get("reported", {}))
        for k in state.get("reported_sets", ()):
            if k in self.reported:
                self.reported[k] = frozenset(self.reported[k])
