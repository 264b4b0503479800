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
before it overflowed.
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
from collections import deque
from typing import Any

from gradwatch.core.config import Config
from gradwatch.core.findings import Finding
from gradwatch.core.history import History
from gradwatch.core.stats import StepStats, ZeroGradFacts, layer_norms
from gradwatch.observe.magnitude import (
    EARLY_NORM,
    WANT_PARAM_NORMS,
    clip_advice,
    clipping_in_place,
    converged,
    measure_param_norms,
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
#: :func:`gradwatch.observe.magnitude.converged`; full-batch Adam oscillates around the minimum) a "spike" must
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
#: ``v > 0`` as a C call (``0.0 < v``).
_POSITIVE = functools.partial(operator.lt, 0.0)


@once_per_check
def _measure(stats: StepStats, history: History) -> dict[str, Any] | None:
    """Config-free facts about this step (the check and ``remember`` both use them)."""
    if not stats.names or stats.is_nonfinite:
        return None
    i = stats.optimizer_index
    layers = stats.layer_norms or layer_norms(stats.modules, stats.norms)
    recent = history.total_norms.get(i, ())
    # Norms are compared only with steps whose gradients came from about the same tensors: a backbone
    # unfrozen mid-run (or a head joining) adds its gradients to the total, which is no explosion.
    ref = history.memory.get(_COUNT, {}).get(i)
    count = _trainable(stats)
    if ref is None or abs(count - ref[0]) > COUNT_CHANGE * ref[0]:
        recent = ()
    elif ref[1] < len(recent):
        recent = list(recent)[len(recent) - ref[1] :]
    logs = list(map(math.log, filter(_POSITIVE, recent)))  # C loops: this runs on every checked step
    m = median(logs)
    total = stats.total_norm
    excess = math.log(total) - m if total > 0 and math.isfinite(total) and math.isfinite(m) else None
    return {
        "total": total,
        "layers": layers,
        "overflow": tuple(stats.overflow_norm),
        "n": len(recent),
        "median": math.exp(m) if math.isfinite(m) else None,
        "early": history.memory.get(_EARLY, {}).get(i),
        "history": weakref.ref(history),  # weakly: once_per_check keeps the latest facts process-wide
        "optimizer": i,
        "excess": excess,
        # The spread (a MAD: two sorts) is computed only for a step that already clears spike_factor.
        "logs": logs,
        "param_total": weight_summary(param_norms_of(stats, history))[1],
        # Measured at this step (every update_ratio_every steps), or earlier: see _weights_now.
        "fresh": isinstance(stats.extra.get("param_norms"), dict),
    }


def _trainable(stats: StepStats) -> int:
    """The optimizer's trainable tensors (with a gradient this step or not): it changes when layers are
    unfrozen or added, not when experts of a mixture are idle for a step."""
    return len(stats.names) + len(stats.none_grad)


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
    scale = _init_scale(params) if isinstance(params, list) else 0.0
    if not facts["total"] > ratio * scale:
        facts["init_scale"] = scale  # cleared at that scale alone: no need to read the weights again
        return
    if not facts["fresh"]:
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


def _init_scale(params: list[Any]) -> float:
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
    _ratio_reference(stats, facts, config)
    reasons = _reasons(facts, config)
    pending = history.memory.get(_PENDING, {}).get(stats.optimizer_index)
    if pending is not None:
        if reasons == ["overflow"]:
            stats.extra[_PENDING] = "reported"  # by the overflow finding below
        elif facts["total"] > pending["total"] / FALL:
            # A spike within the run's range that has not fallen back: reported after SETTLE checked steps,
            # or at once when it grows RANGE_FACTOR x further or another test confirms it.
            grown = facts["total"] > RANGE_FACTOR * pending["total"]
            if pending["left"] <= 1 or grown or any(r != "spike" for r in reasons):
                stats.extra[_RECORD] = pending["excess"]
                stats.extra[_PENDING] = "reported"
                where, jump = _locate(stats, history, facts["layers"])
                also = [r for r in reasons if r != "spike"]
                return [_finding(stats, dict(facts, where=where, jump=jump, since=pending), [*also, "spike"], config)]
    if not reasons:
        return []
    recent = history.memory.get(_KEY, {}).get(stats.optimizer_index, ())
    if reasons == ["overflow"]:
        # An update skipped for it: reported unless the episode's overflow was (a warning about the same
        # episode's growth before it overflowed does not say that updates are now skipped).
        if any(f["overflow"] for f in recent):
            return []
    elif any(_reasons(f, config) for f in recent):
        return []  # the same episode: reported already
    if reasons == ["spike"]:
        # Spikes of the same size recurring (a DQN's target-network sync, each curriculum stage): reported
        # once; a later one only when it is RECORD_FACTOR x larger than every spike reported before.
        record = history.memory.get(_RECORD, {}).get(stats.optimizer_index)
        if record is not None and facts["excess"] <= record + math.log(RECORD_FACTOR):
            return []
        if pending is None and _within_range(facts, history):
            stats.extra[_PENDING] = "new"  # a note for remember: wait for it to fall back
            return []
        stats.extra[_RECORD] = facts["excess"]  # a note for remember: this spike was reported
    where, jump = _locate(stats, history, facts["layers"])
    return [_finding(stats, dict(facts, where=where, jump=jump), reasons, config)]


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
    remember_param_norms(stats, history, stats.extra.get(_NOW))
    applied = stats.extra.get(APPLIED)
    if applied is not None:
        history.memory[APPLIED] = applied
    if stats.extra.get(_WANT):
        history.memory.setdefault(WANT_PARAM_NORMS, set()).add(stats.optimizer_index)
    facts = _measure(stats, history)
    if facts is None:
        return
    pending = history.memory.setdefault(_PENDING, {})
    note = stats.extra.get(_PENDING)
    i = stats.optimizer_index
    if note == "new":
        pending[i] = {
            "step": stats.step,
            "total": facts["total"],
            "median": facts["median"],
            "n": facts["n"],
            "excess": facts["excess"],
            "left": SETTLE,
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
    per_opt = history.memory.setdefault(_KEY, {})
    per_opt.setdefault(stats.optimizer_index, deque(maxlen=REARM)).append(facts)
    counts = history.memory.setdefault(_COUNT, {})
    ref = counts.get(stats.optimizer_index)
    count = _trainable(stats)
    if ref is None or abs(count - ref[0]) > COUNT_CHANGE * ref[0]:
        counts[stats.optimizer_index] = (count, 1)
    else:
        counts[stats.optimizer_index] = (ref[0], ref[1] + 1)
    reported = stats.extra.get(_RECORD)
    if isinstance(reported, float):
        records = history.memory.setdefault(_RECORD, {})
        records[stats.optimizer_index] = max(reported, records.get(stats.optimizer_index, reported))
    early = history.memory.setdefault(_EARLY, {})
    if stats.optimizer_index not in early and facts["n"] >= MIN_HISTORY and facts["median"] is not None:
        early[stats.optimizer_index] = facts["median"]
        peaks = history.memory.setdefault(_PEAK, {})
        peaks[stats.optimizer_index] = max(max(facts["logs"]), peaks.get(stats.optimizer_index, -math.inf))


def _finding(stats: StepStats, facts: dict[str, Any], reasons: list[str], config: Config) -> Finding:
    total = facts["total"]
    where = facts["where"]
    layers: dict[str, float] = facts["layers"]
    what: list[str] = []
    if "overflow" in reasons:
        what.append(
            f"the gradient norm of {', '.join(facts['overflow'][:4])} overflows float32 (inf) although every "
            "element is finite"
        )
        where = None
        for name, m in zip(stats.names, stats.modules):
            if name in facts["overflow"]:
                where = "<root>" if m == "" else m
                break
    if "bound" in reasons:
        over = {k: v for k, v in layers.items() if v > (config.exploding_norm or math.inf)}
        if over:
            where = max(over, key=lambda k: over[k])
        what.append(f"the gradient norm {_f(total)} is above exploding_norm={config.exploding_norm:g}")
    if "ratio" in reasons and facts.get("init_scale"):
        scale = facts["init_scale"]
        what.append(
            f"the gradient norm {_f(total)} is {total / scale:.3g}x the norm a default initialization would give "
            f"these weights ({_f(scale)}; they are at {_f(facts['param_total'])}; "
            f"exploding_ratio={config.exploding_ratio:g})"
        )
    elif "ratio" in reasons:
        what.append(
            f"the gradient norm {_f(total)} is {total / facts['param_total']:.3g}x the norm of the weights "
            f"({_f(facts['param_total'])}; exploding_ratio={config.exploding_ratio:g})"
        )
    since = facts.get("since")
    if "spike" in reasons and since is not None:
        med = since["median"]
        what.append(
            f"the gradient norm jumped at step {since['step']} to {_f(since['total'])}, "
            f"{since['total'] / med:.3g}x its median of {_f(med)} over the {since['n']} checked steps before, "
            f"and has not fallen back since ({_f(total)} now)"
        )
    elif "spike" in reasons:
        med = facts["median"]
        what.append(
            f"the gradient norm jumped to {_f(total)}, {total / med:.3g}x its median of {_f(med)} over the "
            f"last {facts['n']} checked steps"
        )
    if where is not None and where in layers and "overflow" not in reasons:
        jump = facts.get("jump")
        detail = f" (norm {_f(layers[where])}" + (f", {jump:.3g}x its own median)" if jump else ")")
        place = f"Largest in module {where}{detail}."
    elif where is not None:
        place = f"In module {where}."
    else:
        place = ""
    if "overflow" in reasons:
        place += (" " if place else "") + {
            "skip": "gradwatch skipped this update (it would overflow the next forward pass): parameters and "
            "optimizer state are unchanged.",
            "warn": "on_nonfinite='warn': the update was applied; the next forward pass is likely to overflow.",
            "raise": "on_nonfinite='raise': training stops before the update.",
        }[config.on_nonfinite]
    # Lightning clips after gradwatch's check: a user who clips already is told so, not to add clipping.
    clipped = None if "overflow" in reasons else clipping_in_place(stats, this_step=since is None)
    lr = huge_lr(stats) if stats.step < FIRST_STEPS else None
    if "overflow" not in reasons and clipped is None:
        ratio = "ratio" in reasons and facts.get("param_total")
        factor, of = (total / facts["param_total"], "the weights' norm") if ratio else (
            (total / facts["median"], "its median") if facts.get("median") else (None, None)
        )
        if ratio or lr is not None:  # not a transient spike of a healthy run: the weights are thrown off
            stats.extra[APPLIED] = {"step": stats.step, "factor": factor, "of": of,
                                    "optimizer": stats.optimizer_index, "lr": lr}
    lead = ""
    if lr is not None:
        # In the first steps, with a learning rate far outside the usual range: the typo comes first.
        lead = (
            f"lower the learning rate first: lr={lr:g} ({type(stats.extra.get('optimizer')).__name__}) is far "
            "above the usual range (SGD ~1e-3 to 1e-1, Adam ~1e-5 to 1e-3; a typo such as 2 for 2e-2?), and an "
            "update of lr times this gradient throws the weights out of range in the first steps; then "
        )
    if clipped is not None:
        why = (
            f"Why it matters: {clipped}, so {_UNLESS.get(stats.extra['clipping']['how'], '')}the weights did "
            "not move by this gradient's size. But a gradient "
            "this far above its usual size means this batch or the training went wrong (an outlier or "
            "mislabelled batch, a loss term that blew up, a learning rate too high for this point of training); "
            "while clipping scales such steps down, each one steers the weights by one bad batch and hides the "
            "cause until the loss diverges.\n"
        )
        fix = (
            f"Fix: clipping is in place (keep it); {lead or 'lower the learning rate or lengthen its warm-up, and '}"
            "check this step's batch for outliers (its loss, labels and inputs)"
        )
    else:
        why = (
            "Why it matters: an update this large throws the weights far from where training was: the loss "
            "jumps or diverges, and Adam's moment estimates stay polluted for many steps.\n"
        )
        fix = (
            f"Fix: {lead}clip gradients ({clip_advice(stats)}), lower the learning rate or lengthen its warm-up, "
            "and check the batch for outliers"
        )
    message = (
        f"Exploding gradient at step {stats.step}: " + "; ".join(what) + ". " + place + "\n" + why + fix
        + _accumulation_hint(stats) + "; for RNNs use a smaller (or orthogonal) init of the recurrent weights, or an "
        "LSTM/GRU; for deep nets add normalization or residual connections. (If the objective changed at this "
        "step on purpose, e.g. a loss term switched on or a harder curriculum stage, a jump is expected.)"
    )
    top = sorted(layers.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else -math.inf)[:5]
    return Finding(
        kind="exploding_grad",
        step=stats.step,
        severity="error" if "overflow" in reasons else "warning",
        message=message,
        module=where,
        data={
            "reasons": reasons,
            "total_norm": total,
            "median_norm": since["median"] if since is not None else facts["median"],
            "param_norm": facts["param_total"],
            "optimizer": stats.optimizer_index,
            "overflow": list(facts["overflow"]),
            "table": [{"layer": k, "grad_norm": v} for k, v in top],
            **({"since": since["step"]} if since is not None else {}),
            **({"huge_lr": lr} if lr is not None else {}),
        },
    )


def _accumulation_hint(stats: StepStats) -> str:
    """The step sums several backward passes (gradient accumulation by hand): a loss not divided by their
    number makes the gradient, and the update, that many times larger. Not in Lightning's automatic
    optimization, which divides the loss by accumulate_grad_batches itself."""
    passes = stats.extra.get("backward_passes")
    facts: ZeroGradFacts = stats.extra.get("zero_grad") or {}
    if not (isinstance(passes, tuple) and passes[0] >= 2 and passes[1] == 0) or facts.get("lightning_automatic"):
        return ""
    n = passes[0]
    return (
        f"; this update sums {n} backward passes: if each micro-batch's loss is not divided by {n} "
        f"((loss / {n}).backward()), the gradient and the update are {n}x what one batch tuned the learning "
        "rate for"
    )


#: How sure the clipping is to have bounded this update (the module's own clipping may skip steps).
_UNLESS = {"module": "if it clipped this step, "}


def _f(v: float | None) -> str:
    if v is None:
        return "?"
    return f"{v:.3g}" if math.isfinite(v) else str(v)
