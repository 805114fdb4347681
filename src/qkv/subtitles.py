"""Transcripts with times, and the files they are written as (the Whisper CLI's formats).

What is here: :class:`Segment` (a stretch of audio and what was said in it, with its
:class:`Word` s when word timestamps were asked for), :class:`Heard`
(a transcript: the text itself, a ``str``, with its segments and language), and the writers
of :data:`FORMATS` (:func:`render`): ``txt`` (the text, one segment a line), ``tsv`` (start, end
in integer milliseconds, text), ``json`` (text, segments, language), ``srt`` (SubRip) and
``vtt`` (WebVTT), as openai/whisper's ``utils.py`` writes them (``max_words``: subtitle cues of at
most that many timed words, its ``--max_words_per_line``). What is not here: how segments
are found (``longform.py``), how words are timed (``word_timing.py``), reading audio
(``audio.py``), the command (``cli/transcribe.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

FORMATS = ("txt", "tsv", "json", "srt", "vtt")


@dataclass(frozen=True)
class Word:
    """A word of a segment, said from ``start`` to ``end`` (seconds from the start of the file):
    its text as the tokens write it (a leading space, punctuation attached) and the mean
    probability the model gave its tokens."""

    word: str
    start: float
    end: float
    probability: float = 0.0


@dataclass(frozen=True)
class Segment:
    """What was said from ``start`` to ``end`` (seconds from the start of the file).

    Attributes:
        start, end: its times in seconds.
        text: what was said (as the tokens write it: Whisper's start with a space).
        tokens: the token ids that wrote it, timestamps included.
        temperature: the temperature of the decoding it came from (0: greedy).
        avg_logprob: that decoding's mean log-probability per token (END included).
        compression_ratio: its text's length over its zlib-compressed length (repetition).
        no_speech_prob: the probability the model gave to "no speech" in its window.
        words: its words with their times (empty unless word timestamps were asked for).
        language: the language its window was decoded in, where each window's was detected
            (``LongForm.multilingual``); else None (the transcript's is its ``language``).
    """

    start: float
    end: float
    text: str
    tokens: tuple[int, ...] = ()
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    words: tuple[Word, ...] = ()
    language: str | None = None


class Heard(str):
    """A transcript: the text itself (so it compares, prints and joins as the text does), with
    ``segments`` (each with its times) and ``language`` (a multilingual Whisper's, else None)."""

    segments: tuple[Segment, ...]
    language: str | None

    def __new__(cls, text: str, segments: Sequence[Segment] = (), language: str | None = None) -> Heard:
        heard = super().__new__(cls, text)
        heard.segments, heard.language = tuple(segments), language
        return heard

    @property
    def text(self) -> str:
        return str(self)


@dataclass(frozen=True)
class _Record:
    text: str
    language: str | None
    segments: list[dict] = field(default_factory=list)


def clock(seconds: float, *, decimal: str = ".", hours: bool = False) -> str:
    """``[HH:]MM:SS.mmm`` (hours always with ``hours``, else only when there are some)."""
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    head = f"{h:02d}:" if hours or h else ""
    return f"{head}{m:02d}:{s:02d}{decimal}{ms:03d}"


def _line(text: str) -> str:
    """A segment's text on one subtitle line: stripped, and "-->" (the cue arrow) kept out."""
    return " ".join(text.split()).replace("-->", "->")


def cues(segments: Sequence[Segment], max_words: int | None = None) -> list[tuple[float, float, str]]:
    """The subtitle cues (start, end, text) of ``segments``: one per segment, or, with
    ``max_words``, one per run of at most that many of a segment's timed words (from its first
    word's start to its last's end; a segment without words stays one cue), as the Whisper CLI's
    ``--max_words_per_line`` cuts them."""
    out = []
    for s in segments:
        if max_words is None or not s.words:
            out.append((s.start, s.end, _line(s.text)))
            continue
        for i in range(0, len(s.words), max_words):
            run = s.words[i : i + max_words]
            out.append((run[0].start, run[-1].end, _line("".join(w.word for w in run))))
    return out


def render(fmt: str, heard: Heard, *, max_words: int | None = None) -> str:
    """``heard`` written in ``fmt`` (one of :data:`FORMATS`), a file's whole contents; srt and vtt
    cues of at most ``max_words`` timed words each (None: a cue per segment, see :func:`cues`)."""
    segments = [s for s in heard.segments if s.text.strip()]
    if fmt == "txt":
        return "".join(f"{_line(s.text)}\n" for s in segments)
    if fmt == "tsv":
        rows = (f"{round(1000 * s.start)}\t{round(1000 * s.end)}\t{_line(s.text)}\n" for s in segments)
        return "start\tend\ttext\n" + "".join(rows)
    if fmt == "srt":
        return "".join(
            f"{i}\n{clock(start, decimal=',', hours=True)} --> {clock(end, decimal=',', hours=True)}\n{text}\n\n"
            for i, (start, end, text) in enumerate(cues(segments, max_words), start=1)
        )
    if fmt == "vtt":
        lines = (f"{clock(start)} --> {clock(end)}\n{text}\n\n" for start, end, text in cues(segments, max_words))
        return "WEBVTT\n\n" + "".join(lines)
    if fmt == "json":
        return json.dumps(asdict(record(heard)), ensure_ascii=False) + "\n"
    raise ValueError(f"unknown format {fmt!r}; the formats: {', '.join(FORMATS)}")


def record(heard: Heard) -> _Record:
    """``heard`` as the json format holds it (segments with their times rounded to the ms; their
    ``words``, each {word, start, end, probability}, where words were timed)."""
    segments, timed = [], any(s.words for s in heard.segments)
    for i, s in enumerate(heard.segments):
        fields = {**asdict(s), "id": i, "start": round(s.start, 3), "end": round(s.end, 3), "tokens": list(s.tokens)}
        fields["words"] = [{**w, "probability": round(w["probability"], 4)} for w in fields["words"]]
        if not timed:
            del fields["words"]
        if fields["language"] is None:  # a language per segment only where each window's was detected
            del fields["language"]
        segments.append(fields)
    return _Record(heard.text, heard.language, segments)
