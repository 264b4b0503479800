"""Escalation: name the op and module where a NaN/Inf was born, then watch closely for a few steps.

The ladder, as an engine extension (:class:`Escalation`, attached by ``default_extensions``):

1. Cheap mode, every step: the engine's fused checks. The only cost here is a forward pre-hook and a
   forward hook on the root model that keep *references* to the step's inputs and to the gradient
   arriving at the model's output, and a reference to each loss given to ``observe_loss`` (no copies,
   no per-module hooks, no anomaly mode, no sync). Under gradient accumulation every forward call of the
   step is kept (at most ``MAX_CALLS``); the output gradients of the ``MAX_GRADS`` most recent ones are
   held, older ones are folded into their sum (one reduction per micro-batch, a 0-dim tensor, non-finite
   when the gradient was), and their losses are detached so their graphs can go.
2. On a non-finite loss or gradient (``on_incident``, before the update, under every policy):
   ``nonfinite_input`` when the captured batch itself holds NaN/Inf (the data is the cause, nothing
   to localize in the model).
3. Otherwise ``nan_origin``: the step is replayed on the captured batch (weights are still unchanged) with
   anomaly mode and :class:`~gradwatch.diagnose.localize.Localizer` on, and the finding names the op (e.g.
   ``SqrtBackward0``), the module and the source line where the first non-finite value was born, with a
   per-layer table of gradient norm and NaN/Inf counts. The replay leaves no trace: parameter ``.grad``
   is untouched (``torch.autograd.grad``), module buffers (BatchNorm running statistics) and the RNG
   state are restored. With several micro-batches, the one replayed is the one that went non-finite:
   first those whose output gradient or loss was non-finite (read now, on the incident only), else the
   first whose plain replay turns non-finite (a NaN born inside the model's backward leaves both
   finite). When the NaN/Inf came from the loss code outside the model, the finding says so
   (``phase="loss"``) and lists the loss code's ops that can make one (``loss_ops``): backward has freed
   the values they saw, so which one did is named only if it recurs in the window (step 4).
4. The next ``escalate_steps`` optimizer steps run escalated: anomaly mode on (forward tracebacks;
   gradwatch checks NaN *and* Inf itself, so anomaly mode never stops the run) and the localizer recording
   the real forward and backward. A loss given to ``observe_loss`` before its backward also gets the
   localizer's hooks on the loss code between the model's outputs and the loss, so a NaN/Inf born there
   is named with its op (``LogBackward0``) and line. ``engine.escalated`` is True meanwhile.
5. The policy acts (the engine). 6. An incident report goes to ``log_dir/incidents/step_<N>.md``/``.json``
   (and ``.pt`` with ``save_batch=True``). 7. When the window ends, anomaly mode is put back as it was.

``escalate=False`` turns all of it off: no hooks, no replay, no anomaly mode, no extra findings.

Memory: until the optimizer step, the references keep alive what the user's loop would otherwise free
one micro-batch at a time: the inputs of every forward call of the step (up to ``MAX_CALLS``), the
output gradients of the last ``MAX_GRADS`` calls (each the size of the model's output: for a language
model the logits), and the autograd nodes of those calls' graphs (not their saved activations, which
backward frees). Pass ``escalate=False`` when even that is too much.

Lightning: the replay runs ``training_step`` again on the captured batch (under accumulation, on up to
``MAX_REPLAYS`` batches of the cycle, those with a non-finite loss first). Logging, ``manual_backward``,
optimizer and scheduler steps are neutralized for it, but any other Python state the user's
``training_step`` changes (a counter on ``self``, a list it appends to) moves once more per replay.

Finding kinds:

- ``nonfinite_input``: the inputs of the step hold NaN/Inf before the model ran (``data["inputs"]``:
  which argument, NaN and Inf counts).
- ``nan_origin``: where the first non-finite value of the step was born. ``data``: ``phase``
  (``"forward"``, ``"backward"``, ``"loss"`` — born in the loss computation outside the model — or
  ``"weights"`` — the parameters were already non-finite — or ``"buffers"`` — e.g. BatchNorm running
  statistics written non-finite by an earlier forward), ``op``, ``forward_op``, ``module``,
  ``source`` (``file:line in function``), ``code``, ``incoming`` / ``outgoing`` magnitudes,
  ``first_nonfinite_module`` and ``first_nonfinite_module_inputs``, ``table`` (per layer: gradient
  norm, NaN count, Inf count), ``surrogate_grad`` (the replay used a gradient of ones because the real
  one was not available), ``anomaly_error``, ``forward_traceback``, ``replayed``, ``report`` (the
  incident report path). Not emitted when the replay cannot reproduce the non-finite value (the incident
  report says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten_with_path, tree_leaves, tree_map

from gradwatch.core.findings import Finding, names_text
from gradwatch.core.params import fabric_redirect, user_module
from gradwatch.core.stats import SyncBatch, queue_grad_norms, read_grad_norms
from gradwatch.diagnose.localize import ROOT, Localization, Localizer, summarize
from gradwatch.observe.module_hooks import owned, patched
from gradwatch.observe.tracing import _is_compiled, library_frame
from gradwatch.report import host_rng_kept, internal_warning
from gradwatch.report.incidents import incident_paths, write_incident

#: Top-level packages besides torch whose frames stand between the training loop and an optimizer's step
#: (the loop's frame is the first outside them): Lightning Fabric's optimizer steps through its strategy and
#: precision plugins (``lightning.fabric``, ``lightning_fabric``), Lightning's own loop or a LightningOptimizer
#: through ``lightning.pytorch``/``pytorch_lightning``. Not in ``library_frame`` itself: the autograd explanations
#: tell Lightning's own ``backward()`` from the user's by those frames.
_WRAPPERS = ("accelerate", "contextlib", "lightning", "lightning_fabric", "pytorch_lightning")

#: Forward calls (Lightning: batches) of one step kept for replay (gradient accumulation runs several).
MAX_CALLS = 64
#: Of those, the most recent calls whose output gradients are held for a faithful replay; older calls
#: keep only whether their output gradient was finite.
MAX_GRADS = 4
#: Localizing replays per incident at most (suspect micro-batches first).
MAX_REPLAYS = 8
#: Incident reports written per run at most (a run that stays non-finite would write one per step).
MAX_REPORTS = 20


class _Call:
    """One forward call of the watched model: references to its inputs, its output gradients, its losses.

    ``nodes`` are the autograd nodes of its outputs (where the loss code begins) and ``losses`` the losses
    observed after it (``observe_loss``). Once folded (:meth:`fold`, when newer calls arrive) it holds no
    output gradient, node or graph any more, only ``sums``: each output gradient's sum, a 0-dim device
    tensor that is non-finite when the gradient was (read on an incident only).
    """

    __slots__ = (
        "__weakref__",
        "args",
        "autocast",
        "grads",
        "held",
        "kwargs",
        "losses",
        "node_index",
        "nodes",
        "output_ok",
        "outputs",
        "rng",
        "sums",
    )

    def __init__(self, args: Any, kwargs: Any, autocast: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.autocast = autocast
        # The replay draws the same dropout masks and random ops (not inside a torch.compile trace: reading
        # the generator there is a graph break; a compiled model's replay then draws fresh numbers).
        self.rng = None if torch.compiler.is_compiling() else _rng_state()
        self.grads: dict[int, torch.Tensor] = {}
        self.sums: list[torch.Tensor] = []
        self.nodes: tuple[Any, ...] = ()
        self.node_index: tuple[int, ...] = ()  # the output index of each node (its gradient's key in grads)
        self.losses: list[torch.Tensor] = []
        self.held = True
        #: Escalated steps only: a device flag, whether every value of the forward's output was finite.
        self.output_ok: torch.Tensor | None = None
        #: Weak references to the forward's output tensors: read only when an exception ends the loop (they
        #: live as long as the loop's own variables, a traceback's frames included).
        self.outputs: list[Any] = []

    def set_grad(self, index: int, grad: torch.Tensor) -> None:
        if self.held:
            self.grads[index] = grad
        else:
            self.sums.append(_finiteness_sum(grad))

    def fold(self) -> None:
        """Release the output gradients and the graph, keep what says whether they were finite."""
        if not self.held:
            return
        self.held = False
        self.sums += [_finiteness_sum(g) for g in self.grads.values() if isinstance(g, torch.Tensor)]
        self.grads = {}
        self.nodes = ()
        self.losses = [l.detach() for l in self.losses]

    def release(self) -> None:
        """Drop every reference. The output's gradient hook (held by an autograd node) keeps this object
        alive, and this object may hold the loss whose graph holds that node: a cycle through C++ that
        Python's garbage collector cannot see, so it is broken here, by hand, at the end of the step."""
        self.args = ()
        self.kwargs = {}
        self.grads = {}
        self.sums = []
        self.nodes = ()
        self.losses = []
        self.held = False

    def suspect(self) -> torch.Tensor | None:
        """Device flag (no sync): False when its output gradient or its loss held NaN/Inf."""
        parts = [g for g in self.grads.values() if isinstance(g, torch.Tensor)] + self.sums + self.losses
        return _all_finite(parts)


def _finiteness_sum(grad: torch.Tensor) -> torch.Tensor:
    """One reduction, no temporary: the sum is non-finite when an element is, and (short of float32
    overflow) only then; half-precision gradients, e.g. scaled by a GradScaler, are summed in float32."""
    grad = grad.detach()  # a gradient taken with create_graph=True must not keep its graph alive here
    if grad.is_complex():
        grad = torch.view_as_real(grad)
    if grad.dtype in (torch.float16, torch.bfloat16):
        return grad.sum(dtype=torch.float32)
    return grad.sum()


def _output_leaves(output: Any) -> list[Any]:
    """The leaves of a forward's output, looking inside dataclass instances too (pytree does not)."""
    out: list[Any] = []
    for leaf in tree_leaves(output):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += _output_leaves([getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)])
        else:
            out.append(leaf)
    return out


def _input_counts(t: torch.Tensor) -> torch.Tensor:
    """[NaN, Inf, +Inf, finite non-zero] element counts of an input tensor (on the CPU)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    finite = torch.isfinite(t)
    return torch.stack(
        [torch.isnan(t).sum(), torch.isinf(t).sum(), torch.isposinf(t).sum(), (finite & (t != 0)).sum()]
    ).cpu()


def _bad_data(named: list[tuple[str, torch.Tensor]], *, minus_inf: bool = False) -> list[tuple[str, int, int]]:
    """``(name, NaN count, Inf count)`` of the tensors that hold NaN or +Inf, each tensor once (the same
    tensor fed to several forward calls, SAM's two passes). One sync; incident path only. An additive
    attention mask or bias (0 or a finite bias where attended, -inf where masked: a causal mask, a padding
    mask made float, ALiBi or a relative-position bias plus padding) holds -inf by design: not bad data.
    ``minus_inf``: those tensors instead, that hold -inf and no NaN or +Inf (see ``_unabsorbed_minus_inf``)."""
    unique: dict[int, tuple[str, torch.Tensor]] = {}
    for n, t in named:
        unique.setdefault(id(t), (n, t))
    if not unique:
        return []
    with torch.no_grad():
        rows = torch.stack([_input_counts(t.detach()) for _n, t in unique.values()]).tolist()
    if minus_inf:
        return [(n, 0, int(c[1])) for (n, _t), c in zip(unique.values(), rows) if c[1] and not (c[0] or c[2])]
    return [(n, int(c[0]), int(c[1])) for (n, _t), c in zip(unique.values(), rows) if c[0] or c[2]]


class _Batch:
    """A Lightning batch, replayed through ``training_step``."""

    def __init__(self, batch: Any, batch_idx: int, trainer: Any, pl_module: Any) -> None:
        self.batch = batch
        self.batch_idx = batch_idx
        self.trainer = trainer
        self.pl_module = pl_module
        #: The (detached) losses observed for this batch, read on an incident only.
        self.losses: list[torch.Tensor] = []
        self.rng = _rng_state()


class Escalation:
    """Engine extension: localize non-finite incidents and escalate for ``escalate_steps`` steps.

    Args:
        integration: ``"plain"`` (inputs captured by hooks on the root model) or ``"lightning"``
            (the callback hands over each batch through :meth:`lightning_batch_start` and the step is
            replayed through ``training_step``).

    Attributes:
        reports: Paths of the incident reports (``.md``) written so far.
        localizations: ``(step, Localization)`` of each localized incident.

    Example:
        >>> import torch, gradwatch
        >>> from gradwatch.diagnose.escalation import Escalation
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        ...     loss = model(torch.zeros(4, 2)).sum() * float("nan")
        ...     loss.backward(); opt.step()
        >>> gw.engine.extension(Escalation).localizations[0][0]
        0
    """

    def __init__(self, integration: str = "plain") -> None:
        self.integration = integration
        self.engine: Any = None
        self.model: nn.Module | None = None
        self.reports: list[str] = []
        self.localizations: list[tuple[int, Localization]] = []
        self._hooks: list[Any] = []
        self._window_hooks: list[Any] = []
        self._calls: list[_Call] = []
        self._forwards = 0  # forward calls captured since the latest optimizer step (_calls keeps MAX_CALLS)
        self._batches: list[_Batch] = []
        self._culprit: Any = None
        self._mark = -1
        self._handled: tuple[int, int] | None = None
        self._replaying = False
        # The torch.distributed collective a replay stopped at (see _no_collectives), None when it ran through.
        self._collective: str | None = None
        self._window_left = 0
        self._window_start: int | None = None
        self._anomaly_prev: tuple[bool, bool] | None = None
        self._live: Localizer | None = None
        # Reentrant checkpointing swapped for the non-reentrant kind during an escalated forward (see
        # _checkpoint_not_reentrant): the live localizer then sees the segment's ops too.
        self._unnested: Any = None
        self._live_used = False
        self._poison_reported = False
        self._half_loss = False  # a loss of this step was computed in float16 (read by nonfinite_loss)
        self._under_compile = False  # the watched model's forward was seen inside a Dynamo trace
        self._redirect: Any = None  # the arguments of Fabric's training_step call now running (not a forward)
        #: Between steps (and after close): the last step's index and its forward calls' ``(args, kwargs, rng
        #: state)``, references only, for ``Watcher.gradcheck()``; dropped when the next step's forward starts.
        self.last_step: tuple[int, list[tuple[Any, Any, Any]]] | None = None

    @property
    def active(self) -> bool:
        return self.engine is not None and bool(self.engine.config.escalate) and self.model is not None

    @property
    def escalated(self) -> bool:
        """Whether the escalation window is open."""
        return self._window_left > 0

    # -- attach / cheap mode -----------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        self.engine = engine
        engine.escalated = False
        engine.replaying = False
        # Under Lightning Fabric the user's module, not fabric.setup's wrapper: Fabric runs training_step on it
        # directly, so only its own forward is sure to run (and the replay then runs no strategy wrapper's
        # collectives, e.g. DDP's buffer broadcast, on this rank alone).
        self.model = user_module(engine.model) if isinstance(engine.model, nn.Module) else None
        if not engine.config.escalate or self.model is None:
            return
        observers = getattr(engine, "loss_observers", None)
        if observers is not None:
            observers.append(self._on_loss)
        if self.integration != "plain":
            return
        model = self.model
        self._hooks.append(owned(model, model.register_forward_pre_hook(self._on_forward_start, with_kwargs=True)))
        self._hooks.append(owned(model, model.register_forward_hook(self._on_forward_end, with_kwargs=True)))

    def _on_forward_start(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._replaying or not torch.is_grad_enabled():
            return
        if fabric_redirect(module):
            # Fabric calling training_step through DDP: its arguments are the batch, its output the loss; the
            # model's own call inside (self(x)) is the forward to keep.
            self._redirect = args
            return
        if not self._under_compile and torch.compiler.is_compiling():
            # The watched module runs inside a torch.compile'd wrapper (watch(model) of compile(model)):
            # its escalation window must add no function mode or hooks to the trace either.
            self._under_compile = True
        engine = self.engine
        counts = engine.step_counts
        mark = sum(counts)
        if mark != self._mark:  # an optimizer step happened since the last capture
            self._mark = mark
            self._new_step()
            self.last_step = None
        if engine.config.every > 1 and not any(engine.should_check(i) for i in range(len(counts))):
            return  # this step is not checked: keep nothing
        calls = self._calls
        calls.append(_Call(args, kwargs, _autocast_state()))
        self._forwards += 1
        if len(calls) > MAX_GRADS:
            calls[-MAX_GRADS - 1].fold()
        if len(calls) > MAX_CALLS:
            calls.pop(0).release()
        if self._window_left > 0 and not self._under_compile:
            self._escalated_forward_start()
        return

    def _on_forward_end(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if args is self._redirect:
            self._redirect = None
            return
        if self._replaying or not self._calls or not torch.is_grad_enabled():
            return
        call = self._calls[-1]
        if isinstance(output, torch.Tensor):
            call.outputs = [weakref.ref(output)]
            if output.requires_grad:
                output.register_hook(functools.partial(call.set_grad, 0))
                call.nodes, call.node_index = (output.grad_fn,), (0,)
            return
        nodes, index = [], []
        leaves = _output_leaves(output)
        call.outputs = [weakref.ref(t) for t in leaves if isinstance(t, torch.Tensor)][:MAX_CALLS]
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(call.set_grad, i))
                nodes.append(t.grad_fn)
                index.append(i)
        call.nodes, call.node_index = tuple(nodes), tuple(index)
        return

    def _on_loss(self, loss: torch.Tensor) -> None:
        """``observe_loss`` (before backward in the documented loop): O(1) outside an escalation window."""
        if self._replaying:
            return
        if loss.dtype == torch.float16:
            self._half_loss = True
        try:
            if self.integration == "lightning":
                if self._batches and len(self._batches[-1].losses) < MAX_CALLS:
                    self._batches[-1].losses.append(loss.detach())
                return
            if loss.grad_fn is None or not self._calls:
                return
            call = self._calls[-1]
            if len(call.losses) < MAX_GRADS:
                # A reference (the graph's nodes, not its activations, which backward frees): says which
                # micro-batch went non-finite and names the loss code's ops on an incident.
                call.losses.append(loss if call.held else loss.detach())
            live = self._live
            if live is not None and self._live_used:
                # Escalated: the loss code's backward nodes get the localizer's hooks too, so a NaN born
                # between the model's output and the loss is named with its op and line.
                live.hook_graph([loss], outside=True)
        except Exception as exc:  # noqa: BLE001
            internal_warning("Escalation.observe_loss", exc, owner=self.engine)

    def _new_step(self) -> None:
        for call in self._calls:
            call.release()
        self._calls.clear()
        self._forwards = 0
        if self._live is not None:
            self._live.reset()
            self._live_used = False

    def lightning_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Called by ``GradWatchCallback.on_train_batch_start``: keep a reference to the batch and, in an
        escalation window, switch anomaly mode on (the Trainer overrides it when set any earlier)."""
        if not self.active:
            return
        self.capture_batch(batch, batch_idx, trainer, pl_module)
        if self._window_left > 0:
            self._anomaly_on()

    def capture_batch(self, batch: Any, batch_idx: int, trainer: Any = None, pl_module: Any = None) -> None:
        """Keep a reference to a Lightning batch for replay (``training_step(batch, batch_idx)``).

        Every batch of the current accumulation cycle is kept (at most ``MAX_CALLS``): the replay picks
        the one whose loss was non-finite.
        """
        mark = sum(self.engine.step_counts) if self.engine is not None else self._mark
        if mark != self._mark:  # an optimizer step happened since: a new accumulation cycle
            self._mark = mark
            self._batches = []
        self._batches.append(_Batch(batch, batch_idx, trainer, pl_module if pl_module is not None else self.model))
        if len(self._batches) > MAX_CALLS:
            del self._batches[0]

    # -- escalation window -------------------------------------------------------------------------
    def _anomaly_on(self) -> None:
        if self._anomaly_prev is None:
            self._anomaly_prev = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        # check_nan=False: anomaly mode records forward tracebacks; gradwatch itself checks NaN and Inf,
        # so a NaN never raises out of the user's backward() under "warn"/"skip". A user who turned anomaly
        # mode on with its NaN check (Trainer(detect_anomaly=True)) keeps it: their run stops at a NaN.
        enabled, check_nan = self._anomaly_prev
        torch.set_anomaly_enabled(True, bool(enabled and check_nan))

    def _anomaly_restore(self) -> None:
        if self._anomaly_prev is not None:
            enabled, check_nan = self._anomaly_prev
            torch.set_anomaly_enabled(enabled, check_nan)
            self._anomaly_prev = None

    def _open_window(self, step: int) -> None:
        if self._window_left > 0:
            return
        self._window_left = self.engine.config.escalate_steps
        self._window_start = step
        self.engine.escalated = True
        if self._under_compile:
            self._anomaly_on()  # here, at the step: inside Dynamo's trace it would break the graph
        if (
            self.integration == "plain"
            and self.model is not None
            and not _is_compiled(self.model)
            and not self._under_compile
        ):
            # A compiled model's forward runs inside Dynamo's trace, where the live localizer's function
            # modes would cost graph breaks and recompiles: there the window is anomaly mode only.
            self._live = Localizer(self.model)
            self._live.install_module_hooks()
            end = self.model.register_forward_hook(self._escalated_forward_end, with_kwargs=True, always_call=True)
            self._window_hooks.append(owned(self.model, end))

    def _close_window(self) -> None:
        self._restore_checkpoint()
        self._window_left = 0
        self._window_start = None
        for h in self._window_hooks:
            h.remove()
        self._window_hooks = []
        if self._live is not None:
            self._live.close()
            self._live = None
        self._live_used = False
        self._anomaly_restore()
        if self.engine is not None:
            self.engine.escalated = False

    def _escalated_forward_start(self) -> None:
        self._anomaly_on()
        if self._live is not None:
            self._live.start(inside_root=True)  # called from the root model's forward pre-hook
            if self._unnested is None:
                self._unnested = _checkpoint_not_reentrant()
                self._unnested.__enter__()

    def _restore_checkpoint(self) -> None:
        cm, self._unnested = self._unnested, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def _escalated_forward_end(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self._restore_checkpoint()
        live = self._live
        if live is None or self._replaying or not live.recording:
            return
        live.stop_forward()
        try:
            if output is not None:
                leaves = [t for t in _output_leaves(output) if isinstance(t, torch.Tensor)]
                live.hook_graph(leaves)
                self._live_used = True
                if self._calls:  # a device flag, read on an incident only
                    self._calls[-1].output_ok = _all_finite(
                        [t.detach() for t in leaves if t.is_floating_point() or t.is_complex()]
                    )
        except Exception as exc:  # noqa: BLE001
            internal_warning("Escalation.hook_graph", exc, owner=self.engine)
        return

    def before_sync(self, ctx: Any) -> None:
        if self._half_loss:
            # A float16 loss that goes Inf has overflowed 65504 (squared errors above 256): nonfinite_loss says so.
            self._half_loss = False
            ctx.stats.extra["loss_dtype"] = "float16"
        if ctx.stats.none_grad and self.active and _reentrant_no_grad_warned():
            ctx.stats.extra["reentrant_cut"] = self.reentrant_cut  # called by none_grad when it reports only
        passes = ctx.stats.extra.get("backward_passes")
        if isinstance(passes, tuple) and passes[0] >= 3 and self.active:  # only asked about then
            ctx.stats.extra["step_inputs"] = self.step_inputs()

    def step_inputs(self) -> tuple[int, bool, frozenset[int]]:
        """The model inputs of this step so far: how many (forward calls; Lightning batches), whether an
        input tensor requires grad (an adversarial example), and the batch sizes (leading dimensions)."""
        if self.integration == "lightning":
            sources = [b.batch for b in self._batches]
            count = len(sources)
        else:
            sources = [(c.args, c.kwargs) for c in self._calls]
            count = self._forwards
        grad = False
        sizes: set[int] = set()
        for src in sources:
            tensors = [t for t in tree_leaves(src) if isinstance(t, torch.Tensor)]
            grad = grad or any(t.requires_grad for t in tensors)
            first = next((t for t in tensors if t.dim() > 0), None)
            if first is not None:
                sizes.add(int(first.shape[0]))
        return count, grad, frozenset(sizes)

    def after_step(self, stats: Any, decision: str) -> None:
        if stats.optimizer_index == len(self.engine.step_counts) - 1:
            # Release the step's inputs and output gradients as soon as no optimizer needs them. A
            # Lightning batch stays until the next one starts: with several optimizers stepping inside
            # one training_step (manual GAN), the last-listed one may step first.
            inputs = [(c.args, c.kwargs, c.rng) for c in self._calls]
            self._new_step()
            self.last_step = (stats.step, inputs) if inputs else None
        if self._window_left > 0 and stats.optimizer_index == 0 and stats.step != self._window_start:
            self._window_left -= 1
            if self._window_left <= 0:
                self._close_window()

    def close(self) -> None:
        self._close_window()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._new_step()
        self._batches = []
        self._redirect = None
        observers = getattr(self.engine, "loss_observers", None)
        if observers is not None and self._on_loss in observers:
            observers.remove(self._on_loss)

    # -- the incident ------------------------------------------------------------------------------
    def on_incident(self, stats: Any, findings: list[Finding]) -> list[Finding]:
        if not self.active:
            return []
        config = self.engine.config
        if config.deferred:
            # The statistics are one step old and that step's inputs are gone: watch the next steps.
            self._open_window(stats.step)
            return []
        if not stats.is_nonfinite:
            # Only another rank saw it: a local replay has nothing to find here, and under sharded
            # parameters it would run collectives on this rank alone.
            return []
        out: list[Finding] = []
        self._collective = None
        if self._handled == (stats.step, self._mark):
            return out  # a second optimizer of the same step: the first one's findings name the origin
        self._handled = (stats.step, self._mark)
        self._culprit = None
        layers = layer_table(stats)
        origin_finding: Finding | None = None
        result: _Result | None = None
        bad_inputs = self._nonfinite_inputs()
        if bad_inputs:
            # The NaN batch's forward may already have written NaN into buffers (BatchNorm running stats, a
            # fake-quant observer): skipping the update does not undo that, so say it now.
            out.append(_input_finding(stats.step, bad_inputs, self._poisoned(buffers=True)))
        else:
            poisoned = self._poisoned(buffers=False)
            if poisoned:
                if not self._poison_reported:
                    self._poison_reported = True
                    out.append(
                        _poisoned_finding(
                            stats.step, poisoned, config.on_nonfinite, layers, buffers=False, every=config.every,
                            earlier=self.engine.kind_counts.get("nan_origin", 0) > 0,
                            rows=self._embedding_rows(poisoned),
                        )
                    )
                return out
            self._poison_reported = False
            if stats.extra.get("raised") and self.integration != "plain" and not stats.extra.get("anomaly_nan"):
                return out  # the training code raised: training_step is not replayed in a failing Trainer
            result = self._localize()
            if result is not None and self._culprit is not None:
                losses = getattr(self._culprit, "losses", ())
                result.loss_nonfinite = any(
                    not bool(torch.isfinite(l).all()) for l in losses if l.is_floating_point()
                )
                state = getattr(self._culprit, "autocast", None) or ()
                result.half = any(dtype == torch.float16 for _device, dtype in state)
            if result is not None and not result.half:
                # model.half() (or precision="16-true"): the forward runs in float16 without autocast.
                result.half_weights = any(
                    p.dtype == torch.float16 for _n, p in self.engine.index.model_params if p.is_floating_point()
                )
            minus_inf = self._unabsorbed_minus_inf(result)
            if minus_inf:
                # -inf the forward never absorbed, as a mask would be: bad data (log of a zero feature).
                bad_inputs = minus_inf
                out.append(_input_finding(stats.step, minus_inf, self._poisoned(buffers=True), through=result))
            else:
                if self.integration == "plain" and result is not None and result.loc.origin is None and (
                    result.upstream_bad and result.loc.forward_finite
                ):
                    # Born after the model, in the loss code: does a tensor the loop holds for this batch (the
                    # target, a per-sample weight or mask) carry it? Lightning checks its whole batch instead.
                    loop_bad = self._loop_tensors()
                    if loop_bad:
                        out.append(_loop_input_finding(stats.step, loop_bad))
                named = result is not None and result.loc.origin is not None
                # Buffers are checked only when the replay named no op: this step's own forward may have written
                # the NaN into them (BatchNorm running statistics) after it was born where the replay found it.
                # A buffer poisoned by an earlier step (a fake-quant scale, a running scale) makes every later
                # forward non-finite without a birth: it is named instead of a vague "born in the loss".
                stale = [] if named else self._poisoned(buffers=True)
                if named or (result is not None and result.upstream_bad and not stale):
                    self.localizations.append((stats.step, result.loc))
                    origin_finding = _origin_finding(stats.step, result, layers)
                    out.append(origin_finding)
                elif stale:
                    out.append(_poisoned_finding(stats.step, stale, config.on_nonfinite, layers, buffers=True))
                elif result is not None:
                    self.localizations.append((stats.step, result.loc))
                    origin_finding = _origin_finding(stats.step, result, layers)
                    out.append(origin_finding)
        no_forward = self.integration == "plain" and not self._calls and self._forwards == 0
        if result is None and not bad_inputs and no_forward:
            out.append(_no_forward_finding(stats.step, self.model))
        note = None
        if result is None and not bad_inputs and self._collective is not None:
            note = (
                f"The replay of this step stopped at torch.distributed.{self._collective} in the forward: a replay "
                "runs on this rank alone, where a collective would wait for the other ranks or pair with another "
                "of their collectives. The origin was not found before it. The next steps run escalated."
            )
        elif result is None and not bad_inputs:
            note = (
                "The replay of this step's forward and backward on its inputs was finite: the non-finite "
                "value did not come from the model's autograd graph on this batch (look at code that "
                "changes .grad between backward() and step(), at the loss outside the model, or at "
                "randomness such as dropout). The next steps run escalated."
            )
        origin = result.loc.origin if result is not None and origin_finding is not None else None
        if origin is not None:
            # The checks' guess at the cause of a NaN loss with finite gradients ("a mean over zero elements")
            # would contradict the op named here: it is restated (the engine puts it in the original's place).
            from gradwatch.checks.nonfinite import defer_to_origin

            fix = fix_for(origin.op, origin.forward_op)
            for i, f in enumerate(findings):
                restated = defer_to_origin(f, origin.op, origin.module, fix) if f.step == stats.step else None
                if restated is not None:
                    out.append(restated)
                    plain = dataclasses.replace(restated, data={k: v for k, v in restated.data.items() if k != "restates"})
                    findings = [*findings[:i], plain, *findings[i + 1:]]  # for the report
                    break
        self._write_report(stats, findings + [f for f in out if "restates" not in f.data], layers, result, note)
        self._open_window(stats.step)
        return out

    def _source(self) -> list[Any]:
        if self.integration == "lightning":
            return list(self._batches)
        return list(self._calls)

    def _replay_order(self) -> Iterator[Any]:
        """The step's calls (batches) to replay, those that saw the non-finite value first (lazily: the
        caller stops at the first that localizes it).

        Plain loop: calls whose output gradient or loss was non-finite (at most ``MAX_REPLAYS``), then the
        first other call whose plain, unlocalized replay turns non-finite (a NaN born inside the model
        leaves the output gradient finite). Lightning: batches whose loss was non-finite, then the others
        (``training_step`` is the only way to replay them), at most ``MAX_REPLAYS`` in all.
        """
        sources = self._source()
        if len(sources) <= 1:
            yield from sources
            return
        if self.integration == "lightning":
            flags = [_all_finite(b.losses) for b in sources]
            first = [b for b, bad in zip(sources, _nonfinite_flags(flags)) if bad]
            rest = [b for b in sources if all(b is not f for f in first)]
            yield from (first + rest)[:MAX_REPLAYS]
            return
        went_bad = _nonfinite_flags([c.suspect() for c in sources])
        suspects = [c for c, bad in zip(sources, went_bad) if bad][:MAX_REPLAYS]
        yield from suspects
        try:
            for call in sources:
                if not any(call is c for c in suspects) and self._screen_call(call):
                    yield call
                    return
        except Exception as exc:  # noqa: BLE001 - a failed screening: replay the held calls as they are
            if self._collective is not None:
                return  # the forward (or backward) runs a collective: no replay on this rank alone
            internal_warning("Escalation.replay", exc, owner=self.engine)
            yield from (c for c in sources[-MAX_GRADS:] if not any(c is s for s in suspects))

    def _nonfinite_inputs(self, *, minus_inf: bool = False) -> list[tuple[str, int, int]]:
        per_source: list[list[tuple[str, torch.Tensor]]] = []
        sources = self._source()
        for src in sources:
            if isinstance(src, _Batch):
                per_source.append(_named_tensors("batch", src.batch))
            else:
                per_source.append(_named_tensors("args", src.args) + _named_tensors("kwargs", src.kwargs))
        uses: dict[int, int] = {}
        for found in per_source:
            for _n, t in found:
                uses[id(t)] = uses.get(id(t), 0) + 1
        named: list[tuple[str, torch.Tensor]] = []
        for i, found in enumerate(per_source):
            if len(per_source) > 1:
                # Gradient accumulation: say which micro-batch held it (not for a tensor fed to several
                # passes, SAM's). Counted from the step's first forward: a step a GradScaler dropped is found
                # with the next step's forwards held too, so no "of N".
                what = "batch" if isinstance(sources[i], _Batch) else "forward call"
                found = [(f"{n} of the step's {what} {i + 1}" if uses[id(t)] == 1 else n, t) for n, t in found]
            named += found
        return _bad_data([(n, t) for n, t in named if t.is_floating_point() or t.is_complex()], minus_inf=minus_inf)

    def _unabsorbed_minus_inf(self, result: _Result | None) -> list[tuple[str, int, int]]:
        """The inputs holding -inf but no NaN or +Inf, when their -inf was not absorbed. Such an input passes
        for an additive attention mask (see ``_bad_data``) only if the forward absorbs its -inf (softmax,
        masked_fill); one that reaches the model's output as NaN/Inf through plain arithmetic (a Linear) is bad
        data: log of a zero count feature. Not when a NaN was born from finite values, nor for a softmax over a
        fully masked row (the mask's own trap). Incident path, plain loop: a sync or two."""
        if result is None or result.output_ok is None or self.integration != "plain":
            return []
        origin = result.loc.origin
        if origin is not None and (
            origin.phase != "forward"
            or not origin.incoming.get("inf")
            or any(_absorbs_mask(name) for name in (origin.op, origin.forward_op) if name)
        ):
            return []
        if not _nonfinite_flags([result.output_ok])[0]:
            return []
        return self._nonfinite_inputs(minus_inf=True)

    def forward_error(self, exc: BaseException, step: int) -> Finding | None:
        """An exception ended the loop with no NaN/Inf gradient or loss to explain (a loss that raised on a
        NaN input: BCELoss's "between 0 and 1"): a ``nonfinite_input`` finding when the step's inputs, or the
        outputs of the model's latest forward, hold NaN/Inf. Exception path only: a read per tensor."""
        inputs = self._nonfinite_inputs()
        outputs: list[tuple[str, int, int]] = []
        if not inputs and self._calls:
            refs = self._calls[-1].outputs
            live = [(("output" if len(refs) == 1 else f"output {i}"), r()) for i, r in enumerate(refs)]
            outputs = _bad_data([(n, t) for n, t in live if t is not None and (t.is_floating_point() or t.is_complex())])
        if not inputs and not outputs:
            return None
        return _forward_error_finding(step, exc, inputs, outputs)

    def _output_nan(self) -> bool:
        """Whether a held output gradient of the step holds NaN: the loss (or the loss code) was NaN. A
        gradient scaler multiplies a finite output gradient, which may overflow to Inf but never turns NaN.
        Plain loop only; a read per output gradient, exception path only."""
        grads = [g.detach() for c in self._calls for g in c.grads.values() if isinstance(g, torch.Tensor)]
        with torch.no_grad():
            return any(bool(torch.isnan(torch.view_as_real(g) if g.is_complex() else g).any()) for g in grads)

    def _loop_tensors(self) -> list[tuple[str, int, int]]:
        """Tensors of this batch held by the training loop (the first frame outside gradwatch and torch:
        ``y`` in ``loss = loss_fn(model(x), y)``) that hold NaN/Inf: a target, a per-sample weight or mask
        the loss reads. Only those whose first dimension is the batch's (the dataset or a class-weight
        vector is not blamed), not requiring grad, not the model's own tensors. Incident path only."""
        sizes = {
            a.shape[0]
            for c in self._calls
            for a in tree_leaves((c.args, c.kwargs))
            if isinstance(a, torch.Tensor) and a.dim() > 0
        }
        frame = sys._getframe(1)
        for _ in range(64):
            if frame is None:
                return []
            if not library_frame(frame, _WRAPPERS):
                break
            frame = frame.f_back
        else:
            return []
        if frame is None or not sizes:
            return []
        own: set[int] = set()
        if self.model is not None:
            own = {id(t) for t in self.model.parameters()} | {id(t) for t in self.model.buffers()}
        seen_inputs = {id(a) for c in self._calls for a in tree_leaves((c.args, c.kwargs))}
        named: list[tuple[str, torch.Tensor]] = []
        for name, value in list(frame.f_locals.items()):
            if name.startswith("__"):
                continue
            if isinstance(value, (list, tuple, dict)) and len(value) > 16:
                continue
            if not isinstance(value, (torch.Tensor, list, tuple, dict)):
                continue
            for n, t in _named_tensors(name, value):
                if (
                    id(t) in own or id(t) in seen_inputs or t.requires_grad or t.dim() == 0
                    or t.shape[0] not in sizes or not (t.is_floating_point() or t.is_complex())
                ):
                    continue
                named.append((n, t))
        where = f"{frame.f_code.co_name}() at {frame.f_code.co_filename}:{frame.f_lineno}"
        return [(f"{n} (in {where})", nan, inf) for n, nan, inf in _bad_data(named)]

    def _poisoned(self, *, buffers: bool) -> list[str]:
        """Names of parameters (or buffers) that hold NaN/Inf themselves (one sync, incident path only)."""
        if buffers:
            named = list(self.model.named_buffers()) if self.model is not None else []
        else:
            named = list(self.engine.index.model_params)
        params = [(n, p) for n, p in named if p.is_floating_point() and not p.is_meta and p.numel() > 0]
        if not params:
            return []
        batch = SyncBatch()
        slots = queue_grad_norms(batch, [p.detach() for _n, p in params])
        norms = read_grad_norms(batch.resolve(), slots, len(params))
        suspects = [i for i, v in enumerate(norms) if not math.isfinite(v)]
        if not suspects:
            return []
        with torch.no_grad():
            flags = [bool((~torch.isfinite(params[i][1])).any()) for i in suspects]
        return [params[i][0] for i, f in zip(suspects, flags) if f]

    def _embedding_rows(self, names: list[str]) -> dict[str, tuple[list[int], int]]:
        """For poisoned embedding tables, the rows holding NaN/Inf and the number of rows (incident path only).

        A table with a few bad rows (new rows of a resized vocabulary left uninitialized) is non-finite only on
        the batches that look those ids up: saying "every step" would contradict the run's finite steps."""
        if self.model is None:
            return {}
        tables = {id(m.weight): m for m in self.model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
        out: dict[str, tuple[list[int], int]] = {}
        for name, p in self.engine.index.model_params:
            if name in names and id(p) in tables and p.dim() == 2:
                with torch.no_grad():
                    bad = (~torch.isfinite(p)).any(dim=1).nonzero().flatten().tolist()
                if bad and len(bad) < p.shape[0]:
                    out[name] = (bad, p.shape[0])
        return out

    # -- localization ------------------------------------------------------------------------------
    def _localize(self) -> _Result | None:
        live = self._live
        if live is not None and self._live_used:
            try:
                loc = live.resolve()
            finally:
                live.reset()
                self._live_used = False
            upstream_bad, _available = self._upstream_state()
            result = _Result(loc, replayed=False, surrogate=False, upstream_bad=upstream_bad)
            flags = [c.output_ok for c in self._calls if c.output_ok is not None]
            result.output_ok = torch.stack([f.to(flags[0].device) for f in flags]).all() if flags else None
            if loc.origin is not None or (upstream_bad and loc.forward_finite):
                return result
        self._collective = None
        for src in self._replay_order():
            try:
                if isinstance(src, _Batch):
                    result = self._replay_lightning(src)
                else:
                    result = self._replay_call(src)
            except Exception as exc:  # noqa: BLE001 - a failed replay must not fail the step
                if self._collective is not None:
                    return None  # stopped at a collective (see below)
                internal_warning("Escalation.replay", exc, owner=self.engine)
                continue
            if self._collective is not None and result.loc.origin is None:
                # Stopped at a collective before the origin: the rest of the replay is not known (not "finite"),
                # and the other held calls run the same forward. Another rank may still name the origin.
                return None
            if result.loc.origin is not None or result.upstream_bad or not result.loc.forward_finite:
                self._culprit = src
                if result.loc.origin is None and result.upstream_bad and result.loc.forward_finite:
                    result.loss_ops = self._loss_ops()
                return result
        return None

    def _loss_ops(self) -> list[str]:
        """Backward nodes of the loss code (between the model's outputs and the observed losses) whose op
        can turn finite values into NaN/Inf (log, sqrt, division, fractional pow, exp...).

        Read after the backward, when the nodes no longer hold their saved values: which of them produced
        the value cannot be told here, only that they are there. Empty when the walk does not end at the
        model's outputs (then it would name the model's own ops).
        """
        stops = {n for c in self._calls for n in c.nodes if n is not None}
        roots = [l.grad_fn for c in self._calls for l in c.losses if l.grad_fn is not None]
        if not roots or not stops:
            return []
        seen: set[Any] = set()
        frontier: list[Any] = list(roots)
        reached = False
        names: list[str] = []
        while frontier:
            node = frontier.pop()
            if node is None or node in seen:
                continue
            if node in stops:
                reached = True
                continue
            seen.add(node)
            if len(seen) > 512:
                return []
            if type(node).__name__ == "AccumulateGrad":
                continue
            if _can_turn_nonfinite(node):
                names.append(node.name())
            frontier.extend(nxt for nxt, _ in node.next_functions)
        return names if reached else []

    def unowned_params(self, known: set[int], limit: int = 4096) -> list[torch.Tensor]:
        """``nn.Parameter`` leaves the step's model outputs were computed from that the model does not own
        (``known``: ids of its parameters and of the optimizers' tensors): a layer built inside forward().
        A walk of the outputs' graph (at most ``limit`` nodes), stopping at the model's inputs (a
        perturbation that requires grad, added to the input, is not the model's). First checks only."""
        if self.integration != "plain":
            return []
        inputs = [t for c in self._calls for t in tree_leaves((c.args, c.kwargs)) if isinstance(t, torch.Tensor)]
        known = known | {id(t) for t in inputs}
        out: list[torch.Tensor] = []
        for var in self.graph_leaves(limit) or ():
            if isinstance(var, nn.Parameter) and id(var) not in known and all(v is not var for v in out):
                out.append(var)
        return out

    def graph_leaves(self, limit: int = 4096, *, reached: bool = False) -> list[torch.Tensor] | None:
        """The leaf tensors (parameters) the step's model outputs were computed from: a walk of their graph
        (at most ``limit`` nodes) that stops at the model's inputs. ``reached``: only from the outputs a
        gradient arrived at in backward (an auxiliary output the loss ignores reaches nothing). None when
        the step's graph is not held (Lightning, a folded call). For the first steps or suspicious ones."""
        if self.integration != "plain":
            return None
        frontier = [
            n
            for c in self._calls
            for n, i in zip(c.nodes, c.node_index or range(len(c.nodes)))
            if n is not None and (not reached or (c.held and i in c.grads))
        ]
        if not frontier:
            return None
        inputs = [t for c in self._calls for t in tree_leaves((c.args, c.kwargs)) if isinstance(t, torch.Tensor)]
        stops = {id(t.grad_fn) for t in inputs if t.grad_fn is not None}
        seen: set[int] = set()
        out: list[torch.Tensor] = []
        while frontier and len(seen) < limit:
            node = frontier.pop()
            if id(node) in seen or id(node) in stops:
                continue
            seen.add(id(node))
            var = getattr(node, "variable", None)
            if var is not None:
                out.append(var)
                continue
            frontier.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        return out

    def explain_no_graph(self, finding: Finding) -> Finding:
        """``no_grad_graph`` blaming frozen layers or a cut graph: when the cut is a reentrant checkpoint fed
        an input without grad (see :meth:`reentrant_cut`), say so instead; the trainable layers are not frozen."""
        if finding.data.get("cause") not in ("frozen_path", "frozen_or_detached", "detached"):
            return finding
        cut = self.reentrant_cut()
        if not cut:
            return finding
        lines = ["Cause: " + reentrant_cause(cut) if l.startswith("Cause: ") else l for l in finding.message.split("\n")]
        data = {**finding.data, "cause": "reentrant_checkpoint", "reentrant_checkpoint": cut}
        return dataclasses.replace(finding, message="\n".join(lines), module=next(iter(cut)), data=data)

    def reentrant_cut(self) -> dict[str, list[str]]:
        """The ``torch.utils.checkpoint(..., use_reentrant=True)`` segments of the step's forward whose tensor
        inputs all had requires_grad=False (module name), each with the trainable parameters inside it.

        Such a segment returns an output without a graph (torch warns "None of the inputs have
        requires_grad=True. Gradients will be None"), so its parameters get no gradient although they are
        trainable: LoRA adapters behind a frozen embedding (peft#137, transformers#23170). Read by replaying
        the step's last forward with the checkpoint calls recorded: on the ``no_grad_graph`` error path and
        the first ``none_grad`` report only. Plain loop only; empty when no such segment ran.
        """
        cp = sys.modules.get("torch.utils.checkpoint")
        cls = getattr(cp, "CheckpointFunction", None)
        if self.integration != "plain" or self.model is None or not self._calls or cls is None:
            return {}
        seen: list[Any] = []
        own = cls.__dict__.get("apply")
        original = cls.apply

        def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
            if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                seen.append(function)
            return original(function, preserve_rng_state, *args)

        call = self._calls[-1]
        model = self._replay_model()
        self._replaying = True
        cls.apply = staticmethod(apply)
        try:
            with _preserved(model), warnings.catch_warnings(), torch.enable_grad(), _autocast(call.autocast):
                warnings.simplefilter("ignore")  # torch's own "Gradients will be None", once more
                args, kwargs = tree_map(_replay_input, (call.args, call.kwargs))
                _set_rng_state(call.rng)
                with _no_collectives(self):
                    model(*args, **kwargs)
        except _CollectiveInReplay:
            pass  # the segments seen before the collective are reported
        finally:
            self._replaying = False
            if own is None:
                del cls.apply
            else:
                cls.apply = own
        names = self.engine.index.module_name
        out: dict[str, list[str]] = {}
        for fn in seen:
            module = _segment_module(fn)
            if module is None or id(module) not in names:
                continue  # a function of no module of the model: which parameters it trains is not known
            # A frozen segment (no trainable parameter inside) checkpointed this way loses nothing.
            inside = [n for p in module.parameters() if p.requires_grad and (n := self.engine.index.name_of(p))]
            if inside:
                out[names[id(module)] or "<root>"] = inside
        return out

    def _upstream_state(self, call: _Call | None = None) -> tuple[bool, bool]:
        """(non-finite, available) for the gradient that reached the model's outputs.

        ``available``: the gradients themselves are held (calls folded long ago only kept a flag).
        """
        calls = [call] if call is not None else self._calls
        grads = [g for c in calls for g in c.grads.values() if isinstance(g, torch.Tensor)]
        sums = [v for c in calls for v in c.sums]
        bad = bool(_nonfinite_flags([_all_finite(sums)])[0]) if sums else False
        if not grads:
            return bad, False
        v = summarize([g for g in grads if g.is_floating_point() or g.is_complex()])
        if v is None:
            return bad, True
        nan, inf = v[:2].tolist()
        return bool(nan or inf or bad), True

    def _screen_call(self, call: _Call) -> bool:
        """Replay one call's forward and backward without localizing: does it turn non-finite?"""
        model = self._replay_model()
        _bad, available = self._upstream_state(call)
        with _preserved(model), self._replay_guard(), torch.enable_grad(), _autocast(call.autocast):
            args, kwargs = tree_map(_replay_input, (call.args, call.kwargs))
            _set_rng_state(call.rng)
            output = model(*args, **kwargs)
            leaves = [t for t in _output_leaves(output) if isinstance(t, torch.Tensor)]
            checks = [torch.isfinite(t).all() for t in leaves if t.is_floating_point() or t.is_complex()]
            outs = [
                (i, t) for i, t in enumerate(_output_leaves(output)) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            targets, grad_outputs = [], []
            for i, t in outs:
                g = call.grads.get(i) if available else None
                if available and (g is None or g.shape != t.shape):
                    continue
                targets.append(t)
                grad_outputs.append(g if g is not None else torch.ones_like(t))
            wrt = [p for p in model.parameters() if p.requires_grad]
            if targets and wrt:
                grads = torch.autograd.grad(targets, wrt, grad_outputs, allow_unused=True)
                checks += [torch.isfinite(g).all() for g in grads if g is not None]
            return any(_nonfinite_flags(checks))

    def _replay_model(self) -> nn.Module:
        model = self.model
        assert model is not None
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and type(model).__name__ == "DistributedDataParallel":
            model = inner  # no collective calls in a replay that only this rank runs
        orig = getattr(model, "_orig_mod", None)
        if isinstance(orig, nn.Module) and _is_compiled(model):
            # Replayed eagerly: a compiled forward run once under the localizer's dispatch mode changes the
            # compiled graph's later numerics (by an ulp); the eager module computes the same values.
            return orig
        return model

    def _replay_call(self, call: _Call) -> _Result:
        model = self._replay_model()
        upstream_bad, available = self._upstream_state(call)
        loc = Localizer(model, aten=True)
        loc.replay = True
        anomaly_error: str | None = None
        traceback: str | None = None
        surrogate = False
        with _preserved(model), self._replay_guard(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, check_nan=True), _autocast(call.autocast):
                args, kwargs = tree_map(_replay_input, (call.args, call.kwargs))
                _set_rng_state(call.rng)
                loc.start()
                try:
                    output = model(*args, **kwargs)
                except _CollectiveInReplay:
                    output = None  # what the forward did before the collective is localized; no backward
                finally:
                    loc.stop_forward()
                leaves = list(enumerate(_output_leaves(output))) if output is not None else []
                output_ok = _all_finite(
                    [t.detach() for _i, t in leaves if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
                )
                outs = [(i, t) for i, t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
                loc.hook_graph([t for _i, t in outs])
                use_real = available and not upstream_bad
                targets, grad_outputs = [], []
                for i, t in outs:
                    g = call.grads.get(i) if use_real else None
                    if use_real and (g is None or g.shape != t.shape):
                        continue  # this output did not reach the loss
                    targets.append(t)
                    grad_outputs.append(g if g is not None else torch.ones_like(t))
                surrogate = not use_real
                wrt: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
                wrt += [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
                if targets and wrt:
                    try:
                        torch.autograd.grad(targets, wrt, grad_outputs, allow_unused=True)
                    except (RuntimeError, _CollectiveInReplay) as exc:
                        # A collective in a backward function (an all_reduce in a custom Function) is no error.
                        anomaly_error = None if self._collective is not None else str(exc)
            traceback = _anomaly_traceback(caught)
        _reemit_own_warnings(caught)
        try:
            result = loc.resolve()
        finally:
            loc.close()
        out = _Result(
            result,
            replayed=True,
            surrogate=surrogate,
            upstream_bad=upstream_bad,
            anomaly_error=anomaly_error,
            anomaly_traceback=traceback,
        )
        out.output_ok = output_ok
        return out

    def _replay_lightning(self, src: _Batch) -> _Result:
        pl_module = src.pl_module
        loc = Localizer(pl_module, root_label=ROOT, aten=True)
        loc.replay = True
        anomaly_error: str | None = None
        traceback: str | None = None
        with _preserved(pl_module), self._replay_guard(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, check_nan=True):
                batch = tree_map(_replay_input, src.batch)
                _set_rng_state(src.rng)
                losses: list[torch.Tensor] = []
                with _lightning_guards(pl_module, losses), _train_step_context(src.trainer):
                    loc.start()
                    try:
                        out = pl_module.training_step(batch, src.batch_idx)
                    except _CollectiveInReplay:
                        out = None  # self.all_gather: what training_step did before it is localized; no backward
                    finally:
                        loc.stop_forward()
                loss = out.get("loss") if isinstance(out, dict) else out
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    losses.insert(0, loss)
                losses = [l for l in losses if isinstance(l, torch.Tensor) and l.requires_grad]
                loc.hook_graph(losses)
                wrt = [p for p in pl_module.parameters() if p.requires_grad]
                if losses and wrt:
                    try:
                        torch.autograd.grad(losses, wrt, [torch.ones_like(l) for l in losses], allow_unused=True)
                    except (RuntimeError, _CollectiveInReplay) as exc:
                        anomaly_error = None if self._collective is not None else str(exc)
            traceback = _anomaly_traceback(caught)
        _reemit_own_warnings(caught)
        try:
            result = loc.resolve()
        finally:
            loc.close()
        return _Result(
            result,
            replayed=True,
            surrogate=False,
            upstream_bad=False,
            anomaly_error=anomaly_error,
            anomaly_traceback=traceback,
            lightning=True,
        )

    @contextlib.contextmanager
    def _replay_guard(self) -> Iterator[None]:
        live = self._live
        was_recording = live.recording if live is not None else False
        if live is not None:
            live.recording = False
        self._replaying = True
        self.engine.replaying = True
        try:
            with _checkpoint_not_reentrant(), _no_collectives(self):
                yield
        finally:
            self._replaying = False
            self.engine.replaying = False
            if live is not None:
                live.recording = was_recording

    # -- report ------------------------------------------------------------------------------------
    def _write_report(
        self,
        stats: Any,
        findings: list[Finding],
        layers: list[dict[str, Any]],
        result: _Result | None,
        note: str | None,
    ) -> None:
        log_dir = self.engine.log_dir  # None when the log directory could not be written (already reported)
        if not log_dir or not self.engine.rank_zero or len(self.reports) >= MAX_REPORTS:
            return
        save = bool(self.engine.config.save_batch)
        paths = incident_paths(log_dir, stats.step, stats.optimizer_index, save_batch=save)
        for f in findings:
            if f.kind in ("nan_origin", "nonfinite_input") and f.step == stats.step:
                f.data["report"] = paths.markdown
        inputs = None
        if save:
            src = self._source()
            culprit = next((s for s in src if s is self._culprit), src[-1] if src else None)
            if isinstance(culprit, _Batch):
                inputs = {"batch": culprit.batch, "batch_idx": culprit.batch_idx}
                if len(src) > 1:
                    inputs["batches"] = [{"batch": b.batch, "batch_idx": b.batch_idx} for b in src]
            elif culprit is not None:
                inputs = {"args": culprit.args, "kwargs": culprit.kwargs}
                if len(src) > 1:
                    inputs["calls"] = [{"args": c.args, "kwargs": c.kwargs} for c in src]
        traceback = None
        anomaly_error = None
        if result is not None:
            origin = result.loc.origin
            traceback = (origin.traceback if origin is not None else None) or result.anomaly_traceback
            anomaly_error = result.anomaly_error
        try:
            write_incident(
                paths,
                step=stats.step,
                findings=findings,
                layers=layers,
                traceback=traceback,
                anomaly_error=anomaly_error,
                inputs=inputs,
                note=note,
                run=self.engine.run_id,
            )
            self.reports.append(paths.markdown)
        except Exception as exc:  # noqa: BLE001
            internal_warning("incident report", exc, owner=self.engine)


class _Result:
    def __init__(
        self,
        loc: Localization,
        *,
        replayed: bool,
        surrogate: bool,
        upstream_bad: bool,
        anomaly_error: str | None = None,
        anomaly_traceback: str | None = None,
        lightning: bool = False,
    ) -> None:
        self.loc = loc
        self.replayed = replayed
        self.surrogate = surrogate
        self.upstream_bad = upstream_bad
        self.anomaly_error = anomaly_error
        self.anomaly_traceback = anomaly_traceback
        self.lightning = lightning
        #: Loss-code ops that can produce NaN/Inf, when the NaN/Inf came from the loss (see ``_loss_ops``).
        self.loss_ops: list[str] = []
        #: The replayed call's observed loss was already non-finite (the loss code's forward made it first).
        self.loss_nonfinite = False
        #: The replayed call ran under autocast in float16.
        self.half = False
        #: The model's weights are float16 (model.half()): its forward ran in float16 without autocast.
        self.half_weights = False
        #: Plain loop: a device flag, whether the forward's output was all finite (None: not known).
        self.output_ok: torch.Tensor | None = None


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One device flag: every element of ``tensors`` is finite (None for no tensors). No sync."""
    flags = [torch.isfinite(t).all() for t in tensors]
    if not flags:
        return None
    device = flags[0].device
    return torch.stack([f.to(device) for f in flags]).all()


def _nonfinite_flags(flags: Sequence[torch.Tensor | None]) -> list[bool]:
    """For each "all finite" device flag (None: unknown), whether it says non-finite. One read per device."""
    out = [False] * len(flags)
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        if f is not None:
            by_device.setdefault(f.device, []).append(i)
    for idx in by_device.values():
        values = torch.stack([flags[i].reshape(()) for i in idx]).tolist()  # type: ignore[union-attr]
        for i, v in zip(idx, values):
            out[i] = not v
    return out


def _can_turn_nonfinite(node: Any) -> bool:
    """Whether a backward node's op can make NaN/Inf from finite inputs (the ops ``fix_for`` knows, softmax
    aside: it needs an Inf input; custom autograd Functions, whose backward is the user's)."""
    name = node.name()
    if re.fullmatch(r"[A-Za-z_]\w*Backward", name):
        return True  # a custom autograd.Function (no digit suffix): its backward may divide by anything
    base = re.sub(r"Backward\d*$", "", name.rsplit("::", 1)[-1])
    if not any(base in names for names, _fix in _FIXES if "Softmax" not in names):
        return False
    if base == "Pow":
        try:
            exponent = node._saved_exponent  # a number for x ** p; still readable after the backward
        except Exception:  # noqa: BLE001 - a tensor exponent, released
            return True
        if isinstance(exponent, (int, float)) and float(exponent).is_integer() and exponent >= 0:
            return False  # x ** 2: finite wherever x is
    if base in ("NllLoss", "NllLoss2d"):
        # Asked only when the gradient reaching the model was non-finite. Every target ignored makes the loss
        # 0/0 = NaN but its gradient zero, so without class weights nll_loss cannot have made it; a weight
        # (NaN/Inf from 1/count) can. The weight reads as None after the backward when none was passed.
        try:
            return node._saved_weight is not None
        except Exception:  # noqa: BLE001 - a weight tensor, released by the backward
            return True
    return True


# -- state that a replay must not change ------------------------------------------------------------
@contextlib.contextmanager
def _preserved(model: nn.Module) -> Iterator[None]:
    """Restore module buffers (BatchNorm running statistics, counters) and the RNG states afterwards."""
    buffers = []
    for m in model.modules():
        for name, b in m._buffers.items():
            if isinstance(b, torch.Tensor):
                buffers.append((m, name, b, b.detach().clone()))
    cpu_rng = torch.get_rng_state()
    cuda_rng = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_rng = torch.cuda.get_rng_state_all()
    try:
        with host_rng_kept():  # a forward that draws from ``random`` (LayerDrop, augmentation) draws again
            yield
    finally:
        with torch.no_grad():
            for m, name, b, saved in buffers:
                if m._buffers.get(name) is not b:
                    m._buffers[name] = b
                b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


#: torch.distributed's collective and point-to-point calls, and its functional collectives (the module functions:
#: DDP's own are not reached, as replays run the inner module). A replay runs on one rank: there a collective in the forward (a contrastive
#: loss gathering embeddings, Lightning's ``self.all_gather``, a custom all_reduce) waits for ranks that run
#: no replay, or pairs with another collective of theirs (gloo aborts the process on the size mismatch).
_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "_all_gather_base", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "scatter", "scatter_object_list", "send", "recv", "isend",
    "irecv", "batch_isend_irecv",
    # torch.distributed._functional_collectives (torchtitan, DTensor-free tensor parallelism)
    "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd", "all_to_all_single_autograd",
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "permute_tensor",
)


class _CollectiveInReplay(Exception):
    """A ``torch.distributed`` collective called within a replay (see :func:`_no_collectives`)."""


@contextlib.contextmanager
def _no_collectives(owner: Any) -> Iterator[None]:
    """Within a replay under an initialized process group of several ranks, every collective of
    ``torch.distributed`` raises :class:`_CollectiveInReplay` (its name kept in ``owner._collective``) instead of
    communicating: the replay stops there. No-op otherwise."""
    dist = sys.modules.get("torch.distributed")
    try:
        several = dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except Exception:  # noqa: BLE001 - a process group being torn down
        several = False
    if not several:
        yield
        return
    names = ("torch.distributed.distributed_c10d", "torch.distributed._functional_collectives")
    modules = [m for m in (dist, *map(sys.modules.get, names)) if m is not None]
    saved: list[tuple[Any, str, Any]] = []

    def blocked(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            owner._collective = owner._collective or name
            raise _CollectiveInReplay(name)

        return call

    for module in modules:
        for name in _COLLECTIVES:
            fn = module.__dict__.get(name)
            if callable(fn):
                saved.append((module, name, fn))
                setattr(module, name, blocked(name))
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


@contextlib.contextmanager
def _checkpoint_not_reentrant() -> Iterator[None]:
    """Within a replay, ``torch.utils.checkpoint``'s reentrant mode (``use_reentrant=True``: HF's gradient
    checkpointing, older code) runs as the non-reentrant one: the same values and memory, but the segment's
    recomputation happens in the replay's own graph, where the localizer sees each op and module. The
    reentrant mode runs a nested backward no hook of gradwatch sees: the NaN was blamed on
    CheckpointFunctionBackward, or not found at all."""
    cp = sys.modules.get("torch.utils.checkpoint")
    cls = getattr(cp, "CheckpointFunction", None)
    if cls is None or not callable(getattr(cp, "checkpoint", None)):
        yield
        return
    own = cls.__dict__.get("apply")

    def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        return cp.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)

    cls.apply = staticmethod(apply)
    try:
        yield
    finally:
        if own is None:
            del cls.apply
        else:
            cls.apply = own


def _reentrant_no_grad_warned() -> bool:
    """Whether torch's reentrant checkpoint has warned "None of the inputs have requires_grad=True" in this
    process (its module's warning registry): a ``none_grad`` report replays the step's forward to look for such
    segments only then. A replay on a healthy run moves Python-side state of the model (an attribute a forward
    sets) once more: no replay for the usual unused head."""
    cp = sys.modules.get("torch.utils.checkpoint")
    registry = getattr(cp, "__warningregistry__", None)
    if not isinstance(registry, dict):
        return False
    return any(
        isinstance(k, tuple) and k and isinstance(k[0], str) and k[0].startswith("None of the inputs have requires_grad")
        for k in registry
    )


def _segment_module(fn: Any) -> nn.Module | None:
    """The module a checkpointed function runs: the module itself, its bound ``forward``/``__call__``,
    a ``functools.partial`` of those (HF's ``_gradient_checkpointing_func(layer.__call__, ...)``) or a
    closure over it (older HF's ``create_custom_forward(module)``)."""
    for _ in range(4):
        if isinstance(fn, functools.partial):
            fn = fn.func
        else:
            break
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return owner
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, nn.Module):
            return value
    return None


def reentrant_cause(cut: dict[str, list[str]]) -> str:
    """The cause and fix for trainable parameters inside reentrant checkpoint segments fed inputs without
    grad (``cut``: module name -> its trainable parameters, see :meth:`Escalation.reentrant_cut`)."""
    segments = list(cut)
    params = [n for names in cut.values() for n in names]
    where = names_text([f"`{s}`" for s in segments])
    one = len(segments) == 1
    inside = f" ({names_text(params)})" if params else ""
    return (
        f"torch.utils.checkpoint(..., use_reentrant=True) ran {where} on "
        f"{'an input that does' if one else 'inputs that do'} not require grad (what runs before "
        f"{'it' if one else 'the first'} is frozen, e.g. the embedding of a LoRA/adapter fine-tune): a reentrant "
        "checkpoint then returns an output without a graph (torch's warning: \"None of the inputs have "
        f"requires_grad=True. Gradients will be None\"), so the trainable parameters inside {'it' if one else 'them'}"
        f"{inside} get no gradient. They are not frozen. Fix: checkpoint with use_reentrant=False "
        "(`checkpoint(fn, x, use_reentrant=False)`; Hugging Face: "
        "`model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False})`), or "
        "call `model.enable_input_require_grads()` (Hugging Face/PEFT), or make the checkpoint's input require "
        "grad (`x.requires_grad_(True)` on the frozen part's output)."
    )


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The random number generators' state as a forward starts (CPU, and the current CUDA device's): ~1 us,
    no sync. A replay restores it, so it draws the dropout masks and random ops that step drew."""
    try:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda
    except Exception:  # noqa: BLE001 - a replay without it draws fresh random numbers
        return None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
    """Inside :func:`_preserved` (which puts the user's state back afterwards)."""
    if state is None:
        return
    try:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])
    except Exception as exc:  # noqa: BLE001
        internal_warning("replay random state", exc)


def _replay_input(v: Any) -> Any:
    # A private copy: a model that modifies its input in place must not change the user's batch.
    if isinstance(v, torch.Tensor):
        c = v.detach().clone()
        if v.requires_grad and (c.is_floating_point() or c.is_complex()):
            c.requires_grad_(True)
        return c
    return v


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...] | None:
    state: tuple[tuple[str, torch.dtype], ...] | None = None
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            state = (state or ()) + ((device, torch.get_autocast_dtype(device)),)
    return state


@contextlib.contextmanager
def _autocast(state: tuple[tuple[str, torch.dtype], ...] | None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device, dtype in state or ():
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def _reemit_own_warnings(caught: list[warnings.WarningMessage]) -> None:
    """The replay records warnings process-wide: gradwatch's own ones (e.g. from its TensorBoard writer
    thread, issued meanwhile) are passed on instead of being lost with the replay's anomaly-mode noise."""
    from gradwatch.report import GradWatchInternalWarning, safe_warn_explicit

    for w in caught:
        if issubclass(w.category, GradWatchInternalWarning):
            safe_warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _anomaly_traceback(caught: list[warnings.WarningMessage]) -> str | None:
    for w in caught:
        text = str(w.message)
        if text.startswith("Error detected in"):
            return re.sub(r"\s*\(Triggered internally at .*\)\s*$", "", text, flags=re.DOTALL)
    return None


# -- Lightning replay guards ------------------------------------------------------------------------
class _InertOptimizer:
    """Stands in for a LightningOptimizer during a replay: ``step``/``zero_grad`` do nothing, except that
    ``step(closure)`` evaluates the closure once (manual optimization builds its loss there; its
    ``manual_backward`` and ``zero_grad`` are inert during the replay too)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        return closure() if callable(closure) else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def toggle_model(self, *args: Any, **kwargs: Any) -> Any:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if callable(value) and name not in _READ_ONLY:
            # Other methods of the optimizer move the weights too (SAM's first_step/second_step, which
            # calls base_optimizer.step()): inert during the replay.
            return lambda *args, **kwargs: None
        return value


_READ_ONLY = frozenset({"state_dict", "__repr__", "__str__"})


class _InertScheduler(_InertOptimizer):
    def step(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        return None


def _inert(value: Any, cls: type) -> Any:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return type(value)(cls(v) for v in value)
    return cls(value)


@contextlib.contextmanager
def _lightning_guards(pl_module: Any, losses: list[torch.Tensor]) -> Iterator[None]:
    """Neutralize training_step's side effects: logging, manual backward, optimizer and scheduler steps."""
    optimizers = pl_module.optimizers(use_pl_optimizer=True) if _has_trainer(pl_module) else None
    try:
        schedulers = pl_module.lr_schedulers() if _has_trainer(pl_module) else None
    except Exception:  # noqa: BLE001
        schedulers = None
    fake_opts = _inert(optimizers, _InertOptimizer)
    fake_scheds = _inert(schedulers, _InertScheduler)

    def manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        losses.append(loss)

    patches: dict[str, Any] = {
        "log": lambda *a, **k: None,
        "log_dict": lambda *a, **k: None,
        "manual_backward": manual_backward,
        "optimizers": lambda *a, **k: fake_opts,
        "lr_schedulers": lambda *a, **k: fake_scheds,
        "toggle_optimizer": lambda *a, **k: None,
        "untoggle_optimizer": lambda *a, **k: None,
        "toggled_optimizer": lambda *a, **k: contextlib.nullcontext(),
        "clip_gradients": lambda *a, **k: None,
    }
    with patched(pl_module, patches):  # a copy of the module taken by training_step gets none of them
        yield


def _has_trainer(pl_module: Any) -> bool:
    try:
        return pl_module.trainer is not None
    except Exception:  # noqa: BLE001 - Lightning raises when no trainer is attached
        return False


def _train_step_context(trainer: Any) -> Any:
    plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    ctx = getattr(plugin, "train_step_context", None)
    if ctx is None:
        return contextlib.nullcontext()
    try:
        return ctx()
    except Exception:  # noqa: BLE001
        return contextlib.nullcontext()


# -- findings ---------------------------------------------------------------------------------------
def _named_tensors(prefix: str, obj: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    leaves, _spec = tree_flatten_with_path(obj)
    out = []
    for path, v in leaves:
        if isinstance(v, torch.Tensor) and not v.is_meta and v.layout is torch.strided:
            out.append((prefix + "".join(str(k) for k in path), v))
    return out


def layer_table(stats: Any) -> list[dict[str, Any]]:
    """Per-layer rows (layer, grad norm, NaN count, Inf count) in model order, from a step's statistics."""
    order: list[str] = []
    acc: dict[str, float] = {}
    nan: dict[str, int] = {}
    inf: dict[str, int] = {}
    norms = stats.norms if len(stats.norms) == len(stats.names) else [float("nan")] * len(stats.names)
    for name, module, v in zip(stats.names, stats.modules, norms):
        key = ROOT if module == "" else ("<foreign>" if module is None else module)
        if key not in acc:
            order.append(key)
            acc[key] = 0.0
            nan[key] = 0
            inf[key] = 0
        acc[key] += v * v
        nan[key] += int(stats.nan_counts.get(name, 0))
        inf[key] += int(stats.inf_counts.get(name, 0))
    return [
        {"layer": k, "grad_norm": math.sqrt(acc[k]) if math.isfinite(acc[k]) else acc[k], "nan": nan[k], "inf": inf[k]}
        for k in order
    ]


def _absorbs_mask(op: str) -> bool:
    """Whether ``op`` is where an additive attention mask's -inf is meant to go (a NaN there is a fully
    masked row, not bad data): softmax, log-softmax, logsumexp, scaled_dot_product_attention."""
    base = _op_base(op).lower()
    return any(k in base for k in ("softmax", "logsumexp", "scaled_dot_product", "scaleddotproduct", "attention"))


def _input_finding(
    step: int, bad: list[tuple[str, int, int]], buffers: list[str] | None = None, through: _Result | None = None
) -> Finding:
    parts = [f"{name} ({nan} NaN, {inf} Inf)" for name, nan, inf in bad]
    minus_inf = ""
    if through is not None:
        site = through.loc.first_module  # the first module whose output it made non-finite
        origin = through.loc.origin
        if site is None and origin is not None:
            site = f"op {origin.op}" + (f" in module {origin.module}" if origin.module else "")
        elif site is not None:
            site = f"module {site}"
        minus_inf = (
            " It holds -inf and no NaN or +Inf, which would pass for an additive attention mask, but the forward "
            "does not absorb it as a mask is (softmax, masked_fill): it reaches the model's output as NaN/Inf"
            + (f" (first through {site})" if site else "")
            + ". A -inf feature is usually log of 0: log of a zero count, price or probability (use "
            "torch.log1p(x), or x.clamp_min(1e-8).log())."
        )
    stale = ""
    if buffers:
        stale = (
            f"\nIts forward pass also wrote NaN/Inf into buffers that later forwards read: {names_text(buffers)} "
            "(skipping the update does not undo that): reset them (BatchNorm: module.reset_running_stats()) "
            "or reload a checkpoint, or every later step is non-finite."
        )
    return Finding(
        kind="nonfinite_input",
        step=step,
        severity="error",
        message=(
            f"The inputs of step {step} already hold non-finite values before the model ran: "
            f"{', '.join(parts[:8])}{' and more' if len(parts) > 8 else ''}. The data, not the model, is the "
            "cause." + minus_inf + "\nFix: find where the batch is built (missing values in the dataset, a normalization by "
            "a zero std, a broken augmentation); filter or impute bad samples, and assert "
            "torch.isfinite(x).all() in the data pipeline while debugging." + stale
        ),
        data={
            "poisoned_buffers": list(buffers or []),
            "inputs": [{"input": n, "nan": a, "inf": b} for n, a, b in bad],
            "table": [{"input": n, "nan": a, "inf": b} for n, a, b in bad],
        },
    )


def _forward_error_finding(
    step: int, exc: BaseException, inputs: list[tuple[str, int, int]], outputs: list[tuple[str, int, int]]
) -> Finding:
    """``nonfinite_input`` for a step that raised before its backward: the facts of ``_input_finding``, with
    the exception they explain."""
    error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if inputs:
        base = _input_finding(step, inputs)
        head, sep, fix = base.message.partition("\nFix:")
        message = (
            f"Training stopped at step {step} with {error}, raised before any backward pass. {head} "
            f"The NaN/Inf went through the model into the code that raised.{sep}{fix}"
        )
        data = {**base.data, "outputs": [], "raised": type(exc).__name__, "error": str(exc)}
        return dataclasses.replace(base, message=message, data=data)
    parts = [f"{name} ({nan} NaN, {inf} Inf)" for name, nan, inf in outputs]
    return Finding(
        kind="nonfinite_input",
        step=step,
        severity="error",
        message=(
            f"Training stopped at step {step} with {error}, raised before any backward pass, and the model's "
            f"output holds non-finite values: {', '.join(parts[:8])}. The step's inputs were finite: the model "
            "made them (weights or buffers already NaN/Inf, or an op out of range in the forward), and the "
            "code that raised received them.\n"
            "Fix: look at this run's earlier findings (nonfinite_grad, nan_origin, exploding_grad) for how the "
            "weights went non-finite; if there are none, run this step with torch.autograd.set_detect_anomaly("
            "True) to find the forward op, and check for in-place writes to the weights."
        ),
        data={"inputs": [], "outputs": [{"output": n, "nan": a, "inf": b} for n, a, b in outputs],
              "table": [{"input": n, "nan": a, "inf": b} for n, a, b in outputs],
              "raised": type(exc).__name__, "error": str(exc)},
    )


def _loop_input_finding(step: int, bad: list[tuple[str, int, int]]) -> Finding:
    parts = [f"{name} ({nan} NaN, {inf} Inf)" for name, nan, inf in bad]
    return Finding(
        kind="nonfinite_input",
        step=step,
        severity="warning",
        message=(
            f"The batch of step {step} holds non-finite values outside the model's inputs: {', '.join(parts[:6])}"
            f"{' and more' if len(parts) > 6 else ''}. The model's forward pass was finite and the NaN/Inf was "
            "born in the loss code: if the loss reads this tensor (a NaN target, a per-sample weight), the "
            "data, not the model, is the cause; if it is masked out by design (NaN padding removed with "
            "torch.where), see the nan_origin finding of this step instead.\n"
            "Fix: find where the targets are built (missing values in the dataset, a label normalized by a "
            "zero std, a broken transform); filter or impute bad samples (e.g. mask = torch.isfinite(y); "
            "loss = loss_fn(out[mask], y[mask])), and assert torch.isfinite(y).all() in the data pipeline "
            "while debugging."
        ),
        data={
            "inputs": [{"input": n, "nan": a, "inf": b} for n, a, b in bad],
            "table": [{"input": n, "nan": a, "inf": b} for n, a, b in bad],
            "source": "loop",
        },
    )


def _poisoned_finding(
    step: int, names: list[str], policy: str, layers: list[dict[str, Any]], *, buffers: bool, every: int = 1,
    earlier: bool = True, rows: dict[str, tuple[list[int], int]] | None = None,
) -> Finding:
    if buffers:
        what = f"Buffers of the model hold NaN/Inf at step {step}: {names_text(names)}"
        why = (
            "A forward pass on non-finite activations wrote them (BatchNorm running statistics are updated "
            "even on a skipped step), and every forward that reads them (eval mode) is non-finite."
        )
        fix = (
            "Fix: find the first nan_origin or nonfinite_input finding of the run; reset the buffers "
            "(e.g. module.reset_running_stats()) or reload a checkpoint."
        )
    else:
        what = f"The weights themselves hold NaN/Inf at step {step}: {names_text(names)}"
        if policy == "warn":
            why = (
                "An earlier non-finite update was applied (on_nonfinite='warn'), so every later step is non-finite too."
            )
        elif every > 1:
            why = (
                f"gradwatch checks one step in {every} (every={every}), so a non-finite update on a step in "
                "between was applied unchecked (or they were loaded from a checkpoint or written outside the "
                "optimizer); every step is non-finite from then on."
            )
        elif rows and not earlier:
            tables = "; ".join(
                f"{n}: row{'s' if len(r) > 1 else ''} {', '.join(map(str, r[:8]))}{' and more' if len(r) > 8 else ''}"
                f" ({len(r)} of {total})"
                for n, (r, total) in rows.items()
            )
            why = (
                f"Only some rows of the embedding table hold them ({tables}): only batches that look up those "
                "ids are non-finite, this one among them. They were non-finite before this step (rows added "
                "to the vocabulary and left uninitialized, e.g. filled from torch.empty, a bad checkpoint "
                "merge, or a write outside the optimizer)."
            )
        else:
            why = (
                "They became non-finite before this step (loaded from a checkpoint, written outside the "
                "optimizer, or updated by an optimizer gradwatch does not watch), so every step that reads "
                "them is non-finite."
            )
        if earlier:
            fix = (
                "Fix: see the first nan_origin finding of the run for the op and module where it began; use "
                "on_nonfinite='skip' to keep the weights clean while you fix it, and reload a checkpoint."
            )
        elif rows:
            fix = (
                "Fix: re-initialize those rows (with torch.no_grad(): emb.weight[rows] = "
                "emb.weight[ok_rows].mean(0), or normal_ with the table's std), or reload a checkpoint; check "
                "what wrote them (resize_token_embeddings, a checkpoint merge)."
            )
        else:
            fix = (
                "Fix: reload a checkpoint from before it"
                + (", and watch every step (every=1) so the next non-finite update is skipped and localized "
                   "at the step it happens" if every > 1 else ", and check what wrote the weights")
                + "."
            )
    return Finding(
        kind="nan_origin",
        step=step,
        severity="error",
        message=f"{what}. {why}{'' if rows else ' The origin cannot be localized from this step.'}\n{fix}",
        params=tuple(names),
        data={"phase": "buffers" if buffers else "weights", "params": names, "table": layers},
    )


#: The two ways softmax / log_softmax go NaN on finite-or-infinite logits: which one a forward-phase origin
#: is, its inputs' range tells (see _softmax_inf_fix); without them (the loss code's backward) both are given.
_MASKED_ROW = (
    "a fully masked row (every logit -inf) makes softmax NaN: keep one position unmasked, or mask with "
    "torch.finfo(x.dtype).min instead of -inf."
)
_PLUS_INF_LOGIT = (
    "a logit of +inf makes softmax NaN too (inf - inf): logits divided by a temperature or scale of 0 "
    "(clamp it: tau.clamp_min(1e-2)), or a logit that overflowed (compute it in float32, lower the "
    "learning rate)."
)

_FIXES: list[tuple[tuple[str, ...], str]] = [
    (
        ("Log", "Log2", "Log10", "Log1p", "Xlogy", "Lgamma", "Digamma"),
        "log of 0 or of a negative number: clamp the input (torch.log(x.clamp_min(1e-8))), add an epsilon, or "
        "stay in log space (log_softmax, logsumexp, cross_entropy on logits).",
    ),
    (
        ("Sqrt",),
        "the derivative of sqrt is infinite at 0 (and sqrt of a negative number is NaN): use "
        "torch.sqrt(x + 1e-8) or x.clamp_min(1e-8).sqrt(); for a norm, torch.linalg.vector_norm has a "
        "defined gradient at 0.",
    ),
    (
        # rsqrt is Inf at 0 in the forward pass already (not only its derivative): a hand-written RMSNorm
        # with eps=0 on an all-zero vector (a padding or masked position) gives 0 * inf = NaN.
        ("Rsqrt",),
        "rsqrt(0) = 1/sqrt(0) is Inf (and rsqrt of a negative number is NaN): put an epsilon inside, "
        "torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) with eps > 0 (an RMSNorm with eps=0 divides by "
        "zero on an all-zero vector: a padding or masked position), or x.clamp_min(1e-8).rsqrt().",
    ),
    (
        ("Div", "Reciprocal", "Remainder", "Fmod"),
        "division by zero (a zero norm, count or std): divide by d.clamp_min(1e-8) or (d + 1e-8), or use "
        "F.normalize(x, eps=1e-8).",
    ),
    (
        ("Pow",),
        "pow of a negative base with a fractional exponent is NaN, and x ** p with p < 1 has an infinite "
        "derivative at 0: clamp the base (x.clamp_min(1e-8) ** p) or use torch.sign(x) * x.abs().clamp_min(1e-8) ** p.",
    ),
    (
        ("Exp", "Exp2", "Expm1", "Sinh", "Cosh"),
        "exp overflow (float32 overflows above exp(88), float16 above exp(11)): clamp the input "
        "(x.clamp(max=80)), subtract the maximum first (logsumexp, softmax), or lower the learning rate.",
    ),
    (
        ("Acos", "Asin", "Atanh", "Erfinv", "Acosh"),
        "the derivative is infinite at the edge of the domain: clamp the input, e.g. x.clamp(-1 + 1e-6, 1 - 1e-6).",
    ),
    (
        ("Softmax", "LogSoftmax"),
        _MASKED_ROW + " " + _PLUS_INF_LOGIT[:1].upper() + _PLUS_INF_LOGIT[1:],
    ),
    (
        ("Std", "Var", "StdMean", "VarMean"),
        "std/var of a single element (a batch of 1, a dimension of size 1) divides by n - 1 = 0, and a "
        "near-constant input makes the gradient of std (1/std) explode: use drop_last=True in the "
        "DataLoader or correction=0 (unbiased=False), and add an epsilon: (x.var(...) + 1e-5).sqrt().",
    ),
    (
        ("Logsumexp",),
        "logsumexp over a row where every value is -inf (a fully masked row) is -inf and its gradient NaN: "
        "keep one position unmasked, or mask with torch.finfo(x.dtype).min instead of -inf.",
    ),
    (
        ("NllLoss", "NllLoss2d", "nll_loss_forward", "nll_loss2d_forward", "CrossEntropyLoss"),
        "every target of this batch is ignore_index (or has weight 0), so the mean is 0/0: skip such "
        "batches, or use reduction='sum' and divide by the number of counted targets clamped to at least 1. "
        "If you pass class weights (weight=), check them for NaN/Inf: 1/count with a class absent from the "
        "counts is Inf (clamp the counts: 1 / counts.clamp_min(1)).",
    ),
    (
        ("CtcLoss", "ctc_loss", "CTCLoss"),
        "CTC loss is inf for a sample whose input is too short for its target: it needs at least as many "
        "frames as target labels, plus one between each pair of repeated labels. Check input_lengths against "
        "target_lengths (and the blank index), or use nn.CTCLoss(zero_infinity=True) to drop such samples' "
        "loss and gradient.",
    ),
    (
        ("LinalgEigh", "LinalgEig", "LinalgSvd", "Svd", "Symeig", "Eig", "LinalgEigvals", "LinalgLstsq"),
        "eigenvector and singular-vector gradients divide by the gaps between eigenvalues (lambda_i - lambda_j): "
        "repeated or near-equal eigenvalues (duplicate samples, a rank-deficient or symmetric input) make "
        "them Inf/NaN. Use torch.linalg.eigvalsh / svdvals when only the values are needed, add a small "
        "jitter to the diagonal (A + 1e-5 * torch.eye(n)), compute in float64, or avoid duplicate samples.",
    ),
    (
        ("LinalgCholesky", "Cholesky", "LinalgCholeskyEx", "CholeskySolve", "LinalgInv", "LinalgInvEx",
         "LinalgSolve", "LinalgDet", "Logdet", "LinalgSlogdet"),
        "the matrix is singular or nearly so (not positive definite for Cholesky): its inverse, and the "
        "gradient through it, blows up. Add a jitter to the diagonal (A + 1e-5 * torch.eye(n)), compute in "
        "float64, or check what makes it rank-deficient (duplicate samples, a batch smaller than the dimension).",
    ),
    (
        ("Cdist", "Pdist", "Dist"),
        "the gradient of a Euclidean distance or norm divides by its value: at zero distance (identical "
        "points, a zero vector) it is NaN. Add an epsilon inside the square root "
        "(((a - b) ** 2).sum(-1) + 1e-8).sqrt().",
    ),
    (
        ("BinaryCrossEntropy",),
        "binary_cross_entropy on probabilities of exactly 0 or 1 (a saturated sigmoid) takes log(0): use "
        "F.binary_cross_entropy_with_logits on the logits (or nn.BCEWithLogitsLoss), which stays finite.",
    ),
    (
        ("Softplus",),
        "softplus of a very large input overflows when its threshold is raised: keep the default threshold "
        "(20), or clamp the input.",
    ),
    (
        ("Tan", "Atan2"),
        "the op is singular here: keep its input away from the singular points (clamp, add an epsilon).",
    ),
    (
        ("NativeLayerNorm", "NativeGroupNorm", "NativeBatchNorm", "CudnnBatchNorm", "RmsNorm", "FusedRmsNorm",
         "layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm"),
        "normalizing a constant row or channel (zero variance) divides by sqrt(var + eps): with eps=0 that is "
        "0/0. Keep eps > 0 (nn.LayerNorm/nn.GroupNorm/nn.BatchNorm default to 1e-5), and check for constant "
        "inputs (an all-padding sample, a dead channel).",
    ),
]
_GENERIC_FIX = (
    "the values grew out of range: lower the learning rate, add normalization before this op, clip "
    "gradients, or compute this part in float32; if the op has a restricted domain, clamp its input."
)


def _op_base(name: str) -> str:
    """``"SubBackward0"`` -> ``"Sub"``, ``"torch.nn.functional.layer_norm"`` -> ``"Layer_norm"``."""
    base = re.sub(r"Backward\d*$", "", name.rsplit(".", 1)[-1]).lstrip("_")
    return re.sub(r"_$", "", base[:1].upper() + base[1:])


def custom_function(op: str | None) -> str | None:
    """The name of the custom autograd.Function whose backward node ``op`` is (``"CubeBackward"`` -> ``"Cube"``;
    torch's own nodes end in a digit), else None."""
    return op[: -len("Backward")] if op and re.fullmatch(r"[A-Za-z_]\w*Backward", op) else None


#: ``nan_origin`` data for a NaN born in a custom Function's backward: the tool that checks that backward.
_CHECK_CUSTOM_BACKWARD = "gradwatch.gradcheck"


def fix_for(op: str | None, forward_op: str | None = None) -> str:
    """What to change for a non-finite value born in ``op`` (e.g. ``"SqrtBackward0"``)."""
    name = custom_function(op)
    if name is not None:
        return (
            f"{op} is the backward of the custom autograd.Function {name}: its backward() returned NaN/Inf "
            f"from a finite incoming gradient. Check {name}.backward's formula (divisions by saved values, "
            "log or sqrt of them) for the inputs its forward accepts; gradwatch.gradcheck(model, batch) (or "
            "gw.gradcheck() after the step) compares every custom Function's backward with finite differences "
            "of its forward on the inputs it received."
        )
    for name in (op, forward_op):
        if not name:
            continue
        base = _op_base(name)
        for names, fix in _FIXES:
            if base in names or base.lower() in {n.lower() for n in names}:
                return fix
    return _GENERIC_FIX


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v not in (1.0, -1.0) and abs(abs(v) - 1.0) < 5e-3:
            return f"{v:.9g}"  # acos/asin at 1.0000001: "1" would hide that the input left the domain
        return f"{v:.3g}"
    return str(v)


def _range(m: dict[str, float]) -> str:
    text = f"|x| from {_fmt(m['min_abs'])} to {_fmt(m['max_abs'])}"
    if "min" in m and m["min"] < 0:
        text = f"values from {_fmt(m['min'])} to {_fmt(m['max'])}, " + text
    return text


def _backward_context(inc: dict[str, Any]) -> tuple[str, str]:
    """For a backward/loss-phase origin: the gradient it received, and its forward inputs' range."""
    received = f"a finite gradient (|g| up to {_fmt(inc['max_abs'])})" if "max_abs" in inc else "a finite gradient"
    fwd = ""
    if "forward_min_abs" in inc:
        fwd = (
            " Its forward inputs: "
            + _range({k[len("forward_") :]: v for k, v in inc.items() if k.startswith("forward_")})
            + "."
        )
    return received, fwd


def _no_forward_finding(step: int, model: nn.Module | None) -> Finding:
    name = type(model).__name__ if model is not None else "model"
    if callable(getattr(model, "training_step", None)):
        # A LightningModule run by a loop of one's own (Lightning Fabric: `fabric_model.training_step(batch,
        # i)`): the loop is right, training_step goes around the model's forward.
        how = (
            "Its training_step calls the submodules directly (`self.net(x)`), around the model's own forward.\n"
            "Fix: in training_step call the model itself, `self(x)`, with the composition in its forward"
        )
    else:
        how = (
            "The training loop calls its submodules directly (`model.head(model.encoder(x))`), or another "
            "module than the watched one.\n"
            "Fix: call the watched model itself (put the composition in its forward: `model(x)`), or watch the "
            "module the loop calls"
        )
    return Finding(
        kind="nan_origin",
        step=step,
        severity="warning",
        message=(
            f"gradwatch could not look for where the NaN/Inf of step {step} was born: the watched model's own "
            f"forward ({name}.__call__) did not run this step, so neither its inputs nor its outputs were "
            f"seen. {how}; then a NaN batch is named as bad input and a NaN born in an op is named with its line."
        ),
        data={"phase": None, "no_forward": True},
    )


@dataclasses.dataclass(frozen=True)
class OriginFacts:
    """What the words of a ``nan_origin`` finding need about the op where a NaN/Inf was born.

    Attributes:
        step: The step the finding concerns.
        phase: ``"forward"``, ``"backward"`` or ``"loss"`` (see ``Origin.phase``).
        op: The autograd node (or forward function) that produced it, e.g. ``"SqrtBackward0"``.
        forward_op: The torch function that ran in the forward pass, if known.
        module: The innermost module that ran it (None outside any module).
        lightning: Found by the Lightning callback (code outside any module is ``training_step``).
        source: ``"file:line in function"`` of the user's code that called it; code: that line.
        incoming: The range of what went in (see ``Origin.incoming``); outgoing: ``nan``/``inf`` of what came out.
        forward_birth: A loss-code op's forward result was already non-finite.
        explicit_operand: The op was given an explicit non-finite Python number.
        masked: A forward NaN the rest of the forward masked out (the where-NaN trap).
        loss_before_model: The loss was non-finite in the forward pass while the model's forward was finite.
        surrogate: Replayed with a gradient of ones at the model output.
        half: Ran under autocast in float16; half_weights: the model's weights are float16.
        first_module: The first module whose output was non-finite, and the range of its inputs.
    """

    step: int
    phase: str
    op: str | None
    forward_op: str | None
    module: str | None
    lightning: bool
    source: str | None
    code: str | None
    incoming: dict[str, Any]
    outgoing: dict[str, Any]
    forward_birth: bool
    explicit_operand: bool
    masked: bool
    loss_before_model: bool
    surrogate: bool
    half: bool
    half_weights: bool
    first_module: str | None
    first_module_inputs: dict[str, Any]

    @property
    def op_base(self) -> str:
        return _op_base(self.op or "")


def _origin_facts(step: int, result: _Result) -> OriginFacts:
    """The facts of ``result``'s origin (it has one)."""
    loc = result.loc
    origin = loc.origin
    assert origin is not None
    return OriginFacts(
        step=step,
        phase=origin.phase,
        op=origin.op,
        forward_op=origin.forward_op,
        module=origin.module,
        lightning=result.lightning,
        source=origin.source,
        code=origin.code,
        incoming=origin.incoming,
        outgoing=origin.outgoing,
        forward_birth=origin.forward_birth,
        explicit_operand=origin.explicit_operand,
        masked=origin.masked,
        loss_before_model=bool(result.loss_nonfinite and loc.forward_finite),
        surrogate=result.surrogate,
        half=result.half,
        half_weights=result.half_weights,
        first_module=loc.first_module,
        first_module_inputs=loc.first_module_inputs,
    )


def _inf_only(values: dict[str, Any]) -> bool:
    return bool(values.get("inf")) and not values.get("nan")


_LOSS_BEFORE_MODEL_FIX = (
    "the model's output (and so its inputs or weights) reached values the loss cannot hold: check this "
    "batch for unscaled features (normalize the inputs and targets), lower the learning rate if the "
    "weights grew, clip gradients, and compute the loss in float32."
)
_INF_MINUS_INF_FIX = (
    "Inf - Inf is NaN: a row where every value is -inf (a fully masked row of a hand-written masked "
    "softmax, `scores - scores.max(-1, keepdim=True).values`): mask with torch.finfo(x.dtype).min "
    "instead of -inf, keep one position unmasked, or use torch.softmax / "
    "F.scaled_dot_product_attention, which handle the max themselves."
)
_WHERE_NAN_FIX = (
    " Here its NaN never reached the model's output (masked out, e.g. torch.where(mask, x.sqrt(), 0)), "
    "but the gradient of the masked positions is 0 times the op's NaN/infinite derivative: NaN. Apply "
    "the op to a safe input instead: x_safe = torch.where(mask, x, 1.0), then "
    "torch.where(mask, x_safe.sqrt(), 0)."
)
_AUTOCAST_HALF_FIX = (
    "this op ran under autocast in float16, whose largest finite value is 65504: the Inf is an "
    "overflow of half precision, not of the values themselves (clipping gradients cannot help). Keep "
    "this op in float32 (wrap it in torch.autocast(device_type, enabled=False) and call .float() on "
    "its inputs), scale its input down (normalize the batch), or use bfloat16 (float32's range). "
    "Otherwise: "
)
_HALF_WEIGHTS_FIX = (
    "the model's weights are float16 (model.half()), so this op most likely ran in float16, whose "
    "largest finite value is 65504: the Inf is an overflow of half precision (an attention score q.k "
    "or an activation above 65504), not of float32 values. Train with float32 weights under "
    "torch.autocast (bfloat16, or float16 with a GradScaler), compute this op in float32 (.float() on "
    "its inputs), or scale its input down (normalize the batch). Otherwise: "
)
_EXPLICIT_OPERAND_FIX = (
    "the float('inf')/float('nan') written in this line reaches the loss: if it is a mask or "
    "sentinel, mask it out before the loss (torch.where, or masked_fill with a finite value such as "
    "torch.finfo(x.dtype).min); otherwise replace it by a finite number."
)


def _loss_before_model_fix(facts: OriginFacts, fix: str) -> str:
    return _LOSS_BEFORE_MODEL_FIX + ("" if fix is _GENERIC_FIX else " " + fix[:1].upper() + fix[1:])


def _softmax_inf_fix(facts: OriginFacts, fix: str) -> str:
    # Its inputs' range tells a +inf logit (a temperature of 0) from a fully masked row (-inf only).
    return _PLUS_INF_LOGIT if facts.incoming.get("max") == math.inf else _MASKED_ROW


def _half_weights_overflow(facts: OriginFacts) -> bool:
    return (
        facts.half_weights
        and facts.phase == "forward"
        and _inf_only(facts.outgoing)
        and not facts.incoming.get("inf")
        and facts.incoming.get("max_abs", math.inf) <= 65504.0
    )


#: How the op's own fix (``fix_for``) becomes the fix of one origin: every row whose predicate holds for the
#: facts rewrites the fix so far, in this order (so the last matching replacement wins).
_FIX_RULES: tuple[tuple[Callable[[OriginFacts], bool], Callable[[OriginFacts, str], str]], ...] = (
    (lambda f: f.phase == "backward" and f.loss_before_model, _loss_before_model_fix),
    (
        lambda f: f.phase == "forward" and f.op_base in ("Softmax", "LogSoftmax") and bool(f.incoming.get("inf")),
        _softmax_inf_fix,
    ),
    (
        lambda f: f.phase == "forward" and f.op_base in ("Sub", "Rsub", "Add") and _inf_only(f.incoming),
        lambda f, fix: _INF_MINUS_INF_FIX,
    ),
    (lambda f: f.phase == "forward" and f.masked, lambda f, fix: fix + _WHERE_NAN_FIX),
    (lambda f: f.half and _inf_only(f.outgoing), lambda f, fix: _AUTOCAST_HALF_FIX + fix),
    (_half_weights_overflow, lambda f, fix: _HALF_WEIGHTS_FIX + fix),
    (lambda f: f.explicit_operand, lambda f, fix: _EXPLICIT_OPERAND_FIX),
)


def origin_fix(facts: OriginFacts) -> str:
    """What to change for the origin ``facts`` describe: the op's own fix, rewritten by ``_FIX_RULES``."""
    fix = fix_for(facts.op, facts.forward_op)
    for applies, rewrite in _FIX_RULES:
        if applies(facts):
            fix = rewrite(facts, fix)
    return fix


def _produced(facts: OriginFacts) -> str:
    produced = " and ".join(label for key, label in (("nan", "NaN"), ("inf", "Inf")) if facts.outgoing.get(key))
    return produced or "non-finite values"


def _source_lines(facts: OriginFacts) -> str:
    if not facts.source:
        return ""
    return f"\n    {facts.source}" + (f"\n      {facts.code}" if facts.code else "")


def _op_label(facts: OriginFacts) -> str:
    """``"SubBackward0 (torch.sub)"``: the node, and the forward function when it has another name."""
    differs = facts.forward_op and facts.forward_op != facts.op
    return f"{facts.op}" + (f" ({facts.forward_op})" if differs else "")


def _where_in(facts: OriginFacts) -> str:
    # "in module training_step" would name a function as a module.
    if facts.module is not None:
        return f"in module {facts.module}"
    return "in training_step" if facts.lightning else "outside any module"


def _loss_phase_what(facts: OriginFacts) -> str:
    received, fwd = _backward_context(facts.incoming)
    produced = _produced(facts)
    how_born = (
        f"Its forward result holds {produced} although its inputs were finite."
        if facts.forward_birth  # read from what its backward node saved
        else f"It received {received} and produced {produced}."
    )
    where = facts.module if facts.module is not None else "the loss code"
    return (
        f"Born in the loss computation of step {facts.step}, outside the model (its forward pass was finite): "
        f"op {_op_label(facts)} in {where}{_source_lines(facts)}\n{how_born}{fwd}"
    )


def _forward_inputs(facts: OriginFacts) -> str:
    inc = facts.incoming
    inputs = "It had no tensor inputs"
    if inc.get("inf"):
        inputs = f"Its inputs held Inf but no NaN ({_range(inc)})"
    elif "min_abs" in inc:
        inputs = f"Its inputs were finite ({_range(inc)})"
    if facts.explicit_operand:
        inputs += "; it was given an explicit non-finite Python number (float('inf') or float('nan'))"
    return inputs


def _first_module_note(facts: OriginFacts) -> str:
    if facts.first_module is None:
        return ""
    ranged = f" (inputs {_range(facts.first_module_inputs)})" if facts.first_module_inputs else ""
    return f" First module with a non-finite output: {facts.first_module}{ranged}."


def _forward_what(facts: OriginFacts) -> str:
    return (
        f"Born in the forward pass of step {facts.step}: op {_op_label(facts)} {_where_in(facts)}"
        f"{_source_lines(facts)}\n{_forward_inputs(facts)}; its output holds {_produced(facts)}."
        + _first_module_note(facts)
    )


def _backward_what(facts: OriginFacts) -> str:
    received, fwd = _backward_context(facts.incoming)
    site = f"{_op_label(facts)} {_where_in(facts)}{_source_lines(facts)}\n"
    if facts.loss_before_model:
        what = (
            f"The loss of step {facts.step} was already non-finite in the forward pass, although the model's "
            "output was finite: the loss computation made it first (squaring or exponentiating a finite but "
            "huge output overflows: float32 ends at 3.4e38, so x ** 2 at |x| > 1.8e19). In the backward pass "
            f"the first op to go non-finite was {site}"
        )
    else:
        what = f"Born in the backward pass of step {facts.step} (the forward pass was finite): op {site}"
    what += f"It received {received} and produced {_produced(facts)}.{fwd}"
    if facts.surrogate and facts.phase == "backward":
        what += " (Replayed with a gradient of ones at the model output; the real one was not available.)"
    return what


#: What happened, by the phase the NaN/Inf was born in (any other phase reads as the backward pass).
_WHAT_BY_PHASE: dict[str, Callable[[OriginFacts], str]] = {"loss": _loss_phase_what, "forward": _forward_what}


def origin_message(facts: OriginFacts) -> str:
    """The message of a ``nan_origin`` finding with a located op: what happened, then the fix."""
    what = _WHAT_BY_PHASE.get(facts.phase, _backward_what)(facts)
    return f"{what}\nFix: {origin_fix(facts)}"


def _located_data(facts: OriginFacts, result: _Result) -> dict[str, Any]:
    """The ``nan_origin`` data of a located op."""
    origin = result.loc.origin
    assert origin is not None
    function = custom_function(facts.op)
    return {
        "phase": facts.phase,
        "op": facts.op,
        "forward_op": facts.forward_op,
        "module": facts.module,
        "source": facts.source,
        "code": facts.code,
        "incoming": dict(facts.incoming),
        "outgoing": dict(facts.outgoing),
        "forward_traceback": origin.traceback or result.anomaly_traceback,
        "explicit_operand": facts.explicit_operand,
        "loss_nonfinite_first": bool(facts.phase == "backward" and facts.loss_before_model),
        "custom_function": function,
        "check_with": _CHECK_CUSTOM_BACKWARD if function else None,
    }


def _loss_suspects(loss_ops: list[str]) -> str:
    """The loss code's ops that can turn finite values into NaN/Inf, as a sentence ("" for none)."""
    if not loss_ops:
        return ""
    counts = {name: loss_ops.count(name) for name in dict.fromkeys(loss_ops)}
    listed = ", ".join(f"{n} ({c} calls)" if c > 1 else n for n, c in counts.items())
    return (
        f" The loss code between the model's output and the loss runs {listed}: ops that turn finite "
        "values into NaN/Inf at the edge of their domain. Which of them did cannot be told after the "
        "backward (it frees the values they saw); if it recurs in the next (escalated) steps, the op "
        "is named with its line."
    )


_LOSS_CODE_FIX = (
    "look at the loss function: log of a 0 probability (use log_softmax / cross_entropy on logits, "
    "or clamp the probability), division by a zero count or norm, sqrt at 0, or a NaN/Inf target."
)
#: An nll_loss is listed among the loss code's suspects only when it has class weights (see ``_loss_ops``).
_CLASS_WEIGHT_FIX = (
    "a NaN/Inf class weight (weight=) makes the gradient non-finite: 1/count with a class absent "
    "from the counts is Inf (clamp the counts: 1 / counts.clamp_min(1))."
)


def _suspect_fix(name: str) -> str:
    return _CLASS_WEIGHT_FIX if _op_base(name) in ("NllLoss", "NllLoss2d") else fix_for(name)


def _loss_code_fix(loss_ops: list[str]) -> str:
    """One kind of suspect: its own fix; several: each one's; none known: the loss function's usual faults."""
    fixes = {name: _suspect_fix(name) for name in dict.fromkeys(loss_ops)}
    known = {name: f for name, f in fixes.items() if f is not _GENERIC_FIX}
    if len(set(known.values())) == 1:
        return next(iter(known.values()))
    if known:
        return "for each suspect: " + " ".join(f"{_op_base(n)}: {f}" for n, f in known.items())
    return _LOSS_CODE_FIX


def _loss_code_finding(step: int, result: _Result, how: str, data: dict[str, Any]) -> Finding:
    """The model's forward was finite but the gradient from the loss was not, and no loss op was located."""
    data.update(phase="loss", op=None, module=None, loss_ops=list(result.loss_ops))
    message = (
        f"The model's forward pass was finite at step {step}, but the gradient arriving at its output "
        "from the loss was already non-finite: the NaN/Inf was born in the loss computation, outside "
        "the model (seen in " + how + ")." + _loss_suspects(result.loss_ops)
        + "\nFix: " + _loss_code_fix(result.loss_ops)
    )
    return Finding(kind="nan_origin", step=step, severity="error", message=message, data=data)


def _first_seen_finding(step: int, result: _Result, how: str, data: dict[str, Any]) -> Finding:
    """No op made the NaN/Inf, but a traced op's input already held it."""
    seen = result.loc.first_seen
    assert seen is not None
    where = seen.module if seen.module is not None else ("training_step" if result.lightning else "the loss code")
    line = f"\n    {seen.source}" + (f"\n      {seen.code}" if seen.code else "") if seen.source else ""
    data.update(phase="forward", op=None, module=seen.module, first_seen=seen.func, source=seen.source,
                code=seen.code)
    message = (
        f"At step {step} ({how}) the forward pass already held NaN/Inf that no traced op produced: it was "
        f"first seen as an input of {seen.func} in {where}{line}\n"
        "It was written in place (x[i] = float('nan'), masked_fill_ with NaN), read from a buffer or a "
        "tensor the model keeps, or made by code gradwatch does not trace.\n"
        "Fix: look at what that line's inputs hold and where they were last written; guard the write "
        "(torch.nan_to_num, a finite fill value such as torch.finfo(x.dtype).min)."
    )
    return Finding(kind="nan_origin", step=step, severity="error", message=message, module=seen.module, data=data)


def _unreproduced_finding(step: int, result: _Result, how: str, data: dict[str, Any]) -> Finding:
    """Every recorded op and node was finite."""
    loc = result.loc
    data.update(phase=None, op=None, module=loc.first_module)
    message = (
        f"gradwatch could not reproduce where the non-finite value of step {step} was born ({how}: "
        f"{loc.ops_recorded} forward ops and {loc.nodes_recorded} backward nodes were all finite"
        + (
            ", replayed with a gradient of ones because the real upstream gradient was not available"
            if result.surrogate
            else ""
        )
        + "). It may come from outside the watched model, from randomness in the step (dropout), or "
        "from a custom autograd Function.\nFix: see the per-layer table; the next "
        "steps run with anomaly mode on."
    )
    return Finding(
        kind="nan_origin", step=step, severity="warning", message=message, module=loc.first_module, data=data
    )


def _origin_finding(step: int, result: _Result, layers: list[dict[str, Any]]) -> Finding:
    """The ``nan_origin`` finding of one localized step: the op where the NaN/Inf was born, or why none was."""
    loc = result.loc
    data: dict[str, Any] = {
        "replayed": result.replayed,
        "surrogate_grad": result.surrogate,
        "first_nonfinite_module": loc.first_module,
        "first_nonfinite_module_inputs": dict(loc.first_module_inputs),
        "anomaly_error": result.anomaly_error,
        "table": layers,
    }
    if loc.origin is not None:
        facts = _origin_facts(step, result)
        data.update(_located_data(facts, result))
        message = origin_message(facts)
        return Finding(
            kind="nan_origin", step=step, severity="error", message=message, module=facts.module, op=facts.op,
            data=data,
        )
    how = "a replay of the step" if result.replayed else "the escalated step itself"
    if result.upstream_bad and loc.forward_finite:
        return _loss_code_finding(step, result, how, data)
    if loc.first_seen is not None:
        return _first_seen_finding(step, result, how, data)
    return _unreproduced_finding(step, result, how, data)


__all__ = ["MAX_CALLS", "MAX_REPORTS", "Escalation", "fix_for", "layer_table"]
