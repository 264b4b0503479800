"""Console reporter: quiet on healthy steps, one clear panel per finding (one per non-finite incident), a
summary table at close.

Prints through rich's global console by default, which renders above rich progress bars (including
Lightning's ``RichProgressBar``); when tqdm bars are active the print is wrapped in
``tqdm.external_write_mode()`` so the bar line is redrawn instead of broken.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

from gradwatch.core.failures import host_rng_kept
from gradwatch.core.findings import INCIDENT_KINDS, Finding, display_order, incident_panel


class ConsoleReporter:
    """Prints findings (rate-limited per kind) and the run summary.

    Args:
        console: A ``rich.console.Console``; ``None`` uses ``rich.get_console()`` at each print, so a
            progress bar that reconfigures the global console is respected.
        rate_limit: Findings of one kind printed before further ones are only counted.
        rank_zero: Only this process prints (others stay silent).
    """

    def __init__(self, console: Any = None, rate_limit: int = 3, rank_zero: bool = True) -> None:
        self._console = console
        self.rate_limit = rate_limit
        self.rank_zero = rank_zero
        self.printed: Counter[str] = Counter()
        self.suppressed: Counter[str] = Counter()

    @property
    def console(self) -> Any:
        if self._console is not None:
            return self._console
        import rich

        return rich.get_console()

    def print(self, *renderables: Any) -> None:
        if not self.rank_zero:
            return
        with host_rng_kept(), _tqdm_safe():  # rich's first import draws from ``random``
            self.console.print(*renderables)

    def finding(self, finding: Finding) -> None:
        if self._admit(finding):
            self.print(finding)

    def findings(self, findings: list[Finding]) -> None:
        """One step's findings: those of one non-finite incident (the loss, the gradients, where the NaN was
        born) share one panel, the place it was born first; the others get a panel each."""
        # The most severe leads (a hedged "the batch also holds NaN" warning follows the error's origin).
        shown = display_order([f for f in findings if self._admit(f)])
        together = sum(f.kind in INCIDENT_KINDS for f in shown)
        if together > 1:
            self.print(incident_panel(shown[0], shown[1:together]))
            shown = shown[together:]
        for f in shown:
            self.print(f)

    def _admit(self, finding: Finding) -> bool:
        if self.printed[finding.kind] >= self.rate_limit:
            self.suppressed[finding.kind] += 1
            if self.suppressed[finding.kind] == 1:
                self.print(
                    f"[dim]gradwatch: further '{finding.kind}' findings are recorded but not printed "
                    f"(rate_limit={self.rate_limit}); see the summary or gradwatch.jsonl.[/dim]"
                )
            return False
        self.printed[finding.kind] += 1
        return True

    def close(self, summary: Any) -> None:
        if summary is not None:
            self.print(summary)


@contextlib.contextmanager
def _tqdm_safe() -> Iterator[None]:
    tqdm_mod = sys.modules.get("tqdm")
    cls = getattr(tqdm_mod, "tqdm", None) if tqdm_mod is not None else None
    instances = getattr(cls, "_instances", None)
    if cls is not None and instances:
        with cls.external_write_mode():
            yield
    else:
        yield
