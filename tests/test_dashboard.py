"""The TensorBoard dashboard: a Custom Scalars layout that merges with the user's, optional histograms
with non-finite values filtered and counted, all read back from the event files."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.dashboard import CATEGORY, CHARTS, read_layout


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def accumulator(log_dir: str) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def run(log_dir: str, steps: int = 6, **config: Any) -> gradwatch.Watcher:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, console=False, log_dir=log_dir, **config) as gw:
        for _ in range(steps):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw


def test_layout_is_written_once_with_every_gradwatch_chart(tmp_path) -> None:
    run(str(tmp_path))
    layout = read_layout(str(tmp_path))
    assert [c.title for c in layout.category] == [CATEGORY]
    charts = {c.title: list(c.multiline.tag) for c in layout.category[0].chart}
    assert charts == CHARTS
    # Each chart's regex matches the tags gradwatch actually logged.
    import re

    tags = accumulator(str(tmp_path)).Tags()["scalars"]
    for title in ("gradient norm (total)", "gradient norm per layer", "update / weight ratio per layer", "loss"):
        assert any(re.match(rx, t) for rx in charts[title] for t in tags), title
    per_layer = [t for t in tags if re.match(charts["gradient norm per layer"][0], t)]
    assert per_layer == ["gradwatch/grad_norm/0", "gradwatch/grad_norm/2"]


def test_layout_written_by_the_user_before_training_is_kept(tmp_path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path))
    w.add_custom_scalars({"mine": {"accuracy": ["Multiline", ["acc/.*"]]}})
    w.close()
    run(str(tmp_path))
    layout = read_layout(str(tmp_path))
    assert [c.title for c in layout.category] == ["mine", CATEGORY]
    assert list(layout.category[0].chart[0].multiline.tag) == ["acc/.*"]


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


def test_dashboard_renders_in_headless_chromium(tmp_path) -> None:
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("tensorboard_screenshot", os.path.join(root, "tools", "tensorboard_screenshot.py"))
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    chromium = tool.find_chromium()
    if chromium is None:
        pytest.skip("chromium is not installed")
    log_dir = str(tmp_path / "run")
    tool.record_run(log_dir, steps=40)
    out = str(tmp_path / "dashboard.png")
    assert tool.screenshot(log_dir, out, chromium) == []
    with open(out, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_last_layout_is_found_when_writer_numbers_cross_a_digit(tmp_path) -> None:
    # Event files of one process in one second differ by a writer counter: writer 10 was created after 9.
    from gradwatch.dashboard import _event_file_order

    names = [f"events.out.tfevents.1700000000.host.42.{n}" for n in (9, 10, 2)]
    ordered = sorted((str(tmp_path / n) for n in names), key=_event_file_order)
    assert [p.rsplit(".", 1)[1] for p in ordered] == ["2", "9", "10"]
