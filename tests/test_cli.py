"""``gradwatch summary RUN_DIR``: a health report from a recorded run's event files and gradwatch.jsonl."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

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
    assert re.search(rf"^steps +{STEPS} ", text, re.MULTILINE)
    assert re.search(r"^skipped updates +1 ", text, re.MULTILINE)
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


def short_run(log_dir: str, model: nn.Module, steps: int, bad_at: int | None = None, state: dict | None = None,
              first: int = 0) -> gradwatch.Watcher:
    """Steps ``first`` to ``steps - 1`` of a plain loop into ``log_dir``; NaN loss at ``bad_at``; resumed
    from ``state`` (a watcher's state_dict) when given."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with gradwatch.watch(model, opt, console=False, log_dir=log_dir) as gw:
        if state is not None:
            gw.load_state_dict(state)
        for step in range(first, steps):
            loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()
            if step == bad_at:
                loss = loss * float("nan")
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return gw


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def narrow_mlp() -> nn.Module:  # the "edited script": other layer names
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))


@pytest.fixture(scope="module")
def reused_log_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A healthy 200-step run, then an edited script's 20 steps with a NaN at step 5, in one log_dir."""
    log_dir = str(tmp_path_factory.mktemp("reused") / "exp1")
    short_run(log_dir, wide_mlp(), 200)
    short_run(log_dir, narrow_mlp(), 20, bad_at=5)
    return log_dir


def test_a_reused_log_dir_reports_the_latest_run_whole(reused_log_dir: str) -> None:
    (report,) = summarize(reused_log_dir)
    assert (report.run_number, report.earlier_runs, report.latest) == (2, 1, True)
    assert report.steps == 20 and report.steps_logged == 19  # the NaN step has no total norm
    assert report.skipped_steps == 1
    assert {layer.layer for layer in report.layers} == {"0", "1"}  # the second script's layers only
    assert {k.kind for k in report.findings} >= {"nonfinite_loss", "nonfinite_grad"}
    assert all(k.first_step == 5 for k in report.findings)
    assert [i["file"] for i in report.incidents] == ["incidents/step_5.md"]
    assert [(r["number"], r["steps"], r["findings"] > 0, r["shown"]) for r in report.runs_in_dir] == [
        (1, 200, False, False), (2, 20, True, True),
    ]
    text = render(report)
    assert "run 2 of 2 in this log_dir" in text and "--run N" in text


def test_an_earlier_run_is_reachable_with_run_n(reused_log_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    (report,) = summarize(reused_log_dir, run=1)
    assert (report.run_number, report.earlier_runs, report.latest) == (1, 0, False)
    assert report.steps == 200 and report.steps_logged == 200 and report.skipped_steps == 0
    assert {layer.layer for layer in report.layers} == {"0", "2"} and report.findings == [] and report.healthy
    assert report.incidents == []
    assert main(["summary", reused_log_dir, "--run", "-2", "--json"]) == 0
    (only,) = json.loads(capsys.readouterr().out)["runs"]
    assert (only["run_number"], only["steps"], only["earlier_runs"]) == (1, 200, 0)
    assert main(["summary", reused_log_dir, "--run", "3"]) == 2
    assert "no run 3" in capsys.readouterr().err


def test_all_runs_and_json_earlier_runs(reused_log_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summary", reused_log_dir, "--all", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["run_number"], r["earlier_runs"], r["steps"], r["healthy"]) for r in runs] == [
        (1, 0, 200, True), (2, 1, 20, False),
    ]
    assert runs[0]["run_id"] != runs[1]["run_id"]
    assert main(["summary", reused_log_dir, "--json"]) == 0
    (latest,) = json.loads(capsys.readouterr().out)["runs"]
    assert (latest["run_number"], latest["earlier_runs"], len(latest["runs_in_dir"])) == (2, 1, 2)


def test_two_runs_started_within_the_same_second_are_two_runs(tmp_path) -> None:
    log_dir = str(tmp_path / "exp1")
    short_run(log_dir, wide_mlp(), 2)
    short_run(log_dir, narrow_mlp(), 3, bad_at=1)
    first, second = summarize(log_dir, all_runs=True)
    assert (first.steps, first.findings, {lay.layer for lay in first.layers}) == (2, [], {"0", "2"})
    assert second.steps == 3 and second.skipped_steps == 1 and {lay.layer for lay in second.layers} == {"0", "1"}
    with open(os.path.join(log_dir, "gradwatch.jsonl"), encoding="utf-8") as fh:
        starts = [r for r in map(json.loads, fh) if r.get("event") == "run_start"]
    assert len(starts) == 2 and len({r["run"] for r in starts}) == 2
    assert all(len(r["event_files"]) == 1 for r in starts)


def test_a_resumed_run_is_one_run_with_the_steps_it_made_again_counted_once(tmp_path) -> None:
    log_dir = str(tmp_path / "exp1")
    model = wide_mlp()
    first = short_run(log_dir, model, 3)
    state = first.state_dict()  # the checkpoint at step 3; the run goes on and dies after its NaN at step 4
    short_run(log_dir, model, 5, bad_at=4, state=dict(state), first=3)
    short_run(log_dir, model, 6, bad_at=4, state=dict(state), first=3)  # resumed from step 3 again
    (report,) = summarize(log_dir, all_runs=True)
    assert len(report.runs_in_dir) == 1 and report.earlier_runs == 0
    kinds = {k.kind: (k.count, k.first_step) for k in report.findings}
    assert kinds["nonfinite_loss"] == (1, 4)
    assert report.steps == 6 and report.skipped_steps == 1


def test_the_where_of_nan_origin_names_the_op_and_the_line(tmp_path) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bad = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return torch.log(h - 1000.0) if self.bad else h  # the planted NaN

    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, console=False, log_dir=str(tmp_path)):
        for step in range(4):
            model[0].bad = step == 2
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    (report,) = summarize(str(tmp_path))
    (origin,) = [k for k in report.findings if k.kind == "nan_origin"]
    with open(__file__, encoding="utf-8") as fh:
        line = next(i for i, text in enumerate(fh, 1) if text.rstrip().endswith("# the planted NaN"))
    assert origin.where == f"LogBackward0 in 0, test_cli.py:{line}"


def test_records_of_an_older_version_without_run_start_still_split_by_run_id() -> None:
    from gradwatch.report.runs import split_runs

    old = [
        {"kind": "nonfinite_loss", "step": 3, "run": "20261201T100000-7-0"},
        {"kind": "none_grad", "step": 0, "run": "20261201T100500-8-0"},
        {"kind": "nonfinite_grad", "step": 1},  # before runs carried ids at all
    ]
    runs = split_runs(old)
    assert [(r.id, [f["kind"] for f in r.findings]) for r in runs] == [
        ("20261201T100000-7-0", ["nonfinite_loss"]),
        ("20261201T100500-8-0", ["none_grad"]),
        (None, ["nonfinite_grad"]),
    ]
    assert all(r.started is None for r in runs)
