"""The work of the audio endpoints: uploads read as the speech model hears them, transcripts as
the OpenAI API writes them (text, segments, SubRip and WebVTT subtitles), speech as audio bytes.

What is here: :func:`longest_audio` (the seconds a request may upload for a model, and which
limit says so), :func:`heard` (an uploaded file's bytes -> the mono waveform at the model's
rate, through ``qkv.audio.load_audio`` as ``qkv transcribe`` reads files; what it cannot read
is a 400, too long or too short a 422), the jobs the model thread runs (:func:`transcribe`
over ``bundle.transcriptions``, :func:`speak` over ``Bundle.speak``'s functions, a text of qkv's own
TTS model spoken by its :func:`sentences`), the transcript's
:class:`Segment` s and their writers (:func:`verbose`, :func:`subtitles`), and :func:`encoded`
(a waveform as WAV, FLAC or raw PCM bytes).

Timestamps: an imported Whisper's segments (and, asked for, their words) carry the times of its
long-form decoding; a model of qkv's own gives one segment that spans the whole audio
(:func:`segments_of`); :func:`subtitles` writes whatever segments it is given.

What is not here: HTTP (``routes/audio.py``), what is checked before any work (``validation.py``).
"""

from __future__ import annotations

import io
import re
import tempfile
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from qkv.audio import load_audio
from qkv.bundle import TranscriptionOptions, WhisperOptions, piper_speeches, speeches, transcriptions
from qkv.errors import UserError
from qkv.longform import LongForm
from qkv.serve.errors import ApiError
from qkv.serve.models import Served
from qkv.serve.settings import Settings
from qkv.tasks.asr import too_short

PCM_RATE = 24_000  # OpenAI's raw PCM: 24 kHz, 16-bit signed little-endian, mono
MEDIA = {"wav": "audio/wav", "flac": "audio/flac", "pcm": "audio/pcm"}
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def longest_audio(served: Served, settings: Settings) -> tuple[float, str]:
    """The seconds of audio ``served`` may be given, and what sets that limit: the server's
    ``--max-audio-seconds`` (an imported Whisper reads longer audio a 30-second window at a time,
    ``qkv.longform``)."""
    return settings.max_audio_seconds, f"the server takes at most {settings.max_audio_seconds:g} s"


def heard(data: bytes, name: str, served: Served, settings: Settings) -> Tensor:
    """The uploaded file ``data`` (called ``name`` by the client) as the model hears it: a mono
    waveform (Y,) at its rate. Audio that cannot be read (or is silent) is a 400; audio longer
    than :func:`longest_audio` or too short for the model's front-end a 422, each naming both
    numbers. Blocking (the file is read from disk): run it on a worker thread."""
    import soundfile  # imported on use, as qkv.audio does

    config = served.bundle.features
    longest, why = longest_audio(served, settings)
    with tempfile.NamedTemporaryFile(suffix=".audio") as file:
        file.write(data)
        file.flush()
        try:
            info = soundfile.info(file.name)
            seconds = info.frames / info.samplerate if info.samplerate > 0 else 0.0
        except (soundfile.SoundFileError, RuntimeError):
            seconds = 0.0  # load_audio says why it cannot read it
        if seconds > longest:
            raise ApiError(422, "too_long", f"the audio is {seconds:.1f} s long; {why}")
        try:
            wave = load_audio(file.name, sample_rate=config.sample_rate, max_seconds=None)
        except UserError as e:
            reason = str(e).removeprefix(f"{file.name}: ")
            raise ApiError(400, "invalid_audio", f"file {name}: {reason} (WAV, FLAC, OGG or MP3 are read)") from None
    frames = config.frames(wave.numel())
    if too_short(served.model, frames):
        shown = 1000 * wave.numel() / config.sample_rate
        raise ApiError(422, "too_short", f"the audio is {shown:.0f} ms long; too short for model {served.name}")
    return wave


# ----------------------------------------------------------------------------- transcripts


@dataclass(frozen=True)
class Heard:
    """One upload's transcript: its text, token ids, language (an imported multilingual
    Whisper's, given or detected; else None) and the seconds of audio it was heard from."""

    text: str
    ids: list[int]
    language: str | None
    seconds: float
    segments: tuple = ()  # the library's (subtitles.Segment, with times), if it found any


@dataclass(frozen=True)
class Segment:
    """A stretch of a transcript: its text, from ``start`` to ``end`` seconds, its token ids,
    the temperature it was decoded at and, where each window's was detected, its language."""

    text: str
    start: float
    end: float
    ids: list[int]
    temperature: float = 0.0  # the temperature its window was decoded at
    language: str | None = None  # its window's (LongForm.multilingual); else None


def transcribe(
    served: Served,
    waves: list[Tensor],
    *,
    task: str,
    language: str | None,
    timestamps: bool = False,
    prefix: str | None = None,
    ban: tuple[str, ...] = (),
    require: tuple[str, ...] = (),
    words: bool = False,
    prompt: tuple[int, ...] = (),
    temperatures: tuple[float, ...] | None = None,
    multilingual: bool = False,
) -> list[Heard]:
    """Each waveform's transcript by ``bundle.transcriptions`` (as ``qkv transcribe``, with the
    model's own decoding settings); ``task`` and ``language``: an imported Whisper's (None for
    a model of qkv's own, which does the one task it was trained for). ``timestamps``: an
    imported Whisper finds its segments' times (its timestamp tokens, window by window), as
    subtitles need; audio longer than its 30-second chunk is read that way whatever it is.
    ``prefix``, ``ban``, ``require``: constraints (``bundle.constraints``).
    ``words``: an imported Whisper times each word too (``LongForm.word_timestamps``).
    ``prompt`` (token ids) and ``temperatures`` (None: Whisper's fallback schedule): an imported
    Whisper's ``LongForm.initial_prompt`` and ``temperatures``; either read the audio window by
    window, as ``qkv transcribe --initial-prompt`` does (the batched search neither prompts nor draws).
    ``multilingual``: a multilingual Whisper without ``language`` detects each window's language
    (``LongForm.multilingual``; audio of one window, read whole, is detected once: the same)."""
    bundle = served.bundle
    whisper = bundle.whisper is not None
    windowed = whisper and (timestamps or words or bool(prompt) or temperatures is not None)
    options = LongForm(word_timestamps=words and whisper, initial_prompt=prompt, multilingual=multilingual)
    if temperatures is not None:
        options = replace(options, temperatures=temperatures)
    chosen = WhisperOptions(
        language=language if whisper else None,
        task=task if whisper and task != "transcribe" else None,
        timestamps=windowed,
        long_form=options,
    )
    found = transcriptions(bundle, waves, TranscriptionOptions(prefix=prefix, ban=ban, require=require, whisper=chosen))
    rate = bundle.sample_rate
    return [
        Heard(t.text, t.ids, t.language, w.numel() / rate, tuple(t.segments)) for t, w in zip(found, waves, strict=True)
    ]


def segments_of(heard: Heard) -> list[Segment]:
    """The transcript's segments: the library's, with their times (an imported Whisper's by its
    timestamp tokens), else one spanning the whole audio (an empty transcript: none)."""
    if heard.segments:
        found = heard.segments
        return [
            Segment(g.text.strip(), g.start, g.end, list(g.tokens), g.temperature, g.language)
            for g in found
            if g.text.strip()
        ]
    return [Segment(heard.text, 0.0, heard.seconds, heard.ids)] if heard.text else []


def verbose(heard: Heard, *, task: str, segments: bool = True) -> dict:
    """OpenAI's ``verbose_json`` transcript: the text, language (the first window's), duration,
    ``segments`` (unless only words were asked for; each with its window's ``language`` too, beyond
    OpenAI's fields, where each window's was detected) and, where they were timed, ``words``
    ({word, start, end}, as OpenAI's, the word without its leading space)."""
    found = {
        "task": task,
        "language": heard.language,
        "duration": round(heard.seconds, 3),
        "text": heard.text,
        "segments": [
            {
                "id": i,
                "seek": 0,
                "start": round(s.start, 3),
                "end": round(s.end, 3),
                "text": s.text,
                "tokens": s.ids,
                "temperature": s.temperature,
                **({} if s.language is None else {"language": s.language}),
            }
            for i, s in enumerate(segments_of(heard))
        ],
    }
    words = [w for g in heard.segments for w in g.words]
    if words:
        found["words"] = [{"word": w.word.strip(), "start": round(w.start, 3), "end": round(w.end, 3)} for w in words]
    if not segments:
        del found["segments"]
    return found


def clock(seconds: float, *, decimal: str) -> str:
    """``seconds`` as a subtitle's time, HH:MM:SS,mmm (SubRip) or HH:MM:SS.mmm (WebVTT)."""
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    return f"{hours:02d}:{minutes:02d}:{ms // 1000:02d}{decimal}{ms % 1000:03d}"


def subtitles(segments: list[Segment], form: str) -> str:
    """``segments`` as a SubRip (``srt``: numbered cues, times with a comma) or WebVTT (``vtt``:
    a ``WEBVTT`` header, times with a dot) file, one cue per segment."""
    decimal = "," if form == "srt" else "."
    cues = []
    for i, s in enumerate(segments, 1):
        number = f"{i}\n" if form == "srt" else ""
        times = f"{clock(s.start, decimal=decimal)} --> {clock(s.end, decimal=decimal)}"
        cues.append(f"{number}{times}\n{s.text.strip()}\n")
    head = "WEBVTT\n\n" if form == "vtt" else ""
    return head + "\n".join(cues)


# ----------------------------------------------------------------------------- speech


def speak(served: Served, texts: list[str], *, speaker: str | None, speed: float, form: str) -> list[tuple[bytes, int]]:
    """Each text spoken as ``Bundle.speak`` speaks it (seed 0: the same text, the same audio), in
    ``form`` (:func:`encoded`), with how many of its sentences ran into the model's cap. An
    imported Piper voice speaks sentence by sentence itself, at ``speed`` (its ``length_scale``
    divided by it); qkv's own TTS model speaks at one pace, and a text of several sentences
    (:func:`sentences`) as that many, one after the other: its window holds a sentence or two."""
    bundle = served.bundle
    if bundle.kind == "vits":
        pace = bundle.model.config.length_scale / speed
        waves = piper_speeches(bundle, texts, speaker=speaker, length_scale=pace, seed=0)
        return [(encoded(wave, bundle.sample_rate, form), 0) for wave in waves]
    out = []
    for text in texts:
        found = speeches(bundle, sentences(text), speaker=speaker, seed=0)
        wave = torch.cat([wave for _, wave in found])
        out.append((encoded(wave, bundle.sample_rate, form), sum(said.hit_cap for said, _ in found)))
    return out


def sentences(text: str) -> list[str]:
    """``text`` cut after each ``.``, ``!`` or ``?`` that a space follows (a text without one: itself)."""
    return [part for part in SENTENCE_END.split(text.strip()) if part]


def encoded(wave: Tensor, rate: int, form: str) -> bytes:
    """A mono waveform at ``rate`` as the bytes of a 16-bit ``wav`` or ``flac`` file at that rate,
    or as ``pcm``: raw 16-bit little-endian samples at 24 kHz (OpenAI's), resampled by soxr. A
    waveform whose peak passes full scale is scaled down to peak 1, as ``vocoder.write_wav`` does."""
    import soundfile  # imported on use, as qkv.audio does
    import soxr

    x = wave.detach().float().cpu().numpy()
    if form == "pcm" and rate != PCM_RATE:
        x = soxr.resample(x, rate, PCM_RATE)
    peak = float(np.abs(x).max()) if x.size else 0.0
    if peak > 1.0:
        x = x / peak
    if form == "pcm":
        return (np.clip(x, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()
    out = io.BytesIO()
    soundfile.write(out, x, rate, format=form.upper(), subtype="PCM_16")
    return out.getvalue()
