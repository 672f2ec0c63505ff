"""The labelling page in a real browser: Debian's headless chromium driven through selenium (CI installs both,
`.ci/run`; a missing browser fails these tests, it does not skip them). Clicks, keys, a reload midway, two tabs at
once and undo, checked against what the server wrote."""

import json
import shutil
from pathlib import Path

import pytest

from mmrl.label.store import log_path


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:  # a failure, not a skip: CI must run these tests
        pytest.fail("chromium and chromedriver are needed: apt-get install chromium chromium-driver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=900,700"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)  # no driver download
    driver.set_page_load_timeout(60)  # generous: CI runs two pytest halves beside the browser on 2 cores
    yield driver
    driver.quit()


def _wait(driver, cond, what):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, 30, poll_frequency=0.05).until(lambda d: cond(d), message=what)


def progress(driver):
    return driver.find_element("id", "progress").text


def pair_shown(driver):
    """The pair id the page shows once its images loaded (naturalWidth > 0: the media route served them)."""
    return driver.execute_script(
        "const imgs = [...document.querySelectorAll('#samples img')];"
        "return imgs.length && imgs.every(i => i.complete && i.naturalWidth > 0) ? document.body.dataset.pairId : null")


def act(driver, action, expect_progress):
    """Do `action` (a key or a click) and wait until the page shows the new progress and a loaded pair."""
    from selenium.webdriver.common.action_chains import ActionChains

    before = pair_shown(driver)
    if isinstance(action, str):
        ActionChains(driver).send_keys(action).perform()
    else:
        action()
    _wait(driver, lambda d: progress(d) == expect_progress and pair_shown(d) not in (None, before),
          f"after {action!r}: expected {expect_progress!r}, the page shows {progress(driver)!r}")
    return pair_shown(driver)


def open_page(driver, server):
    driver.get(server.url)
    _wait(driver, pair_shown, "the page shows no pair")
    return pair_shown(driver)


def records(out):
    events = [json.loads(x) for x in log_path(Path(out)).read_text().splitlines()]
    rows = [json.loads(x) for x in Path(out).read_text().splitlines()]
    return events, rows


def test_click_keys_reload_and_undo_in_the_browser(browser, serve, tmp_path):
    from selenium.webdriver.common.keys import Keys

    server, _ = serve()
    first = open_page(browser, server)
    assert progress(browser) == "labelled 0 / 6"
    assert browser.find_element("id", "prompt").text == server.items[first].prompt
    second = act(browser, lambda: browser.find_element("id", "choose-0").click(), "labelled 1 / 6")  # left
    third = act(browser, Keys.ARROW_RIGHT, "labelled 2 / 6")
    browser.refresh()  # reload midway: nothing lost, the same pair shown again, progress kept
    assert open_page(browser, server) == third and progress(browser) == "labelled 2 / 6"
    fourth = act(browser, "t", "labelled 3 / 6")
    fifth = act(browser, "s", "labelled 3 / 6")  # a skip is not a label
    assert browser.find_element("id", "skipped").text == "(1 skipped, 2 remaining)"
    back = act(browser, "u", "labelled 3 / 6")  # undo retracts the skip: the skipped pair is shown again
    assert back == fourth and browser.find_element("id", "skipped").text == "(0 skipped, 3 remaining)"
    assert act(browser, Keys.BACKSPACE, "labelled 2 / 6") == third  # undo again: the tie is retracted too
    act(browser, "1", "labelled 3 / 6")  # third: left by its number key
    events, rows = records(tmp_path / "prefs.jsonl")
    assert [(r["pair_id"], r["label_0"]) for r in rows] == [(first, 1), (second, 0), (third, 1)]
    assert [e["event"] for e in events] == ["label"] * 4 + ["undo", "undo", "label"]
    assert fifth not in {r["pair_id"] for r in rows}


def test_two_tabs_label_at_once_and_no_pair_is_labelled_twice(browser, serve, tmp_path, sample_maker):
    from selenium.webdriver.common.action_chains import ActionChains

    server, _ = serve(source=sample_maker(tmp_path / "more", prompts=2, per_prompt=4))  # 12 pairs
    tab_a = browser.current_window_handle
    open_page(browser, server)
    browser.switch_to.new_window("tab")  # its own sessionStorage: another session
    tab_b = browser.current_window_handle
    open_page(browser, server)
    assert pair_shown(browser) != (browser.switch_to.window(tab_a) or pair_shown(browser))
    shown = set()
    for n in range(12):  # alternate: a choice in A, then one in B, each tab on its own pair
        browser.switch_to.window(tab_a if n % 2 == 0 else tab_b)
        pid = _wait(browser, pair_shown, f"tab {'AB'[n % 2]} shows no pair at choice {n + 1}")
        assert pid not in shown, f"pair {pid} was shown again after it was labelled"
        shown.add(pid)
        ActionChains(browser).send_keys("2" if n % 3 else "1").perform()
        _wait(browser, lambda d: progress(d) == f"labelled {n + 1} / 12", f"choice {n + 1} not shown as recorded")
    assert "All pairs are labelled." in browser.find_element("id", "prompt").text
    events, rows = records(tmp_path / "prefs.jsonl")
    assert sorted(e["pair_id"] for e in events) == sorted(server.order) == sorted(shown)  # each exactly once
    assert len({e["session"] for e in events}) == 2 and len(rows) == 12
    browser.switch_to.window(tab_b)
    browser.close()
    browser.switch_to.window(tab_a)
