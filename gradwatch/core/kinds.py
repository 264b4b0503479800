"""The kinds of finding gradwatch reports: one table, the one the docs and the tests check against.

Each row is a stable identifier (``Finding.kind``), its usual severity and one line on what it means.
``docs/findings.md`` documents every row (its "Every kind" table lists exactly these), and a test checks that
every kind the code can emit is a row here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    """One kind of finding.

    Attributes:
        name: The stable identifier, as in ``Finding.kind``.
        severity: The usual severity ("info", "warning" or "error"; some kinds vary, see ``docs/findings.md``).
        summary: What it means, in one line.
    """

    name: str
    severity: str
    summary: str


KINDS: tuple[Kind, ...] = (
    # non-finite values and where they were born
    Kind("nonfinite_loss", "error", "the loss is NaN/Inf"),
    Kind("nonfinite_grad", "error", "gradients hold NaN/Inf"),
    Kind("nonfinite_update", "error", "finite gradients, but the optimizer's update would be NaN/Inf"),
    Kind("nan_origin", "error", "the op and module where a NaN/Inf was born, and the fix"),
    Kind("nonfinite_input", "error", "the batch (or a tensor the loss uses) already holds NaN/Inf"),
    Kind("nonfinite_on_other_rank", "error", "another rank saw NaN/Inf: every rank skips the update"),
    Kind("too_many_skips", "error", "max_skips non-finite steps in a row: gradwatch stops instead of skipping on"),
    # parameters that never train
    Kind("none_grad", "warning", "trainable parameters in the optimizer got no gradient"),
    Kind("not_in_optimizer", "warning", "trainable parameters no watched optimizer updates"),
    Kind("foreign_params", "warning", "the optimizer was built on another model's parameters"),
    Kind("frozen_param_updated", "warning", "frozen parameters the optimizer still moves"),
    Kind("unwatched_optimizer", "warning", "an optimizer not given to watch() updates the model"),
    Kind("optimizer_recreated", "warning", "a new optimizer every step: its state restarts at every update"),
    Kind("no_grads", "error", "optimizer.step() with no gradient at all"),
    Kind("no_optimizer_step", "error", "backward passes filled the gradients, but the optimizer never stepped"),
    Kind("weight_decay_too_large", "warning", "lr * weight_decay >= 1: every step flips and grows the weights"),
    # zero_grad and accumulation
    Kind("zero_grad_missing", "error", "gradients accumulate across steps: zero_grad() is not called"),
    Kind("grads_cleared_before_step", "error", "zero_grad() between backward() and step(): the update is empty"),
    Kind("zero_grad_in_accumulation", "warning", "zero_grad() inside the accumulation loop"),
    Kind("accumulation_remainder", "warning", "an epoch's last micro-batches carried into the next epoch's update"),
    Kind("grads_span_other_step", "warning", "an update's gradient holds a backward pass from before another step"),
    # autograd errors, explained
    Kind("inplace_error", "error", "a tensor autograd saved was modified in place"),
    Kind("backward_twice", "error", "backward through a graph whose saved tensors were freed"),
    Kind("no_grad_graph", "error", "the loss has no autograd graph"),
    Kind("nonscalar_backward", "error", "backward() on a loss that is not a scalar"),
    Kind("bad_backward", "error", "a custom autograd.Function whose backward disagrees with its forward"),
    # magnitudes
    Kind("lr_too_high", "warning", "an early update moves the weights by several times their norm"),
    Kind("lr_collapsed", "warning", "every learning rate fell to nothing (a per-epoch scheduler stepped per batch)"),
    Kind("grads_all_zero", "warning", "every gradient exactly 0 for several steps"),
    Kind("exploding_grad", "warning", "a gradient norm far too large"),
    Kind("vanishing_grad", "warning", "layers whose gradients stay tiny next to the others"),
    Kind("dead_layer", "warning", "a layer whose gradient is exactly 0 while others learn"),
    Kind("update_ratio_high", "warning", "updates far too large for the weights"),
    Kind("update_ratio_low", "warning", "updates far too small for the weights"),
    Kind("loss_spike", "warning", "the loss jumps far above its recent range"),
    Kind("loss_diverging", "warning", "the loss climbs far above where the run started and stays there"),
    # mixed precision
    Kind("amp_overflow", "info", "a GradScaler dropped updates (a warning when most updates are dropped)"),
    Kind("amp_overflow_persistent", "warning", "the GradScaler keeps overflowing after it settled"),
    Kind("scaler_step_bypassed", "error", "optimizer.step() called directly on a GradScaler's scaled gradients"),
    Kind("clip_before_unscale", "warning", "gradients clipped while a GradScaler still scaled them: every update shrunk"),
    # many processes
    Kind("ddp_unused_parameters", "error", "DDP left a backward unreduced: parameters unused on that step"),
    Kind("replicas_diverged", "error", "the DDP replicas hold different parameters: a weight changed on one rank"),
)

#: Kind name -> row.
BY_NAME: dict[str, Kind] = {k.name: k for k in KINDS}

__all__ = ["BY_NAME", "KINDS", "Kind"]
