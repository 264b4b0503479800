"""The escalation window: for ``escalate_steps`` optimizer steps after an incident, anomaly mode is on
(forward tracebacks) and, in a plain loop, a live :class:`~gradwatch.diagnose.localize.Localizer` records the
real forward and backward. When the window closes, anomaly mode is put back as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from gradwatch.diagnose.localize import Localization, Localizer
from gradwatch.diagnose.replay import checkpoint_not_reentrant
from gradwatch.observe.module_hooks import owned


class EscalationWindow:
    """State of the escalation window: steps left, anomaly mode as it was, the live localizer.

    Attributes:
        left: Optimizer steps the window stays open (0: closed).
        start: The step it opened at.
        live: The live localizer (plain loop, uncompiled model), None otherwise.
        live_used: The live localizer hooked a forward's graph since its last reset.
    """

    def __init__(self) -> None:
        self.left = 0
        self.start: int | None = None
        self.live: Localizer | None = None
        self.live_used = False
        self._anomaly_prev: tuple[bool, bool] | None = None
        # Reentrant checkpointing swapped for the non-reentrant kind during an escalated forward (see
        # checkpoint_not_reentrant): the live localizer then sees the segment's ops too.
        self._unnested: Any = None
        self._hooks: list[Any] = []

    @property
    def is_open(self) -> bool:
        return self.left > 0

    def open(self, step: int, steps: int) -> bool:
        """Open for ``steps`` optimizer steps from ``step``; False when it was open already."""
        if self.left > 0:
            return False
        self.left = steps
        self.start = step
        return True

    def localize(self, model: nn.Module, forward_end: Callable[..., Any]) -> None:
        """Record the real forwards of ``model`` with a live localizer (``forward_end``: the root's forward hook)."""
        self.live = Localizer(model)
        self.live.install_module_hooks()
        end = model.register_forward_hook(forward_end, with_kwargs=True, always_call=True)
        self._hooks.append(owned(model, end))

    def count_step(self, step: int) -> bool:
        """An optimizer step (the first optimizer's) ended: True when the window has run out."""
        if self.left > 0 and step != self.start:
            self.left -= 1
            return self.left <= 0
        return False

    def close(self) -> None:
        self.restore_checkpoint()
        self.left = 0
        self.start = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.live is not None:
            self.live.close()
            self.live = None
        self.live_used = False
        self.anomaly_restore()

    def anomaly_on(self) -> None:
        if self._anomaly_prev is None:
            self._anomaly_prev = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        # check_nan=False: anomaly mode records forward tracebacks; gradwatch itself checks NaN and Inf,
        # so a NaN never raises out of the user's backward() under "warn"/"skip". A user who turned anomaly
        # mode on with its NaN check (Trainer(detect_anomaly=True)) keeps it: their run stops at a NaN.
        enabled, check_nan = self._anomaly_prev
        torch.set_anomaly_enabled(True, bool(enabled and check_nan))

    def anomaly_restore(self) -> None:
        if self._anomaly_prev is not None:
            enabled, check_nan = self._anomaly_prev
            torch.set_anomaly_enabled(enabled, check_nan)
            self._anomaly_prev = None

    def forward_start(self) -> None:
        """The root model's forward starts in the window (called from its forward pre-hook)."""
        self.anomaly_on()
        if self.live is not None:
            self.live.start(inside_root=True)
            if self._unnested is None:
                self._unnested = checkpoint_not_reentrant()
                self._unnested.__enter__()

    def restore_checkpoint(self) -> None:
        cm, self._unnested = self._unnested, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def reset_live(self) -> None:
        """A new step: forget what the live localizer recorded."""
        if self.live is not None:
            self.live.reset()
            self.live_used = False

    def resolve_live(self) -> Localization | None:
        """What the live localizer recorded of this step (None when it hooked no forward), then reset it."""
        live = self.live
        if live is None or not self.live_used:
            return None
        try:
            return live.resolve()
        finally:
            live.reset()
            self.live_used = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The live localizer records nothing meanwhile (a replay runs)."""
        live = self.live
        was_recording = live.recording if live is not None else False
        if live is not None:
            live.recording = False
        try:
            yield
        finally:
            if live is not None:
                live.recording = was_recording
