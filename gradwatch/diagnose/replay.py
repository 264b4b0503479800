"""Replay: run one captured step again, localized, leaving no trace in the model, its gradients or the RNGs.

:func:`replay_call` replays a plain loop's forward call on its captured inputs (with the output gradient it
received, when held) under anomaly mode and a :class:`~gradwatch.diagnose.localize.Localizer`;
:func:`replay_lightning` runs a Lightning batch's ``training_step`` again; :func:`screen_call` only tells whether
a call turns non-finite. Module buffers and the RNG states are restored afterwards (:func:`preserved`), the
inputs are private copies (:func:`replay_input`), and a ``torch.distributed`` collective stops the replay
(:func:`no_collectives`): a replay runs on one rank.
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from gradwatch.core.failures import host_rng_kept, internal_warning
from gradwatch.diagnose.capture import MAX_GRADS, Batch, Call, all_finite, nonfinite_flags, output_leaves
from gradwatch.diagnose.lightning_replay import lightning_guards, train_step_context
from gradwatch.diagnose.localize import ROOT, Localization, Localizer, summarize
from gradwatch.observe.tracing import is_compiled

#: Localizing replays per incident at most (suspect micro-batches first).
MAX_REPLAYS = 8

class ReplayResult:
    """What one localization found: the :class:`~gradwatch.diagnose.localize.Localization`, and how it was run."""

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
        #: Loss-code ops that can produce NaN/Inf, when the NaN/Inf came from the loss (see :func:`~gradwatch.diagnose.graph_walk.loss_ops`).
        self.loss_ops: list[str] = []
        #: The op each of ``loss_ops`` took its input from, where one (see :func:`~gradwatch.diagnose.graph_walk.loss_op_inputs`).
        self.loss_inputs: dict[str, str] = {}
        #: The replayed call's observed loss was already non-finite (the loss code's forward made it first).
        self.loss_nonfinite = False
        #: The replayed call ran under autocast in float16.
        self.half = False
        #: The model's weights are float16 (model.half()): its forward ran in float16 without autocast.
        self.half_weights = False
        #: Plain loop: a device flag, whether the forward's output was all finite (None: not known).
        self.output_ok: torch.Tensor | None = None

    @property
    def named(self) -> bool:
        """An op was named as where the NaN/Inf was born."""
        return self.loc.origin is not None

    @property
    def loss_born(self) -> bool:
        """No op was named, the model's forward was finite and the gradient from the loss was not."""
        return self.loc.origin is None and self.upstream_bad and self.loc.forward_finite


# -- state that a replay must not change ------------------------------------------------------------
@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
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
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "_all_gather_base", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "scatter", "scatter_object_list", "send", "recv", "isend",
    "irecv", "batch_isend_irecv",
    # torch.distributed._functional_collectives (torchtitan, DTensor-free tensor parallelism)
    "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd", "all_to_all_single_autograd",
    "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "permute_tensor",
)


class CollectiveInReplay(Exception):
    """A ``torch.distributed`` collective called within a replay (see :func:`no_collectives`)."""


@contextlib.contextmanager
def no_collectives(owner: Any) -> Iterator[None]:
    """Within a replay under an initialized process group of several ranks, every collective of
    ``torch.distributed`` raises :class:`CollectiveInReplay` (its name kept in ``owner.collective``) instead of
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
            owner.collective = owner.collective or name
            raise CollectiveInReplay(name)

        return call

    for module in modules:
        for name in COLLECTIVES:
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
def checkpoint_not_reentrant() -> Iterator[None]:
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

    def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        return cp.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)

    with apply_replaced(cls, apply):
        yield


@contextlib.contextmanager
def apply_replaced(cls: Any, apply: Callable[..., Any]) -> Iterator[None]:
    """``cls.apply`` (an autograd Function's, e.g. ``CheckpointFunction``) is ``apply`` inside; afterwards
    the class's own is put back, or the inherited one shows through again."""
    own = cls.__dict__.get("apply")
    cls.apply = staticmethod(apply)
    try:
        yield
    finally:
        if own is None:
            del cls.apply
        else:
            cls.apply = own


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
    """Inside :func:`preserved` (which puts the user's state back afterwards)."""
    if state is None:
        return
    try:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])
    except Exception as exc:  # noqa: BLE001
        internal_warning("replay random state", exc)


def replay_input(v: Any) -> Any:
    # A private copy: a model that modifies its input in place must not change the user's batch.
    if isinstance(v, torch.Tensor):
        c = v.detach().clone()
        if v.requires_grad and (c.is_floating_point() or c.is_complex()):
            c.requires_grad_(True)
        return c
    return v


@contextlib.contextmanager
def autocast(state: tuple[tuple[str, torch.dtype], ...] | None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device, dtype in state or ():
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def reemit_own_warnings(caught: list[warnings.WarningMessage]) -> None:
    """The replay records warnings process-wide: gradwatch's own ones (e.g. from its TensorBoard writer
    thread, issued meanwhile) are passed on instead of being lost with the replay's anomaly-mode noise."""
    from gradwatch.core.failures import GradWatchInternalWarning, safe_warn_explicit

    for w in caught:
        if issubclass(w.category, GradWatchInternalWarning):
            safe_warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def anomaly_traceback(caught: list[warnings.WarningMessage]) -> str | None:
    for w in caught:
        text = str(w.message)
        if text.startswith("Error detected in"):
            return re.sub(r"\s*\(Triggered internally at .*\)\s*$", "", text, flags=re.DOTALL)
    return None


# -- which calls to replay --------------------------------------------------------------------------
def suspect_calls(calls: Sequence[Call]) -> list[Call]:
    """The calls whose output gradient or loss was non-finite (read now, one read per device), at most
    ``MAX_REPLAYS``."""
    went_bad = nonfinite_flags([c.suspect() for c in calls])
    return [c for c, bad in zip(calls, went_bad) if bad][:MAX_REPLAYS]


def lightning_order(batches: Sequence[Batch]) -> list[Batch]:
    """Lightning batches to replay: those whose loss was non-finite first, then the others, ``MAX_REPLAYS``
    in all (``training_step`` is the only way to replay them)."""
    flags = [all_finite(b.losses) for b in batches]
    first = [b for b, bad in zip(batches, nonfinite_flags(flags)) if bad]
    rest = [b for b in batches if all(b is not f for f in first)]
    return (first + rest)[:MAX_REPLAYS]


def unscreened(calls: Sequence[Call], suspects: Sequence[Call]) -> list[Call]:
    """The held calls (the last ``MAX_GRADS``) that are not suspects: replayed as they are when screening fails."""
    return [c for c in calls[-MAX_GRADS:] if not any(c is s for s in suspects)]


def replay_verdict(result: ReplayResult, stopped: bool) -> str:
    """What a replay's result means for the search: ``"stop"`` (it stopped at a collective before the origin:
    the rest is not known, and the other calls run the same forward), ``"found"`` (it saw the non-finite
    value), or ``"next"`` (finite: try the next call)."""
    if stopped and not result.named:
        return "stop"
    if result.named or result.upstream_bad or not result.loc.forward_finite:
        return "found"
    return "next"


# -- the replays ------------------------------------------------------------------------------------
def replay_model(model: nn.Module) -> nn.Module:
    """The module a replay runs: DDP's inner module (no collectives on this rank alone), a compiled
    model's original module (replayed eagerly: a compiled forward run once under the localizer's dispatch
    mode changes the compiled graph's later numerics by an ulp; the eager module computes the same values)."""
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "DistributedDataParallel":
        model = inner
    orig = getattr(model, "_orig_mod", None)
    if isinstance(orig, nn.Module) and is_compiled(model):
        return orig
    return model


def upstream_state(calls: Sequence[Call]) -> tuple[bool, bool]:
    """(non-finite, available) for the gradient that reached the model's outputs in ``calls``.

    ``available``: the gradients themselves are held (calls folded long ago only kept a flag).
    """
    grads = [g for c in calls for g in c.grads.values() if isinstance(g, torch.Tensor)]
    sums = [v for c in calls for v in c.sums]
    bad = bool(nonfinite_flags([all_finite(sums)])[0]) if sums else False
    if not grads:
        return bad, False
    v = summarize([g for g in grads if g.is_floating_point() or g.is_complex()])
    if v is None:
        return bad, True
    nan, inf = v[:2].tolist()
    return bool(nan or inf or bad), True


def backward_targets(
    leaves: Sequence[Any], grads: dict[int, torch.Tensor] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs to differentiate and the gradient each gets: the one it received (``grads``, by output
    index; outputs that received none did not reach the loss and are left out), or ones (``grads`` None)."""
    targets: list[torch.Tensor] = []
    grad_outputs: list[torch.Tensor] = []
    for i, t in enumerate(leaves):
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            continue
        g = grads.get(i) if grads is not None else None
        if grads is not None and (g is None or g.shape != t.shape):
            continue  # this output did not reach the loss
        targets.append(t)
        grad_outputs.append(g if g is not None else torch.ones_like(t))
    return targets, grad_outputs


def _floating(leaves: Sequence[Any]) -> list[torch.Tensor]:
    return [t for t in leaves if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


Guard = Callable[[], contextlib.AbstractContextManager[Any]]


def screen_call(model: nn.Module, call: Call, guard: Guard) -> bool:
    """Replay one call's forward and backward without localizing: does it turn non-finite?"""
    _bad, available = upstream_state([call])
    with preserved(model), guard(), torch.enable_grad(), autocast(call.autocast):
        args, kwargs = tree_map(replay_input, (call.args, call.kwargs))
        set_rng_state(call.rng)
        leaves = output_leaves(model(*args, **kwargs))
        checks = [torch.isfinite(t).all() for t in _floating(leaves)]
        targets, grad_outputs = backward_targets(leaves, call.grads if available else None)
        wrt = [p for p in model.parameters() if p.requires_grad]
        if targets and wrt:
            grads = torch.autograd.grad(targets, wrt, grad_outputs, allow_unused=True)
            checks += [torch.isfinite(g).all() for g in grads if g is not None]
        return any(nonfinite_flags(checks))


def _localized_forward(loc: Localizer, run: Callable[[], Any]) -> Any:
    loc.start()
    try:
        return run()
    except CollectiveInReplay:
        return None  # what the forward did before the collective is localized; no backward
    finally:
        loc.stop_forward()


def _backward_error(owner: Any, targets: list[torch.Tensor], wrt: list[torch.Tensor], grads: list[torch.Tensor]) -> str | None:
    """Run the replay's backward; the error it raised (anomaly mode's, with check_nan), if any."""
    if not (targets and wrt):
        return None
    try:
        torch.autograd.grad(targets, wrt, grads, allow_unused=True)
    except (RuntimeError, CollectiveInReplay) as exc:
        # A collective in a backward function (an all_reduce in a custom Function) is no error.
        return None if owner.collective is not None else str(exc)
    return None


def _resolved(loc: Localizer) -> Localization:
    try:
        return loc.resolve()
    finally:
        loc.close()


def replay_call(model: nn.Module, call: Call, guard: Guard, owner: Any) -> ReplayResult:
    """Replay one forward call and its backward, localized (``owner.collective``: see :func:`no_collectives`)."""
    upstream_bad, available = upstream_state([call])
    use_real = available and not upstream_bad
    loc = Localizer(model, aten=True)
    loc.replay = True
    with preserved(model), guard(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, check_nan=True), autocast(call.autocast):
            args, kwargs = tree_map(replay_input, (call.args, call.kwargs))
            set_rng_state(call.rng)
            output = _localized_forward(loc, lambda: model(*args, **kwargs))
            leaves = output_leaves(output) if output is not None else []
            output_ok = all_finite([t.detach() for t in _floating(leaves)])
            loc.hook_graph([t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad])
            targets, grad_outputs = backward_targets(leaves, call.grads if use_real else None)
            wrt: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
            wrt += [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
            anomaly_error = _backward_error(owner, targets, wrt, grad_outputs)
        traceback = anomaly_traceback(caught)
    reemit_own_warnings(caught)
    out = ReplayResult(
        _resolved(loc),
        replayed=True,
        surrogate=not use_real,
        upstream_bad=upstream_bad,
        anomaly_error=anomaly_error,
        anomaly_traceback=traceback,
    )
    out.output_ok = output_ok
    return out


def _step_losses(out: Any, losses: list[torch.Tensor]) -> list[torch.Tensor]:
    """The losses of a replayed ``training_step``: the one it returned, then those given to manual_backward."""
    loss = out.get("loss") if isinstance(out, dict) else out
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        losses.insert(0, loss)
    return [l for l in losses if isinstance(l, torch.Tensor) and l.requires_grad]


def replay_lightning(src: Batch, guard: Guard, owner: Any) -> ReplayResult:
    """Run a Lightning batch's ``training_step`` again, localized, with its side effects neutralized."""
    pl_module = src.pl_module
    loc = Localizer(pl_module, root_label=ROOT, aten=True)
    loc.replay = True
    with preserved(pl_module), guard(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, check_nan=True):
            batch = tree_map(replay_input, src.batch)
            set_rng_state(src.rng)
            manual: list[torch.Tensor] = []
            with lightning_guards(pl_module, manual), train_step_context(src.trainer):
                out = _localized_forward(loc, lambda: pl_module.training_step(batch, src.batch_idx))
            losses = _step_losses(out, manual)
            loc.hook_graph(losses)
            wrt = [p for p in pl_module.parameters() if p.requires_grad]
            anomaly_error = _backward_error(owner, losses, wrt, [torch.ones_like(l) for l in losses])
        traceback = anomaly_traceback(caught)
    reemit_own_warnings(caught)
    return ReplayResult(
        _resolved(loc),
        replayed=True,
        surrogate=False,
        upstream_bad=False,
        anomaly_error=anomaly_error,
        anomaly_traceback=traceback,
        lightning=True,
    )
