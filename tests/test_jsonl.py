"""``gradwatch.jsonl``: each finding is on disk as soon as it is made, and the file stays valid JSON lines
when the run is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch.report.jsonl import FILENAME, is_finding, read_jsonl


def strict_loads(line: str) -> dict:
    """json.loads that rejects NaN/Infinity (not JSON, though Python writes them by default)."""

    def reject(token: str) -> None:
        raise ValueError(f"non-standard JSON constant {token}")

    return json.loads(line, parse_constant=reject)


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step(model: nn.Module, opt: torch.optim.Optimizer, gw: gradwatch.Watcher, *, nan: bool) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    if nan:
        loss = loss * float("nan")
    gw.observe_loss(loss)
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_each_finding_is_in_the_file_before_the_next_step(tmp_path) -> None:
    model, opt = make()
    path = str(tmp_path / FILENAME)
    with gradwatch.watch(model, opt, console=False, log_dir=str(tmp_path)) as gw:
        for s in range(6):
            step(model, opt, gw, nan=s in (1, 4))
            on_disk = [(r["kind"], r["step"]) for r in read_jsonl(path) if is_finding(r)]
            assert on_disk == [(f.kind, f.step) for f in gw.findings], f"after step {s}"
    assert ("nonfinite_grad", 4) in on_disk


def test_every_line_is_strict_json_even_with_nonfinite_values(tmp_path) -> None:
    model, opt = make()
    with gradwatch.watch(model, opt, console=False, log_dir=str(tmp_path)) as gw:
        step(model, opt, gw, nan=True)
    with open(tmp_path / FILENAME, encoding="utf-8") as fh:
        records = [r for r in (strict_loads(line) for line in fh) if is_finding(r)]
    loss_record = next(r for r in records if r["kind"] == "nonfinite_loss")
    assert loss_record["data"]["loss"] == "nan"
    assert [gradwatch.Finding.from_dict(r) for r in records] == gw.findings


CHILD = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    import gradwatch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gw = gradwatch.watch(model, opt, console=False, log_dir=sys.argv[1], max_skips=None, escalate=False)
    for s in range(100000):
        loss = model(torch.randn(8, 4)).pow(2).mean() * float("nan")
        gw.observe_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(len(gw.findings), flush=True)
    """
)


def test_run_killed_mid_way_leaves_valid_json_lines_with_every_reported_finding(tmp_path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    log_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(log_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        reported = 0
        while reported < 10:
            line = proc.stdout.readline()
            assert line, f"child exited early with {proc.wait()}"
            reported = int(line)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    with open(log_dir / FILENAME, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    complete, last = lines[:-1], lines[-1]
    records = [strict_loads(line) for line in complete]
    assert len(records) >= reported  # every finding the run had made when it was killed is on disk
    assert last == "" or list(read_jsonl(str(log_dir / FILENAME))) == records


def test_read_jsonl_skips_a_torn_last_line(tmp_path) -> None:
    path = tmp_path / FILENAME
    whole = [{"kind": "nonfinite_loss", "step": 0}, {"kind": "nonfinite_grad", "step": 0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"kind": "none_grad", "st')
    assert list(read_jsonl(str(path))) == whole


def test_new_run_after_a_torn_line_starts_on_a_fresh_line(tmp_path) -> None:
    path = tmp_path / FILENAME
    path.write_text(json.dumps({"kind": "nonfinite_loss", "step": 0}) + "\n" + '{"kind": "none_gr')
    model, opt = make()
    with gradwatch.watch(model, opt, console=False, log_dir=str(tmp_path)) as gw:
        step(model, opt, gw, nan=True)
    records = list(read_jsonl(str(path)))
    assert records[0] == {"kind": "nonfinite_loss", "step": 0}
    assert records[1]["event"] == "run_start"
    assert [gradwatch.Finding.from_dict(r) for r in records[2:]] == gw.findings


def test_an_explained_finding_carries_its_parts_in_json_and_reads_back() -> None:
    from gradwatch import Explanation, Finding

    f = Finding(kind="none_grad", step=3, severity="warning",
                explanation=Explanation("No gradient for head.bias.", why="it never learns.", fix="use it."))
    assert f.message == "No gradient for head.bias.\nWhy it matters: it never learns.\nFix: use it."
    d = f.to_dict()
    assert d["explanation"] == {"what": "No gradient for head.bias.", "why": "it never learns.", "cause": "",
                                "fix": "use it."}
    back = Finding.from_dict(d)
    assert back == f and back.fix == "use it." and back.message == f.message
    assert Finding(kind="k", step=0, severity="info", message="plain").fix == ""


def test_a_changed_message_on_an_explained_finding_is_refused() -> None:
    import dataclasses

    from gradwatch import Explanation, Finding

    f = Finding(kind="k", step=1, severity="info", explanation=Explanation("a", fix="b"))
    with pytest.raises(ValueError, match="explanation or a message"):
        dataclasses.replace(f, message="other words")
    assert dataclasses.replace(f, explanation=Explanation("c")).message == "c"
