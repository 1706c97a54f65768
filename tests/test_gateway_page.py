"""The chat page at / in a real headless Chromium (Debian's chromium + chromium-driver, driven
by Selenium) against the session's gateway and tritonserver: it loads, takes an image from the
file picker, streams the answer with TTFT and tokens/s, takes a dropped image for a second
turn, and each answer equals the openai package's for the same conversation. It writes a
screenshot (its path is printed). `make test` installs the browser where apt-get runs as root;
elsewhere this test skips."""

from __future__ import annotations

import base64
import shutil

import pytest
from test_serve_server import png

from qvl_trt.triton import contract as c

openai = pytest.importorskip("openai", reason="the expected answers come from the openai "
                             "package: pip install openai")

MAX_TOKENS = 16
DROP = """
const [data, name] = arguments;
const bytes = Uint8Array.from(atob(data), (ch) => ch.charCodeAt(0));
const files = new DataTransfer();
files.items.add(new File([bytes], name, {type: "image/png"}));
document.getElementById("drop").dispatchEvent(
    new DragEvent("drop", {dataTransfer: files, bubbles: true, cancelable: true}));
"""


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("needs Chromium and its driver: apt-get install chromium chromium-driver "
                    "(`make test` installs them where apt-get runs as root)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium: pip install "
                                    "selenium")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1100,900"):
        options.add_argument(arg)
    # The Debian driver by path: Selenium Manager would otherwise try to download one.
    session = webdriver.Chrome(options=options,
                               service=webdriver.ChromeService(executable_path=driver))
    yield session
    session.quit()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def test_the_chat_page_streams_answers_about_a_picked_and_a_dropped_image(
        gateway, browser, tmp_path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    first, second = png(30, (96, 64)), png(31, (64, 96))
    path = tmp_path / "picture.png"
    path.write_bytes(first)
    wait = WebDriverWait(browser, 120)

    browser.get(gateway.url + "/")
    assert browser.title == "qvl-trt chat"
    wait.until(ec.text_to_be_present_in_element((By.ID, "status"), "ready"))
    assert browser.find_element(By.ID, "model").get_attribute("value") == c.ENSEMBLE
    limit = browser.find_element(By.ID, "max-tokens")
    limit.clear()
    limit.send_keys(str(MAX_TOKENS))

    def ask(question: str) -> tuple[str, str]:
        browser.find_element(By.ID, "question").send_keys(question)
        browser.find_element(By.ID, "send").click()
        answer = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant")[-1]
        wait.until(lambda _: answer.get_attribute("data-state") != "streaming")
        assert answer.get_attribute("data-state") == "done", answer.text
        return (answer.find_element(By.CLASS_NAME, "text").get_property("textContent"),
                answer.find_element(By.CLASS_NAME, "stats").text)

    browser.find_element(By.ID, "file").send_keys(str(path))
    wait.until(lambda _: browser.find_elements(By.CSS_SELECTOR, "#thumbs img"))
    text1, stats1 = ask("What is in this picture?")

    api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(first)}},
        {"type": "text", "text": "What is in this picture?"}]}]
    want = api.chat.completions.create(model=c.ENSEMBLE, messages=messages,
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert text1 == want.choices[0].message.content
    assert stats1.startswith("TTFT ") and " tokens/s" in stats1
    assert stats1.endswith(f"{want.usage.completion_tokens} tokens")

    browser.execute_script(DROP, base64.b64encode(second).decode(), "dropped.png")
    wait.until(lambda _: browser.find_elements(By.CSS_SELECTOR, "#thumbs img"))
    text2, _ = ask("And this one?")
    messages += [{"role": "assistant", "content": text1}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(second)}},
        {"type": "text", "text": "And this one?"}]}]
    assert text2 == api.chat.completions.create(
        model=c.ENSEMBLE, messages=messages, max_tokens=MAX_TOKENS,
        temperature=0).choices[0].message.content
    assert len(browser.find_elements(By.CSS_SELECTOR, ".turn.user img")) == 2

    shot = tmp_path / "chat_page.png"
    assert browser.save_screenshot(str(shot))
    print(f"screenshot of the chat page: {shot}")


def test_the_page_asks_a_keyed_server_for_its_key_once(triton_server, browser,
                                                       tmp_path) -> None:
    """Against a gateway with a tenant's key from a keys file: the page's first call gets
    401, it asks for the key (a prompt), then lists the models and says ready; a question is
    answered without asking again, and counted for the tenant."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from qvl_trt.gateway import metrics as gm
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.gateway.tenants import add_key
    from qvl_trt.serve.gateway_process import GatewayProcess
    from qvl_trt.serve.progress import read_metrics, total
    from qvl_trt.serve.server import free_ports

    key, _ = add_key(tmp_path / "keys.json", "page-team")
    opts = GatewayOptions(triton_server.grpc_url, port=free_ports().http,
                          keys_file=tmp_path / "keys.json")
    with GatewayProcess(opts, log_file=tmp_path / "gateway.log") as keyed:
        keyed.wait_ready()
        wait = WebDriverWait(browser, 120)
        browser.get(keyed.url + "/")
        prompt = wait.until(ec.alert_is_present())
        assert "API key" in prompt.text
        prompt.send_keys(key)
        prompt.accept()
        wait.until(ec.text_to_be_present_in_element((By.ID, "status"), "ready"))
        assert browser.find_element(By.ID, "model").get_attribute("value") == c.ENSEMBLE
        browser.find_element(By.ID, "question").send_keys("Count.")
        browser.find_element(By.ID, "send").click()
        answer = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant")[-1]
        wait.until(lambda _: answer.get_attribute("data-state") != "streaming")
        assert answer.get_attribute("data-state") == "done", answer.text
        assert total(read_metrics(f"{keyed.url}/metrics", timeout_s=10), gm.REQUESTS,
                     tenant="page-team", status="200") == 1
