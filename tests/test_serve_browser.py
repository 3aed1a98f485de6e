"""`minigpt serve`'s page in a real browser: headless Chromium, driven by Selenium, against a served run."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_serve import FIXTURE, Server, request

webdriver = pytest.importorskip(
    "selenium.webdriver", reason="selenium is not installed: pip install -e '.[dev]'"
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402
from selenium.webdriver.support.wait import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    if CHROMIUM is None or DRIVER is None:
        pytest.skip(
            "headless Chromium is not installed: apt-get install chromium chromium-driver (.ci/run does this)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    # the driver named here, so Selenium never tries to download one
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("runs")
    shutil.copytree(FIXTURE, root / "tiny")
    s = Server(root, str(root / "tiny"))
    yield s
    s.stop()


@pytest.mark.slow
def test_the_page_streams_text_and_shows_what_tokens_attend_to(
    browser: webdriver.Chrome, server: Server, tmp_path: Path
) -> None:
    wait = WebDriverWait(browser, 30)
    browser.get(server.url + "/")
    wait.until(lambda d: d.find_element(By.ID, "model").get_attribute("value") == "tiny")
    wait.until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#curve polyline")) == 2
    )  # train and validation
    assert "Exact total" in browser.find_element(By.ID, "params").text
    for field, value in (("prompt", "The dog"), ("max_tokens", "60"), ("seed", "5")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "go").click()

    # the text came as a stream of chunks; when it is done it is redrawn as one span per token
    tokens = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#output .tok"))
    output = browser.find_element(By.ID, "output")
    assert int(output.get_attribute("data-chunks")) > 10
    body = {"prompt": "The dog", "max_tokens": 60, "seed": 5, "temperature": 0.8}
    expected = "The dog" + request(server.url + "/v1/completions", body)[1]["choices"][0]["text"]
    assert browser.execute_script("return document.getElementById('output').textContent") == expected
    assert len(tokens) == 32  # the model's window: its block_size

    heads = browser.find_element(By.ID, "heads")
    wait.until(lambda d: len(heads.find_elements(By.CSS_SELECTOR, ".head")) == 2)
    last = heads.get_attribute("innerHTML")
    tokens[20].click()
    wait.until(lambda d: "from token 20" in d.find_element(By.ID, "att-title").text)
    wait.until(lambda d: heads.get_attribute("innerHTML") != last)
    assert "selected" in tokens[20].get_attribute("class")
    shaded = heads.find_elements(By.CSS_SELECTOR, ".head .text")[0].find_elements(By.TAG_NAME, "span")
    assert len(shaded) == 21  # token 20 attends to positions 0..20
    layer1 = heads.get_attribute("innerHTML")
    Select(browser.find_element(By.ID, "layer")).select_by_value("0")
    wait.until(lambda d: heads.get_attribute("innerHTML") != layer1)
    browser.save_screenshot(str(tmp_path / "page.png"))
    assert browser.find_element(By.ID, "status").text == ""
