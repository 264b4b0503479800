"""Configuration validation: one rule per keyword (keyword -> check -> words), messages echo the value."""

from __future__ import annotations

import dataclasses

import pytest

import gradwatch
from gradwatch.core.config import _RULES, Config


def test_every_keyword_has_a_rule() -> None:
    assert {f.name for f in dataclasses.fields(Config)} == {name for name, _check, _words in _RULES}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"on_nonfinite": "ignore"}, ValueError, "on_nonfinite='ignore' is not one of 'warn', 'skip', 'raise'"),
        ({"log_dir": 3}, TypeError, "log_dir=3 must be a path (str or os.PathLike) or None"),
        ({"log_dir": "  "}, ValueError, "log_dir='  ' is empty; pass a directory, or None to write no logs"),
        ({"console": "yes"}, TypeError, "console='yes' must be True, False or a rich.console.Console"),
        ({"escalate": 1}, TypeError, "escalate=1 must be True or False"),
        ({"every": 1.5}, TypeError, "every=1.5 must be an integer >= 1"),
        ({"window": 3}, ValueError, "window=3 must be an integer >= 4"),
        ({"max_skips": -1}, ValueError, "max_skips=-1 must be an integer >= 0"),
        ({"exploding_norm": float("nan")}, ValueError, "exploding_norm=nan must be a finite number > 0"),
        ({"spike_factor": True}, ValueError, "spike_factor=True must be a finite number > 0"),
        ({"update_ratio_band": (0.1, 0.01)}, ValueError, "update_ratio_band=(0.1, 0.01) must be (low, high) with 0 < low < high, e.g. (1e-6, 0.1)"),
        ({"update_ratio_band": (0, 1)}, ValueError, "update_ratio_band=(0, 1) must be (low, high)"),
        ({"deferred": True, "on_nonfinite": "skip"}, ValueError, "deferred=True reads each step's statistics one step late"),
    ],
)
def test_a_bad_value_raises_naming_the_keyword_and_echoing_the_value(kwargs, error, message) -> None:
    with pytest.raises(error) as info:
        Config(**kwargs)
    assert str(info.value).startswith(message)


def test_optional_keywords_accept_none() -> None:
    Config(log_dir=None, max_skips=None, exploding_norm=None, exploding_ratio=None)


def test_the_first_bad_keyword_in_rule_order_is_reported() -> None:
    with pytest.raises(ValueError, match=r"^on_nonfinite="):
        Config(on_nonfinite="x", window=1)
    assert gradwatch.Config is Config
