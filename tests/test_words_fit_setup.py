"""Findings whose words must fit the user's set-up: a fix that says to add what the run already has, a flag
that is already set, or a step other than the one where things went wrong, is untrue for that user.

Real tiny training loops on CPU (plain loops, Lightning, two-process DDP on gloo); no mocks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import plain_console
from torch import nn

import gradwatch

pytestmark = pytest.mark.usefixtures("no_internal_failures")


# == DDP(find_unused_parameters=True) with a layer that forward never calls ===========================
REAL_DIST_WORKER = os.path.join(os.path.dirname(__file__), "_real_dist_worker.py")


@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with gloo is needed",
)
def test_none_grad_under_ddp_with_find_unused_parameters_does_not_ask_for_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import test_distributed

    monkeypatch.setattr(test_distributed, "WORKER", REAL_DIST_WORKER)
    codes, logs = test_distributed.launch(str(tmp_path), "unused_dynamic", timeout=60)
    assert codes == [0, 0], f"a rank failed or hung: {codes}\n" + "\n".join(logs)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())["unused_dynamic"]
        assert not isinstance(result.get("error"), str), result.get("error")
        (f,) = [f for f in result["findings"] if f["kind"] == "none_grad"]
        assert f["params"] == ["aux.weight", "aux.bias"]
        why, fix = f["explanation"]["why"], f["explanation"]["fix"]
        # It is set already: asking for it is untrue; what is true is that the layer is unused every step.
        assert "require find_unused_parameters=True" not in why
        assert "already has find_unused_parameters=True" in why and "unused on every step" in why
        assert "traverse the autograd graph after every forward" in why
        assert fix.startswith("remove them from the model, or use them in forward")
