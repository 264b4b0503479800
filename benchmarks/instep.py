"""gradwatch's own time inside real training steps, against the fused floor's read at the same point of the step.

Runs a workload of ``overhead.py`` (W2 by default) twice in one process, step after step: a watched model, whose
time inside gradwatch is summed over its entry points (forward hooks, gradient hooks, the end-of-backward callback,
the optimizer's step hooks: every function autograd, ``nn.Module`` or the optimizer calls into gradwatch), and a
bare model, which reads its gradients after backward the way the floor does (``[p.grad ...]``, one
``_foreach_norm``, one ``isfinite``, one sync). Both run in the cache state of a real step (after backward, before
the optimizer), which the standalone table of ``overhead.py`` does not reproduce. Reported: the median per step of
each, their ratio, and gradwatch's time by entry point. Timing wrappers add about 0.3 us per entry call.

    python benchmarks/instep.py                  # W2, 600 steps each, ~1 minute
    python benchmarks/instep.py --workload W3
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import inspect
import io
import itertools
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead as ob
import torch

#: Modules whose classes hold gradwatch's entry points in a plain loop.
ENTRY_MODULES = (
    "gradwatch.watch",
    "gradwatch.observe.preclip",
    "gradwatch.observe.zero_grad",
    "gradwatch.observe.amp",
    "gradwatch.observe.unstepped",
    "gradwatch.observe.tracing",
    "gradwatch.observe.distributed",
    "gradwatch.diagnose.step_capture",
    "gradwatch.diagnose.capture",
)
#: Method names that torch calls (hooks, queued callbacks), or that gradwatch's hooks queue.
ENTRY_NAMES = {
    "_pre_step", "_post_step", "_any_step", "_on_pass", "_take", "before_accumulate", "after_accumulate",
    "after_sampled_accumulate", "reread", "take_sample", "_on_grad", "_on_step", "_on_pre", "_on_post", "_end",
    "_on_module_pre", "_on_module_post", "_spot_ddp", "_before_forward", "_on_forward_start", "_on_forward_end",
    "set_grad",
}


class EntryClock:
    """Sums the time spent in the entry points (the outermost one only, when one calls another)."""

    def __init__(self) -> None:
        self.total_ns = 0
        self.by_entry: dict[str, int] = collections.defaultdict(int)
        self.calls: collections.Counter[str] = collections.Counter()
        self._inside = False

    def wrap(self, owner: type, name: str) -> None:
        fn = owner.__dict__[name]
        label = f"{owner.__name__}.{name}"

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return fn(*args, **kwargs)
            self._inside = True
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                self._inside = False
                self.total_ns += dt
                self.by_entry[label] += dt
                self.calls[label] += 1

        setattr(owner, name, timed)

    def install(self) -> int:
        n = 0
        for mod_name in ENTRY_MODULES:
            mod = importlib.import_module(mod_name)
            for cls in vars(mod).values():
                if not (inspect.isclass(cls) and cls.__module__ == mod_name):
                    continue
                for name in [n for n in vars(cls) if n in ENTRY_NAMES and inspect.isfunction(vars(cls)[n])]:
                    self.wrap(cls, name)
                    n += 1
        return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W2", choices=("W1", "W2", "W3"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = EntryClock()
    wrapped = clock.install()  # before watch(): the hooks bind the timed methods

    from rich.console import Console

    import gradwatch

    wl = ob.make_workloads(tied=False)[args.workload]
    watched_model, watched_opt = ob.build(wl)
    bare_model, bare_opt = ob.build(wl)
    bare_params = list(bare_model.parameters())
    gw = gradwatch.watch(watched_model, watched_opt, log_dir=tempfile.mkdtemp(prefix="gradwatch-instep-"),
                         console=Console(file=io.StringIO(), width=120, color_system=None))
    batches = itertools.cycle(wl.batches)
    inside: list[float] = []
    floor: list[float] = []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # the entry points' breakdown covers the timed steps only
            clock.by_entry.clear()
            clock.calls.clear()
        x, y = next(batches)
        before = clock.total_ns
        wl.loss_fn(watched_model(x), y).backward()
        watched_opt.step()
        watched_opt.zero_grad(set_to_none=True)
        spent = clock.total_ns - before

        wl.loss_fn(bare_model(x), y).backward()
        t0 = time.perf_counter_ns()
        ob.fused_floor([p.grad for p in bare_params if p.grad is not None])
        read = time.perf_counter_ns() - t0
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            inside.append(spent / 1e3)
            floor.append(read / 1e3)
    findings = list(gw.findings)
    gw.close()
    med_in, med_floor = statistics.median(inside), statistics.median(floor)
    print(f"{wl.name}: {wl.description}; {args.steps} steps each, torch threads {args.threads}, "
          f"{wrapped} entry points timed")
    print(f"gradwatch inside the step (median): {med_in:8.1f} us")
    print(f"floor's read after backward:        {med_floor:8.1f} us")
    print(f"ratio:                              {med_in / med_floor:8.2f}")
    if findings:
        print(f"note: {len(findings)} finding(s) on a healthy run: {[f.kind for f in findings]}")
    n = args.steps
    print("\nby entry point (mean per timed step; an optimizer step hook also fires for the bare model's step):")
    for label, ns in sorted(clock.by_entry.items(), key=lambda kv: -kv[1]):
        print(f"  {ns / n / 1e3:8.1f} us  {clock.calls[label] / n:5.2f} calls  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
