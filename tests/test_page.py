"""The chat page at / of `ssd serve`, in a real browser: headless Chromium from Debian's packages
driven by selenium (ssd/bench/browser.py installs them with apt-get where missing). Behind the
`browser` marker: `python -m pytest -m browser`."""
import json
import signal

import httpx
import pytest

from serving import start_server

pytestmark = pytest.mark.browser

KEY = "page-key-42"
MODEL = "smollm2-135m-instruct"
# Prompt lookup proposes what followed the newest n-gram earlier in the context: a line the
# answer repeats from the question.
REPEAT = "Repeat this line twice: the quick brown fox jumps over the lazy dog."
# SmolLM2 (greedy) answers this with the tag in its text.
SCRIPT = "Write an HTML line: <script>window.pwned = 1</script>"
WAIT = 120  # seconds an answer may take to show


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server("--model", MODEL, "--mode", "sd", "--draft", "ngram", "--api-key", KEY,
                     tmp_path=tmp_path_factory.mktemp("page"))
    yield s
    assert s.stop() == 0 or s.proc.returncode in (-signal.SIGTERM,)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from ssd.bench.browser import chromium
    driver = chromium(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


@pytest.fixture
def page(browser, server):
    """The page, opened fresh, with the right key entered."""
    browser.get(server.url + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(server.url + "/")
    enter_key(browser, KEY)
    wait(browser, lambda d: d.find_element("id", "model").text == MODEL)
    return browser


def wait(driver, condition, timeout: float = WAIT):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition)


def enter_key(driver, key: str) -> None:
    field = driver.find_element("id", "key")
    field.clear()
    field.send_keys(key)
    driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def ask(driver, text: str, max_tokens: int = 48) -> None:
    tokens = driver.find_element("id", "max-tokens")
    tokens.clear()
    tokens.send_keys(str(max_tokens))
    box = driver.find_element("id", "message")
    box.send_keys(text)
    driver.find_element("id", "send").click()


def last_answer(driver):
    return driver.find_elements("css selector", ".message.assistant")[-1]


def finished(driver) -> str:
    """The last answer's stats line once it is there (it is written when the answer ends)."""
    return wait(driver, lambda d: last_answer(d).find_element("css selector", ".stats").text)


def api_answer(server, text: str, max_tokens: int, **extra) -> str:
    r = httpx.post(server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT,
                   json={"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": max_tokens,
                         **extra})
    return r.json()["choices"][0]["message"]["content"]


def test_the_page_loads_and_a_wrong_key_shows_the_error(browser, server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(server.url + "/page/app.js").status_code == 200
    assert httpx.get(server.url + "/page/../server.py").status_code == 404
    browser.get(server.url + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(server.url + "/")
    error = wait(browser, lambda d: d.find_element("id", "error").text)
    assert "401" in error and "API key" in error
    enter_key(browser, "wrong-key")
    wait(browser, lambda d: "401" in d.find_element("id", "error").text)
    ask(browser, "Hello")
    wait(browser, lambda d: "401" in d.find_element("id", "error").text and not d.find_element("id", "send")
         .get_attribute("disabled"))
    assert browser.find_element("id", "mode").text == "sd"


def test_an_answer_streams_with_its_prompt_lookup_marks(page, server):
    ask(page, REPEAT, max_tokens=48)
    # The strip updates while the answer streams, before the stats line is written.
    wait(page, lambda d: d.find_element("id", "per-pass").text not in ("", "–"))
    stats = finished(page)
    answer = last_answer(page)
    text = answer.find_element("css selector", ".text").text
    assert text == api_answer(server, REPEAT, 48).strip()
    marks = answer.find_elements("css selector", ".text span.src-lookup")
    assert marks and sum(len(m.text) for m in marks) < len(text)
    assert "tok/s" in stats and "acceptance" in stats
    assert float(page.find_element("id", "tps").text) > 0
    assert float(page.find_element("id", "per-pass").text) > 1  # drafts taken: more than a token a pass
    # The rounds' plot drew bars.
    assert page.execute_script("""const c = document.getElementById('rounds');
        return c.getContext('2d').getImageData(0, 0, c.width, c.height).data.some(v => v !== 0);""")
    # Plain decoding for the next answer: the same text, nothing marked, and the two compared.
    page.find_element("id", "speculate").click()
    page.find_element("id", "reset").click()
    ask(page, REPEAT, max_tokens=48)
    finished(page)
    plain = last_answer(page)
    assert plain.find_element("css selector", ".text").text == text
    assert not plain.find_elements("css selector", ".text span")
    assert page.find_element("id", "k-now").text == "0 (plain)"
    compare = page.find_element("id", "compare").text
    assert "speculating" in compare and "plain" in compare


def test_model_text_stays_text(page, server):
    """A `<script>` the model writes shows as characters, and nothing of it runs."""
    want = api_answer(server, SCRIPT, 40)
    assert "<script>" in want  # (the prompt is chosen so that SmolLM2 writes one)
    ask(page, SCRIPT, max_tokens=40)
    finished(page)
    body = last_answer(page).find_element("css selector", ".text")
    assert "<script>" in body.text
    assert page.execute_script("return window.pwned === undefined")
    assert not body.find_elements("css selector", "script")
    user = page.find_elements("css selector", ".message.user .text")[-1]
    assert user.text == SCRIPT


def test_stop_ends_the_request(page, server):
    ask(page, "Write a long story about a dragon and a knight.", max_tokens=400)
    wait(page, lambda d: len(last_answer(d).find_element("css selector", ".text").text) > 20)
    page.find_element("id", "stop").click()
    assert finished(page).startswith("stopped")
    server.wait_idle()  # the server cancelled it: nothing runs or holds a block
    metrics = server.metrics()
    assert metrics["ssd_requests_running"] == 0


def test_an_error_in_the_stream_shows(page, server):
    """A request the server refuses (a context too long for the model) shows its message."""
    ask(page, "word " * 9000, max_tokens=16)
    error = wait(page, lambda d: d.find_element("id", "error").text)
    assert "400" in error and ("context" in error or "tokens" in error), error
    assert json.dumps(error)  # (a plain string)
