"""``gradwatch summary RUN_DIR``: a health report from a recorded run's event files and gradwatch.jsonl."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from typing import Iterator

import pytest
import torch
from rich.console import Console
from torch import nn

import gradwatch
from gradwatch.cli import SPARK, main, sparkline, summarize

SPIKE_AT = 30
NAN_AT = 40
STEPS = 50


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 50-step run with a gradient spike at step 30 and a NaN loss at step 40 (skipped)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    log_dir = str(tmp_path_factory.mktemp("run") / "exp1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x_all = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    y_all = (x_all[:, 0] > 0).long()
    g = torch.Generator().manual_seed(0)
    try:
        with gradwatch.watch(model, opt, console=False, log_dir=log_dir, update_ratio_every=10) as gw:
            for step in range(STEPS):
                i = torch.randint(0, 256, (32,), generator=g)
                x, y = x_all[i], y_all[i]
                if step == SPIKE_AT:
                    x = -1000 * x
                loss = nn.functional.cross_entropy(model(x), y)
                if step == NAN_AT:
                    loss = loss * float("nan")
                gw.observe_loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    os.makedirs(os.path.join(log_dir, "incidents"), exist_ok=True)
    with open(os.path.join(log_dir, "incidents", "step_999.md"), "w", encoding="utf-8") as fh:
        fh.write("# a hand-written incident note\n\nbody\n")
    return log_dir


def render(obj: object) -> str:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(obj)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_summary_reports_steps_skips_and_findings_by_kind(recorded_run: str) -> None:
    (report,) = summarize(os.path.dirname(recorded_run))  # found recursively
    assert report.run_dir == recorded_run
    assert report.steps == STEPS
    assert report.skipped_steps == 1
    kinds = {k.kind: (k.count, k.first_step, k.last_step) for k in report.findings}
    assert kinds["exploding_grad"] == (1, SPIKE_AT, SPIKE_AT)
    assert kinds["nonfinite_loss"] == (1, NAN_AT, NAN_AT)
    text = render(report)
    assert re.search(rf"^steps +{STEPS} ", text, re.M)
    assert re.search(r"^skipped updates +1 ", text, re.M)
    assert re.search(rf"│ exploding_grad +│ +1 │ +{SPIKE_AT} │ +{SPIKE_AT} │ warning +│", text)


def test_summary_has_per_layer_statistics_and_a_norm_sparkline(recorded_run: str) -> None:
    (report,) = summarize(recorded_run)
    assert [layer.layer for layer in report.layers] == ["0", "2"]
    assert all(layer.min <= layer.median <= layer.max for layer in report.layers)
    assert all(layer.update_ratio is not None for layer in report.layers)
    line = report.sparkline(48)
    assert len(line) == 48 and set(line) <= set(SPARK)
    assert line.count("█") == 1  # the spike stands out
    text = render(report)
    assert "gradient norm per layer" in text and "update/weight" in text
    assert line in text


def test_summary_lists_incidents(recorded_run: str) -> None:
    text = render(summarize(recorded_run)[0])
    assert "incidents/step_999.md" in text and "a hand-written incident note" in text


def test_json_output_is_parseable(recorded_run: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", recorded_run, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (run,) = data["runs"]
    assert run["steps"] == STEPS and run["healthy"] is False
    assert {f["kind"] for f in run["findings"]} >= {"exploding_grad", "loss_spike", "nonfinite_loss"}
    assert len(run["total_norm"]) == STEPS - 1  # the NaN step logs no norm
    assert run["total_norm_stats"]["max"] > 100 * run["total_norm_stats"]["median"]


def test_directory_without_gradwatch_data_is_a_clear_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("nothing here")
    assert main(["summary", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no gradwatch data in {str(tmp_path)!r}" in err


def test_python_dash_m_gradwatch_runs_the_cli(tmp_path) -> None:
    missing = str(tmp_path / "missing")
    proc = subprocess.run([sys.executable, "-m", "gradwatch", "summary", missing], capture_output=True, text=True)
    assert proc.returncode == 2
    assert missing in proc.stderr


def test_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"gradwatch {gradwatch.__version__}"


def test_sparkline_scales_logarithmically() -> None:
    assert sparkline([1.0, 10.0, 100.0, 1000.0]) == "▁▃▆█"
    assert sparkline([]) == ""


def test_a_log_dir_reused_by_a_second_run_summarizes_the_latest_run(tmp_path) -> None:
    log_dir = str(tmp_path / "exp1")  # the same log_dir for every run, as a re-run of a script does

    def short_run(steps: int, bad_at: int | None, bad: float) -> gradwatch.Watcher:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with gradwatch.watch(model, opt, console=False, log_dir=log_dir) as gw:
            for step in range(steps):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                if step == bad_at:
                    loss = loss * bad
                gw.observe_loss(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return gw

    short_run(4, 2, float("nan"))
    short_run(4, None, 1.0)
    runs = {json.loads(line)["run"] for line in open(os.path.join(log_dir, "gradwatch.jsonl"), encoding="utf-8")}
    assert len(runs) == 1  # only the first run had findings
    (report,) = summarize(log_dir)
    assert report.findings and report.earlier_runs == 0
    # A third run with its own finding: the first run's are no longer counted.
    gw = short_run(1, 0, float("inf"))
    (report,) = summarize(log_dir)
    assert report.earlier_runs == 1
    assert {k.kind for k in report.findings} == {f.kind for f in gw.findings}
    assert all(k.first_step == 0 for k in report.findings)
    assert "earlier run(s) wrote to this log_dir" in render(report)
