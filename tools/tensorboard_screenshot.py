"""See gradwatch's TensorBoard dashboard in a real browser, check what each chart shows, save screenshots.

Records short watched training runs (a healthy one; one with a NaN loss at step 120; a directory of 11
runs, a learning-rate sweep, every third with the NaN; on request one with a corrupted batch at step 100
and the NaN), serves each with ``tensorboard`` on 127.0.0.1 at a free port, opens the Custom Scalars tab
in headless Chromium at TensorBoard's default settings (smoothing 0.6, outliers ignored in the y range)
and reads back, from the page itself, what every gradwatch chart draws: its series, their raw and
smoothed values, and the chart's y range (TensorBoard's charts live in shadow DOM, which ``--dump-dom``
does not serialize, so the check walks the shadow roots through the DevTools protocol). It then checks
that each chart answers its question (:func:`chart_problems`) and saves a screenshot per scenario.

Usage:
    python tools/tensorboard_screenshot.py [--out-dir docs/img] [--scenario healthy nan runs spike] [--keep]

Writes ``tensorboard-<scenario>.png`` (by default healthy, nan and runs; the nan one is also copied to
``tensorboard.png``). Exit codes: 0 rendered, checked and saved; 1 a chart did not show what it should;
3 chromium is not installed (``apt-get install -y chromium``).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]

VIEWPORT = {"width": 1480, "height": 790}

# Walks the document and every shadow root; for each Custom Scalars chart card: its title, settings, the
# series it draws (raw and smoothed values per step) and the y range of its chart.
_PROBE_JS = r"""
(() => {
  const find = (root, name, acc) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.tagName.toLowerCase() === name) acc.push(el);
      if (el.shadowRoot) find(el.shadowRoot, name, acc);
    }
    return acc;
  };
  const texts = [];
  const walkText = (root) => {
    const w = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    while (w.nextNode()) { const t = w.currentNode.textContent.trim(); if (t) texts.push(t); }
    for (const el of root.querySelectorAll('*')) if (el.shadowRoot) walkText(el.shadowRoot);
  };
  walkText(document);
  const cards = find(document, 'tf-custom-scalar-multi-line-chart-card', []).map((card) => {
    const vz = find(card.shadowRoot, 'vz-line-chart2', [])[0];
    const chart = vz && vz._chart;
    const series = {};
    for (const [name, s] of Object.entries(card._nameToDataSeries || {})) {
      series[name] = {run: s.run, tag: s.tag,
                      points: (s.scalarData || []).map((d) => [d.step, d.scalar, d.smoothed])};
    }
    return {title: card.title, smoothing: card.smoothingWeight, smoothingEnabled: card.smoothingEnabled,
            ignoreYOutliers: card.ignoreYOutliers, seriesNames: card._seriesNames || [], series,
            yDomain: chart && chart.yScale ? chart.yScale.domain() : null};
  });
  return JSON.stringify({texts, cards});
})()
"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def record_run(log_dir: str, steps: int = 150, corrupt_at: int | None = None, nan_at: int | None = 120,
               seed: int = 0, lr: float = 3e-3) -> Any:
    """A small watched run with a learning-rate warm-up; optionally a corrupted batch (a gradient and loss
    spike) at ``corrupt_at`` and a NaN loss (skipped by gradwatch) at ``nan_at``. Returns the watcher."""
    import torch
    from torch import nn

    import gradwatch

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    x_all = torch.randn(512, 16)
    y_all = (x_all[:, 0] + 0.5 * x_all[:, 1] > 0).long()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    with gradwatch.watch(model, opt, console=False, log_dir=log_dir, update_ratio_every=5, histogram_every=25) as gw:
        for step in range(steps):
            i = torch.randint(0, 512, (32,))
            x, y = x_all[i], y_all[i]
            if step == corrupt_at:
                x = -1000 * x  # a corrupted batch: gradient and loss spike
            loss = nn.functional.cross_entropy(model(x), y)
            if step == nan_at:
                loss = loss * float("nan")  # skipped by gradwatch
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return gw


def record_runs(log_dir: str, n: int = 11, steps: int = 150) -> list[Any]:
    """``n`` runs in sub-directories of ``log_dir`` (a learning-rate sweep); every third has the NaN step."""
    return [
        record_run(os.path.join(log_dir, f"run{i:02d}"), steps=steps, corrupt_at=None,
                   nan_at=120 if i % 3 == 2 else None, seed=i, lr=1e-3 * (1 + i))
        for i in range(n)
    ]


def wait_for_layout(port: int, timeout: float = 90.0) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/data/plugin/custom_scalars/layout"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                layout = json.loads(r.read())
            if any(c.get("title") == "gradwatch" for c in layout.get("category", [])):
                return layout
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"tensorboard on port {port} served no gradwatch layout within {timeout:.0f}s")


class DevTools:
    """A minimal Chrome DevTools protocol client over a stdlib websocket (text frames only)."""

    def __init__(self, ws_url: str) -> None:
        u = urllib.parse.urlparse(ws_url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("devtools closed the connection during the handshake")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"devtools refused the websocket: {head[:200]!r}")
        self._id = 0

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("devtools connection closed")
            buf += chunk
        return buf

    def _send(self, text: str) -> None:
        data = text.encode()
        header = bytearray([0x81])
        n = len(data)
        if n < 126:
            header.append(0x80 | n)
        elif n < 1 << 16:
            header.append(0x80 | 126)
            header += n.to_bytes(2, "big")
        else:
            header.append(0x80 | 127)
            header += n.to_bytes(8, "big")
        mask = os.urandom(4)
        self.sock.sendall(bytes(header) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _recv(self) -> str:
        parts: list[bytes] = []
        while True:
            b1, b2 = self._exact(2)
            n = b2 & 0x7F
            if n == 126:
                n = int.from_bytes(self._exact(2), "big")
            elif n == 127:
                n = int.from_bytes(self._exact(8), "big")
            payload = self._exact(n)
            opcode = b1 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("devtools closed the websocket")
            if opcode in (0x9, 0xA):
                continue  # ping/pong: chrome does not require answers for short sessions
            parts.append(payload)
            if b1 & 0x80:
                return b"".join(parts).decode()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self._send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def close(self) -> None:
        self.sock.close()


def page_websocket(port: int, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                pages = [t for t in json.loads(r.read()) if t.get("type") == "page"]
            if pages:
                return str(pages[0]["webSocketDebuggerUrl"])
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    raise TimeoutError("chromium's devtools endpoint did not come up")


def probe(tools: DevTools) -> dict[str, Any]:
    r = tools.call("Runtime.evaluate", expression=_PROBE_JS, returnByValue=True)
    return dict(json.loads(r["result"]["value"]))


@dataclasses.dataclass
class RunFacts:
    """What a recorded run's charts must show: taken from the watcher, not from the event files."""

    incident_steps: set[int]  # steps with a finding or a skipped update
    skipped: int
    kinds: int

    @classmethod
    def of(cls, gw: Any) -> RunFacts:
        summary = gw.summary()
        steps = {f.step for f in gw.findings}
        return cls(steps, int(summary.steps_skipped), len({f.kind for f in gw.findings}))


def load_page(log_dir: str, out: str, chromium: str, timeout: float = 120.0) -> dict[str, Any]:
    """Serve ``log_dir``, open the dashboard, wait until every gradwatch chart has drawn its series, save a
    screenshot to ``out``; returns what the page shows (:data:`_PROBE_JS`)."""
    tb_port, cdp_port = free_port(), free_port()
    tb = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", log_dir, "--host", "127.0.0.1", "--port", str(tb_port),
         "--reload_interval", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    profile = tempfile.mkdtemp(prefix="gradwatch-chromium-")
    browser = None
    try:
        wait_for_layout(tb_port)
        size = f"--window-size={VIEWPORT['width']},{VIEWPORT['height']}"
        browser = subprocess.Popen(
            [chromium, *CHROMIUM_FLAGS, size, f"--user-data-dir={profile}", f"--remote-debugging-port={cdp_port}",
             "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        tools = DevTools(page_websocket(cdp_port))
        try:
            tools.call("Emulation.setDeviceMetricsOverride", deviceScaleFactor=1, mobile=False, **VIEWPORT)
            tools.call("Page.enable")
            tools.call("Page.navigate", url=f"http://127.0.0.1:{tb_port}/?darkMode=false#custom_scalars")
            page = wait_for_charts(tools, timeout)
            shot = tools.call("Page.captureScreenshot", format="png")
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out, "wb") as fh:
                fh.write(base64.b64decode(shot["data"]))
            return page
        finally:
            tools.close()
    finally:
        for proc in (browser, tb):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for_charts(tools: DevTools, timeout: float) -> dict[str, Any]:
    """Probe until every chart is on the page with all its series loaded, twice the same (drawn, settled)."""
    from gradwatch.report.dashboard import CHARTS

    deadline = time.monotonic() + timeout
    last: Any = None
    page: dict[str, Any] = {"texts": [], "cards": []}
    while time.monotonic() < deadline:
        page = probe(tools)
        titles = {c["title"] for c in page["cards"]}
        loaded = all(set(c["seriesNames"]) <= {n for n, s in c["series"].items() if s["points"]} for c in page["cards"])
        if set(CHARTS) <= titles and loaded:
            if page["cards"] == last:
                break
            last = page["cards"]
        time.sleep(1.0)
    time.sleep(1.5)  # let the last lines animate in
    return probe(tools)


def _tag_problems(title: str, card: dict[str, Any]) -> list[str]:
    """Each series is matched by this chart's regexes (re.match, as TensorBoard) and by no other chart's."""
    from gradwatch.report.dashboard import CHARTS

    problems = []
    for s in card["series"].values():
        owners = [t for t, rxs in CHARTS.items() if any(re.match(rx, s["tag"]) for rx in rxs)]
        if owners != [title]:
            problems.append(f"{title!r}: tag {s['tag']} is matched by the charts {owners}")
    return problems


def _in_view(card: dict[str, Any], value: float) -> bool:
    lo, hi = card["yDomain"] or (math.inf, -math.inf)
    return bool(lo <= value <= hi)


def _run_problems(title: str, card: dict[str, Any], run: str, facts: RunFacts, alone: bool) -> list[str]:
    """What one run's series in one chart must show."""
    series = {s["tag"]: s["points"] for s in card["series"].values() if s["run"] == run}
    where = f"{title!r} run {run!r}"
    problems = []
    lines = {t: p for t, p in series.items() if "/incidents/" not in t}
    markers = {t: p for t, p in series.items() if "/incidents/" in t}
    if title in ("gradient norm (total)", "loss"):
        if not lines or any(len(p) < 10 for p in lines.values()):
            problems.append(f"{where}: the line is missing or short")
        steps = {int(p[0]) for pts in markers.values() for p in pts}
        if steps != facts.incident_steps:
            problems.append(f"{where}: markers at steps {sorted(steps)}, incidents at {sorted(facts.incident_steps)}")
        hidden = [p[0] for pts in markers.values() for p in pts if not _in_view(card, p[1])]
        if hidden and alone:  # among several runs, a run far above the others is (rightly) off the chart
            problems.append(f"{where}: markers outside the y range {card['yDomain']} at steps {hidden}")
    elif title.startswith("layer gradient spread"):
        if not lines or any(len(p) < 5 or min(v for _, v, _ in p) < 1 for p in lines.values()):
            problems.append(f"{where}: no spread line, or a spread below 1")
    elif title.startswith("update / weight ratio"):
        if not lines or any(len(p) < 5 or not all(0 < v < 1 for _, v, _ in p) for p in lines.values()):
            problems.append(f"{where}: no ratio line, or a ratio outside (0, 1)")
    elif title.startswith("skipped updates"):
        pts = series.get("gradwatch/skipped_steps") or []
        if not pts or pts[-1][1] != facts.skipped or not _in_view(card, pts[-1][1]):
            problems.append(f"{where}: last count {pts[-1][1] if pts else None}, {facts.skipped} skipped, "
                            f"y range {card['yDomain']}")
        elif abs(pts[-1][2] - pts[-1][1]) > 0.05 * max(1, facts.skipped):
            problems.append(f"{where}: smoothed count {pts[-1][2]:.2f} at the end, not {facts.skipped}")
    elif title.startswith("findings"):
        none_yet = series.pop("gradwatch/findings_stacked/none_yet", [])
        if any(v != 0 for _, v, _ in none_yet) or (not facts.kinds and not none_yet):
            problems.append(f"{where}: the zero line before the first finding is missing or not zero")
        finals = [p[-1][1] for p in series.values() if p]
        if len(finals) != facts.kinds or len(set(finals)) != len(finals):
            problems.append(f"{where}: {facts.kinds} kinds found, lines end at {finals} (must be apart)")
        if any(not _in_view(card, v) for v in finals):
            problems.append(f"{where}: a line ends outside the y range {card['yDomain']}")
    return problems


def chart_problems(page: dict[str, Any], runs: dict[str, RunFacts]) -> list[str]:
    """Does each chart answer its question at TensorBoard's default settings? ``runs``: run name (as
    TensorBoard names it, ``.`` for the log directory itself) -> its facts."""
    from gradwatch.report.dashboard import CHARTS

    cards = {c["title"]: c for c in page["cards"]}
    problems = [f"chart {t!r} is not on the page" for t in CHARTS if t not in cards]
    if "gradwatch" not in page["texts"]:
        problems.append("the 'gradwatch' category is not on the page")
    for title, card in cards.items():
        if title not in CHARTS:
            continue
        if not (card["smoothingEnabled"] and card["smoothing"] == 0.6 and card["ignoreYOutliers"]):
            problems.append(f"{title!r}: not at TensorBoard's default settings (smoothing 0.6, outliers ignored)")
        problems += _tag_problems(title, card)
        for run, facts in runs.items():
            problems += _run_problems(title, card, run, facts, alone=len(runs) == 1)
    return problems


def check_scenario(name: str, log_dir: str, out_dir: str, chromium: str, n_runs: int = 11) -> list[str]:
    """Record the scenario's run(s) into ``log_dir``, screenshot ``tensorboard-<name>.png``, check the charts."""
    if name == "runs":
        runs = {f"run{i:02d}": RunFacts.of(gw) for i, gw in enumerate(record_runs(log_dir, n_runs))}
    elif name == "spike":
        runs = {".": RunFacts.of(record_run(log_dir, corrupt_at=100))}
    elif name == "nan":
        runs = {".": RunFacts.of(record_run(log_dir))}
    else:
        runs = {".": RunFacts.of(record_run(log_dir, corrupt_at=None, nan_at=None))}
    page = load_page(log_dir, os.path.join(out_dir, f"tensorboard-{name}.png"), chromium)
    return [f"{name}: {p}" for p in chart_problems(page, runs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "docs", "img"))
    parser.add_argument("--scenario", nargs="+", choices=["healthy", "nan", "spike", "runs"], default=["healthy", "nan", "runs"])
    parser.add_argument("--keep", action="store_true", help="keep the recorded log directories (printed)")
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print("chromium is not installed (Debian/Ubuntu: apt-get install -y chromium)", file=sys.stderr)
        return 3
    problems: list[str] = []
    for name in args.scenario:
        log_dir = tempfile.mkdtemp(prefix=f"gradwatch-tb-{name}-")
        try:
            problems += check_scenario(name, log_dir, args.out_dir, chromium)
        finally:
            if args.keep:
                print(f"{name}: {log_dir}")
            else:
                shutil.rmtree(log_dir, ignore_errors=True)
        if name == "nan":  # the picture the README shows
            shutil.copyfile(os.path.join(args.out_dir, "tensorboard-nan.png"), os.path.join(args.out_dir, "tensorboard.png"))
    if problems:
        print("the gradwatch dashboard does not show what it should:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"every gradwatch chart shows what it should; screenshots in {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
