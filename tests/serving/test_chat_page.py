"""The chat page at ``/`` of ``fxcompiler serve``, in a real headless chromium (selenium + chromium-driver).

One server subprocess (a tiny random-weight chat model, ``--api-key``) and one browser session for the
module. The page's streamed, rendered answer must equal what the API returns for the same greedy
request; the stop button must abort the request on the server. Screenshots are kept as test
artifacts (``$FXCOMPILER_TEST_ARTIFACTS``, default ``test-artifacts/``).
"""
from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from .browser import artifacts_dir, start_browser
from .server_process import start_server
from .tiny_chat_model import save_tiny_chat_model

pytestmark = pytest.mark.slow

NAME = "tiny"
KEY = "page-key"
SYSTEM = "You are terse."
LONG_CONTEXT = 16384
LONG = 16000  # max tokens of the generation that Stop interrupts
STATS = re.compile(r"(\d+) tokens · ([0-9.]+) tok/s · first token (\d+) ms")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve-page")
    # greedy replies run to max tokens; 512 wide and 4 deep, so the 16000-token generation Stop cuts short
    # runs for over a minute (the 64-wide model streamed ~2,800 tokens/s and could end within 5 s, before a
    # busy browser had taken the click)
    model = save_tiny_chat_model(work / "model", never_eos=True, max_position_embeddings=LONG_CONTEXT,
                                 hidden_size=512, num_hidden_layers=4)
    srv = start_server(model, work, served_name=NAME, api_key=KEY,
                       extra_flags=["--max-seq-len-to-capture", str(LONG_CONTEXT), "-db", f"1,{LONG_CONTEXT}"])
    yield srv
    code = srv.stop()
    assert code == 0, f"the server did not shut down cleanly on SIGTERM (exit {code}):\n{srv.log()}"
    assert "Traceback" not in srv.log_path.read_text(errors="replace"), srv.log()


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    driver = start_browser(tmp_path_factory.mktemp("chromium"))
    try:
        driver.get(server.base_url + "/")
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def wait_for(driver, predicate, timeout: float = 60.0, what: str = "condition"):
    """Poll ``predicate(driver)`` (every 20 ms) until truthy; its value, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate(driver)
        if value:
            return value
        time.sleep(0.02)
    status, error = js(driver, "return [document.getElementById('status').textContent, "
                               "document.getElementById('error').textContent]")
    pytest.fail(f"timed out after {timeout} s waiting for {what}; page status: {status!r}, error: {error!r}")


def fill(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    el = driver.find_element(By.ID, element_id)
    el.clear()
    el.send_keys(value + Keys.TAB)  # TAB: leaves the field, so its change event fires


def last_answer(driver) -> str:
    return js(driver, "const m = document.querySelectorAll('.msg.assistant .content');"
                      "return m.length ? m[m.length - 1].textContent : null;")


def screenshot(driver, name: str):
    path = artifacts_dir() / name
    assert driver.save_screenshot(str(path)), f"no screenshot written to {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path


def test_page_is_served_from_the_package(server):
    from fxcompiler.serving.api_server import chat_page

    r = httpx.get(server.base_url + "/", timeout=30)  # no API key needed for the page itself
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.text == chat_page()  # fxcompiler/serving/static/chat.html, read as package data
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    assert not re.search(r"https?://", r.text), "the page must not load anything from elsewhere (no CDN)"
    assert ".innerHTML" not in r.text, "model text must be set as text, never as HTML"


def test_page_honours_the_api_key(page):
    from selenium.webdriver.common.by import By

    # a fresh profile has no key: listing the model is refused with the server's 401 message
    wait_for(page, lambda d: "API key" in d.find_element(By.ID, "error").text, 30, "the missing-key error")
    assert page.find_element(By.ID, "model").text == ""
    fill(page, "api-key", KEY)
    wait_for(page, lambda d: d.find_element(By.ID, "model").text == NAME, 30, "the served model's name")
    assert page.find_element(By.ID, "error").text == ""


def test_streamed_answer_equals_the_api(page, client):
    from selenium.webdriver.common.by import By

    message = "What is a <b>class</b> & an object?"
    fill(page, "system", SYSTEM)
    fill(page, "temperature", "0")
    fill(page, "max-tokens", "24")
    page.find_element(By.ID, "input").send_keys(message)
    page.find_element(By.ID, "send").click()
    wait_for(page, lambda d: js(d, "return document.body.dataset.state") == "idle" and last_answer(d), 120,
             "the streamed answer")

    ref = client.chat.completions.create(model=NAME, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": message}])
    expected = ref.choices[0].message.content
    assert expected, "the greedy reference reply is empty: nothing to compare the page with"
    assert last_answer(page) == expected
    # rendered as text: the user's markup is shown literally, the answer holds no elements
    assert js(page, "return document.querySelector('.msg.user .content').textContent") == message
    assert js(page, "return document.querySelectorAll('#messages b').length") == 0
    assert js(page, "return document.querySelector('.msg.assistant .content').children.length") == 0
    status = page.find_element(By.ID, "status").text
    m = STATS.search(status)
    assert m, f"no tokens/s shown: {status!r}"
    assert int(m.group(1)) == ref.usage.completion_tokens and float(m.group(2)) > 0, status
    assert ref.choices[0].finish_reason == "length" and status.endswith("length"), status
    assert page.find_element(By.ID, "error").text == ""
    screenshot(page, "chat-page.png")


def test_stop_button_aborts_the_request(page, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    page.find_element(By.ID, "clear").click()
    fill(page, "max-tokens", str(LONG))
    aborted = server.metrics().get("fxcompiler:request_success_total[abort]", 0.0)
    page.find_element(By.ID, "input").send_keys("Tell me a very long story about compilers.", Keys.ENTER)
    wait_for(page, last_answer, 120, "the first streamed tokens")
    assert js(page, "return document.body.dataset.state") == "streaming", "the answer ended before Stop was pressed"
    status = page.find_element(By.ID, "status").text
    assert STATS.search(status) and float(STATS.search(status).group(2)) > 0, f"no tokens/s while streaming: {status!r}"
    page.find_element(By.ID, "stop").click()
    wait_for(page, lambda d: js(d, "return document.body.dataset.state") == "idle", 30, "the page to stop")
    assert js(page, "return document.querySelector('.msg.assistant .note').textContent") == "(stopped)"
    status = page.find_element(By.ID, "status").text
    assert status.endswith("stopped") and int(STATS.search(status).group(1)) < LONG, status
    assert page.find_element(By.ID, "send").is_enabled() and not page.find_element(By.ID, "stop").is_enabled()
    text = last_answer(page)

    # the server aborted the request (the client went away), not finished it
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        if (m.get("fxcompiler:request_success_total[abort]", 0.0) == aborted + 1
                and m["fxcompiler:num_requests_running"] == 0):
            break
        assert time.monotonic() < deadline, f"the stopped request was not aborted on the server: {m}"
        time.sleep(0.1)
    assert last_answer(page) == text  # nothing arrives after Stop
    screenshot(page, "chat-page-stopped.png")
