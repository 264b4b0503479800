"""What every autograd error explainer reads: the exception's frames, the run's names, the autograd graph.

:class:`Context` holds the exception, the run's engine and its forward tracer, and the traceback's frames
(with the line each raised at). The functions below walk the autograd graph from the loss on the error
path only: the nodes, their saved tensors and the model parameters around them.
"""

from __future__ import annotations

import linecache
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gradwatch.core.params import user_module
from gradwatch.observe.tracing import ForwardTracer, node_op, traceback_entries

#: Autograd nodes visited at most when walking a graph (the error path only).
MAX_NODES = 200_000

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package root
_LIBRARY_MARKERS = (
    os.sep + "lightning" + os.sep,
    os.sep + "pytorch_lightning" + os.sep,
    os.sep + "lightning_fabric" + os.sep,
)


#: Forward ops (from node names) and the module classes that usually run them.
OP_MODULES = {
    "Sigmoid": ("Sigmoid",),
    "Tanh": ("Tanh",),
    "Relu": ("ReLU",),
    "Threshold": ("ReLU", "Threshold"),
    "Gelu": ("GELU",),
    "Silu": ("SiLU",),
    "Elu": ("ELU",),
    "LeakyRelu": ("LeakyReLU",),
    "Hardtanh": ("Hardtanh", "ReLU6"),
    "Softmax": ("Softmax",),
    "LogSoftmax": ("LogSoftmax",),
    "Addmm": ("Linear",),
    "Mm": ("Linear",),
    "Convolution": ("Conv1d", "Conv2d", "Conv3d"),
    "NativeLayerNorm": ("LayerNorm",),
    "NativeBatchNorm": ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d"),
    "Exp": (),
}


@dataclass
class Context:
    exc: BaseException
    engine: Any
    step: int
    tracer: ForwardTracer | None
    frames: list[Any] = field(default_factory=list)
    #: The line each frame raised at (``frame.f_lineno`` moves on: a ``with`` block's frame is at the ``with``).
    lines: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for frame, line in traceback_entries(self.exc):
            self.frames.append(frame)
            self.lines[id(frame)] = line

    def source_of(self, frame: Any) -> str:
        """``file:line: code`` of a frame of the traceback, at the line it raised from."""
        fname = frame.f_code.co_filename
        lineno = self.lines.get(id(frame), frame.f_lineno)
        line = linecache.getline(fname, lineno).strip()
        return f"{fname}:{lineno}: {line}" if line else f"{fname}:{lineno}"

    @property
    def index(self) -> Any:
        return self.engine.index

    @property
    def model(self) -> Any:
        """The user's model: under Lightning Fabric the module ``fabric.setup`` wrapped, not its wrapper."""
        return user_module(self.engine.model)

    def roots(self) -> list[torch.Tensor]:
        """The tensors backward was called on, from the traceback frames (innermost first)."""
        found: list[torch.Tensor] = []
        for frame in reversed(self.frames):
            code = frame.f_code
            fname = code.co_filename
            if not fname.startswith(_TORCH_DIR):
                continue
            local = frame.f_locals
            if code.co_name == "backward" and fname.endswith(os.path.join("torch", "_tensor.py")):
                cands: Any = [local.get("self")]
            elif code.co_name in ("backward", "grad") and fname.endswith(os.path.join("autograd", "__init__.py")):
                cands = local.get("tensors", local.get("outputs"))
            elif code.co_name == "_engine_run_backward":
                cands = local.get("t_outputs")
            else:
                continue
            if isinstance(cands, torch.Tensor):
                cands = [cands]
            for t in cands or ():
                if isinstance(t, torch.Tensor) and not any(t is f for f in found):
                    found.append(t)
            if found:
                break
        return found

    def user_frames(self) -> list[Any]:
        """Frames of the user's code (not torch, gradwatch or Lightning), outermost first."""
        return [f for f in self.frames if is_user_file(f.f_code.co_filename)]

    def module_name(self, module: Any) -> str | None:
        return self.index.module_name.get(id(module))

    def user_name(self, raw: str, module: Any) -> str:
        """A module's path as the user wrote it (without wrapper segments: DDP's ``module``, Fabric's
        ``_forward_module``); ``raw``, its path in the model walked, when the index does not know it."""
        name = self.module_name(module)
        return raw if name is None else name

    def display_module(self, name: str | None) -> str | None:
        if name is None:
            return None
        if name == "":
            model = self.model
            return f"<root {type(model).__name__}>" if model is not None else "<root>"
        return name

    def param_of(self, node: Any) -> tuple[str, str] | None:
        """(parameter name, module name) of an AccumulateGrad node's variable, if the model owns it."""
        var = getattr(node, "variable", None)
        if var is None:
            return None
        name = self.index.param_name.get(id(var))
        if name is None:
            return None
        return name, self.index.param_module.get(id(var), "")


def is_user_file(fname: str) -> bool:
    if fname.startswith((_TORCH_DIR, _OWN_DIR)):
        return False
    if any(m in fname for m in _LIBRARY_MARKERS):
        return False
    return not fname.startswith("<frozen")


def with_line(source: str | None) -> str | None:
    """``file:line`` -> ``file:line: <code>``."""
    if not source:
        return source
    fname, _, lineno = source.rpartition(":")
    line = linecache.getline(fname, int(lineno)).strip() if lineno.isdigit() else ""
    return f"{source}: {line}" if line else source


def walk(roots: list[torch.Tensor]) -> Iterator[tuple[Any, int]]:
    """Breadth-first over the autograd graph from ``roots``: (node, depth)."""
    seen: set[int] = set()
    queue: deque[tuple[Any, int]] = deque()
    for r in roots:
        if r.grad_fn is not None:
            queue.append((r.grad_fn, 0))
    keep: list[Any] = []  # hold visited nodes so their ids stay unique during the walk
    while queue and len(keep) < MAX_NODES:
        node, depth = queue.popleft()
        if id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        yield node, depth
        for child, _ in getattr(node, "next_functions", ()):
            if child is not None and id(child) not in seen:
                queue.append((child, depth + 1))


def children(node: Any) -> list[Any]:
    return [c for c, _ in getattr(node, "next_functions", ()) if c is not None]


def saved_error(node: Any) -> str | None:
    """The error raised when reading one of ``node``'s saved tensors, if any."""
    for attr in dir(node):
        # ``saved_tensors``: what a custom autograd.Function saved with ctx.save_for_backward
        if not attr.startswith("_saved_") and attr != "saved_tensors":
            continue
        try:
            getattr(node, attr)
        except RuntimeError as e:
            return str(e)
        except Exception:  # noqa: BLE001, S112 - an attribute that is not a tensor: nothing to learn
            continue
    return None


def upstream_param(ctx: Context, node: Any, limit: int = 2000) -> tuple[str, str] | None:
    """The nearest model parameter feeding ``node`` (breadth-first toward the inputs)."""
    seen: set[int] = set()
    queue: deque[Any] = deque(children(node))
    keep: list[Any] = []
    while queue and len(keep) < limit:
        n = queue.popleft()
        if id(n) in seen:
            continue
        seen.add(id(n))
        keep.append(n)
        found = ctx.param_of(n)
        if found is not None:
            return found
        queue.extend(children(n))
    return None


def own_param(ctx: Context, node: Any) -> tuple[str, str] | None:
    """A parameter ``node`` uses directly (through views such as ``TBackward0``): the module it runs in."""
    for child in children(node):
        found = ctx.param_of(child)
        if found is not None:
            return found
        if node_op(child) in (
            "T",
            "Transpose",
            "View",
            "Reshape",
            "Expand",
            "Permute",
            "AsStrided",
            "Unsqueeze",
            "Squeeze",
        ):
            for grandchild in children(child):
                found = ctx.param_of(grandchild)
                if found is not None:
                    return found
    return None


def modules_of_type(ctx: Context, op: str) -> list[tuple[str, Any]]:
    """(user path, module) of the model's modules whose class usually runs ``op``."""
    model = ctx.model
    classes = OP_MODULES.get(op, (op,))
    if model is None or not classes:
        return []
    return [(ctx.user_name(name, m), m) for name, m in model.named_modules() if type(m).__name__ in classes]




def node_op_name(raw: str) -> str:
    """``SigmoidBackward0`` or ``Sigmoid`` -> ``Sigmoid``."""
    raw = raw.rsplit("::", 1)[-1]
    i = raw.find("Backward")
    return raw[:i] if i > 0 else raw


def versions_text(now: int, expected: int) -> str:
    changes = now - expected
    return f"saved at version {expected}, now at version {now} ({changes} in-place change{'s' if changes != 1 else ''})"


def user_frames_innermost(ctx: Context) -> list[tuple[Any, int]]:
    return [(f, ctx.lines.get(id(f), f.f_lineno)) for f in reversed(ctx.user_frames())]


def local_name(ctx: Context, tensor: torch.Tensor) -> str | None:
    """The name of a local variable of the user's code that holds ``tensor`` (innermost frame first)."""
    for frame in reversed(ctx.user_frames()):
        for k, v in list(frame.f_locals.items()):
            if v is tensor:
                return k
    return None
