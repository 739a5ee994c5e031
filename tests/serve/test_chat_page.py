"""The chat page in a real headless Chromium: load /, send a message, see the streamed answer appear."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("fastapi")
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="Chromium and chromedriver are not installed "
                                "(Debian: apt-get install chromium chromium-driver; .ci/run installs them)")


@pytest.fixture(scope="module")
def browser():
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def test_a_message_typed_on_the_page_gets_the_streamed_greedy_answer(served, browser):
    browser.get(served.url + "/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_element(By.ID, "model").text == "tiny")
    temperature = browser.find_element(By.ID, "temperature")
    temperature.clear()
    temperature.send_keys("0")
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("12")
    browser.find_element(By.ID, "input").send_keys("Hello there")
    browser.find_element(By.ID, "send").click()
    answer = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-state='done']"))
    prompt = served.chat_template.render([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    assert answer.get_attribute("textContent") == served.offline_text(prompt, max_tokens=12)
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "Hello there"
