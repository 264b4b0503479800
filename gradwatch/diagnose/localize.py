"""Localize where a non-finite value was born: the forward op, the module, the backward node.

A :class:`Localizer` is switched on only for a replayed step or an escalated step, never on healthy
steady-state steps. While it records:

- a ``TorchFunctionMode`` sees every torch function and tensor method of the forward pass and notes, per
  call, whether its tensor inputs were finite and its outputs not, which module ran it (innermost module on
  a stack kept by forward pre/post hooks on every submodule) and which line of the user's code called it;
- forward hooks note, per module, whether its output was finite and the magnitudes of its inputs;
- node hooks on the autograd graph note, per backward node in execution order, whether the gradient it
  received was finite and the one it produced not (Inf included, unlike anomaly mode);
- node hooks on the loss code between the model's outputs and the loss (:meth:`Localizer.hook_graph` with
  ``outside=True``, before that backward runs) do the same for the ops the model did not run, and also
  check the forward inputs each such node saved: an op whose forward inputs were already non-finite
  (a NaN target) only passed a NaN on. Their source line comes from anomaly mode's forward traceback.

Every check is queued as a device tensor; :meth:`Localizer.resolve` reads them all back at once and
returns a :class:`Localization`.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gradwatch.core.params import module_wrappers, user_path
from gradwatch.diagnose.birth import (
    absorbed,
    first_bad_module,
    first_birth,
    first_seen,
    forward_finite,
    inf_reached,
    is_bad,
    last_finite,
    magnitudes,
    output_flags,
    passed_on,
)
from gradwatch.diagnose.op_fixes import input_op
from gradwatch.observe.module_hooks import owned

ROOT = "<root>"

_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package root
_SKIP_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _OWN_DIR)
_OPTIONAL_SKIP = ("lightning", "pytorch_lightning", "lightning_fabric")


def _skip_dirs() -> tuple[str, ...]:
    dirs = list(_SKIP_DIRS)
    for name in _OPTIONAL_SKIP:
        mod = sys.modules.get(name)
        f = getattr(mod, "__file__", None)
        if f:
            dirs.append(os.path.dirname(os.path.abspath(f)) + os.sep)
    return tuple(dirs)


@dataclass
class Site:
    """Where a forward op ran: the user's line that called it and the innermost module around it."""

    func: str
    module: str | None
    filename: str | None = None
    lineno: int | None = None
    function: str | None = None

    @property
    def source(self) -> str | None:
        return source_text(self.filename, self.lineno, self.function)

    @property
    def code(self) -> str | None:
        return code_at(self.filename, self.lineno)


def source_text(filename: str | None, lineno: int | None, function: str | None) -> str | None:
    """``file:line in function``, or None where the place is unknown."""
    return None if filename is None else f"{filename}:{lineno} in {function}"


def code_at(filename: str | None, lineno: int | None) -> str | None:
    """The stripped source line at ``filename:lineno``, or None."""
    if filename is None or lineno is None:
        return None
    return linecache.getline(filename, lineno).strip() or None


@dataclass
class Origin:
    """The op where a non-finite value was born.

    Attributes:
        phase: ``"forward"`` (an op's output went non-finite from finite inputs), ``"backward"`` (a
            backward node produced a non-finite gradient from a finite one) or ``"loss"`` (such a backward
            node of the loss code outside the model, hooked with ``hook_graph(..., outside=True)``).
        op: Autograd node name, e.g. ``"LogBackward0"`` (the forward function when no graph was built).
        forward_op: The torch function that ran in the forward pass, e.g. ``"torch.log"``.
        module: Qualified name of the innermost module that ran it (``"<root>"`` for the root module,
            None outside any module).
        source: ``"file:line in function"`` of the user's code that called it.
        code: That source line.
        incoming: What went in. Forward birth: ``min_abs``/``max_abs``/``min``/``max`` of the op's tensor
            inputs. Backward birth: ``min_abs``/``max_abs`` of the gradient it received, and
            ``forward_min_abs``/``forward_max_abs``/``forward_min``/``forward_max`` of its forward inputs.
        outgoing: What came out: ``nan``/``inf`` (whether present) and ``max_abs``.
        traceback: The forward traceback recorded by anomaly mode for this node, if it was on.
        explicit_operand: The op was given an explicit non-finite Python number (``float("inf")``).
        input_op: The op that produced the op's input (``"Sigmoid"`` for ``torch.log(torch.sigmoid(z))``),
            read from its autograd node; None without one.
    """

    phase: str
    op: str
    forward_op: str | None
    module: str | None
    source: str | None
    code: str | None
    incoming: dict[str, float] = field(default_factory=dict)
    outgoing: dict[str, Any] = field(default_factory=dict)
    traceback: str | None = None
    explicit_operand: bool = False
    forward_birth: bool = False  # a loss-code op's forward result was non-finite (read from its saved result)
    masked: bool = False  # a forward NaN the rest of the forward masked out (torch.where): the where-NaN trap
    #: A backward birth whose forward inputs held Inf: the forward op that made that Inf, which the forward
    #: then masked out (``torch.where(x > 0, w * x.log(), 0)``): the backward's 0 * inf is the NaN.
    masked_inf: Origin | None = None
    input_op: str | None = None


@dataclass
class Localization:
    """What one recorded forward/backward showed.

    Attributes:
        origin: The op where the first non-finite value was born, if one was seen.
        first_module: The first module (in completion order) whose forward output was non-finite.
        first_module_inputs: ``min_abs``/``max_abs``/``min``/``max`` of that module's tensor inputs.
        first_module_carried: ``"NaN"``/``"Inf"`` when that module's inputs already held it (it passed it on).
        last_finite_module: Then the last module before it whose output was finite.
        root_class: The class name of the recorded root module.
        forward_finite: Whether every recorded forward op output was finite.
        first_seen: With no birth found, the site of the first recorded op whose inputs held NaN/Inf.
        ops_recorded: Number of forward ops recorded.
        nodes_recorded: Number of backward nodes that ran with a hook.
    """

    origin: Origin | None = None
    first_module: str | None = None
    first_module_inputs: dict[str, float] = field(default_factory=dict)
    first_module_carried: str | None = None
    last_finite_module: str | None = None
    root_class: str | None = None
    forward_finite: bool = True
    #: With no birth found: the first recorded op whose inputs already held NaN/Inf (where it was first
    #: seen: written in place, e.g. ``x[i] = float("nan")``, or read from a buffer or untraced code).
    first_seen: Site | None = None
    ops_recorded: int = 0
    nodes_recorded: int = 0


@dataclass
class Readings:
    """Every check one recording queued, read back to the host (the facts :meth:`Localizer.resolve` decides on).

    Attributes:
        ops: Per forward op: its site, its autograd node, whether it was given an explicit non-finite number,
            the summary of its inputs and of its outputs, and the span of aten ops it ran (indices in ``aten``).
        aten: Per aten op: its name, the explicit-number flag, its input and output summaries.
        modules: Per module completion: its label, its input and output summaries.
        fired: Per backward node that ran: its index, the gradient it received and the one it produced.
        saved: The forward inputs loss-code nodes saved, by node index.
        results: The forward results loss-code nodes saved, by node index.
    """

    ops: list[tuple[Site, Any, bool, list[float] | None, list[float] | None, tuple[int, int]]]
    aten: list[tuple[str, bool, list[float] | None, list[float] | None]]
    modules: list[tuple[str, list[float] | None, list[float] | None]]
    fired: list[tuple[int, list[float] | None, list[float] | None]]
    saved: dict[int, list[float] | None]
    results: dict[int, list[float] | None]

    @property
    def outputs(self) -> list[list[float] | None]:
        """The output summary of every forward op, in order."""
        return [after for _s, _n, _i, _b, after, _r in self.ops]


def _float_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        leaves: Iterable[Any] = (obj,)
    else:
        leaves = tree_leaves(obj)
    out = []
    for t in leaves:
        if (
            isinstance(t, torch.Tensor)
            and (t.is_floating_point() or t.is_complex())
            and not t.is_meta
            and t.layout is torch.strided
            and t.numel() > 0
        ):
            out.append(t)
    return out


def _has_nonfinite_scalar(args: Any, kwargs: Any) -> bool:
    """An explicit float('inf')/nan argument: an intentional non-finite value (masks), not a bug."""
    for v in tree_leaves((args, kwargs)):
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            return True
    return False


def summarize(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``[has_nan, has_inf, min_abs, max_abs, min, max]`` over ``tensors``: one float32 device vector, no sync.

    Complex tensors count by magnitude (``min``/``max`` are then magnitudes too).
    """
    if not tensors:
        return None
    with torch.no_grad():
        parts = []
        device = tensors[0].device
        for t in tensors:
            if not _has_data(t):
                continue
            t = t.detach()
            a = t.abs().float().reshape(-1)
            signed = a if t.is_complex() else t.float().reshape(-1)
            lo, hi = torch.aminmax(a)
            smin, smax = torch.aminmax(signed)
            v = torch.stack([torch.isnan(a).any().float(), torch.isinf(a).any().float(), lo, hi, smin, smax])
            parts.append(v if v.device == device else v.to(device, non_blocking=True))
        if len(parts) <= 1:
            return parts[0] if parts else None
        s = torch.stack(parts)
        return torch.stack(
            [s[:, 0].amax(), s[:, 1].amax(), s[:, 2].amin(), s[:, 3].amax(), s[:, 4].amin(), s[:, 5].amax()]
        )


def _has_data(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds its elements. FSDP1 frees a sharded parameter's storage between uses
    (``resize_(0)``) and keeps its sizes: reading such a tensor reads freed memory (a segmentation fault)."""
    if t.numel() == 0 or t.is_meta:
        return False
    try:
        extent = t.storage_offset() + 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        return t.untyped_storage().nbytes() >= extent * t.element_size()
    except (RuntimeError, NotImplementedError, TypeError):  # no plain storage (a tensor subclass): let it be read
        return True


#: Factories whose output is uninitialized memory, which the code fills before reading (a gather buffer,
#: an ``out=`` target): whatever they hold, NaN included, is chance, never where a NaN was born.
_UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})


class _OpRecorder(TorchFunctionMode):
    def __init__(self, loc: Localizer) -> None:
        super().__init__()
        self.loc = loc

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        loc = self.loc
        if name in ("__get__", "__set__") or name in _UNINITIALIZED or not loc.recording:
            return func(*args, **kwargs)
        loc.recording = False  # our own checks are not the model's ops
        try:
            before = summarize(_float_tensors((args, kwargs)))
        except Exception:  # noqa: BLE001 - never break the forward pass
            before = None
        loc.recording = True
        start = len(loc._aten)
        out = func(*args, **kwargs)
        loc.recording = False
        try:
            loc._record_op(func, args, kwargs, before, out, (start, len(loc._aten)))
        except Exception:  # noqa: BLE001
            pass
        finally:
            loc.recording = True
        return out


class _AtenRecorder(TorchDispatchMode):
    """The aten ops inside composite torch functions (e.g. the softmax inside multi-head attention)."""

    def __init__(self, loc: Localizer) -> None:
        super().__init__()
        self.loc = loc

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        loc = self.loc
        packet = getattr(getattr(func, "overloadpacket", func), "__name__", "")
        if not loc.recording or packet in _UNINITIALIZED:
            return func(*args, **kwargs)
        loc.recording = False
        try:
            before = summarize(_float_tensors((args, kwargs)))
        except Exception:  # noqa: BLE001
            before = None
        loc.recording = True
        out = func(*args, **kwargs)
        loc.recording = False
        try:
            name = getattr(getattr(func, "overloadpacket", func), "__name__", str(func))
            loc._aten.append((name, _has_nonfinite_scalar(args, kwargs), before, summarize(_float_tensors(out))))
        except Exception:  # noqa: BLE001
            pass
        finally:
            loc.recording = True
        return out


def _func_name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    qual = getattr(func, "__qualname__", name)
    mod = getattr(func, "__module__", None) or ""
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + name
    if mod.startswith("torch.nn.functional"):
        return "F." + name
    if mod.startswith("torch"):
        return "torch." + name
    return qual


class Localizer:
    """Records one forward (and its backward) of ``root`` to localize non-finite values.

    Use as: :meth:`start` before the forward, :meth:`stop_forward` after it, :meth:`hook_graph` with the
    forward's outputs, then run the backward, then :meth:`resolve`; :meth:`close` removes every hook.
    Several forwards may be recorded before one resolve (gradient accumulation).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> loc = Localizer(model)
        >>> loc.start()
        >>> out = model(torch.zeros(1, 2)).log()
        >>> loc.stop_forward(); loc.hook_graph([out])
        >>> _ = torch.autograd.grad(out.sum(), list(model.parameters()), allow_unused=True)
        >>> loc.resolve().origin is not None
        True
        >>> loc.close()
    """

    def __init__(self, root: nn.Module | None, *, root_label: str = ROOT, aten: bool = False) -> None:
        self.root = root
        self.root_label = root_label
        self.aten = aten
        self._root_class: str | None = None
        self.recording = False
        self._mode: _OpRecorder | None = None
        self._aten_mode: _AtenRecorder | None = None
        self._module_hooks: list[Any] = []
        self._node_handles: list[Any] = []
        self._stack: list[str] = []
        self._skip = _skip_dirs()
        #: Replaying a captured call from inside gradwatch: a frame of gradwatch's own ends the search for the
        #: user's line (past it is the training loop's ``opt.step()``, not the code that ran the op).
        self.replay = False
        self._own = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package root
        self.reset()

    # -- recording state ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every record (and remove node hooks); module hooks stay."""
        for h in self._node_handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._node_handles = []
        self._ops: list[tuple[Site, Any, bool, torch.Tensor | None, torch.Tensor | None, tuple[int, int]]] = []
        self._aten: list[tuple[str, bool, torch.Tensor | None, torch.Tensor | None]] = []
        self._node_site: dict[Any, Site] = {}
        self._modules: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []
        self._nodes: list[Any] = []
        self._node_sites: list[Site | None] = []
        self._fired: list[tuple[int, torch.Tensor | None, torch.Tensor | None]] = []
        self._outside: set[int] = set()
        self._saved_inputs: dict[int, torch.Tensor | None] = {}
        self._saved_results: dict[int, torch.Tensor | None] = {}  # loss-code nodes' forward results
        self._stack = []

    def install_module_hooks(self) -> None:
        """Forward pre/post hooks on every submodule (only while localizing)."""
        if self._module_hooks or self.root is None:
            return
        wrappers = module_wrappers(self.root)
        for name, m in self.root.named_modules():
            label = user_path(name, wrappers) or self.root_label  # no torch.compile / DDP wrapper segments
            if label == self.root_label:
                self._root_class = type(m).__name__  # the innermost of the wrappers (DDP, torch.compile): the user's
            # prepend: before the module's own pre-hooks (legacy weight_norm computes the weight in one)
            enter = m.register_forward_pre_hook(functools.partial(self._enter, label), prepend=True)
            leave = m.register_forward_hook(functools.partial(self._exit, label), with_kwargs=True, always_call=True)
            self._module_hooks += [owned(m, enter), owned(m, leave)]

    def remove_module_hooks(self) -> None:
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []

    def start(self, *, inside_root: bool = False) -> None:
        """Begin recording a forward pass (pushes the op recorder; installs module hooks). ``inside_root``:
        called from the root module's own forward pre-hook, so its ops belong to the root module."""
        self.install_module_hooks()
        self._stack = [self.root_label] if inside_root and self.root is not None else []
        if self._mode is None:
            self._mode = _OpRecorder(self)
            self._mode.__enter__()
            if self.aten:
                self._aten_mode = _AtenRecorder(self)
                self._aten_mode.__enter__()
        self.recording = True

    def stop_forward(self) -> None:
        """End recording the forward pass (pops the op recorder)."""
        self.recording = False
        modes = (self._aten_mode, self._mode)
        self._mode = self._aten_mode = None
        for mode in modes:
            if mode is None:
                continue
            try:
                mode.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - the stack was changed under us; nothing more to undo
                pass

    def close(self) -> None:
        self.stop_forward()
        self.remove_module_hooks()
        self.reset()

    # -- forward -----------------------------------------------------------------------------------
    def _enter(self, label: str, module: nn.Module, args: Any) -> None:
        if self.recording:
            self._stack.append(label)

    def _exit(self, label: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self.recording:
            return
        if self._stack and self._stack[-1] == label:
            self._stack.pop()
        elif label in self._stack:  # an inner module raised: unwind to this one
            del self._stack[self._stack.index(label) :]
        self.recording = False  # our own checks are not the model's ops
        try:
            ins = summarize(_float_tensors((args, kwargs)))
            outs = summarize(_float_tensors(output))
            self._modules.append((label, ins, outs))
        except Exception:  # noqa: BLE001
            pass
        finally:
            self.recording = True

    def _site(self, func: Any) -> Site:
        module = self._stack[-1] if self._stack else None
        f = sys._getframe(2)
        skip = self._skip
        replay = self.replay
        outside = False  # past the recorder's own frames
        while f is not None:
            fn = f.f_code.co_filename
            if fn.startswith(self._own):
                if replay and outside:
                    break
            else:
                outside = True
            if not fn.startswith(skip) and not fn.startswith("<frozen"):
                return Site(_func_name(func), module, fn, f.f_lineno, f.f_code.co_name)
            f = f.f_back
        return Site(_func_name(func), module)

    def _record_op(
        self, func: Any, args: Any, kwargs: Any, before: torch.Tensor | None, out: Any, aten: tuple[int, int]
    ) -> None:
        outs = _float_tensors(out)
        if not outs and args and isinstance(args[0], torch.Tensor):
            outs = _float_tensors(args[0])  # an in-place write that returns nothing (x[i] = v): x is its output
        if not outs:
            return
        site = self._site(func)
        node = next((t.grad_fn for t in outs if t.grad_fn is not None), None)
        if node is not None:
            for t in outs:
                if t.grad_fn is not None and t.grad_fn not in self._node_site:
                    self._node_site[t.grad_fn] = site
        self._ops.append((site, node, _has_nonfinite_scalar(args, kwargs), before, summarize(outs), aten))

    # -- backward ----------------------------------------------------------------------------------
    def hook_graph(self, outputs: Iterable[torch.Tensor], *, outside: bool = False) -> int:
        """Put a post hook on every backward node reachable from ``outputs``; returns how many.

        Nodes hooked before (the model's own graph) are not walked again, so after the model's outputs
        were hooked, ``hook_graph([loss], outside=True)`` reaches only the loss code between them and the
        loss. Call it before that backward runs: its nodes still hold their saved forward inputs then.
        """
        seen: set[Any] = set(self._nodes)
        frontier: list[tuple[Any, Site | None]] = []
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                frontier.append((t.grad_fn, self._node_site.get(t.grad_fn)))
        added = 0
        while frontier:
            node, inherited = frontier.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if type(node).__name__ == "AccumulateGrad":
                continue
            if outside:
                site = self._node_site.get(node) or _traceback_site(node, self._skip)
            else:
                site = self._node_site.get(node) or self._untraced_site(node) or inherited
            index = len(self._nodes)
            self._nodes.append(node)
            self._node_sites.append(site)
            if outside:
                self._outside.add(index)
            self._node_handles.append(node.register_hook(functools.partial(self._on_node, index)))
            added += 1
            for nxt, _ in node.next_functions:
                if nxt is not None and nxt not in seen:
                    frontier.append((nxt, site))
        return added

    def _untraced_site(self, node: Any) -> Site | None:
        """Where a node that no recorded op made ran (a custom ``autograd.Function``, whose ``apply`` the
        op recorder does not see): anomaly mode's forward traceback gives the line, and the one module whose
        ``forward`` contains that line gives the module. None without anomaly mode's traceback."""
        if not _is_custom_function(node):
            return None
        site = _traceback_site(node, self._skip)
        if site is None or self.root is None:
            return site
        owners = []
        wrappers = module_wrappers(self.root)
        for name, m in self.root.named_modules():
            code = getattr(getattr(type(m), "forward", None), "__code__", None)
            if code is None or code.co_filename != site.filename or site.lineno is None:
                continue
            lines = [line for _s, _e, line in code.co_lines() if line is not None]
            if lines and code.co_firstlineno <= site.lineno <= max(lines):
                owners.append(user_path(name, wrappers) or self.root_label)
        site.module = owners[0] if len(owners) == 1 else None
        site.func = node.name()[: -len("Backward")] + ".apply"
        return site

    def _on_node(self, index: int, grad_inputs: Any, grad_outputs: Any) -> None:
        try:
            produced = summarize(_float_tensors([g for g in grad_inputs if g is not None]))
            incoming = summarize(_float_tensors([g for g in grad_outputs if g is not None]))
            self._fired.append((index, incoming, produced))
            if index in self._outside and index not in self._saved_inputs:
                # Still held here: a node releases its saved tensors only after its post hooks ran.
                node = self._nodes[index]
                self._saved_inputs[index] = summarize(_saved_inputs(node))
                result = getattr(node, "_saved_result", None)
                if isinstance(result, torch.Tensor) and (result.is_floating_point() or result.is_complex()):
                    self._saved_results[index] = summarize([result])
        except Exception:  # noqa: BLE001
            pass

    # -- reading back ------------------------------------------------------------------------------
    def _read_back(self) -> Readings:
        """Every queued check read back to the host (one transfer per device)."""
        vectors: list[torch.Tensor | None] = []
        for _site, _node, _intent, before, after, _span in self._ops:
            vectors += [before, after]
        for _name, _intent, before, after in self._aten:
            vectors += [before, after]
        for _label, ins, outs in self._modules:
            vectors += [ins, outs]
        for _i, incoming, produced in self._fired:
            vectors += [incoming, produced]
        saved_keys = list(self._saved_inputs)
        vectors += [self._saved_inputs[k] for k in saved_keys]
        result_keys = list(self._saved_results)
        vectors += [self._saved_results[k] for k in result_keys]
        it = iter(_read(vectors))
        return Readings(
            ops=[(site, node, intent, next(it), next(it), span) for site, node, intent, _b, _a, span in self._ops],
            aten=[(name, intent, next(it), next(it)) for name, intent, _b, _a in self._aten],
            modules=[(label, next(it), next(it)) for label, _i, _o in self._modules],
            fired=[(i, next(it), next(it)) for i, _a, _b in self._fired],
            saved={k: next(it) for k in saved_keys},
            results={k: next(it) for k in result_keys},
        )

    def resolve(self) -> Localization:
        """Read every queued check back (one transfer per device) and name the origin."""
        r = self._read_back()
        outputs = r.outputs
        loc = Localization(
            ops_recorded=len(r.ops), nodes_recorded=len(r.fired), forward_finite=forward_finite(outputs)
        )
        origin = self._forward_origin(r)
        ends_finite = last_finite(outputs)
        if origin is not None and origin.outgoing.get("nan") and ends_finite is not None:
            # A NaN born in the forward that its output no longer holds: masked out (torch.where, indexing),
            # yet the masked positions' gradient is NaN (0 * the op's infinite derivative).
            origin.masked = ends_finite
        if origin is None or absorbed(origin.outgoing, ends_finite):
            origin = self._later_origin(r, origin)
        loc.origin = origin
        if origin is None and not loc.forward_finite:
            loc.first_seen = first_seen([(site, before) for site, _n, _i, before, _a, _s in r.ops])
        loc.first_module, loc.first_module_inputs = first_bad_module(r.modules)
        loc.first_module_carried, loc.last_finite_module = passed_on(r.modules)
        loc.root_class = self._root_class
        return loc

    def _forward_origin(self, r: Readings) -> Origin | None:
        """The forward op where a non-finite value was born (the aten op inside a composite one), if any."""
        found = first_birth([(i, b, a) for _s, _n, i, b, a, _r in r.ops], [str(s.func) for s, *_r in r.ops])
        if found is None:
            return None
        site, node, intent, before, after, (start, end) = r.ops[found]
        origin = Origin(
            phase="forward",
            # CopySlices (an in-place write into a view) says less than the op that wrote: x[i] = v.
            op=node.name() if node is not None and "::" not in node.name() else site.func,
            forward_op=site.func,
            module=site.module,
            source=site.source,
            code=site.code,
            incoming=magnitudes(before),
            outgoing=output_flags(after),
            traceback=_traceback(node) if node is not None else None,
            explicit_operand=intent,
            input_op=input_op(node) if node is not None else None,
        )
        if end - start > 1:  # a composite function: name the aten op inside it
            inner = first_birth([(i, b, a) for _n, i, b, a in r.aten[start:end]])
            if inner is not None:
                _refine(origin, node, r.aten[start + inner])
        return origin

    def _later_origin(self, r: Readings, forward: Origin | None) -> Origin | None:
        """With no forward birth, or one the forward absorbed: a backward (or loss-code) birth, which then
        wins; else ``forward``."""
        forward_inputs = {node: before for _s, node, _i, before, _a, _r in r.ops if node is not None}
        for index, summary in r.saved.items():
            forward_inputs.setdefault(self._nodes[index], summary)
        backward = self._backward_origin(r.fired, forward_inputs)
        if backward is None and forward is None:
            backward = self._loss_forward_origin(r.fired, r.saved, r.results)
        if backward is not None and forward is not None and inf_reached(backward.incoming):
            backward.masked_inf = forward
        return backward if backward is not None or forward is None else forward

    def _loss_forward_origin(
        self,
        fired: list[tuple[int, list[float] | None, list[float] | None]],
        saved: dict[int, list[float] | None],
        results: dict[int, list[float] | None],
    ) -> Origin | None:
        """A loss-code op whose forward result was non-finite from finite inputs (``std`` of one element):
        read from what its backward node saved. The earliest in forward order (the last to fire)."""
        for index, _incoming, _produced in reversed(fired):
            result = results.get(index)
            fwd = saved.get(index)
            if result is None or not is_bad(result) or fwd is None or is_bad(fwd):
                continue
            return self._node_origin(index, "loss", _forward_range({}, fwd), output_flags(result), forward_birth=True)
        return None

    def _backward_origin(
        self,
        fired: list[tuple[int, list[float] | None, list[float] | None]],
        forward_inputs: dict[Any, list[float] | None],
    ) -> Origin | None:
        for index, incoming, produced in fired:
            if produced is None or not is_bad(produced):
                continue
            if incoming is not None and is_bad(incoming):
                continue
            fwd = forward_inputs.get(self._nodes[index])
            outside = index in self._outside
            if outside and fwd is not None and is_bad(fwd):
                continue  # its forward inputs were already non-finite (a NaN target): passed on, not born
            if fwd is not None and fwd[0]:
                continue  # NaN in its forward inputs (a poisoned buffer, e.g. a fake-quant scale): passed on
            inc: dict[str, float] = {}
            if incoming is not None:
                inc = {"min_abs": incoming[2], "max_abs": incoming[3]}
            return self._node_origin(index, "loss" if outside else "backward", _forward_range(inc, fwd), output_flags(produced))
        return None

    def _node_origin(
        self, index: int, phase: str, incoming: dict[str, float], outgoing: dict[str, Any], *, forward_birth: bool = False
    ) -> Origin:
        """An origin at recorded backward node ``index``, placed where its forward op ran."""
        node = self._nodes[index]
        site = self._node_sites[index]
        return Origin(
            phase=phase,
            op=node.name(),
            forward_op=(site.func or None) if site else None,
            module=site.module if site else None,
            source=site.source if site else None,
            code=site.code if site else None,
            incoming=incoming,
            outgoing=outgoing,
            traceback=_traceback(node),
            forward_birth=forward_birth,
            input_op=input_op(node),
        )


def _forward_range(inc: dict[str, float], fwd: list[float] | None) -> dict[str, float]:
    """``inc`` plus the range of a node's forward inputs (``forward_min_abs``... from a summary)."""
    if fwd is not None:
        inc.update(forward_min_abs=fwd[2], forward_max_abs=fwd[3], forward_min=fwd[4], forward_max=fwd[5])
    return inc


def _saved_inputs(node: Any) -> list[torch.Tensor]:
    """The forward inputs a backward node saved (``_saved_self``, ``_saved_other``...), not its result."""
    out: list[torch.Tensor] = []
    for name in dir(node):
        if not name.startswith("_saved_") or name.startswith("_saved_result"):
            continue
        try:
            v = getattr(node, name)
        except Exception:  # noqa: BLE001, S112 - released, or not a tensor attribute
            continue
        if isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
        elif isinstance(v, torch.Tensor):
            out.append(v)
    return _float_tensors(out)


_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def _is_custom_function(node: Any) -> bool:
    """A node of a Python ``torch.autograd.Function`` (``MyFnBackward``; built-in nodes end in a digit)."""
    try:
        return bool(re.fullmatch(r"[A-Za-z_]\w*Backward", node.name()))
    except Exception:  # noqa: BLE001
        return False


def _traceback_site(node: Any, skip: tuple[str, ...]) -> Site | None:
    """Where a node's forward op ran, from anomaly mode's forward traceback (the last frame of user code)."""
    try:
        tb = node.metadata.get("traceback_")
    except Exception:  # noqa: BLE001
        return None
    if not tb:
        return None
    frames = tb if isinstance(tb, list) else str(tb).split("\n  File")
    for frame in reversed(frames):
        m = _FRAME.match(frame if frame.lstrip().startswith("File") else "  File" + frame)
        if m is None:
            continue
        filename = m.group("file")
        if filename.startswith(skip) or filename.startswith("<frozen"):
            continue
        return Site("", None, filename, int(m.group("line")), m.group("func"))
    return None


def _read(vectors: list[torch.Tensor | None]) -> list[list[float] | None]:
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(vectors):
        if v is not None:
            by_device.setdefault(v.device, []).append(i)
    out: list[list[float] | None] = [None] * len(vectors)
    for idx in by_device.values():
        rows = torch.stack([vectors[i] for i in idx]).tolist()  # type: ignore[misc]
        for i, r in zip(idx, rows):
            out[i] = r
    return out


def _traceback(node: Any) -> str | None:
    try:
        tb = node.metadata.get("traceback_")
    except Exception:  # noqa: BLE001
        return None
    if not tb:
        return None
    if isinstance(tb, list):
        # gradwatch's own frames (the op recorder) mean nothing to users
        return "".join(frame for frame in tb if _OWN_DIR not in frame)
    return str(tb)


def _norm_name(name: str) -> str:
    return re.sub(r"backward\d*$", "", name.lower()).replace("_", "")


def _refine(origin: Origin, node: Any, inner: tuple[str, bool, list[float] | None, list[float] | None]) -> None:
    """Name the aten op inside a composite function, and its backward node when one matches."""
    name, _intended, before, after = inner
    origin.forward_op = f"{origin.forward_op} > aten.{name}"
    origin.incoming = magnitudes(before)
    if after is not None:
        origin.outgoing = output_flags(after)
    wanted = _norm_name(name)
    match = None
    frontier, seen = [node], set()
    while frontier and len(seen) < 2000:
        n = frontier.pop(0)
        if n is None or n in seen:
            continue
        seen.add(n)
        if _norm_name(n.name()) == wanted:
            match = n
            break
        frontier.extend(nxt for nxt, _ in n.next_functions)
    origin.op = match.name() if match is not None else f"aten.{name}"
    if match is not None:
        origin.traceback = _traceback(match) or origin.traceback
        origin.input_op = input_op(match)
