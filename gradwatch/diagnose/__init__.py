"""Diagnose: why a step went wrong, worked out only when it did.

The escalation extension (``escalation``: :class:`~gradwatch.diagnose.escalation.Escalation`) and its parts:
``step_capture`` and ``capture`` (references to the step's inputs, output gradients and RNG state), ``window``
(anomaly mode and live localization for a few steps), ``replay`` and ``replayer`` (replaying a step without a
trace; ``lightning_replay`` neutralizes ``training_step``'s side effects), ``localize`` (the op and module where
a NaN/Inf was born), ``origin`` (its facts, fix rules and words) with ``op_fixes`` (advice per op),
``input_findings`` and ``bad_values`` (bad data, non-finite weights or buffers), ``graph_walk``, ``reentrant``
(the reentrant-checkpoint cut) and ``incident`` (decisions and the incident report). And the explainers of
autograd errors (``autograd_errors``: in-place modification, backward twice, no grad_fn, non-scalar backward)
with the line of the user's source that caused them (``inplace_source``).
"""
