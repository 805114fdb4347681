"""Speech in and out of ``qkv serve`` through the ``openai`` Python client: ``/v1/audio/transcriptions``
and ``/v1/audio/translations`` (a recognizer and a speech translator of qkv's own, an imported
multilingual Whisper) answer what the library's ``transcribe`` gives, in every response format;
``/v1/audio/speech`` (qkv's own TTS, a Piper voice) answers the audio the library's ``speak``
makes; the limits (size 413, duration and text length 422, both numbers said), bad audio (400)
and the API key hold. One real ``qkv serve`` on a loopback port, tiny random-weight models."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
import torch

import qkv
from qkv.bundle import TranscriptionOptions, WhisperOptions, piper_speeches, speeches, transcriptions
from qkv.bundle.transcription import initial_prompt, longest_prompt
from qkv.checkpoint import save_model
from qkv.longform import LongForm
from qkv.serve.settings import Settings
from serving import LocalServer, Server, tiny_audio_models, tone

openai = pytest.importorskip("openai", reason="the audio API is tested with the openai client (pip install -e .[dev])")

KEY = "audio-test-key-0123456789"
MAX_SECONDS, MAX_MB, MAX_CHARS = 2, 1, 60


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    """qkv's own recognizer, translator and TTS; a random Piper voice; a multilingual Whisper
    imported from a random transformers checkpoint (its chunk: 1 s)."""
    pytest.importorskip("piper.espeakbridge", reason="pip install piper-tts (a Piper voice's phonemes)")
    pytest.importorskip("transformers", reason="an imported Whisper is built with transformers")
    from piper.phoneme_ids import DEFAULT_PHONEME_ID_MAP

    from qkv.hf.convert import import_hf
    from test_piper import tiny_voice
    from whisper_fixtures import hf_whisper

    root = tmp_path_factory.mktemp("audio")
    found = tiny_audio_models(root)
    piper_json = root / "voice.onnx.json"
    piper_json.write_text(json.dumps({"espeak": {"voice": "en-us"}, "phoneme_id_map": DEFAULT_PHONEME_ID_MAP}))
    found["voice"] = save_model(tiny_voice(n_symbols=256), root / "voice", files={"piper.json": piper_json})
    hf_whisper(root / "hf", multilingual=True)
    import_hf(root / "hf", root / "whisper")
    found["whisper"] = root / "whisper"
    (root / "tone.wav").write_bytes(tone(0.5))
    return found


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    limits = ["--max-audio-seconds", str(MAX_SECONDS), "--max-upload-mb", str(MAX_MB)]
    s = Server(
        list(paths.values()),
        "--api-key",
        KEY,
        *limits,
        "--max-speech-chars",
        str(MAX_CHARS),
        cwd=tmp_path_factory.mktemp("audio_server"),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def wav(paths) -> Path:
    return paths["asr"].parent / "tone.wav"


def test_transcriptions_in_every_format_are_the_librarys_transcript(client, paths, wav):
    expected = qkv.load(paths["asr"]).transcribe(wav)
    assert expected  # the tiny recognizer writes something: every format below has a text to hold

    def heard(response_format: str, **options):
        with wav.open("rb") as f:
            return client.audio.transcriptions.create(model="asr", file=f, response_format=response_format, **options)

    assert heard("json").text == expected
    assert heard("text") == expected
    assert heard("srt") == f"1\n00:00:00,000 --> 00:00:00,500\n{expected}\n"
    assert heard("vtt") == f"WEBVTT\n\n00:00:00.000 --> 00:00:00.500\n{expected}\n"
    verbose = heard("verbose_json", timestamp_granularities=["segment"])
    assert verbose.text == expected and verbose.duration == 0.5 and verbose.language is None
    (segment,) = verbose.segments
    assert (segment.start, segment.end, segment.text) == (0.0, 0.5, expected)


def test_requests_that_arrive_together_get_what_each_gets_alone(client, paths, wav):
    expected = qkv.load(paths["asr"]).transcribe(wav)
    found: list[str] = []

    def one() -> None:
        with wav.open("rb") as f:
            found.append(client.audio.transcriptions.create(model="asr", file=f).text)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert found == [expected] * 3


def test_translations_by_qkvs_own_translator_and_an_imported_whisper(client, paths, wav):
    with wav.open("rb") as f:
        assert client.audio.translations.create(model="st", file=f).text == qkv.load(paths["st"]).transcribe(wav)
    with wav.open("rb") as f, pytest.raises(openai.UnprocessableEntityError, match="audio/translations"):
        client.audio.translations.create(model="asr", file=f)  # a recognizer does not translate
    whisper = qkv.load(paths["whisper"])
    with wav.open("rb") as f:
        assert client.audio.translations.create(model="whisper", file=f).text == whisper.transcribe(
            wav,
            task="translate",
            timestamps=False,  # json: the text alone, no timestamp tokens
        )
    with wav.open("rb") as f:
        german = client.audio.transcriptions.create(
            model="whisper", file=f, language="de", response_format="verbose_json"
        )
    assert german.text == whisper.transcribe(wav, language="de") and german.language == "de"
    with wav.open("rb") as f, pytest.raises(openai.UnprocessableEntityError, match="knows en, de"):
        client.audio.transcriptions.create(model="whisper", file=f, language="fr")


def test_word_timestamps_are_the_librarys_words(client, paths, wav):
    """timestamp_granularities[]=word: verbose_json's words are the library's (without their
    leading space), segments only where asked for too; a model of qkv's own has none to give."""
    expected = qkv.load(paths["whisper"]).transcribe(wav, language="en", word_timestamps=True)
    words = [(w.word.strip(), round(w.start, 3), round(w.end, 3)) for s in expected.segments for w in s.words]
    assert words  # something to compare

    def verbose(model: str, granularities: list[str]):
        language = {"language": "en"} if model == "whisper" else {}  # qkv's own recognizer takes none
        with wav.open("rb") as f:
            return client.audio.transcriptions.create(
                model=model, file=f, response_format="verbose_json", timestamp_granularities=granularities, **language
            )

    both = verbose("whisper", ["word", "segment"])
    assert [(w.word, w.start, w.end) for w in both.words] == words and both.segments
    assert not verbose("whisper", ["word"]).segments
    with pytest.raises(openai.UnprocessableEntityError, match="imported Whisper"):
        verbose("asr", ["word"])


def test_a_prompt_and_a_temperature_reach_whispers_decoder(client, paths, wav):
    """OpenAI's ``prompt`` is Whisper's initial prompt and ``temperature`` the temperature each
    window is decoded at (0: Whisper's fallback schedule): the server answers what the library's
    long-form decoding gives with the same settings, and the prompt changes the transcript."""
    whisper = qkv.load(paths["whisper"])
    prompt = "Yes."

    def library(**options) -> tuple[str, list[float]]:
        chosen = WhisperOptions(language="en", timestamps=True, long_form=LongForm(**options))
        (found,) = transcriptions(whisper, [wav], TranscriptionOptions(whisper=chosen))
        return found.text, [g.temperature for g in found.segments]

    def served(**options) -> tuple[str, list[float]]:
        with wav.open("rb") as f:
            heard = client.audio.transcriptions.create(
                model="whisper", file=f, language="en", response_format="verbose_json", **options
            )
        return heard.text, [g.temperature for g in heard.segments]

    unprompted = library()
    assert served(prompt=prompt) == library(initial_prompt=initial_prompt(whisper, prompt)) != unprompted
    drawn = served(temperature=0.7)
    assert drawn == library(temperatures=(0.7,)) and set(drawn[1]) <= {0.7}
    longest = longest_prompt(whisper)
    with pytest.raises(
        openai.UnprocessableEntityError, match=rf"prompt is \d+ tokens; the model reads at most {longest}"
    ):
        served(prompt="kinkajou " * longest)
    with pytest.raises(openai.UnprocessableEntityError, match=r"temperature.*less than or equal to 1"):
        served(temperature=1.5)
    with pytest.raises(openai.UnprocessableEntityError, match="not an imported Whisper"), wav.open("rb") as f:
        client.audio.transcriptions.create(model="asr", file=f, prompt=prompt)


@pytest.fixture(scope="module")
def two_languages(paths) -> tuple[Path, list[str]]:
    """Two seconds, two tones that the tiny multilingual Whisper (1 s chunks) hears as two
    languages, as a file; and the language ``detect_language`` finds for each second alone."""
    from qkv.audio import features
    from qkv.hf.whisper import detect_language

    path = paths["whisper"].parent / "two_languages.wav"
    seconds = [(0.3 * np.sin(np.arange(16000) * pitch)).astype("f4") for pitch in (0.05, 0.11)]
    soundfile.write(path, np.concatenate(seconds), 16000, subtype="FLOAT")
    whisper = qkv.load(paths["whisper"])
    heads = [features(torch.from_numpy(w), whisper.features) for w in seconds]  # (T, M) each
    alone = detect_language(whisper.model, heads, whisper.path)
    assert len(set(alone)) == 2  # else the tests below could not tell per window from once
    return path, alone


def test_multilingual_detects_each_windows_language(client, paths, two_languages):
    """The form's ``multilingual`` (faster-whisper's; the openai client sends it as extra_body): a
    multilingual Whisper given no language decodes each window in the language detected on it,
    as the library's ``LongForm.multilingual``, and each verbose_json segment says its own; it is
    refused (422) beside a language, or for a model that is not a multilingual Whisper."""
    path, alone = two_languages
    options = LongForm(multilingual=True)
    timed = TranscriptionOptions(whisper=WhisperOptions(timestamps=True, long_form=options))
    (library,) = transcriptions(qkv.load(paths["whisper"]), [path], timed)

    def served(model: str = "whisper", **options):
        with path.open("rb") as f:
            return client.audio.transcriptions.create(model=model, file=f, response_format="verbose_json", **options)

    each, once = served(extra_body={"multilingual": True}), served()
    assert [g.language for g in each.segments] == [g.language for g in library.segments] == alone
    assert each.text == library.text and each.language == alone[0]
    assert once.text != each.text and once.language == alone[0]  # the first window's language, for both
    assert all(not hasattr(g, "language") for g in once.segments)  # OpenAI's segment fields alone
    with pytest.raises(openai.UnprocessableEntityError, match="give no language"):
        served(language="de", extra_body={"multilingual": True})
    with pytest.raises(openai.UnprocessableEntityError, match="model asr is not a multilingual Whisper"):
        served("asr", extra_body={"multilingual": True})


def test_serve_multilingual_is_the_default_a_request_overrides(paths, wav, two_languages, tmp_path, capsys):
    """``qkv serve --multilingual`` (``Settings.multilingual``): requests without a language detect
    each window's; ``multilingual: false`` or a language asks otherwise. An English-only Whisper
    is refused the flag (one line, exit 2) and the request field (422)."""
    from qkv.cli.main import main
    from qkv.hf.convert import import_hf
    from whisper_fixtures import hf_whisper

    path, alone = two_languages
    local = LocalServer(paths["whisper"], Settings(multilingual=True))
    try:
        client = openai.OpenAI(base_url=f"{local.url}/v1", api_key="none", max_retries=0, timeout=60)

        def languages(heard: Path = path, **options) -> list[str | None]:
            with heard.open("rb") as f:
                heard = client.audio.transcriptions.create(
                    model="whisper", file=f, response_format="verbose_json", **options
                )
            return [getattr(g, "language", None) for g in heard.segments]

        assert languages() == alone
        assert languages(extra_body={"multilingual": False}) == [None, None]
        assert languages(wav, language="de") == [None]  # a language given: no detection
    finally:
        local.stop()
    hf_whisper(tmp_path / "hf", multilingual=False)
    import_hf(tmp_path / "hf", tmp_path / "english")
    assert main(["serve", "--model", str(tmp_path / "english"), "--multilingual", "--port", "0"]) == 2
    assert "no model served is a multilingual Whisper" in capsys.readouterr().err
    english = LocalServer(tmp_path / "english", Settings())
    try:
        client = openai.OpenAI(base_url=f"{english.url}/v1", api_key="none", max_retries=0, timeout=60)
        with (
            pytest.raises(openai.UnprocessableEntityError, match="is not a multilingual Whisper"),
            path.open("rb") as f,
        ):
            client.audio.transcriptions.create(model="english", file=f, extra_body={"multilingual": True})
    finally:
        english.stop()


def speech_of(client, model: str, text: str, **options) -> bytes:
    return client.audio.speech.create(model=model, voice="default", input=text, **options).read()


def test_speech_is_the_librarys_speech(client, paths):
    tts, text = qkv.load(paths["tts"]), "do re mi"
    wave = tts.speak(text)
    for form in ("wav", "flac"):
        samples, rate = soundfile.read(io.BytesIO(speech_of(client, "tts", text, response_format=form)))
        assert rate == tts.sample_rate and len(samples) == wave.numel()
        assert np.abs(samples - wave.numpy() / max(1.0, float(wave.abs().max()))).max() < 1e-4  # 16 bits
    pcm = speech_of(client, "tts", text, response_format="pcm")  # 16-bit samples at 24 kHz
    assert len(pcm) // 2 == round(wave.numel() * 24000 / tts.sample_rate)


def test_qkvs_own_tts_speaks_a_text_sentence_by_sentence(client, paths):
    tts, parts = qkv.load(paths["tts"]), ["do re mi.", "mi re do.", "do."]  # what the tokenizer knows
    found = speeches(tts, parts)  # what the window holds: a sentence or two
    raw = client.audio.speech.with_raw_response.create(model="tts", voice="default", input="  ".join(parts))
    assert soundfile.info(io.BytesIO(raw.content)).frames == sum(wave.numel() for _, wave in found)
    assert raw.headers["x-sentences-cut"] == str(sum(said.hit_cap for said, _ in found))
    assert raw.headers["x-sample-rate"] == str(tts.sample_rate)


def test_a_piper_voice_speaks_at_the_speed_asked(client, paths):
    voice, text = qkv.load(paths["voice"]), "Hello there."
    normal = soundfile.info(io.BytesIO(speech_of(client, "voice", text))).frames
    assert normal == voice.speak(text).numel()
    fast = soundfile.info(io.BytesIO(speech_of(client, "voice", text, speed=2.0))).frames
    pace = voice.model.config.length_scale / 2.0
    assert fast == piper_speeches(voice, [text], length_scale=pace)[0].numel() and fast < normal


def test_bad_audio_and_limits_are_4xx_naming_both_numbers(client, server, paths, wav):
    with pytest.raises(openai.BadRequestError, match="not readable as audio"):
        client.audio.transcriptions.create(model="asr", file=("a.wav", b"RIFF-but-not-audio" * 10))
    with pytest.raises(openai.UnprocessableEntityError, match=r"3\.0 s long; the server takes at most 2 s"):
        client.audio.transcriptions.create(model="asr", file=("long.wav", tone(3.0)))
    # Longer than an imported Whisper's chunk (1 s here): read a window at a time, not refused;
    # every cue within the file.
    srt = client.audio.transcriptions.create(model="whisper", file=("long.wav", tone(1.3)), response_format="srt")
    ends = [line.split(" --> ")[1] for line in srt.splitlines() if " --> " in line]
    assert all(end <= "00:00:01,300" for end in ends)
    limit = MAX_MB * 1024 * 1024
    with pytest.raises(openai.APIStatusError, match=f"the file is {limit + 1} bytes; the server takes at most {limit}"):
        client.audio.transcriptions.create(model="asr", file=("big.wav", b"\0" * (limit + 1)))
    big = httpx.post(
        f"{server.url}/v1/audio/transcriptions",
        files={"file": ("big.wav", b"\0" * (2 * limit))},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert big.status_code == 413
    assert big.json()["error"]["message"].endswith(f"bytes; the server takes files of at most {limit} bytes")
    with pytest.raises(openai.UnprocessableEntityError, match=f"{MAX_CHARS + 1} characters; at most {MAX_CHARS}"):
        speech_of(client, "tts", "a" * (MAX_CHARS + 1))
    with pytest.raises(openai.UnprocessableEntityError, match="voices are 'default'"):
        client.audio.speech.create(model="tts", voice="alloy", input="do")


def test_the_api_key_guards_the_audio_routes(server, wav):
    stranger = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-the-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError), wav.open("rb") as f:
        stranger.audio.transcriptions.create(model="asr", file=f)
    with pytest.raises(openai.AuthenticationError):
        stranger.audio.speech.create(model="tts", voice="default", input="do")


def test_models_list_what_each_audio_model_answers(server):
    listed = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["models"]
    endpoints = {m["name"]: m["endpoints"] for m in listed}
    assert endpoints == {
        "asr": ["/v1/audio/transcriptions"],
        "st": ["/v1/audio/translations"],
        "tts": ["/v1/audio/speech"],
        "voice": ["/v1/audio/speech"],
        "whisper": ["/v1/audio/transcriptions", "/v1/audio/translations"],
    }
