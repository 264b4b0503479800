"""``bad_backward``: custom ``torch.autograd.Function`` backwards checked against finite differences.

A custom Function whose ``backward`` is wrong makes no NaN and raises nothing: the model only learns worse.
:func:`gradcheck` runs the model's forward once (and the loss code, with ``loss_fn``) to capture every custom
Function it calls (those inside ``torch.utils.checkpoint`` segments too) with the inputs each one received,
then re-runs each Function alone on float64 copies of them: the analytical gradient of ``<v, F(x)>`` (a
random ``v``) from its ``backward`` is compared with one-sided finite differences of its ``forward`` at a few
positions of each input that requires grad. The model, its ``.grad``, its buffers and the random number
generators are left as they were.

The pipeline: *capture* (:func:`_capture`, a temporary wrap of ``Function.apply`` during one forward) ->
*measure* (:func:`_check_call`, facts per input) -> *judge and word* (:func:`_finding`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.function import Function
from torch.utils._pytree import tree_map

from gradwatch.core.findings import Explanation, Finding, panel
from gradwatch.diagnose.localize import ROOT, code_at, source_text
from gradwatch.observe.tracing import library_frame

KIND = "bad_backward"
#: Positions of each input where the numerical gradient is taken (all of a smaller input); each costs two
#: forward calls of the Function alone, so a check takes seconds whatever the input's size.
POSITIONS = 16
#: Finite-difference steps (float64). A position is wrong only if it is wrong at both: an error that is
#: noise of a forward computing in float32 inside shrinks at the larger step, a wrong formula does not.
STEPS = (1e-6, 1e-3)
#: An analytical gradient farther than this (relative to the larger of it and the numerical one) from the
#: numerical one is wrong. Correct backwards are ~1e-7 off in float64; wrong formulas O(1).
RTOL = 1e-2
#: ... plus this fraction of the input's largest gradient (a near-zero gradient beside large ones).
ATOL_FRACTION = 1e-3
#: Distinct custom Function call sites checked per call of :func:`gradcheck`.
MAX_FUNCTIONS = 32
#: Forward calls of a watched step replayed by ``Watcher.gradcheck`` (micro-batches of one update).
MAX_STEP_CALLS = 4

#: Why a Function is not checked, keyed by cause (facts are filled in from the check).
SKIP_REASONS: dict[str, str] = {
    "no_grad_input": "no input required grad where it ran (under no_grad, or on constants): its backward never runs",
    "complex": "complex inputs or outputs are not checked",
    "integer_output": "it returns no floating-point tensor: integer outputs have no gradient",
    "non_differentiable": "every output is marked non-differentiable (ctx.mark_non_differentiable)",
    "not_float64": "its forward returns {dtype} for float64 inputs: finite differences would measure rounding",
    "forward_failed": "its forward fails on float64 copies of its inputs ({error})",
    "backward_failed": "its backward fails on float64 copies of its inputs ({error})",
    "check_failed": "re-running it alone failed ({error})",
    "nonfinite": "its output on these inputs holds NaN/Inf, where no gradient can be compared",
    "identity": (
        "its forward returns its input unchanged (x.view_as(x), x.clone()) and its backward does not: a gradient "
        "modifier by design (gradient reversal, scaling, clipping)"
    ),
    "flat": (
        "its forward is flat in `{name}` where checked (round, sign, a threshold): its backward for `{name}` is a "
        "surrogate (straight-through) gradient by design"
    ),
}


@dataclass
class FunctionCall:
    """One custom Function call of the forward: what it received and where it ran (first call of a site)."""

    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    requires_grad: tuple[bool, ...]  # per positional argument: a tensor that required grad where it ran
    module: str | None
    filename: str | None
    lineno: int | None
    function: str | None
    calls: int = 1

    @property
    def name(self) -> str:
        return self.cls.__name__

    @property
    def source(self) -> str | None:
        return source_text(self.filename, self.lineno, self.function)

    @property
    def code(self) -> str | None:
        return code_at(self.filename, self.lineno)


@dataclass
class InputCheck:
    """The comparison for one input of a Function (facts, no words)."""

    index: int
    name: str
    positions: int
    max_abs_err: float
    max_rel_err: float
    analytical: float  # at the worst position
    numerical: float
    returned_none: bool
    ok: bool
    flat: int = 0  # positions where the forward is exactly flat and the backward is not: surrogate, not compared
    #: The shape of the gradient backward returned, when autograd cannot sum it to the input's (``shape``).
    returned_shape: tuple[int, ...] | None = None
    shape: tuple[int, ...] = ()


@dataclass
class Skipped:
    """A custom Function that was not checked, and why."""

    function: str
    source: str | None
    module: str | None
    reason: str


@dataclass
class GradcheckResult:
    """What :func:`gradcheck` found: ``findings`` (``bad_backward``), the Functions checked and those skipped.

    Renders itself on a rich console (one panel per finding, then a line per skipped Function).
    """

    findings: list[Finding] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No custom Function with a wrong backward."""
        return not self.findings

    def __str__(self) -> str:
        lines = [str(f) for f in self.findings]
        lines.append(self._tally())
        lines += [f"  skipped {s.function} ({s.source or 'unknown line'}): {s.reason}" for s in self.skipped]
        return "\n".join(lines)

    def _tally(self) -> str:
        wrong = len(self.findings)
        return (
            f"gradwatch.gradcheck: {len(self.checked)} custom autograd.Function(s) checked, {wrong} with a wrong "
            f"backward, {len(self.skipped)} skipped."
        )

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.text import Text

        parts: list[Any] = [panel(f, []) for f in self.findings]
        parts.append(Text(self._tally(), style="bold"))
        parts += [Text(f"  skipped {s.function}: {s.reason}", style="dim") for s in self.skipped]
        return Group(*parts)


def gradcheck(
    model: nn.Module,
    *example_inputs: Any,
    loss_fn: Callable[[Any], Any] | None = None,
    forward_kwargs: dict[str, Any] | None = None,
) -> GradcheckResult:
    """Check the backward of every custom ``torch.autograd.Function`` the model's step runs.

    Runs ``model(*example_inputs, **forward_kwargs)`` once (then ``loss_fn(output)``, if given, for Functions
    in the loss code), in the mode the model is in (train or eval), and checks each custom Function it called
    against finite differences, alone, in float64, on the inputs it received there.

    Args:
        model: The model (a ``torch.compile``'d or DDP-wrapped one is run through its eager inner module).
        *example_inputs: A batch, as the training loop passes it to the model.
        loss_fn: Called on the model's output; custom Functions it calls are checked too.
        forward_kwargs: Keyword arguments of the forward call.

    Returns:
        A :class:`GradcheckResult`: ``findings`` of kind ``bad_backward`` (empty when every backward agrees
        with its forward), the names of the Functions checked, and those skipped with the reason.

    Example:
        >>> import torch, gradwatch
        >>> model = torch.nn.Linear(3, 2)
        >>> gradwatch.gradcheck(model, torch.randn(4, 3)).ok  # no custom Function: nothing to check
        True
    """
    return check_model(model, example_inputs, forward_kwargs or {}, loss_fn=loss_fn)


def check_model(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    loss_fn: Callable[[Any], Any] | None = None,
    step: int = 0,
    calls: list[tuple[Any, Any, Any]] | None = None,
) -> GradcheckResult:
    """:func:`gradcheck` on one batch (``args``, ``kwargs``), or on several forward calls of a step
    (``calls``: ``(args, kwargs, rng state)`` each), reporting findings at ``step``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"gradcheck() needs a torch.nn.Module as model, got {type(model).__name__}: {model!r:.80}")
    batches = calls if calls is not None else [(args, kwargs, None)]
    captured = _capture(_eager(model), batches, loss_fn)
    result = GradcheckResult()
    for call in captured:
        try:
            outcome = _check_call(call)
        except Exception as exc:  # noqa: BLE001 - the user's Function misbehaving alone: a reason, not a crash
            outcome = SKIP_REASONS["check_failed"].format(error=_short(exc))
        if isinstance(outcome, str):
            result.skipped.append(Skipped(call.name, call.source, call.module, outcome))
            continue
        result.checked.append(call.name)
        result.skipped += [_flat_input(call, c) for c in outcome if c.positions and c.flat == c.positions]
        if not all(c.ok for c in outcome):
            result.findings.append(_finding(call, outcome, step))
    return result


def _flat_input(call: FunctionCall, check: InputCheck) -> Skipped:
    reason = SKIP_REASONS["flat"].format(name=check.name)
    return Skipped(f"{call.name} (input `{check.name}`)", call.source, call.module, reason)


# -- capture ------------------------------------------------------------------------------------------
def _eager(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
        model = inner
    orig = getattr(model, "_orig_mod", None)
    return orig if isinstance(orig, nn.Module) else model


def _capture(model: nn.Module, batches: list[tuple[Any, Any, Any]], loss_fn: Any) -> list[FunctionCall]:
    """Run the forward (and ``loss_fn``) on each batch; return the first call of each custom Function site."""
    from gradwatch.diagnose.replay import checkpoint_not_reentrant, preserved, replay_input, set_rng_state

    found: dict[tuple[Any, ...], FunctionCall] = {}
    with preserved(model), checkpoint_not_reentrant(), _module_stack(model) as stack, _recording(
        found, stack
    ), torch.enable_grad():
        for args, kwargs, rng in batches:
            args, kwargs = tree_map(replay_input, (tuple(args), dict(kwargs)))
            set_rng_state(rng)
            output = model(*args, **kwargs)
            if loss_fn is not None:
                stack.append(None)  # the loss code runs outside every module
                try:
                    loss_fn(output)
                finally:
                    stack.pop()
            del output
    return list(found.values())


@contextlib.contextmanager
def _module_stack(model: nn.Module) -> Iterator[list[str | None]]:
    """The qualified names of the modules running now (innermost last), kept by temporary hooks."""
    stack: list[str | None] = []
    handles = []

    def enter(name: str) -> Callable[..., None]:
        return lambda _m, _a: stack.append(name)

    def leave(_m: Any, _a: Any, _o: Any) -> None:
        if stack:
            stack.pop()

    try:
        for name, m in model.named_modules():
            handles.append(m.register_forward_pre_hook(enter(name or ROOT)))
            handles.append(m.register_forward_hook(leave, always_call=True))
        yield stack
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _recording(found: dict[tuple[Any, ...], FunctionCall], stack: list[str | None]) -> Iterator[None]:
    """Wrap ``torch.autograd.Function.apply`` (every subclass that does not override it) for this thread."""
    own = Function.__dict__["apply"]
    thread = threading.get_ident()

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread and _is_custom(cls):
            _record(found, stack, cls, args, kwargs)
        return own.__func__(cls, *args, **kwargs)

    Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Function.apply = own  # type: ignore[method-assign]


def _is_custom(cls: type) -> bool:
    """A Function of the user's (or a library's), not one of torch's own (checkpoint, hooks) or gradwatch's."""
    module = getattr(cls, "__module__", "") or ""
    return not module.startswith(("torch.", "gradwatch."))


def _record(found: dict[tuple[Any, ...], FunctionCall], stack: list[str | None], cls: type, args: Any, kw: Any) -> None:
    frame = _caller()
    site = (cls, frame.f_code.co_filename, frame.f_lineno) if frame is not None else (cls, None, None)
    seen = found.get(site)
    if seen is not None:
        seen.calls += 1
        return
    if len(found) >= MAX_FUNCTIONS:
        return
    grad = torch.is_grad_enabled()
    found[site] = FunctionCall(
        cls=cls,
        args=tuple(_held(a) for a in args),
        kwargs={k: _held(v) for k, v in kw.items()},
        requires_grad=tuple(grad and isinstance(a, torch.Tensor) and a.requires_grad for a in args),
        module=stack[-1] if stack else None,
        filename=None if frame is None else frame.f_code.co_filename,
        lineno=None if frame is None else frame.f_lineno,
        function=None if frame is None else frame.f_code.co_name,
    )


def _caller() -> Any:
    f = sys._getframe(2)
    while f is not None and library_frame(f):
        f = f.f_back
    return f


def _held(v: Any) -> Any:
    # A copy: the forward may go on to modify its input in place (ctx.mark_dirty, `out += x` after it).
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


# -- measure ------------------------------------------------------------------------------------------
def _check_call(call: FunctionCall) -> list[InputCheck] | str:
    """Facts per differentiable input, or the reason the Function cannot be checked."""
    wrt = [i for i, r in enumerate(call.requires_grad) if r and call.args[i].is_floating_point()]
    reason = _input_reason(call, wrt)
    if reason is not None:
        return reason
    args = tuple(_float64(a) for a in call.args)
    kwargs = {k: _float64(v) for k, v in call.kwargs.items()}
    with _seeded():
        measured = _measure(call.cls, args, kwargs, wrt)
    if isinstance(measured, str):
        return measured
    checks, outs = measured
    wrong = {c.index for c in checks if not c.ok}
    misshapen = any(c.returned_shape is not None for c in checks)
    if wrong and not misshapen and wrong <= _passed_through(outs, args):
        # A gradient modifier: only the passed-through input's gradient differs. A ReLU fed positive values
        # passes too, and is checked when right; a wrong gradient of another input (a weight at its init of
        # ones, so that x * w == x) is still a wrong backward.
        return SKIP_REASONS["identity"]
    return checks


def _input_reason(call: FunctionCall, wrt: list[int]) -> str | None:
    """Why the recorded inputs cannot be checked (complex, or none differentiable), or None."""
    tensors = [t for t in (*call.args, *call.kwargs.values()) if isinstance(t, torch.Tensor)]
    if any(t.is_complex() for t in tensors):
        return SKIP_REASONS["complex"]
    if not wrt:
        return SKIP_REASONS["no_grad_input"]
    return None


def _measure(
    cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any], wrt: list[int]
) -> tuple[list[InputCheck], list[Any]] | str:
    """Analytic against numerical gradients of each input in ``wrt`` (and the outputs), or why not."""
    try:
        leaves, outs = _analytic_forward(cls, args, kwargs, wrt)
    except Exception as exc:  # noqa: BLE001 - the user's forward: a reason, not a crash
        return SKIP_REASONS["forward_failed"].format(error=_short(exc))
    reason = _output_reason(outs)
    if reason is not None:
        return reason
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    gen = torch.Generator().manual_seed(0)
    v = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in diff]
    try:
        grads: Any = torch.autograd.grad(diff, leaves, v, allow_unused=True)
    except Exception as exc:  # noqa: BLE001
        # A gradient of a shape autograd cannot sum to its input's ("invalid gradient at index 1 - got [4] but
        # expected shape compatible with [8]") is a wrong backward, not a reason to skip: ask backward itself.
        grads = _returned_grads(cls, args, kwargs, wrt, v)
        if grads is None or not any(_misshapen(args[i], g) for i, g in zip(wrt, grads)):
            return SKIP_REASONS["backward_failed"].format(error=_short(exc))
    probe = _Probe(cls, args, kwargs, [i for i, o in enumerate(outs) if any(o is d for d in diff)], v)
    names = _input_names(cls, len(args))
    return [_check_returned(probe, i, names[i], g, gen) for i, g in zip(wrt, grads)], outs


def _returned_grads(
    cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any], wrt: list[int], v: list[Any]
) -> list[Any] | None:
    """What the Function's backward returns for each input in ``wrt``, as it returns it: its node called
    directly on a fresh forward (the same random numbers), without autograd's checks of the result. None when
    that cannot be done."""
    try:
        with _seeded():
            _leaves, outs = _analytic_forward(cls, args, kwargs, wrt)
        diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        node = diff[0].grad_fn
        if getattr(node, "_forward_cls", None) is not cls:
            return None
        given = iter(v)
        grad_outputs = [
            next(given) if any(o is d for d in diff) else torch.zeros_like(o) if isinstance(o, torch.Tensor) else None
            for o in outs
        ]
        with torch.no_grad(), _seeded():
            returned = node.apply(*grad_outputs)
    except Exception:  # noqa: BLE001 - the user's Function: then it is skipped, as before
        return None
    returned = tuple(returned) if isinstance(returned, (tuple, list)) else (returned,)
    return [returned[i] if i < len(returned) else None for i in wrt]


def _sums_to(shape: tuple[int, ...], grad_shape: tuple[int, ...]) -> bool:
    """Whether autograd takes a gradient of ``grad_shape`` for an input of ``shape``: the same shape, or one
    the input broadcasts to (it sums the gradient back over the broadcast dimensions)."""
    if len(shape) > len(grad_shape):
        return False
    return all(s in (g, 1) for s, g in zip(reversed(shape), reversed(grad_shape)))


def _misshapen(x: Any, grad: Any) -> bool:
    return isinstance(grad, torch.Tensor) and not _sums_to(tuple(x.shape), tuple(grad.shape))


def _check_returned(probe: _Probe, i: int, name: str, grad: Any, gen: torch.Generator) -> InputCheck:
    """:func:`_check_input`, or the facts of a gradient whose shape autograd rejects."""
    x = probe.args[i]
    if _misshapen(x, grad):
        nan = math.nan
        return InputCheck(i, name, 0, nan, nan, nan, nan, returned_none=False, ok=False,
                          returned_shape=tuple(grad.shape), shape=tuple(x.shape))
    if isinstance(grad, torch.Tensor) and (grad.shape != x.shape or grad.dtype != x.dtype):
        grad = grad.sum_to_size(x.shape).to(x.dtype)  # what autograd does with it
    return _check_input(probe, i, name, grad, gen)


def _analytic_forward(cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any], wrt: list[int]) -> tuple[Any, Any]:
    leaves = [args[i].clone().requires_grad_(True) for i in wrt]
    inputs = list(_fresh(args))
    for i, leaf in zip(wrt, leaves):
        inputs[i] = leaf.clone()  # not the leaf itself: a Function may modify its input in place
    with torch.enable_grad():
        out = cls.apply(*inputs, **_fresh(kwargs))
    return leaves, (list(out) if isinstance(out, (tuple, list)) else [out])


def _output_reason(outs: list[Any]) -> str | None:
    floats = [o for o in outs if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())]
    if any(o.is_complex() for o in floats):
        return SKIP_REASONS["complex"]
    if not floats:
        return SKIP_REASONS["integer_output"]
    diff = [o for o in floats if o.requires_grad]
    if not diff:
        return SKIP_REASONS["non_differentiable"]
    other = next((o.dtype for o in diff if o.dtype != torch.float64), None)
    if other is not None:
        return SKIP_REASONS["not_float64"].format(dtype=str(other).replace("torch.", ""))
    if not all(bool(torch.isfinite(o).all()) for o in diff):
        return SKIP_REASONS["nonfinite"]
    return None


def _passed_through(outs: list[Any], args: tuple[Any, ...]) -> set[int]:
    """The indices of the inputs the Function passes through when every differentiable output equals an input
    (gradient reversal's ``x.view_as(x)``); empty when some output is computed."""
    diff = [o.detach() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    equal = [{i for i, a in inputs if a.shape == o.shape and torch.equal(a, o)} for o in diff]
    return set().union(*equal) if equal and all(equal) else set()


class _Probe:
    """``<v, F(x + delta * e_j) - F(x)>`` for one input position, with the Function alone (no graph)."""

    def __init__(self, cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out_index: list[int], v: list[Any]):
        self.cls, self.args, self.kwargs, self.out_index, self.v = cls, args, kwargs, out_index, v
        self.base = self._outputs(_fresh(args))

    def _outputs(self, args: tuple[Any, ...]) -> list[torch.Tensor]:
        with torch.no_grad(), _seeded():
            out = self.cls.apply(*args, **_fresh(self.kwargs))
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        return [out[i] for i in self.out_index]

    def __call__(self, i: int, j: int, delta: float) -> float:
        args = _fresh(self.args)  # contiguous copies (see _float64): view(-1) writes into the tensor itself
        args[i].view(-1)[j] += delta
        outs = self._outputs(args)
        return float(sum(torch.dot((o - b).reshape(-1), v.reshape(-1)) for o, b, v in zip(outs, self.base, self.v)))


def _check_input(probe: _Probe, i: int, name: str, grad: torch.Tensor | None, gen: torch.Generator) -> InputCheck:
    x = probe.args[i]
    analytic = torch.zeros_like(x) if grad is None else grad.detach()
    flat = analytic.reshape(-1)
    positions = _positions(flat, gen)
    if not positions:  # an empty input
        return InputCheck(i, name, 0, 0.0, 0.0, 0.0, 0.0, returned_none=grad is None, ok=True)
    a = [float(flat[j]) for j in positions]
    errs = [_error(probe, i, j, aj, STEPS[0]) for j, aj in zip(positions, a)]
    ref = max((e[1] for e in errs), default=0.0)
    rows = []
    for j, aj, first in zip(positions, a, errs):
        worst = first if _bad(first, ref) else None
        if worst is not None:
            worst = min(first, _error(probe, i, j, aj, STEPS[1]))
        rows.append((worst or first, worst is not None and _bad(worst, ref), aj))
    top = max(rows, key=lambda r: (r[1], r[0][0]))
    return InputCheck(
        index=i,
        name=name,
        positions=len(positions),
        max_abs_err=max(r[0][0] for r in rows),
        max_rel_err=max(_rel(r[0][0], r[0][1]) for r in rows),
        analytical=top[2],
        numerical=top[0][2],
        returned_none=grad is None,
        ok=not any(r[1] for r in rows),
        flat=sum(1 for r in rows if r[0][3]),
    )


def _bad(err: tuple[float, float, float, bool], ref: float) -> bool:
    return err[0] > RTOL * err[1] + ATOL_FRACTION * ref + 1e-12


def _error(probe: _Probe, i: int, j: int, a: float, eps: float) -> tuple[float, float, float, bool]:
    """(distance of ``a`` from the one-sided finite differences' interval, scale, central difference, flat).

    The interval, not the central difference alone: at a kink (relu at 0, max with ties) the two one-sided
    derivatives differ and a correct backward may return either, or anything between. Where the forward is
    exactly flat on both sides and the backward is not (a straight-through estimator: round, sign, a clamp
    passed through) the backward is a surrogate by design: ``flat``, no error."""
    step = eps * max(1.0, abs(float(probe.args[i].reshape(-1)[j])))  # relative to a large |x|: above rounding
    up = probe(i, j, step) / step
    down = -probe(i, j, -step) / step
    lo, hi = min(up, down), max(up, down)
    central = (up + down) / 2
    if not (_finite(up) and _finite(down)):
        return 0.0, 0.0, central, False  # the forward leaves its domain here: no comparison
    if not _finite(a):
        return float("inf"), max(abs(lo), abs(hi)), central, False
    if up == 0.0 and down == 0.0 and a != 0.0:
        return 0.0, 0.0, central, True
    return max(lo - a, a - hi, 0.0), max(abs(a), abs(lo), abs(hi)), central, False


def _positions(flat: torch.Tensor, gen: torch.Generator) -> list[int]:
    n = flat.numel()
    if n <= POSITIONS:
        return list(range(n))
    picked = {int(flat.abs().nan_to_num(0.0).argmax())}  # where the analytical gradient is largest
    for j in torch.randint(0, n, (4 * POSITIONS,), generator=gen).tolist():
        if len(picked) >= POSITIONS:
            break
        picked.add(int(j))
    return sorted(picked)


def _input_names(cls: Any, count: int) -> list[str]:
    """The forward's parameter names for positional arguments (``ctx`` left out), ``input i`` beyond them."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    if params and not _has_setup_context(cls):
        params = params[1:]  # ctx
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else f"input {i}" for i in range(count)]


def _has_setup_context(cls: Any) -> bool:
    """A Function in the ``forward(*inputs)`` + ``setup_context(ctx, inputs, output)`` style (no ctx in forward)."""
    return any("setup_context" in vars(c) for c in cls.__mro__ if not c.__module__.startswith("torch"))


def _float64(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.to(torch.float64).contiguous()
    return v


def _fresh(v: Any) -> Any:
    """New copies of the tensors for every evaluation: a Function may write into its inputs."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, v)


@contextlib.contextmanager
def _seeded() -> Iterator[None]:
    """The same random numbers for every evaluation (a dropout inside the Function draws one mask)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def _finite(x: float) -> bool:
    return math.isfinite(x)


def _rel(err: float, scale: float) -> float:
    if err == 0.0:
        return 0.0
    return err / scale if scale > 0 else float("inf")


def _short(exc: BaseException) -> str:
    text = str(exc).strip().split("\n", 1)[0]
    return f"{type(exc).__name__}: {text[:160]}"


# -- words --------------------------------------------------------------------------------------------
def _finding(call: FunctionCall, checks: list[InputCheck], step: int) -> Finding:
    wrong = [c for c in checks if not c.ok]
    cause = "shape" if all(c.returned_shape is not None for c in wrong) else "values"
    name = call.name
    inputs = ", ".join(f"`{c.name}` (argument {c.index})" for c in wrong)
    facts = " ".join(_input_facts(c) for c in wrong)
    where = f" in module {call.module}" if call.module not in (None, ROOT) else ""
    line = f"\n    {call.source}" + (f"\n      {call.code}" if call.code else "") if call.source else ""
    more = f" (it ran {call.calls} times from this line; the first call was checked)" if call.calls > 1 else ""
    explanation = Explanation(
        # The facts, and why a wrong backward matters, follow the first line unlabelled.
        what=f"{name}.backward {_WRONG[cause]} {inputs}{where}{more}.{line}\n{facts} {_WHY[cause]}",
        fix=_FIX[cause].format(name=name),
    )
    return Finding(
        kind=KIND,
        step=step,
        severity="error",
        explanation=explanation,
        module=call.module,
        op=f"{name}Backward",
        data={
            "function": f"{call.cls.__module__}.{call.cls.__qualname__}",
            "source": call.source,
            "code": call.code,
            "calls": call.calls,
            "wrong_inputs": [c.name for c in wrong],
            "wrong_shapes": [
                {"input": c.name, "index": c.index, "expected": list(c.shape), "returned": list(c.returned_shape)}
                for c in wrong
                if c.returned_shape is not None
            ],
            "table": [_row(c) for c in checks],
        },
    )


#: The words of a wrong backward, by cause: wrong values (checked against finite differences of forward) or,
#: for every wrong input, a gradient of a shape autograd rejects.
_WRONG = {
    "values": "returns a wrong gradient for",
    "shape": "returns a gradient of the wrong shape for",
}
_WHY = {
    "values": (
        "A wrong backward raises nothing and makes no NaN: the optimizer follows a wrong gradient, and the model "
        "learns worse or not at all."
    ),
    "shape": "Training stops at the first backward through it with that error.",
}
_FIX = {
    "values": (
        "derive {name}.backward again from forward: it returns, for each forward input in order, grad_output "
        "times the derivative of the output with respect to that input (for x ** 3: grad_output * 3 * x ** 2), "
        "and None only for inputs that need no gradient. Check it again with gradwatch.gradcheck(model, batch)."
    ),
    "shape": (
        "make {name}.backward return, for each forward input in order, a gradient of that input's shape: sum it "
        "over the dimensions forward broadcast the input along (grad_output * x summed over the batch for a "
        "per-feature weight: (grad_output * x).sum(0)), and do not slice, reshape or transpose it to another "
        "shape. Check it again with gradwatch.gradcheck(model, batch)."
    ),
}


def _input_facts(c: InputCheck) -> str:
    if c.returned_shape is not None:
        return (
            f"For `{c.name}` (argument {c.index}, shape {list(c.shape)}) it returns a gradient of shape "
            f"{list(c.returned_shape)}, which autograd cannot sum to {list(c.shape)}: it raises \"invalid "
            f"gradient ... got {list(c.returned_shape)} but expected shape compatible with {list(c.shape)}\"."
        )
    if c.returned_none:
        return (
            f"For `{c.name}` it returns None (a zero gradient) where the forward's derivative is "
            f"{c.numerical:.3g}."
        )
    return (
        f"For `{c.name}`, at the worst of {c.positions} positions, backward gives {c.analytical:.3g} where "
        f"finite differences give {c.numerical:.3g} (largest absolute error {c.max_abs_err:.3g}, relative "
        f"{c.max_rel_err:.3g})."
    )


def _row(c: InputCheck) -> dict[str, Any]:
    if c.returned_shape is not None:  # nothing compared: the shape alone is wrong
        shape = f"NO: shape {list(c.returned_shape)}, not {list(c.shape)}"
        return {"input": c.name, "ok": shape, "positions": 0, "max_abs_err": None, "max_rel_err": None,
                "backward": None, "numerical": None}
    return {
        "input": c.name,
        "ok": "yes" if c.ok else "NO",
        "positions": c.positions,
        "max_abs_err": c.max_abs_err,
        "max_rel_err": c.max_rel_err,
        "backward": c.analytical,
        "numerical": c.numerical,
    }


__all__ = ["KIND", "SKIP_REASONS", "GradcheckResult", "Skipped", "gradcheck"]
