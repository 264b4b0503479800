"""The TensorBoard dashboard: a Custom Scalars layout that merges with the user's, one question per chart at
TensorBoard's default settings (incident markers, running totals, stacked findings, one line per run),
optional histograms with non-finite values filtered and counted, all read back from the event files."""

from __future__ import annotations

import math
import re
import statistics
import sys
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.report.dashboard import CATEGORY, CHARTS, ChartSeries, read_layout

pytestmark = pytest.mark.usefixtures("one_thread")


def accumulator(log_dir: str) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def run(log_dir: str, steps: int = 6, nan_at: int | None = None, **config: Any) -> gradwatch.Watcher:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, console=False, log_dir=log_dir, **config) as gw:
        for step in range(steps):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            if step == nan_at:
                loss = loss * float("nan")  # skipped by gradwatch
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw


def series(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    acc = accumulator(log_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def charted(tags: Any) -> dict[str, set[str]]:
    """Chart title -> the tags its regexes match, as TensorBoard matches them (``re.match``)."""
    return {title: {t for t in tags if any(re.match(rx, t) for rx in rxs)} for title, rxs in CHARTS.items()}


def test_layout_is_written_once_with_every_gradwatch_chart(tmp_path) -> None:
    run(str(tmp_path))
    layout = read_layout(str(tmp_path))
    assert [c.title for c in layout.category] == [CATEGORY]
    charts = {c.title: list(c.multiline.tag) for c in layout.category[0].chart}
    assert charts == CHARTS
    # Each chart's regex matches the tags gradwatch actually logged; the per-layer detail is in the Scalars tab.
    tags = accumulator(str(tmp_path)).Tags()["scalars"]
    shown = charted(tags)
    assert shown["gradient norm (total)"] == {"gradwatch/grad_norm/total"}
    assert shown["loss"] == {"gradwatch/loss"}
    assert shown["layer gradient spread (largest / smallest layer norm)"] == {"gradwatch/layer_norm_spread"}
    assert shown["update / weight ratio (median layer)"] == {"gradwatch/update_ratio_median"}
    assert shown["skipped updates (running total)"] == {"gradwatch/skipped_steps"}
    assert {"gradwatch/grad_norm/0", "gradwatch/grad_norm/2", "gradwatch/update_ratio/0"} <= set(tags)
    assert not any(t in shown_tags for t in ("gradwatch/grad_norm/0", "gradwatch/update_ratio/0")
                   for shown_tags in shown.values())


def test_layout_written_by_the_user_before_training_is_kept(tmp_path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path))
    w.add_custom_scalars({"mine": {"accuracy": ["Multiline", ["acc/.*"]]}})
    w.close()
    run(str(tmp_path))
    layout = read_layout(str(tmp_path))
    assert [c.title for c in layout.category] == ["mine", CATEGORY]
    assert list(layout.category[0].chart[0].multiline.tag) == ["acc/.*"]


def test_layout_of_an_earlier_gradwatch_version_is_replaced_and_the_users_kept(tmp_path) -> None:
    # A run resumed into its directory with this version: the old "gradwatch" category (a running and a
    # per-step count on one axis) gives way to the new one; the user's categories stay as they were.
    from torch.utils.tensorboard import SummaryWriter

    old = {"gradient norm per layer": ["Multiline", [r"gradwatch/grad_norm/(?!total).*"]],
           "skipped steps and non-finite gradients": ["Multiline", [r"gradwatch/skipped_steps$",
                                                                    r"gradwatch/nonfinite_grads$"]]}
    w = SummaryWriter(str(tmp_path))
    w.add_custom_scalars({"mine": {"accuracy": ["Multiline", ["acc/.*"]]}, CATEGORY: old})
    w.close()
    run(str(tmp_path))
    layout = read_layout(str(tmp_path))
    assert [c.title for c in layout.category] == ["mine", CATEGORY]
    assert {c.title: list(c.multiline.tag) for c in layout.category[1].chart} == CHARTS


def test_a_users_own_category_of_our_title_is_kept(tmp_path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path))
    w.add_custom_scalars({CATEGORY: {"norm and accuracy": ["Multiline", ["gradwatch/grad_norm/total", "acc"]]}})
    w.close()
    run(str(tmp_path))
    layout = read_layout(str(tmp_path))
    assert [c.title for c in layout.category] == [CATEGORY]
    assert [c.title for c in layout.category[0].chart] == ["norm and accuracy"]


def test_no_histograms_by_default(tmp_path) -> None:
    run(str(tmp_path))
    assert accumulator(str(tmp_path)).Tags()["histograms"] == []


def test_histograms_every_n_checked_steps(tmp_path) -> None:
    run(str(tmp_path), steps=7, histogram_every=3)
    acc = accumulator(str(tmp_path))
    assert sorted(acc.Tags()["histograms"]) == ["gradwatch/grad_hist/0", "gradwatch/grad_hist/2"]
    assert [e.step for e in acc.Histograms("gradwatch/grad_hist/0")] == [0, 3, 6]
    h = acc.Histograms("gradwatch/grad_hist/0")[0].histogram_value
    assert h.num == 4 * 8 + 8  # weight and bias of layer 0


def test_histogram_filters_and_counts_nonfinite_values(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    with gradwatch.watch(model, console=False, log_dir=str(tmp_path), histogram_every=1, on_nonfinite="warn") as gw:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        model[0].weight.grad[0, :3] = float("nan")
        model[1].weight.grad.fill_(float("inf"))  # all of it: add_histogram would raise on it
        gw.check()
    acc = accumulator(str(tmp_path))
    h = acc.Histograms("gradwatch/grad_hist/0")[0].histogram_value
    assert h.num == 12 + 3 - 3  # the three NaNs are left out
    assert [e.value for e in acc.Scalars("gradwatch/grad_hist_nonfinite/0")] == [3.0]
    assert [e.value for e in acc.Scalars("gradwatch/grad_hist_nonfinite/1")] == [3.0]
    h1 = acc.Histograms("gradwatch/grad_hist/1")[0].histogram_value
    assert h1.num == 1  # only layer 1's bias was finite
    assert [f.kind for f in gw.findings][:1] == ["nonfinite_grad"]


def test_findings_are_readable_text_in_tensorboard(tmp_path) -> None:
    model = nn.Linear(4, 4)
    with gradwatch.watch(model, console=False, log_dir=str(tmp_path)) as gw:
        for p in model.parameters():
            p.grad = torch.full_like(p, 3e37)
        gw.check()
    acc = accumulator(str(tmp_path))
    (event,) = acc.Tensors("gradwatch/findings/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert text.startswith("**error: exploding_grad** at step 0")
    assert "Why it matters:" in text and "Fix:" in text


def test_each_written_tag_is_on_one_chart_at_most_and_each_chart_has_its_tags(tmp_path) -> None:
    gw = run(str(tmp_path), steps=12, nan_at=7, update_ratio_every=3)
    tags = set(accumulator(str(tmp_path)).Tags()["scalars"])
    shown = charted(tags)
    kinds = {f.kind for f in gw.findings}
    assert shown == {
        "gradient norm (total)": {"gradwatch/grad_norm/total", "gradwatch/incidents/grad_norm"},
        "loss": {"gradwatch/loss", "gradwatch/incidents/loss"},
        "layer gradient spread (largest / smallest layer norm)": {"gradwatch/layer_norm_spread"},
        "update / weight ratio (median layer)": {"gradwatch/update_ratio_median"},
        "skipped updates (running total)": {"gradwatch/skipped_steps"},
        "findings so far, stacked by kind": {f"gradwatch/findings_stacked/{k}" for k in kinds | {"none_yet"}},
    }
    for tag in tags:  # no series drawn on two charts (two scales on one axis)
        assert sum(tag in t for t in shown.values()) <= 1, tag


def test_nan_step_is_marked_on_the_norm_and_loss_charts_only_there(tmp_path) -> None:
    gw = run(str(tmp_path), steps=14, nan_at=7)
    assert {f.step for f in gw.findings} == {7}
    s = series(str(tmp_path))
    for line, marker in (("gradwatch/grad_norm/total", "gradwatch/incidents/grad_norm"),
                         ("gradwatch/loss", "gradwatch/incidents/loss")):
        assert 7 not in [step for step, _ in s[line]]  # the NaN itself is not drawn
        ((step, height),) = s[marker]
        assert step == 7
        values = [v for _, v in s[line]]
        assert min(values) <= height <= max(values)  # within the line's own range: on the chart


def smoothed(points: list[tuple[int, float]]) -> list[float]:
    """TensorBoard's default smoothing: an EMA of weight 0.6, debiased."""
    out, last = [], 0.0
    for n, (_, v) in enumerate(points, 1):
        last = last * 0.6 + 0.4 * v
        out.append(last / (1 - 0.6**n))
    return out


def y_range(values: list[float]) -> tuple[float, float]:
    """The y range TensorBoard 2.21 draws with "ignore outliers" on (its default), before rounding it out to
    nice ticks: the 5th to 95th percentile (d3.quantile) of the chart's smoothed values, padded by 5%."""
    ordered = sorted(values)

    def quantile(q: float) -> float:
        i = (len(ordered) - 1) * q
        lo = math.floor(i)
        return ordered[lo] + (ordered[min(lo + 1, len(ordered) - 1)] - ordered[lo]) * (i - lo)

    lo, hi = quantile(0.05), quantile(0.95)
    return lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)


def test_marker_is_inside_the_range_tensorboard_draws_and_above_the_line() -> None:
    # A loss that falls from 1 to about 0.1 and is NaN at step 40: the marker must be on the chart (the
    # range TensorBoard draws by default) and away from the line where the incident is.
    derived = ChartSeries()
    loss: list[tuple[int, float]] = []
    markers: list[tuple[int, float]] = []
    for step in range(60):
        v = math.nan if step == 40 else 1 / (1 + step / 5) + 0.02 * math.sin(step)
        for at, values in derived.derive(step, {"gradwatch/loss": v}):
            loss += [(at, values["gradwatch/loss"])] if math.isfinite(values.get("gradwatch/loss", math.nan)) else []
            markers += [(at, values["gradwatch/incidents/loss"])] if "gradwatch/incidents/loss" in values else []
    ((step, height),) = markers
    assert step == 40
    lo, hi = y_range(smoothed(loss) + smoothed(markers))
    assert 0 < lo <= height <= hi  # on a linear axis, and above zero for a log one
    assert height > 3 * smoothed(loss)[39]  # far above the line where the line is at the incident


def test_healthy_run_has_no_markers_no_findings_and_a_zero_skip_count(tmp_path) -> None:
    gw = run(str(tmp_path), steps=8)
    assert gw.findings == []
    s = series(str(tmp_path))
    assert not [t for t in s if t.startswith("gradwatch/incidents/")]
    # zero, at the engine's cadence (every 10 steps): a flat line, not an empty chart
    assert s["gradwatch/skipped_steps"] == [(0, 0.0)]
    assert [t for t in s if t.startswith("gradwatch/findings_stacked/")] == ["gradwatch/findings_stacked/none_yet"]
    assert s["gradwatch/findings_stacked/none_yet"] == [(0, 0.0)]


def test_skipped_updates_are_a_running_total_written_at_every_step_once_above_zero(tmp_path) -> None:
    # Smoothing only delays a running total written at every step: its last drawn value is the count. Zero
    # is written sparsely, so that the counts are not outliers of the chart's y range (5th-95th percentile).
    run(str(tmp_path), steps=16, nan_at=5)
    s = series(str(tmp_path))
    assert s["gradwatch/skipped_steps"] == [(0, 0.0), (4, 0.0)] + [(step, 1.0) for step in range(5, 16)]


def test_findings_are_stacked_so_kinds_found_together_stay_apart(tmp_path) -> None:
    model = nn.Linear(4, 4)
    with gradwatch.watch(model, console=False, log_dir=str(tmp_path), on_nonfinite="warn") as gw:
        for step in range(8):
            for p in model.parameters():
                p.grad = torch.full_like(p, 3e37 if step == 2 else 1e-2)
            if step == 5:
                model.weight.grad[0, 0] = float("nan")
            gw.check()
    first = {}
    for f in gw.findings:
        first.setdefault(f.kind, f.step)
    assert set(first.values()) == {2, 5} and len(first) >= 2
    order = sorted(first, key=lambda k: (first[k], k))  # the stacking order: first found, lowest
    s = series(str(tmp_path))
    stacked = {k: dict(s[f"gradwatch/findings_stacked/{k}"]) for k in order}
    assert max(dict(s["gradwatch/findings_stacked/none_yet"])) < 2  # the zero line ends at the first finding

    def found_before(kinds: list[str], step: int) -> float:
        return float(sum(1 for f in gw.findings if f.kind in kinds and f.step < step))

    for i, kind in enumerate(order):
        step = first[kind]
        counts = dict(s[f"gradwatch/findings/{kind}"])
        assert counts[step - 1] == 0.0 and counts[step] >= 1  # a step up at the step it was found
        assert stacked[kind][step - 1] == found_before(order[:i], step)  # rises from the stack below
        values = [v for _, v in sorted(stacked[kind].items())]
        assert values == sorted(values)  # a running total: never down
        assert stacked[kind][7] == found_before(order[: i + 1], 8)  # this kind and the kinds below it
    finals = [stacked[k][7] for k in order]
    assert finals == sorted(set(finals))  # apart, even for kinds found at the same step


def test_summaries_are_one_line_per_run_from_the_per_layer_scalars(tmp_path) -> None:
    run(str(tmp_path), steps=12, update_ratio_every=3)
    s = series(str(tmp_path))
    spread = dict(s["gradwatch/layer_norm_spread"])
    layers = [dict(s["gradwatch/grad_norm/0"]), dict(s["gradwatch/grad_norm/2"])]
    assert sorted(spread) == sorted(layers[0]) == [0, 10]
    for step, v in spread.items():
        norms = [layer[step] for layer in layers]
        assert v == pytest.approx(max(norms) / min(norms), rel=1e-6)
    ratio = dict(s["gradwatch/update_ratio_median"])
    per_layer = [dict(s["gradwatch/update_ratio/0"]), dict(s["gradwatch/update_ratio/2"])]
    assert sorted(ratio) == sorted(set(per_layer[0]) | set(per_layer[1])) and len(ratio) >= 3
    for step, v in ratio.items():
        measured = [layer[step] for layer in per_layer if step in layer]
        assert v == pytest.approx(statistics.median(measured), rel=1e-6)


def test_markers_of_several_optimizers_go_to_their_own_lines() -> None:
    derived = ChartSeries()
    derived.derive(0, {"gradwatch/grad_norm/total_opt1": 2.0, "gradwatch/loss_opt1": 1.0})
    ((step, values),) = derived.derive(1, {"gradwatch/grad_norm/total_opt1": math.nan, "gradwatch/loss_opt1": 1.5,
                                            "gradwatch/nonfinite_grads": 3.0})
    assert step == 1
    assert values["gradwatch/incidents/grad_norm_opt1"] == 2.0 and values["gradwatch/incidents/loss_opt1"] == 1.0
    shown = charted(values)
    assert "gradwatch/incidents/grad_norm_opt1" in shown["gradient norm (total)"]
    assert "gradwatch/incidents/loss_opt1" in shown["loss"]


@pytest.mark.browser
def test_dashboard_shows_what_each_chart_should_in_headless_chromium(tmp_path) -> None:
    # About 20 s per scenario: deselected by default (pyproject addopts); run with `pytest -m browser`.
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("tensorboard_screenshot", os.path.join(root, "tools", "tensorboard_screenshot.py"))
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # dataclasses look their module up
    spec.loader.exec_module(tool)
    chromium = tool.find_chromium()
    if chromium is None:
        pytest.skip("chromium is not installed")
    for scenario in ("healthy", "nan"):
        log_dir = str(tmp_path / scenario)
        assert tool.check_scenario(scenario, log_dir, str(tmp_path), chromium) == []
        with open(tmp_path / f"tensorboard-{scenario}.png", "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_last_layout_is_found_when_writer_numbers_cross_a_digit(tmp_path) -> None:
    # Event files of one process in one second differ by a writer counter: writer 10 was created after 9.
    from gradwatch.report.dashboard import _event_file_order

    names = [f"events.out.tfevents.1700000000.host.42.{n}" for n in (9, 10, 2)]
    ordered = sorted((str(tmp_path / n) for n in names), key=_event_file_order)
    assert [p.rsplit(".", 1)[1] for p in ordered] == ["2", "9", "10"]
