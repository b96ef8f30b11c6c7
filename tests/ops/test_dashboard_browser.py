"""The dashboard in a real headless browser (Debian's Chromium driven by Selenium): the page
loads without a script or policy error, the accuracy chart gains points while a live run goes
on, the client table shows the client whose updates are refused, and a token opened once
with ``?token=`` keeps working from its cookie.

Slow (a browser start takes seconds on a small machine): ``python -m pytest -m slow``. Skipped
when chromium, chromedriver or selenium is missing (``.ci/run`` installs them). Set
``MURMURA_SCREENSHOT=1`` to write the page to docs/images/dashboard.png (the screenshot in
docs/operations.md); otherwise it goes to the test's temporary directory.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the dashboard needs the ops extra")
pytest.importorskip("uvicorn", reason="the dashboard needs the ops extra")
webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")

from murmura.dashboard import start_live  # noqa: E402
from murmura.server.dashboard import plan_bind  # noqa: E402
from tests.ops.test_dashboard import TOKEN, Federation  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "images" / "dashboard.png"
WAIT_S = 60.0


def _binary(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = _binary("chromium", "chromium-browser", "google-chrome")
    driver_path = _binary("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("needs chromium and chromedriver (apt-get install chromium "
                    "chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1700", "--hide-scrollbars", "--no-first-run",
                "--disable-extensions", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, script: str, what: str, timeout: float = WAIT_S) -> Any:
    """Poll a JavaScript expression in the page until it is truthy; return its value."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
            lambda d: d.execute_script(f"return ({script});"))
    except TimeoutException:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}") from None


ACCURACY_POINTS = ("Number((document.querySelector('#chart-accuracy svg') || "
                   "{dataset: {}}).dataset.points || 0)")


def severe_logs(driver: Any) -> list[str]:
    """Script errors and Content-Security-Policy violations the page logged."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE" and "favicon" not in entry["message"]]


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[Any]:
    """A live aggregator with 5 honest clients and 1 whose updates are refused, and a
    dashboard beside it, started the way ``murmura server --dashboard`` starts it."""
    started: list[tuple[Federation, Any]] = []

    def start(*, token: str = "") -> tuple[Federation, Any]:
        fed = Federation(tmp_path / "runs" / "async-demo", honest=5, bad=1, period_s=0.8,
                         buffer_size=3, workers=1)  # a decoding worker: the tier panel has one
        plan = plan_bind("127.0.0.1:0", token=token)
        assert fed.core.recorder is not None
        live = start_live(plan, fed.core, fed.core.recorder.out_dir, call=fed.srv.call)
        started.append((fed, live))
        fed.start_clients()
        return fed, live

    yield start
    for fed, live in started:
        fed.srv.call(live.cancel_poster)
        live.stop()
        fed.close()


def test_the_page_follows_a_live_run_and_shows_the_refused_client(browser: Any, live_run,
                                                                  tmp_path: Path) -> None:
    fed, live = live_run()

    browser.get(live.url)

    assert browser.title == "Murmura dashboard"
    wait_for(browser, f"{ACCURACY_POINTS} >= 2", "two points on the accuracy chart")
    points = browser.execute_script(f"return {ACCURACY_POINTS};")
    wait_for(browser, f"{ACCURACY_POINTS} > {points}", "the accuracy chart to gain a point")
    refused = wait_for(browser, "Array.from(document.querySelectorAll('#clients tr.refused'))"
                       ".map(tr => tr.dataset.client).join(',')",
                       "a refused client in the client table")
    assert refused == "bad-05"
    cells = browser.execute_script(
        "return Array.from(document.querySelectorAll('#clients tr.refused td'))"
        ".map(td => td.textContent);")
    assert cells[0] == "bad-05" and int(cells[7]) >= 1  # the refusals column
    reasons = browser.execute_script(
        "return document.querySelector('#refusals tbody').textContent;")
    assert "INVALID_ARGUMENT: payload does not decode" in reasons
    assert browser.execute_script("return document.getElementById('status').textContent;") \
        == "live"
    assert browser.execute_script(
        "return document.querySelectorAll('#clients tbody tr').length;") == 6
    browser.find_element("css selector", "#clients th[data-key='client_id']").click()
    first = browser.execute_script(
        "return document.querySelector('#clients tbody tr').dataset.client;")
    assert first == "bad-05"  # sorted by id: "bad-" before "client-"
    assert not severe_logs(browser)

    # a few more versions, so the screenshot shows curves rather than dots
    wait_for(browser, f"{ACCURACY_POINTS} >= 12", "a dozen versions")
    browser.find_element("css selector", "#clients th[data-key='refusals']").click()
    target = SCREENSHOT if os.environ.get("MURMURA_SCREENSHOT") == "1" else \
        tmp_path / "dashboard.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    bottom = browser.execute_script(
        "return Math.ceil(document.querySelector('footer').getBoundingClientRect().bottom);")
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {  # the page, no more
        "width": 1400, "height": int(bottom), "deviceScaleFactor": 1, "mobile": False})
    assert browser.save_screenshot(str(target))
    assert target.stat().st_size > 10_000


def test_a_token_given_once_in_the_address_then_lives_in_a_cookie(browser: Any,
                                                                  live_run) -> None:
    fed, live = live_run(token=TOKEN)

    browser.get(live.url)  # no token: refused
    assert "needs its token" in browser.find_element("tag name", "body").text
    assert any("401" in line for line in severe_logs(browser))  # read: the log starts over

    browser.get(f"{live.url}?token={TOKEN}")

    wait_for(browser, f"{ACCURACY_POINTS} >= 2", "the chart, through the event stream")
    assert "token" not in browser.current_url  # taken out of the address bar
    assert browser.get_cookie("murmura_dashboard")["httpOnly"] is True
    assert not severe_logs(browser)


def test_a_finished_run_opens_from_its_directory_and_another_from_the_list(
        browser: Any, tmp_path: Path) -> None:
    from murmura.server.dashboard import DashboardServer, RunDirFeed
    from tests.ops.test_dashboard import make_run, row, write_rows

    make_run(tmp_path, "sync-run", versions=6, finished=True)
    gossip = tmp_path / "gossip-run"
    gossip.mkdir()
    write_rows(gossip / "metrics.jsonl", [row(v, consensus_distance=1.0 / v, peers=8)
                                          for v in range(1, 9)], mode="w")
    (gossip / "summary.json").write_text('{"config": {"gossip": {"rule": "median"}}}')
    server = DashboardServer(RunDirFeed(tmp_path / "sync-run"), plan_bind("127.0.0.1:0"),
                             runs_root=tmp_path).start()
    try:
        browser.get(server.url)
        wait_for(browser, f"{ACCURACY_POINTS} == 6", "the finished run's six versions")
        assert browser.execute_script(
            "return document.getElementById('status').textContent;") == "finished"
        assert browser.execute_script(
            "return document.getElementById('chart-consensus').hidden;") is True

        wait_for(browser, "!document.getElementById('runs').disabled", "the list of runs")
        browser.execute_script("const s = document.getElementById('runs');"
                               "s.value = 'gossip-run'; s.dispatchEvent(new Event('change'));")

        wait_for(browser, f"location.pathname === '/runs/gossip-run' && {ACCURACY_POINTS} == 8",
                 "the gossip run's page")
        assert browser.execute_script(
            "return document.querySelector('#chart-consensus svg').dataset.points;") == "8"
        assert "peer" in browser.execute_script(
            "return document.getElementById('run-title').textContent;")
        assert not severe_logs(browser)
    finally:
        server.stop()
