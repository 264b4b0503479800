"""Core: the engine's step pipeline and the data every part shares.

The engine (observe -> check -> act -> report, once per optimizer step), the fused step statistics, the
configuration, findings and the table of their kinds, the parameter index, the history the checks look back on,
and which extensions each way in attaches.
"""
