"""Diagnose: why a step went wrong, worked out only when it did.

The escalation window (capture, replay, localize the op and module where a NaN/Inf was born, and the fix rules
for it), and the explainers of autograd errors (in-place modification, backward twice, no grad_fn, non-scalar
backward) with the line of the user's source that caused them.
"""
