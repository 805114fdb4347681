"""Constraints through the server (``prefix``, ``ban``, ``require`` on /v1/translate, /v1/generate
and /v1/audio/transcriptions; ``terms`` on /v1/translate), in-process with the real app and tiny
random models: every output obeys its constraints and equals what the library's job function
gives for them; without constraints an output is unchanged; a request that cannot be honoured
is a 422 naming what is wrong, never a 500."""

from __future__ import annotations

import re

import pytest

from qkv.bundle import TranscriptionOptions, generations, transcriptions, translations
from qkv.serve.audio import heard
from qkv.serve.models import load_served
from qkv.serve.settings import Settings
from serving import app_client, tiny_audio_models, tiny_models, tone

LIMITS = Settings(max_chars=200, max_texts=4, max_new_tokens=40, max_beam=5, timeout_s=60)
TEXTS = ["Ein Hund läuft über die Wiese.", "Grüße aus 北京"]
SHORT = {"max_new_tokens": 8}
LENGTHS = {"max_len_a": 0.0, "max_len_b": 12}  # outputs of at most 12 tokens: room for the prefix and a word


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    paths = tiny_models(tmp_path_factory.mktemp("constrained_text"))
    audio = tiny_audio_models(tmp_path_factory.mktemp("constrained_audio"))
    return load_served([str(paths["de_en"]), str(paths["lm"]), str(audio["asr"])])


@pytest.fixture(scope="module")
def client(served):
    with app_client(served, LIMITS) as c:
        yield c


def starts_a_word(text: str, word: str) -> bool:
    """Whether ``text`` writes ``word`` where a word starts: what a ban keeps out, and what a
    requirement puts in (its tokens as the tokenizer writes the word after a space or at the start)."""
    return re.search(r"(?<!\w)" + re.escape(word), text) is not None


def word_start(texts: list[str], n: int, *, keep: list[str]) -> str:
    """The first n letters of a word ``texts`` write, which start none of the words in ``keep``
    (a ban that leaves the prefix and the required words possible); "W" where there is none."""
    starts = [w[:n] for text in texts for w in re.findall(r"\w+", text) if len(w) >= n]
    return next((s for s in starts if not any(word.startswith(s) for word in keep)), "W")


def translated(client, **body) -> list[str]:
    got = client.post("/v1/translate", json={"text": TEXTS, "beam_size": 3, **LENGTHS, **body})
    assert got.status_code == 200, got.text
    return [hyps[0]["text"] for hyps in got.json()["translations"]]


def test_translations_obey_their_constraints_and_are_the_librarys(client, served) -> None:
    plain = translated(client)
    assert translated(client, prefix=None, ban=[], require=[]) == plain  # no constraints: unchanged
    assert plain == [h[0].text for h in translations(served["de_en"].bundle, TEXTS, beam_size=3, **LENGTHS)]
    banned = word_start(plain, 2, keep=["A", "dog", "Hund"])  # a word start the unconstrained outputs write
    constraints = {"prefix": "A dog", "ban": [banned], "require": ["Hund"]}
    steered = translated(client, **constraints)
    library = translations(served["de_en"].bundle, TEXTS, beam_size=3, **LENGTHS, **constraints)
    assert steered == [h[0].text for h in library]
    for text in steered:
        assert text.startswith("A dog") and starts_a_word(text[len("A dog") :], "Hund")
        assert not starts_a_word(text[len("A dog") :], banned)
    assert steered != plain


def test_terms_are_required_only_where_their_source_appears(client, served) -> None:
    """``terms``, as ``qkv translate --terms FILE``: a target is written in the output of the
    sentence that holds its source, and the other sentence is translated as without terms."""
    plain = translated(client)
    terms = [["Hund", "dog"], ["Katze", "cat"]]  # the first text holds "Hund"; neither holds "Katze"
    steered = translated(client, terms=terms)
    library = translations(served["de_en"].bundle, TEXTS, beam_size=3, **LENGTHS, terms=[tuple(t) for t in terms])
    assert steered == [h[0].text for h in library]
    assert starts_a_word(steered[0], "dog") and not starts_a_word(plain[0], "dog")
    assert not starts_a_word(steered[0], "cat")
    assert steered[1] == plain[1]  # no source of a term in it: nothing required


def test_generations_obey_their_constraints_and_are_the_librarys(client, served) -> None:
    body = {"prompt": "Hund", "max_new_tokens": 8}
    plain = client.post("/v1/generate", json=body).json()
    assert client.post("/v1/generate", json={**body, "ban": [], "require": []}).json() == plain
    banned = word_start([plain["text"]], 1, keep=["A", "dog"])
    constraints = {"prefix": " A ", "ban": [banned], "require": ["dog"]}
    got = client.post("/v1/generate", json={**body, **constraints, "beam_size": 4})
    assert got.status_code == 200, got.text
    text = got.json()["text"]
    assert text.startswith(" A ") and starts_a_word(text[3:], "dog") and not starts_a_word(text[3:], banned)
    (want,) = generations(served["lm"].bundle, [body["prompt"]], max_new_tokens=8, beam_size=4, **constraints)
    assert got.json()["tokens"] == len(want[0].tokens)
    drawn = client.post("/v1/generate", json={**body, "ban": [banned], "top_k": 5, "seed": 3}).json()["text"]
    assert not starts_a_word(drawn, banned)  # sampling obeys bans too


def test_transcripts_obey_their_constraints_and_are_the_librarys(client, served) -> None:
    audio = {"file": ("tone.wav", tone(0.5), "audio/wav")}
    wave = heard(tone(0.5), "tone.wav", served["asr"], LIMITS)  # the upload as the server reads it
    bundle = served["asr"].bundle
    plain = client.post("/v1/audio/transcriptions", files=audio, data={"model": "asr", "ban": []})
    assert plain.status_code == 200, plain.text
    assert plain.json()["text"] == transcriptions(bundle, [wave])[0].text  # no constraints: unchanged
    constraints = {"prefix": "a", "ban": ["mi", "re"], "require": ["dog"]}
    got = client.post("/v1/audio/transcriptions", files=audio, data={"model": "asr", **constraints})
    assert got.status_code == 200, got.text
    text = got.json()["text"]
    assert text.startswith("a") and starts_a_word(text[1:], "dog")
    assert not starts_a_word(text, "mi") and not starts_a_word(text, "re")
    assert text == transcriptions(bundle, [wave], TranscriptionOptions(**constraints))[0].text


@pytest.mark.parametrize(
    ("path", "body", "said"),
    [
        ("/v1/translate", {"text": "Hund", "beam_size": 1, "require": ["dog"]}, "require needs beam search"),
        ("/v1/translate", {"text": "Hund", "ban": ["a"] * 17}, "ban"),
        ("/v1/translate", {"text": "Hund", "ban": ["a" * 101]}, "ban"),
        ("/v1/translate", {"text": "Hund", "ban": ["  "]}, "blank"),
        ("/v1/translate", {"text": "Hund", "ban": "dog"}, "ban"),
        ("/v1/translate", {"text": "Hund", "prefix": ""}, "prefix"),
        ("/v1/translate", {"text": "Hund", "prefix": "A dog", "ban": ["do"]}, "writes the banned word"),
        ("/v1/translate", {"text": "Hund", "ban": ["dog"], "require": ["dog"]}, "both banned and required"),
        ("/v1/translate", {"text": "Hund", "beam_size": 2, "require": ["Ωμέγα"]}, "cannot write"),
        ("/v1/translate", {"text": "Hund", "beam_size": 1, "terms": [["Hund", "dog"]]}, "terms needs beam search"),
        ("/v1/translate", {"text": "Hund", "terms": [["a", "b"]] * 65}, "at most 64"),
        ("/v1/translate", {"text": "Hund", "terms": [["Hund"]]}, "terms"),
        ("/v1/translate", {"text": "Hund", "terms": [["Hund", "dog", "cat"]]}, "terms"),
        ("/v1/translate", {"text": "Hund", "terms": [["Hund", " "]]}, "blank"),
        ("/v1/translate", {"text": "Hund", "terms": [["Hund", "a" * 101]]}, "terms"),
        ("/v1/translate", {"text": "Hund", "beam_size": 2, "terms": [["Hund", "Ωμέγα"]]}, "cannot write"),
        ("/v1/generate", {"prompt": "Hund", "prefix": "A dog runs on the grass", **SHORT}, "window"),
        ("/v1/generate", {"prompt": "Hund", "ban": ["a"], "stream": True, **SHORT}, "stream"),
        ("/v1/generate", {"prompt": "Hund", "require": ["a"], "beam_size": 3, "seed": 1, **SHORT}, "beam_size"),
        ("/v1/generate", {"prompt": "Hund", "require": ["a"], **SHORT}, "require needs beam search"),
        ("/v1/generate", {"prompt": " ", "prefix": "a", **SHORT}, "need a prompt"),
    ],
)
def test_constraints_that_cannot_be_honoured_are_422_naming_why(client, path, body, said) -> None:
    got = client.post(path, json=body)
    assert got.status_code == 422, got.text
    assert said in got.json()["error"]["message"]


def test_a_term_that_is_not_unicode_is_422(client) -> None:
    body = '{"text": "Hund", "beam_size": 2, "terms": [["Hund", "\\ud800"]]}'  # JSON can carry a lone surrogate
    got = client.post("/v1/translate", content=body, headers={"content-type": "application/json"})
    assert got.status_code == 422, got.text
    assert got.json()["error"]["message"].startswith("terms.0.1: ")  # the pair and the side named


@pytest.mark.parametrize(
    ("data", "said"),
    [({"ban": [" "]}, "blank"), ({"require": ["a"] * 17}, "require"), ({"prefix": "a" * 501}, "prefix")],
)
def test_transcription_constraints_are_bounded(client, data, said) -> None:
    audio = {"file": ("tone.wav", tone(0.5), "audio/wav")}
    got = client.post("/v1/audio/transcriptions", files=audio, data={"model": "asr", **data})
    assert got.status_code == 422, got.text
    assert said in got.json()["error"]["message"]
