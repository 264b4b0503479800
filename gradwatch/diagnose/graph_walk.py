"""Walks of the step's autograd graph, from the captured forward calls: the loss code's ops that can make
NaN/Inf (:func:`loss_ops`) and the ops their inputs came from (:func:`loss_op_inputs`), and the leaf tensors
the model's outputs were computed from (:func:`graph_leaves`, :func:`unowned_params`, :func:`gated_leaves`).
Incident path, first steps or suspicious ones only: no walk runs on a healthy step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gradwatch.core.grad_gates import Gate
from gradwatch.diagnose.capture import Call, call_tensors
from gradwatch.diagnose.op_fixes import can_turn_nonfinite, input_op

#: Nodes a walk of the loss code visits at most (beyond that it names nothing).
MAX_LOSS_NODES = 512


def loss_ops(calls: Sequence[Call]) -> list[str]:
    """Backward nodes of the loss code (between the model's outputs and the observed losses) whose op
    can turn finite values into NaN/Inf (log, sqrt, division, fractional pow, exp...).

    Read after the backward, when the nodes no longer hold their saved values: which of them produced
    the value cannot be told here, only that they are there. Empty when the walk does not end at the
    model's outputs (then it would name the model's own ops).
    """
    return [node.name() for node in _loss_nodes(calls)]


def loss_op_inputs(calls: Sequence[Call]) -> dict[str, str]:
    """For each op of :func:`loss_ops` whose calls all take their input from one op: that op (``{"LogBackward0":
    "Sigmoid"}`` for ``torch.log(torch.sigmoid(z))``), which some fixes are keyed on."""
    found: dict[str, set[str | None]] = {}
    for node in _loss_nodes(calls):
        found.setdefault(node.name(), set()).add(input_op(node))
    return {name: next(iter(ops)) for name, ops in found.items() if len(ops) == 1 and None not in ops}  # type: ignore[misc]


def _loss_nodes(calls: Sequence[Call]) -> list[Any]:
    """The nodes :func:`loss_ops` names."""
    stops = {n for c in calls for n in c.nodes if n is not None}
    roots = [l.grad_fn for c in calls for l in c.losses if l.grad_fn is not None]
    if not roots or not stops:
        return []
    seen: set[Any] = set()
    frontier: list[Any] = list(roots)
    reached = False
    nodes: list[Any] = []
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        if node in stops:
            reached = True
            continue
        seen.add(node)
        if len(seen) > MAX_LOSS_NODES:
            return []
        if type(node).__name__ == "AccumulateGrad":
            continue
        if can_turn_nonfinite(node):
            nodes.append(node)
        frontier.extend(nxt for nxt, _ in node.next_functions)
    return nodes if reached else []


def output_nodes(calls: Sequence[Call], *, reached: bool = False) -> list[Any]:
    """The autograd nodes of the calls' outputs (``reached``: only those a gradient arrived at in backward)."""
    return [
        n
        for c in calls
        for n, i in zip(c.nodes, c.node_index or range(len(c.nodes)))
        if n is not None and (not reached or (c.held and i in c.grads))
    ]


def walk_leaves(frontier: list[Any], stops: set[int], limit: int) -> list[torch.Tensor]:
    """The leaf tensors (``AccumulateGrad`` nodes' variables) reached from ``frontier``, not walking past the
    nodes in ``stops`` (ids), at most ``limit`` nodes."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    while frontier and len(seen) < limit:
        node = frontier.pop()
        if id(node) in seen or id(node) in stops:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)
        if var is not None:
            out.append(var)
            continue
        frontier.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return out


def graph_leaves(calls: Sequence[Call], limit: int = 4096, *, reached: bool = False) -> list[torch.Tensor] | None:
    """The leaf tensors (parameters) the calls' outputs were computed from: a walk of their graph (at most
    ``limit`` nodes) that stops at the model's inputs. ``reached``: see :func:`output_nodes`. None when no
    output node is held."""
    frontier = output_nodes(calls, reached=reached)
    if not frontier:
        return None
    stops = {id(t.grad_fn) for t in call_tensors(calls) if t.grad_fn is not None}
    return walk_leaves(frontier, stops, limit)


def custom_function(node: Any) -> str | None:
    """The qualified name of the user's (or a library's) ``torch.autograd.Function`` whose backward ``node`` is,
    or None: another node, or one of torch's own Functions (checkpoint, hooks) or gradwatch's."""
    cls = getattr(node, "_forward_cls", None)
    module = getattr(cls, "__module__", "") or ""
    if cls is None or module.startswith(("torch.", "gradwatch.")):
        return None
    return f"{module}.{getattr(cls, '__qualname__', type(node).__name__)}"


def gated_leaves(
    calls: Sequence[Call], limit: int = 4096, *, reached: bool = False
) -> list[tuple[torch.Tensor, Gate | None]] | None:
    """The leaf tensors the calls' outputs were computed from (as :func:`graph_leaves`), each with the custom
    autograd Function whose backward node every path to it passes through (the nearest one), or None for a
    leaf some path reaches without passing one. Walked a layer at a time: every node reachable without
    crossing a custom Function first, then what lies below each Function met, so a leaf reached both ways is
    never pinned on a Function. At most ``limit`` nodes in all; None when no output node is held."""
    frontier = output_nodes(calls, reached=reached)
    if not frontier:
        return None
    stops = {id(t.grad_fn) for t in call_tensors(calls) if t.grad_fn is not None}
    seen: set[int] = set()
    found: dict[int, tuple[torch.Tensor, Gate | None]] = {}
    layers: list[tuple[Gate | None, list[Any]]] = [(None, frontier)]
    while layers and len(seen) < limit:
        gate, stack = layers.pop(0)
        while stack and len(seen) < limit:
            node = stack.pop()
            if id(node) in seen or id(node) in stops:
                continue
            seen.add(id(node))
            var = getattr(node, "variable", None)
            if var is not None:
                found.setdefault(id(var), (var, gate))
                continue
            below = [nxt for nxt, _ in node.next_functions if nxt is not None]
            function = custom_function(node)
            if function is None:
                stack.extend(below)
            else:
                layers.append(((type(node).__name__, function), below))
    return list(found.values())


def unowned_params(calls: Sequence[Call], known: set[int], limit: int = 4096) -> list[torch.Tensor]:
    """``nn.Parameter`` leaves of the calls' outputs' graph whose ids are not in ``known`` nor among the
    calls' inputs (a perturbation that requires grad, added to the input, is not the model's)."""
    known = known | {id(t) for t in call_tensors(calls)}
    out: list[torch.Tensor] = []
    for var in graph_leaves(calls, limit) or ():
        if isinstance(var, nn.Parameter) and id(var) not in known and all(v is not var for v in out):
            out.append(var)
    return out
