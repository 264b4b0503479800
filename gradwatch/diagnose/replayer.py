"""Localizing an incident: which of the step's captured calls (batches) to replay, in which order, and the
replays themselves, run so that they leave no trace (the engine and the capture know a replay is running).

:class:`Replayer` is the stateful shell over :mod:`gradwatch.diagnose.replay`'s functions: it remembers the
call that went non-finite (``culprit``) and the collective a replay stopped at (``collective``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gradwatch.core.failures import internal_warning
from gradwatch.diagnose.capture import Batch, Call
from gradwatch.diagnose.graph_walk import loss_op_inputs, loss_ops
from gradwatch.diagnose.localize import Localization
from gradwatch.diagnose.replay import (
    ReplayResult,
    checkpoint_not_reentrant,
    lightning_order,
    no_collectives,
    replay_call,
    replay_lightning,
    replay_model,
    replay_verdict,
    screen_call,
    suspect_calls,
    unscreened,
    upstream_state,
)
from gradwatch.diagnose.step_capture import StepCapture
from gradwatch.diagnose.window import EscalationWindow


class Replayer:
    """Finds where a step's NaN/Inf was born: the live localizer's record of an escalated step, else replays.

    Attributes:
        culprit: The call (batch) whose replay saw the non-finite value, None before one did.
        collective: The torch.distributed collective a replay stopped at (see ``no_collectives``), None when
            it ran through.
    """

    def __init__(self, capture: StepCapture, window: EscalationWindow) -> None:
        self.capture = capture
        self.window = window
        self.engine: Any = None
        self.model: nn.Module | None = None
        self.culprit: Any = None
        self.collective: str | None = None

    def localize(self) -> ReplayResult | None:
        """The escalated step's own record when it explains the incident, else the first replay that does."""
        loc = self.window.resolve_live()
        if loc is not None:
            result = self._live_result(loc)
            if result.loss_born:
                result.loss_ops = loss_ops(self.capture.calls)
                result.loss_inputs = loss_op_inputs(self.capture.calls)
            if result.named or result.loss_born:
                return result
        self.collective = None
        for src in self._order():
            try:
                result = self._replay(src)
            except Exception as exc:  # noqa: BLE001 - a failed replay must not fail the step
                if self.collective is not None:
                    return None  # stopped at a collective (see replay_verdict)
                internal_warning("Escalation.replay", exc, owner=self.engine)
                continue
            verdict = replay_verdict(result, self.collective is not None)
            if verdict == "stop":
                return None  # another rank may still name the origin
            if verdict == "found":
                self.culprit = src
                if result.loss_born:
                    result.loss_ops = loss_ops(self.capture.calls)
                    result.loss_inputs = loss_op_inputs(self.capture.calls)
                return result
        return None

    def _live_result(self, loc: Localization) -> ReplayResult:
        """What the escalated step itself showed (the live localizer recorded its forward and backward)."""
        calls = self.capture.calls
        upstream_bad, _available = upstream_state(calls)
        result = ReplayResult(loc, replayed=False, surrogate=False, upstream_bad=upstream_bad)
        flags = [c.output_ok for c in calls if c.output_ok is not None]
        result.output_ok = torch.stack([f.to(flags[0].device) for f in flags]).all() if flags else None
        return result

    def _order(self) -> Iterator[Any]:
        """The step's calls (batches) to replay, those that saw the non-finite value first (lazily: the
        caller stops at the first that localizes it).

        Plain loop: calls whose output gradient or loss was non-finite (at most ``MAX_REPLAYS``), then the
        first other call whose plain, unlocalized replay turns non-finite (a NaN born inside the model
        leaves the output gradient finite). Lightning: batches whose loss was non-finite, then the others
        (``training_step`` is the only way to replay them), at most ``MAX_REPLAYS`` in all.
        """
        sources = self.capture.sources()
        if len(sources) <= 1:
            yield from sources
        elif self.capture.integration == "lightning":
            yield from lightning_order(sources)
        else:
            suspects = suspect_calls(sources)
            yield from suspects
            yield from self._screened(sources, suspects)

    def _screened(self, calls: list[Call], suspects: list[Call]) -> Iterator[Call]:
        """The first call besides ``suspects`` whose plain replay turns non-finite."""
        try:
            for call in calls:
                if not any(call is c for c in suspects) and screen_call(self.replay_model(), call, self.guard):
                    yield call
                    return
        except Exception as exc:  # noqa: BLE001 - a failed screening: replay the held calls as they are
            if self.collective is not None:
                return  # the forward (or backward) runs a collective: no replay on this rank alone
            internal_warning("Escalation.replay", exc, owner=self.engine)
            yield from unscreened(calls, suspects)

    def _replay(self, src: Call | Batch) -> ReplayResult:
        if isinstance(src, Batch):
            return replay_lightning(src, self.guard, self)
        return replay_call(self.replay_model(), src, self.guard, self)

    def replay_model(self) -> nn.Module:
        assert self.model is not None
        return replay_model(self.model)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around a replay: the live localizer paused, captures and updates off, reentrant checkpoints run
        non-reentrant, collectives stop the replay."""
        with self.window.paused():
            self.capture.replaying = True
            self.engine.replaying = True
            try:
                with checkpoint_not_reentrant(), no_collectives(self):
                    yield
            finally:
                self.capture.replaying = False
                self.engine.replaying = False
