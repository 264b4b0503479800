"""Configuration: every keyword gradwatch accepts, validated once, eagerly.

Both ways in (``gradwatch.watch`` and ``GradWatchCallback``) take exactly these keywords. A bad value
raises ``ValueError`` (or ``TypeError``) naming the keyword, echoing the value and listing what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
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


def _validate(c: Config) -> None:
    if c.on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite={c.on_nonfinite!r} is not one of {', '.join(map(repr, ON_NONFINITE))}")
    if c.log_dir is not None and not isinstance(c.log_dir, str):
        raise TypeError(f"log_dir={c.log_dir!r} must be a path (str or os.PathLike) or None")
    if c.log_dir is not None and not c.log_dir.strip():
        raise ValueError(f"log_dir={c.log_dir!r} is empty; pass a directory, or None to write no logs")
    if not isinstance(c.console, bool):
        try:
            from rich.console import Console as _Console
        except ImportError:  # pragma: no cover - rich is a dependency
            _Console = ()  # type: ignore[assignment,misc]
        if not isinstance(c.console, _Console):
            raise TypeError(f"console={c.console!r} must be True, False or a rich.console.Console")
    for name in ("per_layer", "escalate", "save_batch", "deferred", "rank_agreement"):
        _check_bool(name, getattr(c, name))
    _check_int("every", c.every, minimum=1)
    _check_int("escalate_steps", c.escalate_steps, minimum=1)
    _check_int("histogram_every", c.histogram_every, minimum=0)
    _check_int("tb_flush_every", c.tb_flush_every, minimum=1)
    _check_int("layer_every", c.layer_every, minimum=1)
    _check_int("window", c.window, minimum=4)
    _check_int("dead_steps", c.dead_steps, minimum=1)
    _check_int("rate_limit", c.rate_limit, minimum=0)
    if c.max_skips is not None:
        _check_int("max_skips", c.max_skips, minimum=0)
    if c.exploding_norm is not None:
        _check_positive("exploding_norm", c.exploding_norm)
    _check_positive("spike_factor", c.spike_factor)
    _check_positive("vanishing_ratio", c.vanishing_ratio)
    if c.exploding_ratio is not None:
        _check_positive("exploding_ratio", c.exploding_ratio)
    _check_int("update_ratio_every", c.update_ratio_every, minimum=0)
    band = c.update_ratio_band
    if (
        not isinstance(band, (tuple, list))
        or len(band) != 2
        or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0 for b in band)
        or band[0] >= band[1]
    ):
        raise ValueError(f"update_ratio_band={band!r} must be (low, high) with 0 < low < high, e.g. (1e-6, 0.1)")
    if c.deferred and c.on_nonfinite != "warn":
        raise ValueError(
            f"deferred=True reads each step's statistics one step late, so on_nonfinite={c.on_nonfinite!r} "
            "cannot act on the step; use on_nonfinite='warn' with deferred=True"
        )


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
