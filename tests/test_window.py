"""The escalation window's state: opening once, counting steps, putting anomaly mode back."""

from __future__ import annotations

import torch

from gradwatch.diagnose.window import EscalationWindow


def test_window_opens_once_and_runs_out_after_its_steps_not_counting_its_own() -> None:
    w = EscalationWindow()
    assert w.open(step=3, steps=2) and not w.open(step=4, steps=9)
    assert not w.count_step(3)  # the incident's own step
    assert not w.count_step(4) and w.is_open
    assert w.count_step(5)
    w.close()
    assert not w.is_open and w.start is None


def test_window_puts_anomaly_mode_back_as_it_was() -> None:
    w = EscalationWindow()
    before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    w.anomaly_on()
    assert torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled()
    w.close()
    assert (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) == before
