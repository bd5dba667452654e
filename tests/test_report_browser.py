"""The report as a user sees it: headless Chromium opens the page from file://, the controls
move the mechanism's event counter, and a screenshot shows a drawn page.

Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON
messages separated by NUL bytes on file descriptors 3 and 4), so no driver package is needed.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.observer import report
from shardwise.observer.trace import trace

CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing: apt-get install -y chromium"
)


class Browser:
    """One headless Chromium page, commanded over the DevTools protocol."""

    def __init__(self, width: int = 1280, height: int = 1400):
        self.profile = tempfile.mkdtemp(prefix="sw-chromium-")
        to_child, self._out = os.pipe()
        self._in, from_child = os.pipe()
        # the child's fds 3 and 4 must be the pipe ends: keep copies above them, dup2 in the child
        hi_r, hi_w = (
            fcntl.fcntl(to_child, fcntl.F_DUPFD, 100),
            fcntl.fcntl(from_child, fcntl.F_DUPFD, 100),
        )

        def fds():
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-dev-shm-usage",
                "--remote-debugging-pipe",
                f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            pass_fds=(3, 4),
            preexec_fn=fds,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for fd in (to_child, from_child, hi_r, hi_w):
            os.close(fd)
        self._buf = b""
        self._id = 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call("Page.enable", session=True)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def call(self, method: str, *, session: bool = False, timeout: float = 30.0, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise TimeoutError(f"no answer from Chromium to {method}")
                self._buf += os.read(self._in, 1 << 20)
            line, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(line)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("document.readyState === 'complete' && !!document.getElementById('grid')")

    def js(self, expression: str):
        result = self.call(
            "Runtime.evaluate",
            session=True,
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, condition: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.js(f"!!({condition})"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied {condition}")
            time.sleep(0.05)

    def click(self, selector: str) -> None:
        """A real mouse click at the element's centre, as a user's."""
        box = self.js(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent",
                session=True,
                type=kind,
                x=box[0],
                y=box[1],
                button="left",
                clickCount=1,
            )

    def screenshot(self) -> bytes:
        return base64.b64decode(
            self.call("Page.captureScreenshot", session=True, format="png")["data"]
        )

    def close(self) -> None:
        with contextlib.suppress(TimeoutError, RuntimeError, OSError):  # gone: the kill below is enough
            self.call("Browser.close", timeout=5)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._in)
        os.close(self._out)
        shutil.rmtree(self.profile, ignore_errors=True)


def traced_steps(steps: int = 2):
    """A real traced run: the built-in GPT, full_shard, one unit per block."""
    from shardwise.data import get_batch, rank_slice
    from shardwise.models import GPT, Block, gpt_config

    cfg = gpt_config("tiny", n_layer=3)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    shardwise.shard(model, wrap=shardwise.wrap.by_class(Block))
    opt = torch.optim.AdamW(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    with trace(model, opt) as t:
        for step in range(steps):
            x, y = get_batch(step, 2 * world, cfg.seq_len)
            model(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    return t.data


@pytest.fixture(scope="module")
def page(pools, tmp_path_factory):
    data = pools(2).run(traced_steps)[0]
    path = report.write(data, tmp_path_factory.mktemp("report") / "report.html")
    browser = Browser()
    try:
        browser.open(path.as_uri())
        yield browser, data
    finally:
        browser.close()


def counter(browser: Browser) -> tuple[int, int]:
    text = browser.js("document.getElementById('counter').textContent")
    at, total = text.removeprefix("event ").split(" / ")
    return int(at), int(total)


def test_controls_move_through_the_step(page):
    browser, _ = page
    at, total = counter(browser)
    assert at == 0 and total > 20
    browser.click("#step")
    browser.click("#step")
    assert counter(browser)[0] == 2
    assert browser.js("document.getElementById('current').textContent").startswith("t = ")
    browser.click("#play")
    browser.wait_for("parseInt(document.getElementById('counter').textContent.slice(6)) > 6")
    browser.click("#pause")
    paused = counter(browser)[0]
    time.sleep(0.4)
    assert counter(browser)[0] == paused > 6  # pause holds the position
    browser.click("#reset")
    assert counter(browser)[0] == 0
    for _ in range(total + 3):  # stepping stops at the last event
        browser.js("document.getElementById('step').click()")
    assert counter(browser) == (total, total)
    gathered = browser.js(
        "document.querySelectorAll('#grid td.gathered, #grid td.gathering').length"
    )
    sharded = browser.js("document.querySelectorAll('#grid td.sharded').length")
    assert gathered == 0 and sharded > 0  # after the step: every unit sharded again


def test_mechanism_shows_gathered_units_mid_step(page):
    browser, _ = page
    browser.click("#reset")
    seen = set()
    for _ in range(counter(browser)[1]):
        browser.js("document.getElementById('step').click()")
        seen.update(
            browser.js(
                "[...document.querySelectorAll('#grid td')].map(td => td.className.split(' ')[0])"
            )
        )
    assert {"sharded", "gathering", "gathered"} <= seen


def test_screenshot_is_drawn(page):
    browser, _ = page
    png = browser.screenshot()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # decode it in the page's own canvas and count the distinct colours it shows
    colours = browser.js(
        "new Promise(done => { const img = new Image(); img.onload = () => {"
        " const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;"
        " const g = c.getContext('2d'); g.drawImage(img, 0, 0);"
        " const px = g.getImageData(0, 0, c.width, c.height).data, seen = new Set();"
        " for (let i = 0; i < px.length; i += 4 * 37)"
        "   seen.add((px[i] << 16) | (px[i + 1] << 8) | px[i + 2]);"
        " done(seen.size); }; img.src = 'data:image/png;base64,"
        + base64.b64encode(png).decode()
        + "'; })"
    )
    assert colours > 20, f"the screenshot shows only {colours} colours: the page did not draw"
    svg_shapes = browser.js("document.querySelectorAll('#timeline rect, #memory path').length")
    assert svg_shapes > 50


def test_page_needs_no_network(page):
    _, data = page
    html = report.render(report.build(data))
    for needle in ("http://", "https://", 'src="//', "<link"):
        assert needle not in html.replace('"http://www.w3.org/2000/svg"', ""), needle
