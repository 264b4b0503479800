"""Cheap mode, every step: references to the step's forward calls (plain loop: hooks on the root model) or
Lightning batches, and to the losses given to ``observe_loss``. No copies, no per-module hooks, no sync.

:class:`StepCapture` is the stateful shell; what it keeps is described in :mod:`gradwatch.diagnose.capture`.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradwatch.core.failures import internal_warning
from gradwatch.core.params import fabric_redirect
from gradwatch.diagnose.capture import (
    MAX_CALLS,
    MAX_GRADS,
    MAX_INPUT_BYTES,
    Batch,
    Call,
    autocast_state,
    output_leaves,
    step_inputs,
)
from gradwatch.observe.module_hooks import owned

if TYPE_CHECKING:
    from gradwatch.diagnose.window import EscalationWindow


class StepCapture:
    """The step's forward calls (``calls``; ``forwards`` counts them, ``calls`` keeps ``MAX_CALLS``) or
    Lightning batches (``batches``), kept until the optimizer step.

    Attributes:
        replaying: A replay (or ``Watcher.gradcheck``'s forward) is running: its forwards are not captured.
        last_step: Between steps (and after close): the last step's index and its forward calls' ``(args,
            kwargs, rng state)``, references only, for ``Watcher.gradcheck()``; dropped when the next step's
            forward starts.
    """

    def __init__(self, window: EscalationWindow, integration: str = "plain") -> None:
        self.window = window
        self.integration = integration
        self.engine: Any = None
        self.model: nn.Module | None = None
        self.calls: list[Call] = []
        self.forwards = 0
        self.batches: list[Batch] = []
        self.mark = -1
        self.replaying = False
        self.under_compile = False  # the watched model's forward was seen inside a Dynamo trace
        self.half_loss = False  # a loss of this step was computed in float16 (read by nonfinite_loss)
        self.last_step: tuple[int, list[tuple[Any, Any, Any]]] | None = None
        self._redirect: Any = None  # the arguments of Fabric's training_step call now running (not a forward)
        self._hooks: list[Any] = []

    def attach(self, engine: Any, model: nn.Module) -> None:
        """Hook the root model's forward (plain loop)."""
        self.engine = engine
        self.model = model
        self._hooks.append(owned(model, model.register_forward_pre_hook(self._on_forward_start, with_kwargs=True)))
        self._hooks.append(owned(model, model.register_forward_hook(self._on_forward_end, with_kwargs=True)))

    def _on_forward_start(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.replaying or not torch.is_grad_enabled():
            return
        if fabric_redirect(module):
            # Fabric calling training_step through DDP: its arguments are the batch, its output the loss; the
            # model's own call inside (self(x)) is the forward to keep.
            self._redirect = args
            return
        if not self.under_compile and torch.compiler.is_compiling():
            # The watched module runs inside a torch.compile'd wrapper (watch(model) of compile(model)):
            # its escalation window must add no function mode or hooks to the trace either.
            self.under_compile = True
        if self._next_step():
            self.last_step = None
        engine = self.engine
        if engine.config.every > 1 and not any(engine.should_check(i) for i in range(len(engine.step_counts))):
            return  # this step is not checked: keep nothing
        self._keep(Call(args, kwargs, autocast_state()))
        if self.window.is_open and not self.under_compile:
            self.window.forward_start()

    def _next_step(self) -> bool:
        """Whether an optimizer step happened since the last capture (then the held calls are released)."""
        mark = sum(self.engine.step_counts)
        if mark == self.mark:
            return False
        self.mark = mark
        self.new_step()
        return True

    def _keep(self, call: Call) -> None:
        calls = self.calls
        calls.append(call)
        self.forwards += 1
        if len(calls) > MAX_GRADS:
            calls[-MAX_GRADS - 1].fold()
        for _ in range(within_budget(calls)):
            calls.pop(0).release()

    def _on_forward_end(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if args is self._redirect:
            self._redirect = None
            return
        if self.replaying or not self.calls or not torch.is_grad_enabled():
            return
        call = self.calls[-1]
        if isinstance(output, torch.Tensor):
            call.outputs = [weakref.ref(output)]
            if output.requires_grad:
                output.register_hook(functools.partial(call.set_grad, 0))
                call.nodes, call.node_index = (output.grad_fn,), (0,)
            return
        nodes, index = [], []
        leaves = output_leaves(output)
        call.outputs = [weakref.ref(t) for t in leaves if isinstance(t, torch.Tensor)][:MAX_CALLS]
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(call.set_grad, i))
                nodes.append(t.grad_fn)
                index.append(i)
        call.nodes, call.node_index = tuple(nodes), tuple(index)

    def on_loss(self, loss: torch.Tensor) -> None:
        """``observe_loss`` (before backward in the documented loop): O(1) outside an escalation window."""
        if self.replaying:
            return
        if loss.dtype == torch.float16:
            self.half_loss = True
        try:
            if self.integration == "lightning":
                if self.batches and len(self.batches[-1].losses) < MAX_CALLS:
                    self.batches[-1].losses.append(loss.detach())
                return
            if loss.grad_fn is None or not self.calls:
                return
            call = self.calls[-1]
            if len(call.losses) < MAX_GRADS:
                # A reference (the graph's nodes, not its activations, which backward frees): says which
                # micro-batch went non-finite and names the loss code's ops on an incident.
                call.losses.append(loss if call.held else loss.detach())
            live = self.window.live
            if live is not None and self.window.live_used:
                # Escalated: the loss code's backward nodes get the localizer's hooks too, so a NaN born
                # between the model's output and the loss is named with its op and line.
                live.hook_graph([loss], outside=True)
        except Exception as exc:  # noqa: BLE001
            internal_warning("Escalation.observe_loss", exc, owner=self.engine)

    def new_step(self) -> None:
        """Release the held calls (the batches stay until the next one starts)."""
        for call in self.calls:
            call.release()
        self.calls.clear()
        self.forwards = 0
        self.window.reset_live()

    def capture_batch(self, batch: Any, batch_idx: int, trainer: Any, pl_module: Any) -> None:
        """Keep a reference to a Lightning batch, each batch of the accumulation cycle (at most ``MAX_CALLS``)."""
        mark = sum(self.engine.step_counts) if self.engine is not None else self.mark
        if mark != self.mark:  # an optimizer step happened since: a new accumulation cycle
            self.mark = mark
            self.batches = []
        self.batches.append(Batch(batch, batch_idx, trainer, pl_module))
        del self.batches[: within_budget(self.batches)]

    def sources(self) -> list[Any]:
        """What a replay can run: the Lightning batches, or the plain loop's forward calls."""
        return list(self.batches) if self.integration == "lightning" else list(self.calls)

    def step_inputs(self) -> tuple[int, bool, frozenset[int]]:
        """The model inputs of this step so far: how many (forward calls; Lightning batches), whether an
        input tensor requires grad (an adversarial example), and the batch sizes (leading dimensions)."""
        if self.integration == "lightning":
            return step_inputs([b.batch for b in self.batches], len(self.batches)).as_tuple()
        return step_inputs([(c.args, c.kwargs) for c in self.calls], self.forwards).as_tuple()

    def end_step(self, step: int) -> None:
        """The step's last optimizer stepped: release its calls, keep references for ``Watcher.gradcheck()``."""
        inputs = [(c.args, c.kwargs, c.rng) for c in self.calls] if self.calls else []
        self.new_step()
        self.last_step = (step, inputs) if inputs else None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.new_step()
        self.batches = []
        self._redirect = None


def within_budget(kept: list[Any]) -> int:
    """How many of the oldest of ``kept`` (calls or batches, oldest first, each with ``nbytes``) to let go: past
    MAX_CALLS, and past MAX_INPUT_BYTES of inputs beyond the MAX_GRADS most recent."""
    drop = max(0, len(kept) - MAX_CALLS)
    if len(kept) - drop <= MAX_GRADS:
        return drop  # the most recent are always kept: no bytes to count (the usual step, one forward call)
    total = sum(k.nbytes for k in kept[drop:])
    while len(kept) - drop > MAX_GRADS and total > MAX_INPUT_BYTES:
        total -= kept[drop].nbytes
        drop += 1
    return drop
