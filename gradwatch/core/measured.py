"""Measured magnitudes: the ``StepStats.extra`` keys the magnitude measurement fills and the checks read.

:class:`gradwatch.observe.magnitude.MagnitudeExtension` measures per-layer parameter norms and update-to-weight
ratios in the step's one sync and stores them under these keys; checks read them, and ask for a measurement at
the next checked step through :data:`WANT_PARAM_NORMS`. :func:`measure_param_norms` reads a suspicious step's
weights on the spot (one sync, only for such a step).
"""

from __future__ import annotations

import torch

from gradwatch.core.stats import SyncBatch, layer_norms, queue_grad_norms, read_grad_norms

#: ``StepStats.extra`` key of the per-layer parameter norms ``{layer: norm}`` (on measuring steps).
PARAM_NORMS = "param_norms"
#: ``StepStats.extra`` key of the per-layer update-to-weight ratios ``{layer: ratio}``.
UPDATE_RATIO = "update_ratio"
#: Checked steps, from the first, whose update is measured (whatever ``update_ratio_every``): a learning
#: rate far too large throws the weights in the first updates, and is seen in the whole-model ratio.
EARLY_UPDATES = 10
#: ``StepStats.extra`` key of the whole model's measured update-to-weight ratio.
UPDATE_TOTAL = "update_ratio_total"
#: ... and of the norm of the weights it was measured against.
UPDATE_WEIGHTS = "update_ratio_total/weights"

#: Optimizer indices whose parameter norms a check wants measured at their next checked step (in deferred
#: mode, where a suspicious step's weights cannot be read on the spot: they have moved on, and no sync is
#: allowed). The measurement rides in that step's one sync.
WANT_PARAM_NORMS = "param_norms/wanted"


def measure_param_norms(params: list[torch.Tensor], modules: list[str | None]) -> dict[str, float]:
    """Per-layer norms of ``params`` as they are now, read back with one sync: only for a suspicious step."""
    keep = [(p.detach(), m) for p, m in zip(params, modules) if p.is_floating_point() and not p.is_meta]
    if not keep:
        return {}
    batch = SyncBatch()
    slots = queue_grad_norms(batch, [p for p, _ in keep])
    return layer_norms([m for _, m in keep], read_grad_norms(batch.resolve(), slots, len(keep)))
