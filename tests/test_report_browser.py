"""The report as a user sees it: headless Chromium (Playwright driving the Debian build)
opens the page from file://, the controls move the mechanism's event counter, and a
screenshot shows a drawn page."""

from __future__ import annotations

import base64
import importlib.util
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.observer import report
from shardwise.observer.trace import trace

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright (the [test] extra)"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing: apt-get install -y chromium"),
]
BROWSER_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]


def traced_steps(steps: int = 2):
    """A real traced run: the built-in GPT, full_shard, one unit per block."""
    from shardwise.job.data import get_batch, rank_slice
    from shardwise.job.models import GPT, Block, gpt_config

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
    from playwright.sync_api import sync_playwright

    data = pools(2).run(traced_steps)[0]
    path = report.write(data, tmp_path_factory.mktemp("report") / "report.html")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(path.as_uri())
            page.wait_for_selector("#grid")
            yield page, data
        finally:
            browser.close()


def counter(page) -> tuple[int, int]:
    text = page.text_content("#counter")
    at, total = text.removeprefix("event ").split(" / ")
    return int(at), int(total)


def test_controls_move_through_the_step(page):
    tab, _ = page
    at, total = counter(tab)
    assert at == 0 and total > 20
    tab.click("#step")
    tab.click("#step")
    assert counter(tab)[0] == 2
    assert tab.evaluate("document.getElementById('current').textContent").startswith("t = ")
    tab.click("#play")
    tab.wait_for_function("parseInt(document.getElementById('counter').textContent.slice(6)) > 6")
    tab.click("#pause")
    paused = counter(tab)[0]
    time.sleep(0.4)
    assert counter(tab)[0] == paused > 6  # pause holds the position
    tab.click("#reset")
    assert counter(tab)[0] == 0
    for _ in range(total + 3):  # stepping stops at the last event
        tab.evaluate("document.getElementById('step').click()")
    assert counter(tab) == (total, total)
    gathered = tab.evaluate(
        "document.querySelectorAll('#grid td.gathered, #grid td.gathering').length"
    )
    sharded = tab.evaluate("document.querySelectorAll('#grid td.sharded').length")
    assert gathered == 0 and sharded > 0  # after the step: every unit sharded again


def test_mechanism_shows_gathered_units_mid_step(page):
    tab, _ = page
    tab.click("#reset")
    seen = set()
    for _ in range(counter(tab)[1]):
        tab.evaluate("document.getElementById('step').click()")
        seen.update(
            tab.evaluate(
                "[...document.querySelectorAll('#grid td')].map(td => td.className.split(' ')[0])"
            )
        )
    assert {"sharded", "gathering", "gathered"} <= seen


def test_screenshot_is_drawn(page):
    tab, _ = page
    png = tab.screenshot(full_page=True)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # decode it in the page's own canvas and count the distinct colours it shows
    colours = tab.evaluate(
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
    svg_shapes = tab.evaluate("document.querySelectorAll('#timeline rect, #memory path').length")
    assert svg_shapes > 50


def test_page_needs_no_network(page):
    _, data = page
    html = report.render(report.build(data))
    for needle in ("http://", "https://", 'src="//', "<link"):
        assert needle not in html.replace('"http://www.w3.org/2000/svg"', ""), needle
