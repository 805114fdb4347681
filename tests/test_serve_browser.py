"""The page at ``/`` in a real browser: Playwright (the Python package) driving Chromium headless
(Debian's ``chromium``, which ``scripts/setup.sh`` installs as root with apt; Playwright's own
browser download is not used). Against a real ``qkv serve`` of a tiny trained numbers model and
a tiny language model: translate, check the heatmaps against the API's maps (rows, columns,
values), switch layer and head, hover tokens both ways, read the beam trace, stream a
generation in German and Chinese, fit a phone's width, and save a screenshot (under pytest's
temporary directory; ``QKV_SCREENSHOT=FILE`` copies it there too).

Skipped, saying why, where Playwright or Chromium is missing; CI installs both.
"""

from __future__ import annotations

import contextlib
import io
import os
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
    page.get_by_label("Model").select_option("numbers")
    page.get_by_label("Text").fill(text)
    page.get_by_label("Beam size").fill(str(beam))
    page.get_by_role("button", name="Run").click()
    page.wait_for_selector('table.heatmap[data-part="cross"]')
    body = {"model": "numbers", "text": text, "beam_size": beam, "length_penalty": 1.0, "trace": True}
    return httpx.post(f"{site.url}/v1/attention", json=body, timeout=30).json()


def _values(page, selector: str, attribute: str) -> list[float]:
    return page.eval_on_selector_all(selector, f"nodes => nodes.map(n => Number(n.dataset.{attribute}))")


def test_translate_and_see_every_attention_map(site, browser, tmp_path):
    page = _open(browser, site)
    view = _translate(page, site, "52,017", beam=3)
    translations = httpx.post(f"{site.url}/v1/translate", json={"text": "52,017", "beam_size": 3, "nbest": 3}).json()
    shown = page.locator("#output .nbest li .text").all_text_contents()
    assert shown == [h["text"] for h in translations["translations"][0]]
    best = translations["translations"][0][0]
    assert page.locator("#output .nbest li .score").first.text_content() == f"{best['score']:.4f}"

    # Three kinds side by side, each a token-by-token heatmap of the right size.
    assert [f.get_attribute("data-part") for f in page.locator("figure.panel").all()] == ["encoder", "decoder", "cross"]
    s, t = len(view["source_tokens"]), len(view["predicted_tokens"])
    for part, rows, cols in (("encoder", s, s), ("decoder", t, t), ("cross", t, s)):
        table = page.locator(f'table.heatmap[data-part="{part}"]')
        assert table.locator("tbody tr").count() == rows
        assert table.locator("thead th[scope=col]").count() == cols
    cross = 'table.heatmap[data-part="cross"] tbody tr:first-child td'
    assert _values(page, cross, "w") == pytest.approx(view["cross"][-1][0][0], abs=2e-4)  # last layer, head 1

    # Another layer and head: the cells are that map's.
    page.get_by_label("Layer").select_option(label="1 of 2")
    page.get_by_label("Head").select_option(label="3")
    assert _values(page, cross, "w") == pytest.approx(view["cross"][0][2][0], abs=2e-4)
    assert "layer 1, head 3" in page.locator('figure[data-part="cross"] figcaption').text_content()
    page.get_by_label("Head").select_option(label="All heads")
    assert page.locator('figure[data-part="cross"] table.heatmap.small').count() == view["heads"] == 3
    page.get_by_label("Head").select_option(label="1")

    # Hover an output token: the source tokens light up by its cross-attention; and the reverse.
    page.locator('.tok[data-side="output"][data-i="1"]').hover()
    assert _values(page, '.tok[data-side="source"]', "weight") == pytest.approx(view["cross"][0][0][1], abs=2e-4)
    assert "focus" in page.locator('.tok[data-side="output"][data-i="1"]').get_attribute("class")
    page.locator('.tok[data-side="source"][data-i="0"]').hover()
    column = [row[0] for row in view["cross"][0][0]]
    assert _values(page, '.tok[data-side="output"]', "weight") == pytest.approx(column, abs=2e-4)
    page.locator('table.heatmap[data-part="cross"] tbody th[data-r="2"]').hover()  # a row of the map: the same
    assert _values(page, '.tok[data-side="source"]', "weight") == pytest.approx(view["cross"][0][0][2], abs=2e-4)

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
    chips = page.locator('.tok[data-side="output"]').all_text_contents()
    assert chips[: len(prompt)] == list(prompt)  # ü and 北京 as they were typed
    page.close()


def test_a_phone_width_and_labelled_controls(site, browser):
    page = _open(browser, site, width=390, height=844)
    _translate(page, site, "4,317", beam=2)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # wide maps scroll inside their panel
    boxes = [f.bounding_box() for f in page.locator("figure.panel").all()]
    assert len({round(b["x"]) for b in boxes}) == 1  # stacked, not side by side
    unlabelled = page.evaluate(
        """() => [...document.querySelectorAll("select, input, textarea, button")]
        .filter((e) => !e.closest("[hidden]") && !(e.labels && e.labels.length) && !e.getAttribute("aria-label")
                       && !(e.tagName === "BUTTON" && e.textContent.trim()))
        .map((e) => e.id)"""
    )
    assert unlabelled == []
    page.close()
