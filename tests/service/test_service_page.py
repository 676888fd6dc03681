"""The web page at / in headless Chromium, against a service with a live run.

The DOM after the page's scripts ran must list the run with its state and draw both charts
(loss; tokens/s on both clocks) with the run's log below; the screenshot must show the chart lines in their colours.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from service_harness import TOKEN, wait_until

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium missing (apt-get install chromium; see .ci/system-deps.sh)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--window-size=1280,900", "--virtual-time-budget=4000"]
INLINE = '[model]\nflavor = "debug"\n[training]\nsteps = 2000\nseq_len = 64\n[metrics]\nlog_freq = 1\n'


def chromium(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, *args], capture_output=True, text=True, timeout=timeout)


def colour_pixels(img: np.ndarray, rgb: tuple[int, int, int], tol: int = 40) -> int:
    return int((np.abs(img[..., :3].astype(int) - np.array(rgb)).max(axis=-1) < tol).sum())


def test_page_shows_the_live_run_and_its_charts(make_service, tmp_path):
    import matplotlib.image

    svc = make_service("page", fake=True, step_seconds=0.1)
    assert svc.create(name="live-page-run", toml=INLINE).status_code == 201
    wait_until(lambda: svc.run("live-page-run")["latest_metrics"].get("step", 0) >= 5, 30, "5 logged steps")

    dom = chromium("--dump-dom", f"{svc.url}/").stdout
    row = re.search(r'<tr class="run[^"]*" data-run="live-page-run">(.*?)</tr>', dom, re.S)
    assert row, dom[:3000]
    assert '<span class="state running">running</span>' in row.group(1)
    for chart in ("chart-loss", "chart-tps"):
        svg = re.search(rf'<svg id="{chart}"[^>]*>(.*?)</svg>', dom, re.S)
        assert svg, chart
        lines = re.findall(r'<polyline points="([^"]+)"', svg.group(1))
        assert lines and all(len(pts.split()) >= 4 for pts in lines), (chart, lines)
    log = re.search(r'<pre id="log">(.*?)</pre>', dom, re.S)
    assert log and re.search(r"step \d+ loss", log.group(1)), "log pane is empty"
    assert len(re.findall(r'<polyline', re.search(r'<svg id="chart-tps".*?</svg>', dom, re.S).group(0))) == 2

    shot = tmp_path / "page.png"
    chromium(f"--screenshot={shot}", f"{svc.url}/")
    img = matplotlib.image.imread(shot)
    img = (img * 255).astype(np.uint8) if img.dtype != np.uint8 else img
    assert img.shape[:2] == (900, 1280)
    # Legend swatches are 8x8 px; only a drawn line (2 px wide, hundreds long) passes 300 px.
    assert colour_pixels(img, (0x1A, 0x73, 0xE8)) > 300, "loss line (blue) not drawn"
    assert colour_pixels(img, (0x1E, 0x8E, 0x3E)) > 300, "training-clock line (green) not drawn"
    assert colour_pixels(img, (0xE3, 0x74, 0x00)) > 300, "session-clock line (orange) not drawn"


def test_page_stop_button_stops_the_run_with_the_token(make_service):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium missing (pip install -e '.[dev]')")
    from selenium.webdriver.chrome.service import Service as DriverService
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver_path = shutil.which("chromedriver")
    if driver_path is None:
        pytest.skip("chromedriver missing (apt-get install chromium-driver; see .ci/system-deps.sh)")
    svc = make_service("page-stop", fake=True, step_seconds=0.1)
    assert svc.create(name="button-run", toml=INLINE).status_code == 201
    svc.wait_state("button-run", ("running",))
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=DriverService(driver_path), options=opts)
    try:
        driver.get(f"{svc.url}/")
        wait = WebDriverWait(driver, 30)
        wait.until(lambda d: "button-run — running" in d.find_element(By.ID, "title").text)
        driver.find_element(By.ID, "token").send_keys("wrong")
        driver.find_element(By.ID, "stop").click()
        wait.until(lambda d: "401" in d.find_element(By.ID, "action-result").text)
        assert svc.run("button-run")["state"] == "running"
        field = driver.find_element(By.ID, "token")
        field.clear()
        field.send_keys(TOKEN)
        driver.find_element(By.ID, "stop").click()
        wait.until(lambda d: "stop: 202" in d.find_element(By.ID, "action-result").text)
        svc.wait_state("button-run", ("stopped",))
        wait.until(lambda d: "button-run — stopped" in d.find_element(By.ID, "title").text)
    finally:
        driver.quit()
