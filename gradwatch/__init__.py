"""gradwatch: a training-health monitor for PyTorch you can leave switched on.

Catches NaN/Inf in losses and gradients, parameters without gradients or outside the optimizer,
forgotten ``zero_grad``, exploding and vanishing gradients, and explains autograd errors, at the step
they happen; protects the weights; reports to the console, TensorBoard and JSON lines. On request,
``gradwatch.gradcheck`` checks every custom autograd Function's backward against finite differences.

Example:
    >>> import gradwatch
    >>> # with gradwatch.watch(model, optimizer, log_dir="runs/exp1") as gw:
    >>> #     ... your training loop ...
"""

from gradwatch.core.config import Config
from gradwatch.core.failures import GradWatchInternalWarning
from gradwatch.core.findings import Explanation, Finding, GradWatchError
from gradwatch.core.kinds import KINDS, Kind
from gradwatch.gradcheck import GradcheckResult, gradcheck
from gradwatch.report.summary import RunSummary
from gradwatch.version import __version__
from gradwatch.watch import Watcher, watch

__all__ = [
    "KINDS",
    "Config",
    "Explanation",
    "Finding",
    "GradWatchError",
    "GradWatchInternalWarning",
    "GradcheckResult",
    "Kind",
    "RunSummary",
    "Watcher",
    "__version__",
    "gradcheck",
    "watch",
]
