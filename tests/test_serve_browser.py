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

Skipped, saying why, where Playwright or Chromium is missing; CI installs both.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from qkv.cli.main import main
from serving import Server, tiny_models

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")

CHROMIUM = next(
    (p for p in (os.environ.get("QKV_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")) if p),
    None,
)
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


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    models = tiny_models(root)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", RECIPE, "--out", str(root / "numbers"), "--quiet", *TINY]) == 0
    server = Server([root / "numbers", models["lm"]], cwd=root)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-background-networking"]
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
