"""Observe whether each step's gradients were cleared since the previous step (forgotten ``zero_grad``).

The facts come from the gradients themselves, not from patching ``zero_grad`` (Lightning's manual
optimization bypasses patched instances and never fires ``on_before_zero_grad``). Per optimizer, one
representative parameter (the smallest trainable one, one the model does not own if the optimizer holds
such; re-picked when it holds no gradient at a check while others do, or when no backward pass reached
it since the previous check) carries two hooks, so the cost is two Python calls per backward pass,
whatever the model's size (two more in a distributed run, see ``reread_after_backward``):

- a tensor hook, which runs before the incoming gradient is accumulated, while ``p.grad`` still holds
  the old value: it sees whether the old gradient was set to None, replaced, or modified in place
  (``grad._version`` moves by one per accumulation and by one for ``zero_()`` / ``zero_grad(set_to_none=False)``);
- a post-accumulate hook, which counts the backward passes that accumulated into ``p.grad``.

At each check the representative's gradient is compared with the one the previous check saw (by weak
reference: a freed gradient's ``id()`` is reused at once):

- None, another tensor, or a version bump beyond the counted accumulations: cleared since the previous
  step ("fresh").
- The same tensor, only accumulations in between: either ``zero_grad`` was forgotten or the gradient was
  zeroed through ``.data`` (no version bump). Only in this case the tensor hook queues a lazy device
  scalar "the old gradient holds a non-zero" (one tiny kernel on the representative, no sync); it is read
  with the step's one sync. All zeros: fresh. Otherwise the step's gradient holds the previous step's:
  ``stats.extra["zero_grad_missing"] = True``.

A second parameter per optimizer, the *sentinel*, carries no hook: from another part of the model (the
least shared module path), only its gradient's identity and version are compared at each check (O(1)).
``zero_grad()`` on one submodule clears one of the two only. If the representative was cleared and the
sentinel kept its gradient, the hooks move to the sentinel; if the representative accumulated and the
sentinel's gradient was set to None or replaced, ``zero_grad_missing`` waits one check. Either way every
parameter's gradient (reference, version) is kept once, and the next check names the parameters that
accumulated (``"kept_params"``) and those cleared (``"cleared_params"``). Partial clearing in place
(``zero_grad(set_to_none=False)`` on the part the representative is not in) is not told apart: a version
bump of the sentinel may as well be one more backward pass.

``grads_cleared_before_step``: backward passes reached the representative since the previous check, but
at step time the optimizer has no gradient at all, or every gradient is zero after an in-place change
that came after the last backward (``zero_grad(set_to_none=False)`` called between ``backward()`` and
``step()``). Telling the latter from an all-zero gradient that was merely clipped needs the gradient's
value right after backward: on the first step, and once a step looks like that, the post-accumulate hook
queues one lazy scalar per backward until a step no longer does, so such a finding comes at step 0 or one
step after the first suspicious one.

``zero_grad_in_accumulation`` needs the step's gradient to be the last backward pass's. Clipping or
unscaling it in place after that pass keeps it so; writing other values into it (``p.grad.copy_(summed)``
in a DP-SGD loop written by hand) does not. The tensor hook counts the passes since the gradient was last
found cleared between two passes (``kept_passes``): 1 means the step holds its last pass only, whether each
pass cleared the one before or one ``zero_grad`` right before the last discarded the accumulated ones
(Accelerate's ``accumulate()`` with ``zero_grad()`` at its top). On the first step, and once a step had 3+
backward passes ending so, one parameter with at least 16 elements gets a third hook (until a step no longer
has them), which keeps a
16-element strided sample of its gradient after each backward pass (taken again at the end of the backward
call, after DDP's reducer wrote the averaged gradient into ``.grad``); a step whose gradient changed in place
after its last pass queues one lazy flag: is it still a multiple of that sample?

With one optimizer the same two hooks also tell the engine which observed losses belong to the
step: a backward pass that finds the gradient cleared since the previous backward pass (``zero_grad``
with no optimizer step in between: a batch the training code skipped, or one a GradScaler dropped)
moves the losses observed up to that previous pass aside, so they never decide the next step's update.
A GradScaler's dropped step (``scaler.update()`` wrote the scale with no optimizer step) ends the backward
passes counted for the next update, as a step does: they were the dropped step's.

Facts written to ``stats.extra``: ``"zero_grad"`` (:class:`gradwatch.core.stats.ZeroGradFacts`: optimizer,
representative parameter, backward passes counted, kept passes, state, the step of the previous check,
whether Lightning's automatic optimization clears the gradients), ``"zero_grad_missing"``,
``"grads_cleared_before_step"`` and ``"cleared_between_backwards"`` (bools); ``"last_backward_grad"``
in ``"zero_grad"`` turns False after the sync when the gradient was rewritten after the last pass.
The check :mod:`gradwatch.checks.zero_grad` turns them into findings.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch.nn.parameter import is_lazy

from gradwatch.core.failures import internal_warning
from gradwatch.core.stats import StepStats, ZeroGradFacts

#: ``stats.extra["zero_grad"]["state"]`` values.
FRESH = "fresh"
ACCUMULATED = "accumulated"
UNKNOWN = "unknown"
PENDING = "pending"

_Ref: TypeAlias = "weakref.ref[torch.Tensor]"

#: Checks between two re-picks of a representative that no backward pass reached.
REPICK_EVERY = 50

_SLOT_ZERO = "zero_grad/old_grad_zero"
_SLOT_NONZERO = "zero_grad/after_backward_nonzero"
_SLOT_REWRITTEN = "zero_grad/rewritten_after_backward"
#: Backward passes per step, each clearing the one before, that arm the sampling (as the check's minimum).
SAMPLE_PASSES = 3
#: Elements sampled from one parameter's gradient after each backward pass, while armed.
SAMPLE = 16


def _sample(g: torch.Tensor) -> torch.Tensor | None:
    """A strided copy of at most SAMPLE elements (none for sparse or non-contiguous gradients)."""
    if g.is_sparse or not g.is_contiguous() or g.numel() == 0:
        return None
    flat = g.detach().view(-1)
    return flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].float().clone()


def _rewritten(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Device flag: ``now`` is not a multiple of ``before`` (clipping and unscaling only scale)."""
    scale = torch.dot(now, before) / torch.dot(before, before).clamp_min(1e-30)
    residual = torch.linalg.vector_norm(now - scale * before)
    return (residual > 1e-3 * torch.linalg.vector_norm(now)).reshape(1)


class _Tracker:
    """What one optimizer's representative parameter has seen since the previous check."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.rep: torch.Tensor | None = None
        self.rep_name: str = ""
        self.handles: list[Any] = []
        # Baseline: the gradient the previous check saw.
        self.base_ref: weakref.ref[torch.Tensor] | None = None
        self.base_version = 0
        self.base_step: int | None = None  # the step the baseline was taken at
        # Since the baseline.
        self.accumulations = 0
        self.cleared = False  # set to None, replaced, or zeroed with a version bump
        # Backward passes since the gradient was last found cleared between two passes (or since the
        # baseline): the passes the step's gradient still holds.
        self.kept_passes = 0
        self.old_nonzero: list[torch.Tensor] = []  # lazy, per backward: the old gradient held a non-zero
        # After the most recent accumulation.
        self.post_ref: weakref.ref[torch.Tensor] | None = None
        self.post_version = 0
        self.post_ptr = 0  # its storage (``p.grad.data = summed`` keeps the tensor, swaps the storage)
        self.post_nonzero: torch.Tensor | None = None  # lazy: the gradient right after it was non-zero
        # Queue post_nonzero (armed by a suspicious step). Armed for the first step too: one lazy scalar per
        # backward pass of that step only, so zero_grad(set_to_none=False) between the last backward and the
        # very first step() is reported at step 0, as zero_grad() (None gradients) is.
        self.watch_after_backward = True
        # Armed by a step of cleared backward passes: a parameter of SAMPLE+ elements, and its gradient
        # after the latest backward pass (reference, version, storage, SAMPLE elements of it).
        self.sampled: torch.Tensor | None = None
        self.sample_handle: Any = None
        self.sample_of: tuple[weakref.ref[torch.Tensor], int, int, torch.Tensor] | None = None
        # Engine callbacks (single-optimizer runs): a backward pass reached the representative; its
        # gradient was cleared since the previous backward pass.
        self.on_backward: Any = None
        self.on_cleared: Any = None
        # A GradScaler's dropped step (plain loop: scaler.step() never calls optimizer.step(), so no step is
        # counted, but scaler.update() writes the scale in place): the passes before it were that step's, not
        # the next update's. ``scale`` returns the scaler's scale tensor (or None); its version and the step
        # count at the latest pass tell a scaler.update() since that pass with no optimizer step.
        self.on_dropped: Any = None
        self.scale: Any = None
        self.pass_scale_version = -1
        self.pass_steps = -1
        self.repick_after = 0  # no re-pick for an unreached representative before this step
        # Distributed runs: DDP's reducer writes the all-reduced gradient into .grad (or swaps its bucket
        # view in) at the end of each synced backward, after the post-accumulate hook: that is the pass's
        # gradient, so it is read again then.
        self.reread_after_backward = False
        # The engine's optimizer step count, and its value at the latest accumulation and at the first of
        # the passes the gradient still holds (another optimizer stepping in between: a GAN's generator
        # loss went through the discriminator, whose gradient was not cleared before its own backward).
        self.steps: Any = None
        self.accumulated_at = -1
        self.first_kept_at = -1
        # With several optimizers: the backward call (autograd graph task) of the same two passes. Equal step
        # counts do not say one backward reached both optimizers: a discriminator's own pass and the
        # generator's pass of the batch before (toggle_optimizer) ran with no step in between too.
        self.task: Any = None
        self.accumulated_task = -1
        self.first_kept_task = -1
        # A second parameter with no hooks, from another part of the model than the representative (the
        # least shared module path), and its gradient at the previous check: zero_grad() called on one
        # submodule (enc.zero_grad() where one optimizer trains enc and dec) clears one of the two only.
        self.sentinel: torch.Tensor | None = None
        self.sentinel_name = ""
        self.sentinel_ref: weakref.ref[torch.Tensor] | None = None
        self.sentinel_version = 0
        self.swap_after = 0  # no swap of representative and sentinel before this step
        # Taken only once the two disagreed: every parameter's gradient (name, parameter, reference,
        # version), to name at the next check the parameters that accumulated.
        self.snapshot: list[tuple[str, torch.Tensor, weakref.ref[torch.Tensor] | None, int]] | None = None
        # With a representative the model does not own: one model parameter's gradient at the previous check.
        self.model_param: torch.Tensor | None = None
        self.model_ref: weakref.ref[torch.Tensor] | None = None
        self.usual_facts: ZeroGradFacts | None = None  # of the latest step ZeroGradTracker._usual_step decided

    def reset(self) -> None:
        g = self.rep.grad if self.rep is not None else None
        self.reset_to(
            weakref.ref(g) if g is not None else None,
            g._version if g is not None else 0,
            self.sentinel.grad if self.sentinel is not None else None,
        )

    def reset_to(self, base_ref: _Ref | None, base_version: int, sg: torch.Tensor | None) -> None:
        """A new baseline: the representative's gradient (``base_ref``, at ``base_version``) and the sentinel's
        (``sg``)."""
        self.base_ref = base_ref
        self.base_version = base_version
        self.accumulations = 0
        self.cleared = False
        self.kept_passes = 0
        self.old_nonzero = []
        self.post_nonzero = None
        if sg is None:
            self.sentinel_ref, self.sentinel_version = None, 0
        else:
            self.sentinel_ref, self.sentinel_version = weakref.ref(sg), sg._version

    # -- hooks (run inside backward: must never raise) ----------------------------------------------
    def before_accumulate(self, incoming: torch.Tensor) -> None:
        try:
            if self.on_dropped is not None and self._scaler_dropped_a_step():
                self.on_dropped()
            if self.post_ref is not None and self._cleared_since_last_pass():
                self.kept_passes = 0  # what the earlier passes accumulated is gone
                if self.on_cleared is not None:
                    self.on_cleared()
            if self.base_ref is None or self.cleared or self.rep is None:
                return
            self._compare_with_baseline(self.rep.grad)
        except Exception as exc:  # noqa: BLE001 - never break the user's backward
            internal_warning("zero_grad tensor hook", exc)

    def _scaler_dropped_a_step(self) -> bool:
        """``scaler.update()`` wrote the scale since the latest pass, with no optimizer step in between."""
        scale = self.scale()
        return (
            scale is not None
            and scale._version != self.pass_scale_version
            and self.pass_steps == self.steps()
            and self.pass_steps >= 0
        )

    def _cleared_since_last_pass(self) -> bool:
        """The gradient the latest pass wrote is gone (None, another tensor) or was written since."""
        g = self.rep.grad if self.rep is not None else None
        return g is None or g is not self.post_ref() or g._version != self.post_version

    def _compare_with_baseline(self, g: torch.Tensor | None) -> None:
        """Cleared since the previous check, or the same tensor with only accumulations (a lazy read decides)."""
        if g is None or g is not self.base_ref():
            self.cleared = True
        elif g._version != self.base_version + self.accumulations:
            self.cleared = True  # zero_() / zero_grad(set_to_none=False) since the previous step
        else:
            # Same tensor, only accumulations since the previous check: zero_grad forgotten, or the
            # gradient was zeroed through .data (no version bump). Its value tells them apart.
            held = g.any() if not g.is_sparse else g.coalesce().values().any()
            self.old_nonzero.append(held)
            if len(self.old_nonzero) > 16:  # many backward passes per step: keep the memory flat
                self.old_nonzero = [torch.stack(self.old_nonzero).all()]

    def after_accumulate(self, param: torch.Tensor) -> None:
        try:
            g = param.grad
            if g is None:
                return
            self.accumulations += 1
            self.kept_passes += 1
            self.accumulated_at = self.steps() if self.steps is not None else -1
            self.accumulated_task = self.task() if self.task is not None else -1
            if self.kept_passes == 1:
                self.first_kept_at = self.accumulated_at
                self.first_kept_task = self.accumulated_task
            self.post_ref = weakref.ref(g)
            self.post_version = g._version
            self.post_ptr = g.data_ptr() if not g.is_sparse else 0
            if self.on_backward is not None:
                self.on_backward()
            if self.on_dropped is not None:
                scale = self.scale()
                self.pass_scale_version = scale._version if scale is not None else -1
                self.pass_steps = self.accumulated_at
            if self.reread_after_backward:
                queue = torch.autograd.Variable._execution_engine.queue_callback
                queue(lambda: queue(lambda: self.reread(param)))  # runs after every callback queued before
            if self.watch_after_backward and not g.is_sparse:
                self.post_nonzero = g.any()
            else:
                self.post_nonzero = None
        except Exception as exc:  # noqa: BLE001
            internal_warning("zero_grad accumulate hook", exc)

    def reread(self, param: torch.Tensor) -> None:
        try:
            g = param.grad
            if g is not None and param is self.rep:
                self.post_ref = weakref.ref(g)
                self.post_version = g._version
                self.post_ptr = g.data_ptr() if not g.is_sparse else 0
        except Exception as exc:  # noqa: BLE001 - runs inside the user's backward
            internal_warning("zero_grad end of backward", exc)

    def after_sampled_accumulate(self, param: torch.Tensor) -> None:
        try:
            self.take_sample(param)
            if self.reread_after_backward:  # after DDP's reducer wrote this pass's all-reduced gradient
                queue = torch.autograd.Variable._execution_engine.queue_callback
                queue(lambda: queue(lambda: self.take_sample(param)))
        except Exception as exc:  # noqa: BLE001
            internal_warning("zero_grad sample hook", exc)

    def take_sample(self, param: torch.Tensor) -> None:
        try:
            g = param.grad
            sample = _sample(g) if g is not None else None
            self.sample_of = (
                (weakref.ref(g), g._version, g.data_ptr(), sample) if g is not None and sample is not None else None
            )
        except Exception as exc:  # noqa: BLE001 - runs inside the user's backward
            internal_warning("zero_grad sample", exc)

    def arm_sampling(self, armed: bool, params: list[torch.Tensor]) -> None:
        if not armed:
            if self.sample_handle is not None:
                self.sample_handle.remove()
            self.sampled = self.sample_handle = self.sample_of = None
            return
        if self.sampled is not None:
            return
        p = next((p for p in params if p.is_leaf and p.requires_grad and p.numel() >= SAMPLE), None)
        if p is not None and hasattr(p, "register_post_accumulate_grad_hook"):
            self.sampled = p
            self.sample_handle = p.register_post_accumulate_grad_hook(self.after_sampled_accumulate)

    def rewritten(self) -> bool | torch.Tensor | None:
        """Since the sampled parameter's latest backward pass: True if its gradient was replaced, a device
        flag if it changed in place (not a multiple of the sample), None if unchanged or unknown."""
        kept, p = self.sample_of, self.sampled
        if kept is None or p is None:
            return None
        ref, version, ptr, before = kept
        g = p.grad
        if g is None or g is not ref() or g.data_ptr() != ptr:
            return True
        if g._version == version:
            return None
        now = _sample(g)
        return _rewritten(now, before) if now is not None and now.shape == before.shape else None

    def model_grad_replaced(self) -> bool:
        """The model parameter's gradient was set to None or replaced since the previous check (re-baselined)."""
        mg = self.model_param.grad if self.model_param is not None else None
        replaced = mg is None or self.model_ref is None or mg is not self.model_ref()
        self.model_ref = weakref.ref(mg) if mg is not None else None
        return replaced

    def hook(self, param: torch.Tensor, name: str) -> None:
        self.unhook()
        self.rep = param
        self.rep_name = name
        self.post_ref = None
        self.handles.append(param.register_hook(self.before_accumulate))
        if hasattr(param, "register_post_accumulate_grad_hook"):
            self.handles.append(param.register_post_accumulate_grad_hook(self.after_accumulate))

    def pick_sentinel(self, candidates: list[tuple[torch.Tensor, str]]) -> None:
        """The candidate whose name shares the fewest leading module names with the representative's."""
        self.sentinel, self.sentinel_name, self.sentinel_ref = None, "", None
        if self.rep is None or self.model_param is not None:
            return
        parts = self.rep_name.split(".")

        def shared(name: str) -> int:
            k = 0
            for a, b in zip(parts, name.split(".")):
                if a != b:
                    break
                k += 1
            return k

        others = [c for c in candidates if c[0] is not self.rep]
        if others:
            self.sentinel, self.sentinel_name = min(others, key=lambda c: shared(c[1]))

    def take_snapshot(self, params: list[torch.Tensor], names: list[str]) -> None:
        self.snapshot = [
            (n, p, weakref.ref(p.grad) if p.grad is not None else None, p.grad._version if p.grad is not None else 0)
            for p, n in zip(params, names)
        ]

    def accumulated_names(self, rep_delta: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """From the snapshot: the parameters whose gradient is the same tensor, written no more often than
        the representative's (which accumulated), and the others that hold a gradient (cleared since)."""
        kept: list[str] = []
        cleared: list[str] = []
        for n, p, ref, version in self.snapshot or ():
            g = p.grad
            if g is None:
                continue
            (kept if ref is not None and g is ref() and g._version - version <= rep_delta else cleared).append(n)
        self.snapshot = None
        return tuple(kept), tuple(cleared)

    def unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.rep = None
        self.arm_sampling(False, [])


#: :func:`after_backward_verdict` values: what happened to the gradients between the last backward pass and the
#: step (the first two are also the ``stats.extra`` keys they are reported under).
CLEARED_BEFORE_STEP = "grads_cleared_before_step"
CLEARED_BETWEEN_BACKWARDS = "cleared_between_backwards"
CHANGED_AFTER_BACKWARD = "changed_after_backward"
#: :func:`repick_rule` values: which parameter becomes the representative.
SMALLEST = "smallest"
MOST_WRITTEN = "most_written"


@dataclass(slots=True)  # not frozen: made at every check, and a frozen __init__ costs three times as much
class GradObservation:
    """What one check finds about an optimizer's representative gradient (plain values, no tensors)."""

    backward_passes: int  # accumulations since the previous check
    kept_passes: int  # the passes the step's gradient still holds
    state: str  # FRESH, PENDING or UNKNOWN (ACCUMULATED is known after the sync only)
    has_grad: bool  # the representative holds a gradient
    any_grads: bool  # the step holds any gradient at all
    reached_this_step: bool  # the latest pass came after the previous optimizer step
    changed_after_backward: bool  # the gradient the latest pass wrote was modified in place since
    last_backward_grad: bool  # the step's gradient is the tensor (and storage) the latest pass wrote


def grad_state(t: _Tracker, g: torch.Tensor | None) -> str:
    """Cleared since the previous check (FRESH), maybe not (PENDING: a lazy read decides), or UNKNOWN."""
    if t.rep is None or t.base_ref is None:
        return UNKNOWN
    if g is None or g is not t.base_ref() or t.cleared:
        return FRESH
    if g._version < t.base_version + t.accumulations:
        return UNKNOWN
    if t.accumulations == 0:
        return UNKNOWN  # no backward reached it since the previous step
    return PENDING if t.old_nonzero else UNKNOWN


def observe(t: _Tracker, g: torch.Tensor | None, any_grads: bool, steps_done: int) -> GradObservation:
    """The tracker's records since the previous check, and the representative's gradient ``g`` now, as facts."""
    latest = g is not None and t.post_ref is not None and t.post_ref() is g
    return GradObservation(
        backward_passes=t.accumulations,
        kept_passes=t.kept_passes,
        state=grad_state(t, g),
        has_grad=g is not None,
        any_grads=any_grads,
        reached_this_step=t.accumulated_at == steps_done,
        changed_after_backward=latest and g._version > t.post_version,
        last_backward_grad=latest and (g.is_sparse or g.data_ptr() == t.post_ptr),
    )


def _unreached(t: _Tracker, g: torch.Tensor, base: _Ref, step: int) -> tuple[str, bool] | None:
    """``(UNKNOWN, last_backward_grad)`` if no backward pass reached the representative since the previous
    check, whose gradient it still holds, and no re-pick is due (:meth:`ZeroGradTracker._rebase`); else None."""
    if t.accumulations or t.cleared or g is not base() or step >= t.repick_after:
        return None
    post = t.post_ref
    return UNKNOWN, post is not None and post() is g and (g.is_sparse or g.data_ptr() == t.post_ptr)


def _quiet_sentinel(t: _Tracker, state: str, g: torch.Tensor, base: _Ref) -> tuple[bool, torch.Tensor | None] | None:
    """``(cleared, gradient)`` of the sentinel when it cannot take the hooks over at this check (see
    :meth:`ZeroGradTracker._sentinel`): cleared is True if its gradient was set to None or replaced. None when
    it may: it kept its gradient while the representative's was fresh, not zeroed in place as well."""
    s, ref = t.sentinel, t.sentinel_ref
    sg = s.grad if s is not None else None
    if s is None or ref is None:
        return False, sg
    if ref() is not sg or sg is None:
        return True, sg
    if state is FRESH and (g is not base() or 0 < sg._version - t.sentinel_version <= t.accumulations):
        return None
    return False, sg


def after_backward_verdict(seen: GradObservation) -> str | None:
    """Backward passes reached the representative since the previous check; what came after the last one?

    No gradient at all at step time: cleared before the step. The representative's set to None after a pass of
    this step while others hold theirs: cleared between two backward passes. Its gradient modified in place:
    zeroed, or clipped/unscaled (the step's norms and the gradient right after backward decide, after the sync).
    """
    if seen.backward_passes <= 0:
        return None
    if not seen.any_grads:
        return CLEARED_BEFORE_STEP
    if not seen.has_grad and seen.reached_this_step:
        return CLEARED_BETWEEN_BACKWARDS
    if seen.changed_after_backward:
        return CHANGED_AFTER_BACKWARD
    return None


def spans_other_step(t: _Tracker, trackers: list[_Tracker]) -> bool:
    """The gradient holds passes from before another optimizer's step (and after it).

    That step's backward also went through these parameters and nothing cleared them since. Its last pass
    reached no other optimizer: its own loss (a GAN's discriminator loss) on top of another's; and the other
    optimizer's latest pass is the one this gradient starts with (one backward call through both, not merely
    one with no step in between). A loss every optimizer shares, stepped at different rates on purpose, reaches
    the others in its last pass too; a probe on detached features stepping every micro-batch while a backbone
    accumulates never reaches the backbone; a generator accumulating under toggle_optimizer next to a
    discriminator stepping every batch on its own loss never reaches the discriminator.
    """
    if len(trackers) <= 1 or t.kept_passes < 2 or not 0 <= t.first_kept_at < t.accumulated_at:
        return False
    others = [o for o in trackers if o is not t]
    return all(o.accumulated_at < t.accumulated_at for o in others) and any(
        o.accumulated_at == t.first_kept_at and o.accumulated_task == t.first_kept_task for o in others
    )


def sampling_armed(passes: Any, kept_passes: int) -> bool:
    """Sample after each pass from the next step on: this one had SAMPLE_PASSES+ passes, each clearing the last."""
    return isinstance(passes, tuple) and passes[0] >= SAMPLE_PASSES and passes[1] > 0 and kept_passes == 1


def repick_rule(any_grads: bool, has_grad: bool, unreached: bool, swapped: bool) -> str | None:
    """Re-pick the representative if it holds no gradient while others do (the smallest parameter), or if no
    backward reached it since the previous check, a rarely used gate or branch (the parameter whose gradient
    was written most often, smallest first); not when the hooks just moved to the sentinel."""
    if not any_grads or swapped:
        return None
    if not has_grad:
        return SMALLEST
    return MOST_WRITTEN if unreached else None


def baseline_was_dropped(dropped: Any, base_step: int | None) -> bool:
    """The tracker's baseline was taken at the first of the steps a GradScaler dropped (``scaler_dropped``:
    ``(first step, count)``) since the previous check."""
    return isinstance(dropped, tuple) and base_step == dropped[0]


def partly_cleared(missing: bool, facts: ZeroGradFacts, has_snapshot: bool) -> bool:
    """The representative accumulated while the sentinel was cleared (``zero_grad()`` on part of the model):
    the verdict waits for the next check, which names the parameters that accumulated."""
    return missing and bool(facts.get("sentinel_cleared")) and "kept_params" not in facts and not has_snapshot


@dataclass(frozen=True, slots=True)
class LazyFlags:
    """The tracker's lazy device reads, after the step's one sync (None: not queued this step)."""

    old_zero: bool | None = None  # some backward found the old gradient all zero
    nonzero_after_backward: bool | None = None  # the gradient right after the last pass held a non-zero
    rewritten: bool | None = None  # the sampled gradient changed in place, not by a scaling


_NO_FLAGS = LazyFlags()


def _read_lazy_flags(ctx: Any) -> LazyFlags:
    slots = ctx.slots
    if _SLOT_ZERO not in slots and _SLOT_NONZERO not in slots and _SLOT_REWRITTEN not in slots:
        return _NO_FLAGS  # nothing queued: the usual step
    values = ctx.batch.resolve()
    return LazyFlags(
        old_zero=not all(values[slots[_SLOT_ZERO]]) if _SLOT_ZERO in slots else None,
        nonzero_after_backward=bool(values[slots[_SLOT_NONZERO]][0]) if _SLOT_NONZERO in slots else None,
        rewritten=bool(values[slots[_SLOT_REWRITTEN]][0]) if _SLOT_REWRITTEN in slots else None,
    )


class ZeroGradTracker:
    """Engine extension: is each step's gradient this step's only? See the module docstring."""

    def __init__(self, integration: str = "plain") -> None:
        self.engine: Any = None
        self.trackers: list[_Tracker] = []
        self.integration = integration  # "lightning": the fix texts differ in automatic optimization

    def attach(self, engine: Any) -> None:
        self.engine = engine
        from gradwatch.observe.distributed import is_distributed

        distributed = is_distributed()
        for op in engine.index.per_optimizer:
            t = _Tracker(op.index)
            t.steps = lambda: sum(engine.step_counts)
            t.reread_after_backward = distributed
            self.trackers.append(t)
            candidates = [
                (p, n) for p, n in zip(op.params, op.names) if p.requires_grad and p.is_leaf and not is_lazy(p)
            ]
            # Parameters the model does not own (a loss's centers or temperature) first: model.zero_grad()
            # leaves them alone, so they are where a missing optimizer.zero_grad() shows.
            foreign = set(op.foreign)
            owned = [c for c in candidates if c[1] not in foreign]
            candidates = [c for c in candidates if c[1] in foreign] or candidates
            if candidates:
                p, n = min(candidates, key=lambda c: c[0].numel())
                t.hook(p, n)
                # Sampled from the first step on (the first check disarms it unless that step had cleared
                # micro-batches): zero_grad() in the accumulation loop is then told from gradients the code
                # rewrote after its last pass at step 0 already.
                t.arm_sampling(True, [c[0] for c in candidates])
                if n in foreign and owned:  # no hooks: is the model's own gradient a new tensor each step?
                    t.model_param = min(owned, key=lambda c: c[0].numel())[0]
                t.pick_sentinel(candidates)
        if len(self.trackers) == 1:  # with several optimizers a backward pass is not one step's
            self.trackers[0].on_backward = engine.backward_reached
            self.trackers[0].on_cleared = engine.gradients_cleared
            from gradwatch.observe.amp import AmpMonitor

            amp = engine.extension(AmpMonitor)
            if amp is not None:
                self.trackers[0].on_dropped = engine.step_dropped
                self.trackers[0].scale = lambda: getattr(amp.scaler, "_scale", None)
        else:
            task = getattr(torch._C, "_current_graph_task_id", None)  # one C call per backward pass
            for t in self.trackers:
                t.task = task

    def before_sync(self, ctx: Any) -> None:
        stats = ctx.stats
        i = stats.optimizer_index
        if i >= len(self.trackers):
            return
        t = self.trackers[i]
        if stats.params_changed or not self._usual_step(ctx, stats, t):
            self._any_step(ctx, t)

    def _usual_step(self, ctx: Any, stats: StepStats, t: _Tracker) -> bool:
        """The usual step, decided with a few attribute reads; False (nothing written) for any other.

        Usual: nothing sampled or armed, no snapshot, no model parameter to compare; the representative holds
        a gradient, either fresh (:meth:`_fresh`) or the very tensor of the previous check with no backward
        pass since (:func:`_unreached`); the sentinel cannot take the hooks over (:func:`_quiet_sentinel`). No
        verdict, nothing queued: the facts and the new baseline are those :meth:`_any_step` writes then.
        """
        rep, base = t.rep, t.base_ref
        if rep is None or base is None or t.sampled is not None or t.model_param is not None or t.snapshot is not None:
            return False
        g = rep.grad
        if g is None:
            return False
        # (kept passes never outnumber the accumulations: one kept pass means a backward pass reached it)
        seen = self._fresh(ctx, t, g, base) if t.kept_passes else _unreached(t, g, base, stats.step)
        if seen is None:
            return False
        state, last = seen
        sentinel = _quiet_sentinel(t, state, g, base)
        if sentinel is None:
            return False
        cleared, sg = sentinel
        facts = self._facts(stats.optimizer_index, t, t.accumulations, t.kept_passes, state, last)
        if cleared:
            facts["sentinel_cleared"] = True
        extra = stats.extra
        extra["zero_grad"] = facts
        extra["zero_grad_missing"] = False
        extra[CLEARED_BEFORE_STEP] = False
        t.usual_facts = facts  # after the sync: nothing was queued for this step (see after_sync)
        t.sample_of = None
        t.reset_to(t.post_ref if state is FRESH else base, g._version, sg)  # (both refer to g)
        t.base_step = stats.step
        return True

    def _fresh(self, ctx: Any, t: _Tracker, g: torch.Tensor, base: _Ref) -> tuple[str, bool] | None:
        """``(FRESH, last_backward_grad)`` if the representative's gradient ``g`` is the tensor its latest
        backward pass wrote, unchanged since, and not the one the previous check saw (or cleared in place
        since), with nothing to arm; several kept passes (accumulation) only with one optimizer (no other step
        for them to span). None otherwise."""
        kept, post = t.kept_passes, t.post_ref
        if (kept > 1 and len(self.trackers) > 1) or post is None or post() is not g or not ctx.grads:
            return None
        if g._version != t.post_version or (g is base() and not t.cleared):
            return None
        passes = ctx.stats.extra.get("backward_passes")
        if isinstance(passes, tuple) and passes[1] and sampling_armed(passes, kept):
            return None
        return FRESH, g.is_sparse or g.data_ptr() == t.post_ptr

    def _any_step(self, ctx: Any, t: _Tracker) -> None:
        """Every step the usual one (:meth:`_usual_step`) is not: the general decision."""
        stats = ctx.stats
        i = stats.optimizer_index
        if stats.params_changed:
            self._forget_departed(i, t)
        g = t.rep.grad if t.rep is not None else None
        seen = observe(t, g, bool(ctx.grads), sum(self.engine.step_counts))
        facts = self._facts(i, t, seen.backward_passes, seen.kept_passes, seen.state, seen.last_backward_grad)
        if len(self.trackers) > 1 and spans_other_step(t, self.trackers):  # (one optimizer: no other step)
            facts["spans_other_step"] = True
        verdict = after_backward_verdict(seen)
        self._record(ctx, t, seen, verdict, facts)
        armed = sampling_armed(stats.extra.get("backward_passes"), t.kept_passes)
        if armed or t.sampled is not None:  # (disarming what is not armed changes nothing)
            t.arm_sampling(armed, ctx.params)
        t.sample_of = None
        if t.model_param is not None:
            facts["model_grad_replaced"] = t.model_grad_replaced()
        swapped = self._sentinel(t, g, facts, stats.step)
        stats.extra["zero_grad"] = facts
        stats.extra["zero_grad_missing"] = False
        stats.extra[CLEARED_BEFORE_STEP] = verdict == CLEARED_BEFORE_STEP
        self._rebase(ctx, t, seen, swapped)

    def _forget_departed(self, i: int, t: _Tracker) -> None:
        """The optimizer's parameters changed: unhook a representative (and drop a sentinel) it no longer holds."""
        if t.rep is None:
            return
        op = self.engine.index.per_optimizer[i]
        if not any(p is t.rep for p in op.params):
            t.unhook()
        if t.sentinel is not None and not any(p is t.sentinel for p in op.params):
            t.sentinel = None

    def _facts(self, i: int, t: _Tracker, passes: int, kept: int, state: str, last: bool) -> ZeroGradFacts:
        """The check's hand-over in ``stats.extra["zero_grad"]`` (see the module docstring)."""
        lightning = self.integration == "lightning"
        return {
            "optimizer": i,
            "param": t.rep_name if t.rep is not None else None,
            "backward_passes": passes,
            "kept_passes": kept,
            "state": state,
            "previous_step": t.base_step,
            "has_optimizer": self.engine.index.per_optimizer[i].optimizer is not None,
            # Lightning calls zero_grad() and step() itself: the user's own zero_grad() is to be deleted.
            "lightning_automatic": lightning and bool(getattr(self.engine.model, "automatic_optimization", True)),
            "lightning": lightning,
            "last_backward_grad": last,
        }

    @staticmethod
    def _record(ctx: Any, t: _Tracker, seen: GradObservation, verdict: str | None, facts: ZeroGradFacts) -> None:
        """Write the verdict into the step's facts and queue the lazy device reads it needs for the one sync."""
        if seen.state == PENDING and t.old_nonzero:
            held = t.old_nonzero[0] if len(t.old_nonzero) == 1 else torch.stack(t.old_nonzero)
            ctx.slots[_SLOT_ZERO] = ctx.batch.add(held)
        if verdict == CLEARED_BETWEEN_BACKWARDS:
            ctx.stats.extra[CLEARED_BETWEEN_BACKWARDS] = True
        elif verdict == CHANGED_AFTER_BACKWARD:
            facts[CHANGED_AFTER_BACKWARD] = True
            if t.post_nonzero is not None:
                ctx.slots[_SLOT_NONZERO] = ctx.batch.add(t.post_nonzero)
        if facts["last_backward_grad"] and t.sample_of is not None:  # (nothing sampled: nothing to compare)
            ZeroGradTracker._read_rewritten(ctx, t, facts)

    @staticmethod
    def _read_rewritten(ctx: Any, t: _Tracker, facts: ZeroGradFacts) -> None:
        """Was the sampled gradient replaced (known now) or rewritten in place (a lazy flag, read after the sync)?"""
        rewritten = t.rewritten()
        if rewritten is True:
            facts["last_backward_grad"] = False
        elif isinstance(rewritten, torch.Tensor):
            ctx.slots[_SLOT_REWRITTEN] = ctx.batch.add(rewritten)

    @staticmethod
    def _rebase(ctx: Any, t: _Tracker, seen: GradObservation, swapped: bool) -> None:
        """New baseline, after re-picking the representative if :func:`repick_rule` says so."""
        step = ctx.stats.step
        unreached = t.accumulations == 0 and t.base_ref is not None and step >= t.repick_after
        rule = repick_rule(seen.any_grads, seen.has_grad, unreached, swapped)
        if rule is not None:
            if unreached:  # an O(parameters) scan: at most once every REPICK_EVERY checks
                t.repick_after = step + REPICK_EVERY
            candidates = [(p, n) for p, n in zip(ctx.params, ctx.stats.names) if p.is_leaf]
            if candidates:
                if rule == SMALLEST:
                    p, n = min(candidates, key=lambda c: c[0].numel())
                else:
                    p, n = min(candidates, key=lambda c: (-c[0].grad._version, c[0].numel()))
                if p is not t.rep:
                    t.hook(p, n)
                    t.pick_sentinel(candidates)
        t.reset()
        t.base_step = step

    def _sentinel(self, t: _Tracker, g: torch.Tensor | None, facts: ZeroGradFacts, step: int) -> bool:
        """Compare the sentinel with the representative (O(1); O(parameters) once they disagree). Returns
        True when the hooks moved to the sentinel."""
        if t.snapshot is not None:
            # The previous check found the two cleared differently: name what accumulated since.
            rep_delta = (
                g._version - t.base_version if g is not None and t.base_ref is not None and g is t.base_ref() else -1
            )
            kept, cleared = t.accumulated_names(rep_delta)
            if rep_delta >= 0:  # the representative accumulated (it is among the kept)
                facts["kept_params"], facts["cleared_params"] = kept, cleared
        s = t.sentinel
        if s is None or t.sentinel_ref is None or t.rep is None:
            return False
        sg = s.grad
        if sg is None or sg is not t.sentinel_ref():
            facts["sentinel_cleared"] = True  # set to None or replaced: zero_grad() reached it
            return False
        if sg.is_sparse or facts["state"] != FRESH or step < t.swap_after:
            return False
        if not s.requires_grad:
            return False  # frozen since: its gradient stays because nothing writes it (no hooks possible)
        delta = sg._version - t.sentinel_version
        replaced = g is None or t.base_ref is None or g is not t.base_ref()
        if not (replaced or 0 < delta <= t.accumulations):
            return False  # both zeroed in place (a version bump each), or the sentinel never written
        # The representative was cleared, the sentinel kept its gradient (not set to None by the same
        # zero_grad(set_to_none=True), or not bumped by a zero_()): zero_grad() on the part of the model
        # the representative is in. Move the hooks to the sentinel, whose value decides from the next
        # check on, and keep every gradient to name the parameters that accumulated then.
        t.swap_after = step + REPICK_EVERY
        op = self.engine.index.per_optimizer[t.index]
        t.take_snapshot(op.params, op.names)
        old, old_name = t.rep, t.rep_name
        t.hook(s, t.sentinel_name)
        t.sentinel, t.sentinel_name = old, old_name
        return True

    def closure_finding(self, index: int, step: int) -> Any:
        """At a closure's second evaluation within a checked step (LBFGS): the representative's gradient is
        the first evaluation's tensor with only this evaluation's accumulation since, and it held non-zero
        values before it (one read): the closure never clears the gradients. The finding, or None."""
        t = self.trackers[index] if index < len(self.trackers) else None
        if t is None or t.rep is None or t.base_ref is None or t.cleared or not t.old_nonzero:
            return None
        g = t.rep.grad
        if g is None or g is not t.base_ref() or g._version != t.base_version + t.accumulations:
            return None
        if not bool(torch.stack(t.old_nonzero).all()):
            return None  # zeroed through .data in the closure
        from gradwatch.checks.zero_grad import closure_missing

        op = self.engine.index.per_optimizer[index]
        names = tuple(n for p, n in zip(op.params, op.names) if p.grad is not None)
        optimizer = type(op.optimizer).__name__ if op.optimizer is not None else "the optimizer"
        return closure_missing(step, index, optimizer, names, t.rep_name)

    def after_sync(self, ctx: Any) -> None:
        stats = ctx.stats
        extra = stats.extra
        facts = extra.get("zero_grad")
        if not isinstance(facts, dict):
            return
        tracker = self.trackers[facts["optimizer"]]
        if facts is not tracker.usual_facts:
            self._after_any_sync(ctx, facts)
            return
        # The usual step (_usual_step queued nothing): only the scaler's dropped steps move the baseline.
        dropped = extra.get("scaler_dropped")
        if dropped is not None and baseline_was_dropped(dropped, tracker.base_step):
            tracker.base_step = stats.step
        tracker.watch_after_backward = False

    def _after_any_sync(self, ctx: Any, facts: ZeroGradFacts) -> None:
        """After the sync, when a lazy flag was queued or the step is not the usual one: the general decision."""
        stats = ctx.stats
        read = _read_lazy_flags(ctx)
        if read.old_zero is not None:
            # Any backward that found the old gradient all zero: it was cleared (through .data).
            facts["state"] = FRESH if read.old_zero else ACCUMULATED
            stats.extra["zero_grad_missing"] = not read.old_zero
        i = facts.get("optimizer")
        tracker = self.trackers[i] if isinstance(i, int) and i < len(self.trackers) else None
        if tracker is not None and baseline_was_dropped(stats.extra.get("scaler_dropped"), tracker.base_step):
            # The scaler's dropped steps came before this one, whose step number moved past them after the
            # sync: the next check's "not cleared after the update of step N" names this update.
            tracker.base_step = stats.step
        if tracker is not None and partly_cleared(stats.extra["zero_grad_missing"], facts, tracker.snapshot is not None):
            # Accumulated, but the sentinel was cleared: zero_grad() on part of the model only. Which part
            # shows at the next check (an O(parameters) snapshot, on this step only); the finding waits for
            # it rather than naming parameters that were cleared.
            op = self.engine.index.per_optimizer[tracker.index]
            tracker.take_snapshot(op.params, op.names)
            stats.extra["zero_grad_missing"] = False
        suspicious = bool(facts.get("changed_after_backward")) and bool(stats.names) and stats.total_norm == 0.0
        if suspicious and read.nonzero_after_backward:
            stats.extra["grads_cleared_before_step"] = True
        if read.rewritten:
            facts["last_backward_grad"] = False  # other values were written into it: not that pass's
        if tracker is not None:
            tracker.watch_after_backward = suspicious

    def close(self) -> None:
        for t in self.trackers:
            t.unhook()
            t.model_param = None
            t.model_ref = None
            t.sentinel = None
            t.sentinel_ref = None
            t.snapshot = None
            t.base_ref = None
            t.post_ref = None
            t.old_nonzero = []
            t.post_nonzero = None
            t.arm_sampling(False, [])
