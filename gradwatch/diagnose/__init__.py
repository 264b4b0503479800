"""Diagnose: why a step went wrong, worked out only when it did.

The escalation window (capture the step, replay it, localize the op and module where a NaN/Inf was born, and
the fix rules for it: ``escalation``, ``window``, ``capture``, ``replay``, ``localize``, ``birth``, ``origin``,
``op_fixes``, ...), and the explainers of autograd errors, one module per family in ``autograd/`` (in-place
modification, backward twice, no grad_fn, non-scalar backward) with the line of the user's source that caused
them. See docs/architecture.md.
"""
