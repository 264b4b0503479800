"""How much does gradwatch cost per training step? Side-by-side, in one process, interleaved.

Every variant (bare, a second bare as an A/A control, gradwatch in several configurations, and the
tools people would otherwise use) trains its own copy of the same model on the same batches. Rounds run
the variants in a freshly shuffled order, each for a few whole training steps (forward, backward,
optimizer step, zero_grad); a variant's round time is the mean step time of its steps in that round.
Reported per variant: the median round time and the median over rounds of its ratio to *that round's*
bare step, so slow drifts of the machine (other processes, thermal) cancel. The A/A row shows how far
from 1.00 two identical variants land: differences smaller than that are noise.

Also measured: gradwatch's own per-step work on ready gradients (the engine's check path called
directly, many repetitions) against the fused floor (``_foreach_norm`` + one ``isfinite`` + one sync)
and against ``AdamW.step``; and a Lightning ``Trainer.fit`` of W2 with and without gradwatch's callback
(each fit runs in a process of its own and one fit runs at a time: the fits take turns, so those are
interleaved too).

Usage::

    python benchmarks/overhead.py --quick            # < 2 minutes
    python benchmarks/overhead.py --out results.md   # full run, < 30 minutes
    python benchmarks/overhead.py --workloads standalone --repeat 9   # gradwatch's own work vs the floor

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import itertools
import math
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gradwatch

TARGETS = {
    # (workload, variant) -> maximum median ratio to bare
    ("W1", "gradwatch every=10"): 1.01,
    ("W2", "gradwatch every=10"): 1.01,
    ("W3", "gradwatch every=10"): 1.01,
    ("W2-Lightning", "gradwatch callback"): 1.03,
}
#: Variants whose cost comes every N steps: judged on the total-time ratio (amortized), not the median.
AMORTIZED = {"gradwatch every=10"}
#: Variant judged against another variant of the same table (its median ratio at most the other's), not a number.
RELATIVE_TARGETS = {
    "gradwatch default": "Lightning grad_norm, logged every step",
    "gradwatch callback": "Lightning grad_norm, logged every step",
}
#: The noise floor shown next to a relative verdict: two identical variants (plain loop; Lightning).
AA_ROWS = ("bare (A/A)", "without callback (A/A)")
#: Standalone: gradwatch's check at most this many times the fused floor (None: shown, not judged).
OWN_VS_FLOOR: dict[str, float | None] = {"W1": None, "W2": 1.2, "W3": 1.2}
OWN_VS_ADAMW = 0.15


# ------------------------------------------------------------------------------------------------
# Workloads
# ------------------------------------------------------------------------------------------------
class TinyLM(nn.Module):
    """W1: Embedding 8000x256 + learned positions, 4 encoder layers (d=256, 4 heads, ff=1024), LM head."""

    def __init__(self, vocab: int = 8000, d: int = 256, layers: int = 4, seq: int = 128, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=1024, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        if tied:
            self.head.weight = self.tok.weight
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def deep_mlp(depth: int = 40, width: int = 256) -> nn.Module:
    """W2: 40 x (Linear(256, 256) + ReLU): 80 small parameter tensors."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        lin = nn.Linear(width, width)
        # He init keeps activations and gradients at scale through 40 layers; PyTorch's default init
        # shrinks them into float32 denormals, which makes every kernel (and AdamW) 50x slower on CPU.
        nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers)


def wide_mlp(depth: int = 6, width: int = 1024) -> nn.Module:
    """W3: 6 x (Linear(1024, 1024) + GELU): 12 parameter tensors, 6.3M values (few large tensors)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        lin = nn.Linear(width, width)
        nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")  # see deep_mlp: no float32 denormals
        nn.init.zeros_(lin.bias)
        layers += [lin, nn.GELU()]
    return nn.Sequential(*layers)


@dataclass
class Workload:
    name: str
    description: str
    make_model: Callable[[], nn.Module]
    batches: list[tuple[torch.Tensor, torch.Tensor]]  # a variant's steps cycle through them

    @property
    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[0]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    steps_per_round: int


def make_workloads(tied: bool) -> dict[str, Workload]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 8000, (8, 129), generator=g)

    def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    # W2 cycles through 32 batches of random targets: a stationary, healthy run. On one fixed batch the
    # net memorizes it, and after ~400 steps Adam's update on near-zero gradients starts a real burst
    # (norm x100, loss +14%) that gradwatch rightly reports.
    w2 = [(torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)) for _ in range(32)]
    w3 = [(torch.randn(256, 1024, generator=g), torch.randn(256, 1024, generator=g)) for _ in range(8)]
    return {
        "W1": Workload(
            "W1",
            f"Transformer-encoder LM ({'tied' if tied else 'untied'} head), seq 128, batch 8, AdamW",
            lambda: TinyLM(tied=tied),
            [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())],
            lm_loss,
            steps_per_round=5,
        ),
        "W2": Workload(
            "W2",
            "MLP 40 x Linear(256,256)+ReLU, batch 64, AdamW",
            deep_mlp,
            w2,
            lambda out, y: nn.functional.mse_loss(out, y),
            steps_per_round=10,
        ),
        "W3": Workload(
            "W3",
            "MLP 6 x Linear(1024,1024)+GELU, batch 256, AdamW",
            wide_mlp,
            w3,
            lambda out, y: nn.functional.mse_loss(out, y),
            steps_per_round=5,
        ),
    }


def build(workload: Workload) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = workload.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


# ------------------------------------------------------------------------------------------------
# Variants: each owns its model, optimizer and watcher (built once, alive across rounds)
# ------------------------------------------------------------------------------------------------
@dataclass
class Variant:
    name: str
    step: Callable[[], None]
    close: Callable[[], None] = lambda: None
    note: str = ""
    check_after: Callable[[], str | None] = lambda: None  # e.g. findings on a healthy run
    watcher: Any = None
    end_round: Callable[[], None] = lambda: None  # untimed, after each round (restore global state)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, wl: Workload, *, before_step: Callable[[], None] | None = None,
                around_fwd_bwd: Callable[[], Any] | None = None) -> Callable[[], None]:
    next_batch = itertools.cycle(wl.batches).__next__
    loss_fn = wl.loss_fn

    def step() -> None:
        x, y = next_batch()
        ctx = around_fwd_bwd() if around_fwd_bwd is not None else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y)
            loss.backward()
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _watched_step(model: nn.Module, opt: torch.optim.Optimizer, wl: Workload, gw: Any) -> Callable[[], None]:
    next_batch = itertools.cycle(wl.batches).__next__
    loss_fn = wl.loss_fn

    def step() -> None:
        x, y = next_batch()
        loss = loss_fn(model(x), y)
        gw.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _bare(wl: Workload, name: str, tmp: str) -> Variant:
    model, opt = build(wl)
    return Variant(name, _train_step(model, opt, wl))


def _gradwatch(wl: Workload, name: str, tmp: str, **config: Any) -> Variant:
    model, opt = build(wl)
    log_dir = tempfile.mkdtemp(prefix=f"gw-{wl.name}-", dir=tmp)
    sink = io.StringIO()
    from rich.console import Console

    config = {"log_dir": log_dir, "console": Console(file=sink, width=120, color_system=None), **config}
    gw = gradwatch.watch(model, opt, **config)

    def check_quiet() -> str | None:
        if gw.findings:
            kinds = sorted({f.kind for f in gw.findings})
            return f"findings on a healthy run: {', '.join(kinds)}"
        return None

    return Variant(name, _watched_step(model, opt, wl, gw), close=gw.close, check_after=check_quiet, watcher=gw)


def _escalated(wl: Workload, name: str, tmp: str) -> Variant | str:
    """gradwatch with its escalation window held open (reference only: escalation follows an incident)."""
    try:
        from gradwatch.diagnose.escalation import Escalation
    except ImportError:
        return "escalation is not available in this version of gradwatch"
    v = _gradwatch(wl, name, tmp)
    engine = v.watcher.engine
    ext = next((e for e in engine.extensions if isinstance(e, Escalation)), None)
    open_window = getattr(ext, "_open_window", None)
    if ext is None or open_window is None:
        return "no escalation extension with a window to open"
    # The window must close by itself after escalate_steps optimizer steps.
    open_window(engine.step_counts[0])
    for _ in range(engine.config.escalate_steps + 1):
        v.step()
    if engine.escalated:
        v.note = f"window still open after {engine.config.escalate_steps + 1} steps"
        return v
    inner = v.step

    def step() -> None:
        if not engine.escalated:
            open_window(engine.step_counts[0])
        inner()

    v.step = step
    # Anomaly mode is process-wide while the window is open: close it between rounds so the variants that
    # run next are not measured with it.
    v.end_round = ext._close_window
    v.note = f"window re-opened whenever it closes; it closed by itself after {engine.config.escalate_steps} steps"
    return v


def _per_param_loop(wl: Workload, name: str, tmp: str) -> Variant:
    model, opt = build(wl)
    params = list(model.parameters())

    def check() -> None:
        bad = 0
        total = 0.0
        for p in params:
            g = p.grad
            if g is None:
                continue
            if not torch.isfinite(g).all().item():
                bad += 1
            total += g.norm().item() ** 2

    return Variant(name, _train_step(model, opt, wl, before_step=check))


def _import_grad_norm() -> Callable[..., dict[str, torch.Tensor]] | None:
    try:
        from lightning.pytorch.utilities import grad_norm
    except ImportError:
        try:
            from pytorch_lightning.utilities import grad_norm  # type: ignore[no-redef]
        except ImportError:
            return None
    return grad_norm


def _lightning_grad_norm(wl: Workload, name: str, tmp: str) -> Variant | str:
    """Lightning's ``grad_norm`` computed every step, its values not read (no sync, nothing logged)."""
    grad_norm = _import_grad_norm()
    if grad_norm is None:
        return "Lightning is not installed"
    model, opt = build(wl)
    return Variant(name, _train_step(model, opt, wl, before_step=lambda: grad_norm(model, 2)))


def _lightning_grad_norm_logged(wl: Workload, name: str, tmp: str) -> Variant | str:
    """``grad_norm`` as Lightning's documentation uses it, logged every step: each value read and written to
    TensorBoard, as ``self.log_dict(grad_norm(self, 2))`` with ``log_every_n_steps=1`` and Lightning's
    TensorBoardLogger end up doing (without the Trainer's own bookkeeping of the logged values)."""
    grad_norm = _import_grad_norm()
    if grad_norm is None:
        return "Lightning is not installed"
    from torch.utils.tensorboard import SummaryWriter

    model, opt = build(wl)
    writer = SummaryWriter(tempfile.mkdtemp(prefix=f"gn-{wl.name}-", dir=tmp))
    step = [0]

    def log() -> None:
        for key, value in grad_norm(model, 2).items():
            writer.add_scalar(key, value.item(), step[0])
        step[0] += 1

    return Variant(name, _train_step(model, opt, wl, before_step=log), close=writer.close)


def _anomaly(wl: Workload, name: str, tmp: str) -> Variant:
    model, opt = build(wl)
    return Variant(name, _train_step(model, opt, wl, around_fwd_bwd=lambda: torch.autograd.detect_anomaly(check_nan=True)))


def _nan_hooks(wl: Workload, name: str, tmp: str) -> Variant:
    """isfinite of every module's outputs in forward hooks (fairseq NanDetector style)."""
    model, opt = build(wl)

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        outs = output if isinstance(output, (tuple, list)) else (output,)
        for o in outs:
            if isinstance(o, torch.Tensor) and o.is_floating_point() and not torch.isfinite(o).all():
                raise FloatingPointError(f"non-finite output in {type(module).__name__}")

    handles = [m.register_forward_hook(hook) for m in model.modules()]

    def close() -> None:
        for h in handles:
            h.remove()

    return Variant(name, _train_step(model, opt, wl), close=close)


def _tb_histograms(wl: Workload, name: str, tmp: str) -> Variant:
    from torch.utils.tensorboard import SummaryWriter

    model, opt = build(wl)
    writer = SummaryWriter(log_dir=tempfile.mkdtemp(prefix=f"hist-{wl.name}-", dir=tmp))
    named = list(model.named_parameters())
    count = [0]

    def log() -> None:
        for n, p in named:
            if p.grad is not None:
                writer.add_histogram(f"grad/{n}", p.grad, count[0])
        count[0] += 1

    return Variant(name, _train_step(model, opt, wl, before_step=log), close=writer.close)


def fused_floor(grads: list[torch.Tensor]) -> bool:
    """The least a fused check can do: per-tensor norms in one kernel, one isfinite, one sync."""
    norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    return bool(torch.isfinite(norms).all())


def _floor(wl: Workload, name: str, tmp: str) -> Variant:
    model, opt = build(wl)
    params = list(model.parameters())

    def check() -> None:
        fused_floor([p.grad for p in params if p.grad is not None])

    return Variant(name, _train_step(model, opt, wl, before_step=check))


BARE = "bare"
VARIANTS: list[tuple[str, Callable[..., Variant | str]]] = [
    (BARE, _bare),
    ("bare (A/A)", _bare),
    ("gradwatch default", _gradwatch),
    ("gradwatch every=10", lambda wl, n, t: _gradwatch(wl, n, t, every=10)),
    ("gradwatch escalated (reference)", _escalated),
    ("floor: fused _foreach_norm + isfinite + 1 sync", _floor),
    ("per-parameter .item() loop", _per_param_loop),
    ("Lightning grad_norm, logged every step", _lightning_grad_norm_logged),
    ("Lightning grad_norm, not logged", _lightning_grad_norm),
    ("isfinite forward hooks (NanDetector)", _nan_hooks),
    ("torch.autograd.detect_anomaly", _anomaly),
    ("TensorBoard histograms every step", _tb_histograms),
]


# ------------------------------------------------------------------------------------------------
# Interleaved measurement
# ------------------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    median_ms: float
    ratio: float
    ratio_lo: float
    ratio_hi: float
    total_ratio: float
    note: str = ""


def summarize(per_round: dict[str, list[float]], bare: str = BARE, notes: dict[str, str] | None = None) -> list[Row]:
    """Median round time and median per-round ratio to bare (with the 25th-75th percentile of ratios)."""
    notes = notes or {}
    base = per_round[bare]
    rows = []
    for name, ts in per_round.items():
        ratios = sorted(t / b for t, b in zip(ts, base))
        rows.append(
            Row(
                name,
                statistics.median(ts) * 1e3,
                statistics.median(ratios),
                _quantile(ratios, 0.25),
                _quantile(ratios, 0.75),
                sum(ts) / sum(base[: len(ts)]),
                notes.get(name, ""),
            )
        )
    return rows


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def run_loop_benchmark(wl: Workload, rounds: int, warmup: int, steps: int, tmp: str, rng: random.Random,
                       only: set[str] | None, log: Callable[[str], None]) -> tuple[list[Row], list[str]]:
    variants: list[Variant] = []
    skipped: list[str] = []
    for name, factory in VARIANTS:
        if only and name != BARE and not any(o in name for o in only):
            continue
        v = factory(wl, name, tmp)
        if isinstance(v, str):
            skipped.append(f"{wl.name} / {name}: skipped ({v})")
            continue
        variants.append(v)
    for v in variants:  # warm-up: first steps (allocator, gradwatch's first-step checks) are not timed
        for _ in range(warmup):
            v.step()
    per_round: dict[str, list[float]] = {v.name: [] for v in variants}
    t_start = time.perf_counter()
    for r in range(rounds):
        order = variants[:]
        rng.shuffle(order)
        for v in order:
            gc.collect()
            t0 = time.perf_counter()
            for _ in range(steps):
                v.step()
            per_round[v.name].append((time.perf_counter() - t0) / steps)
            v.end_round()
        if r == 0:
            eta = (time.perf_counter() - t_start) * rounds
            log(f"  {wl.name}: {len(variants)} variants x {rounds} rounds x {steps} steps, ~{eta:.0f} s")
    problems = []
    for v in variants:
        v.close()
        msg = v.check_after()
        if msg:
            problems.append(f"{wl.name} / {v.name}: {msg}")
    notes = {v.name: v.note for v in variants if v.note}
    return summarize(per_round, notes=notes), skipped + problems


# ------------------------------------------------------------------------------------------------
# Standalone: gradwatch's own per-step work on ready gradients
# ------------------------------------------------------------------------------------------------
def run_standalone(wl: Workload, reps: int, tmp: str, rng: random.Random) -> dict[str, float]:
    from rich.console import Console

    x, y = wl.batch
    model, opt = build(wl)
    gw = gradwatch.watch(model, opt, log_dir=tempfile.mkdtemp(prefix=f"own-{wl.name}-", dir=tmp),
                         console=Console(file=io.StringIO(), width=120, color_system=None))
    wl.loss_fn(model(x), y).backward()
    engine = gw.engine
    params = list(model.parameters())

    adam_model, adam_opt = build(wl)
    wl.loss_fn(adam_model(x), y).backward()

    def own() -> None:
        engine.check_step(0)
        engine.step_done(0)

    def floor() -> None:  # as in the loop's floor row: a check in a step reads the gradients off the parameters
        fused_floor([p.grad for p in params if p.grad is not None])

    def adamw() -> None:
        adam_opt.step()

    fns = {"gradwatch check": own, "fused floor": floor, "AdamW.step": adamw}
    for fn in fns.values():  # past gradwatch's first checks (the early update-ratio measurements)
        for _ in range(12):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    block = 5
    gc.collect()
    for _ in range(max(1, reps // block)):
        order = list(fns.items())
        rng.shuffle(order)
        for name, fn in order:
            t0 = time.perf_counter()
            for _ in range(block):
                fn()
            times[name].append((time.perf_counter() - t0) / block)
    findings = list(gw.findings)
    gw.close()
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    # Paired: each round's check block against the same round's floor block (load drifts cancel).
    out["check / floor"] = statistics.median(c / f for c, f in zip(times["gradwatch check"], times["fused floor"]))
    out["findings"] = float(len(findings))
    return out


# ------------------------------------------------------------------------------------------------
# Lightning: fit W2 with and without the callback, each fit in its own process, fits taking turns
# ------------------------------------------------------------------------------------------------
#: Seconds the parent waits for a fit process: to reach its first batch (spawn, imports, Trainer setup),
#: for one turn (plus a second per step), and to end after "stop".
PL_START_TIMEOUT = 600.0
PL_TURN_TIMEOUT = 120.0
PL_STOP_TIMEOUT = 60.0


def _lightning_fit_child(conn: Any, repo_root: str, gradwatch_file: str, mode: str, threads: int, tmp: str) -> None:
    """One ``Trainer.fit`` of W2 in a process of its own, run by :func:`run_lightning` through ``conn``.

    ``mode``: ``"none"`` (the bare fit), ``"callback"`` (gradwatch's callback) or ``"grad_norm"`` (the module logs
    Lightning's ``grad_norm`` in ``on_before_optimizer_step``, as Lightning's documentation shows). Every fit
    has ``log_every_n_steps=1``: the logged norms are written at every step.

    Protocol (tuples over a duplex pipe). Child to parent: ``("ready", info)`` at the first batch,
    ``("turn", mean_step_s, n_steps)`` at the end of each turn, ``("error", text)`` if the fit fails,
    ``("done",)`` when the fit has ended. Parent to child: ``("go", n_steps)`` or ``("stop",)``. Between
    turns the fit blocks in ``conn.recv()`` (a blocking read: an idle fit uses no CPU).
    """
    try:
        if repo_root not in sys.path:
            sys.path.insert(0, repo_root)
        torch.set_num_threads(threads)
        warnings.simplefilter("ignore")
        import logging

        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # "GPU available: False ..." x3
        import lightning.pytorch as pl
        from lightning.pytorch.loggers import TensorBoardLogger

        import gradwatch as gw_mod

        if os.path.realpath(gw_mod.__file__) != os.path.realpath(gradwatch_file):
            conn.send(("error", f"the fit process imported gradwatch from {gw_mod.__file__}, not {gradwatch_file}"))
            return
        callback_cls: Any = None
        if mode == "callback":
            callback_cls = importlib.import_module("gradwatch.lightning").GradWatchCallback

        wl = make_workloads(tied=False)["W2"]

        class Batches(torch.utils.data.IterableDataset):
            def __iter__(self):  # type: ignore[no-untyped-def]
                yield from itertools.cycle(wl.batches)

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(1)
                self.net = deep_mlp()

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                xb, yb = batch
                return nn.functional.mse_loss(self.net(xb), yb)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.AdamW(self.parameters(), lr=1e-4)

        class GradNormModule(Module):
            def on_before_optimizer_step(self, optimizer: Any) -> None:
                from lightning.pytorch.utilities import grad_norm

                self.log_dict(grad_norm(self, norm_type=2))

        class Turns(pl.Callback):
            """Times each step (batch start to next batch start); between turns, waits for the parent."""

            def __init__(self) -> None:
                self.left = 0
                self.t_last: float | None = None
                self.turn_times: list[float] = []
                self.started = False
                self.stopping = False

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                now = time.perf_counter()
                if self.stopping:
                    trainer.should_stop = True
                    return
                if self.t_last is not None:
                    self.turn_times.append(now - self.t_last)
                if self.left > 0:
                    self.left -= 1
                    self.t_last = now
                    return
                if not self.started:
                    self.started = True
                    conn.send(("ready", {"torch_threads": torch.get_num_threads(), "pid": os.getpid()}))
                elif self.turn_times:
                    conn.send(("turn", sum(self.turn_times) / len(self.turn_times), len(self.turn_times)))
                self.turn_times = []
                self.t_last = None
                msg = conn.recv()  # blocks until the parent hands this fit its next turn
                if msg[0] != "go":
                    self.stopping = True
                    trainer.should_stop = True  # this last step runs, then the fit ends normally
                    return
                gc.collect()
                self.left = int(msg[1]) - 1
                self.t_last = time.perf_counter()

        from rich.console import Console

        callbacks: list[Any] = [Turns()]
        if callback_cls is not None:
            callbacks.append(callback_cls(console=Console(file=io.StringIO(), width=120, color_system=None)))
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=10**9,
            max_epochs=-1,
            logger=TensorBoardLogger(tempfile.mkdtemp(prefix="pl-", dir=tmp), name="", version=""),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=1,
            callbacks=callbacks,
        )
        trainer.fit(GradNormModule() if mode == "grad_norm" else Module(), torch.utils.data.DataLoader(Batches(), batch_size=None))
        conn.send(("done",))
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        conn.close()


def run_lightning(rounds: int, steps: int, warmup: int, threads: int, tmp: str, rng: random.Random,
                  log: Callable[[str], None]) -> tuple[list[Row], list[str]]:
    """W2 under ``Trainer.fit``: each fit in its own (spawned) process, one fit running at a time.

    Fits in threads of one process share the GIL and compete with each other's OpenMP teams: the step is
    3x slower than a user's fit and the callback's cost is blurred. Here every fit is a process of its
    own with ``torch.set_num_threads(threads)``; the parent hands out turns of ``steps`` steps (rounds in
    shuffled order, warm-up turns first and not timed) and the other fits wait in a blocking read.
    """
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        return [], ["Lightning: skipped (lightning is not installed)"]
    notes: list[str] = []
    variants = [("without callback", "none"), ("without callback (A/A)", "none"),
                ("Lightning grad_norm, logged every step", "grad_norm")]
    try:
        importlib.import_module("gradwatch.lightning")  # (an import statement would bind a local `gradwatch`)
    except ImportError as exc:
        notes.append(f"W2-Lightning / gradwatch callback: skipped (gradwatch.lightning not importable: {exc})")
    else:
        variants.append(("gradwatch callback", "callback"))

    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    gradwatch_file = os.path.abspath(gradwatch.__file__)

    @dataclass
    class Fit:
        name: str
        proc: Any
        conn: Any
        per_round: list[float]
        failed: str = ""

    def fail(fit: Fit, why: str) -> None:
        if not fit.failed:
            fit.failed = why
            notes.append(f"W2-Lightning / {fit.name}: failed: {why}")
        with contextlib.suppress(Exception):
            fit.conn.close()
        if fit.proc.is_alive():
            fit.proc.terminate()
            fit.proc.join(10)
            if fit.proc.is_alive():
                fit.proc.kill()
                fit.proc.join(10)

    def receive(fit: Fit, expect: str, timeout: float) -> tuple | None:
        """The fit's next message if it is ``expect``; anything else (error, exit, timeout) fails the fit."""
        try:
            if not fit.conn.poll(timeout):
                fail(fit, f"no {expect!r} from the fit process within {timeout:.0f} s")
                return None
            msg = fit.conn.recv()
        except (EOFError, OSError):
            fit.proc.join(10)
            fail(fit, f"the fit process exited (exit code {fit.proc.exitcode}) before {expect!r}")
            return None
        if msg[0] == "error":
            fit.proc.join(10)
            fail(fit, msg[1])
            return None
        if msg[0] != expect:
            fail(fit, f"expected {expect!r} from the fit process, got {msg[0]!r}")
            return None
        return msg

    def turn(fit: Fit, n: int) -> float | None:
        try:
            fit.conn.send(("go", n))
        except (BrokenPipeError, EOFError, OSError):
            fit.proc.join(10)
            fail(fit, f"the fit process exited (exit code {fit.proc.exitcode})")
            return None
        msg = receive(fit, "turn", PL_TURN_TIMEOUT + n)
        return None if msg is None else float(msg[1])

    fits: list[Fit] = []
    try:
        for name, mode in variants:  # all start at once (untimed); each stops at its first batch
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_lightning_fit_child, name=f"gradwatch-bench fit: {name}", daemon=True,
                               args=(child_conn, repo_root, gradwatch_file, mode, threads, tmp))
            proc.start()
            child_conn.close()  # the child's end lives in the child only: its exit gives the parent EOF
            fits.append(Fit(name, proc, parent_conn, []))
        for fit in fits:
            msg = receive(fit, "ready", PL_START_TIMEOUT)
            if msg is not None and msg[1].get("torch_threads") != threads:
                notes.append(f"W2-Lightning / {fit.name}: torch threads {msg[1].get('torch_threads')}, not {threads}")
        for fit in fits:  # warm-up turns, not timed
            if not fit.failed:
                turn(fit, warmup)
        t_start = time.perf_counter()
        for r in range(rounds):
            order = fits[:]
            rng.shuffle(order)
            for fit in order:
                if fit.failed:
                    continue
                t = turn(fit, steps)
                if t is not None:
                    fit.per_round.append(t)
            if r == 0:
                log(f"  W2-Lightning: {len(fits)} fits (one process each) x {rounds} rounds x {steps} steps, "
                    f"~{(time.perf_counter() - t_start) * rounds:.0f} s")
        for fit in fits:
            if fit.failed:
                continue
            with contextlib.suppress(BrokenPipeError, EOFError, OSError):
                fit.conn.send(("stop",))
            if receive(fit, "done", PL_STOP_TIMEOUT) is None:
                continue
            fit.proc.join(PL_STOP_TIMEOUT)
            if fit.proc.is_alive():
                notes.append(f"W2-Lightning / {fit.name}: the fit process did not exit after its fit ended")
    finally:
        for fit in fits:  # never leave a fit process behind (an error here, Ctrl-C)
            if fit.proc.is_alive():
                fit.proc.terminate()
                fit.proc.join(10)
                if fit.proc.is_alive():
                    fit.proc.kill()
            with contextlib.suppress(Exception):
                fit.conn.close()
    per_round = {f.name: f.per_round for f in fits if f.per_round}
    if "without callback" not in per_round:
        notes.append("W2-Lightning: no timed round of the fit without callback; no rows")
        return [], notes
    n = min(len(v) for v in per_round.values())
    if n < rounds or len(per_round) < len(fits):
        notes.append(f"W2-Lightning: a fit ended early; the rows cover {n} of {rounds} rounds")
        per_round = {k: v[:n] for k, v in per_round.items()}
    return summarize(per_round, bare="without callback"), notes


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def machine_facts(threads: int) -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        load = "n/a"
    try:
        import lightning

        pl_version = lightning.__version__
    except ImportError:
        pl_version = "not installed"
    return [
        f"- machine: {cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}",
        (
            f"- Python {platform.python_version()}, torch {torch.__version__}, lightning {pl_version}, "
            f"gradwatch {getattr(gradwatch, '__version__', '?')}"
        ),
        f"- torch threads: {threads} (`torch.set_num_threads({threads})`)",
        f"- load average at start (1, 5, 15 min): {load}",
    ]


def table(title: str, rows: list[Row], targets: dict[str, float]) -> list[str]:
    lines = [
        f"#### {title}",
        "",
        "| variant | median step (ms) | median ratio to bare | ratio IQR | total-time ratio | target |",
        "|---|---:|---:|---:|---:|---|",
    ]
    by_name = {r.name: r for r in rows}
    for r in rows:
        tgt = targets.get(r.name)
        judged = r.total_ratio if r.name in AMORTIZED else r.ratio
        which = " (total-time)" if r.name in AMORTIZED else ""
        verdict = "" if tgt is None else f"<= {tgt:.2f}{which} {'ok' if judged <= tgt else 'MISSED'}"
        if r.name in RELATIVE_TARGETS:
            verdict = "; ".join(v for v in (verdict, relative_verdict(r, by_name)) if v)
        name = r.name + (f" ({r.note})" if r.note else "")
        lines.append(
            f"| {name} | {r.median_ms:.2f} | {r.ratio:.3f} | {r.ratio_lo:.2f}-{r.ratio_hi:.2f} | {r.total_ratio:.3f} "
            f"| {verdict} |"
        )
    return lines + [""]


def relative_verdict(row: Row, by_name: dict[str, Row]) -> str:
    """``<= <other>'s ratio``, both side by side, with the A/A ratio as the noise floor."""
    other = by_name.get(RELATIVE_TARGETS[row.name])
    if other is None:
        return f"<= {RELATIVE_TARGETS[row.name]}: not measured"
    aa = next((by_name[n] for n in AA_ROWS if n in by_name), None)
    noise = f"; A/A {aa.ratio:.3f} ({aa.ratio_lo:.2f}-{aa.ratio_hi:.2f})" if aa is not None else ""
    ok = "ok" if row.ratio <= other.ratio else "MISSED"
    return f"<= {other.name} {other.ratio:.3f}: {row.ratio:.3f} {ok}{noise}"


def standalone_table(results: dict[str, list[dict[str, float]]]) -> list[str]:
    """One row per workload: medians over the repeats, and the spread (min-max) of the check/floor ratio."""
    lines = [
        "#### gradwatch's own per-step work on ready gradients (standalone)",
        "",
        "Each repeat: the engine's check path called directly on one backward's gradients, in blocks of 5 calls "
        "interleaved in shuffled order with the fused floor (which reads the gradients off the parameters, as the "
        "check does) and `AdamW.step`; check / floor = median over the "
        "blocks of (check block / the floor block of the same round). Medians over the repeats; spread = "
        "min-max of the repeats' check / floor.",
        "",
        "| workload | repeats | gradwatch check (ms) | fused floor (ms) | AdamW.step (ms) | check / floor | spread "
        "| target | check / AdamW.step |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for key, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ratios = [r["check / floor"] for r in runs]
        tgt = OWN_VS_FLOOR.get(key)
        verdict = "" if tgt is None else f"<= {tgt}: {'ok' if med['check / floor'] <= tgt else 'MISSED'}"
        r2 = med["gradwatch check"] / med["AdamW.step"]
        v2 = "ok" if r2 <= OWN_VS_ADAMW else "MISSED"
        lines.append(
            f"| {key} | {len(runs)} | {med['gradwatch check']:.3f} | {med['fused floor']:.3f} | {med['AdamW.step']:.2f} "
            f"| {med['check / floor']:.3f} | {min(ratios):.3f}-{max(ratios):.3f} | {verdict} "
            f"| {r2:.3f} (<= {OWN_VS_ADAMW}: {v2}) |"
        )
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few rounds (< 2 minutes); numbers are rough")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 30; --quick 4, W1 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per variant first (default 5; --quick 3)")
    ap.add_argument("--reps", type=int, default=None, help="calls per function in one standalone measurement")
    ap.add_argument("--repeat", type=int, default=None,
                    help="standalone measurements per workload, reported as median and spread (default 5; --quick 3)")
    ap.add_argument("--workloads", default="W1,W2,W3,lightning,standalone",
                    help="comma list of W1, W2, W3, lightning, standalone (default: all)")
    ap.add_argument("--only", default="", help="comma list of substrings: time only matching variants (plus bare)")
    ap.add_argument("--tied", action="store_true", help="W1 with a head tied to the embedding")
    ap.add_argument("--seed", type=int, default=0, help="seed of the round order")
    ap.add_argument("--out", default=None, help="also write the markdown report to this file")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    rounds = args.rounds or (4 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    reps = args.reps or (40 if args.quick else 400)
    repeat = max(1, args.repeat or (3 if args.quick else 5))
    which = {w.strip() for w in args.workloads.split(",") if w.strip()}
    only = {o.strip() for o in args.only.split(",") if o.strip()} or None
    rng = random.Random(args.seed)
    command = "python benchmarks/overhead.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    out = ["### gradwatch overhead", "", f"Command: `{command.strip()}`", ""] + machine_facts(args.threads) + [""]
    out.append(
        "Whole training steps (forward, backward, AdamW step, zero_grad), every variant its own model copy, "
        f"rounds in shuffled order after {warmup} warm-up steps per variant; ratio = a round's mean step time / "
        "that round's bare step time, median over rounds (IQR: 25th-75th percentile of the ratios); "
        "total-time ratio = all of a variant's steps / all of bare's (amortizes work done every N steps)."
    )
    out.append("")
    notes: list[str] = []
    results: dict[str, list[Row]] = {}
    workloads = make_workloads(args.tied)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradwatch-bench-") as tmp:
        for key in ("W1", "W2", "W3"):
            if key not in which:
                continue
            wl = workloads[key]
            log(f"{key}: {wl.description}")
            steps = wl.steps_per_round
            wl_rounds = rounds
            if args.quick and key in ("W1", "W3") and args.rounds is None:
                steps, wl_rounds = 2, 3  # rough: a first look, not numbers to report
            rows, more = run_loop_benchmark(wl, wl_rounds, warmup, steps, tmp, rng, only, log)
            results[key] = rows
            notes += more
            out += table(f"{key}: {wl.description} ({wl_rounds} rounds of {steps} steps)",
                         rows, {n: t for (w, n), t in TARGETS.items() if w == key})
        if "lightning" in which:
            log("W2-Lightning: Trainer.fit")
            lrounds = 4 if args.quick and args.rounds is None else rounds
            rows, more = run_lightning(lrounds, 10, 10, args.threads, tmp, rng, log)
            notes += more
            if rows:
                results["W2-Lightning"] = rows
                out += table(f"W2 under Lightning Trainer.fit ({lrounds} rounds, 10 steps per turn; each fit in its own "
                             "process, one fit running at a time; bare = fit without callback)",
                             rows, {n: t for (w, n), t in TARGETS.items() if w == "W2-Lightning"})
        if "standalone" in which:
            own_results: dict[str, list[dict[str, float]]] = {}
            for key in ("W1", "W2", "W3"):
                log(f"standalone: {key} ({repeat} x {reps} calls)")
                own_results[key] = [run_standalone(workloads[key], reps, tmp, rng) for _ in range(repeat)]
                found = max(int(s["findings"]) for s in own_results[key])
                if found:
                    notes.append(f"standalone {key}: gradwatch reported {found} finding(s) on healthy gradients")
            out += standalone_table(own_results)
    elapsed = time.perf_counter() - started
    try:
        load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        load = "n/a"
    out.append(f"- load average at end (1, 5, 15 min): {load}; wall time {elapsed / 60:.1f} min")
    for n in notes:
        out.append(f"- note: {n}")
    text = "\n".join(out) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
        log(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
