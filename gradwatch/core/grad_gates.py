"""Trainable parameters that the step's graph reaches only through a custom ``torch.autograd.Function`` and
that got no gradient: did the Function's backward return None for them, or did the training code drop their
gradient after backward (DINO's ``cancel_gradients_last_layer``)?

At the check the two look alike (``.grad`` is None, the graph reaches the parameter). The difference shows
during the next backward: a post-accumulate-grad hook on each such parameter (a few, and only those) notes
whether backward left its ``.grad`` None (the Function returned None) or gave it one (dropped later). The
hook goes as soon as the next check has read it: on healthy steps nothing is watched.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch

#: A custom Function's backward node: (the node's class name, the Function's qualified name).
Gate = tuple[str, str]
Verdict = Literal["pending", "blocked", "dropped"]


def gate_verdict(fired: bool, got: bool) -> Verdict:
    """What a watched parameter's hook saw since it was installed: a gradient at some backward (``got``: the
    training code drops it later, on purpose); backward passes that all left ``.grad`` None (``fired``: the
    Function's backward returns None for it); or no backward reached it yet."""
    if got:
        return "dropped"
    return "blocked" if fired else "pending"


@dataclass
class _Watch:
    gate: Gate
    param: weakref.ref[torch.Tensor]
    handle: Any = None
    fired: bool = False
    got: bool = False


def _on_accumulate(watch: _Watch, param: torch.Tensor) -> None:
    # After backward's AccumulateGrad for this parameter: it runs even when the gradient it got is None.
    watch.fired = True
    if param.grad is not None:
        watch.got = True


class FunctionGates:
    """The parameters behind a custom Function under watch (by id), and those whose verdict is in."""

    def __init__(self) -> None:
        self._watching: dict[int, _Watch] = {}
        #: id(param) -> the Function whose backward returned None for it at every backward watched.
        self.blocked: dict[int, Gate] = {}
        #: ids of parameters whose gradient backward gave and the training code dropped.
        self.dropped: set[int] = set()

    @property
    def watching(self) -> bool:
        return bool(self._watching)

    def suspect(self, param: torch.Tensor, gate: Gate) -> None:
        """Watch ``param`` over the next backward passes (no-op if it is watched or decided already)."""
        key = id(param)
        if key in self._watching or key in self.blocked or key in self.dropped:
            return
        if not hasattr(param, "register_post_accumulate_grad_hook"):
            self.dropped.add(key)  # cannot be told apart: keep today's reading, a gradient dropped on purpose
            return
        watch = _Watch(gate, weakref.ref(param))
        watch.handle = param.register_post_accumulate_grad_hook(functools.partial(_on_accumulate, watch))
        self._watching[key] = watch

    def holds(self, key: int) -> bool:
        """Whether the parameter (by id) is watched, or was found blocked by a Function."""
        return key in self._watching or key in self.blocked

    def settle(self) -> None:
        """Read every watch's verdict: blocked or dropped ones lose their hook; pending ones keep it."""
        for key, watch in list(self._watching.items()):
            verdict = "dropped" if watch.param() is None else gate_verdict(watch.fired, watch.got)
            if verdict == "pending":
                continue
            watch.handle.remove()
            del self._watching[key]
            if verdict == "blocked":
                self.blocked[key] = watch.gate
            else:
                self.dropped.add(key)

    def close(self) -> None:
        for watch in self._watching.values():
            watch.handle.remove()
        self._watching = {}
