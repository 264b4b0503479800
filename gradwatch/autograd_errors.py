"""Explain autograd errors (in-place modification, backward twice, no grad_fn, non-scalar backward)."""

from __future__ import annotations

from typing import Any

from gradwatch.findings import Finding


def explain(exc: BaseException, *, engine: Any, step: int) -> Finding | None:
    """A finding explaining ``exc`` if it is a known autograd error, else None."""
    return None
