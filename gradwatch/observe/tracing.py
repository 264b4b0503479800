"""Trace which module ran each forward op, on the steps where it is worth the cost.

Autograd errors name an op ("output 0 of Sigmoid") but not the module that ran it. The
:class:`ForwardTracer` records, for every op output that carries a ``grad_fn``, the innermost watched
module that was running, the op, the shape, the tensor's version, and the source line; and for every
in-place op, which tensor it changed and where. :mod:`gradwatch.diagnose.autograd` looks the failing node
up in these records.

Tracing runs only on the first watched step and while the engine is escalated. On other steps the cost
is a forward pre-hook on the model (and, when the model's own forward may not be called, on its direct
children: Lightning modules and container models), each one Python call that reads a flag. A traced
forward enters a :class:`~torch.overrides.TorchFunctionMode` and registers global module hooks for its
duration only; a forward hook registered with ``always_call=True`` leaves both again, also when the
forward raises. Nothing here touches saved tensors (no ``saved_tensors_hooks``, which would switch off
PyTorch's own in-place version check), so tracing cannot turn an error into a wrong gradient.
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gradwatch.core.failures import internal_warning
from gradwatch.core.params import user_module
from gradwatch.observe.module_hooks import owned

#: Direct children hooked at most (beyond this only the root is hooked).
MAX_CHILDREN = 32
#: Forwards traced at most before the first optimizer step (a loop that runs many forwards before it
#: steps pays the tracing cost only for these).
MAX_FIRST_FORWARDS = 16

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package root


@dataclass
class OpRecord:
    """A traced op output: which op, in which module, of what shape, at which version."""

    node: Any  # the output's grad_fn (held for the traced step only: nodes cannot be weakly referenced)
    op: str
    module: str | None
    shape: tuple[int, ...]
    version: int
    tensor: weakref.ref[torch.Tensor]
    source: str | None
    modified_by: list[InplaceRecord] = field(default_factory=list)


@dataclass
class InplaceRecord:
    """A traced in-place op: the tensor it changed, the op, the module and source line."""

    tensor: weakref.ref[torch.Tensor]
    base: weakref.ref[torch.Tensor] | None
    op: str
    module: str | None
    source: str | None
    version_before: int
    version_after: int


def func_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    return {
        "__iadd__": "+=",
        "__isub__": "-=",
        "__imul__": "*=",
        "__itruediv__": "/=",
        "__setitem__": "x[idx] = ...",
    }.get(name, name)


def library_frame(frame: Any, extra: tuple[str, ...] = ()) -> bool:
    """A frame of torch's or gradwatch's own code (or of a top-level package in ``extra``), not the user's."""
    fname = frame.f_code.co_filename
    if fname.startswith((_TORCH_DIR, _OWN_DIR)):
        return True
    return bool(extra) and str(frame.f_globals.get("__name__", "")).split(".")[0] in extra


def traceback_entries(exc: BaseException, limit: int | None = None) -> list[tuple[Any, int]]:
    """``(frame, line it raised at)`` for each frame of ``exc``'s traceback, outermost first (at most ``limit``)."""
    out: list[tuple[Any, int]] = []
    tb = exc.__traceback__
    while tb is not None and (limit is None or len(out) < limit):
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def user_source(depth: int = 2, limit: int = 12) -> str | None:
    """``file:line`` of the nearest caller outside torch and gradwatch."""
    try:
        frame: Any = sys._getframe(depth)
    except ValueError:
        return None
    for _ in range(limit):
        if frame is None:
            return None
        if not library_frame(frame):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


class _RecordingMode(TorchFunctionMode):
    def __init__(self, tracer: ForwardTracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        out_kw = kwargs.get("out")
        before = first._version if first is not None else 0
        before_out = out_kw._version if isinstance(out_kw, torch.Tensor) else 0
        # Other tensor arguments a function writes in place (F.embedding with max_norm renormalizes its
        # weight, the second argument), checked by version like the first.
        others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor) and a is not out_kw]
        versions = [a._version for a in others]
        result = func(*args, **kwargs)
        try:
            written = [(a, v) for a, v in zip(others, versions) if a._version != v]
            self.tracer.record(
                func, first, before, out_kw, before_out, result, kwargs.get("inplace") is True, written
            )
        except Exception as exc:  # noqa: BLE001 - tracing must never change what the model computes
            internal_warning("forward tracer", exc)
        return result


def _changed(
    first: torch.Tensor | None,
    before: int,
    out_kw: Any,
    before_out: int,
    written: list[tuple[torch.Tensor, int]] | None,
) -> list[tuple[torch.Tensor, int]]:
    """The tensors an op wrote in place, each with its version before the op: ``written`` (known to the
    caller), its first argument and its ``out=`` tensor when their versions moved."""
    changed: list[tuple[torch.Tensor, int]] = list(written or ())
    if first is not None and first._version != before:
        changed.append((first, before))
    if isinstance(out_kw, torch.Tensor) and out_kw._version != before_out:
        changed.append((out_kw, before_out))
    return changed


class ForwardTracer:
    """Engine extension: module-level forward tracing on the first step and while escalated.

    Attributes:
        records: Traced op outputs of the current traced step, by ``id`` of their ``grad_fn``.
        inplace: Traced in-place ops of the current traced step.
        traced_step: Whether the records belong to the step now running.
        last_forward_grad_enabled: Grad mode during the most recent watched forward (every step; cheap).
        step_seq: Autograd sequence number at the most recent check: nodes numbered below it belong to
            graphs built before that optimizer step.
        prev_step_seq: The same at the check before (with several optimizers, nodes numbered between the
            two were built in the current iteration, before another optimizer's step).
    """

    def __init__(self, integration: str = "plain") -> None:
        self.integration = integration
        self.engine: Any = None
        self.records: dict[int, OpRecord] = {}
        self.inplace: list[InplaceRecord] = []
        self._by_tensor: dict[int, OpRecord] = {}
        self.traced_step = False
        self.last_forward_grad_enabled: bool | None = None
        self.last_forward_inference: bool = False
        self.step_seq: int | None = None
        self.prev_step_seq: int | None = None
        self._first_forwards = 0  # traced forwards of the first step; MAX_FIRST_FORWARDS once it is over
        self._handles: list[Any] = []
        self._trace_handles: list[Any] = []
        self._mode: _RecordingMode | None = None
        self._starter: nn.Module | None = None
        self._stack: list[str | None] = []
        self._names: dict[int, str] = {}

    # -- set-up -----------------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        self.engine = engine
        model = engine.model
        if model is None or is_compiled(model):
            # Hooks on a compiled model run inside Dynamo's trace (a TorchFunctionMode there costs graph
            # breaks and recompiles): autograd errors then get the untraced, approximate module names.
            return
        # Under Lightning Fabric the user's module: Fabric runs its training_step without the wrapper's __call__.
        model = user_module(model)
        targets = [model]
        children = list(model.children())
        steps = self.integration == "lightning" or callable(getattr(model, "training_step", None))
        if (steps or type(model).forward is nn.Module.forward) and len(children) <= MAX_CHILDREN:
            # The model's own forward may never run (a LightningModule's training_step calling
            # self.encoder(x), under the Trainer or Fabric; a ModuleDict of generator and discriminator).
            targets.extend(children)
        for m in targets:
            self._handles.append(owned(m, m.register_forward_pre_hook(self._on_pre)))
            self._handles.append(owned(m, m.register_forward_hook(self._on_post, always_call=True)))

    @property
    def wanted(self) -> bool:
        """Whether the next forward is traced: first step, or escalated."""
        return self._first_forwards < MAX_FIRST_FORWARDS or bool(getattr(self.engine, "escalated", False))

    # -- per step (cheap) -------------------------------------------------------------------------
    def _on_pre(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        try:
            grad = torch.is_grad_enabled()
            self.last_forward_grad_enabled = grad
            self.last_forward_inference = torch.is_inference_mode_enabled()
            if self._mode is not None or not grad or not self.wanted:
                return
            self._begin(module)
        except Exception as exc:  # noqa: BLE001
            internal_warning("forward tracer (pre-hook)", exc)

    def _on_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._starter is module:
            self._end()

    # -- traced forward ---------------------------------------------------------------------------
    def _begin(self, module: nn.Module) -> None:
        if not self.traced_step:
            self._clear()
            self.traced_step = True
        self._names = dict(self.engine.index.module_name)
        self._first_forwards += 1
        self._starter = module
        self._stack = [self._names.get(id(module))]
        reg = torch.nn.modules.module
        self._trace_handles = [
            reg.register_module_forward_pre_hook(self._on_module_pre),
            reg.register_module_forward_hook(self._on_module_post, always_call=True),
        ]
        self._mode = _RecordingMode(self)
        self._mode.__enter__()

    def _end(self) -> None:
        mode, self._mode = self._mode, None
        self._starter = None
        for h in self._trace_handles:
            h.remove()
        self._trace_handles = []
        self._stack = []
        if mode is not None:
            try:
                mode.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001
                internal_warning("forward tracer (exit)", exc)

    def _on_module_pre(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        self._stack.append(name if name is not None else (self._stack[-1] if self._stack else None))

    def _on_module_post(self, module: nn.Module, args: Any, output: Any) -> None:
        try:
            self._record_module_output(module, output)
        except Exception as exc:  # noqa: BLE001 - tracing must never change what the model computes
            internal_warning("forward tracer (module output)", exc)
        if len(self._stack) > 1:
            self._stack.pop()

    def _record_module_output(self, module: nn.Module, output: Any) -> None:
        """Record a module's outputs that no traced op produced: a custom ``autograd.Function.apply`` does not
        go through ``__torch_function__``, so its output is known only here, as the module's output."""
        for t in _tensors(output):
            node = t.grad_fn
            if node is None or self.record_for(node) is not None:
                continue
            rec = OpRecord(
                node=node,
                op=node_op(node),
                module=self._stack[-1] if self._stack else self._names.get(id(module)),
                shape=tuple(t.shape),
                version=t._version,
                tensor=weakref.ref(t),
                source=user_source(2),  # the line that called the module
            )
            self.records[id(node)] = rec
            self._by_tensor.setdefault(id(t), rec)

    def record(
        self,
        func: Any,
        first: torch.Tensor | None,
        before: int,
        out_kw: Any,
        before_out: int,
        result: Any,
        inplace_flag: bool = False,
        written: list[tuple[torch.Tensor, int]] | None = None,
    ) -> None:
        module = self._stack[-1] if self._stack else None
        changed = _changed(first, before, out_kw, before_out, written)
        outs = _tensors(result)
        if not changed and not any(t.grad_fn is not None for t in outs):
            return
        name = func_name(func) + ("(inplace=True)" if inplace_flag else "")
        source = user_source(3)  # here, so that the depth counts from the op's caller
        for t, v in changed:
            self._record_inplace(t, v, name, module, source)
        for t in outs:
            node = t.grad_fn
            if node is None:
                continue
            rec = OpRecord(
                node=node,
                op=name,
                module=module,
                shape=tuple(t.shape),
                version=t._version,
                tensor=weakref.ref(t),
                source=source,
            )
            if id(node) not in self.records or not changed:
                self.records[id(node)] = rec
            if not changed:
                self._by_tensor[id(t)] = rec

    def _record_inplace(
        self, t: torch.Tensor, version_before: int, name: str, module: str | None, source: str | None
    ) -> None:
        """An in-place change of ``t`` by op ``name``, attached to the traced output it changed."""
        base = t._base
        event = InplaceRecord(
            tensor=weakref.ref(t),
            base=weakref.ref(base) if base is not None else None,
            op=name,
            module=module,
            source=source,
            version_before=version_before,
            version_after=t._version,
        )
        self.inplace.append(event)
        # Attach it to the traced output it changed (the tensor itself or the base it is a view of),
        # while the Python object is certainly alive.
        for target in (t, base):
            if target is None:
                continue
            rec = self._by_tensor.get(id(target))
            if rec is not None and rec.tensor() is target:
                rec.modified_by.append(event)

    # -- look-ups ---------------------------------------------------------------------------------
    def record_for(self, node: Any) -> OpRecord | None:
        """The traced record of an autograd node, if this step was traced."""
        rec = self.records.get(id(node))
        return rec if rec is not None and rec.node is node else None

    def modifications_of(self, record: OpRecord) -> list[InplaceRecord]:
        """Traced in-place ops that changed ``record``'s output (directly or through a view)."""
        return list(record.modified_by)

    def before_inplace(self, record: OpRecord) -> tuple[OpRecord, InplaceRecord] | None:
        """When ``record`` is an in-place op's own output (``z /= n`` gives ``z`` the node ``DivBackward0``),
        the record of the value it overwrote and the in-place event: autograd saved that earlier value."""
        t = record.tensor()
        if t is None:
            return None
        event = next((e for e in self.inplace if e.tensor() is t), None)
        original = self._by_tensor.get(id(t))
        if event is None or original is None or original is record or original.tensor() is not t:
            return None
        return original, event

    def find(self, op: str, shape: tuple[int, ...], version: int | None = None) -> list[OpRecord]:
        """Traced records by op name (``"Sigmoid"`` matches ``SigmoidBackward0``) and shape."""
        out = []
        for rec in self.records.values():
            if rec.shape != shape or not _node_matches(rec.node, op):
                continue
            if version is not None:
                t = rec.tensor()
                if t is not None and t._version != version:
                    continue
            out.append(rec)
        return out

    # -- engine protocol --------------------------------------------------------------------------
    def before_sync(self, ctx: Any) -> None:
        # The first watched step reached its update: from now on only escalation traces.
        self._first_forwards = MAX_FIRST_FORWARDS
        # Autograd nodes numbered below this were created before this update (an earlier step's graph).
        self.prev_step_seq, self.step_seq = self.step_seq, next_sequence_nr()
        if self._mode is None and self.traced_step:
            self._clear()
            self.traced_step = False

    def end_trace(self) -> None:
        """Leave a traced forward that is still open (an exception unwound past the hooks)."""
        if self._mode is not None:
            self._end()

    def close(self) -> None:
        self.end_trace()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._clear()
        self.traced_step = False

    def _clear(self) -> None:
        self.records = {}
        self.inplace = []
        self._by_tensor = {}


_GET_SEQUENCE_NR = getattr(getattr(torch._C, "_autograd", None), "_get_sequence_nr", None)


def next_sequence_nr() -> int | None:
    """The sequence number the next autograd node of this thread gets (nodes are numbered in creation order)."""
    try:
        return int(_GET_SEQUENCE_NR()) if _GET_SEQUENCE_NR is not None else None
    except Exception:  # noqa: BLE001
        return None


def is_compiled(model: nn.Module) -> bool:
    """``torch.compile(model)`` (an ``OptimizedModule``), ``model.compile()``, or a compiled ``forward``
    (what Lightning makes of ``trainer.fit(torch.compile(module))``)."""
    if getattr(model, "_compiled_call_impl", None) is not None or getattr(model, "_compiler_ctx", None):
        return True
    if hasattr(getattr(model, "forward", None), "_torchdynamo_orig_callable"):
        return True
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001 - no Dynamo in this build
        return False
    return isinstance(model, OptimizedModule) or any(isinstance(m, OptimizedModule) for m in model.children())


def node_op(node: Any) -> str:
    """``SigmoidBackward0`` -> ``Sigmoid``; ``torch::autograd::AccumulateGrad`` -> ``AccumulateGrad``."""
    name = node.name() if hasattr(node, "name") else type(node).__name__
    name = name.rsplit("::", 1)[-1]
    i = name.find("Backward")
    return name[:i] if i > 0 else name


def _node_matches(node: Any, op: str) -> bool:
    return node_op(node) == op
