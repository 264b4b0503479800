"""``exploding_grad``: a gradient norm far too large, by an absolute bound, for the weights, or for this run.

Four tests, any of which fires (thresholds and why in :class:`gradwatch.Config`):

- the norm of the gradient (total or one layer's) overflows float32 although every element is finite;
- the total or a layer's norm is above ``exploding_norm`` (if set);
- the total gradient norm is more than ``exploding_ratio`` times the total parameter norm (needs no
  history, so it also catches a run that explodes from step 0), or than that many times the norm PyTorch's
  default initialization would give those weights when they are smaller than that (a small or zero init
  grows into its scale in the first updates: the gradient of a regression from N(0, 0.01) weights onto
  targets ~1e2 is 2e4x those weights at step 0, and the run is healthy);
- a spike: the total norm is more than ``spike_factor`` times its median over the last ``window`` checked
  steps and more than 5 robust standard deviations (MAD) above it in log space. Because the median rolls,
  warm-up and learning-rate schedules, which move norms gradually, do not trigger it. In a converged run
  (the loss 100x below its early median, or else the norm's median 100x below that of the run's first 20
  checked steps) a spike must also exceed 10x (1x) that early norm: oscillations of full-batch Adam
  around a minimum are not explosions. A spike that stays within the range the run has already shown (at
  most ``RANGE_FACTOR`` x the largest norm of its first ``MIN_HISTORY`` checked steps, of an earlier spike
  that fell back, or of the last ``window``) is reported only if it has not fallen back to half its size
  within ``SETTLE`` checked steps:
  a DQN's hard target-network sync, a lazy-regularization step (StyleGAN2's R1 every 16 steps) or a task
  sampled now and then with a larger loss scale jump that far and fall back at once. A jump beyond that
  range is reported at its step.

A persisting explosion is reported once; it is reported again only after 10 checked steps without one.
An overflowing norm (the update is skipped) is reported even when the episode's growth was reported
before it overflowed. A spike found at the first judged step whose jump started earlier inside the norms it
is judged against is reported at the same step, in words naming the step it started (``data["since"]``).
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gradwatch.checks.scaler_step_bypassed import with_bypass_cause
from gradwatch.core.clipping import clip_advice, clipping_in_place
from gradwatch.core.config import Config
from gradwatch.core.findings import Explanation, Finding
from gradwatch.core.history import History
from gradwatch.core.measured import WANT_PARAM_NORMS, measure_param_norms
from gradwatch.core.stats import StepStats, ZeroGradFacts, layer_norms
from gradwatch.core.trend import (
    EARLY_NORM,
    converged,
    jump_start,
    matching_steps,
    median,
    once_per_check,
    param_norms_of,
    remember_param_norms,
    robust_spread,
    weight_summary,
)

#: Checked steps of history the spike test waits for.
MIN_HISTORY = 20
#: Robust standard deviations (log space) a spike must also clear, so noisy runs need a bigger jump.
SPREADS = 5.0
#: Checked steps without an explosion before a new one is reported again.
REARM = 10

_KEY = "exploding"
#: The median total norm of the run's first ``MIN_HISTORY`` checked steps. In a converged run (see
#: :func:`gradwatch.core.trend.converged`; full-batch Adam oscillates around the minimum) a "spike" must
#: also exceed that early level: a jump back towards it is the oscillation, not an explosion.
_EARLY = EARLY_NORM
#: The largest spike (log excess over the median) reported so far, per optimizer.
_RECORD = "exploding_grad/record"
#: How much larger than every spike reported before a later spike must be to be reported again.
RECORD_FACTOR = 2.0
#: With the loss 100x below its early median, a spike must exceed this many times the early norm.
CONVERGED_FACTOR = 10.0
#: Where the number of trainable tensors the norms are taken over, and the checked steps since, are kept; a
#: change by more than this fraction (layers unfrozen or added) restarts the comparison.
_COUNT = "exploding/count"
COUNT_CHANGE = 0.25
#: The log of the largest total norm of the run's first ``MIN_HISTORY`` checked steps, or of a later spike
#: that fell back (the run has shown that range), per optimizer.
_PEAK = "exploding/peak"
#: A spike at most this many times that peak, or the largest norm of the recent window, is within the range
#: the run has shown: judged by whether it falls back (below) instead of at its step. Gradient norms grow
#: with the weights: a DQN's target sync at step 150 jumps to 1.8-2.2x its first steps' norms.
RANGE_FACTOR = 4.0
#: Checked steps a spike within that range has to fall back below ``1 / FALL`` of its size; one that has
#: not is reported then. A transient (a DQN's target sync: the next norms fall 2.5x, 3x, 5x) falls back at
#: once; a real explosion stays up or keeps growing.
SETTLE = 3
FALL = 2.0
#: Per optimizer, the spike within the run's range that is waiting to fall back (see ``SETTLE``).
_PENDING = "exploding/pending"
#: Notes for remember: the weights' norms measured on this suspicious step, or a measurement wanted next step.
_NOW = "exploding/param_norms"
#: The latest exploding update that was applied (not an overflow, which is skipped) with a gradient at least
#: exploding_ratio x the weights' norm or a learning rate far too high: ``{"step", "factor", "of",
#: "optimizer", "lr"}``. The non-finite steps that follow it within APPLIED_WINDOW steps name it as
#: their likely cause (weights thrown out of range), and so does ``too_many_skips``.
APPLIED = "exploding/applied"
APPLIED_WINDOW = 50
#: A learning rate this large (non-adaptive optimizers: SGD and the like; adaptive: Adam, RMSprop...) is far
#: outside the usual range: an explosion in the first FIRST_STEPS steps is then first the learning rate's.
HUGE_LR = 1.0
HUGE_ADAPTIVE_LR = 0.05
FIRST_STEPS = 20
_ADAPTIVE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "RMSprop", "Adagrad", "Adadelta", "SparseAdam")
_WANT = "exploding/want_param_norms"
#: Per optimizer, ``(step, total norm)`` of the checked steps before the first judged one (since the last
#: restart of the comparison): a spike found at the first judged step names the step its jump started when
#: that lies inside them (see :func:`_started`).
_STEPS = "exploding/steps"
#: A note for remember: where the jump of a spike waiting to fall back started.
_STARTED = "exploding/started"
#: ``v > 0`` as a C call (``0.0 < v``).
_POSITIVE = functools.partial(operator.lt, 0.0)


#: An empty mapping to look things up in before their first entry (never written to).
_NOTHING: dict[Any, Any] = {}


@once_per_check
def _measure(stats: StepStats, history: History) -> dict[str, Any] | None:
    """Config-free facts about this step (the check and ``remember`` both use them)."""
    if not stats.names or stats.is_nonfinite:
        return None
    i = stats.optimizer_index
    memory = history.memory
    recent = history.total_norms.get(i, ())
    # Norms are compared only with steps whose gradients came from about the same tensors: a backbone
    # unfrozen mid-run (or a head joining) adds its gradients to the total, which is no explosion.
    ref = memory.get(_COUNT, _NOTHING).get(i)
    count = len(stats.names) + len(stats.none_grad)  # _trainable(stats)
    if ref is None or (count != ref[0] and abs(count - ref[0]) > COUNT_CHANGE * ref[0]):
        recent, counted = (), (count, 1)
    else:
        counted = (ref[0], ref[1] + 1)
        if ref[1] < len(recent):
            recent = list(recent)[len(recent) - ref[1] :]
    # C loops: this runs on every checked step. The logs of positive finite norms are finite: their median
    # is that of trend.median without its filter.
    logs = sorted(map(math.log, filter(_POSITIVE, recent)))
    n = len(logs)
    m = (logs[n // 2] if n % 2 else 0.5 * (logs[n // 2 - 1] + logs[n // 2])) if n else math.nan
    total = stats.total_norm
    excess = math.log(total) - m if n and total > 0 and math.isfinite(total) else None
    return {
        "total": total,
        "layers": stats.layer_norms or layer_norms(stats.modules, stats.norms),
        "overflow": tuple(stats.overflow_norm),
        "n": len(recent),
        "median": math.exp(m) if n else None,
        "early": memory.get(_EARLY, _NOTHING).get(i),
        "history": weakref.ref(history),  # weakly: once_per_check keeps the latest facts process-wide
        "optimizer": i,
        "excess": excess,
        # Sorted. The spread (a MAD: two sorts) is computed only for a step that already clears spike_factor.
        "logs": logs,
        "param_total": weight_summary(param_norms_of(stats, history))[1],
        # What remember records (the count and the checked steps since), if the reference is still ``ref``.
        "counted": (ref, counted),
        # The spike within the run's range waiting to fall back (None: none), as the check saw it.
        "pending": memory.get(_PENDING, _NOTHING).get(i),
    }


def _trainable(stats: StepStats) -> int:
    """The optimizer's trainable tensors (with a gradient this step or not): it changes when layers are
    unfrozen or added, not when experts of a mixture are idle for a step."""
    return len(stats.names) + len(stats.none_grad)


def _counted(stats: StepStats, ref: tuple[int, int] | None) -> tuple[int, int]:
    """The trainable tensors of the reference and the checked steps since, this step recorded: a change by more
    than COUNT_CHANGE starts them again."""
    count = _trainable(stats)
    if ref is None or abs(count - ref[0]) > COUNT_CHANGE * ref[0]:
        return count, 1
    return ref[0], ref[1] + 1


def _spread(facts: dict[str, Any]) -> float:
    spread = facts.get("spread")
    if spread is None:
        spread = robust_spread(facts["logs"])[1]
        facts["spread"] = spread = spread if math.isfinite(spread) else 0.0
    return spread  # type: ignore[no-any-return]


def _locate(stats: StepStats, history: History, layers: dict[str, float]) -> tuple[str | None, float | None]:
    """The layer that jumped most against its own recent median (or the largest one without history).

    Only needed for a finding: per-layer medians are too costly to compute on every healthy step.
    """
    jumps: dict[str, float] = {}
    for name, v in layers.items():
        med = median(history.layer_series(stats.optimizer_index, name))
        if math.isfinite(med) and med > 0:
            jumps[name] = v / med
    where = max(jumps, key=lambda k: jumps[k]) if jumps else (max(layers, key=lambda k: layers[k]) if layers else None)
    return where, (jumps.get(where) if where is not None else None)


def _reasons(facts: dict[str, Any], config: Config) -> list[str]:
    reasons: list[str] = []
    if facts["overflow"]:
        return ["overflow"]
    bound = config.exploding_norm
    if bound is not None:
        if facts["total"] > bound or any(v > bound for v in facts["layers"].values()):
            reasons.append("bound")
    pt = facts.get("init_scale") or facts["param_total"]
    if config.exploding_ratio is not None and pt and facts["total"] > config.exploding_ratio * pt:
        reasons.append("ratio")
    excess = facts["excess"]
    if facts["n"] >= MIN_HISTORY and excess is not None:
        if excess > math.log(config.spike_factor) and excess > SPREADS * _spread(facts) and _beyond_converged(facts):
            reasons.append("spike")
    return reasons


def _quiet(facts: dict[str, Any], config: Config) -> bool:
    """True for the usual step, on which no test can fire: :func:`_ratio_reference` would leave the facts as
    they are and :func:`_reasons` would find none (the same tests, in a few reads)."""
    total = facts["total"]
    bound = config.exploding_norm
    if facts["overflow"]:
        return False
    if bound is not None and (total > bound or any(v > bound for v in facts["layers"].values())):
        return False
    ratio, pt = config.exploding_ratio, facts["param_total"]
    if ratio is not None and pt and total > ratio * pt:
        return False
    excess = facts["excess"]
    return facts["n"] < MIN_HISTORY or excess is None or not excess > math.log(config.spike_factor)


def _beyond_converged(facts: dict[str, Any]) -> bool:
    """False for a jump of a converged run that stays near the run's own early levels (only asked about
    a step that already clears the spike thresholds)."""
    early = facts.get("early")
    history = facts["history"]()
    how = converged(history, facts["optimizer"]) if early is not None and history is not None else None
    if how == "loss":
        return facts["total"] > CONVERGED_FACTOR * early
    if how == "norm":
        return facts["total"] > early
    return True


def _ratio_reference(stats: StepStats, facts: dict[str, Any], config: Config) -> None:
    """What the ratio test judges the gradient against: this step's weights, or a default init's scale.

    Asked on every step, works only on a step whose gradient clears ``exploding_ratio`` x the latest
    measurement of the weights. Weights smaller than a default initialization's (a small or zero init,
    which grows into its scale in the first updates) are judged at that scale. The weights' norms are
    measured every ``update_ratio_every`` steps, and one update can grow them 50x (a learning rate or weight
    decay far too high): a stale measurement is replaced by one taken now, one more sync on this step only;
    in deferred mode (no sync, and the weights have moved on) the step is not judged by the ratio and the
    next checked step measures them.
    """
    ratio = config.exploding_ratio
    pt = facts["param_total"]
    if ratio is None or not pt or not facts["total"] > ratio * pt:
        return
    params = stats.extra.get("params")
    scale = init_scale(params) if isinstance(params, list) else 0.0
    if not facts["total"] > ratio * scale:
        facts["init_scale"] = scale  # cleared at that scale alone: no need to read the weights again
        return
    # The weights measured at this step (every update_ratio_every steps), or earlier.
    if not (facts.get("fresh") or isinstance(stats.extra.get("param_norms"), dict)):
        if config.deferred or not isinstance(params, list):
            stats.extra[_WANT] = True  # a note for remember
            facts["param_total"] = None
            return
        now = measure_param_norms(params, stats.modules)
        stats.extra[_NOW] = now  # a note for remember: the latest measurement
        facts["param_total"] = pt = weight_summary(now)[1]
        facts["fresh"] = True
    if pt is not None and scale > pt:
        facts["init_scale"] = scale


_SCALE: list[tuple[Any, ...]] = [()]


def init_scale(params: list[Any]) -> float:
    """The norm PyTorch's default initialization gives these weights: nn.Linear and nn.ConvNd draw them with
    variance 1 / (3 fan_in), out_features / 3 per weight tensor in all. Vectors (biases, norm scales) are
    left out, so it never overstates that scale. Memoized for the latest parameter list (the optimizer's,
    the same from step to step; its tensors held weakly): no per-parameter work on a step that needs it
    again."""
    if not params:
        return 0.0
    memo = _SCALE[0]  # one read: another thread may replace it, never half of it
    if memo and memo[0]() is params[0] and memo[1]() is params[-1] and memo[2] == len(params):
        return memo[3]  # type: ignore[no-any-return]
    scale = math.sqrt(sum(p.shape[0] / 3 for p in params if p.dim() >= 2))
    _SCALE[0] = (weakref.ref(params[0]), weakref.ref(params[-1]), len(params), scale)
    return scale


def check(stats: StepStats, history: History, config: Config) -> list[Finding]:
    facts = _measure(stats, history)
    if facts is None:
        return []
    pending = facts["pending"]
    if pending is None and _quiet(facts, config):
        return []
    _ratio_reference(stats, facts, config)
    reasons = _reasons(facts, config)
    if pending is not None:
        settled = _pending_verdict(stats, history, facts, reasons, pending, config)
        if settled is not None:
            return [settled]
    if not reasons or _same_episode(stats, history, reasons, config):
        return []
    started = _started(stats, history, facts, config) if "spike" in reasons else None
    if reasons == ["spike"] and not _report_spike(stats, history, facts, pending, started):
        return []
    where, jump = _locate(stats, history, facts["layers"])
    facts = dict(facts, where=where, jump=jump)
    if started is not None:
        facts.update(since=started, started_now=True)
    return [with_bypass_cause(_finding(stats, facts, reasons, config), stats)]


def _started(stats: StepStats, history: History, facts: dict[str, Any], config: Config) -> dict[str, Any] | None:
    """At the first judged step: where the jump started when it lies inside the norms judged against (the
    unbroken run of norms above the spike threshold of the norms before it that reaches this step), as the
    facts of a spike that has not fallen back since; None when the jump is this step's norm alone."""
    n = facts["n"]
    if n != MIN_HISTORY:
        return None
    recent = list(history.total_norms.get(stats.optimizer_index, ()))[-n:]
    pairs = matching_steps(history.memory.get(_STEPS, _NOTHING).get(stats.optimizer_index), recent)
    if pairs is None:
        return None
    floor = math.log(config.spike_factor)

    def threshold(values: list[float]) -> float:
        m, spread = robust_spread([math.log(v) for v in values if v > 0])
        return math.exp(m + max(floor, SPREADS * spread)) if math.isfinite(m) else math.inf

    found = jump_start(pairs, facts["total"], threshold)
    if found is None:
        return None
    step, before = found
    return {"step": step, "total": pairs[len(before)][1], "median": median(before), "n": len(before)}


def _pending_verdict(
    stats: StepStats, history: History, facts: dict[str, Any], reasons: list[str], pending: dict[str, Any],
    config: Config,
) -> Finding | None:
    """A spike within the run's range that has not fallen back: reported after SETTLE checked steps, or at
    once when it grows RANGE_FACTOR x further or another test confirms it."""
    if reasons == ["overflow"]:
        stats.extra[_PENDING] = "reported"  # by the overflow finding
        return None
    if not facts["total"] > pending["total"] / FALL:
        return None
    grown = facts["total"] > RANGE_FACTOR * pending["total"]
    if not (pending["left"] <= 1 or grown or any(r != "spike" for r in reasons)):
        return None
    stats.extra[_RECORD] = pending["excess"]
    stats.extra[_PENDING] = "reported"
    where, jump = _locate(stats, history, facts["layers"])
    also = [r for r in reasons if r != "spike"]
    since = pending.get("started") or pending
    return _finding(stats, dict(facts, where=where, jump=jump, since=since), [*also, "spike"], config)


def _same_episode(stats: StepStats, history: History, reasons: list[str], config: Config) -> bool:
    """The explosion of a recent step was reported already. An overflow (the update is skipped) is reported
    unless the episode's overflow was: a warning about the same episode's growth before it overflowed does
    not say that updates are now skipped."""
    recent = history.memory.get(_KEY, {}).get(stats.optimizer_index, ())
    if reasons == ["overflow"]:
        return any(f["overflow"] for f in recent)
    return any(_reasons(f, config) for f in recent)


def _report_spike(
    stats: StepStats, history: History, facts: dict[str, Any], pending: Any, started: dict[str, Any] | None
) -> bool:
    """Spikes of the same size recurring (a DQN's target-network sync, each curriculum stage) are reported
    once; a later one only when it is RECORD_FACTOR x larger than every spike reported before. One within
    the run's range waits to see whether it falls back. Leaves notes for remember."""
    record = history.memory.get(_RECORD, {}).get(stats.optimizer_index)
    if record is not None and facts["excess"] <= record + math.log(RECORD_FACTOR):
        return False
    if pending is None and _within_range(facts, history):
        stats.extra[_PENDING] = "new"  # a note for remember: wait for it to fall back
        stats.extra[_STARTED] = started
        return False
    stats.extra[_RECORD] = facts["excess"]  # a note for remember: this spike was reported
    return True


def after_explosion(stats: StepStats, history: History) -> str:
    """For a non-finite step: the sentence naming the exploding update applied at most APPLIED_WINDOW steps
    before it as its likely cause (or "")."""
    applied = history.memory.get(APPLIED)
    if not applied or applied["optimizer"] != stats.optimizer_index:
        return ""
    if not 0 < stats.step - applied["step"] <= APPLIED_WINDOW:
        return ""
    size = f", {applied['factor']:.3g}x {applied['of']}" if applied.get("factor") else ""
    lr = f" with lr={applied['lr']:g}" if applied.get("lr") is not None else ""
    return (
        f"Likely cause: the exploding gradient of step {applied['step']} (exploding_grad{size}) was applied{lr} "
        "and threw the weights out of range, so later forward passes overflow: lower the learning rate "
        "(10x at a time) and clip gradients (torch.nn.utils.clip_grad_norm_) before the update."
    )


def huge_lr(stats: StepStats) -> float | None:
    """The step's optimizer's largest learning rate when it is far outside the usual range (a typo such as
    lr=2 for SGD or lr=0.3 for Adam), else None."""
    opt = stats.extra.get("optimizer")
    groups = getattr(opt, "param_groups", None) or ()
    try:
        lr = max(float(g.get("lr", 0.0)) for g in groups) if groups else None
    except (TypeError, ValueError):
        return None  # a tensor or scheduler-managed lr of an odd type
    if lr is None:
        return None
    adaptive = type(opt).__name__ in _ADAPTIVE
    return lr if lr >= (HUGE_ADAPTIVE_LR if adaptive else HUGE_LR) else None


def _within_range(facts: dict[str, Any], history: History) -> bool:
    """True for a norm at most RANGE_FACTOR x the largest of the run's start or of the recent window (only
    asked about a step that already clears the spike thresholds)."""
    peak = history.memory.get(_PEAK, {}).get(facts["optimizer"])
    logs = facts["logs"]
    top = max(logs) if logs else -math.inf
    if peak is not None:
        top = max(top, peak)
    return math.log(facts["total"]) <= math.log(RANGE_FACTOR) + top


def remember(stats: StepStats, history: History) -> None:
    extra = stats.extra
    memory = history.memory
    i = stats.optimizer_index
    remember_param_norms(stats, history, extra.get(_NOW))
    applied = extra.get(APPLIED)
    if applied is not None:
        memory[APPLIED] = applied
    if extra.get(_WANT):
        memory.setdefault(WANT_PARAM_NORMS, set()).add(i)
    facts = _measure(stats, history)
    if facts is None:
        return
    note = extra.get(_PENDING)
    if note is not None or facts["pending"] is not None:  # (the same check as i in memory[_PENDING])
        _remember_pending(history, i, facts, note, stats.step, extra.get(_STARTED))
    try:
        memory[_KEY][i].append(facts)
    except KeyError:
        memory.setdefault(_KEY, {}).setdefault(i, deque(maxlen=REARM)).append(facts)
    if facts["n"] < MIN_HISTORY:
        _remember_steps(memory, i, facts, stats.step)
    counts = memory.get(_COUNT)
    if counts is None:
        counts = memory[_COUNT] = {}
    ref, counted = facts["counted"]
    counts[i] = counted if counts.get(i) is ref else _counted(stats, counts.get(i))
    reported = extra.get(_RECORD)
    if isinstance(reported, float):
        records = memory.setdefault(_RECORD, {})
        records[i] = max(reported, records.get(i, reported))
    if facts["early"] is None and facts["n"] >= MIN_HISTORY and facts["median"] is not None:  # i not in _EARLY
        memory.setdefault(_EARLY, {})[i] = facts["median"]
        peaks = memory.setdefault(_PEAK, {})
        peaks[i] = max(max(facts["logs"]), peaks.get(i, -math.inf))


def _remember_steps(memory: dict[str, Any], i: int, facts: dict[str, Any], step: int) -> None:
    """The step of each norm before the first judged step (started again with the comparison)."""
    steps = memory.setdefault(_STEPS, {}).setdefault(i, [])
    if facts["n"] == 0:
        steps.clear()
    if math.isfinite(facts["total"]):
        steps.append((step, facts["total"]))


def _remember_pending(
    history: History, i: int, facts: dict[str, Any], note: str | None, step: int, started: dict[str, Any] | None
) -> None:
    """A spike within the run's range starts waiting to fall back (``note == "new"``), was reported, fell
    back (its size joins the run's range), or waits one more checked step."""
    pending = history.memory.setdefault(_PENDING, {})
    if note == "new":
        pending[i] = {
            "step": step,
            "total": facts["total"],
            "median": facts["median"],
            "n": facts["n"],
            "excess": facts["excess"],
            "left": SETTLE,
            "started": started,
        }
    elif i in pending:
        if note == "reported":
            del pending[i]
        elif facts["total"] <= pending[i]["total"] / FALL:
            # Fell back: a transient of a healthy run, whose size is now part of the run's range (the
            # target syncs of a DQN grow slowly with its weights).
            peaks = history.memory.setdefault(_PEAK, {})
            peaks[i] = max(peaks.get(i, -math.inf), math.log(pending.pop(i)["total"]))
        else:
            pending[i]["left"] -= 1


@dataclass(frozen=True)
class Explosion:
    """The facts an ``exploding_grad`` finding states: why it fired, how large, where, and what is in place."""

    step: int
    #: Tests that fired, among ``overflow``, ``bound``, ``ratio``, ``spike``.
    reasons: tuple[str, ...]
    total: float
    where: str | None
    layers: dict[str, float]
    jump: float | None
    overflow: tuple[str, ...]
    exploding_norm: float | None
    exploding_ratio: float | None
    #: The norm a default init gives the weights, when the ratio test judged against it.
    init_scale: float | None
    param_total: float | None
    median: float | None
    n: int
    #: The pending spike this finding reports after it did not fall back (its step, total, median, n).
    since: dict[str, Any] | None
    on_nonfinite: str
    #: How clipping in place bounds the update (None: no clipping), and by whom (``module`` or the loop).
    clipped: str | None
    clip_how: str | None
    #: A learning rate far outside the usual range in the first steps (None otherwise).
    lr: float | None
    optimizer_class: str
    clip_advice: str
    #: Backward passes the update sums by hand, with a loss perhaps not divided by them (0: none).
    accumulated: int


def explosion_facts(stats: StepStats, facts: dict[str, Any], reasons: list[str], config: Config) -> Explosion:
    since = facts.get("since")
    overflow = "overflow" in reasons
    # Lightning clips after gradwatch's check: a user who clips already is told so, not to add clipping.
    clipped = None if overflow else clipping_in_place(stats, this_step=since is None or facts.get("started_now", False))
    return Explosion(
        step=stats.step,
        reasons=tuple(reasons),
        total=facts["total"],
        where=_where(stats, facts, reasons, config),
        layers=facts["layers"],
        jump=facts.get("jump"),
        overflow=tuple(facts["overflow"]),
        exploding_norm=config.exploding_norm,
        exploding_ratio=config.exploding_ratio,
        init_scale=facts.get("init_scale"),
        param_total=facts["param_total"],
        median=facts["median"],
        n=facts["n"],
        since=since,
        on_nonfinite=config.on_nonfinite,
        clipped=clipped,
        clip_how=stats.extra["clipping"]["how"] if clipped is not None else None,
        lr=huge_lr(stats) if stats.step < FIRST_STEPS else None,
        optimizer_class=type(stats.extra.get("optimizer")).__name__,
        clip_advice=clip_advice(stats) if clipped is None else "",
        accumulated=_accumulated(stats),
    )


def _where(stats: StepStats, facts: dict[str, Any], reasons: list[str], config: Config) -> str | None:
    """The module to name: the one holding the first overflowing norm, or the layer most over
    ``exploding_norm``, or the one that jumped most."""
    where = facts["where"]
    if "overflow" in reasons:
        where = next(("<root>" if m == "" else m for n, m in zip(stats.names, stats.modules)
                      if n in facts["overflow"]), None)
    if "bound" in reasons:
        over = {k: v for k, v in facts["layers"].items() if v > (config.exploding_norm or math.inf)}
        if over:
            where = max(over, key=lambda k: over[k])
    return where


def _overflow_words(e: Explosion) -> str:
    return (
        f"the gradient norm of {', '.join(e.overflow[:4])} overflows float32 (inf) although every element is finite"
    )


def _bound_words(e: Explosion) -> str:
    return f"the gradient norm {_f(e.total)} is above exploding_norm={e.exploding_norm:g}"


def _ratio_words(e: Explosion) -> str:
    if e.init_scale:
        return (
            f"the gradient norm {_f(e.total)} is {e.total / e.init_scale:.3g}x the norm a default initialization "
            f"would give these weights ({_f(e.init_scale)}; they are at {_f(e.param_total)}; "
            f"exploding_ratio={e.exploding_ratio:g})"
        )
    return (  # the ratio test fires only against a measured norm
        f"the gradient norm {_f(e.total)} is {e.total / e.param_total:.3g}x the norm of the weights "
        f"({_f(e.param_total)}; exploding_ratio={e.exploding_ratio:g})"
    )


def _spike_words(e: Explosion) -> str:
    if e.since is not None:
        med = e.since["median"]
        return (
            f"the gradient norm jumped at step {e.since['step']} to {_f(e.since['total'])}, "
            f"{e.since['total'] / med:.3g}x its median of {_f(med)} over the {e.since['n']} checked steps before, "
            f"and has not fallen back since ({_f(e.total)} now)"
        )
    return (  # the spike test fires only against a median
        f"the gradient norm jumped to {_f(e.total)}, {e.total / e.median:.3g}x its median of {_f(e.median)} over "
        f"the last {e.n} checked steps"
    )


#: What each test that fired says, in this order.
_REASON_WORDS: dict[str, Callable[[Explosion], str]] = {
    "overflow": _overflow_words,
    "bound": _bound_words,
    "ratio": _ratio_words,
    "spike": _spike_words,
}

#: What gradwatch did about an overflowing norm, per ``on_nonfinite``.
_OVERFLOW_ACTION = {
    "skip": "gradwatch skipped this update (it would overflow the next forward pass): parameters and "
    "optimizer state are unchanged.",
    "warn": "on_nonfinite='warn': the update was applied; the next forward pass is likely to overflow.",
    "raise": "on_nonfinite='raise': training stops before the update.",
}


def _place(e: Explosion) -> str:
    overflow = "overflow" in e.reasons
    if e.where is not None and e.where in e.layers and not overflow:
        detail = f" (norm {_f(e.layers[e.where])}" + (f", {e.jump:.3g}x its own median)" if e.jump else ")")
        place = f"Largest in module {e.where}{detail}."
    elif e.where is not None:
        place = f"In module {e.where}."
    else:
        place = ""
    if overflow:
        place += (" " if place else "") + _OVERFLOW_ACTION[e.on_nonfinite]
    return place


def _lead(e: Explosion) -> str:
    """In the first steps, with a learning rate far outside the usual range: the typo comes first."""
    if e.lr is None:
        return ""
    return (
        f"lower the learning rate first: lr={e.lr:g} ({e.optimizer_class}) is far "
        "above the usual range (SGD ~1e-3 to 1e-1, Adam ~1e-5 to 1e-3; a typo such as 2 for 2e-2?), and an "
        "update of lr times this gradient throws the weights out of range in the first steps; then "
    )


def _clipped_words(e: Explosion) -> tuple[str, str]:
    why = (
        f"{e.clipped}, so {_UNLESS.get(e.clip_how or '', '')}the weights did not move by this gradient's size. But "
        "a gradient this far above its usual size means this batch or the training went wrong (an outlier or "
        "mislabelled batch, a loss term that blew up, a learning rate too high for this point of training); "
        "while clipping scales such steps down, each one steers the weights by one bad batch and hides the "
        "cause until the loss diverges."
    )
    fix = (
        f"clipping is in place (keep it); {_lead(e) or 'lower the learning rate or lengthen its warm-up, and '}"
        "check this step's batch for outliers (its loss, labels and inputs)"
    )
    return why, fix


def _unclipped_words(e: Explosion) -> tuple[str, str]:
    why = (
        "an update this large throws the weights far from where training was: the loss "
        "jumps or diverges, and Adam's moment estimates stay polluted for many steps."
    )
    fix = (
        f"{_lead(e)}clip gradients ({e.clip_advice}), lower the learning rate or lengthen its warm-up, "
        "and check the batch for outliers"
    )
    return why, fix


#: Said after every fix: the usual structural causes, and a jump planned by the training code.
_STRUCTURAL = (
    "; for RNNs use a smaller (or orthogonal) init of the recurrent weights, or an "
    "LSTM/GRU; for deep nets add normalization or residual connections. (If the objective changed at this "
    "step on purpose, e.g. a loss term switched on or a harder curriculum stage, a jump is expected.)"
)


def explosion_explanation(e: Explosion) -> Explanation:
    what = [words(e) for reason, words in _REASON_WORDS.items() if reason in e.reasons]
    why, fix = _clipped_words(e) if e.clipped is not None else _unclipped_words(e)
    return Explanation(
        what=f"Exploding gradient at step {e.step}: " + "; ".join(what) + ". " + _place(e),
        why=why,
        fix=fix + _accumulation_words(e.accumulated) + _STRUCTURAL,
    )


def _note_applied(stats: StepStats, e: Explosion) -> None:
    """A note for remember: an update thrown far by this gradient was applied (not an overflow, which is
    skipped; not clipped), so the non-finite steps that follow name it as their likely cause."""
    if "overflow" in e.reasons or e.clipped is not None:
        return
    ratio = "ratio" in e.reasons and e.param_total
    if not (ratio or e.lr is not None):  # a transient spike of a healthy run: the weights are not thrown off
        return
    if ratio:
        factor, of = e.total / e.param_total, "the weights' norm"  # type: ignore[operator]
    else:
        factor, of = (e.total / e.median, "its median") if e.median else (None, None)
    stats.extra[APPLIED] = {"step": stats.step, "factor": factor, "of": of,
                            "optimizer": stats.optimizer_index, "lr": e.lr}


def _finding(stats: StepStats, facts: dict[str, Any], reasons: list[str], config: Config) -> Finding:
    e = explosion_facts(stats, facts, reasons, config)
    _note_applied(stats, e)
    stats.extra[_EXPLOSION] = e
    top = sorted(e.layers.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else -math.inf)[:5]
    return Finding(
        kind="exploding_grad",
        step=stats.step,
        severity="error" if "overflow" in reasons else "warning",
        explanation=explosion_explanation(e),
        module=e.where,
        data={
            "reasons": reasons,
            "total_norm": e.total,
            "median_norm": e.since["median"] if e.since is not None else e.median,
            "param_norm": e.param_total,
            "optimizer": stats.optimizer_index,
            "overflow": list(e.overflow),
            "table": [{"layer": k, "grad_norm": v} for k, v in top],
            **({"since": e.since["step"]} if e.since is not None else {}),
            **({"huge_lr": e.lr} if e.lr is not None else {}),
        },
    )


def _accumulated(stats: StepStats) -> int:
    """The backward passes the step sums by hand (gradient accumulation), 0 if not: a loss not divided by
    their number makes the gradient, and the update, that many times larger. Not in Lightning's automatic
    optimization, which divides the loss by accumulate_grad_batches itself."""
    passes = stats.extra.get("backward_passes")
    facts: ZeroGradFacts = stats.extra.get("zero_grad") or {}
    if not (isinstance(passes, tuple) and passes[0] >= 2 and passes[1] == 0) or facts.get("lightning_automatic"):
        return 0
    return int(passes[0])


def _accumulation_words(n: int) -> str:
    if not n:
        return ""
    return (
        f"; this update sums {n} backward passes: if each micro-batch's loss is not divided by {n} "
        f"((loss / {n}).backward()), the gradient and the update are {n}x what one batch tuned the learning "
        "rate for"
    )


def _clipped_after_check(f: Finding, stats: StepStats, history: History) -> Finding:
    """The finding worded again once the step's gradients are known to have been clipped after the check
    (Lightning: the module's own on_before_optimizer_step; see gradwatch.core.held): clipping is in place."""
    e = stats.extra.get(_EXPLOSION)
    clipped = clipping_in_place(stats, this_step=True)
    if not isinstance(e, Explosion) or e.clipped is not None or clipped is None or "overflow" in e.reasons:
        return f
    applied = history.memory.get(APPLIED)
    if isinstance(applied, dict) and applied.get("step") == e.step:
        del history.memory[APPLIED]  # the update was clipped: later non-finite steps do not name it
    e = replace(e, clipped=clipped, clip_how=stats.extra["clipping"]["how"], clip_advice="")
    return replace(f, explanation=explosion_explanation(e))


#: Kinds whose words depend on clipping measured after the check (see gradwatch.core.held).
CLIPPED_AFTER_CHECK = {"exploding_grad": _clipped_after_check}
#: The facts of the finding made at this step, for those words.
_EXPLOSION = "exploding/explosion"


#: How sure the clipping is to have bounded this update (the module's own clipping may skip steps).
_UNLESS = {"module": "if it clipped this step, "}


def _f(v: float | None) -> str:
    if v is None:
        return "?"
    return f"{v:.3g}" if math.isfinite(v) else str(v)
