"""See gradwatch's TensorBoard dashboard in a real browser, check it renders, save a screenshot.

Runs a short watched training run (a learning-rate warm-up, a corrupted batch at step 100 and a NaN
loss at step 120), starts ``tensorboard`` on 127.0.0.1 at a free port, opens the Custom Scalars tab in
headless Chromium, checks that every gradwatch chart is drawn with data (TensorBoard's charts live in
shadow DOM, which ``--dump-dom`` does not serialize, so the check walks the shadow roots through the
DevTools protocol), and saves a screenshot.

Usage:
    python tools/tensorboard_screenshot.py [--out docs/img/tensorboard.png] [--log-dir DIR] [--keep]

Exit codes: 0 rendered and saved; 1 the charts did not render; 3 chromium is not installed
(``apt-get install -y chromium``).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
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
    "--window-size=1400,1000",
    "--hide-scrollbars",
]

# Walks the document and every shadow root: chart titles, drawn line charts, and "no data" notices.
_PROBE_JS = r"""
(() => {
  const texts = [], charts = [];
  const walk = (root) => {
    for (const el of root.querySelectorAll('*')) {
      const tag = el.tagName.toLowerCase();
      if (tag.includes('line-chart')) charts.push(tag);
      if (el.shadowRoot) walk(el.shadowRoot);
    }
    const w = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    while (w.nextNode()) { const t = w.currentNode.textContent.trim(); if (t) texts.push(t); }
  };
  walk(document);
  return JSON.stringify({texts, charts: charts.length});
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


def record_run(log_dir: str, steps: int = 150) -> None:
    """A small watched run with something to see on every chart."""
    import torch
    from torch import nn

    import gradwatch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x_all = torch.randn(512, 16)
    y_all = (x_all[:, 0] + 0.5 * x_all[:, 1] > 0).long()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    with gradwatch.watch(model, opt, console=False, log_dir=log_dir, update_ratio_every=5, histogram_every=25) as gw:
        for step in range(steps):
            i = torch.randint(0, 512, (32,))
            x, y = x_all[i], y_all[i]
            if step == 100:
                x = -1000 * x  # a corrupted batch: gradient and loss spike
            loss = nn.functional.cross_entropy(model(x), y)
            if step == 120:
                loss = loss * float("nan")  # skipped by gradwatch
            gw.observe_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()


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


def screenshot(log_dir: str, out: str, chromium: str, timeout: float = 120.0) -> list[str]:
    """Serve ``log_dir``, open the dashboard, wait for every gradwatch chart; returns the problems found."""
    from gradwatch.dashboard import CHARTS

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
        browser = subprocess.Popen(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--remote-debugging-port={cdp_port}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        tools = DevTools(page_websocket(cdp_port))
        try:
            tools.call("Page.enable")
            tools.call("Page.navigate", url=f"http://127.0.0.1:{tb_port}/?darkMode=false#custom_scalars")
            deadline = time.monotonic() + timeout
            found: dict[str, Any] = {"texts": [], "charts": 0}
            while time.monotonic() < deadline:
                found = probe(tools)
                texts = set(found["texts"])
                if all(t in texts for t in CHARTS) and found["charts"] >= len(CHARTS):
                    break
                time.sleep(1.0)
            time.sleep(2.0)  # let the last lines animate in
            found = probe(tools)
            shot = tools.call("Page.captureScreenshot", format="png")
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out, "wb") as fh:
                fh.write(base64.b64decode(shot["data"]))
        finally:
            tools.close()
        texts = set(found["texts"])
        problems = [f"chart {t!r} is not on the page" for t in CHARTS if t not in texts]
        if found["charts"] < len(CHARTS):
            problems.append(f"only {found['charts']} line charts drawn, expected {len(CHARTS)}")
        if "gradwatch" not in texts:
            problems.append("the 'gradwatch' category is not on the page")
        if any("No data" in t or "no scalar data" in t.lower() for t in texts):
            problems.append("a chart says it has no data")
        return problems
    finally:
        for proc in (browser, tb):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "tensorboard.png"))
    parser.add_argument("--log-dir", default=None, help="record the demo run here (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary log directory")
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print("chromium is not installed (Debian/Ubuntu: apt-get install -y chromium)", file=sys.stderr)
        return 3
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="gradwatch-tb-")
    try:
        record_run(log_dir)
        problems = screenshot(log_dir, args.out, chromium)
    finally:
        if args.log_dir is None and not args.keep:
            shutil.rmtree(log_dir, ignore_errors=True)
    if problems:
        print("the gradwatch dashboard did not render:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"every gradwatch chart rendered; screenshot saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
