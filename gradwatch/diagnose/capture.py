"""Capture: references to a step's inputs, output gradients and losses, kept for a replay on an incident.

A :class:`Call` is one forward call of the watched model (plain loop), a :class:`Batch` one Lightning batch;
each keeps the random number generators' state at its start so a replay draws the same numbers. The helpers
here are facts about captured tensors (which hold NaN/Inf, which device flags say non-finite), no policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten_with_path, tree_leaves

#: Forward calls (Lightning: batches) of one step kept for replay (gradient accumulation runs several).
MAX_CALLS = 64
#: Of those, the most recent calls whose output gradients are held for a faithful replay; older calls
#: keep only whether their output gradient was finite.
MAX_GRADS = 4
#: The input bytes of one step's calls (Lightning: batches) kept alive at most, beyond the MAX_GRADS most recent:
#: a long accumulation of large micro-batches (images, on a GPU) would otherwise hold up to MAX_CALLS of them
#: past their iteration. The oldest go first, as past MAX_CALLS.
MAX_INPUT_BYTES = 64 * 2**20


def input_bytes(*sources: Any) -> int:
    """The bytes of the tensors in ``sources`` (a view counts as its size: an estimate, never an undercount of
    what a call adds)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(sources) if isinstance(t, torch.Tensor))

class Call:
    """One forward call of the watched model: references to its inputs, its output gradients, its losses.

    ``nodes`` are the autograd nodes of its outputs (where the loss code begins) and ``losses`` the losses
    observed after it (``observe_loss``). Once folded (:meth:`fold`, when newer calls arrive) it holds no
    output gradient, node or graph any more, only ``sums``: each output gradient's sum, a 0-dim device
    tensor that is non-finite when the gradient was (read on an incident only).
    """

    __slots__ = (
        "__weakref__",
        "_nbytes",
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
        self._nbytes: int | None = None  # counted when the budget is asked about (see nbytes)
        self.autocast = autocast
        # The replay draws the same dropout masks and random ops (not inside a torch.compile trace: reading
        # the generator there is a graph break; a compiled model's replay then draws fresh numbers).
        self.rng = None if torch.compiler.is_compiling() else rng_state()
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

    @property
    def nbytes(self) -> int:
        """The bytes of its inputs (see :func:`input_bytes`): counted on first use, only when a step keeps more
        calls than the budget lets through without counting (an accumulation of MAX_GRADS micro-batches or more).
        The arguments are the call's own, referenced since it ran: the count is the one it had then."""
        if self._nbytes is None:
            self._nbytes = input_bytes(self.args, self.kwargs)
        return self._nbytes

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
        return all_finite(parts)


def _finiteness_sum(grad: torch.Tensor) -> torch.Tensor:
    """One reduction, no temporary: the sum is non-finite when an element is, and (short of float32
    overflow) only then; half-precision gradients, e.g. scaled by a GradScaler, are summed in float32."""
    grad = grad.detach()  # a gradient taken with create_graph=True must not keep its graph alive here
    if grad.is_complex():
        grad = torch.view_as_real(grad)
    if grad.dtype in (torch.float16, torch.bfloat16):
        return grad.sum(dtype=torch.float32)
    return grad.sum()


def output_leaves(output: Any) -> list[Any]:
    """The leaves of a forward's output, looking inside dataclass instances too (pytree does not)."""
    out: list[Any] = []
    for leaf in tree_leaves(output):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += output_leaves([getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)])
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


def bad_data(named: list[tuple[str, torch.Tensor]], *, minus_inf: bool = False) -> list[tuple[str, int, int]]:
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


class Batch:
    """A Lightning batch, replayed through ``training_step``."""

    def __init__(self, batch: Any, batch_idx: int, trainer: Any, pl_module: Any) -> None:
        self.batch = batch
        self._nbytes: int | None = None
        self.batch_idx = batch_idx
        self.trainer = trainer
        self.pl_module = pl_module
        #: The (detached) losses observed for this batch, read on an incident only.
        self.losses: list[torch.Tensor] = []
        self.rng = rng_state()

    @property
    def nbytes(self) -> int:
        """The bytes of the batch's tensors, counted on first use (as :attr:`Call.nbytes`)."""
        if self._nbytes is None:
            self._nbytes = input_bytes(self.batch)
        return self._nbytes


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One device flag: every element of ``tensors`` is finite (None for no tensors). No sync."""
    flags = [torch.isfinite(t).all() for t in tensors]
    if not flags:
        return None
    device = flags[0].device
    return torch.stack([f.to(device) for f in flags]).all()


def nonfinite_flags(flags: Sequence[torch.Tensor | None]) -> list[bool]:
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


def rng_state() -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The random number generators' state as a forward starts (CPU, and the current CUDA device's): ~1 us,
    no sync. A replay restores it, so it draws the dropout masks and random ops that step drew."""
    try:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda
    except Exception:  # noqa: BLE001 - a replay without it draws fresh random numbers
        return None


def autocast_state() -> tuple[tuple[str, torch.dtype], ...] | None:
    state: tuple[tuple[str, torch.dtype], ...] | None = None
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            state = (state or ()) + ((device, torch.get_autocast_dtype(device)),)
    return state


def named_tensors(prefix: str, obj: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    leaves, _spec = tree_flatten_with_path(obj)
    out = []
    for path, v in leaves:
        if isinstance(v, torch.Tensor) and not v.is_meta and v.layout is torch.strided:
            out.append((prefix + "".join(str(k) for k in path), v))
    return out


def nonfinite_inputs(sources: Sequence[Call | Batch], *, minus_inf: bool = False) -> list[tuple[str, int, int]]:
    """``(name, NaN count, Inf count)`` of the captured inputs of the step (``sources``: its calls or batches)
    that hold NaN or +Inf (``minus_inf``: -inf only, see :func:`bad_data`). One sync; incident path only."""
    per_source = [_source_tensors(src) for src in sources]
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
            what = "batch" if isinstance(sources[i], Batch) else "forward call"
            found = [(f"{n} of the step's {what} {i + 1}" if uses[id(t)] == 1 else n, t) for n, t in found]
        named += found
    return bad_data([(n, t) for n, t in named if t.is_floating_point() or t.is_complex()], minus_inf=minus_inf)


def _source_tensors(src: Call | Batch) -> list[tuple[str, torch.Tensor]]:
    if isinstance(src, Batch):
        return named_tensors("batch", src.batch)
    return named_tensors("args", src.args) + named_tensors("kwargs", src.kwargs)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The model inputs of a step so far (see :func:`step_inputs`)."""

    count: int
    requires_grad: bool
    batch_sizes: frozenset[int]

    def as_tuple(self) -> tuple[int, bool, frozenset[int]]:
        return self.count, self.requires_grad, self.batch_sizes


def step_inputs(sources: Sequence[Any], count: int) -> StepInputs:
    """How many inputs (``count``), whether an input tensor in ``sources`` requires grad (an adversarial
    example), and the batch sizes (leading dimensions of each source's first tensor with one)."""
    grad = False
    sizes: set[int] = set()
    for src in sources:
        tensors = [t for t in tree_leaves(src) if isinstance(t, torch.Tensor)]
        grad = grad or any(t.requires_grad for t in tensors)
        first = next((t for t in tensors if t.dim() > 0), None)
        if first is not None:
            sizes.add(int(first.shape[0]))
    return StepInputs(count, grad, frozenset(sizes))


def call_tensors(calls: Sequence[Call]) -> list[torch.Tensor]:
    """The tensors among the captured calls' arguments."""
    return [t for c in calls for t in tree_leaves((c.args, c.kwargs)) if isinstance(t, torch.Tensor)]
