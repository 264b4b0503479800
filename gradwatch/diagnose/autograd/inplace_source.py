"""Find, in the user's source, the line that wrote a local tensor in place after autograd saved it.

In-place ops of the training code (``label.fill_(0)`` on a loss target, ``probs.clamp_(min=1e-6)`` on a
model's output) run outside the model's forward, where :class:`gradwatch.observe.tracing.ForwardTracer` records
nothing. On the error path only, the frames of the exception's traceback still hold the user's local
variables: a local bound to the tensor whose version counter is at the version PyTorch reports (or to a
view of it) is the modified tensor, and the function's source names the in-place writes to that
variable. The write that ran last before the raising line is the culprit.
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

#: In-place methods that change flags or sharing, not values (no version bump).
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})


@dataclass(frozen=True)
class SourceWrite:
    """An in-place write to local variable ``name`` in the user's source."""

    name: str
    op: str  # "fill_", "+=", "x[idx] = ..."
    file: str
    line: int
    code: str

    @property
    def source(self) -> str:
        return f"{self.file}:{self.line}: {self.code}"

    @property
    def spelled(self) -> str:
        """``label.fill_()``, ``x +=``, ``x[idx] = ...``."""
        if self.op.endswith("_"):
            return f"{self.name}.{self.op}()"
        return f"{self.name}[idx] = ..." if self.op == "x[idx] = ..." else f"{self.name} {self.op}"


def _patterns(name: str) -> list[tuple[re.Pattern[str], Callable[[re.Match[str]], str]]]:
    var = rf"(?<![\w.]){re.escape(name)}(?:\[[^\]]*\])*"
    return [
        (re.compile(var + r"\.(?P<op>[a-z]\w*_)\("), lambda m: m.group("op")),
        (re.compile(var + r"\s*(?P<op>[-+*/@]=)"), lambda m: m.group("op")),
        (re.compile(rf"(?<![\w.]){re.escape(name)}\[[^\]]*\]\s*=(?!=)"), lambda m: "x[idx] = ..."),
    ]


def _function_lines(frame: Any) -> range:
    code = frame.f_code
    if code.co_name == "<module>":
        return range(1, len(linecache.getlines(code.co_filename)) + 1)
    last = max((end for _start, end, _line in code.co_lines() if end is not None), default=0)
    lines = [line for _s, _e, line in code.co_lines() if line is not None]
    return range(code.co_firstlineno, (max(lines) if lines else last) + 1)


def source_writes(frame: Any, name: str) -> list[SourceWrite]:
    """In-place writes to ``name`` in the source of ``frame``'s function, in line order."""
    fname = frame.f_code.co_filename
    found = []
    for lineno in _function_lines(frame):
        text = linecache.getline(fname, lineno).strip()
        if name not in text or text.startswith("#"):
            continue
        for pattern, op in _patterns(name):
            m = pattern.search(text)
            if m is not None and op(m) not in _NOT_WRITES:
                found.append(SourceWrite(name, op(m), fname, lineno, text))
                break
    return found


def last_write_before(writes: list[SourceWrite], line: int) -> SourceWrite | None:
    """The write that ran last before ``line``: the last one above it (a loop's body otherwise wraps around)."""
    above = [w for w in writes if w.line < line]
    return above[-1] if above else (writes[-1] if writes else None)


def local_writer(
    frames: Iterable[tuple[Any, int]], is_it: Callable[[torch.Tensor], bool]
) -> SourceWrite | None:
    """The in-place write to a local variable of the user's ``frames`` (``(frame, raising line)``, innermost
    first) whose tensor ``is_it`` accepts; None if no such variable is written in place in its source."""
    for frame, line in frames:
        for name, value in list(frame.f_locals.items()):
            if not isinstance(value, torch.Tensor) or not name.isidentifier():
                continue
            try:
                hit = is_it(value)
            except Exception:  # noqa: BLE001 - a tensor subclass or a freed storage: not it
                hit = False
            if hit:
                write = last_write_before(source_writes(frame, name), line)
                if write is not None:
                    return write
    return None
