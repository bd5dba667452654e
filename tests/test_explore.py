"""``shardwise explore`` as a user meets it: the server started from the command line with
two real rank processes, driven from headless Chromium (Playwright, the Debian build), and
stopped. One server serves the tests below in order: the controls, bad input, a rank that
dies, closing the server."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardwise
from shardwise.explore.machine import choose

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None, reason="needs the [explore] extra (aiohttp)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright (the [test] extra)"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing: apt-get install -y chromium"),
]
BROWSER_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]
START_S = 180  # rank processes import torch and plan: slow on a loaded machine


def _env() -> dict[str, str]:
    src = str(Path(shardwise.__file__).resolve().parents[1])  # this checkout's shardwise
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))


def children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        out.update(int(c) for c in (task / "children").read_text().split())
    return out


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardwise", "explore", "--port", "0", "--ranks", "2"],
        stdout=subprocess.PIPE, text=True, env=_env(),
    )
    line = proc.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:\d+/", line)
    assert match, f"the server printed {line!r}, not its address"
    try:
        yield proc, match.group(0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
        try:
            yield b
        finally:
            b.close()


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_function("typeof state !== 'undefined' && state !== null")
    page.errors = errors
    return page


def text(page, selector: str) -> str:
    return page.text_content(selector)


def wait_text(page, selector: str, expected: str, timeout_s: float = 60) -> None:
    page.wait_for_function(
        f"document.querySelector({selector!r}).textContent === {expected!r}", timeout=timeout_s * 1000
    )


def set_speed(page, delay_ms: int) -> None:
    page.eval_on_selector("#speed", f"e => {{ e.value = {delay_ms}; e.dispatchEvent(new Event('input')); }}")


def cells(page) -> list[str]:
    return page.eval_on_selector_all("#grid td.cell", "tds => tds.map(td => td.className)")


def regions(page) -> str:
    return page.eval_on_selector("#regions", "c => c.toDataURL()")


def test_controls_drive_the_run(server, browser, tmp_path):
    _, url = server
    a, b = open_page(browser, url), open_page(browser, url)  # two tabs, one run
    wait_text(a, "#status", "ready", START_S)
    first_seed = text(a, "#seed")
    assert text(a, "#counter") == "Step 0 / 12" and first_seed.isdigit()
    a.click("#reset")  # a new seed and fresh state, the same processes
    a.wait_for_function(f"document.getElementById('seed').textContent !== {first_seed!r}")
    wait_text(a, "#status", "ready", START_S)
    seed = text(a, "#seed")
    wait_text(b, "#seed", seed)
    untrained = regions(a)

    a.click("#step")  # exactly one stage
    wait_text(a, "#counter", "Step 1 / 12")
    wait_text(b, "#counter", "Step 1 / 12")
    assert text(a, "#status") == "ready" and a.evaluate("state.loss.length") == 5
    assert regions(a) != untrained  # drawn from the model after the stage
    assert a.evaluate("state.ranks.every(r => r.measured && r.measured.bytes_per_step > 0)")

    set_speed(a, 40)  # slow: the page follows the ranks event by event
    a.click("#train")
    a.wait_for_function(
        "[...document.querySelectorAll('#grid td.cell')].some(td => /gather|forward|backward/.test(td.className))",
        timeout=60_000,
    )
    b.click("#pause")  # from the other tab
    wait_text(a, "#status", "paused")
    time.sleep(0.5)  # an event already sent may still arrive
    frozen = (text(a, "#counter"), cells(a), a.eval_on_selector_all("#grid td.event", "e => e.map(x => x.textContent)"))
    time.sleep(1.0)
    assert (text(a, "#counter"), cells(a), a.eval_on_selector_all("#grid td.event", "e => e.map(x => x.textContent)")) == frozen
    assert any(re.search("gather|forward|backward", c) for c in frozen[1])  # mid-step, as the ranks are
    k = int(frozen[0].split()[1])

    set_speed(a, 0)
    a.click("#step")  # finishes the stage it paused in, and stops
    wait_text(a, "#counter", f"Step {k + 1} / 12")
    wait_text(a, "#status", "ready")
    assert all(c.split()[1] == "sharded" for c in cells(a))  # between stages: all sharded

    b.click("#train")
    wait_text(a, "#counter", "Step 12 / 12", 120)
    wait_text(a, "#status", "complete")
    loss = a.evaluate("state.loss")
    assert len(loss) == 60 and loss[-1] < loss[0] / 5
    assert a.evaluate("state.grid.accuracy") > 0.9  # the spiral is learned (one process: 1.0)
    assert text(b, "#seed") == seed and text(b, "#counter") == "Step 12 / 12"
    colours = a.eval_on_selector(
        "#regions",
        "c => { const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, seen = new Set();"
        " for (let i = 0; i < px.length; i += 4 * 7) seen.add((px[i] << 16) | (px[i + 1] << 8) | px[i + 2]);"
        " return seen.size; }",
    )
    assert colours > 10, "the model view drew nothing"
    png = a.screenshot(path=str(tmp_path / "explore.png"), full_page=True)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert not a.errors and not b.errors
    a.close()
    b.close()


def test_bad_settings_show_a_message(server, browser):
    _, url = server
    page = open_page(browser, url)
    before = (text(page, "#counter"), text(page, "#seed"))
    page.fill("#set-ranks", "7")
    page.click("#reset")
    page.wait_for_function("document.getElementById('message').textContent !== ''")
    assert "ranks must be a whole number from 1 to 4, got 7" in text(page, "#message")
    page.fill("#set-ranks", "2")  # hybrid needs 4 ranks: 2 shard groups of 2
    page.select_option("#set-strategy", "hybrid_shard")
    page.click("#reset")
    page.wait_for_function("document.getElementById('message').textContent.includes('hybrid_shard')")
    assert "it needs ranks = 4 (2 replicas x 2 shards), got ranks = 2" in text(page, "#message")
    page.evaluate("send({cmd: 'speed', delay_ms: -5})")
    page.wait_for_function("document.getElementById('message').textContent.startsWith('speed')")
    assert "from 0 to 2000, got -5" in text(page, "#message")
    page.click("#step")  # the run before is complete
    page.wait_for_function("document.getElementById('message').textContent.startsWith('the run is complete')")
    assert (text(page, "#counter"), text(page, "#seed")) == before  # the run is untouched
    page.close()


def test_a_dead_rank_is_shown_and_reset_brings_the_job_back(server, browser):
    proc, url = server
    page = open_page(browser, url)
    old = page.evaluate("state.ranks.map(r => r.pid)")
    assert set(old) == children(proc.pid)
    os.kill(old[1], signal.SIGKILL)
    wait_text(page, "#status", "dead")
    page.wait_for_selector("#dead-1")
    assert "rank 1 is dead" in text(page, "#ranks") and "exited with code -9" in text(page, "#dead-1")
    assert "dead" in page.eval_on_selector_all("#grid td.event", "e => e.map(x => x.textContent)")
    assert proc.poll() is None  # the server lives on
    # what-if settings, applied at the Reset that restarts the job: hybrid over 2 x 2 ranks
    page.fill("#set-ranks", "4")
    page.select_option("#set-strategy", "hybrid_shard_grad_op")
    page.select_option("#set-comm", "bf16")
    page.click("#reset")
    wait_text(page, "#status", "ready", START_S)
    new = page.evaluate("state.ranks.map(r => r.pid)")
    assert not set(new) & set(old) and set(new) == children(proc.pid)
    assert all(gone(p) for p in old)
    assert page.evaluate("state.settings.strategy") == "hybrid_shard_grad_op"
    assert text(page, "#machine") == choose(4).describe()  # cpu (gloo) without 4 GPUs
    assert "after stage 1" in text(page, "#plan")  # the prediction, before training
    page.click("#step")
    wait_text(page, "#counter", "Step 1 / 12")
    plan, measured = page.evaluate("state.plan"), page.evaluate("state.ranks.map(r => r.measured)")
    # the planner's prediction against the ranks' own figures, bf16 on the wire
    assert measured[0]["bytes_per_step"] == pytest.approx(plan["bytes_per_step"], rel=0.05)
    assert max(m["peak"] for m in measured) == pytest.approx(plan["peak"], rel=0.25)
    assert "%" in text(page, "#plan")
    page.close()


def test_closing_the_server_leaves_no_process(server):
    proc, _ = server
    ranks = children(proc.pid)
    assert len(ranks) == 4  # (the job the Reset above started)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in ranks), "a rank process outlived the server"


def test_out_of_range_ranks_on_the_command_line(capsys):
    from shardwise.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["explore", "--ranks", "9"])
    assert exit_.value.code == 2
    assert "ranks must be a whole number from 1 to 4, got 9" in capsys.readouterr().err
