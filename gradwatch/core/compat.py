"""What differs between the Python versions gradwatch runs on (3.10 and newer)."""

from __future__ import annotations

import operator
from typing import Any


def _call(fn: Any, /, *args: Any) -> Any:
    return fn(*args)


#: ``operator.call`` (Python 3.11+: a C function, so ``map(call, fns, ...)`` calls each with no Python frame
#: of its own); on 3.10, a plain function that does the same.
call = getattr(operator, "call", _call)
