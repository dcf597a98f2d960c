"""The chat page (serving/web/) in a real browser: headless Chromium driven by selenium, against serve.py on
127.0.0.1 with an API key, on a tiny character model trained here to answer "hello" with an HTML
payload, so that the model's own text tests that nothing it says is run as HTML.

One server and one browser for the module; each test opens the page afresh with its own saved
state. The screenshot in docs/ comes from the same browser: `PYTHONPATH=. python tests/test_web.py OUT_DIR PNG`.
"""

import json
import os
import re
import signal
import string
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import openai
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait
from test_serve import ROOT, free_port
from test_train import small_config

import train
from data import chat_template, tokenizer

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip(
        "no Chromium: `apt-get install chromium chromium-driver` (Debian) runs the chat page's tests",
        allow_module_level=True,
    )

KEY = "test-key-0123"
PAYLOAD = "<img src=x onerror=window.pwned=1>"
PHRASE = f"USER: hello\n\nASSISTANT: {PAYLOAD}\n\n"  # the default chat template's shape
CHARS = "".join(sorted(set(PHRASE + string.ascii_letters + " .,!?'")))
TOK = tokenizer.CharTokenizer(CHARS)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-layer model with a context of 128 that has learnt PHRASE by heart."""
    root = tmp_path_factory.mktemp("web")
    data = root / "data" / "toy"
    data.mkdir(parents=True)
    ids = np.array(TOK.encode(PHRASE * 400), np.uint16)
    ids.tofile(data / "train.bin")
    ids[:2_000].tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"kind": "char", "chars": CHARS, "vocab_size": len(CHARS)}))
    config = small_config(
        root,
        block_size=128,
        max_iters=300,
        eval_interval=300,
        learning_rate=2e-2,
        warmup_iters=5,
        lr_decay_iters=300,
        min_lr=1e-3,
        log_interval=100,
    )
    train.train(config, jax.devices()[:1])
    return config.out_dir


def start_server(out_dir, log_path, env=None) -> tuple[str, subprocess.Popen]:
    """serve.py on a free port of 127.0.0.1, its output in log_path; returns once /health is 200."""
    port = free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "serve.py"),
                f"--out_dir={out_dir}",
                f"--port={port}",
                "--slots=2",
                "--log_interval=0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        try:
            if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                return url, process
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 while compiling
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"serve.py did not start:\n{open(log_path).read()}")


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    """(url, its log's path); the key comes from the environment variable."""
    log_path = tmp_path_factory.mktemp("server") / "serve.log"
    url, process = start_server(run, log_path, env={"NANOMAX_API_KEY": KEY})
    yield url, log_path
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def start_browser(width=1100, height=800) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(flag)
    # the console (for errors) and the network log (for what the page sent)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


@pytest.fixture(scope="module")
def browser():
    driver = start_browser()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


# ----------------------------------------------------------------------------- driving the page


def wait(browser, condition, seconds=60):
    # The page re-renders its messages as tokens arrive: an element read mid-render is stale; look again.
    return WebDriverWait(
        browser, seconds, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)
    ).until(lambda _: condition())


def open_page(browser, url, settings=None, mode=None, messages=()):
    """The page afresh with this state saved in its localStorage, once it has asked for the model."""
    browser.get(url)
    state = {
        "settings": {"temperature": "0", "top_k": "0", "top_p": "1", **(settings or {})},
        "mode": mode or "",
        "messages": list(messages),
    }
    browser.execute_script("localStorage.setItem('nanomax', arguments[0])", json.dumps(state))
    browser.refresh()
    wait(browser, lambda: text(browser, "#model") != "connecting…")
    browser.get_log("browser"), browser.get_log("performance")  # this test's logs start now


def text(browser, css) -> str:
    """An element's text as the page holds it (Selenium's .text trims the spaces an answer starts with)."""
    return browser.find_element(By.CSS_SELECTOR, css).get_property("textContent")


def texts(browser, css) -> list[str]:
    return [e.get_property("textContent") for e in browser.find_elements(By.CSS_SELECTOR, css)]


def say(browser, message):
    browser.find_element(By.ID, "input").send_keys(message + "\n")  # Enter sends


def answered(browser, count):
    """Waits until `count` assistant messages have their line under them and nothing is running."""
    wait(
        browser,
        lambda: (
            text(browser, "#error")
            or len(texts(browser, ".assistant .meta")) == count
            and not browser.find_element(By.ID, "stop").is_displayed()
        ),
    )
    assert text(browser, "#error") == ""


def sent(browser, path) -> list[dict]:
    """The JSON bodies the page POSTed to `path`, from Chrome's network log."""
    bodies = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        request = message.get("params", {}).get("request", {})
        if message["method"] == "Network.requestWillBeSent" and request.get("url", "").endswith(path):
            bodies.append(json.loads(request["postData"]))
    return bodies


def console_errors(browser) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def html_stayed_text(browser):
    """No <img> was made from the payload and its onerror never ran."""
    assert browser.find_elements(By.TAG_NAME, "img") == []
    assert browser.execute_script("return window.pwned") is None


def greedy_chat(client, messages, max_tokens) -> str:
    return (
        client.chat.completions.create(
            model="out", messages=messages, max_tokens=max_tokens, temperature=0, top_p=1, extra_body={"top_k": 0}
        )
        .choices[0]
        .message.content
    )


# ----------------------------------------------------------------------------- tests


def test_without_the_key_the_page_shows_the_401_and_with_it_works(browser, server):
    url, _ = server
    open_page(browser, url)
    assert text(browser, "#model") == "not connected"
    assert text(browser, "#error").startswith("error 401: missing or wrong API key")
    browser.find_element(By.ID, "api_key").send_keys(KEY + "\t")  # asked once: it is saved with the page
    wait(browser, lambda: text(browser, "#model") == "out (context 128 tokens)")
    assert not browser.find_element(By.ID, "error").is_displayed()
    # A model without a chat template: the page offers to continue text
    assert browser.find_element(By.ID, "mode").get_property("value") == "complete"
    browser.refresh()  # the key was kept
    wait(browser, lambda: text(browser, "#model") == "out (context 128 tokens)")
    assert console_errors(browser) == []


def test_the_openai_client_needs_the_key(server, client):
    url, _ = server
    assert client.completions.create(model="out", prompt="hello", max_tokens=3).usage.completion_tokens == 3
    stranger = openai.OpenAI(base_url=url + "/v1", api_key="wrong-key", max_retries=0, timeout=60)
    for call in (
        lambda: stranger.models.list(),
        lambda: stranger.chat.completions.create(model="out", messages=[{"role": "user", "content": "hi"}]),
    ):
        with pytest.raises(openai.AuthenticationError) as refused:
            call()
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert urllib.request.urlopen(url + "/").status == 200  # the page and /health need no key
    assert urllib.request.urlopen(url + "/health").status == 200


def test_a_typed_message_streams_the_greedy_answer_and_html_stays_text(browser, server, client):
    open_page(browser, server[0], {"api_key": KEY, "max_tokens": "40"}, mode="chat")
    browser.execute_script("""  // every text the answer shows while it streams in
        window.seen = [];
        const list = document.getElementById("messages");
        new MutationObserver(() => {
          const answer = list.querySelector(".assistant:last-child .content");
          if (answer) window.seen.push(answer.textContent);
        }).observe(list, {childList: true, subtree: true, characterData: true});""")
    say(browser, "hello")
    answered(browser, 1)
    expected = greedy_chat(client, [{"role": "user", "content": "hello"}], 40)
    assert PAYLOAD in expected  # the model answers with HTML...
    assert texts(browser, ".message .content") == ["hello", expected]  # ...which the page shows as text
    html_stayed_text(browser)
    seen = [s for s in browser.execute_script("return window.seen") if s]
    assert len(set(seen)) > 1 and all(expected.startswith(s) for s in seen)  # it came in pieces
    assert re.fullmatch(r"40 tokens, [\d.]+ tokens/s, finish: length", text(browser, ".assistant .meta"))
    body = sent(browser, "/v1/chat/completions")[0]  # the side bar's settings went with it
    assert body["messages"] == [{"role": "user", "content": "hello"}] and body["stream"] is True
    assert (body["temperature"], body["top_k"], body["top_p"], body["max_tokens"]) == (0, 0, 1, 40)
    browser.refresh()  # the conversation outlives a reload
    wait(browser, lambda: texts(browser, ".message .content") == ["hello", expected])
    assert console_errors(browser) == []


def test_stop_mid_answer_then_the_next_message_is_served(browser, server, client):
    url, _ = server
    health = lambda: json.loads(urllib.request.urlopen(url + "/health").read())
    aborted = health()["aborted"]
    open_page(browser, url, {"api_key": KEY, "max_tokens": "100"}, mode="chat")
    browser.execute_script("""  // Stop as soon as the first words show
        const list = document.getElementById("messages");
        new MutationObserver((changes, observer) => {
          const answer = list.querySelector(".assistant:last-child .content");
          if (answer && answer.textContent) {
            observer.disconnect();
            document.getElementById("stop").click();
          }
        }).observe(list, {childList: true, subtree: true, characterData: true});""")
    say(browser, "hello")
    answered(browser, 1)
    full = greedy_chat(client, [{"role": "user", "content": "hello"}], 100)
    partial = texts(browser, ".assistant .content")[0]
    assert text(browser, ".assistant .meta") == "stopped"
    assert partial and full.startswith(partial) and len(partial) < len(full)
    wait(browser, lambda: health()["aborted"] > aborted and health()["busy"] == 0)  # the server let go of it
    max_tokens = browser.find_element(By.ID, "max_tokens")
    max_tokens.clear()
    max_tokens.send_keys("5\t")
    say(browser, "hello")
    answered(browser, 2)
    assert texts(browser, ".assistant .meta")[1].startswith("5 tokens")
    assert console_errors(browser) == []


def test_regenerate_and_edit_send_the_conversation_up_to_there(browser, server):
    url, log_path = server
    logged = lambda: [int(n) for n in re.findall(r"^request \S+: (\d+) prompt", log_path.read_text(), re.M)]
    open_page(browser, url, {"api_key": KEY, "max_tokens": "6", "system": "be brief"}, mode="chat")
    say(browser, "hello")
    answered(browser, 1)
    say(browser, "and you")
    answered(browser, 2)
    first_answer = texts(browser, ".assistant .content")[0]
    sent(browser, "/v1/chat/completions")  # from here on

    browser.find_element(By.XPATH, "//button[text()='Regenerate']").click()
    answered(browser, 2)
    edits = browser.find_elements(By.XPATH, "//button[text()='Edit']")
    edits[1].click()  # the second user message: everything after it goes
    box = browser.find_element(By.CSS_SELECTOR, "textarea.edit")
    box.clear()
    box.send_keys(PAYLOAD)
    browser.find_element(By.XPATH, "//button[text()='Save and answer']").click()
    answered(browser, 2)

    start = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first_answer},
    ]
    expected = [start + [{"role": "user", "content": "and you"}], start + [{"role": "user", "content": PAYLOAD}]]
    assert [body["messages"] for body in sent(browser, "/v1/chat/completions")] == expected
    # The server's request log agrees (its last two lines): each prompt is that conversation's
    # rendering, token for token. A line is written just after the stream's end: wait for it.
    lengths = [len(TOK.encode(chat_template.render(TOK, messages))) for messages in expected]
    wait(browser, lambda: logged()[-2:] == lengths, seconds=10)
    assert texts(browser, ".user .content") == ["hello", PAYLOAD]  # the user's HTML is text too
    html_stayed_text(browser)
    assert console_errors(browser) == []


def test_completion_mode_continues_the_text_and_html_stays_text(browser, server, client):
    open_page(browser, server[0], {"api_key": KEY, "max_tokens": "30"}, mode="chat")
    Select(browser.find_element(By.ID, "mode")).select_by_value("complete")  # either mode can be chosen
    browser.find_element(By.ID, "prompt").send_keys(PAYLOAD)
    browser.find_element(By.ID, "continue").click()
    wait(browser, lambda: text(browser, "#output-meta"))
    expected = (
        client.completions.create(
            model="out", prompt=PAYLOAD, max_tokens=30, temperature=0, top_p=1, extra_body={"top_k": 0}
        )
        .choices[0]
        .text
    )
    assert (text(browser, "#output-prompt"), text(browser, "#output-text")) == (PAYLOAD, expected)
    assert text(browser, "#output-meta").endswith("finish: length")
    html_stayed_text(browser)
    assert console_errors(browser) == []


def test_a_server_error_shows_its_message(browser, server):
    open_page(browser, server[0], {"api_key": KEY}, mode="chat")
    say(browser, "a snowman: \u2603")  # not in the model's vocabulary: a 400
    wait(browser, lambda: browser.find_element(By.ID, "error").is_displayed())
    assert text(browser, "#error").startswith("error 400: the prompt can't be encoded with this model's vocabulary")
    assert texts(browser, ".message .content") == ["a snowman: \u2603"]  # kept, to be answered again
    assert [e for e in console_errors(browser) if "status of 400" not in e] == []


# ----------------------------------------------------------------------------- the README's screenshot


def screenshot(out_dir, png, prompt="ROMEO:"):
    """The page continuing `prompt` with the model in out_dir, as a PNG."""
    log_path = os.path.join(tempfile.mkdtemp(), "serve.log")
    url, process = start_server(out_dir, log_path)
    driver = start_browser(1000, 700)
    try:
        open_page(driver, url, {"temperature": "0.8", "max_tokens": "120"})
        driver.find_element(By.ID, "prompt").send_keys(prompt)
        driver.find_element(By.ID, "continue").click()
        wait(driver, lambda: text(driver, "#output-meta"))
        driver.save_screenshot(png)
    finally:
        driver.quit()
        process.send_signal(signal.SIGTERM)
        process.wait()


if __name__ == "__main__":
    screenshot(*sys.argv[1:3])
