"""The plain-loop way in: ``gradwatch.watch(model, optimizer)``.

Checks run in an optimizer step pre-hook, i.e. inside ``optimizer.step()``, before the update. For
closure-driven optimizers (LBFGS, or any ``step(closure)``) the closure is wrapped so the checks see the
gradients it produced, not stale ones.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradwatch.core.closure_guard import failed_trial_loss
from gradwatch.core.config import make_config
from gradwatch.core.engine import Engine
from gradwatch.core.extensions import default_extensions
from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Explanation, Finding, names_text
from gradwatch.core.open_watchers import open_watchers, register
from gradwatch.core.weak import weak_method
from gradwatch.observe.distributed import is_rank_zero
from gradwatch.report.summary import RunSummary

if TYPE_CHECKING:
    from gradwatch.gradcheck import GradcheckResult

# optimizer -> its watcher, both weakly (a strong value would keep its own key, the optimizer, alive).
_WATCHED: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[Watcher]] = weakref.WeakKeyDictionary()


def _watcher_of(opt: torch.optim.Optimizer) -> Watcher | None:
    ref = _WATCHED.get(opt)
    return ref() if ref is not None else None


class Watcher:
    """Watches a model and its optimizer(s) in a plain training loop.

    Use :func:`watch` to build one. After :meth:`close` (or leaving the ``with`` block) every hook is
    removed and the model and optimizer behave exactly as before.

    Attributes:
        engine: The shared engine (findings, counters, history).
    """

    def __init__(
        self,
        /,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        scaler: Any = None,
        **config: Any,
    ) -> None:
        if isinstance(model, type) and issubclass(model, nn.Module):
            raise TypeError(f"watch() needs a model instance, got the class {model.__name__}; pass {model.__name__}(...)")
        if not isinstance(model, nn.Module):
            raise TypeError(_bad_model(model, optimizer))
        given = _as_optimizers(optimizer)
        optimizers = [applying_optimizer(o) for o in given]
        cfg = make_config(**config)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}: {scaler!r:.80}"
            )
        if not optimizers and not any(p.requires_grad for p in model.parameters()):
            # With an optimizer, a frozen model is fine: it may optimize inputs (style transfer,
            # adversarial examples), and a forgotten unfreeze is explained when backward() fails.
            raise ValueError(
                f"{type(model).__name__} has no trainable parameters (none with requires_grad=True), so there "
                "are no gradients to watch; unfreeze some parameters or do not watch this model"
            )
        for opt in optimizers:
            other = _watcher_of(opt)
            if other is not None and not other.closed:
                raise RuntimeError(
                    f"optimizer {type(opt).__name__} is already watched by another gradwatch watcher; "
                    "close() it first (or use one watcher for all optimizers: watch(model, [opt_a, opt_b]))"
                )
        self.model = model
        self.optimizers = optimizers
        self.scaler = scaler
        self.engine = Engine(model, optimizers, cfg, rank_zero=is_rank_zero())
        self._handles: list[Any] = []
        self._pending_snapshot: dict[int, dict[Any, Any]] = {}
        self._closure_step: set[int] = set()
        for i, opt in enumerate(optimizers):
            _WATCHED[opt] = weakref.ref(self)
            # Run eagerly under torch.compile(opt.step): dynamo would trace gradwatch's own Python (graph
            # breaks at its sync, recompiles) and see no real gradients.
            self._handles.append(opt.register_step_pre_hook(_eager(functools.partial(self._pre_step, i))))
            self._handles.append(opt.register_step_post_hook(_eager(functools.partial(self._post_step, i))))
        # Any other optimizer's step: one that updates the watched model's parameters is reported (once).
        self._known: weakref.WeakSet[Any] = weakref.WeakSet([*given, *optimizers])
        # Optimizers stepping the model unwatched: [the run's step when each first stepped, its steps since],
        # and the furthest such step reached (an optimizer re-created each epoch is freed with its epoch).
        self._unwatched: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
        self._unwatched_reach = 0
        # The latest unwatched optimizer's parameters and [first step, steps taken] (kept past its death), and
        # how many in a row were replaced by a new one over the same parameters after a single step.
        self._last_unwatched: tuple[tuple[str, ...], list[int]] | None = None
        self._recreated = 0
        self._in_watched_step = False
        if optimizers:
            # A process-wide hook: it holds the watcher weakly, and is removed when the watcher is closed or
            # collected (a watcher never closed must not keep its model alive through it).
            handle = register_optimizer_step_pre_hook(_eager(weak_method(self, "_any_step")))
            self._handles.append(handle)
            weakref.finalize(self, handle.remove)
        try:
            extensions = default_extensions(self.engine, scaler=scaler, integration="plain")
        except Exception as exc:  # noqa: BLE001 - watch on with the core checks only
            internal_warning("default_extensions", exc, owner=self.engine)
            extensions = []
        for ext in extensions:
            self.engine.add_extension(ext)
        register(self)
        _install_excepthook()

    # -- public ------------------------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def findings(self) -> list[Finding]:
        """Every finding so far, in order."""
        return self.engine.findings

    @property
    def closed(self) -> bool:
        return self.engine.closed

    @property
    def log_dir(self) -> str | None:
        return self.engine.log_dir

    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Tell gradwatch this step's loss (optional; no sync: it is read with the step's statistics)."""
        self.engine.observe_loss(loss)  # type: ignore[arg-type]

    def check(self) -> bool:
        """Check now, for loops without an optimizer (hand-written updates). Call after ``backward()``.

        Returns:
            True if the update may be applied; False when it must be skipped (non-finite under
            ``on_nonfinite="skip"``): gradwatch cannot skip a hand-written update for you.

        Raises:
            GradWatchError: under ``on_nonfinite="raise"``.
        """
        try:
            return self.engine.check_step(0) == "ok"
        finally:
            self.engine.step_done(0)

    def explain(self, exc: BaseException) -> Finding | None:
        """Diagnose an exception from the training code (autograd errors); returns the finding, if any."""
        return self.engine.explain_exception(exc)

    def summary(self) -> RunSummary:
        return self.engine.summary()

    def gradcheck(self, *example_inputs: Any, loss_fn: Callable[[Any], Any] | None = None) -> GradcheckResult:
        """Check every custom ``torch.autograd.Function`` of the last step against finite differences.

        Without ``example_inputs``, on the batch the last step's forward got (call it between steps or after
        the loop; it needs ``escalate=True``, the default). See :func:`gradwatch.gradcheck`.

        Returns:
            A :class:`gradwatch.GradcheckResult`; its ``bad_backward`` findings are not added to
            :attr:`findings`.
        """
        from gradwatch.diagnose.escalation import Escalation
        from gradwatch.gradcheck import MAX_STEP_CALLS, check_model

        esc = self.engine.extension(Escalation)
        last = getattr(esc, "last_step", None)
        if example_inputs:
            step, calls = (last[0] if last else 0), [(example_inputs, {}, None)]
        elif last is None:
            raise RuntimeError(
                "gw.gradcheck() found no step to check: call it after an optimizer step (between steps or "
                "after the loop), with escalate=True (the default); or pass a batch: gw.gradcheck(x)"
            )
        else:
            step, calls = last[0], last[1][:MAX_STEP_CALLS]
        with _paused(self.engine, esc):
            return check_model(self.model, (), {}, loss_fn=loss_fn, step=step, calls=calls)

    def state_dict(self) -> dict[str, Any]:
        """Counters, step numbers, recent history and findings, for a checkpoint (plain types only: loads
        with ``torch.load(weights_only=True)``). ``fabric.save(path, {..., "gradwatch": gw})`` calls it."""
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: findings carry on from the saved step numbers, and a condition
        reported before the checkpoint is not reported again."""
        self.engine.load_state_dict(state_dict)

    def close(self) -> None:
        """Remove every hook, flush and close the reports, print the summary. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.engine.restore_grads()
        for opt in self.optimizers:
            if _watcher_of(opt) is self:
                del _WATCHED[opt]
        self.engine.close()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            self.engine.interrupted = exc is not None
            if exc is not None and isinstance(exc, Exception):
                self.engine.explain_exception(exc)
        finally:
            self.close()
        return False  # never swallow the user's exception

    # -- hooks -------------------------------------------------------------------------------------
    def _any_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global step pre-hook: an optimizer gradwatch does not watch is about to update the model."""
        try:
            if self._in_watched_step:
                return  # a wrapper's inner optimizer stepping inside a watched step (Lookahead)
            seen = self._unwatched.get(optimizer)
            if seen is not None:
                seen[1] += 1
                self._unwatched_reach = max(self._unwatched_reach, seen[0] + seen[1])
                return
            if optimizer in self._known:
                return  # a watched optimizer
            self._known.add(optimizer)
            # The run's step: an optimizer re-created each epoch takes over from the previous one's count.
            step = max(self.engine.step_counts[0], self._unwatched_reach)
            owned = self.engine.index.param_name
            names = [
                owned[id(p)]
                for g in optimizer.param_groups
                for p in g["params"]
                if id(p) in owned and p.requires_grad
            ]
            if names:
                seen = self._unwatched[optimizer] = [step, 1]
                self._unwatched_reach = max(self._unwatched_reach, step + 1)
                last, self._last_unwatched = self._last_unwatched, (tuple(names), seen)
                if last is not None and last[0] == tuple(names) and last[1][1] <= RECREATED_STEPS:
                    # Its predecessor over the same parameters took a step or a few: a new optimizer every
                    # few steps (inside the training loop), not a restart between training stages.
                    self._recreated += 1
                    if self._recreated == 2:
                        self.engine.add_finding(_recreated_finding(optimizer, names, step, last[1][1]))
                    return
                self._recreated = 0
                self.engine.add_finding(_unwatched_finding(optimizer, names, step))
        except Exception as exc:  # noqa: BLE001 - never break the user's step
            internal_warning("unwatched optimizer check", exc, owner=self.engine)

    def _pre_step(self, index: int, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._in_watched_step = True
        # ``args`` starts with the optimizer itself (torch passes the bound call's positional arguments).
        pos = 1 if args and args[0] is optimizer else 0
        closure = kwargs.get("closure") if "closure" in kwargs else (args[pos] if len(args) > pos else None)
        if closure is not None and callable(closure):
            self._closure_step.add(index)
            if self.engine.should_check(index) and self.engine.config.on_nonfinite == "skip":
                self._pending_snapshot[index] = self.engine.snapshot_state(index)
            wrapped = self._wrap_closure(index, closure)
            if "closure" in kwargs:
                return args, dict(kwargs, closure=wrapped)
            return (*args[:pos], wrapped, *args[pos + 1 :]), kwargs
        self._check(index)
        return None

    def _wrap_closure(self, index: int, closure: Callable[[], Any]) -> Callable[[], Any]:
        evaluations = [0]
        guarded = [False]

        def gradwatch_closure() -> Any:
            loss = closure()
            evaluations[0] += 1
            if evaluations[0] == 1:
                if isinstance(loss, torch.Tensor) and loss.numel() > 0:
                    self.engine.observe_loss(loss)
                due = self.engine.should_check(index)
                guarded[0] = self._check(index, closure=True) == "ok" and due
            elif guarded[0] and not self.engine.guard_reevaluation(index, loss, evaluations[0], large_loss=True):
                # LBFGS iterates (and line-searches) within one step: this evaluation is non-finite. Its
                # gradients are hidden (None); a large finite loss makes it a failed trial, not a NaN one.
                if self.engine.config.on_nonfinite == "skip":
                    return failed_trial_loss(loss)
            return loss

        return gradwatch_closure

    def _check(self, index: int, closure: bool = False) -> str:
        decision = self.engine.check_step(index, closure=closure)
        if decision == "skip":
            self.engine.suppress_update(index, self._pending_snapshot.pop(index, None))
        return decision

    def _post_step(self, index: int, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._in_watched_step = False
        self.engine.restore_grads()
        self._pending_snapshot.pop(index, None)
        if index in self._closure_step:
            self._closure_step.discard(index)
            self.engine.drop_losses()  # later line-search evaluations of this step
        self.engine.step_done(index)


@contextlib.contextmanager
def _paused(engine: Engine, esc: Any) -> Iterator[None]:
    """gradwatch's own forward hooks ignore the forward calls of ``Watcher.gradcheck``."""
    replaying = engine.replaying if hasattr(engine, "replaying") else False
    engine.replaying = True
    if esc is not None:
        esc.replaying = True
    try:
        yield
    finally:
        engine.replaying = replaying
        if esc is not None:
            esc.replaying = False


def watch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    **config: Any,
) -> Watcher:
    """Watch a plain PyTorch training loop. One line to attach.

    Args:
        model: The model being trained.
        optimizer: Its optimizer, a list of optimizers, or None for hand-written updates (then call
            :meth:`Watcher.check` after ``backward()``).
        **config: Any :class:`gradwatch.Config` keyword (``on_nonfinite``, ``log_dir``, ``every``, ...),
            plus ``scaler=`` (a ``torch.amp.GradScaler``) for exact AMP accounting.

    Returns:
        A :class:`Watcher`; use it as a context manager or call ``close()`` at the end.

    Example:
        >>> import torch, gradwatch
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with gradwatch.watch(model, opt, console=False) as gw:
        ...     for _ in range(3):
        ...         loss = model(torch.randn(8, 4)).pow(2).mean()
        ...         gw.observe_loss(loss)
        ...         opt.zero_grad()
        ...         loss.backward()
        ...         opt.step()
        >>> gw.findings
        []
    """
    return Watcher(model, optimizer, **config)


_HOOKED: list[Any] = []


def _install_excepthook() -> None:
    """Once per process: ``sys.excepthook`` explains an autograd error that ends a script whose watcher was
    not used as a context manager (``gw = gradwatch.watch(...)`` without ``with``), then hands over to the
    previous hook (Python's traceback). Watchers in a ``with`` block explain on exit, and each exception is
    explained once."""
    if _HOOKED:
        return
    previous = sys.excepthook

    def hook(exc_type: Any, exc: BaseException, tb: Any) -> None:
        try:
            if isinstance(exc, Exception):
                for w in open_watchers():
                    if not w.closed:
                        w.engine.explain_exception(exc)
        except Exception:  # noqa: BLE001, S110 - Python's own report must follow whatever happens here
            pass
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    _HOOKED.append(hook)


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` excluded from torch.compile tracing (it runs eagerly at the call)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def applying_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``step()`` applies the update, where a wrapper's own ``step()`` may not run:
    SAM-style optimizers (``first_step``/``second_step`` around ``base_optimizer.step()``), Lightning Fabric's
    optimizer wrapper, and wrappers
    that never ran ``Optimizer.__init__`` (no step hooks: some Lookahead ports, torch's own
    ``PostLocalSGDOptimizer`` keeping its optimizer in ``.optim``). Others stay as given."""
    for _ in range(4):  # wrappers of wrappers, bounded
        base = getattr(opt, "base_optimizer", None)
        if isinstance(base, torch.optim.Optimizer) and base is not opt:
            opt = base
            continue
        inner = getattr(opt, "optimizer", None)
        if (
            isinstance(inner, torch.optim.Optimizer)
            and inner is not opt
            and getattr(inner, "_optimizer_step_pre_hooks", None) is getattr(opt, "_optimizer_step_pre_hooks", 0)
        ):
            # Lightning Fabric's optimizer (fabric.setup): a subclass of the user's optimizer class sharing its
            # state and hook dicts, stepping the one it wraps. The hooks fire on that one: watch it.
            opt = inner
            continue
        if not hasattr(opt, "_optimizer_step_pre_hooks"):
            inner = next(
                (
                    v for v in (getattr(opt, a, None) for a in _INNER)
                    if isinstance(v, torch.optim.Optimizer) and v is not opt
                ),
                None,
            )
            if inner is not None:
                opt = inner
                continue
        break
    if not hasattr(opt, "_optimizer_step_pre_hooks"):
        raise TypeError(
            f"gradwatch cannot watch {type(opt).__name__}: it never ran torch.optim.Optimizer.__init__, so it has "
            "no step hooks, and no optimizer it wraps was found (looked at "
            f"{', '.join('.' + a for a in ('base_optimizer', *_INNER))}). Pass the torch optimizer that applies "
            "the update: gradwatch.watch(model, wrapper.<inner optimizer>)."
        )
    return opt


#: Attributes where wrappers without ``Optimizer.__init__`` keep the optimizer they wrap.
_INNER = ("optimizer", "optim", "_optimizer", "inner_optimizer", "opt")


#: A new unwatched optimizer over the same parameters after at most this many steps of its predecessor, twice
#: in a row: re-created inside the training loop.
RECREATED_STEPS = 3


def _optimizer_finding(kind: str, optimizer: Any, names: list[str], step: int, explanation: Explanation) -> Finding:
    """A warning about an optimizer gradwatch does not watch, over ``names`` of the watched model."""
    return Finding(
        kind=kind,
        step=step,
        severity="warning",
        explanation=explanation,
        params=tuple(names),
        data={"optimizer_class": type(optimizer).__name__, "count": len(names)},
    )


def _unwatched_finding(optimizer: Any, names: list[str], step: int) -> Finding:
    return _optimizer_finding(
        "unwatched_optimizer", optimizer, names, step,
        Explanation(
            what=(
                f"An optimizer gradwatch does not watch ({type(optimizer).__name__}) is updating {len(names)} "
                f"parameter(s) of the watched model at step {step}: {names_text(names)}. gradwatch checks updates "
                "inside the watched optimizers' step() only, so this one's updates are not checked: a NaN/Inf in "
                "them is neither skipped nor reported."
            ),
            why=(
                "usually the optimizer was re-created after watch() (fine-tuning, a restart with another learning "
                "rate), or a second optimizer was left out."
            ),
            fix=(
                "watch every optimizer that updates the model, and watch a re-created one anew: gw.close(); "
                "gw = gradwatch.watch(model, [opt_a, opt_b])."
            ),
        ),
    )


def _recreated_finding(optimizer: Any, names: list[str], step: int, each: int) -> Finding:
    every = "for every step" if each == 1 else f"every {each} steps"
    return _optimizer_finding(
        "optimizer_recreated", optimizer, names, step,
        Explanation(
            what=(
                f"A new optimizer ({type(optimizer).__name__}) over the same {len(names)} parameter(s) of the "
                f"watched model is created {every} (the third one at step {step}): {names_text(names)}."
            ),
            why=(
                "each one starts with an empty state, so the optimizer's memory is thrown away at every update: "
                "momentum never builds up, Adam's moments restart (its bias correction makes every update about "
                "lr * sign(gradient), whatever the gradient's size), and a learning-rate scheduler built on one "
                "of them drives none of the later ones. None of these updates is checked by gradwatch either."
            ),
            fix=(
                "create the optimizer once, before the training loop (not inside it), and watch that one: "
                "gradwatch.watch(model, optimizer)."
            ),
        ),
    )


def _bad_model(model: Any, optimizer: Any) -> str:
    """The message for a first argument that is no module: its type named, never its (multi-line) repr."""
    got = f"watch() needs a torch.nn.Module as model, got {type(model).__name__}"
    if isinstance(model, torch.optim.Optimizer) and isinstance(optimizer, nn.Module):
        return (
            f"{got} and a {type(optimizer).__name__} module as optimizer: the arguments are swapped; "
            "call watch(model, optimizer)"
        )
    if isinstance(model, torch.optim.Optimizer):
        return f"{got}; pass the model first: watch(model, optimizer)"
    return got


def _as_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if isinstance(optimizer, type):
        raise TypeError(f"optimizer must be an optimizer instance, got the class {optimizer.__name__}")
    if isinstance(optimizer, (list, tuple, types.GeneratorType)):
        opts = list(optimizer)
        bad = [o for o in opts if not isinstance(o, torch.optim.Optimizer)]
        if bad and all(isinstance(o, torch.Tensor) for o in opts):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {len(opts)} tensors (model.parameters()?); "
                "pass the optimizer built from them: watch(model, optimizer)"
            )
        if bad or not opts:
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or a non-empty list of them, got {[type(o).__name__ for o in opts]}"
            )
        if len({id(o) for o in opts}) != len(opts):
            raise ValueError("the same optimizer is listed twice")
        return opts
    inner = getattr(optimizer, "optimizer", None)  # e.g. a LightningOptimizer or another wrapper
    if isinstance(inner, torch.optim.Optimizer):
        return [inner]
    raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a list of them), got {type(optimizer).__name__}")
