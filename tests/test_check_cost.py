"""What a checked step costs, counted rather than timed: the tensor ops gradwatch adds to a training step,
how often it reads the gradients, and the Python frames it runs.

The counts do not move with the machine's load. The tensor side is pinned as a whole (one fused norm of
every gradient, a handful of small ops, whatever the model's size); the Python side as its growth: the
frames gradwatch runs in a healthy training step are the same for a 3-layer and a 12-layer model (no
Python loop over the parameters or layers on the usual step: those run as C loops).
"""

from __future__ import annotations

import collections
import io
import os
import sys
from typing import Any

import torch
from rich.console import Console
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradwatch

GRADWATCH_DIR = os.path.dirname(os.path.abspath(gradwatch.__file__)) + os.sep
#: Tensor ops gradwatch adds to a healthy step of these models (same-shape layers on the CPU): the norms of the
#: weights' and the biases' gradients (each shape's gradients stacked, one norm per row: ``stack`` and
#: ``linalg_vector_norm``, twice), joined and put back in the parameters' order (``cat``, ``index``), the
#: representative's norm for the clip ratio, the observed loss (``detach``, ``view``) and the one ``cat``
#: read back by the step's single sync. Whatever the depth: one pair of ops per shape, not per layer.
OPS_PER_STEP = 12


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops, and the gradient elements that norm ops read."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.params = params
        self.ops: collections.Counter[str] = collections.Counter()
        self.norm_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        self.ops[name] += 1
        if "norm" in name or name.startswith(("aten.stack", "aten.cat", "aten.dot")):  # what reads gradients
            grads = {id(p.grad) for p in self.params if p.grad is not None}
            for a in args:
                for t in a if isinstance(a, (list, tuple)) else [a]:
                    if isinstance(t, torch.Tensor) and id(t) in grads:
                        self.norm_reads += t.numel()
        return func(*args, **(kwargs or {}))


def make_model(depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        lin = nn.Linear(16, 16)
        nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")  # healthy gradients at any depth
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(4)]


def train(depth: int, steps: int, watched: bool, measure: Any) -> list[Any]:
    """Train ``steps`` steps (observing the loss when watched); ``measure(model)`` wraps each step from the
    13th on (past the first checks, which measure more) and returns what it counted."""
    model = make_model(depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = data()
    out = []
    gw = gradwatch.watch(model, opt, console=Console(file=io.StringIO())) if watched else None
    try:
        for i in range(steps):
            x, y = batches[i % len(batches)]
            with measure(model) if i >= 12 else _Nothing() as counted:
                loss = nn.functional.mse_loss(model(x), y)
                if gw is not None:
                    gw.observe_loss(loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
            if i >= 12:
                out.append(counted.result())
    finally:
        if gw is not None:
            assert not gw.findings, [f.kind for f in gw.findings]
            gw.close()
    return out


class _Nothing:
    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Ops:
    def __init__(self, model: nn.Module) -> None:
        self.counter = OpCounter(list(model.parameters()))

    def __enter__(self) -> _Ops:
        self.counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.counter.__exit__(*exc)

    def result(self) -> tuple[int, int]:
        return sum(self.counter.ops.values()), self.counter.norm_reads


class _Frames:
    """Python frames started in gradwatch's files (functions, comprehensions, generator resumptions)."""

    def __init__(self, model: nn.Module) -> None:
        self.n = 0

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(GRADWATCH_DIR):
            self.n += 1

    def __enter__(self) -> _Frames:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)

    def result(self) -> int:
        return self.n


def test_a_checked_step_adds_a_few_ops_and_reads_each_gradient_once() -> None:
    for depth in (3, 12):
        bare = train(depth, 20, watched=False, measure=_Ops)
        watched = train(depth, 20, watched=True, measure=_Ops)
        grad_elements = sum(p.numel() for p in make_model(depth).parameters())
        for (bare_ops, bare_reads), (ops, reads) in zip(bare, watched):
            assert bare_reads == 0
            assert reads == grad_elements, f"depth {depth}: norms read {reads / grad_elements:.2f}x the gradients"
            assert ops - bare_ops <= OPS_PER_STEP, f"depth {depth}: gradwatch added {ops - bare_ops} ops"


def test_python_frames_per_step_do_not_grow_with_the_number_of_parameters() -> None:
    small = train(3, 40, watched=True, measure=_Frames)
    large = train(12, 40, watched=True, measure=_Frames)
    assert small == large, f"per step, 3 layers: {small}; 12 layers: {large}"
