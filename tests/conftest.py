"""Fixtures (plain helpers live in ``helpers.py``) and the Hypothesis profiles."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import (  # noqa: F401  (re-exported: some test files import them from here)
    LIGHTNING_NAMESPACES,
    lightning_namespace,
    plain_console,
    single_thread,
    tiny_data,
    tiny_module,
    tiny_trainer,
)
from helpers import no_internal_failures as _no_internal_failures
from hypothesis import HealthCheck, settings

# Property-based tests: "ci" (default) is small and deterministic; HYPOTHESIS_PROFILE=long explores more.
_NO_DEADLINE = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", max_examples=15, derandomize=True, database=None, print_blob=True, **_NO_DEADLINE)
settings.register_profile("long", max_examples=400, **_NO_DEADLINE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def text_console() -> Any:
    """A rich console that renders plain text into a buffer: ``console.file.getvalue()``."""
    return plain_console()


@pytest.fixture(params=LIGHTNING_NAMESPACES)
def pl_ns(request: pytest.FixtureRequest) -> Any:
    """Each installed Lightning namespace in turn."""
    return lightning_namespace(request.param)


@pytest.fixture
def lightning_pytorch() -> Any:
    return lightning_namespace("lightning.pytorch")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The test runs with torch on one thread (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    with single_thread():
        yield


@pytest.fixture
def no_internal_failures() -> Iterator[None]:
    """The test fails if gradwatch reports a failure of its own (a GradWatchInternalWarning)."""
    with _no_internal_failures():
        yield
