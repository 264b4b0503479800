"""Core: the engine and the data every part shares.

``engine.py`` composes small parts, one job each: the parameter tracker, the loss ledger, the step pipeline
(gather, the one device-to-host read, the checks), the extension bus, the pure policy (``decide``), the update
and closure guards, the explanation of exceptions and the run state a checkpoint keeps. Beside them: step
statistics, configuration, findings and their words, the table of kinds, the history and the pure decisions over
it the checks share, and gradwatch's own failure isolation. See docs/architecture.md.
"""
