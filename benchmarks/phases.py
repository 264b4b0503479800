"""Where a W2 step's time goes, phase by phase, and what reading every gradient once costs inside the loop.

Runs the W2 workload of ``overhead.py`` (MLP 40 x Linear(256,256)+ReLU, batch 64, AdamW) and, step after step
in one process, times forward+backward, a gradient read (one variant per step, in turn), the optimizer step
and the whole step. Variants: none, the fused ``_foreach_norm`` (the benchmark's floor), the same on one
thread, in reverse order, a per-tensor ``vector_norm`` loop, and gradwatch's own check (``watch`` on a twin
model; a third, unwatched model is the A/A row). Median per variant; "step" is the whole step, so "step - none" is what the variant adds.

    python benchmarks/phases.py            # ~1 minute
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import overhead as ob
import torch

BLOCK = 10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    wl = ob.make_workloads(tied=False)["W2"]

    def fused(gs: list[torch.Tensor]) -> None:
        torch.stack(torch._foreach_norm(gs, 2, dtype=torch.float32)).tolist()

    def one_thread(gs: list[torch.Tensor]) -> None:
        torch.set_num_threads(1)
        try:
            fused(gs)
        finally:
            torch.set_num_threads(args.threads)

    def reverse(gs: list[torch.Tensor]) -> None:
        fused(gs[::-1])

    def per_tensor(gs: list[torch.Tensor]) -> None:
        torch.stack([torch.linalg.vector_norm(g) for g in gs]).tolist()

    variants: list[tuple[str, Callable[[list[torch.Tensor]], None] | None]] = [
        ("none", None), ("fused _foreach_norm (floor)", fused), ("fused, 1 thread", one_thread),
        ("fused, reverse order", reverse), ("per-tensor vector_norm", per_tensor), ("none, another model (A/A)", None),
        ("gradwatch default", None),
    ]
    model, opt = ob.build(wl)
    twin, twin_opt = ob.build(wl)
    other, other_opt = ob.build(wl)
    from rich.console import Console

    import gradwatch

    gw = gradwatch.watch(twin, twin_opt, log_dir=tempfile.mkdtemp(), console=Console(file=io.StringIO()))
    params = list(model.parameters())
    batches = itertools.cycle(wl.batches)
    times: dict[str, dict[str, list[float]]] = {name: {"read": [], "opt": [], "step": []} for name, _ in variants}
    for i in range(args.steps):
        # Blocks of BLOCK steps per variant, in turn; a block's first step (another model's memory was
        # just in the caches) is not counted.
        name, read = variants[(i // BLOCK) % len(variants)]
        m, o = {"gradwatch default": (twin, twin_opt), "none, another model (A/A)": (other, other_opt)}.get(
            name, (model, opt)
        )
        x, y = next(batches)
        t0 = time.perf_counter()
        loss = wl.loss_fn(m(x), y)
        loss.backward()
        t1 = time.perf_counter()
        if read is not None:
            read([p.grad for p in params])
        t2 = time.perf_counter()
        o.step()  # gradwatch's check runs here, in the step's pre-hook
        t3 = time.perf_counter()
        o.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if i >= BLOCK * len(variants) and i % BLOCK:
            times[name]["read"].append(t2 - t1)
            times[name]["opt"].append(t3 - t2)
            times[name]["step"].append(t4 - t0)
    gw.close()
    base = statistics.median(times["none"]["step"])
    print(f"W2 phases, {args.steps} steps, {args.threads} threads, torch {torch.__version__} (median ms)")
    print(f"{'variant':32s} {'read':>7s} {'opt.step':>9s} {'step':>8s} {'step - none':>12s}")
    for name, _ in variants:
        t = {k: statistics.median(v) * 1e3 for k, v in times[name].items()}
        print(f"{name:32s} {t['read']:7.3f} {t['opt']:9.3f} {t['step']:8.3f} {t['step'] - base * 1e3:+12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
