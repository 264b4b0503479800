"""Configuration: every keyword gradwatch accepts, validated once, eagerly.

Both ways in (``gradwatch.watch`` and ``GradWatchCallback``) take exactly these keywords. A bad value
raises ``ValueError`` (or ``TypeError``) naming the keyword, echoing the value and listing what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

OnNonfinite = Literal["warn", "skip", "raise"]
ON_NONFINITE: tuple[str, ...] = get_args(OnNonfinite)


@dataclass(frozen=True)
class Config:
    """gradwatch settings. All have defaults; pass only what you change.

    Attributes:
        on_nonfinite: What to do when a loss or gradient is NaN/Inf before the update: ``"skip"`` (default)
            leaves parameters and optimizer state exactly as they were; ``"warn"`` reports and lets the
            update happen; ``"raise"`` raises :class:`gradwatch.GradWatchError`.
        log_dir: Directory for TensorBoard event files and ``gradwatch.jsonl``; ``None`` writes neither.
        console: Print findings (and a summary at close) with rich: ``True`` uses rich's global console
            (which prints above rich and Lightning progress bars), or pass a ``rich.console.Console``.
        every: Check every N-th optimizer step (1 = every step). Unchecked steps cost nothing and are not
            protected.
        per_layer: Compute and log per-module gradient norms.
        max_skips: After this many consecutive skipped steps, raise instead of skipping forever
            (``None``: never).
        escalate: On a non-finite incident, localize its origin (op and module) and watch the next
            ``escalate_steps`` steps closely with anomaly mode.
        escalate_steps: Length of the escalation window in optimizer steps.
        save_batch: Save the inputs of an escalated incident to ``log_dir/incidents/step_<N>.pt``.
        deferred: Make no device-to-host sync in the step: each step's statistics are read one step
            later. ``"skip"``/``"raise"`` and same-step localization are then unavailable.
        histogram_every: Write gradient histograms every N checked steps (``0``: never; costly).
        tb_flush_every: Flush TensorBoard scalars to disk every N checked steps.
        layer_every: Write the per-layer scalars (``gradwatch/grad_norm/<layer>``) every N checked steps,
            and on every step with a finding; the total norm and the loss are written every checked
            step, the counters whenever they change. Default ``10``: TensorBoard keeps 1,000 points per
            chart anyway, and writing a few dozen per-layer values every step is most of gradwatch's
            logging cost. ``1`` writes them every step.
        exploding_norm: Absolute bound on the total or a layer's gradient norm (``None``, the default: no
            bound, because a good bound depends on the model and loss scale; the adaptive tests below need
            no tuning).
        exploding_ratio: A total gradient norm more than this many times the total parameter norm is
            exploding even without history (e.g. at step 0). Default ``1e4``: healthy runs stay below about
            1 (a gradient step of lr x grad must be small next to the weights), and unscaled AMP gradients
            (x65536 at most, times a healthy <= 0.1) still stay clear of it. The parameter norm is the one of
            that step, or the norm PyTorch's default init gives those weights when they are smaller (a
            small init, N(0, 0.01), is not an explosion from step 0). ``None`` turns it off.
        spike_factor: The total gradient norm is spiking when it is more than this many times its median
            over the last ``window`` checked steps *and* more than 5 robust standard deviations (MAD)
            above it in log space; the loss is spiking when it is more than this many robust spreads
            above its recent median (the spread is at least the median-to-90th-percentile distance and a
            quarter of the median's size, so near-zero, heavy-tailed losses do not flag). Default
            ``10``: a real explosion is orders of magnitude, while warm-up and learning-rate schedules
            move norms by a few times over many steps, which the rolling median follows. Both tests wait
            for 20 checked steps of history.
        window: Number of recent checked steps that the adaptive checks look back over (median, MAD) and
            that a vanishing layer must persist for. Default ``50``: long enough for robust statistics, short
            enough to follow a learning-rate schedule.
        vanishing_ratio: A layer is vanishing when its relative gradient ``||grad|| / ||weights||`` stays
            below this fraction of the typical layer's (the 75th percentile over layers) for ``window``
            checked steps in a row. Default ``1e-4``: in a 10-layer sigmoid MLP the first layers sit at
            1e-5 to 1e-7 of it, while healthy networks keep every layer within about 1e-2 of it (the
            embedding of a 50k-token Transformer sits at ~2e-3). Needs parameter norms
            (``update_ratio_every > 0``); until the first are measured, layers are not compared.
        dead_steps: A layer whose gradient is exactly zero this many checked steps in a row, while other
            layers' are not, is dead. Default ``20``: a live ReLU layer gets a zero gradient on a whole
            batch rarely and never for long.
        update_ratio_every: Measure parameter norms and the update-to-weight ratio
            ``||p_after - p_before|| / ||p_before||`` per layer every N checked steps (logged as
            ``gradwatch/update_ratio/<layer>``). The update of a tensor larger than 4096 elements is
            measured on a fixed random sample of 4096 of them (no copy of the parameters).
            Default ``100``; ``0`` turns it (and the parameter-scale part of ``vanishing_grad`` and
            ``exploding_ratio``) off.
        update_ratio_band: ``(low, high)``: a layer whose update-to-weight ratio stays outside this band
            for 5 measurements in a row is reported. Default ``(1e-6, 0.1)``: the usual band is around
            1e-3; above 0.1 the weights change by a tenth every step (learning rate too high), below 1e-6
            they barely move (learning rate far too low, or a scale problem). Exactly zero updates (a
            frozen layer, ``lr=0``) are not reported.
        rate_limit: Print at most this many findings of one kind to the console (all are recorded).
        rank_agreement: With several processes (``torch.distributed``), fold every rank's verdict into one
            small ``all_reduce`` per checked step so that all ranks skip (or raise on) the same step, and
            rank zero names another rank's problem. It needs every rank to watch and to step together.
            ``False`` (for a rank-conditional ``optimizer.step()``, or a watcher on some ranks only): no
            collective of gradwatch's; each rank decides on its own gradients, which DDP keeps identical.
    """

    on_nonfinite: OnNonfinite = "skip"
    log_dir: str | None = None
    console: Any = True
    every: int = 1
    per_layer: bool = True
    max_skips: int | None = 10
    escalate: bool = True
    escalate_steps: int = 3
    save_batch: bool = False
    deferred: bool = False
    histogram_every: int = 0
    tb_flush_every: int = 50
    layer_every: int = 10
    exploding_norm: float | None = None
    exploding_ratio: float | None = 1e4
    spike_factor: float = 10.0
    window: int = 50
    vanishing_ratio: float = 1e-4
    dead_steps: int = 20
    update_ratio_every: int = 100
    update_ratio_band: tuple[float, float] = (1e-6, 0.1)
    rate_limit: int = 3
    rank_agreement: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.log_dir, os.PathLike):
            object.__setattr__(self, "log_dir", os.fspath(self.log_dir))
        _validate(self)

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)


def keywords() -> tuple[str, ...]:
    """Every configuration keyword, in declaration order."""
    return tuple(f.name for f in fields(Config))


def make_config(**kwargs: Any) -> Config:
    """Build a :class:`Config`, rejecting unknown keywords with the list of known ones."""
    known = keywords()
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise TypeError(
            f"unknown gradwatch option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(_with_suggestion(k, known) for k in unknown)}; known options: {', '.join(known)}"
        )
    if "log_dir" in kwargs and isinstance(kwargs["log_dir"], os.PathLike):
        kwargs["log_dir"] = os.fspath(kwargs["log_dir"])
    return Config(**kwargs)


def _with_suggestion(name: str, known: tuple[str, ...]) -> str:
    """``'on_nonfinte' (did you mean 'on_nonfinite'?)``: the nearest known keyword, when one is near."""
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"{name!r} (did you mean {near[0]!r}?)" if near else repr(name)


def _is_bool(value: Any) -> type[Exception] | None:
    return None if isinstance(value, bool) else TypeError


def _integer_at_least(minimum: int) -> Callable[[Any], type[Exception] | None]:
    def check(value: Any) -> type[Exception] | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return TypeError
        return ValueError if value < minimum else None

    return check


def _finite_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _positive(value: Any) -> type[Exception] | None:
    return None if _finite_number(value) and value > 0 else ValueError


def _optional(check: Callable[[Any], type[Exception] | None]) -> Callable[[Any], type[Exception] | None]:
    return lambda value: None if value is None else check(value)


def _one_of(allowed: tuple[str, ...]) -> Callable[[Any], type[Exception] | None]:
    return lambda value: None if value in allowed else ValueError


def _path(value: Any) -> type[Exception] | None:
    return None if isinstance(value, str) else TypeError


def _not_blank(value: Any) -> type[Exception] | None:
    return None if value.strip() else ValueError


def _console(value: Any) -> type[Exception] | None:
    if isinstance(value, bool):
        return None
    try:
        from rich.console import Console as _Console
    except ImportError:  # pragma: no cover - rich is a dependency
        return TypeError
    return None if isinstance(value, _Console) else TypeError


def _band(value: Any) -> type[Exception] | None:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return ValueError
    if not all(_finite_number(b) and b > 0 for b in value):
        return ValueError
    return None if value[0] < value[1] else ValueError


_INTEGER = "must be an integer >= {}"
_POSITIVE = "must be a finite number > 0"
_BOOL = "must be True or False"

#: Every keyword's checks, in order: (keyword, check, what the value must be). The first failing check
#: raises ``<its exception>("<keyword>=<value!r> <words>")``.
_RULES: tuple[tuple[str, Callable[[Any], type[Exception] | None], str], ...] = (
    ("on_nonfinite", _one_of(ON_NONFINITE), f"is not one of {', '.join(map(repr, ON_NONFINITE))}"),
    ("log_dir", _optional(_path), "must be a path (str or os.PathLike) or None"),
    ("log_dir", _optional(_not_blank), "is empty; pass a directory, or None to write no logs"),
    ("console", _console, "must be True, False or a rich.console.Console"),
    ("per_layer", _is_bool, _BOOL),
    ("escalate", _is_bool, _BOOL),
    ("save_batch", _is_bool, _BOOL),
    ("deferred", _is_bool, _BOOL),
    ("rank_agreement", _is_bool, _BOOL),
    ("every", _integer_at_least(1), _INTEGER.format(1)),
    ("escalate_steps", _integer_at_least(1), _INTEGER.format(1)),
    ("histogram_every", _integer_at_least(0), _INTEGER.format(0)),
    ("tb_flush_every", _integer_at_least(1), _INTEGER.format(1)),
    ("layer_every", _integer_at_least(1), _INTEGER.format(1)),
    ("window", _integer_at_least(4), _INTEGER.format(4)),
    ("dead_steps", _integer_at_least(1), _INTEGER.format(1)),
    ("rate_limit", _integer_at_least(0), _INTEGER.format(0)),
    ("max_skips", _optional(_integer_at_least(0)), _INTEGER.format(0)),
    ("exploding_norm", _optional(_positive), _POSITIVE),
    ("spike_factor", _positive, _POSITIVE),
    ("vanishing_ratio", _positive, _POSITIVE),
    ("exploding_ratio", _optional(_positive), _POSITIVE),
    ("update_ratio_every", _integer_at_least(0), _INTEGER.format(0)),
    ("update_ratio_band", _band, "must be (low, high) with 0 < low < high, e.g. (1e-6, 0.1)"),
)


def _validate(c: Config) -> None:
    for name, check, words in _RULES:
        value = getattr(c, name)
        error = check(value)
        if error is not None:
            raise error(f"{name}={value!r} {words}")
    if c.deferred and c.on_nonfinite != "warn":
        raise ValueError(
            f"deferred=True reads each step's statistics one step late, so on_nonfinite={c.on_nonfinite!r} "
            "cannot act on the step; use on_nonfinite='warn' with deferred=True"
        )
