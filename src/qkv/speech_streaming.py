"""Speech recognised while it is spoken: local agreement over a sliding buffer of audio.

The policy is LocalAgreement-2 of Macháček, Dabre and Bojar (2023), "Turning Whisper into
Real-Time Transcription System" (the ``whisper_streaming`` project), over any speech model's
decoding:

  * audio arrives in chunks and is kept in a buffer; once ``min_chunk`` seconds of new audio
    have arrived, the whole buffer is decoded again, after the committed text that lies before
    the buffer as a prompt (Whisper's ``initial_prompt``; the last ``prompt_chars`` of it);
  * the words of the new hypothesis that re-say words already committed (their audio is still
    in the buffer) are skipped (:func:`resaid`); of the rest, the longest common prefix with the
    previous hypothesis's rest is committed (:func:`agreed`): two decodings in a row, each with
    more audio, said the same, so later audio is unlikely to change it (section 2.2);
  * when the buffer is longer than ``trim_seconds``, it is cut at the end of the latest segment
    (by the decoder's timestamps, never its last segment) whose words are all committed
    (:func:`cut_at`), as ``whisper_streaming`` trims "on segment"; a buffer that grows past
    ``max_seconds`` with no such cut (a model without timestamps: one segment) has its
    hypothesis committed whole and starts afresh;
  * at the end, the last hypothesis is committed whole.

Words are compared by their letters and digits, casefolded (:func:`spelled`): a word that gains
a comma or a capital between two decodings still agrees. The decoder gives segments with times,
and their words timed where it can (``decoder_of(words=True)``, the server's way: an imported
Whisper's decoding aligns the words by the cross-attention of its alignment heads with the
encoder output it has just read, as ``--word-timestamps`` does, ``word_timing.py``); without,
a step that commits words first has them timed where a ``timer`` can (:func:`timer_of`: the
buffer read again, encoder and decoder). Each word's times are those of the timed words that
hold its characters (:func:`aligned`); elsewhere (a model of qkv's own, timed words that do not
spell the segment) a word's times are its segment's, shared out by characters
(:func:`words_of`): an estimate, and :attr:`Word.aligned` says which.

What is here: :class:`StreamOptions`, :class:`Word`, :class:`Update` (what one step commits and
what it guesses beyond), the pure parts (:func:`words_of`, :func:`aligned`, :func:`spelled`,
:func:`agreed`, :func:`resaid`, :func:`cut_at`, :func:`trusted`), :class:`SpeechStream` (the
policy's state, over a ``decode`` function and an optional ``timer``), :func:`decoder_of` (a
loaded speech model's decoding as that function: an imported Whisper's segments by its
timestamps, greedy, after the prompt; a model of qkv's own, one segment) and :func:`timer_of`
(an imported Whisper's word timing of a decoded buffer).
What is not here: the decoding (``bundle.transcriptions``, ``longform.py``), the alignment
(``word_timing.py``), the WebSocket (``serve/routes/stream.py``).

Shapes: a waveform (Y,) of samples at the decoder's rate.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.audio_stream import AudioSource, WhisperFrames
from qkv.bundle import Bundle, TranscriptionOptions, WhisperOptions, checked_heads, transcriptions
from qkv.hf.whisper import most_likely_languages
from qkv.longform import LongForm, compression_ratio
from qkv.subtitles import Segment
from qkv.tasks.asr import too_short
from qkv.word_timing import UNSPACED, align_window, fit_words

Decode = Callable[
    [Tensor, str], Sequence[Segment]
]  # (buffer (Y,), prompt) -> segments, seconds from the buffer's start
Timer = Callable[
    [Tensor, Sequence[Segment]], Sequence[Segment]
]  # (buffer (Y,), its segments) -> the same segments, their words timed (Segment.words)
LETTERS = re.compile(r"[\W_]+")


@dataclass(frozen=True)
class StreamOptions:
    """How the stream decodes; the defaults are ``whisper_streaming``'s.

    Attributes:
        min_chunk: seconds of new audio before the buffer is decoded again.
        trim_seconds: a buffer longer than this is cut at the end of a committed segment.
        max_seconds: a buffer longer than this with no such cut is committed whole and emptied
            (Whisper's window: 30 s).
        prompt_chars: the characters of committed text before the buffer given as the prompt.
    """

    min_chunk: float = 1.0
    trim_seconds: float = 15.0
    max_seconds: float = 30.0
    prompt_chars: int = 200


@dataclass(frozen=True)
class Word:
    """A word as decoded (punctuation kept) and its times, in seconds from the stream's start:
    the model's alignment (``aligned``) or a share of its segment's by characters (an estimate)."""

    text: str
    start: float
    end: float
    aligned: bool = False


@dataclass(frozen=True)
class Update:
    """One step's news: the words it committed (in order, never taken back) and the words of
    its hypothesis beyond them (a guess the next steps may change)."""

    committed: tuple[Word, ...]
    partial: tuple[Word, ...]

    @property
    def text(self) -> str:
        """The committed words, joined by spaces."""
        return " ".join(w.text for w in self.committed)

    @property
    def partial_text(self) -> str:
        return " ".join(w.text for w in self.partial)


def words_of(segments: Sequence[Segment], offset: float) -> tuple[list[Word], list[int]]:
    """The segments' words (split at white space) with times ``offset`` seconds later: where a
    segment's timed words (``Segment.words``) spell it, each word's :func:`aligned` times, else
    a share of its segment's time in proportion to its characters; and how many words there are
    up to the end of each segment (cumulative)."""
    words, counts = [], []
    for s in segments:
        pieces = s.text.split()
        timed = aligned(pieces, [(w.word, w.start, w.end) for w in s.words]) if s.words else None
        total, at = sum(map(len, pieces)) or 1, 0
        for i, piece in enumerate(pieces):
            begin = s.start + (s.end - s.start) * at / total
            at += len(piece)
            end = s.start + (s.end - s.start) * at / total
            if timed is not None:
                begin, end = timed[i]
            words.append(Word(piece, offset + begin, offset + end, timed is not None))
        counts.append(len(words))
    return words, counts


def aligned(pieces: Sequence[str], timed: Sequence[tuple[str, float, float]]) -> list[tuple[float, float]] | None:
    """Each piece's (start, end): from the start of the timed word (text, start, end) that holds
    its first character to the end of the one that holds its last, white space aside (the two
    may split a text differently: Whisper's words keep a hyphen's halves apart). None when the
    timed words do not spell the pieces."""
    owners = [(start, end) for text, start, end in timed for _ in "".join(text.split())]
    if "".join(pieces) != "".join("".join(text.split()) for text, _, _ in timed):
        return None
    out, at = [], 0
    for piece in pieces:
        out.append((owners[at][0], owners[at + len(piece) - 1][1]))
        at += len(piece)
    return out


def spelled(word: str) -> str:
    """A word as compared: casefolded, its letters and digits only (punctuation alone: as it is)."""
    letters = LETTERS.sub("", word.casefold())
    return letters or word


def agreed(previous: Sequence[str], current: Sequence[str]) -> int:
    """How many leading words two hypotheses share (their longest common prefix, compared as
    :func:`spelled`): what LocalAgreement-2 commits."""
    n = 0
    for a, b in zip(previous, current, strict=False):  # as far as the shorter goes
        if spelled(a) != spelled(b):
            break
        n += 1
    return n


def resaid(hypothesis: Sequence[str], committed: Sequence[str], *, longest: int = 5) -> int:
    """How many leading words of ``hypothesis`` (a decoding of the whole buffer) re-say
    ``committed`` (the committed words whose audio is still in the buffer). Said alike: all of
    them. Said otherwise (a word split or joined): up to where the committed words' last ``n``
    words recur in it (``n`` from ``longest`` down to 1, ``whisper_streaming``'s n-gram rule),
    the occurrence nearest their count; never found: as many words as were committed."""
    h, c = [spelled(w) for w in hypothesis], [spelled(w) for w in committed]
    if h[: len(c)] == c:
        return len(c)
    for n in range(min(longest, len(c)), 0, -1):
        ends = [j for j in range(n, len(h) + 1) if h[j - n : j] == c[-n:]]
        if ends:
            return min(ends, key=lambda j: (abs(j - len(c)), j))
    return min(len(c), len(h))


def cut_at(ends: Sequence[float], counts: Sequence[int], committed: int) -> tuple[float, int] | None:
    """Where a buffer may be cut: the end of the latest segment but the last (``ends``, seconds
    from the buffer's start; ``counts``, words up to each segment's end) whose words are all
    among the first ``committed`` words of the hypothesis; with the words before it. None: nowhere."""
    found = None
    for end, n in zip(ends[:-1], counts[:-1], strict=True):
        if n <= committed and end > 0:
            found = (end, n)
    return found


class SpeechStream:
    """LocalAgreement-2 over ``decode`` (see the module): :meth:`insert` audio as it arrives,
    :meth:`step` when :meth:`ready`, :meth:`finish` at the end. ``timer``: the words a step
    commits are timed by it (None: their times are estimates).

    Shapes: each chunk (Y,) at ``sample_rate``.
    """

    def __init__(
        self,
        decode: Decode,
        *,
        sample_rate: int,
        options: StreamOptions = StreamOptions(),
        timer: Timer | None = None,
    ) -> None:
        self.decode, self.rate, self.options, self.timer = decode, sample_rate, options, timer
        self.buffer = torch.zeros(0)  # (Y,) the audio since the last cut
        self.offset = 0.0  # seconds of the stream before the buffer
        self.fresh = 0  # samples inserted since the last decoding
        self.committed: list[Word] = []
        self.in_buffer = 0  # how many of the committed words were heard in the buffer
        self.pending: list[Word] = []  # the last hypothesis beyond what is committed

    @property
    def seconds(self) -> float:
        """The seconds of audio in the buffer."""
        return self.buffer.numel() / self.rate

    def insert(self, chunk: Tensor) -> None:
        """Add a chunk (Y,) of audio after what came before."""
        self.buffer = torch.cat([self.buffer, chunk.float().reshape(-1)])  # (Y,)
        self.fresh += chunk.numel()

    def ready(self) -> bool:
        """Whether ``min_chunk`` seconds have arrived since the last decoding."""
        return self.fresh >= self.options.min_chunk * self.rate

    def prompt(self) -> str:
        """The committed text before the buffer, its last ``prompt_chars`` characters."""
        before = self.committed[: len(self.committed) - self.in_buffer]
        return " ".join(w.text for w in before)[-self.options.prompt_chars :]

    def step(self) -> Update:
        """Decode the buffer and commit what the last two hypotheses agree on (timed by the
        timer, when there is one: only a step that commits pays for it)."""
        segments, words, counts, skip = self._hypothesis()
        tail = words[skip:]
        n = agreed([w.text for w in self.pending], [w.text for w in tail])
        if n:
            tail = self._timed(segments, words)[skip:]
        new = self._commit(tail[:n])
        self.pending = tail[n:]
        ends = [s.end for s in segments]
        cut = cut_at(ends, counts, skip + n) if self.seconds > self.options.trim_seconds else None
        if cut is not None:
            self._cut(cut[0], cut[1])
        elif self.seconds > self.options.max_seconds:
            new = (*new, *self._commit(self.pending))
            self._cut(self.seconds, self.in_buffer)
        return Update(new, tuple(self.pending))

    def finish(self) -> Update:
        """Decode what is left and commit it whole: if any audio came since the last step, or
        the guess left has words the timer could time (the same buffer decodes the same)."""
        if self.fresh or (self.pending and self.timer is not None):
            segments, words, _, skip = self._hypothesis()
            self.pending = self._timed(segments, words)[skip:]
        new = self._commit(self.pending)
        self._cut(self.seconds, self.in_buffer)
        return Update(new, ())

    def _hypothesis(self) -> tuple[list[Segment], list[Word], list[int], int]:
        """The buffer decoded: its segments (seconds from the buffer's start), its words, the
        words up to each segment's end, how many leading words re-say committed ones."""
        self.fresh = 0
        segments = list(self.decode(self.buffer, self.prompt())) if self.buffer.numel() else []
        words, counts = words_of(segments, self.offset)
        heard = self.committed[len(self.committed) - self.in_buffer :]
        skip = resaid([w.text for w in words], [w.text for w in heard])
        return segments, words, counts, skip

    def _timed(self, segments: list[Segment], words: list[Word]) -> list[Word]:
        """``words`` (the hypothesis's, of ``segments``) with the timer's times where it has
        them; the same words, as they were, without a timer or segments."""
        if self.timer is None or not segments:
            return words
        timed, _ = words_of(self.timer(self.buffer, segments), self.offset)
        return timed if [w.text for w in timed] == [w.text for w in words] else words

    def _commit(self, words: Sequence[Word]) -> tuple[Word, ...]:
        """Commit ``words``, their times kept in order (a word starts no earlier than the last ended)."""
        out = []
        for w in words:
            last = self.committed[-1].end if self.committed else 0.0
            self.committed.append(Word(w.text, max(w.start, last), max(w.end, last), w.aligned))
            out.append(self.committed[-1])
        self.in_buffer += len(out)
        return tuple(out)

    def _cut(self, seconds: float, words: int) -> None:
        """Drop the buffer's first ``seconds``, which held ``words`` of the committed words."""
        samples = min(self.buffer.numel(), round(seconds * self.rate))
        self.buffer = self.buffer[samples:]  # (Y,)
        self.offset += samples / self.rate
        self.in_buffer = max(0, self.in_buffer - words)
        if not self.buffer.numel():
            self.in_buffer, self.pending = 0, []


def trusted(segments: Sequence[Segment], threshold: float | None) -> list[Segment]:
    """The segments before the first whose text repeats itself (its gzip compression ratio above
    ``threshold``: Whisper's sign of greedy decoding caught in a loop, which its temperature
    fallback would decode again; None: all). Judged segment by segment, not by window, so that a
    loop in the half-heard audio at the buffer's end leaves the words before it; a stream decodes
    the buffer again a second later, with more audio."""
    out = []
    for s in segments:
        if threshold is not None and compression_ratio(s.text.strip()) > threshold:
            break
        out.append(s)
    return out


def decoder_of(bundle: Bundle, *, language: str | None = None, task: str | None = None, words: bool = False) -> Decode:
    """A loaded speech model's decoding as :class:`SpeechStream` calls it: an imported Whisper's
    timed segments (greedy, no temperature fallback: a step must be quick; those of a window that
    repeats itself left out, :func:`trusted`; ``language`` and ``task`` as
    :func:`~qkv.bundle.transcriptions`), after the prompt as its ``initial_prompt``; a model of
    qkv's own, one segment over the buffer (no prompt). Audio too short for the model's
    front-end: no segment. ``words``: an imported Whisper's segments come with their words
    timed by its alignment heads (``LongForm.word_timestamps``: the window's encoder output read
    once, for the decoding and the alignment, where :func:`timer_of` reads it again; the times
    ``qkv transcribe --word-timestamps --no-fallback`` gives for the buffer), at a decoder pass
    more each step."""
    whisper = bundle.whisper is not None
    tokenizer = bundle.vocab.target

    def decode(wave: Tensor, prompt: str) -> Sequence[Segment]:
        if too_short(bundle.model, bundle.features.frames(wave.numel())):
            return []
        prompt_ids = tuple(tokenizer.encode(" " + prompt.strip())) if whisper and prompt.strip() else ()
        options = LongForm(temperatures=(0.0,), initial_prompt=prompt_ids, word_timestamps=words) if whisper else None
        chosen = WhisperOptions(language=language, task=task, timestamps=whisper, long_form=options)
        (found,) = transcriptions(bundle, [wave], TranscriptionOptions(whisper=chosen))
        return trusted(found.segments, options.compression_ratio_threshold if options else None)

    return decode


def timer_of(bundle: Bundle, *, language: str | None = None, task: str | None = None) -> Timer | None:
    """An imported Whisper's word timing of a decoded buffer, as its word timestamps are found
    (``longform.py`` with ``word_timestamps``): the buffer read as one window, the segments' text
    aligned by the checkpoint's alignment heads (``word_timing.align_window``; none named: the
    upper half's heads) and fitted to the segments (``fit_words``). ``language``: the buffer's
    (None: a multilingual model detects it). A buffer longer than the window keeps its segments
    as they are. None for a model of qkv's own (its words keep their estimates)."""
    settings = bundle.whisper
    if settings is None or settings.no_timestamps_id is None:
        return None
    heads, eot, tokenizer = checked_heads(bundle), bundle.model.config.eos_id, bundle.vocab.target
    where, bos = bundle.path / "config.json", bundle.model.config.bos_id
    frames = round(bundle.features.chunk_seconds * bundle.sample_rate) // bundle.features.hop_length  # a window

    @torch.no_grad()
    def timed(wave: Tensor, segments: Sequence[Segment]) -> Sequence[Segment]:
        source = AudioSource.of_wave(wave, bundle.sample_rate)
        mel = WhisperFrames(source, bundle.features, pad_seconds=bundle.features.chunk_seconds)
        size = mel.frames - frames  # the buffer's own frames (a window of zeros follows them)
        if not segments or not 0 < size <= frames:
            return segments
        window = F.pad(mel.window(0, size), (0, 0, 0, frames - size))  # (T, M): as longform pads one
        window = window.to(next(bundle.model.parameters()).dtype)
        code = language
        if code is None and settings.multilingual:
            (code,) = most_likely_languages(bundle.model, [window], settings, where=where)
        start = settings.prefix(bos, language=code, task=task or "transcribe", timestamps=True, where=where)
        text = [t for s in segments for t in s.tokens if t < eot]
        words = align_window(
            bundle.model,
            window,
            size,
            start,
            text,
            no_timestamps=settings.no_timestamps_id,
            heads=heads,
            decode=tokenizer.decode,
            spaces=code not in UNSPACED,
        )
        return fit_words(segments, words, 0.0, 0.0, eot)[0]

    return timed
