"""The page's speech, speech-out and chat views in a real browser (Playwright driving Chromium, as
tests/test_serve_browser.py), and the routes they draw from (``/v1/audio/attention``,
``/v1/audio/speech/attention``, ``/v1/chat/attention``), against one real ``qkv serve`` of tiny
random models: a recognizer and a Transformer-TTS of qkv's own, and a language model with a chat
template. One browser for all three views; Chromium's fake microphone plays a WAV file (an FSDD
recording where ``QKV_DATA`` has one, else a tone).

What is proven: an uploaded file's transcript on the page is the API's, with its segments and a
segment's cross-attention drawn to the size the API gives; a recording from the microphone is
transcribed as the API transcribes the WAV the page recorded; a spoken sentence loads in the
``<audio>`` element with the WAV's duration (within a frame) and its cross-attention is drawn;
a streamed chat answer is the API's whole greedy answer, arrived in pieces, and clicking an
answer token shades the conversation by the API's weights; nothing is wider than a phone.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile

from serving import CHARACTERS, Server, tiny_audio_models, tone

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")

CHROMIUM = next(
    (p for p in (os.environ.get("QKV_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")) if p),
    None,
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium to drive: apt-get install chromium (scripts/setup.sh does as root), or set QKV_CHROMIUM",
)
DATA = Path(os.environ.get("QKV_DATA", "/work/shared/data"))
FSDD = DATA / "fsdd" / "recordings" / "0_george_0.wav"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from qkv.tokenization import FILE, Tokenizer
    from test_openai_api import TEMPLATE, tiny_lm

    root = tmp_path_factory.mktemp("views")
    models = tiny_audio_models(root)
    chat_root = root / "chat"
    chat_root.mkdir()
    tokenizer = Tokenizer.train_char_level([CHARACTERS + "abcdefghijklmnopqrstuvwxyz:|?_"])
    tokenizer.save(chat_root / FILE)
    talk = tiny_lm(chat_root, "talk", tokenizer, seed=0, template=TEMPLATE)
    server = Server([models["asr"], models["tts"], talk], cwd=root)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def heard_wav(tmp_path_factory) -> Path:
    """What the fake microphone plays and the upload sends: a spoken digit, else a rising tone."""
    path = tmp_path_factory.mktemp("mic") / "heard.wav"
    if FSDD.is_file():
        shutil.copyfile(FSDD, path)
    else:
        path.write_bytes(tone(0.6))
    return path


@pytest.fixture(scope="module")
def browser(heard_wav):
    fake = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
    args = ["--no-sandbox", "--disable-background-networking", "--autoplay-policy=no-user-gesture-required"]
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[*args, *fake, f"--use-file-for-fake-audio-capture={heard_wav}"],
        )
        yield chromium
        chromium.close()


def _open(browser, site, model: str, **viewport):
    page = browser.new_page(viewport=viewport or {"width": 1280, "height": 900})
    page.goto(f"{site.url}/")
    page.wait_for_selector("#model option", state="attached")
    page.get_by_label("Model").select_option(model)
    return page


def _verbose(site, data: bytes) -> dict:
    files = {"file": ("heard.wav", data)}
    form = {"model": "asr", "response_format": "verbose_json"}
    return httpx.post(f"{site.url}/v1/audio/transcriptions", files=files, data=form, timeout=60).json()


def _shown(x: float) -> str:
    text = f"{x:.4f}"
    return text.lstrip("-") if float(text) == 0 else text


def _pretty(token: str) -> str:
    """A token as the page shows it: byte-level BPE's and SentencePiece's space marks as spaces."""
    return token.replace("Ġ", " ").replace("▁", " ").replace("Ċ", "⏎")


def _no_overflow(page) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") <= page.viewport_size["width"]


def test_speech_in_upload_and_microphone(site, browser, heard_wav):
    page = _open(browser, site, "asr")
    assert page.locator("#view-speech").is_visible() and not page.locator("#view-text").is_visible()
    page.set_input_files("#speech-file", str(heard_wav))
    page.wait_for_selector('#transcript[data-done="true"]')
    api = _verbose(site, heard_wav.read_bytes())
    assert api["text"] and page.locator("#transcript").text_content() == api["text"]
    shown = page.locator("#segments .segment")
    assert shown.count() == len(api["segments"])
    segment = api["segments"][0]
    assert float(shown.first.get_attribute("data-end")) == segment["end"]

    # The segment's cross-attention over its spectrogram, as /v1/audio/attention gives it.
    page.wait_for_selector("#speech-figure:not([hidden]) canvas")
    form = {"model": "asr", "start": str(segment["start"]), "end": str(segment["end"])}
    form["tokens"] = ",".join(map(str, segment["tokens"]))
    files = {"file": ("heard.wav", heard_wav.read_bytes())}
    view = httpx.post(f"{site.url}/v1/audio/attention", files=files, data=form, timeout=60).json()
    holder = page.locator("#speech-figure .time-canvas")
    assert holder.get_attribute("data-rows") == str(len(view["tokens"])) == str(len(view["cross"][-1][0]))
    assert holder.get_attribute("data-cols") == str(len(view["cross"][-1][0][0]))
    assert holder.get_attribute("data-frames") == str(len(view["mel"]))
    page.locator("#speech-head").select_option("0")
    assert holder.get_attribute("data-top") == _shown(max(max(row) for row in view["cross"][-1][0]))
    shown.first.click()  # plays the stretch
    page.wait_for_function("document.getElementById('speech-audio').readyState >= 1")
    duration = page.evaluate("document.getElementById('speech-audio').duration")
    assert abs(duration - soundfile.info(str(heard_wav)).duration) < 0.01

    # The microphone (Chromium plays the same file into it): the page's recording, transcribed.
    page.get_by_role("button", name="Record").click()
    page.wait_for_timeout(1200)
    page.get_by_role("button", name="Stop").click()
    page.wait_for_selector('#transcript[data-done="true"]')
    recorded = base64.b64decode(
        page.evaluate(
            """async () => { const b = await (await fetch(document.getElementById('speech-audio').src)).arrayBuffer();
            let s = ''; for (const x of new Uint8Array(b)) s += String.fromCharCode(x); return btoa(s); }"""
        )
    )
    samples, rate = soundfile.read(io.BytesIO(recorded))
    assert len(samples) / rate > 0.5 and np.abs(samples).max() > 0.01  # sound came in, not silence
    assert page.locator("#transcript").text_content() == _verbose(site, recorded)["text"]
    page.close()


def test_speech_out_plays_the_wav_and_draws_its_attention(site, browser):
    page = _open(browser, site, "tts")
    text = "do re mi"
    page.get_by_label("Sentence to speak").fill(text)
    page.get_by_role("button", name="Speak").click()
    page.wait_for_function("document.getElementById('tts-audio').readyState >= 1")
    wav = httpx.post(f"{site.url}/v1/audio/speech", json={"model": "tts", "input": text}, timeout=60).content
    info = soundfile.info(io.BytesIO(wav))
    duration = page.evaluate("document.getElementById('tts-audio').duration")
    assert abs(duration - info.frames / info.samplerate) <= 160 / info.samplerate  # within a frame (hop 160)
    page.wait_for_selector("#tts-figure:not([hidden]) canvas")
    view = httpx.post(f"{site.url}/v1/audio/speech/attention", json={"model": "tts", "input": text}).json()
    holder = page.locator("#tts-figure .time-canvas")
    assert holder.get_attribute("data-rows") == str(len(view["tokens"][0])) == str(len(view["cross"][0][0][0]))
    assert holder.get_attribute("data-cols") == str(len(view["steps"])) == str(len(view["cross"][0][0]))
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)  # the figure is redrawn to the phone's width
    _no_overflow(page)
    assert page.locator("#tts-figure canvas").bounding_box()["width"] <= 390
    page.close()


def test_chat_streams_the_greedy_answer_and_shows_a_tokens_attention(site, browser):
    page = _open(browser, site, "talk", width=390, height=844)  # a phone
    page.get_by_role("tab", name="Chat").click()
    message = "Hello there, über 北京?"
    page.get_by_label("Your message").fill(message)
    page.get_by_label("Max tokens").fill("20")
    page.evaluate(
        """() => { window.pieces = 0;
        new MutationObserver(() => window.pieces++).observe(document.getElementById("conversation"),
          {subtree: true, childList: true, characterData: true}); }"""
    )
    page.get_by_role("button", name="Send").click()
    page.wait_for_selector('#answer[data-done="true"]')
    messages = [{"role": "user", "content": message}]
    body = {"model": "talk", "messages": messages, "max_tokens": 20, "temperature": 0}
    whole = httpx.post(f"{site.url}/v1/chat/completions", json=body, timeout=60).json()
    answer = whole["choices"][0]["message"]["content"]
    assert answer and page.locator("#answer").text_content() == answer
    assert page.evaluate("window.pieces") > 3  # streamed: the text arrived in pieces

    page.wait_for_selector("#chat-tokens button.tok")
    page.locator("#chat-tokens button.tok").nth(1).click()  # the answer's second token
    page.wait_for_selector('#chat-tokens[data-token="1"]')
    page.locator("#chat-head").select_option("0")
    view = httpx.post(
        f"{site.url}/v1/chat/attention", json={"model": "talk", "messages": messages, "answer": answer, "token": 1}
    ).json()
    expected = view["weights"][-1][0]
    assert len(expected) == view["row"] + 1 == view["answer_start"] + 1
    assert sum(expected) == pytest.approx(1, abs=1e-3)  # a softmax over what the step read
    chips = page.locator("#chat-tokens .tok")
    assert chips.all_text_contents() == [_pretty(t) for t in view["tokens"]]
    weights = page.eval_on_selector_all("#chat-tokens .tok", "nodes => nodes.map(n => n.dataset.weight ?? null)")
    assert weights == [_shown(w) for w in expected] + [None] * (len(view["tokens"]) - len(expected))
    _no_overflow(page)
    page.close()
