"""The shared engine: observe -> check -> act -> report, once per optimizer step.

Both ways in (``gradwatch.watch`` for plain loops, ``GradWatchCallback`` for Lightning) are thin shells
that call :meth:`Engine.check_step` right before an optimizer update and :meth:`Engine.step_done` after it.

Extensions (zero-grad tracking, escalation, AMP, distributed agreement) plug into the engine through a
small protocol of optional methods, see :class:`Extension`.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, TypeVar

import torch
from torch import nn

from gradwatch import checks as _checks
from gradwatch.checks.exploding import APPLIED, after_explosion
from gradwatch.core.config import Config
from gradwatch.core.findings import Finding, GradWatchError
from gradwatch.core.history import History
from gradwatch.core.params import ParamIndex
from gradwatch.core.stats import (
    StepStats,
    SyncBatch,
    count_nonfinite,
    layer_norms,
    queue_grad_norms,
    read_grad_norms,
    total_norm,
)
from gradwatch.core.stats import (
    queue_all_norms as _queue_all_norms,
)
from gradwatch.diagnose.escalation import Escalation
from gradwatch.observe.amp import AmpMonitor
from gradwatch.observe.preclip import BackwardNorms
from gradwatch.report import Reporters, internal_warning, safe_warn
from gradwatch.report.console import ConsoleReporter
from gradwatch.report.jsonl import JsonlReporter, new_run_id
from gradwatch.report.summary import RunSummary
from gradwatch.report.tensorboard import TensorBoardReporter

_E = TypeVar("_E")

Decision = Literal["ok", "skip"]

_GRAD = operator.attrgetter("grad")

#: Kinds that the ``on_nonfinite`` policy acts on.
NONFINITE_KINDS = ("nonfinite_grad", "nonfinite_loss")


@dataclass
class StepContext:
    """What extensions see of a step while it is being checked."""

    stats: StepStats
    batch: SyncBatch
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    engine: Engine
    slots: dict[str, int] = field(default_factory=dict)
    #: ``(batch slot, gradient indices)`` of the queued per-gradient norms (see ``queue_grad_norms``).
    norm_slots: list[tuple[int, list[int]]] = field(default_factory=list)


class Extension(Protocol):
    """Optional methods an extension may define; the engine calls those that exist.

    - ``attach(engine)``: once, when added.
    - ``before_sync(ctx)``: queue device values into ``ctx.batch`` (no sync allowed).
    - ``after_sync(ctx)``: read them back (``ctx.batch.resolve()``) and fill ``ctx.stats.extra``.
    - ``on_incident(stats, findings) -> list[Finding]``: the step is non-finite; localize it before the
      update (may replay the step) and return extra findings. A returned finding with ``data["restates"]``
      (a kind) takes the place of the step's finding of that kind: its cause restated in the light of the
      origin found (``nonfinite_loss`` deferring to ``nan_origin``).
    - ``after_step(stats, decision)``: the decision is taken.
    - ``close()``: detach everything.
    """


class Engine:
    """One run's gradwatch state: parameter index, history, findings, counters, reporters.

    Args:
        model: The model whose parameters are watched (may be None for optimizer-only use).
        optimizers: The watched optimizers.
        config: Validated configuration.
        tb_writer: An existing SummaryWriter to write into (Lightning's logger); else ``config.log_dir``.
        records_dir: Where ``gradwatch.jsonl`` and incident reports go when there is neither ``tb_writer`` nor
            ``config.log_dir`` (the directory of a Lightning run's other logger).
        rank_zero: Whether this process reports (console/TensorBoard/JSON lines).
    """

    def __init__(
        self,
        model: nn.Module | None,
        optimizers: list[torch.optim.Optimizer],
        config: Config,
        *,
        tb_writer: Any = None,
        rank_zero: bool = True,
        tb_log_dir: str | None = None,
        run_id: str | None = None,
        records_dir: str | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.optimizers = list(optimizers)
        #: The "run" of gradwatch.jsonl records (a Lightning callback's across the fits of one Trainer); kept
        #: in checkpoints, so a resumed run continues its own records.
        self.run_id = run_id or new_run_id()
        self.rank_zero = rank_zero
        self.index = ParamIndex(model, self.optimizers)
        self.history = History(window=config.window)
        self.findings: list[Finding] = []
        self._explained: tuple[tuple[int, str], Finding | None] | None = None  # the last explained exception
        # The optimizer steps taken when the latest checked step was found non-finite: an exception on those
        # same gradients before the update (a clipping hook that raises after the check) is reported already.
        self._blocked_at = -1
        self.kind_counts: Counter[str] = Counter()
        self.steps_checked = 0
        self.steps_skipped = 0
        self.consecutive_skips = 0
        self.step_counts = [0] * max(1, len(self.optimizers))
        self.extensions: list[Any] = []
        #: Added to every finding's ``data`` (e.g. ``{"rank": 1}`` in a distributed run).
        self.finding_tags: dict[str, Any] = {}
        #: Called with every loss tensor given to :meth:`observe_loss`, before it is detached (O(1) each).
        self.loss_observers: list[Any] = []
        self._losses: list[torch.Tensor] = []
        # Aligned with ``_losses``: for a loss with a graph, a one-element list that a hook on its grad_fn sets
        # once a backward pass runs through it; None when gradwatch cannot tell (no graph).
        self._loss_reached: list[list[bool] | None] = []
        # Losses of earlier backward passes whose gradients were cleared without an optimizer step (a
        # skipped batch), or of batches never backpropagated: read with the next step, never held against
        # its update. ``_stale_unused`` counts those of the second kind (they come last).
        self._stale_losses: list[torch.Tensor] = []
        self._stale_unused = 0
        self._loss_mark = 0  # len(self._losses) when the latest backward pass reached the gradients
        #: Gradients were cleared between two backward passes since the previous check (single optimizer).
        self.cleared_between_backwards = False
        self._backwards_since_check = 0
        self._cleared_backwards = 0  # backward passes since then that found the gradients cleared
        # Unregistered trainable tensors found at a check: (name, tensor, how, its grad, grad version).
        self._unregistered_seen: list[tuple[str, torch.Tensor, str, torch.Tensor, int]] = []
        self._forward_scans = 0  # the first two checked steps look for layers built inside forward()
        self._reached: dict[int, bool] = {}  # id(param) -> the graph of the step it lacked a gradient reached it
        self._forward_params: list[tuple[weakref.ref[torch.Tensor], tuple[int, ...]]] = []
        self._first_check = [True] * max(1, len(self.optimizers))
        self._group_signature = [self._signature(o) for o in self.optimizers]
        self._params_dirty = False
        self._suppressed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._suppressed_state: list[tuple[torch.optim.Optimizer, dict[Any, Any]]] = []
        self._pending: tuple[StepStats, SyncBatch, Any] | None = None
        self._reevaluation_reported: set[int] = set()  # optimizers whose non-finite re-evaluation was reported
        self._norm_samples: list[float] = []
        self._layer_tags: dict[str, str] = {}
        self._last_counters: dict[str, float] = {}
        self._scalar_steps: dict[int, int] = {}
        self._norm_stride = 1
        self._norm_seen = 0
        self._check_modules = _checks.discover()
        self._closed = False
        self.started = time.time()
        self.log_dir: str | None = None
        self.reporters = Reporters([])
        self._unwritable: set[str] = set()
        self._build_reporters(tb_writer, tb_log_dir, records_dir)
        self._hooks: list[Any] = []
        if model is not None:
            # Process-wide hooks hold the engine weakly and go with it: an engine never closed must not keep
            # its model alive, nor slow down every later module registration.
            reg = torch.nn.modules.module
            for register, method in (
                (reg.register_module_parameter_registration_hook, "_on_param_registered"),
                (reg.register_module_module_registration_hook, "_on_module_registered"),
            ):
                handle = register(_weak_method(self, method))
                self._hooks.append(handle)
                weakref.finalize(self, handle.remove)

    # -- set-up ------------------------------------------------------------------------------------
    def _build_reporters(self, tb_writer: Any, tb_log_dir: str | None, records_dir: str | None = None) -> None:
        c = self.config
        if c.console is not False:
            console = None if c.console is True else c.console
            self.reporters.add(ConsoleReporter(console, rate_limit=c.rate_limit, rank_zero=self.rank_zero))
        if not self.rank_zero:
            return
        if tb_writer is not None:
            try:
                self.reporters.add(TensorBoardReporter(writer=tb_writer, flush_every=c.tb_flush_every))
                self.log_dir = tb_log_dir or self.reporters.items[-1].log_dir
            except Exception as exc:  # noqa: BLE001
                self._warn_unwritable(str(tb_writer), exc)
        elif c.log_dir is not None:
            try:
                self.reporters.add(TensorBoardReporter(log_dir=c.log_dir, flush_every=c.tb_flush_every))
                self.log_dir = c.log_dir
            except Exception as exc:  # noqa: BLE001
                self._warn_unwritable(c.log_dir, exc)
        jsonl_dir = self.log_dir if tb_writer is not None else c.log_dir or records_dir
        if jsonl_dir is not None:
            try:
                tb = self.reporters.of_type(TensorBoardReporter)
                files = tb.event_files() if tb is not None else []
                self.reporters.add(JsonlReporter(jsonl_dir, run=self.run_id, event_files=files))
                self.log_dir = jsonl_dir
            except Exception as exc:  # noqa: BLE001
                self._warn_unwritable(jsonl_dir, exc)
        self.reporters.call("start")  # run_start in gradwatch.jsonl: where this run's records begin

    def _warn_unwritable(self, where: str, exc: BaseException) -> None:
        from gradwatch.report import GradWatchInternalWarning

        if where in self._unwritable:
            return  # TensorBoard and gradwatch.jsonl share the directory: one warning is enough
        self._unwritable.add(where)
        safe_warn(
            f"gradwatch: cannot write logs to {where!r} ({type(exc).__name__}: {exc}); training continues "
            "with console reporting only. Pass a writable log_dir to get TensorBoard and gradwatch.jsonl.",
            GradWatchInternalWarning,
            stacklevel=5,
        )

    def add_extension(self, ext: Any) -> Any:
        self.extensions.append(ext)
        attach = getattr(ext, "attach", None)
        if attach is not None:
            try:
                attach(self)
            except GradWatchError:
                raise
            except Exception as exc:  # noqa: BLE001 - an extension that cannot attach is left out
                self.extensions.remove(ext)
                internal_warning(f"{type(ext).__name__}.attach", exc, owner=self, key=type(ext).__name__)
                close = getattr(ext, "close", None)
                if close is not None:
                    try:
                        close()  # remove whatever it attached before failing
                    except Exception:  # noqa: BLE001
                        pass
        return ext

    def extension(self, cls: type[_E]) -> _E | None:
        """The attached extension of type ``cls`` (or a subclass), or None: extensions find each other here."""
        return next((e for e in self.extensions if isinstance(e, cls)), None)

    # -- parameter-set changes ---------------------------------------------------------------------
    def _on_param_registered(self, module: nn.Module, name: str, param: Any) -> None:
        if id(module) in self.index.module_name:
            self._params_dirty = True

    def _on_module_registered(self, module: nn.Module, name: str, submodule: Any) -> None:
        if id(module) in self.index.module_name:
            self._params_dirty = True

    @staticmethod
    def _signature(opt: torch.optim.Optimizer) -> tuple[int, ...]:
        return tuple(len(g["params"]) for g in opt.param_groups)

    def _unregistered(self, scan: bool) -> list[tuple[str, str]]:
        """Trainable tensors the model uses but never registered (see ``ParamIndex.unregistered``) whose
        gradient moved since the previous check: the scan's candidates are confirmed one check later."""
        try:
            confirmed = [
                (n, how)
                for n, t, how, g, version in self._unregistered_seen
                if t.grad is not None and (t.grad is not g or t.grad._version != version)
            ]
            self._unregistered_seen = []
            if scan:
                self._unregistered_seen = [
                    (n, t, how, t.grad, t.grad._version) for n, t, how in self.index.unregistered()
                ]
            return confirmed + self._built_in_forward()
        except Exception as exc:  # noqa: BLE001 - a model with odd attributes must not stop the check
            internal_warning("unregistered-parameter scan", exc, owner=self)
            self._unregistered_seen = []
            return []

    def _built_in_forward(self) -> list[tuple[str, str]]:
        """Parameters a layer built inside forward() trains through: on each of the first two checked steps,
        the ``nn.Parameter`` leaves of the outputs' graph the model does not own; reported when the second
        step's are new tensors of the shapes the first step's had (created anew at every forward)."""
        if self._forward_scans >= 2:
            return []
        self._forward_scans += 1
        esc = self.extension(Escalation)
        if esc is None:
            return []
        known = {id(p) for _, p in self.index.model_params} | self.index._held
        found = esc.unowned_params(known)
        before, self._forward_params = self._forward_params, [(weakref.ref(p), tuple(p.shape)) for p in found]
        if self._forward_scans < 2 or not before:
            return []
        shapes = {shape for _ref, shape in before}
        fresh = [p for p in found if tuple(p.shape) in shapes and all(ref() is not p for ref, _s in before)]
        return [(f"<parameter {tuple(p.shape)} created in forward>", "forward") for p in fresh]

    def _grads_dropped(self, op: Any, none: list[str]) -> frozenset[str]:
        """Of ``none`` (trainable, no gradient at the step), those the step's graph reached: backward gave them
        a gradient that the training code then set to None on purpose (DINO's cancel_gradients_last_layer
        in its first epoch). A walk of the step's graph for parameters not asked about before; cached."""
        known = self._reached
        by_name = dict(zip(op.names, op.params))
        ask = [by_name[n] for n in none if n in by_name and id(by_name[n]) not in known]
        if ask:
            esc = self.extension(Escalation)
            leaves = esc.graph_leaves(reached=True) if esc is not None else None
            if leaves is None:
                return frozenset(n for n in none if n in by_name and known.get(id(by_name[n])))
            reached = {id(v) for v in leaves}
            for p in ask:
                known[id(p)] = id(p) in reached
        return frozenset(n for n in none if n in by_name and known.get(id(by_name[n])))

    def _refresh_index(self) -> bool:
        changed = self._params_dirty or self.index.unheld_trainable_changed()
        for i, o in enumerate(self.optimizers):
            sig = self._signature(o)
            if sig != self._group_signature[i]:
                self._group_signature[i] = sig
                changed = True
        if changed:
            self._params_dirty = False
            self.index.rebuild()
        return changed

    def _unheld_with_grads(self) -> tuple[str, ...]:
        """Trainable model parameters no watched optimizer holds that the backward reached. Those it did not
        reach are no forgotten layer: an EMA/mean teacher left requires_grad=True, run under no_grad and
        updated by hand (had it been trained, they would have gradients now)."""
        names = self.index.not_in_optimizer
        if not names:
            return ()
        wanted = set(names)
        return tuple(n for n, p in self.index.model_params if n in wanted and p.grad is not None)

    # -- the step ----------------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor) -> None:
        """Remember a loss of the current step (no sync: read with the step's statistics)."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() == 0 or loss.is_meta:
                return  # no value to read: an empty batch, or a model on the meta device
            self._losses.append(loss.detach())
            self._loss_reached.append(_reach_flag(loss))
            for observe in self.loss_observers:
                observe(loss)
        elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):
            self._losses.append(torch.tensor(float(loss)))
            self._loss_reached.append(None)
        else:
            raise TypeError(
                f"observe_loss() takes the loss as a tensor or a number, got {type(loss).__name__}: {loss!r:.80}"
            )

    def backward_reached(self) -> None:
        """A backward pass reached the gradients: the losses observed so far are its (or earlier) ones."""
        self._loss_mark = len(self._losses)
        self._backwards_since_check += 1

    def gradients_cleared(self) -> None:
        """The gradients were cleared (``zero_grad``) since the latest backward pass and no optimizer step
        took them: the losses observed up to that backward went with gradients nobody used."""
        if self._backwards_since_check:
            self.cleared_between_backwards = True  # not the usual zero_grad() before a step's first backward
            self._cleared_backwards += 1
        mark, self._loss_mark = self._loss_mark, 0
        if mark:
            self._stale_losses = (self._stale_losses + self._losses[:mark])[-64:]
            del self._losses[:mark]
            del self._loss_reached[:mark]

    def step_dropped(self) -> None:
        """A GradScaler dropped a step since the latest backward pass (no optimizer step ran): the passes
        counted so far were that step's, and a zero_grad() after it is the usual one before a step."""
        self._backwards_since_check = 0
        self._cleared_backwards = 0
        self.cleared_between_backwards = False

    def drop_losses(self) -> None:
        """Forget the observed losses (a step not checked, or one whose check failed)."""
        self._losses.clear()
        self._loss_reached.clear()
        self._stale_losses = []
        self._stale_unused = 0
        self._loss_mark = 0

    def _set_aside_unused_losses(self) -> None:
        """The losses of this step that no backward pass ran through, while others were: batches the
        training code left out (``if torch.isnan(loss): continue`` before ``backward()``). Their NaN/Inf is
        no reason to skip the update made of the other batches. When no observed loss was reached (observed
        after its backward, or under a closure) nothing is moved: gradwatch cannot tell."""
        reached = self._loss_reached
        if len(reached) != len(self._losses) or not any(r is not None and r[0] for r in reached):
            return
        unused = [l for l, r in zip(self._losses, reached) if r is not None and not r[0]]
        if unused:
            self._losses = [l for l, r in zip(self._losses, reached) if r is None or r[0]]
            self._stale_losses = (self._stale_losses + unused)[-64:]
            self._stale_unused = min(len(unused), len(self._stale_losses))

    def should_check(self, opt_index: int, step: int | None = None) -> bool:
        s = self.step_counts[opt_index] if step is None else step
        return not self._closed and s % self.config.every == 0

    def check_step(self, opt_index: int = 0, step: int | None = None, *, due: bool | None = None) -> Decision:
        """Run the pipeline for optimizer ``opt_index`` before its update.

        ``step`` labels the findings (default: this optimizer's step count); ``due`` says whether the
        ``every`` cadence selects this step (default: ``step % every == 0``). Integrations whose step
        label counts several optimizers' steps (Lightning's ``global_step``) pass
        ``due=engine.should_check(opt_index)`` so each optimizer keeps its own cadence.

        Returns ``"skip"`` when the update must not be applied (the caller suppresses it, e.g. with
        :meth:`suppress_update`). Raises :class:`GradWatchError` under ``on_nonfinite="raise"`` or after
        ``max_skips`` consecutive skips. Any other failure inside gradwatch is reported once and the step
        proceeds as if gradwatch were not there.
        """
        if self._closed:
            return "ok"
        s = self.step_counts[opt_index] if step is None else step
        if not (s % self.config.every == 0 if due is None else due):
            self.drop_losses()
            return "ok"
        try:
            stats, findings = self._observe_and_check(opt_index, s)
        except GradWatchError:
            raise
        except Exception as exc:  # noqa: BLE001 - never make training worse
            internal_warning("check_step", exc, owner=self)
            self.drop_losses()
            return "ok"
        if stats is None:
            return "ok"
        return self._act(stats, findings)

    def _observe_and_check(self, opt_index: int, step: int) -> tuple[StepStats | None, list[Finding]]:
        changed = self._refresh_index()
        op = self.index.per_optimizer[opt_index]
        grads: list[torch.Tensor] = []
        gparams: list[torch.Tensor] = []
        gnames: list[str] = []
        gmods: list[str | None] = []
        none: list[str] = []
        every_grad = list(map(_GRAD, op.params))
        # Not ``None in`` (that calls Tensor.__eq__) nor a generator (a Python frame per parameter): a C loop.
        full = all(map(operator.is_not, every_grad, itertools.repeat(None)))
        if full:  # the usual step: no per-parameter branching (the index's lists are never mutated)
            grads, gparams, gnames, gmods = every_grad, op.params, op.names, op.modules
        else:
            for p, n, m, g in zip(op.params, op.names, op.modules, every_grad):
                if g is None:
                    if p.requires_grad and p.numel():  # an empty local shard (FSDP1) has nothing to get
                        none.append(n)
                else:
                    grads.append(g)
                    gparams.append(p)
                    gnames.append(n)
                    gmods.append(m)
        stats = StepStats(
            step=step,
            optimizer_index=opt_index,
            names=gnames,
            modules=gmods,
            none_grad=tuple(none),
            not_in_optimizer=self._unheld_with_grads() if self._first_check[opt_index] or changed else (),
            params_changed=changed,
            foreign=tuple(op.foreign) if self.index.model_trainable else (),
            first_check=self._first_check[opt_index],
        )
        self._first_check[opt_index] = False
        if stats.first_check or changed or self._unregistered_seen:
            stats.extra["unregistered"] = self._unregistered(stats.first_check or changed)
        elif self._forward_scans < 2:
            stats.extra["unregistered"] = self._built_in_forward()
        stats.extra["params"] = gparams  # aligned with names; checks that need a parameter's flags read it
        stats.extra["lookup_layers"] = self.index.lookup_layers
        stats.extra["optimizer"] = op.optimizer
        if none:
            stats.extra["member_of"] = self.index.member_of  # none_grad: experts, LayerDrop layers, task heads
            dropped = self._grads_dropped(op, none)
            if dropped:
                stats.extra["grad_dropped"] = dropped
        if len(self.optimizers) > 1:
            stats.extra["several_optimizers"] = True
        if self.cleared_between_backwards:
            stats.extra["cleared_between_backwards"] = True
        # (backward passes of this step, how many of them found the gradients cleared by an earlier one's
        # zero_grad): every pass but the first cleared is zero_grad() inside an accumulation loop.
        stats.extra["backward_passes"] = (self._backwards_since_check, self._cleared_backwards)
        self.cleared_between_backwards = False
        self._backwards_since_check = 0
        self._cleared_backwards = 0
        batch = SyncBatch()
        source = self.extension(BackwardNorms)
        # Plain loops: the norms backward produced, before the loop clipped them (see gradwatch.observe.preclip).
        norm_slots = source.backward_norms(opt_index, batch, grads, full) if source is not None else None
        if norm_slots is None and full:
            norm_slots = _queue_all_norms(batch, op, grads)
        if norm_slots is None:
            norm_slots = queue_grad_norms(batch, grads)
        loss_slot = -1
        self._set_aside_unused_losses()
        self._loss_reached = []
        if self._losses:
            losses = self._losses
            first = losses[0]
            if len(losses) == 1 and first.dtype is torch.float32 and first.dim() == 0:
                loss_slot = batch.add(first.reshape(1))  # the usual step: one scalar loss
            else:
                device = grads[0].device if grads else first.device
                losses = [l.float().mean() for l in losses]
                losses = [l if l.device == device else l.to(device, non_blocking=True) for l in losses]
                loss_slot = batch.add(torch.stack(losses))
            self._losses = []
        self._loss_mark = 0
        stale_slot = -1
        if self._stale_losses:
            device = grads[0].device if grads else self._stale_losses[0].device
            stale = [l.float().mean().reshape(1).to(device, non_blocking=True) for l in self._stale_losses]
            stale_slot = batch.add(torch.cat(stale))
            if self._stale_unused:
                stats.extra["stale_unused"] = self._stale_unused  # the last ones never reached a backward
            self._stale_losses = []
            self._stale_unused = 0
        ctx = StepContext(stats=stats, batch=batch, grads=grads, params=gparams, engine=self, norm_slots=norm_slots)
        ctx.slots["loss"] = loss_slot
        ctx.slots["stale_loss"] = stale_slot
        self._call("before_sync", ctx)
        if self.config.deferred:
            previous = self._pending
            batch.start_read()
            ctx.grads = []  # read one step late: hold no gradient past the user's zero_grad
            self._pending = (stats, batch, (norm_slots, loss_slot, ctx))
            if previous is None:
                return None, []
            stats, batch, (norm_slots, loss_slot, ctx) = previous
            grads = []  # the previous step's gradients are gone; no element-wise counts
        self._fill(stats, batch, norm_slots, loss_slot, grads)
        if ctx.slots.get("stale_loss", -1) >= 0:
            stats.extra["stale_losses"] = batch.resolve()[ctx.slots["stale_loss"]]  # already read: no sync
        self._call("after_sync", ctx)
        findings = self._run_checks(stats)
        if stats.is_nonfinite or stats.extra.get("any_rank_nonfinite"):
            findings.extend(self._incident(stats, findings))
        return stats, findings

    def _fill(
        self,
        stats: StepStats,
        batch: SyncBatch,
        norm_slots: list[tuple[int, list[int]]],
        loss_slot: int,
        grads: list[torch.Tensor],
    ) -> None:
        values = batch.resolve()  # the step's one device-to-host sync
        norms = read_grad_norms(values, norm_slots, len(stats.names))
        stats.norms = norms
        total = stats.total_norm = total_norm(norms)
        if self.config.per_layer:
            stats.layer_norms = layer_norms(stats.modules, norms)
        # The total is finite exactly when every norm is (float64 sums of float32 norms cannot overflow).
        suspects = [] if math.isfinite(total) else [i for i, v in enumerate(norms) if not math.isfinite(v)]
        if suspects:
            if grads:
                nan, inf = count_nonfinite(stats.names, grads, suspects)
                stats.nan_counts, stats.inf_counts = nan, inf
                bad = set(nan) | set(inf)
                stats.nonfinite = tuple(stats.names[i] for i in suspects if stats.names[i] in bad)
                stats.overflow_norm = tuple(stats.names[i] for i in suspects if stats.names[i] not in bad)
            else:
                stats.nonfinite = tuple(stats.names[i] for i in suspects)
        if loss_slot >= 0:
            lv = values[loss_slot]
            finite = [v for v in lv if math.isfinite(v)]
            stats.loss_nonfinite = len(finite) != len(lv)
            stats.loss = (sum(lv) / len(lv)) if lv else None

    def _run_checks(self, stats: StepStats) -> list[Finding]:
        findings: list[Finding] = []
        history, config = self.history, self.config
        for name, fn, _remember in self._check_modules:
            try:
                findings.extend(fn(stats, history, config))
            except Exception as exc:  # noqa: BLE001
                internal_warning(f"check {name}", exc, owner=self)
        for name, _fn, remember in self._check_modules:
            if remember is not None:
                try:
                    remember(stats, history)
                except Exception as exc:  # noqa: BLE001
                    internal_warning(f"check {name}.remember", exc, owner=self, key=f"check {name}")
        return findings

    def _incident(self, stats: StepStats, findings: list[Finding]) -> list[Finding]:
        extra: list[Finding] = []
        for ext in self.extensions:
            fn = getattr(ext, "on_incident", None)
            if fn is None:
                continue
            try:
                extra.extend(fn(stats, findings + extra) or [])
            except GradWatchError:
                raise
            except Exception as exc:  # noqa: BLE001
                internal_warning(f"{type(ext).__name__}.on_incident", exc, owner=self, key=type(ext).__name__)
        for new in [f for f in extra if "restates" in f.data]:
            extra.remove(new)
            kind = new.data.pop("restates")
            at = next((i for i, f in enumerate(findings) if f.kind == kind and f.step == new.step), None)
            if at is not None:
                findings[at] = new
        return extra

    def _act(self, stats: StepStats, findings: list[Finding]) -> Decision:
        c = self.config
        # A gradient whose norm overflows float32 (an element above ~1.8e19) is blocked like a non-finite one:
        # the update it makes turns the next forward pass non-finite.
        blocked = (
            stats.is_nonfinite
            or bool(stats.overflow_norm)
            or bool(stats.extra.get("any_rank_nonfinite"))
            or bool(stats.extra.get("update_nonfinite"))
        )
        decision: Decision = "ok"
        error: GradWatchError | None = None
        if blocked and c.on_nonfinite == "raise":
            error = GradWatchError(_error_text(stats, findings, "on_nonfinite='raise'"), findings)
        elif blocked and c.on_nonfinite == "skip":
            self.consecutive_skips += 1
            if c.max_skips is not None and self.consecutive_skips > c.max_skips:
                f = Finding(
                    kind="too_many_skips",
                    step=stats.step,
                    severity="error",
                    message=(
                        f"{self.consecutive_skips} optimizer steps in a row were non-finite "
                        f"(max_skips={c.max_skips}); skipping further would only stall the run.\n"
                        + _after_explosion(stats, self.history)
                        + (
                            "Fix: the cause is persistent: the gradients are finite but their norm overflows "
                            "float32, so the weights or the loss have blown up (see the first exploding_grad "
                            "and loss_diverging findings of this run): lower the learning rate (10x at a time), "
                            "check weight_decay, add a warm-up, and clip gradients. "
                            if stats.overflow_norm and not stats.nonfinite
                            else "Fix: the cause is persistent, not a rare bad batch: see the first nonfinite "
                            "finding of this run for the op and module, lower the learning rate, or check the "
                            "data. "
                        )
                        + "Raise max_skips (or set it to None) to keep skipping."
                    ),
                    data={"consecutive_skips": self.consecutive_skips,
                          "after_exploding": (self.history.memory.get(APPLIED) or {}).get("step")},
                )
                findings.append(f)
                error = GradWatchError(_error_text(stats, findings, f"max_skips={c.max_skips}"), findings)
            else:
                decision = "skip"
                self.steps_skipped += 1
        else:
            self.consecutive_skips = 0
        self.steps_checked += 1
        if blocked:
            self._blocked_at = sum(self.step_counts)
        self._record(stats, findings, skipped=decision == "skip")
        self._call("after_step", stats, decision)
        if error is not None:
            raise error
        return decision

    def _record(self, stats: StepStats, findings: list[Finding], *, skipped: bool) -> None:
        try:
            self.history.record(stats, skipped=skipped)
            if stats.names and math.isfinite(stats.total_norm) and not skipped:
                self._sample_norm(stats.total_norm)
            for f in findings:
                self._keep(f)
            if findings:
                self.reporters.findings(findings)
            self.reporters.call("scalars", stats.step, self._scalars(stats, every_value=bool(findings)))
        except Exception as exc:  # noqa: BLE001
            internal_warning("report", exc, owner=self)

    def add_finding(self, f: Finding) -> None:
        """Record and report a finding (also used by extensions and the integrations)."""
        self._keep(f)
        self.reporters.call("finding", f)

    def _keep(self, f: Finding) -> None:
        if self.finding_tags:
            f.data.update({k: v for k, v in self.finding_tags.items() if k not in f.data})
        self.findings.append(f)
        self.kind_counts[f.kind] += 1

    def _scalars(self, stats: StepStats, *, every_value: bool = False) -> dict[str, float]:
        """This step's TensorBoard scalars. Per-layer norms every ``layer_every`` checked steps (and with
        ``every_value``: a step with findings), counters when they change: fewer events, same charts."""
        multi = len(self.optimizers) > 1
        suffix = f"_opt{stats.optimizer_index}" if multi else ""
        out: dict[str, float] = {}
        if stats.names:
            out[f"gradwatch/grad_norm/total{suffix}"] = stats.total_norm
        seen = self._scalar_steps[stats.optimizer_index] = self._scalar_steps.get(stats.optimizer_index, 0) + 1
        full = every_value or (seen - 1) % self.config.layer_every == 0  # each optimizer its own cadence
        if full:
            tags = self._layer_tags
            for layer, v in stats.layer_norms.items():
                tag = tags.get(layer)
                if tag is None:
                    tag = tags[layer] = f"gradwatch/grad_norm/{layer}"
                out[tag] = v
        if stats.loss is not None:
            out[f"gradwatch/loss{suffix}"] = stats.loss  # a GAN's two losses: two series
        counters = {"gradwatch/skipped_steps": float(self.steps_skipped),
                    "gradwatch/nonfinite_grads": float(len(stats.nonfinite))}
        for kind, n in self.kind_counts.items():
            counters["gradwatch/findings/" + kind] = float(n)
        last = self._last_counters
        for tag, v in counters.items():
            if full or last.get(tag) != v:
                out[tag] = last[tag] = v
        more = stats.extra.get("scalars")
        if isinstance(more, dict):
            out.update(more)
        return out

    def _sample_norm(self, v: float) -> None:
        # Bounded sample for the summary's median: keep every k-th value, doubling k when full.
        self._norm_seen += 1
        if (self._norm_seen - 1) % self._norm_stride == 0:
            self._norm_samples.append(v)
            if len(self._norm_samples) >= 4096:
                self._norm_samples = self._norm_samples[::2]
                self._norm_stride *= 2

    def step_done(self, opt_index: int = 0) -> None:
        """Count one optimizer step (applied, skipped, or skipped by an AMP scaler)."""
        self.step_counts[opt_index] += 1
        self._backwards_since_check = 0  # the next zero_grad() is the usual one before a step
        self._cleared_backwards = 0
        self.cleared_between_backwards = False

    # -- skipping an update ------------------------------------------------------------------------
    def suppress_update(self, opt_index: int, state_snapshot: dict[Any, Any] | None = None) -> None:
        """Make the next ``optimizer.step()`` a no-op: every parameter's ``.grad`` is set to None.

        ``grad.zero_()`` would not do: momentum and weight decay still move the weights. Optimizer state
        entries are snapshotted (shallow) so closure optimizers such as LBFGS leave no trace either.
        :meth:`restore_grads` puts the gradients back after the step.
        """
        op = self.index.per_optimizer[opt_index]
        for p in op.params:
            self._suppressed.append((p, p.grad))
            p.grad = None
        opt = op.optimizer
        if opt is None:
            return
        snap = state_snapshot if state_snapshot is not None else self.snapshot_state(opt_index)
        self._suppressed_state.append((opt, {"known": snap, "params": list(op.params)}))

    def guard_reevaluation(self, opt_index: int, loss: Any, evaluation: int, step: int | None = None,
                           *, large_loss: bool = False) -> bool:
        """A closure optimizer (LBFGS) evaluated the closure again within a checked step: are this
        evaluation's loss and gradients finite? Returns True when they are (or when gradwatch cannot tell).

        When they are not: a finding at this step (the first time in the run), and under
        ``on_nonfinite="skip"`` every gradient of the optimizer is set to None (LBFGS reads that as a zero
        gradient and ends its iterations, or its line search backs off when ``large_loss``, the caller's
        promise to hand back a large finite loss); ``"raise"`` raises :class:`GradWatchError`. One read per
        evaluation, next to the optimizer's own ``float(loss)`` of it.
        """
        if self._closed or self.config.deferred:
            return True
        if evaluation == 2:
            try:
                self._closure_kept_gradients(opt_index, step)
            except Exception as exc:  # noqa: BLE001 - never make training worse
                internal_warning("closure zero_grad", exc, owner=self)
        try:
            finding = self._reevaluation_finding(opt_index, loss, evaluation, step, large_loss)
        except Exception as exc:  # noqa: BLE001 - never make training worse
            internal_warning("guard_reevaluation", exc, owner=self)
            return True
        if finding is None:
            return True
        policy = self.config.on_nonfinite
        if policy != "warn":
            for p in self.index.per_optimizer[opt_index].params:
                p.grad = None
        if opt_index not in self._reevaluation_reported:  # once per run: a line search may meet it every step
            self._reevaluation_reported.add(opt_index)
            self.add_finding(finding)
        if policy == "raise":
            raise GradWatchError(_error_text(None, [finding], "on_nonfinite='raise'"), [finding])
        return False

    def _nonfinite_now(
        self, opt_indices: list[int], losses: list[torch.Tensor]
    ) -> tuple[float | None, list[str], tuple[dict[str, int], dict[str, int]], int]:
        """Off the hot path (a guarded re-evaluation, an exception): the first non-finite loss value among
        ``losses``, the names of the gradients of ``opt_indices`` that hold NaN/Inf with their counts, and
        how many gradients there are. One read, plus one for the counts when some are non-finite."""
        names: list[str] = []
        grads: list[torch.Tensor] = []
        for i in opt_indices:
            op = self.index.per_optimizer[i]
            for p, n in zip(op.params, op.names):
                if p.grad is not None:
                    names.append(n)
                    grads.append(p.grad)
        batch = SyncBatch()
        slots = queue_grad_norms(batch, grads)
        live = [l for l in losses if isinstance(l, torch.Tensor) and l.numel() > 0 and not l.is_meta]
        loss_slot = batch.add(torch.stack([l.detach().float().mean() for l in live])) if live else -1
        values = batch.resolve() if slots or live else []
        norms = read_grad_norms(values, slots, len(grads)) if slots else []
        suspects = [i for i, v in enumerate(norms) if not math.isfinite(v)]
        counts = count_nonfinite(names, grads, suspects)
        bad = [names[i] for i in suspects if names[i] in counts[0] or names[i] in counts[1]]
        bad_loss = next((v for v in values[loss_slot] if not math.isfinite(v)), None) if live else None
        return bad_loss, bad, counts, len(names)

    def _closure_kept_gradients(self, opt_index: int, step: int | None) -> None:
        """The closure's second evaluation added its gradient onto the first one's: the closure does not
        clear them. Reported at this step, once (the next step's check would see the same)."""
        from gradwatch.observe.zero_grad import ZeroGradTracker

        tracker, key = self.extension(ZeroGradTracker), f"zero_grad_missing/{opt_index}"
        if tracker is None or self.history.reported.get(key):
            return
        finding = tracker.closure_finding(opt_index, self.step_counts[opt_index] if step is None else step)
        if finding is not None:
            self.history.reported[key] = True
            self.add_finding(finding)

    def _reevaluation_finding(self, opt_index: int, loss: Any, evaluation: int, step: int | None,
                              large_loss: bool) -> Finding | None:
        from gradwatch.checks import nonfinite

        bad_loss, bad, counts, total = self._nonfinite_now([opt_index], [loss] if loss is not None else [])
        if not bad and bad_loss is None:
            return None
        opt = self.index.per_optimizer[opt_index].optimizer
        return nonfinite.reevaluation(
            step=self.step_counts[opt_index] if step is None else step,
            optimizer_index=opt_index,
            optimizer_name=type(opt).__name__ if opt is not None else "the optimizer",
            evaluation=evaluation,
            loss=bad_loss,
            bad_params=bad,
            counts=counts,
            total_params=total,
            policy=self.config.on_nonfinite,
            returned_large_loss=large_loss and self.config.on_nonfinite == "skip",
        )

    def snapshot_state(self, opt_index: int) -> dict[Any, Any]:
        """Shallow copy of the optimizer state entries of ``opt_index`` (for an exact skip)."""
        op = self.index.per_optimizer[opt_index]
        if op.optimizer is None:
            return {}
        state = op.optimizer.state
        return {p: dict(state[p]) for p in op.params if p in state}

    def restore_grads(self) -> None:
        """Undo :meth:`suppress_update` after the (no-op) step."""
        for p, g in self._suppressed:
            p.grad = g
        self._suppressed = []
        for opt, snap in self._suppressed_state:
            known = snap["known"]
            for p in snap["params"]:
                if p in known:
                    opt.state[p] = known[p]
                elif p in opt.state:
                    del opt.state[p]
        self._suppressed_state = []

    # -- exceptions --------------------------------------------------------------------------------
    def explain_exception(self, exc: BaseException, step: int | None = None) -> Finding | None:
        """Diagnose an exception raised by the training code (autograd errors); never raises."""
        if isinstance(exc, GradWatchError):
            return None
        key = (id(exc), str(exc))
        if self._explained is not None and self._explained[0] == key:
            return self._explained[1]  # explained already (gw.explain(e), then re-raised out of the with block)
        try:
            from gradwatch.diagnose import autograd_errors

            s = self.step_counts[0] if step is None and self.step_counts else (step or 0)
            finding = autograd_errors.explain(exc, engine=self, step=s)
            esc = self.extension(Escalation)
            if finding is not None and finding.kind == "no_grad_graph" and esc is not None:
                finding = esc.explain_no_graph(finding)  # a reentrant checkpoint cut the graph, not frozen layers
            if finding is not None and finding.data.get("loss_nonfinite"):
                found = self._forward_born(exc, s, finding)
            else:
                found = [finding] if finding is not None else self._unchecked_nonfinite(exc, s)
            esc = self.extension(Escalation)
            if not found and esc is not None:
                # Raised before any backward (a loss that refuses a NaN input): NaN/Inf data named anyway.
                found = [f for f in [esc.forward_error(exc, s)] if f is not None]
        except Exception as e:  # noqa: BLE001
            internal_warning("explain_exception", e, owner=self)
            return None
        for f in found:
            self.add_finding(f)
        finding = found[0] if found else None
        self._explained = (key, finding)
        return finding

    def _unchecked_nonfinite(self, exc: BaseException, step: int) -> list[Finding]:
        """The training code raised before gradwatch checked the step (``clip_grad_norm_`` with
        ``error_if_nonfinite=True``, a user's own NaN assert): a NaN/Inf it met is still named, then localized
        like a checked step's (the error path: a few syncs, a replay)."""
        from gradwatch.checks import nonfinite

        if self._blocked_at == sum(self.step_counts):
            return []  # this step's check found them (and said so); no update ran since
        bad_loss, bad, counts, total = self._nonfinite_now(list(range(len(self.index.per_optimizer))), self._losses)
        if bad_loss is None and not bad:
            return []
        observed = bool(self._losses)
        self.drop_losses()
        amp = self.extension(AmpMonitor)
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
        found += self._incident(stats, found)  # may restate ``finding`` in place
        return found

    def _forward_born(self, exc: BaseException, step: int, anomaly: Finding) -> list[Finding]:
        """Anomaly mode stopped backward on a loss that was NaN/Inf already: the NaN was born in the forward
        pass, and the backward op anomaly mode names only carries it. Localized like a checked step's
        incident (the batch named as nonfinite_input, or the forward op as nan_origin, by a replay); the
        anomaly finding stays when that names nothing."""
        loss = anomaly.data.get("loss")
        stats = StepStats(step=step, loss=loss if isinstance(loss, float) else math.nan, loss_nonfinite=True)
        stats.extra["raised"] = type(exc).__name__
        stats.extra["anomaly_nan"] = True  # a numerical error, raised with the Trainer intact: replayable
        self.drop_losses()
        found = [f for f in self._incident(stats, [anomaly]) if f.kind in ("nan_origin", "nonfinite_input")]
        if not any(f.kind == "nonfinite_input" or f.data.get("op") or f.data.get("source") for f in found):
            return [anomaly, *found]
        note = (
            f"Anomaly mode stopped backward at {anomaly.op}, the first backward op that returned NaN: it only "
            "carried the NaN of the loss (anomaly mode checks backward outputs only). Training stopped with "
            "PyTorch's error."
        )
        out = []
        for f in found:
            f.data.update(raised=True, anomaly_error=str(exc), anomaly_op=anomaly.op)
            head, sep, fix = f.message.partition("\nFix:")
            out.append(replace(f, message=f"{head}\n{note}{sep}{fix}") if sep and f.kind == "nan_origin" else f)
        return out

    # -- end ---------------------------------------------------------------------------------------
    def summary(self) -> RunSummary:
        samples = sorted(self._norm_samples)
        return RunSummary(
            steps=sum(self.step_counts),
            steps_checked=self.steps_checked,
            steps_skipped=self.steps_skipped,
            kind_counts=dict(self.kind_counts),
            first_step={k: min(f.step for f in self.findings if f.kind == k) for k in self.kind_counts},
            norm_min=samples[0] if samples else None,
            norm_median=samples[len(samples) // 2] if samples else None,
            norm_max=samples[-1] if samples else None,
            log_dir=self.log_dir,
        )

    def close(self) -> None:
        """Flush pending statistics, remove hooks, print the summary, close writers. Idempotent."""
        if self._closed:
            return
        if self._pending is not None:
            try:
                stats, batch, (norm_slots, loss_slot, ctx) = self._pending
                self._pending = None
                self._fill(stats, batch, norm_slots, loss_slot, [])
                self._call("after_sync", ctx)
                self._record(stats, self._run_checks(stats), skipped=False)
            except Exception as exc:  # noqa: BLE001
                internal_warning("close (deferred step)", exc, owner=self)
        self._closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._call("close")
        summary = None
        try:
            summary = self.summary()
        except Exception as exc:  # noqa: BLE001
            internal_warning("summary", exc, owner=self)
        self.reporters.call("close", summary)

    @property
    def closed(self) -> bool:
        return self._closed

    def _call(self, method: str, *args: Any) -> None:
        for ext in self.extensions:
            fn = getattr(ext, method, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except GradWatchError:
                raise
            except Exception as exc:  # noqa: BLE001
                internal_warning(f"{type(ext).__name__}.{method}", exc, owner=self, key=type(ext).__name__)

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps_checked": self.steps_checked,
            "steps_skipped": self.steps_skipped,
            "consecutive_skips": self.consecutive_skips,
            "step_counts": list(self.step_counts),
            "kind_counts": dict(self.kind_counts),
            "findings": [f.to_dict() for f in self.findings[-1000:]],
            "history": self.history.state_dict(),
            "run": self.run_id,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_checked = int(state.get("steps_checked", 0))
        self.steps_skipped = int(state.get("steps_skipped", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        counts = list(state.get("step_counts", []))
        for i in range(min(len(counts), len(self.step_counts))):
            self.step_counts[i] = int(counts[i])
        self.kind_counts = Counter({str(k): int(v) for k, v in state.get("kind_counts", {}).items()})
        self.findings = [Finding.from_dict(d) for d in state.get("findings", [])]
        self.history.load_state_dict(state.get("history", {}))
        run = state.get("run")
        if isinstance(run, str) and run != self.run_id:
            self._continue_run(run)

    def _continue_run(self, run: str) -> None:
        """A run resumed from its checkpoint: gradwatch.jsonl records go on under the checkpoint's run id."""
        self.run_id = run
        jsonl = self.reporters.of_type(JsonlReporter)
        if jsonl is None:
            return
        try:
            jsonl.continue_run(run, at_step=min(self.step_counts))
        except Exception as exc:  # noqa: BLE001 - a record that cannot be written must not stop the resume
            internal_warning("JsonlReporter.continue_run", exc, owner=jsonl, key="JsonlReporter")


def _reach_flag(loss: torch.Tensor) -> list[bool] | None:
    """A flag a hook on ``loss.grad_fn`` sets when a backward pass runs through it (O(1): one hook on the
    loss's own node, none on the model). None for a loss with no graph, or when the hook cannot be placed."""
    node = loss.grad_fn
    if node is None:
        return None
    flag = [False]

    def reached(grad_outputs: Any) -> None:
        flag[0] = True

    try:
        node.register_prehook(reached)
    except Exception:  # noqa: BLE001 - a node that takes no hook: the loss counts as this step's
        return None
    return flag


def _weak_method(obj: Any, name: str) -> Any:
    """A function calling ``obj.<name>(...)`` while ``obj`` lives, and doing nothing after."""
    ref = weakref.ref(obj)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        return getattr(target, name)(*args, **kwargs) if target is not None else None

    return call


def failed_trial_loss(loss: Any) -> Any:
    """What a guarded closure hands back for a non-finite re-evaluation (see
    :meth:`Engine.guard_reevaluation`): a finite loss far above any real one, shaped like ``loss``, which
    a line search reads as a failed trial and backs off from; float32 so it cannot overflow."""
    if isinstance(loss, torch.Tensor):
        return torch.full(loss.shape, 1e30, dtype=torch.float32, device=loss.device)
    return 1e30


def _after_explosion(stats: StepStats, history: History) -> str:
    """too_many_skips: the exploding update that threw the weights out of range before the skips, if any."""
    text = after_explosion(stats, history)
    return text + "\n" if text else ""


def _error_text(stats: StepStats | None, findings: list[Finding], why: str) -> str:
    step = stats.step if stats is not None else findings[0].step
    lines = [f"gradwatch stopped training at step {step} ({why}):"]
    for f in findings:
        if f.severity == "error":
            lines.append(f"  {f.title}")
            lines.extend("    " + line for line in f.message.splitlines())
    return "\n".join(lines)
