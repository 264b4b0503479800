"""Observe: fused per-step gradient statistics with a single device-to-host sync.

Per-parameter gradient norms come from ``torch._foreach_norm`` (float32 accumulation, grouped by device
and dtype), every device value the step needs (norms, observed losses, extension scalars) is put into one
vector, and that vector is read back once. Everything else is Python arithmetic on floats.
"""

from __future__ import annotations

import functools
import math
import operator
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypedDict

import torch

_HAS_FOREACH_NORM = hasattr(torch, "_foreach_norm")


@dataclass
class StepStats:
    """What one optimizer step looked like, as plain Python values.

    Attributes:
        step: Index of the optimizer step (steps completed before it).
        optimizer_index: Which watched optimizer.
        names: Qualified names of the parameters that hold a gradient, in optimizer order.
        modules: Owning module of each of those parameters (None when the model does not own it).
        norms: L2 norm of each of those gradients (float32 accumulation).
        total_norm: L2 norm over all of them.
        layer_norms: L2 norm per owning module (only with ``per_layer``).
        none_grad: Trainable parameters of the optimizer whose ``.grad`` is None.
        nonfinite: Parameters whose gradient holds NaN or Inf (confirmed element-wise).
        nan_counts: NaN elements per parameter in ``nonfinite``.
        inf_counts: Inf elements per parameter in ``nonfinite``.
        overflow_norm: Parameters whose gradient is finite but whose norm overflows float32.
        loss: Mean of the losses observed since the previous step, if any.
        loss_nonfinite: Whether any observed loss was NaN or Inf.
        not_in_optimizer: Trainable model parameters no watched optimizer updates.
        params_changed: The model's or optimizer's parameter set changed since the previous check.
        foreign: Parameters the optimizer holds that the model does not own.
        extra: Values that the engine, extensions and checks add (AMP scale, clip ratio, rank flags, ...):
            every key is declared in :data:`StepExtra`.
    """

    step: int
    optimizer_index: int = 0
    names: list[str] = field(default_factory=list)
    modules: list[str | None] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    total_norm: float = 0.0
    layer_norms: dict[str, float] = field(default_factory=dict)
    none_grad: tuple[str, ...] = ()
    nonfinite: tuple[str, ...] = ()
    nan_counts: dict[str, int] = field(default_factory=dict)
    inf_counts: dict[str, int] = field(default_factory=dict)
    overflow_norm: tuple[str, ...] = ()
    loss: float | None = None
    loss_nonfinite: bool = False
    not_in_optimizer: tuple[str, ...] = ()
    params_changed: bool = False
    foreign: tuple[str, ...] = ()
    first_check: bool = False
    extra: StepExtra = field(default_factory=dict)  # type: ignore[assignment]

    @property
    def has_grads(self) -> bool:
        return bool(self.names)

    @property
    def is_nonfinite(self) -> bool:
        """True when the update would be non-finite (NaN/Inf gradient or loss)."""
        return bool(self.nonfinite) or self.loss_nonfinite


class ZeroGradFacts(TypedDict, total=False):
    """``stats.extra["zero_grad"]``: what :class:`gradwatch.observe.zero_grad.ZeroGradTracker` saw of one optimizer's
    gradients since its previous check, for the checks in :mod:`gradwatch.checks.zero_grad` (a plain dict at
    run time). The tracker writes the first ten keys at every check, the others only when they hold."""

    optimizer: int  # index of the watched optimizer
    param: str | None  # the representative parameter (None: none picked)
    backward_passes: int  # backward passes that reached it since the previous check
    kept_passes: int  # of those, the passes the step's gradient still holds
    state: str  # "fresh", "accumulated", "pending" (before the sync) or "unknown"
    previous_step: int | None  # the step of the previous check
    has_optimizer: bool
    lightning_automatic: bool  # Lightning's automatic optimization clears the gradients itself
    lightning: bool
    last_backward_grad: bool  # the step's gradient is the one the latest backward pass wrote
    spans_other_step: bool  # it holds passes from before another optimizer's step
    changed_after_backward: bool  # modified in place after the last backward pass
    model_grad_replaced: bool  # a model parameter's gradient was set to None or replaced
    sentinel_cleared: bool  # the second, hook-less parameter's gradient was set to None or replaced
    kept_params: tuple[str, ...]  # after a partial zero_grad(): the parameters that accumulated
    cleared_params: tuple[str, ...]  # ... and those that were cleared


#: ``stats.extra``: what the engine, the extensions and the checks add to a step's statistics (a plain dict at
#: run time). Every key set or read anywhere in gradwatch is declared here (``tests/test_step_extra.py`` scans
#: the source); keys with a ``/`` are notes a check leaves for its own ``remember``.
StepExtra = TypedDict(
    "StepExtra",
    {
        # -- the engine (core/engine.py, core/loss_ledger.py, core/explain.py) --
        "params": "list[torch.Tensor]",  # the parameters holding a gradient, aligned with ``names``
        "lookup_layers": "frozenset[str]",  # embedding-like modules (rows read by lookup): never vanishing
        "optimizer": "torch.optim.Optimizer | None",  # the optimizer of this step (None: optimizer-less use)
        "unregistered": "list[tuple[str, str]]",  # (name, how) of trainable tensors the model never registered
        "member_of": Any,  # ParamIndex.member_of: the ModuleList/ModuleDict element of a parameter (none_grad)
        "frozen_param_updated/moved": "tuple[str, ...]",  # frozen_update: the frozen parameters the step moves
        "grad_dropped": "frozenset[str]",  # parameters the graph reached whose gradient the code set to None
        "grad_blocked": "dict[str, tuple[str, str]]",  # parameters a custom Function's backward gave None: its node
        "grad_blocked_pending": "frozenset[str]",  # parameters reached only through a custom Function, watched
        "several_optimizers": bool,  # more than one watched optimizer
        "cleared_between_backwards": bool,  # zero_grad() ran between two backward passes of this step
        "backward_passes": "tuple[int, int]",  # (backward passes of this step, those that found grads cleared)
        "stale_unused": int,  # of ``stale_losses``, the last ones never backpropagated (left out by the loop)
        "stale_losses": "list[float]",  # losses of batches whose gradients no update took, read with this step
        "raised": str,  # the exception class when the incident comes from an exception, not a check
        "anomaly_nan": bool,  # anomaly mode stopped backward on a loss already NaN/Inf (replayable)
        "closure_step": bool,  # checked inside the closure of a step(closure) (LBFGS)
        # -- observers (observe/) --
        "zero_grad": ZeroGradFacts,  # the zero-grad tracker's facts of this step
        "zero_grad_missing": bool,  # gradients accumulated across steps: zero_grad() was not called
        "grads_cleared_before_step": bool,  # the gradients were cleared between backward and step
        "scaler_dropped": "tuple[int, int]",  # (first step, hidden overflows): a GradScaler dropped steps
        "amp": "dict[str, Any]",  # a GradScaler's overflow streak (steps, first step, scales, consecutive)
        "grad_scale": float,  # the GradScaler's scale at this step
        "amp_overflow_step": bool,  # this step is a GradScaler overflow (dropped by the scaler)
        "amp_dropped_here": bool,  # the scaler dropped this step on this rank
        "clipping": "dict[str, Any]",  # how the run clips: {"lightning", "how", "clip_val", ...}
        "clip_ratio": float,  # clipped over unclipped total norm of this step
        "params_trainable": bool,  # every parameter in "params" requires grad (read before the norms)
        "scaler_bypassed": "dict[str, Any]",  # optimizer.step() ran directly on a GradScaler's scaled gradients
        "unscaled_by": float,  # plain loops: the GradScaler's scale its unscale_ divided this step's gradients by
        "param_norms": "dict[str, float]",  # weight norm per layer (measured on some steps)
        "update_ratio": "dict[str, float]",  # update-to-weight norm ratio per layer
        "update_ratio_total": float,  # the ratio over the whole model
        "update_ratio_total/weights": float,  # the whole model's weight norm behind ``update_ratio_total``
        "update_nonfinite": bool,  # a float16 update rounds to NaN/Inf (the optimizer's eps underflows)
        "update_nonfinite_eps": float,  # that eps
        "update_nonfinite_params": "list[str]",  # the parameters whose update would be NaN/Inf (half_update)
        "lr_collapsed": bool,  # lr_collapsed: reported at this step
        "scaler_step_bypassed": bool,  # scaler_step_bypassed: reported at this step
        "clip_before_unscale": bool,  # clip_before_unscale: reported at this step
        "scalars": "dict[str, float]",  # more TensorBoard scalars of this step, by tag
        "ddp": bool,  # the model is wrapped in DistributedDataParallel
        "unused_expected": bool,  # DDP's find_unused_parameters: parameters without gradient are expected
        "sharded": bool,  # gradients are this rank's shards (FSDP): element counts are local
        "nonfinite_ranks": "list[int]",  # the ranks whose step is non-finite
        "any_rank_nonfinite": bool,  # another rank's step is non-finite
        "rank_reports": "list[dict[str, Any]]",  # what each rank saw at the incident (rank zero's report)
        # -- diagnosis (diagnose/escalation.py) --
        "loss_dtype": str,  # "float16" when the loss itself is half precision
        "reentrant_cut": Any,  # Escalation.reentrant_cut: reentrant checkpoints that cut the graph
        "step_inputs": "tuple[int, bool, frozenset[int]]",  # (model inputs, input requires grad, batch sizes)
        # -- checks' notes (checks/) --
        "none_grad_report": "tuple[Any, Any]",  # none_grad: (fresh, waiting) parameters, for remember
        "grads_span_other_step": bool,  # zero_grad: the gradients hold passes from before another step
        "accumulation_remainder": Any,  # accumulation_remainder: the window state, for remember
        "foreign_params/shown": bool,  # not_in_optimizer: foreign parameters reported (once per optimizer)
        "weight_decay_too_large/settings": "list[tuple[object, object]]",  # weight_decay: each group's (lr, wd)
        "loss_spike/record": float,  # loss_spike: the size of the spike reported
        "loss_spike/pending": str,  # loss_spike: "new" or "reported"
        "loss_spike/started": Any,  # loss_spike: where the jump of a spike waiting to fall back started
        "exploding/applied": "dict[str, Any]",  # exploding: the exploding update applied (step, factor, lr)
        "exploding/param_norms": Any,  # exploding: the latest weight-norm measurement
        "exploding/want_param_norms": bool,  # exploding: measure the weights at the next step
        "exploding/pending": str,  # exploding: "new" or "reported"
        "exploding/started": Any,  # exploding: where the jump of a spike waiting to fall back started
        "exploding_grad/record": float,  # exploding: the excess reported
        "exploding/explosion": Any,  # exploding: the facts of the finding made at this step (worded again, held)
    },
    total=False,
)

#: ``stats.extra`` keys made per optimizer index (``template.format(i)``): notes a TypedDict cannot name.
STEP_EXTRA_TEMPLATES: tuple[str, ...] = (
    "lr_too_high/{}",  # early_update: reported for optimizer i (once)
    "weight_decay_too_large/{}",  # weight_decay: reported for optimizer i (once)
)


class SyncBatch:
    """Collects device scalars/vectors and reads them all back with one ``tolist()``.

    Example:
        >>> b = SyncBatch()
        >>> slot = b.add(torch.tensor([1.0, 2.0]))
        >>> b.resolve()[slot]
        [1.0, 2.0]
    """

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._sizes: list[int] = []
        self._values: list[list[float]] | None = None
        self._flat: torch.Tensor | None = None
        self._host: tuple[torch.Tensor, Any] | None = None

    def add(self, t: torch.Tensor) -> int:
        """Queue a tensor (any shape; read back flattened as float32). Returns its slot."""
        if not (t.dtype is torch.float32 and t.dim() == 1 and not t.requires_grad):  # else already flat
            t = t.detach()
            if t.is_complex():
                t = t.abs()
            t = t.reshape(-1).to(torch.float32)
        self._parts.append(t)
        self._sizes.append(t.numel())
        return len(self._parts) - 1

    def part(self, slot: int) -> torch.Tensor:
        """The queued (flattened float32) tensor of ``slot``, still on its device (no sync)."""
        return self._parts[slot]

    def stage(self) -> torch.Tensor | None:
        """Concatenate everything on one device without syncing (for deferred reads and all-reduce)."""
        if self._flat is None and self._parts:
            if len(self._parts) == 1:  # the usual step without observed losses: nothing to move or join
                self._flat = self._parts[0]
                return self._flat
            device = self._parts[0].device
            parts = [p if p.device == device else p.to(device, non_blocking=True) for p in self._parts]
            self._flat = torch.cat(parts)
        return self._flat

    def replace_flat(self, flat: torch.Tensor) -> None:
        """Swap in a processed (e.g. all-reduced) copy of :meth:`stage`'s vector."""
        self._flat = flat
        self._host = None

    def start_read(self) -> None:
        """Start copying the staged vector to the host without blocking (deferred reads).

        On CUDA the copy goes into pinned memory behind an event, so a later :meth:`resolve` waits only
        for this batch's kernels (long finished by the next step) and makes no stream synchronisation.
        """
        flat = self.stage()
        if flat is not None and flat.is_cuda and self._values is None:
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._host = (host, event)

    def resolve(self) -> list[list[float]]:
        """The one sync: every queued tensor's values, by slot."""
        if self._values is None:
            host = self._host
            if host is not None:
                host[1].synchronize()
                flat = host[0]
            else:
                flat = self.stage()
            values: list[float] = flat.tolist() if flat is not None else []
            if len(self._sizes) == 1 and len(values) == self._sizes[0]:
                self._values = [values]  # one slot holds it all (a fresh list: no copy needed)
                return self._values
            out: list[list[float]] = []
            pos = 0
            for n in self._sizes:
                out.append(values[pos : pos + n])
                pos += n
            self._values = out
        return self._values


def queue_grad_norms(batch: SyncBatch, grads: list[torch.Tensor]) -> list[tuple[int, list[int]]]:
    """Queue per-gradient L2 norms into ``batch``; returns ``(slot, positions)`` pairs to read them back.

    Dense floating gradients go through one fused ``_foreach_norm`` per (device, dtype) with float32
    accumulation (fp16/bf16 gradients cannot overflow the norm; float64 ones keep float64). Sparse,
    complex and integer gradients take a per-tensor path. Meta tensors have no values and are left out (their norm reads as 0).
    """
    grads = local_shards(grads)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    odd: list[int] = []
    strided = torch.strided
    for i, g in enumerate(grads):
        if g.is_meta:
            continue
        dtype = g.dtype  # ``dtype.is_floating_point`` is an attribute: cheaper than a method call per step
        if g.layout is strided and dtype.is_floating_point and _HAS_FOREACH_NORM:
            groups[(g.device, dtype)].append(i)
        else:
            odd.append(i)
    slots: list[tuple[int, list[int]]] = []
    for (_device, dtype), idx in groups.items():
        slots.append((batch.add(_fused_norms([grads[i] for i in idx], dtype)), idx))
    for i in odd:
        g = grads[i]
        if g.is_sparse:
            g = g.coalesce().values()
        if not (g.is_floating_point() or g.is_complex()):
            g = g.float()
        slots.append((batch.add(torch.linalg.vector_norm(g).float()), [i]))
    return slots


_BITS: dict[torch.dtype, int] = {}


def _fused_norms(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor L2 norms in one fused call, as one float32 vector: accumulated in float32 for half,
    bfloat16 and float32 gradients (a half-precision norm would overflow), in their own precision for
    wider ones (float64: asking the kernel for float32 would be a narrowing it refuses)."""
    bits = _BITS.get(dtype)
    if bits is None:
        bits = _BITS[dtype] = torch.finfo(dtype).bits  # an object per call otherwise: this runs every step
    if bits <= 32:
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return torch.stack(torch._foreach_norm(tensors, 2)).float()


#: On the CPU, a float32 gradient of at least this many elements gets its sum of squares from a BLAS dot
#: product, which runs on the intra-op threads at memory speed; ``_foreach_norm`` runs one reduction kernel
#: per tensor, slower on large ones (see docs/performance.md).
DOT_MIN_NUMEL = 1 << 16
#: On the CPU, float32 gradients of at most this many elements that share a shape (biases, norm layers' weights)
#: are stacked and reduced row by row in two kernels: the fused call spends more on each small tensor than on
#: its values. Gradients between the two sizes, and any other, stay in the fused call.
GROUP_MAX_NUMEL = 4096


class NormPlan(NamedTuple):
    """How :func:`queue_all_norms` reads one optimizer's gradient norms (made once per parameter list)."""

    params: list[torch.Tensor]
    uniform: bool  # one device, one floating dtype: the fast path applies
    order: list[int]  # the positions of the norms read back: every gradient, in order
    dtype: torch.dtype | None
    large: list[int]  # by dot product (CPU float32)
    groups: list[tuple[list[int], tuple[int, ...]]]  # stacked, one group per shape, and its norm's dims (CPU float32)
    rest: list[int]  # by the fused call, when ``large`` or ``groups`` is not empty
    back: torch.Tensor | None  # where each gradient's norm is in what the split computes; None: in order

    @property
    def split(self) -> bool:
        return bool(self.large or self.groups)


def queue_all_norms(batch: SyncBatch, op: Any, grads: list[torch.Tensor]) -> list[tuple[int, list[int]]] | None:
    """Fast path of :func:`queue_grad_norms` for the usual step: every gradient of optimizer ``op`` present.

    When the optimizer's parameters share one device and floating dtype (a gradient always has its
    parameter's), all norms come from one fused call with no per-gradient Python work (on the CPU, float32
    gradients are split by size: see :data:`DOT_MIN_NUMEL` and :data:`GROUP_MAX_NUMEL`). Returns None when
    that does not apply (mixed devices or dtypes, sparse or sharded gradients): use the general path.
    """
    plan = getattr(op, "_norm_plan", None)
    if plan is None or plan.params is not op.params:
        plan = op._norm_plan = plan_norms(op.params)
    if not plan.uniform:
        return None
    if plan.split:
        try:
            return [(batch.add(_split_norms(grads, plan)), plan.order)]
        except (RuntimeError, NotImplementedError, TypeError):
            # A gradient with no flat view (not contiguous: a channels_last convolution's, a transposed copy) or
            # a sparse one: this optimizer's norms come from the fused call from now on.
            plan = op._norm_plan = plan._replace(large=[], groups=[], rest=[], back=None)
    try:
        # Raises for what the fused kernel cannot take (a sparse gradient of nn.Embedding(sparse=True),
        # parameters moved to different devices or dtypes after the plan was made).
        stacked = _fused_norms(grads, plan.dtype)
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return [(batch.add(stacked), plan.order)]


def plan_norms(params: list[torch.Tensor]) -> NormPlan:
    """The :class:`NormPlan` of an optimizer's parameters (a gradient has its parameter's shape and dtype)."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(dtensor_module, "DTensor", None) if dtensor_module is not None else None
    uniform = (
        _HAS_FOREACH_NORM
        and bool(params)
        and len({(p.device, p.dtype) for p in params}) == 1
        and params[0].dtype.is_floating_point
        and not params[0].is_meta
        and not (dtensor is not None and any(isinstance(p, dtensor) for p in params))  # sharded: general path
    )
    dtype = params[0].dtype if params else None
    order = list(range(len(params)))
    if not (uniform and dtype is torch.float32 and params[0].device.type == "cpu"):
        return NormPlan(params, uniform, order, dtype, [], [], [], None)
    large = [i for i, p in enumerate(params) if p.numel() >= DOT_MIN_NUMEL]
    by_shape: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        if 0 < p.numel() <= GROUP_MAX_NUMEL and p.dim() > 0:  # a 0-d one: no dimension to take the norm over
            by_shape[tuple(p.shape)].append(i)
    groups = [(idx, tuple(range(1, len(shape) + 1))) for shape, idx in by_shape.items() if len(idx) > 1]
    chosen = set(large).union(*(idx for idx, _dims in groups))
    rest = [i for i in order if i not in chosen]
    computed = large + [i for idx, _dims in groups for i in idx] + rest
    back = None if computed == order else torch.tensor(sorted(order, key=computed.__getitem__))
    return NormPlan(params, uniform, order, dtype, large, groups, rest, back)


def _split_norms(grads: list[torch.Tensor], plan: NormPlan) -> torch.Tensor:
    """Norms of the large gradients (BLAS dot products), then of each group of small ones of one shape (stacked,
    one norm per row), then of the rest (fused), as one float32 vector in the order of ``grads``.

    All are float32 sums of squares, as the fused kernel's: a norm past float32's range reads as inf, and
    NaN/Inf elements give a non-finite norm, in every part alike.
    """
    parts = []
    take = grads.__getitem__
    if plan.large:
        views = list(map(_FLAT, map(take, plan.large)))  # C loops: this runs every step
        parts.append(torch.stack(list(map(torch.dot, views, views))).sqrt_())
    for idx, dims in plan.groups:  # a norm over every dimension but the stacking one: one per gradient
        parts.append(torch.linalg.vector_norm(torch.stack(list(map(take, idx))), dim=dims))
    if plan.rest:
        parts.append(_fused_norms(list(map(take, plan.rest)), torch.float32))
    norms = torch.cat(parts) if len(parts) > 1 else parts[0]
    return norms if plan.back is None else norms[plan.back]


_FLAT = operator.methodcaller("view", -1)


def local_shards(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """This process's shards of sharded (DTensor, e.g. FSDP2) gradients; other tensors as they are.

    Norms of the local shards need no communication; the distributed extension combines them into
    the global norm within the step's one collective.
    """
    dtensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before its import
    cls = getattr(dtensor_module, "DTensor", None) if dtensor_module is not None else None
    if cls is None:
        return grads
    return [g.to_local() if isinstance(g, cls) else g for g in grads]


def read_grad_norms(values: list[list[float]], slots: list[tuple[int, list[int]]], n: int) -> list[float]:
    if len(slots) == 1 and len(slots[0][1]) == n and len(values[slots[0][0]]) == n:
        slot, idx = slots[0]
        if idx == _in_order(n):  # every gradient in one slot, in order (the fast path; a C comparison)
            return list(values[slot])
    norms = [0.0] * n
    for slot, idx in slots:
        for pos, i in enumerate(idx):
            norms[i] = values[slot][pos]
    return norms


_IN_ORDER: list[list[int]] = [[]]


def _in_order(n: int) -> list[int]:
    """``list(range(n))``, kept: the positions of a slot that holds every gradient in order."""
    if len(_IN_ORDER[0]) != n:
        _IN_ORDER[0] = list(range(n))
    return _IN_ORDER[0]


#: Before Python 3.12, ``sum()`` of floats adds them in order into a C double: the very digits of the
#: ``functools.reduce`` below, without a float object per term. From 3.12 it compensates (other digits).
_SUM_IN_ORDER = sys.version_info < (3, 12)


def total_norm(norms: list[float]) -> float:
    # ((0 + a*a) + b*b) + ...: the sum of squares in order, as a C loop (sum() may compensate: other digits).
    if _SUM_IN_ORDER:
        s = sum(map(operator.mul, norms, norms), 0.0)
    else:
        s = functools.reduce(operator.add, map(operator.mul, norms, norms), 0.0)
    return math.sqrt(s) if math.isfinite(s) else s


def layer_key(module: str | None) -> str:
    """The layer name used in ``StepStats.layer_norms`` for a parameter's owning module: its path,
    ``<root>`` for the model itself, ``<foreign>`` for parameters the model does not own."""
    return "<root>" if module == "" else ("<foreign>" if module is None else module)


#: Layer plans of recently seen ``modules`` lists (by identity; the engine passes the same list each step).
_LAYER_PLANS: dict[int, tuple[list[str | None], int, list[str], list[tuple[int, ...]], Any]] = {}


def _layer_plan(modules: list[str | None]) -> tuple[list[str], list[tuple[int, ...]], Any]:
    """``(layer keys, each layer's positions, columns)``; ``columns`` is set when every layer holds the same
    number of parameters (a stack of Linear layers: weight and bias): one getter per position within a layer,
    each reading that position of every layer at once, so the per-layer norms take one C-level ``map``."""
    cached = _LAYER_PLANS.get(id(modules))
    if cached is not None and cached[0] is modules and cached[1] == len(modules):
        return cached[2], cached[3], cached[4]
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(modules):
        groups.setdefault(layer_key(m), []).append(i)
    keys = list(groups)
    idx = [tuple(v) for v in groups.values()]
    columns = _columns(idx)
    if len(_LAYER_PLANS) >= 16:
        _LAYER_PLANS.pop(next(iter(_LAYER_PLANS)))
    _LAYER_PLANS[id(modules)] = (modules, len(modules), keys, idx, columns)
    return keys, idx, columns


def _columns(idx: list[tuple[int, ...]]) -> list[operator.itemgetter] | None:
    """For layers of equal size (two or more layers): the j-th getter reads the j-th position of every layer."""
    if len(idx) < 2 or len({len(g) for g in idx}) != 1:
        return None
    return [operator.itemgetter(*[g[j] for g in idx]) for j in range(len(idx[0]))]


def layer_norms(modules: list[str | None], norms: list[float], *, finite: bool = False) -> dict[str, float]:
    """L2 norm per owning module (``<root>`` for the model itself, ``<foreign>`` for unowned parameters).
    ``finite``: the caller knows every norm is finite (their sum of squares is), so every layer's is too."""
    if len(modules) == len(norms):
        keys, groups, columns = _layer_plan(modules)
        try:
            hypot = math.hypot
            if columns is not None:  # hypot(a, b) is hypot(*[a, b]); hypot(a) is abs(a)
                vals = list(map(hypot, *[get(norms) for get in columns]))
            else:
                vals = [abs(norms[g[0]]) if len(g) == 1 else hypot(*[norms[i] for i in g]) for g in groups]
        except (IndexError, TypeError):
            vals = None
        # hypot of finite float32-range norms cannot overflow a double: known finite, they need no look.
        if vals is not None and (finite or all(map(math.isfinite, vals))):
            return dict(zip(keys, vals))
    acc: dict[str, float] = {}
    for m, v in zip(modules, norms):
        key = layer_key(m)
        acc[key] = acc.get(key, 0.0) + v * v
    return {k: math.sqrt(v) if math.isfinite(v) else v for k, v in acc.items()}


def count_nonfinite(names: list[str], grads: list[torch.Tensor], suspects: list[int]) -> tuple[dict[str, int], dict[str, int]]:
    """Element-wise NaN and Inf counts for the suspect gradients (incident path only: one more sync)."""
    if not suspects:
        return {}, {}
    grads = local_shards(grads)
    parts = []
    for i in suspects:
        g = grads[i]
        if g.is_sparse:
            g = g.coalesce().values()
        parts.append(torch.stack([torch.isnan(g).sum(), torch.isinf(g).sum()]).to("cpu"))
    counts = torch.stack(parts).tolist()
    nan = {names[i]: int(c[0]) for i, c in zip(suspects, counts) if c[0]}
    inf = {names[i]: int(c[1]) for i, c in zip(suspects, counts) if c[1]}
    return nan, inf
