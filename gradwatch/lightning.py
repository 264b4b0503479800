"""The Lightning way in: ``GradWatchCallback``, a thin shell over the shared :class:`~gradwatch.core.engine.Engine`.

Works in ``lightning.pytorch.Trainer`` and in ``pytorch_lightning.Trainer``: a callback is a ``Callback`` of
every Lightning namespace the program has imported by the time the callback is built (the two are distinct
classes; the class itself subclasses those imported before this module).
gradwatch imports no namespace the program has not imported: importing ``pytorch_lightning`` re-points
Lightning's rank-zero logger away from ``lightning.pytorch``'s. A callback built before any Lightning import
is a ``lightning.pytorch`` callback (or a ``pytorch_lightning`` one when only that is installed).

Where it hooks in:

- ``on_fit_start``: the engine is built from ``trainer.optimizers`` (the real torch optimizers) and the
  LightningModule, writing into the Trainer's ``TensorBoardLogger`` when there is one.
- ``on_train_batch_start``: extensions that define ``lightning_batch_start(trainer, pl_module, batch,
  batch_idx)`` get the batch (for replaying an incident) and may switch anomaly mode on here, the only
  place where the Trainer does not override it.
- ``on_before_backward``: the training loss is observed (no sync; read with the step's statistics).
- ``on_before_optimizer_step``: the checks run here, after the closure and AMP unscaling and before
  Lightning's gradient clipping, once per accumulation cycle, in automatic and manual optimization.
  A step to skip gets every ``.grad`` set to None, so the optimizer leaves parameters and state alone;
  a step post-hook on the real optimizer puts the gradients back.
- ``on_exception`` / ``teardown``: autograd errors are explained, hooks removed, reports closed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
import pickle
import sys
import types
import weakref
from typing import Any

import torch

from gradwatch.core.closure_guard import failed_trial_loss
from gradwatch.core.config import Config, OnNonfinite, make_config
from gradwatch.core.engine import Engine
from gradwatch.core.extensions import default_extensions
from gradwatch.core.failures import internal_warning, safe_warn
from gradwatch.core.findings import Explanation, Finding
from gradwatch.report.jsonl import new_run_id
from gradwatch.watch import applying_optimizer

# gradwatch is installed when this hint shows; Lightning is what is missing. ("gradwatch[lightning]" alone would
# look for gradwatch on a package index, which does not hold it.)
INSTALL_HINT = 'pip install lightning (or, in a gradwatch checkout, pip install ".[lightning]")'


#: The Lightning namespaces (each has its own ``Callback`` class).
_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
_LOGGER_MODULES = ("lightning.pytorch.loggers", "pytorch_lightning.loggers")
_LIGHTNING_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_fabric.")
_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _namespaces_in_use() -> tuple[str, ...]:
    """The Lightning namespaces the program has imported; when it has imported none yet (a callback built
    before ``import lightning.pytorch``), the one Lightning documents, ``lightning.pytorch``, else
    ``pytorch_lightning``. No other namespace is imported: importing one changes Lightning's logging (each
    namespace points ``lightning_utilities``' rank-zero logger at its own).
    """
    imported = tuple(ns for ns in _NAMESPACES if getattr(sys.modules.get(ns), "Callback", None) is not None)
    if imported:
        return imported
    for ns in _NAMESPACES:
        try:
            importlib.import_module(ns)
        except ImportError:
            continue
        return (ns,)
    raise _not_installed()


def _not_installed() -> ImportError:
    return ImportError(
        "gradwatch.lightning needs PyTorch Lightning (lightning or pytorch-lightning), which is not "
        f"installed. Install it with: {INSTALL_HINT}"
    )


def _installed(namespace: str) -> bool:
    """Whether the namespace's package is installed, without importing it."""
    top = namespace.split(".")[0]
    if top in sys.modules:
        return sys.modules[top] is not None
    return importlib.util.find_spec(top) is not None


if not any(_installed(ns) for ns in _NAMESPACES):
    raise _not_installed()


def _callback_class(cls: Any, namespaces: tuple[str, ...]) -> Any:
    """``cls``, made a ``Callback`` of each namespace it is not one of yet (the two ``Callback`` classes are
    distinct: a callback subclassing both works in either Trainer)."""
    missing = tuple(ns for ns in namespaces if ns not in cls._namespaces)
    if not missing:
        return cls
    key = (cls, missing)
    made = _CLASSES.get(key)
    if made is None:
        bases = tuple(importlib.import_module(ns).Callback for ns in missing)
        attrs = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        attrs.update(_namespaces=cls._namespaces + missing, _plain=cls._plain or cls)
        made = _CLASSES[key] = type(cls.__name__, (cls, *bases), attrs)
    return made


def _rebuild(cls: type, namespaces: tuple[str, ...]) -> Any:
    """Unpickling (``strategy="ddp_spawn"``): the same callback class in the new process."""
    return object.__new__(_callback_class(cls, namespaces))


#: The namespaces imported before this module: the class itself subclasses their ``Callback`` (so that
#: ``issubclass(GradWatchCallback, Callback)`` holds where it is asked, e.g. by ``LightningCLI``'s arguments).
_IMPORTED = tuple(ns for ns in _NAMESPACES if getattr(sys.modules.get(ns), "Callback", None) is not None)


class GradWatchCallback(*(sys.modules[ns].Callback for ns in _IMPORTED)):  # type: ignore[misc]
    """Watch a Lightning run with gradwatch: the same checks, findings and settings as ``gradwatch.watch``.

    Args:
        on_nonfinite: ``"skip"`` (default) leaves parameters and optimizer state exactly as they were when a
            loss or gradient is NaN/Inf; ``"warn"`` reports and lets the update happen; ``"raise"`` makes
            ``trainer.fit`` raise :class:`gradwatch.GradWatchError`.
        log_dir: TensorBoard event files and ``gradwatch.jsonl`` go here when the Trainer has no
            ``TensorBoardLogger``; with one, gradwatch writes into the logger's run instead (same directory,
            ``trainer.global_step`` as x-axis) and ignores ``log_dir``.
        **config: Any other :class:`gradwatch.Config` keyword (``every``, ``per_layer``, ``max_skips``,
            ``console``, ...). Validated here, with the same messages as ``gradwatch.watch``.

    Logged metrics (into the Trainer's ``TensorBoardLogger``, or ``log_dir``; rank zero only):

    - ``gradwatch/grad_norm/total``: L2 norm of all gradients before clipping (``gradwatch/grad_norm/total_opt{i}``
      per optimizer when there are several).
    - ``gradwatch/grad_norm/<module>``: per-module gradient norm before clipping (with ``per_layer=True``;
      every ``layer_every`` checked steps and on steps with a finding).
    - ``gradwatch/clip_ratio``: ``min(1, gradient_clip_val / total_norm)``, the factor Lightning's norm
      clipping scales the gradients by (1 = not clipped); only with ``Trainer(gradient_clip_val=...)``, the
      norm algorithm and no ``configure_gradient_clipping`` override.
    - ``gradwatch/loss``: the training loss of the step (mean over accumulated batches, as returned by
      ``training_step``).
    - ``gradwatch/skipped_steps``: updates skipped so far because of NaN/Inf.
    - ``gradwatch/nonfinite_grads``: parameters with a NaN/Inf gradient at this step.
    - ``gradwatch/findings/<kind>``: findings of each kind so far.
    - ``gradwatch/update_ratio/<layer>``: ``||update|| / ||weights||`` of the layer, on measuring steps.
    - ``gradwatch/amp/scale``, ``gradwatch/amp/overflow_steps``: the GradScaler's scale and the steps it
      skipped (with ``precision="16-mixed"`` and a scaler).
    - histograms ``gradwatch/grad_hist/<layer>`` and scalars ``gradwatch/grad_hist_nonfinite/<layer>``:
      only with ``histogram_every > 0``.
    - text ``gradwatch/findings``: every finding, with its explanation; plus a Custom Scalars layout, one
      question per chart, drawn from the scalars above and these, derived for it:
      ``gradwatch/incidents/grad_norm`` and ``gradwatch/incidents/loss`` (a marker at steps with a finding, a
      skipped update or a NaN/Inf), ``gradwatch/layer_norm_spread`` (largest / smallest per-module norm),
      ``gradwatch/update_ratio_median`` and ``gradwatch/findings_stacked/<kind>`` (findings so far, stacked
      by kind).

    Each finding is also appended to ``gradwatch.jsonl`` next to the event files.

    Attributes:
        engine: The shared engine of the current (or last) fit; ``None`` before ``fit`` or when there is
            nothing to watch.
        findings: Every finding so far.

    Example:
        >>> from gradwatch.lightning import GradWatchCallback
        >>> cb = GradWatchCallback(on_nonfinite="skip", console=False)
        >>> # trainer = lightning.pytorch.Trainer(callbacks=[cb]); trainer.fit(model)
        >>> cb.findings
        []
    """

    _namespaces: tuple[str, ...] = _IMPORTED  # the Lightning namespaces whose Callback this class subclasses
    _plain: type | None = None  # the class before more Callback bases were added

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Also a Callback of the namespaces imported since this module was (an isort'ed script imports
        # gradwatch before lightning): decided when the callback is built.
        return object.__new__(_callback_class(cls, _namespaces_in_use()))

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _rebuild, (self._plain or type(self), self._namespaces), self.__getstate__()

    def __init__(
        self,
        *,
        on_nonfinite: OnNonfinite = "skip",
        log_dir: str | os.PathLike[str] | None = None,
        **config: Any,
    ) -> None:
        self.config: Config = make_config(on_nonfinite=on_nonfinite, log_dir=log_dir, **config)
        self.engine: Engine | None = None
        self._trainer: weakref.ReferenceType[Any] | None = None
        self._escalation: tuple[Any, Any] | None = None  # (engine, its Escalation): asked at every step
        self._run_id = new_run_id()  # one run in gradwatch.jsonl across the fits of one Trainer
        self._handles: list[Any] = []
        self._optimizer_ids: dict[int, int] = {}
        self._pending_state: dict[str, Any] | None = None
        self._anomaly: tuple[bool, bool] | None = None
        self._in_step: set[int] = set()  # inside optimizer.step() (step pre-hook ran, post-hook not yet)
        self._checked: set[int] = set()  # checked, step not yet counted
        self._backward_seen = False
        # A closure optimizer's (LBFGS) later evaluations within a checked step: optimizer -> [count, loss,
        # whether the latest one was non-finite].
        self._reevaluations: dict[int, list[Any]] = {}
        self._skip_pending: set[int] = set()  # checked "skip", update not yet suppressed
        self._cleared_reported: set[tuple[int, int]] = set()  # (engine, optimizer): gradients cleared after the check
        self._fitted_with: Any = None  # weak reference to the Trainer of the latest fit
        self._automatic = True
        self._loss_scaler: Any = None  # the precision plugin's GradScaler: it scales the loss before our hook

    def __getstate__(self) -> dict[str, Any]:
        """What ``strategy="ddp_spawn"`` sends to its processes: the settings, not this process's run (its
        engine, hooks and Trainer). A console object that cannot be pickled (``rich.console.Console`` holds
        a lock) becomes ``True``: each process prints through its own global console (rank zero only)."""
        # Methods bound to a module (Lightning sets a callback's ``log`` during a fit) stay behind too.
        state = {k: v for k, v in self.__dict__.items() if not isinstance(v, types.MethodType)}
        state.update(engine=None, _escalation=None, _trainer=None, _fitted_with=None, _handles=[], _loss_scaler=None)
        console = self.config.console
        if not isinstance(console, bool):
            try:
                pickle.dumps(console)
            except Exception:  # noqa: BLE001 - any reason it does not pickle
                state["config"] = self.config.replace(console=True)
        return state

    # -- public ------------------------------------------------------------------------------------
    @property
    def findings(self) -> list[Finding]:
        """Every finding so far, in order."""
        return self.engine.findings if self.engine is not None else []

    @property
    def state_key(self) -> str:
        return "GradWatchCallback"

    # -- set-up ------------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any = None, stage: str | None = None) -> None:
        _require_instance(self)
        if stage != "fit":
            return
        active = self._trainer() if self._trainer is not None else None
        if active is not None and active is not trainer:
            raise RuntimeError(
                "this GradWatchCallback is already attached to another Trainer that is still fitting; one "
                "callback instance watches one run at a time. Give each Trainer its own: "
                "Trainer(callbacks=[GradWatchCallback(...)])"
            )
        self._trainer = weakref.ref(trainer)
        # The Trainer's own anomaly context restores what it found; this restores what gradwatch found.
        self._anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._owns(trainer):
            return
        try:
            self._build(trainer, pl_module)
        except Exception as exc:  # noqa: BLE001 - never make training worse
            internal_warning("GradWatchCallback.on_fit_start", exc)
            self._remove_hooks()
            self.engine = None

    def _build(self, trainer: Any, pl_module: Any) -> None:
        carried = self._carried_state(trainer)
        self.engine = None
        rank_zero = bool(trainer.is_global_zero)
        optimizers = [o for o in (_unwrap(o) for o in trainer.optimizers) if o is not None]
        idle = _idle_reason(pl_module, optimizers)
        if idle is not None:
            if rank_zero:
                safe_warn(idle, UserWarning, stacklevel=3)
            return
        engine = self._make_engine(trainer, pl_module, optimizers, rank_zero)
        if carried is not None:
            engine.load_state_dict(carried)
            self._run_id = engine.run_id  # a resumed fit continues the checkpoint's run
        self._pending_state = None
        self._automatic = bool(getattr(pl_module, "automatic_optimization", True))
        self._loss_scaler = _scaler(trainer)
        self._optimizer_ids = {id(o): i for i, o in enumerate(optimizers)}
        self._in_step.clear()
        self._checked.clear()
        self._reevaluations.clear()
        self._skip_pending.clear()
        self._backward_seen = False
        self._hook_optimizers(optimizers)

    def _carried_state(self, trainer: Any) -> dict[str, Any] | None:
        """The state this fit continues from (a checkpoint's, or this Trainer's previous fit's), if any."""
        carried = self._pending_state
        previous = self._fitted_with() if self._fitted_with is not None else None
        if carried is None and self.engine is not None and previous is trainer:
            carried = self.engine.state_dict()  # a second fit() of the same Trainer continues the counters
        # Another Trainer (a sweep reusing one callback) starts afresh: the history of an unrelated run
        # would make its first steps look like explosions. It is another run in gradwatch.jsonl too (a
        # checkpoint it resumes from carries the run it continues).
        if self._fitted_with is not None and previous is not trainer:
            self._run_id = new_run_id()
        self._fitted_with = weakref.ref(trainer)
        self._pending_state = carried
        return carried

    def _make_engine(self, trainer: Any, pl_module: Any, optimizers: list[Any], rank_zero: bool) -> Engine:
        """The engine for this fit, with the default extensions and the clip ratio (set as ``self.engine``)."""
        writer, writer_dir = _tensorboard_writer(trainer) if rank_zero else (None, None)
        records = _records_dir(trainer) if self.config.log_dir is None else None  # on every rank: a collective
        engine = Engine(
            pl_module, optimizers, self.config, tb_writer=writer, rank_zero=rank_zero, tb_log_dir=writer_dir,
            run_id=self._run_id, records_dir=records,
        )
        self.engine = engine
        try:
            for ext in default_extensions(engine, scaler=_scaler(trainer), integration="lightning"):
                engine.add_extension(ext)
        except Exception as exc:  # noqa: BLE001 - the core checks still run without the extensions
            internal_warning("GradWatchCallback: default_extensions", exc)
        how, clip = _clipping(trainer, pl_module)
        manual = not bool(getattr(pl_module, "automatic_optimization", True))
        engine.add_extension(ClipRatio(clip, how=how, manual=manual))
        return engine

    def _hook_optimizers(self, optimizers: list[Any]) -> None:
        for i, opt in enumerate(optimizers):
            # SAM-style wrappers update through their base optimizer's step() (first_step/second_step):
            # the hooks go where the update is applied, as in a plain loop.
            try:
                stepping = applying_optimizer(opt)
            except TypeError as exc:  # no step hooks: checked from Lightning's hooks only
                safe_warn(f"{exc} Steps Lightning does not run are not checked.", stacklevel=4)
                continue
            if stepping is not opt:
                self._optimizer_ids.setdefault(id(stepping), i)
            self._handles.append(stepping.register_step_pre_hook(functools.partial(self._before_step, i)))
            self._handles.append(stepping.register_step_post_hook(functools.partial(self._after_step, i)))

    # -- the step ----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        engine = self.engine
        if engine is None or engine.closed or not self._owns(trainer):
            return
        # Lightning-side extension point: extensions that need the batch (replay) or must switch anomaly
        # mode (the Trainer overrides it when set any earlier) define lightning_batch_start().
        for ext in engine.extensions:
            fn = getattr(ext, "lightning_batch_start", None)
            if fn is None:
                continue
            try:
                fn(trainer, pl_module, batch, batch_idx)
            except Exception as exc:  # noqa: BLE001
                internal_warning(f"{type(ext).__name__}.lightning_batch_start", exc)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        engine = self.engine
        if engine is None or engine.closed or not self._owns(trainer):
            return
        self._backward_seen = True
        if self._in_step & self._checked:
            # A closure optimizer (LBFGS) re-evaluating a step that was already checked.
            for i in self._in_step & self._checked:
                if i in self._reevaluations and isinstance(loss, torch.Tensor):
                    self._reevaluations[i][1] = _unscaled(loss.detach(), self._loss_scaler)
            return
        if isinstance(loss, torch.Tensor) and loss.numel() > 0:
            loss = loss.detach()
            # Automatic optimization backpropagates loss / accumulate_grad_batches; report the loss itself.
            # Read per step: a GradientAccumulationScheduler changes the factor during the run.
            scale = float(trainer.accumulate_grad_batches) if self._automatic else 1.0
            if scale != 1.0:
                loss = loss * scale
            engine.observe_loss(_unscaled(loss, self._loss_scaler))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        engine = self.engine
        if engine is None or engine.closed or not self._owns(trainer):
            return
        i = self._index_of(optimizer)
        if i is None:
            return
        if i in self._in_step and i in self._checked:
            # LBFGS calls the closure, and with it this hook, several times per step: guard the later ones.
            seen = self._reevaluations.get(i)
            if seen is not None:
                seen[0] += 1
                seen[2] = not engine.guard_reevaluation(
                    i, seen[1], seen[0], step=int(trainer.global_step), large_loss=True
                )
                seen[1] = None
            return
        if i in self._checked:
            # The previous step of this optimizer never ran (an AMP scaler skipped it); this step's
            # backward already happened, so keep its flag.
            self._finish(i, new_cycle=False)
        self._checked.add(i)
        if self._automatic and not self._backward_seen:
            return  # training_step returned None: Lightning skips backward and the step updates nothing
        self._backward_seen = False
        due = engine.should_check(i)
        decision = engine.check_step(i, step=int(trainer.global_step), due=due)
        if decision == "skip":
            # Applied right before the update (after Lightning's clipping and the module's own
            # on_before_optimizer_step, which still see the gradients): in the closure wrapper, or in the
            # step pre-hook when the closure ran first (AMP: precision plugin, then scaler.step).
            self._skip_pending.add(i)
        elif due and i in self._in_step:
            self._reevaluations[i] = [1, None, False]

    def _check_raw_step(self, index: int) -> None:
        engine = self.engine
        if engine is None or engine.closed:
            return
        self._checked.add(index)
        self._backward_seen = False
        # Lightning's global_step counts LightningOptimizer steps only (it stays put here): the engine's own
        # count labels the step.
        if engine.check_step(index, due=engine.should_check(index)) == "skip":
            self._skip_pending.add(index)

    def _suppress_if_skipped(self, index: int) -> None:
        if index in self._skip_pending and self.engine is not None:
            self._skip_pending.discard(index)
            self.engine.suppress_update(index)

    def _replaying(self) -> bool:
        """A localization replay of training_step is running (it must update nothing)."""
        esc = self._escalation
        if esc is None or esc[0] is not self.engine:
            engine = self.engine
            from gradwatch.diagnose.escalation import Escalation

            found = engine.extension(Escalation) if engine else None
            self._escalation = esc = (engine, found)
        return bool(esc[1] is not None and esc[1].replaying)

    def _before_step(self, index: int, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if self._replaying():
            # An optimizer stepped from inside the replayed training_step, past its inert stand-in: no update.
            if self.engine is not None:
                self.engine.suppress_update(index)
            return None
        self._in_step.add(index)
        if self.engine is not None:
            self.engine.release_held()  # a closure that ran before the step (AMP's scaler.step): gradients final
        pos = 1 if args and args[0] is optimizer else 0
        closure = kwargs.get("closure") if "closure" in kwargs else (args[pos] if len(args) > pos else None)
        if closure is None and not self._automatic and index not in self._checked:
            # Manual optimization stepping the torch optimizer itself (optimizers(use_pl_optimizer=False),
            # SAM's base_optimizer.step()): Lightning's on_before_optimizer_step does not run, check here.
            self._check_raw_step(index)
        self._suppress_if_skipped(index)
        closure = kwargs.get("closure")
        if closure is None or not callable(closure):
            return None

        def gradwatch_closure() -> Any:
            # Lightning's closure runs training_step, backward, on_before_optimizer_step (the check, and for
            # an LBFGS re-evaluation the guard) and clipping; then the optimizer updates. A skipped step is
            # suppressed here; a guarded non-finite re-evaluation becomes a failed trial.
            checked_before = self.engine.steps_checked if self.engine is not None else 0
            loss = closure()
            if self.engine is not None:
                self.engine.release_held()  # after the module's on_before_optimizer_step and clipping
            if self._automatic and self.engine is not None and self.engine.steps_checked > checked_before:
                self._cleared_after_check(index)  # checked inside this closure (not a skipped training_step)
            self._suppress_if_skipped(index)
            seen = self._reevaluations.get(index)
            if seen is not None and seen[2] and self.engine is not None and self.engine.config.on_nonfinite == "skip":
                seen[2] = False
                return failed_trial_loss(loss)
            return loss

        return args, dict(kwargs, closure=gradwatch_closure)

    def _cleared_after_check(self, index: int) -> None:
        """The LightningModule's own ``on_before_optimizer_step`` (or ``configure_gradient_clipping``) runs
        after the callbacks' (where gradwatch checked): gradients it sets to None are found here, before the
        update. One attribute read per step; the full look only when the first gradient is gone."""
        engine = self.engine
        stats = engine.history.last.get(index) if engine is not None else None
        params = stats.extra.get("params") if stats is not None else None
        if not params or params[0].grad is not None or any(p.grad is not None for p in params):
            return
        if (id(engine), index) in self._cleared_reported:
            return  # reported once per optimizer and run
        self._cleared_reported.add((id(engine), index))
        n = len(params)
        engine.add_finding(
            Finding(
                kind="grads_cleared_before_step",
                step=stats.step,
                severity="error",
                explanation=Explanation(
                    what=(
                        f"optimizer {index}.step() at step {stats.step} found no gradient: all {n} gradients were "
                        "set to None after backward and after gradwatch's check, by the LightningModule's own "
                        "on_before_optimizer_step (or configure_gradient_clipping), which Lightning runs after the "
                        "callbacks' hooks."
                    ),
                    why="the step applies no gradient; the model does not learn.",
                    fix=(
                        "remove optimizer.zero_grad() (or p.grad = None) from that hook: Lightning clears the "
                        "gradients itself after each optimizer step."
                    ),
                ),
                params=tuple(stats.names[:n]),
                data={"optimizer": index, "after_check": True, "count": n},
            )
        )

    def _after_step(self, index: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._replaying():
            if self.engine is not None:
                self.engine.restore_grads()
            return
        self._in_step.discard(index)
        if index in self._checked:
            self._finish(index)
        elif self.engine is not None:
            self.engine.step_done(index)

    def _finish(self, index: int, new_cycle: bool = True) -> None:
        self._checked.discard(index)
        self._skip_pending.discard(index)
        self._reevaluations.pop(index, None)
        if new_cycle:
            self._backward_seen = False
        engine = self.engine
        if engine is None:
            return
        engine.release_held()  # a step the optimizer never ran (an AMP overflow): its gradients are still there
        engine.restore_grads()
        engine.step_done(index)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.engine is None or not self._owns(trainer):
            return
        # Steps whose optimizer.step() never ran (AMP scaler overflow): put gradients back, count them.
        for i in sorted(self._checked - self._in_step):
            self._finish(i)

    def _index_of(self, optimizer: Any) -> int | None:
        i = self._optimizer_ids.get(id(optimizer))
        if i is None:
            inner = _unwrap(optimizer)
            i = self._optimizer_ids.get(id(inner)) if inner is not None else None
        return i

    # -- end ---------------------------------------------------------------------------------------
    def on_exception(self, trainer: Any, pl_module: Any = None, exception: BaseException | None = None) -> None:
        if not isinstance(self, GradWatchCallback):
            return  # the class itself was passed to the Trainer; setup() already said so
        if not self._owns(trainer):
            return
        engine = self.engine
        if engine is not None:
            engine.interrupted = True
        if engine is not None and isinstance(exception, Exception) and not engine.closed:
            engine.explain_exception(exception, step=int(trainer.global_step))
        self._shutdown()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self._owns(trainer):
            self._shutdown()

    def _shutdown(self) -> None:
        """Remove hooks, put gradients back, close reports, restore anomaly mode. Idempotent."""
        self._remove_hooks()
        engine = self.engine
        if engine is not None and not engine.closed:
            try:
                engine.restore_grads()
                engine.close()
            except Exception as exc:  # noqa: BLE001
                internal_warning("GradWatchCallback.close", exc)
        if self._anomaly is not None:
            enabled, check_nan = self._anomaly
            if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != (enabled, check_nan):
                torch.autograd.set_detect_anomaly(enabled, check_nan=check_nan)
            self._anomaly = None
        self._in_step.clear()
        self._checked.clear()
        self._reevaluations.clear()
        self._skip_pending.clear()
        self._trainer = None

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _owns(self, trainer: Any) -> bool:
        return self._trainer is not None and self._trainer() is trainer

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, recent history and findings, saved in Lightning checkpoints."""
        if self.engine is not None:
            return self.engine.state_dict()
        return dict(self._pending_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from a checkpoint; applied when the engine is built if ``fit`` has not started it yet."""
        if self.engine is not None and not self.engine.closed:
            self.engine.load_state_dict(state_dict)
            self._run_id = self.engine.run_id
        else:
            self._pending_state = dict(state_dict)


class ClipRatio:
    """Engine extension: logs ``gradwatch/clip_ratio``, the factor Lightning's norm clipping applies, and
    tells the magnitude checks how this run clips (``stats.extra["clipping"]``: Lightning's norm or value
    clipping, the module's own ``configure_gradient_clipping``, or none), so that their findings do not tell
    a user who clips to add clipping.

    Reads the step's pre-clip total norm (already synced with the step's statistics): no extra sync.
    """

    def __init__(self, clip_val: float | None, how: str | None = "norm", manual: bool = False) -> None:
        self.clip_val = float(clip_val) if clip_val else None
        self.how = how if how is not None and (self.clip_val is not None or how == "module") else None
        # One dict for the run: the checks read it, nothing is built per step.
        self.facts = {"lightning": True, "how": self.how, "clip_val": self.clip_val, "manual": manual}
        self.module_code = {"lightning": True, "how": "module_code", "clip_val": None, "manual": manual}
        self._multi = False

    def attach(self, engine: Engine) -> None:
        self._multi = len(engine.optimizers) > 1
        # The module's own on_before_optimizer_step (and callbacks after this one) run after the check and may
        # clip: findings worded by clipping wait for the update (released by the callback, see core/held.py).
        engine.hold_clipped_words = True

    def after_sync(self, ctx: Any) -> None:
        stats = ctx.stats
        found = stats.extra.get("clipping")
        if isinstance(found, dict) and found.get("how") == "loop":
            # The module's own code clipped before the check (gradwatch.observe.preclip measured before it).
            stats.extra["clipping"] = self.module_code
            return
        stats.extra["clipping"] = self.facts
        if self.how != "norm" or self.clip_val is None or not stats.names or not math.isfinite(stats.total_norm):
            return
        ratio = min(1.0, self.clip_val / (stats.total_norm + 1e-6))  # clip_grad_norm_'s own formula
        suffix = f"_opt{stats.optimizer_index}" if self._multi else ""
        stats.extra.setdefault("scalars", {})[f"gradwatch/clip_ratio{suffix}"] = ratio
        stats.extra["clip_ratio"] = ratio


def _require_instance(obj: Any) -> None:
    # Trainer(callbacks=[GradWatchCallback]) calls the hooks on the class, with the Trainer as `self`.
    if not isinstance(obj, GradWatchCallback):
        raise TypeError(
            "Trainer(callbacks=[...]) got the class GradWatchCallback instead of an instance; "
            "pass GradWatchCallback(...), e.g. Trainer(callbacks=[GradWatchCallback(on_nonfinite='skip')])"
        )


def _idle_reason(pl_module: Any, optimizers: list[Any]) -> str | None:
    """Why the callback has nothing to watch in this fit (the warning it gives), or None."""
    if not any(p.requires_grad for p in pl_module.parameters()):
        return (
            f"gradwatch: {type(pl_module).__name__} has no trainable parameters (none with "
            "requires_grad=True), so there are no gradients to watch and GradWatchCallback does "
            "nothing in this run. Unfreeze some parameters, or remove the callback."
        )
    if not optimizers:
        return (
            "gradwatch: the Trainer has no optimizer (configure_optimizers returned none), so "
            "GradWatchCallback has no optimizer step to check and does nothing in this run."
        )
    return None


def _unwrap(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer behind a LightningOptimizer (or the optimizer itself); None for Lightning's mock."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "_optimizer"):
        inner = getattr(optimizer, "_optimizer", None)
        if inner is None or seen > 4:
            break
        optimizer, seen = inner, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer) or type(optimizer).__name__ == "_MockOptimizer":
        return None
    return optimizer


def _tensorboard_writer(trainer: Any) -> tuple[Any, str | None]:
    """The SummaryWriter of the Trainer's TensorBoardLogger (either namespace), and its directory."""
    logger_classes = tuple(
        cls
        for cls in (getattr(sys.modules.get(m), "TensorBoardLogger", None) for m in _LOGGER_MODULES)
        if isinstance(cls, type)
    )
    if not logger_classes:
        return None, None
    from torch.utils.tensorboard import SummaryWriter

    writer_classes: tuple[type, ...] = (SummaryWriter,)
    tbx = sys.modules.get("tensorboardX")
    if tbx is not None and isinstance(getattr(tbx, "SummaryWriter", None), type):
        writer_classes += (tbx.SummaryWriter,)
    for logger in getattr(trainer, "loggers", None) or []:
        if isinstance(logger, logger_classes):
            # Off rank zero `experiment` is a dummy whose every attribute exists: check the type.
            experiment = logger.experiment
            if isinstance(experiment, writer_classes):
                return experiment, str(logger.log_dir)
    return None, None


def _records_dir(trainer: Any) -> str | None:
    """``trainer.log_dir`` when the Trainer logs, but to no ``TensorBoardLogger``: gradwatch.jsonl and the
    incident reports go beside the Trainer's own logs (``logger=False``: nowhere). Called on every rank, the
    same way: ``trainer.log_dir`` broadcasts rank zero's directory."""
    loggers = getattr(trainer, "loggers", None) or []
    tensorboard = tuple(
        cls
        for cls in (getattr(sys.modules.get(m), "TensorBoardLogger", None) for m in _LOGGER_MODULES)
        if isinstance(cls, type)
    )
    if not loggers or any(isinstance(logger, tensorboard) for logger in loggers):
        return None
    log_dir = trainer.log_dir
    return str(log_dir) if log_dir else None


def _unscaled(loss: torch.Tensor, scaler: Any) -> torch.Tensor:
    """The training loss before the precision plugin's GradScaler multiplied it (``MixedPrecision`` and
    ``FSDPPrecision`` scale it in ``pre_backward``, before ``on_before_backward``). The scale it used is the
    scaler's current one (it changes in ``update()``, after the step); divided on the device: no sync."""
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor) or not scaler.is_enabled():
        return loss
    return loss / scale.to(loss.device)


def _scaler(trainer: Any) -> Any:
    plugin = getattr(trainer, "precision_plugin", None)
    return getattr(plugin, "scaler", None)


def _clipping(trainer: Any, pl_module: Any) -> tuple[str | None, float | None]:
    """How Lightning clips this run's gradients after gradwatch's check: ``("norm" | "value", clip)`` from
    ``Trainer(gradient_clip_val=...)``, ``("module", clip)`` when the module overrides
    ``configure_gradient_clipping`` (it clips its own way: the ratio would be a guess), or ``(None, None)``."""
    for cls in type(pl_module).__mro__:
        if "configure_gradient_clipping" in vars(cls) and not cls.__module__.startswith(_LIGHTNING_PACKAGES):
            clip = getattr(trainer, "gradient_clip_val", None)
            return "module", float(clip) if isinstance(clip, (int, float)) and clip > 0 else None
    clip = getattr(trainer, "gradient_clip_val", None)
    if not isinstance(clip, (int, float)) or clip <= 0:
        return None, None
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    if algorithm is not None and str(getattr(algorithm, "value", algorithm)).lower() != "norm":
        return "value", float(clip)
    return "norm", float(clip)


__all__ = ["INSTALL_HINT", "ClipRatio", "GradWatchCallback"]
