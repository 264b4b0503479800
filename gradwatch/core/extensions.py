"""Which extensions each way in attaches to the engine (one place, so both integrations agree)."""

from __future__ import annotations

from typing import Any, Literal

Integration = Literal["plain", "lightning"]


def default_extensions(engine: Any, *, scaler: Any = None, integration: Integration = "plain") -> list[Any]:
    """The extensions for a new engine, in the order they run."""
    exts: list[Any] = []
    from gradwatch.observe.amp import AmpMonitor

    exts.append(AmpMonitor(scaler, integration=integration))  # first: overflow steps are not incidents
    if integration == "plain":  # Lightning's precision plugin drives the scaler itself
        from gradwatch.observe.scaler_bypass import ScalerBypass

        exts.append(ScalerBypass(scaler))  # after AmpMonitor: uses the scaler it found
    from gradwatch.observe.preclip import BackwardNorms

    # Lightning too: Trainer(gradient_clip_val=...) clips after the check, but a LightningModule's own code
    # may clip before it (self.clip_gradients in manual optimization, clip_grad_norm_ in on_after_backward).
    exts.append(BackwardNorms())  # before ZeroGradTracker: it reads the norms of a cleared step
    from gradwatch.observe.zero_grad import ZeroGradTracker

    exts.append(ZeroGradTracker(integration=integration))
    from gradwatch.observe.unstepped import UnsteppedOptimizers

    exts.append(UnsteppedOptimizers(integration=integration))  # after ZeroGradTracker: reads its pass counts
    from gradwatch.observe.half_update import HalfUpdateGuard

    exts.append(HalfUpdateGuard())  # float16 parameters with an eps that rounds to 0 only
    from gradwatch.observe.tracing import ForwardTracer

    exts.append(ForwardTracer(integration=integration))  # module names for autograd errors
    from gradwatch.observe.magnitude import MagnitudeExtension
    from gradwatch.report.dashboard import Dashboard

    exts.append(MagnitudeExtension())
    exts.append(Dashboard())
    from gradwatch.diagnose.escalation import Escalation

    exts.append(Escalation(integration=integration))
    from gradwatch.observe.distributed import RankAgreement, is_distributed

    if is_distributed() and engine.config.rank_agreement:
        exts.append(RankAgreement())  # last: it folds every rank's verdict into one collective
    return exts
