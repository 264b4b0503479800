"""Escalation: name the op and module where a NaN/Inf was born, then watch closely for a few steps.

The ladder, as an engine extension (:class:`Escalation`, attached by ``default_extensions``):

1. Cheap mode, every step: the engine's fused checks. The only cost here is a forward pre-hook and a
   forward hook on the root model that keep *references* to the step's inputs and to the gradient
   arriving at the model's output, and a reference to each loss given to ``observe_loss`` (no copies,
   no per-module hooks, no anomaly mode, no sync). Under gradient accumulation every forward call of the
   step is kept (at most ``MAX_CALLS``); the output gradients of the ``MAX_GRADS`` most recent ones are
   held, older ones are folded into their sum (one reduction per micro-batch, a 0-dim tensor, non-finite
   when the gradient was), and their losses are detached so their graphs can go.
2. On a non-finite loss or gradient (``on_incident``, before the update, under every policy):
   ``nonfinite_input`` when the captured batch itself holds NaN/Inf (the data is the cause, nothing
   to localize in the model).
3. Otherwise ``nan_origin``: the step is replayed on the captured batch (weights are still unchanged) with
   anomaly mode and :class:`~gradwatch.diagnose.localize.Localizer` on, and the finding names the op (e.g.
   ``SqrtBackward0``), the module and the source line where the first non-finite value was born, with a
   per-layer table of gradient norm and NaN/Inf counts. The replay leaves no trace: parameter ``.grad``
   is untouched (``torch.autograd.grad``), module buffers (BatchNorm running statistics) and the RNG
   state are restored. With several micro-batches, the one replayed is the one that went non-finite:
   first those whose output gradient or loss was non-finite (read now, on the incident only), else the
   first whose plain replay turns non-finite (a NaN born inside the model's backward leaves both
   finite). When the NaN/Inf came from the loss code outside the model, the finding says so
   (``phase="loss"``) and lists the loss code's ops that can make one (``loss_ops``): backward has freed
   the values they saw, so which one did is named only if it recurs in the window (step 4).
4. The next ``escalate_steps`` optimizer steps run escalated: anomaly mode on (forward tracebacks;
   gradwatch checks NaN *and* Inf itself, so anomaly mode never stops the run) and the localizer recording
   the real forward and backward. A loss given to ``observe_loss`` before its backward also gets the
   localizer's hooks on the loss code between the model's outputs and the loss, so a NaN/Inf born there
   is named with its op (``LogBackward0``) and line. ``engine.escalated`` is True meanwhile.
5. The policy acts (the engine). 6. An incident report goes to ``log_dir/incidents/step_<N>.md``/``.json``
   (and ``.pt`` with ``save_batch=True``). 7. When the window ends, anomaly mode is put back as it was.

``escalate=False`` turns all of it off: no hooks, no replay, no anomaly mode, no extra findings.

Memory: until the optimizer step, the references keep alive what the user's loop would otherwise free
one micro-batch at a time: the inputs of every forward call of the step (up to ``MAX_CALLS``), the
output gradients of the last ``MAX_GRADS`` calls (each the size of the model's output: for a language
model the logits), and the autograd nodes of those calls' graphs (not their saved activations, which
backward frees). Pass ``escalate=False`` when even that is too much.

Lightning: the replay runs ``training_step`` again on the captured batch (under accumulation, on up to
``MAX_REPLAYS`` batches of the cycle, those with a non-finite loss first). Logging, ``manual_backward``,
optimizer and scheduler steps are neutralized for it, but any other Python state the user's
``training_step`` changes (a counter on ``self``, a list it appends to) moves once more per replay.

Finding kinds:

- ``nonfinite_input``: the inputs of the step hold NaN/Inf before the model ran (``data["inputs"]``:
  which argument, NaN and Inf counts).
- ``nan_origin``: where the first non-finite value of the step was born. ``data``: ``phase``
  (``"forward"``, ``"backward"``, ``"loss"`` — born in the loss computation outside the model — or
  ``"weights"`` — the parameters were already non-finite — or ``"buffers"`` — e.g. BatchNorm running
  statistics written non-finite by an earlier forward), ``op``, ``forward_op``, ``module``,
  ``source`` (``file:line in function``), ``code``, ``incoming`` / ``outgoing`` magnitudes,
  ``input_op`` (the op that produced the op's input, e.g. ``"Sigmoid"``), ``first_nonfinite_module`` and
  ``first_nonfinite_module_inputs``, ``first_nonfinite_module_given`` (``"NaN"``/``"Inf"`` when that module's
  inputs already held it: it passed it on) and ``last_finite_module``, ``table`` (per layer: gradient
  norm, NaN count, Inf count), ``surrogate_grad`` (the replay used a gradient of ones because the real
  one was not available), ``anomaly_error``, ``forward_traceback``, ``replayed``, ``report`` (the
  incident report path). Not emitted when the replay cannot reproduce the non-finite value (the incident
  report says so).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
from torch import nn

from gradwatch.core.failures import internal_warning
from gradwatch.core.findings import Finding
from gradwatch.core.grad_gates import Gate
from gradwatch.core.params import user_module
from gradwatch.diagnose import bad_values, graph_walk
from gradwatch.diagnose.capture import (
    Call,
    all_finite,
    nonfinite_flags,
    nonfinite_inputs,
    output_leaves,
)
from gradwatch.diagnose.incident import (
    ReportFacts,
    layer_table,
    needs_loop_scan,
    origin_verdict,
    replay_note,
    restate_checks,
    write_report,
)
from gradwatch.diagnose.input_findings import (
    PoisonFacts,
    forward_error_finding,
    input_finding,
    loop_input_finding,
    no_forward_finding,
    poisoned_finding,
)
from gradwatch.diagnose.localize import Localization
from gradwatch.diagnose.origin import origin_finding
from gradwatch.diagnose.reentrant import (
    CUT_CAUSES,
    explain_cut,
    record_reentrant_cut,
    reentrant_no_grad_warned,
)
from gradwatch.diagnose.replay import ReplayResult
from gradwatch.diagnose.replayer import Replayer
from gradwatch.diagnose.step_capture import StepCapture
from gradwatch.diagnose.window import EscalationWindow
from gradwatch.observe.tracing import is_compiled


@dataclasses.dataclass
class _Diagnosis:
    """What an incident's facts led to: its findings, the replay's result, the bad inputs named, the origin
    finding; ``final``: these findings alone (no incident report, no escalation window)."""

    findings: list[Finding]
    result: ReplayResult | None = None
    bad_inputs: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    origin: Finding | None = None
    final: bool = False


class Escalation:
    """Engine extension: localize non-finite incidents and escalate for ``escalate_steps`` steps.

    Args:
        integration: ``"plain"`` (inputs captured by hooks on the root model) or ``"lightning"``
            (the callback hands over each batch through :meth:`lightning_batch_start` and the step is
            replayed through ``training_step``).

    Attributes:
        reports: Paths of the incident reports (``.md``) written so far.
        localizations: ``(step, Localization)`` of each localized incident.

    Example:
        >>> import torch, gradwatch
        >>> from gradwatch.diagnose.escalation import Escalation
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with gradwatch.watch(model, opt, console=False, on_nonfinite="skip") as gw:
        ...     loss = model(torch.zeros(4, 2)).sum() * float("nan")
        ...     loss.backward(); opt.step()
        >>> gw.engine.extension(Escalation).localizations[0][0]
        0
    """

    def __init__(self, integration: str = "plain") -> None:
        self.integration = integration
        self.engine: Any = None
        self.model: nn.Module | None = None
        self.reports: list[str] = []
        self.localizations: list[tuple[int, Localization]] = []
        self.window = EscalationWindow()
        self.capture = StepCapture(self.window, integration)
        self.replayer = Replayer(self.capture, self.window)
        self._handled: tuple[int, int] | None = None
        self._poison_reported = False

    @property
    def active(self) -> bool:
        return self.engine is not None and bool(self.engine.config.escalate) and self.model is not None

    @property
    def escalated(self) -> bool:
        """Whether the escalation window is open."""
        return self.window.is_open

    @property
    def replaying(self) -> bool:
        """Whether a localization replay (or ``Watcher.gradcheck``'s forward) is running: it must update nothing."""
        return self.capture.replaying

    @replaying.setter
    def replaying(self, value: bool) -> None:  # set by ``Watcher.gradcheck`` around its forwards
        self.capture.replaying = value

    @property
    def last_step(self) -> tuple[int, list[tuple[Any, Any, Any]]] | None:
        """Between steps (and after close): the last step's index and its forward calls' ``(args, kwargs, rng
        state)``, references only, for ``Watcher.gradcheck()``; dropped when the next step's forward starts."""
        return self.capture.last_step

    @property
    def _calls(self) -> list[Call]:
        return self.capture.calls

    # -- attach / cheap mode -----------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        self.engine = engine
        engine.escalated = False
        engine.replaying = False
        # Under Lightning Fabric the user's module, not fabric.setup's wrapper: Fabric runs training_step on it
        # directly, so only its own forward is sure to run (and the replay then runs no strategy wrapper's
        # collectives, e.g. DDP's buffer broadcast, on this rank alone).
        self.model = user_module(engine.model) if isinstance(engine.model, nn.Module) else None
        self.capture.engine, self.capture.model = engine, self.model
        self.replayer.engine, self.replayer.model = engine, self.model
        if not engine.config.escalate or self.model is None:
            return
        observers = getattr(engine, "loss_observers", None)
        if observers is not None:
            observers.append(self.capture.on_loss)
        if self.integration == "plain":
            self.capture.attach(engine, self.model)

    def lightning_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Called by ``GradWatchCallback.on_train_batch_start``: keep a reference to the batch and, in an
        escalation window, switch anomaly mode on (the Trainer overrides it when set any earlier)."""
        if not self.active:
            return
        self.capture_batch(batch, batch_idx, trainer, pl_module)
        if self.window.is_open:
            self.window.anomaly_on()

    def capture_batch(self, batch: Any, batch_idx: int, trainer: Any = None, pl_module: Any = None) -> None:
        """Keep a reference to a Lightning batch for replay (``training_step(batch, batch_idx)``).

        Every batch of the current accumulation cycle is kept (at most ``MAX_CALLS``): the replay picks
        the one whose loss was non-finite.
        """
        self.capture.capture_batch(batch, batch_idx, trainer, pl_module if pl_module is not None else self.model)

    # -- escalation window -------------------------------------------------------------------------
    def _open_window(self, step: int) -> None:
        if not self.window.open(step, self.engine.config.escalate_steps):
            return
        self.engine.escalated = True
        if self.capture.under_compile:
            self.window.anomaly_on()  # here, at the step: inside Dynamo's trace it would break the graph
        if self.integration == "plain" and self.model is not None and not is_compiled(self.model) and not (
            self.capture.under_compile
        ):
            # A compiled model's forward runs inside Dynamo's trace, where the live localizer's function
            # modes would cost graph breaks and recompiles: there the window is anomaly mode only.
            self.window.localize(self.model, self._escalated_forward_end)

    def _close_window(self) -> None:
        self.window.close()
        if self.engine is not None:
            self.engine.escalated = False

    def _escalated_forward_end(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.window.restore_checkpoint()
        live = self.window.live
        if live is None or self.capture.replaying or not live.recording:
            return
        live.stop_forward()
        try:
            if output is not None:
                leaves = [t for t in output_leaves(output) if isinstance(t, torch.Tensor)]
                live.hook_graph(leaves)
                self.window.live_used = True
                if self._calls:  # a device flag, read on an incident only
                    self._calls[-1].output_ok = all_finite(
                        [t.detach() for t in leaves if t.is_floating_point() or t.is_complex()]
                    )
        except Exception as exc:  # noqa: BLE001
            internal_warning("Escalation.hook_graph", exc, owner=self.engine)

    def before_sync(self, ctx: Any) -> None:
        if self.capture.half_loss:
            # A float16 loss that goes Inf has overflowed 65504 (squared errors above 256): nonfinite_loss says so.
            self.capture.half_loss = False
            ctx.stats.extra["loss_dtype"] = "float16"
        if ctx.stats.none_grad and self.active and reentrant_no_grad_warned():
            ctx.stats.extra["reentrant_cut"] = self.reentrant_cut  # called by none_grad when it reports only
        passes = ctx.stats.extra.get("backward_passes")
        if isinstance(passes, tuple) and passes[0] >= 3 and self.active:  # only asked about then
            ctx.stats.extra["step_inputs"] = self.step_inputs()

    def step_inputs(self) -> tuple[int, bool, frozenset[int]]:
        """See :meth:`StepCapture.step_inputs`."""
        return self.capture.step_inputs()

    def after_step(self, stats: Any, decision: str) -> None:
        if stats.optimizer_index == len(self.engine.step_counts) - 1:
            # Release the step's inputs and output gradients as soon as no optimizer needs them. A
            # Lightning batch stays until the next one starts: with several optimizers stepping inside
            # one training_step (manual GAN), the last-listed one may step first.
            self.capture.end_step(stats.step)
        if stats.optimizer_index == 0 and self.window.count_step(stats.step):
            self._close_window()

    def close(self) -> None:
        self._close_window()
        self.capture.close()
        observers = getattr(self.engine, "loss_observers", None)
        if observers is not None and self.capture.on_loss in observers:
            observers.remove(self.capture.on_loss)

    # -- the incident ------------------------------------------------------------------------------
    def on_incident(self, stats: Any, findings: list[Finding]) -> list[Finding]:
        if not self.active:
            return []
        if self.engine.config.deferred:
            # The statistics are one step old and that step's inputs are gone: watch the next steps.
            self._open_window(stats.step)
            return []
        if not stats.is_nonfinite:
            # Only another rank saw it: a local replay has nothing to find here, and under sharded
            # parameters it would run collectives on this rank alone.
            return []
        if "scaler_bypassed" in stats.extra:
            # The gradients still carry the GradScaler's scale (the optimizer stepped around it): the op a
            # localization would name only overflowed under that scale; scaler_step_bypassed names the cause.
            return []
        self.replayer.collective = None
        if self._handled == (stats.step, self.capture.mark):
            return []  # a second optimizer of the same step: the first one's findings name the origin
        self._handled = (stats.step, self.capture.mark)
        self.replayer.culprit = None
        layers = layer_table(stats)
        found = self._diagnose(stats, layers)
        if found.final:
            return found.findings
        out = found.findings
        result = found.result
        if result is None and not found.bad_inputs and self._no_forward():
            out.append(no_forward_finding(stats.step, self.model))
        note = replay_note(result is not None or bool(found.bad_inputs), self.replayer.collective)
        if result is not None and found.origin is not None and result.named:
            restated, findings = restate_checks(findings, stats.step, result.loc.origin)
            if restated is not None:
                out.append(restated)
        self._write_report(stats, findings + [f for f in out if "restates" not in f.data], layers, result, note)
        self._open_window(stats.step)
        return out

    def _no_forward(self) -> bool:
        """The watched model's own forward did not run this step (plain loop)."""
        return self.integration == "plain" and not self._calls and self.capture.forwards == 0

    def _diagnose(self, stats: Any, layers: list[dict[str, Any]]) -> _Diagnosis:
        """The incident's findings, from its facts in order: bad inputs, bad weights, then a localization."""
        bad_inputs = self.nonfinite_inputs()
        if bad_inputs:
            # The NaN batch's forward may already have written NaN into buffers (BatchNorm running stats, a
            # fake-quant observer): skipping the update does not undo that, so say it now.
            finding = input_finding(stats.step, bad_inputs, self._poisoned(buffers=True))
            return _Diagnosis([finding], bad_inputs=bad_inputs)
        poisoned = self._poisoned(buffers=False)
        if poisoned:
            return _Diagnosis(self._poisoned_weights(stats, poisoned, layers), final=True)
        self._poison_reported = False
        if stats.extra.get("raised") and self.integration != "plain" and not stats.extra.get("anomaly_nan"):
            return _Diagnosis([], final=True)  # the training code raised: training_step is not replayed in a failing Trainer
        result = self.replayer.localize()
        if result is not None:
            self._add_precision_facts(result)
        minus_inf = self._unabsorbed_minus_inf(result)
        if minus_inf:
            # -inf the forward never absorbed, as a mask would be: bad data (log of a zero feature).
            finding = input_finding(stats.step, minus_inf, self._poisoned(buffers=True), through=result)
            return _Diagnosis([finding], result=result, bad_inputs=minus_inf)
        return self._origin(stats, layers, result)

    def _poisoned_weights(self, stats: Any, names: list[str], layers: list[dict[str, Any]]) -> list[Finding]:
        """Weights already non-finite: said once until a step is finite again."""
        if self._poison_reported:
            return []
        self._poison_reported = True
        config = self.engine.config
        earlier = self.engine.kind_counts.get("nan_origin", 0) > 0
        facts = PoisonFacts(
            stats.step, names, buffers=False, policy=config.on_nonfinite, every=config.every, earlier=earlier,
            rows=self._embedding_rows(names),
        )
        return [poisoned_finding(facts, layers)]

    def _add_precision_facts(self, result: ReplayResult) -> None:
        """What the replayed call's loss and precision add to ``result``: its observed loss was non-finite, it
        ran under float16 autocast, or the model's weights are float16 (model.half(), precision="16-true")."""
        culprit = self.replayer.culprit
        if culprit is not None:
            losses = getattr(culprit, "losses", ())
            result.loss_nonfinite = any(not bool(torch.isfinite(l).all()) for l in losses if l.is_floating_point())
            state = getattr(culprit, "autocast", None) or ()
            result.half = any(dtype == torch.float16 for _device, dtype in state)
        if not result.half:
            result.half_weights = any(
                p.dtype == torch.float16 for _n, p in self.engine.index.model_params if p.is_floating_point()
            )

    def _origin(self, stats: Any, layers: list[dict[str, Any]], result: ReplayResult | None) -> _Diagnosis:
        out: list[Finding] = []
        if needs_loop_scan(self.integration == "plain", result):
            loop_bad = self._loop_tensors()
            if loop_bad:
                out.append(loop_input_finding(stats.step, loop_bad))
        # Buffers are checked only when the replay named no op: this step's own forward may have written
        # the NaN into them (BatchNorm running statistics) after it was born where the replay found it.
        # A buffer poisoned by an earlier step (a fake-quant scale, a running scale) makes every later
        # forward non-finite without a birth: it is named instead of a vague "born in the loss".
        stale = [] if result is not None and result.named else self._poisoned(buffers=True)
        verdict = origin_verdict(result is not None, bool(stale))
        origin: Finding | None = None
        if verdict == "stale":
            facts = PoisonFacts(stats.step, stale, buffers=True, policy=self.engine.config.on_nonfinite)
            out.append(poisoned_finding(facts, layers))
        elif verdict == "origin" and result is not None:
            self.localizations.append((stats.step, result.loc))
            origin = origin_finding(stats.step, result, layers)
            out.append(origin)
        return _Diagnosis(out, result=result, origin=origin)

    def _source(self) -> list[Any]:
        return self.capture.sources()

    def nonfinite_inputs(self, *, minus_inf: bool = False) -> list[tuple[str, int, int]]:
        """``(name, NaN count, Inf count)`` of the step's captured inputs that hold NaN/Inf (``minus_inf``:
        those holding -inf only). One sync: on an incident or an error only."""
        return nonfinite_inputs(self._source(), minus_inf=minus_inf)

    def _unabsorbed_minus_inf(self, result: ReplayResult | None) -> list[tuple[str, int, int]]:
        """The inputs holding -inf but no NaN or +Inf, when their -inf was not absorbed. Such an input passes
        for an additive attention mask (see ``capture.bad_data``) only if the forward absorbs its -inf (softmax,
        masked_fill); one that reaches the model's output as NaN/Inf through plain arithmetic (a Linear) is bad
        data: log of a zero count feature. Incident path, plain loop: a sync or two."""
        if result is None or result.output_ok is None or self.integration != "plain":
            return []
        if not bad_values.minus_inf_suspected(result) or not nonfinite_flags([result.output_ok])[0]:
            return []
        return self.nonfinite_inputs(minus_inf=True)

    def forward_error(self, exc: BaseException, step: int) -> Finding | None:
        """An exception ended the loop with no NaN/Inf gradient or loss to explain (a loss that raised on a
        NaN input: BCELoss's "between 0 and 1"): a ``nonfinite_input`` finding when the step's inputs, or the
        outputs of the model's latest forward, hold NaN/Inf. Exception path only: a read per tensor."""
        inputs = self.nonfinite_inputs()
        outputs = bad_values.bad_outputs(self._calls[-1]) if not inputs and self._calls else []
        if not inputs and not outputs:
            return None
        return forward_error_finding(step, exc, inputs, outputs)

    def output_nan(self) -> bool:
        """Whether a held output gradient of the step holds NaN (plain loop; exception path only)."""
        return bad_values.output_nan(self._calls)

    def _loop_tensors(self) -> list[tuple[str, int, int]]:
        return bad_values.loop_tensors(self._calls, self.model, sys._getframe())

    def _poisoned(self, *, buffers: bool) -> list[str]:
        """Names of parameters (or buffers) that hold NaN/Inf themselves (one sync, incident path only)."""
        if buffers:
            return bad_values.poisoned(list(self.model.named_buffers()) if self.model is not None else [])
        return bad_values.poisoned(list(self.engine.index.model_params))

    def _embedding_rows(self, names: list[str]) -> dict[str, tuple[list[int], int]]:
        if self.model is None:
            return {}
        return bad_values.embedding_rows(self.model, self.engine.index.model_params, names)

    # -- graph walks and the reentrant checkpoint cut ------------------------------------------------
    def unowned_params(self, known: set[int], limit: int = 4096) -> list[torch.Tensor]:
        """``nn.Parameter`` leaves the step's model outputs were computed from that the model does not own
        (``known``: ids of its parameters and of the optimizers' tensors): a layer built inside forward().
        A walk of the outputs' graph (at most ``limit`` nodes), stopping at the model's inputs (a
        perturbation that requires grad, added to the input, is not the model's). First checks only."""
        if self.integration != "plain":
            return []
        return graph_walk.unowned_params(self._calls, known, limit)

    def graph_leaves(self, limit: int = 4096, *, reached: bool = False) -> list[torch.Tensor] | None:
        """The leaf tensors (parameters) the step's model outputs were computed from: a walk of their graph
        (at most ``limit`` nodes) that stops at the model's inputs. ``reached``: only from the outputs a
        gradient arrived at in backward (an auxiliary output the loss ignores reaches nothing). None when
        the step's graph is not held (Lightning, a folded call). For the first steps or suspicious ones."""
        if self.integration != "plain":
            return None
        return graph_walk.graph_leaves(self._calls, limit, reached=reached)

    def gated_leaves(self, limit: int = 4096) -> list[tuple[torch.Tensor, Gate | None]] | None:
        """:meth:`graph_leaves` (``reached``), each leaf with the custom autograd Function every path to it
        passes through, or None (see ``graph_walk.gated_leaves``). None when the step's graph is not held."""
        if self.integration != "plain":
            return None
        return graph_walk.gated_leaves(self._calls, limit, reached=True)

    def explain_no_graph(self, finding: Finding) -> Finding:
        """``no_grad_graph`` blaming frozen layers or a cut graph: when the cut is a reentrant checkpoint fed
        an input without grad (see :meth:`reentrant_cut`), say so instead; the trainable layers are not frozen."""
        if finding.data.get("cause") not in CUT_CAUSES:
            return finding
        cut = self.reentrant_cut()
        return explain_cut(finding, cut) if cut else finding

    def reentrant_cut(self) -> dict[str, list[str]]:
        """The ``torch.utils.checkpoint(..., use_reentrant=True)`` segments of the step's forward whose tensor
        inputs all had requires_grad=False (module name), each with the trainable parameters inside it.

        Such a segment returns an output without a graph (torch warns "None of the inputs have
        requires_grad=True. Gradients will be None"), so its parameters get no gradient although they are
        trainable: LoRA adapters behind a frozen embedding (peft#137, transformers#23170). Read by replaying
        the step's last forward with the checkpoint calls recorded: on the ``no_grad_graph`` error path and
        the first ``none_grad`` report only. Plain loop only; empty when no such segment ran.
        """
        if self.integration != "plain" or self.model is None or not self._calls:
            return {}
        model = self.replayer.replay_model()
        self.replaying = True
        try:
            return record_reentrant_cut(model, self._calls[-1], self.engine.index, self.replayer)
        finally:
            self.replaying = False

    # -- report ------------------------------------------------------------------------------------
    def _write_report(
        self,
        stats: Any,
        findings: list[Finding],
        layers: list[dict[str, Any]],
        result: ReplayResult | None,
        note: str | None,
    ) -> None:
        facts = ReportFacts(findings, layers, result, note, self._source(), self.replayer.culprit)
        write_report(self.engine, self.reports, stats, facts)

