"""Word timestamps: when each word of a transcript was said.

Whisper (Radford et al., 2022, section 3.8 "timestamps"; openai/whisper's ``timing.py``): the
decoder reads the window's text again, after the start tokens and <|notimestamps|>, and the
cross-attention weights of the checkpoint's *alignment heads* (a few heads of the upper
decoder layers whose attention follows the speech; a model that names none: every head of the
upper half, openai/whisper's default) say where in the audio each token is. The weights are
kept to the window's real frames, standardised per head and frame over the tokens, smoothed by
a median filter over time (width 7) and averaged over the heads; dynamic time warping
(:func:`dtw`) finds the cheapest monotone path through their negation, and a token starts
where the path first reaches its row. The tokens are grouped into words as Whisper does
(:func:`split_words`: a word begins at a token that starts with a space, at punctuation and at
a special token; :func:`merge_punctuations` then joins leading and trailing punctuation to its
word), a word lasting from its first token's start to the next word's. The times are then fitted
to the segments (:func:`fit_words`, openai/whisper's ``add_word_timestamps``): a word longer than
twice the median word (at most 0.7 s) is cut at sentence ends and after a pause, and a
segment's start and end move to its words'.

CTC models (Graves et al., 2006): forced alignment, the Viterbi path of the transcript's tokens
through the CTC head's per-frame log-probabilities (:func:`ctc_alignment`, :func:`ctc_words`).

What is here: those pure functions (:func:`median_filter`, :func:`dtw`,
:func:`alignment_matrix`, :func:`split_words`, :func:`merge_punctuations`, :func:`fit_words`,
:func:`ctc_alignment`) and :func:`align_window`, which runs a Whisper model on one window
(the model's own attention capture: ``decode(..., need_weights=True)``). What is not here: the
windows (``longform.py``), the segments and their files (``subtitles.py``).

Shapes use the legend of ``attention.py``: H heads (here the K alignment heads), L tokens, S
encoder frames (20 ms each for Whisper), M mel bins, V vocabulary.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.models.speech import SpeechEncoderDecoder
from qkv.subtitles import Segment, Word

MEDIAN_WIDTH = 7  # openai/whisper's medfilt_width
PREPEND = "\"'“¿([{-"  # openai/whisper's prepend_punctuations: joined to the word after
APPEND = "\"'.。,，!！?？:：”)]}、"  # append_punctuations: joined to the word before
SENTENCE_ENDS = ".。!！?？"
UNSPACED = ("zh", "ja", "th", "lo", "my", "yue")  # languages written without spaces: words are characters


@dataclass(frozen=True)
class Timed:
    """A word as it is aligned: its text, its token ids, start and end (seconds from the window's
    start) and the mean probability of its tokens."""

    word: str
    tokens: tuple[int, ...]
    start: float
    end: float
    probability: float


def median_filter(x: Tensor, width: int) -> Tensor:
    """Each value replaced by the median of the ``width`` values centred on it along the last
    axis, the edges reflected (openai/whisper's ``median_filter``); ``x`` as it is where that axis
    is no longer than width // 2.

    Shapes: (..., S) -> (..., S).
    """
    if width < 1 or width % 2 == 0:
        raise ValueError(f"the median filter's width must be odd and positive, got {width}")
    half = width // 2
    if x.shape[-1] <= half:
        return x
    rows = F.pad(x.reshape(-1, 1, x.shape[-1]), (half, half), mode="reflect")  # (N, 1, S + 2·half)
    return rows.unfold(-1, width, 1).sort(dim=-1).values[..., half].reshape(x.shape)  # (..., S)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest path through ``cost`` (N, M) from cell (0, 0) to (N − 1, M − 1), each step
    one row down, one column right or both (dynamic time warping; Sakoe & Chiba, 1978): the rows
    and columns of its cells, in order. The sums are kept in float32 and ties broken as
    openai/whisper's ``dtw_cpu`` breaks them (diagonal only when strictly cheapest, then down,
    else right), so the path is its path. The table is filled one anti-diagonal at a time (a cell
    reads only the two anti-diagonals before its own), N + M vector steps.

    Shapes: cost (N, M) -> rows (P,), columns (P,), N + M − 1 >= P >= max(N, M).
    """
    n, m = cost.shape
    x = np.asarray(cost, dtype=np.float64)
    total = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    total[0, 0] = 0
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)  # the rows of anti-diagonal i + j = d
        j = d - i
        c0, c1, c2 = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        total[i, j] = x[i - 1, j - 1] + np.choose(step, [c0, c1, c2])  # float64 sum, kept as float32
        trace[i, j] = step
    return _backtrace(trace)


def _backtrace(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The path :func:`dtw`'s trace (0: diagonal, 1: down, 2: right) leads back along."""
    trace = trace.copy()
    trace[0, :], trace[:, 0] = 2, 1
    i, j = trace.shape[0] - 1, trace.shape[1] - 1
    rows, columns = [], []
    while i > 0 or j > 0:
        rows.append(i - 1)
        columns.append(j - 1)
        step = trace[i, j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    return np.array(rows[::-1]), np.array(columns[::-1])


def alignment_matrix(weights: Tensor, frames: int, rows: slice, width: int = MEDIAN_WIDTH) -> Tensor:
    """What DTW reads (negated) of the alignment heads' cross-attention: the weights kept to the
    first ``frames`` encoder frames and renormalised there (openai/whisper takes the softmax of
    the kept scores: the same), standardised per head and frame over all L tokens, median-filtered
    over time, averaged over the heads; then the ``rows`` DTW aligns.

    Shapes: weights (K, L, S) -> (len(rows), frames).
    """
    w = weights[..., :frames].float()  # (K, L, frames)
    w = w / w.sum(-1, keepdim=True)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, correction=0)  # (K, 1, frames)
    return median_filter((w - mean) / std, width).mean(0)[rows]  # (len(rows), frames)


def token_starts(matrix: Tensor) -> np.ndarray:
    """The encoder frame at which each row (token) of ``matrix`` starts: where the DTW path
    through −matrix first reaches its row.

    Shapes: matrix (L, S) -> (L,) frame indices.
    """
    rows, columns = dtw(-matrix.double().cpu().numpy())
    jumps = np.diff(rows, prepend=-1).astype(bool)  # the path's first cell in each row
    return columns[jumps]


def split_words(
    tokens: Sequence[int], decode: Callable[[list[int]], str], eot: int, *, spaces: bool = True
) -> list[tuple[str, list[int]]]:
    """``tokens`` grouped into words as Whisper's tokenizer groups them (``split_to_word_tokens``):
    first into the shortest runs that decode to whole characters; with ``spaces`` (languages
    written with spaces) a run joins the word before unless it starts with a space, is
    punctuation or a special token (id >= ``eot``). Returns (text, tokens) per word."""
    whole, pieces, run, offset = decode(list(tokens)), [], [], 0
    for token in tokens:
        run.append(token)
        text = decode(run)
        bad = text.find("\ufffd")  # an incomplete UTF-8 character: unless the whole text has one there too
        if bad < 0 or offset + bad >= len(whole) or whole[offset + bad] == "\ufffd":
            pieces.append((text, run))
            run, offset = [], offset + len(text)
    if not spaces:
        return pieces
    words: list[tuple[str, list[int]]] = []
    for text, run in pieces:
        alone = run[0] >= eot or text.startswith(" ") or text.strip() in string.punctuation or not words
        if alone:
            words.append((text, list(run)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + run)
    return words


def merge_punctuations(words: list[Timed], prepend: str = PREPEND, append: str = APPEND) -> list[Timed]:
    """Leading punctuation (a word of ``prepend``'s after a space) joined to the word after it,
    trailing punctuation (``append``'s) to the word before, as openai/whisper's
    ``merge_punctuations``: the word keeps its own times; the emptied entries stay (text "",
    no tokens) so that tokens still count in order."""
    w = list(words)
    i, j = len(w) - 2, len(w) - 1
    while i >= 0:
        if w[i].word.startswith(" ") and w[i].word.strip() in prepend:
            w[j] = replace(w[j], word=w[i].word + w[j].word, tokens=w[i].tokens + w[j].tokens)
            w[i] = replace(w[i], word="", tokens=())
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(w):
        if not w[i].word.endswith(" ") and w[j].word in append:
            w[i] = replace(w[i], word=w[i].word + w[j].word, tokens=w[i].tokens + w[j].tokens)
            w[j] = replace(w[j], word="", tokens=())
        else:
            i = j
        j += 1
    return w


@torch.no_grad()
def align_window(
    model: SpeechEncoderDecoder,
    window: Tensor,
    frames: int,
    start: Sequence[int],
    text: Sequence[int],
    *,
    no_timestamps: int,
    heads: Sequence[tuple[int, int]],
    decode: Callable[[list[int]], str],
    spaces: bool = True,
    memory: Tensor | None = None,
) -> list[Timed]:
    """The words of ``text`` (token ids, no timestamps) in one window of features, timed from
    the window's start (openai/whisper's ``find_alignment``): the decoder reads ``start`` (the
    start tokens), <|notimestamps|>, ``text`` and END; ``frames``: the window's real feature
    frames; ``heads``: (layer, head) pairs (empty: every head of the upper half of the layers);
    ``memory``: the window's encoder output (1, S, D) where the decoding has it already (the
    encoder is most of the cost: openai/whisper's ``find_alignment`` runs it again).

    Shapes: window (T, M) -> words.
    """
    if not text:
        return []
    eot, device = model.config.eos_id, next(model.parameters()).device
    tokens = [*start, no_timestamps, *text, eot]
    if memory is None:
        memory, valid = model.encode(window[None].to(device, next(model.parameters()).dtype))  # (1, S, D), (1, S)
    else:  # a whole window: every position valid, as encode says of it
        valid = torch.ones(memory.shape[:2], dtype=torch.bool, device=memory.device)  # (1, S)
    out = model.decode(torch.tensor([tokens], device=device), memory, src_mask=valid, need_weights=True)
    layers = len(out.attention)
    heads = heads or [(n, h) for n in range(layers // 2, layers) for h in range(out.attention[n].shape[1])]
    weights = torch.stack([out.attention[n][0, h] for n, h in heads])  # (K, L, S)
    probs = out.logits[0, len(start) : len(start) + len(text), :eot].float().softmax(-1)  # (N, eot): text only
    probs = probs[torch.arange(len(text)), torch.tensor(text)].tolist()
    rows = slice(len(start), len(tokens) - 1)  # the rows that write text[0], ..., END
    step = model.config.features.hop_length * 2 / model.config.features.sample_rate  # an encoder frame, seconds
    times = token_starts(alignment_matrix(weights, frames // 2, rows)) * step  # (N + 1,)
    return timed_words(split_words([*text, eot], decode, eot, spaces=spaces), times, probs)


def timed_words(words: list[tuple[str, list[int]]], times: np.ndarray, probs: list[float]) -> list[Timed]:
    """Each word (the last is END's) from its first token's start to the next word's; the mean
    probability of its tokens. Shapes: times (N + 1,) seconds, probs (N,)."""
    if len(words) <= 1:
        return []
    bounds = np.cumsum([0] + [len(tokens) for _, tokens in words[:-1]])
    return [
        Timed(text, tuple(tokens), float(times[a]), float(times[b]), float(np.mean(probs[a:b])))
        for (text, tokens), a, b in zip(words, bounds[:-1], bounds[1:], strict=False)
    ]


def fit_words(
    segments: Sequence[Segment], words: list[Timed], offset: float, last_speech: float, eot: int
) -> tuple[list[Segment], float]:
    """One window's segments given the words of their text (timed from ``offset``, the window's
    start, in seconds), as openai/whisper's ``add_word_timestamps`` fits them: words longer than
    twice the median word (at most 0.7 s) cut at sentence ends, punctuation merged, each segment
    given its words (rounded to 10 ms), a first word after a pause (``last_speech``: where the
    speech before ended) cut, and the segment's start and end moved to its words' unless a word
    runs 0.5 s past them. Returns the segments and where their speech ends."""
    durations = np.array([w.end - w.start for w in words])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    if len(durations):
        words = _cut_at_sentence_ends(words, 2 * median)
    words, out, k = merge_punctuations(words), [], 0
    for segment in segments:
        length, found = len([t for t in segment.tokens if t < eot]), []
        while k < len(words) and length > 0:
            if words[k].word:
                w = words[k]
                found.append(Word(w.word, round(offset + w.start, 2), round(offset + w.end, 2), w.probability))
            length -= len(words[k].tokens)
            k += 1
        segment = _fit_segment(segment, found, median, last_speech)
        last_speech = segment.end if segment.words else last_speech
        out.append(segment)
    return out, last_speech


def _cut_at_sentence_ends(words: list[Timed], longest: float) -> list[Timed]:
    """A word longer than ``longest`` shortened: a sentence end from its start, the word after
    one from its end (the pause a sentence end often hides)."""
    words = list(words)
    for i in range(1, len(words)):
        w = words[i]
        if w.end - w.start > longest:
            if w.word in SENTENCE_ENDS:
                words[i] = replace(w, end=w.start + longest)
            elif words[i - 1].word in SENTENCE_ENDS:
                words[i] = replace(w, start=w.end - longest)
    return words


def _fit_segment(segment: Segment, words: list[Word], median: float, last_speech: float) -> Segment:
    """openai/whisper's fitting of one segment and its words (see :func:`fit_words`)."""
    if not words:
        return replace(segment, words=())
    longest, t = 2 * median, [[w.start, w.end] for w in words]
    if t[0][1] - last_speech > median * 4 and (
        t[0][1] - t[0][0] > longest or (len(t) > 1 and t[1][1] - t[0][0] > longest * 2)
    ):  # the first word after a pause, too long: cut (and the second)
        if len(t) > 1 and t[1][1] - t[1][0] > longest:
            t[0][1] = t[1][0] = max(t[1][1] / 2, t[1][1] - longest)
        t[0][0] = max(0, t[0][1] - longest)
    start, end = segment.start, segment.end
    if start < t[0][1] and start - 0.5 > t[0][0]:  # the first word too long: the segment's start wins
        t[0][0] = max(0, min(t[0][1] - median, start))
    else:
        start = t[0][0]
    if end > t[-1][0] and end + 0.5 < t[-1][1]:  # the last word too long: the segment's end wins
        t[-1][1] = max(t[-1][0] + median, end)
    else:
        end = t[-1][1]
    timed = tuple(replace(w, start=a, end=b) for w, (a, b) in zip(words, t, strict=True))
    return replace(segment, start=start, end=end, words=timed)


def ctc_alignment(log_probs: Tensor, tokens: Sequence[int], blank: int) -> list[int]:
    """The CTC forced alignment of ``tokens`` (Graves et al., 2006): the likeliest path of CTC
    states through the per-frame log-probabilities that reads exactly ``tokens`` (blanks
    between, a repeated token with a blank between its two), by Viterbi over the 2N + 1 states
    [blank, y1, blank, y2, ..., yN, blank]. Returns each frame's token index in ``tokens`` (−1:
    blank); ValueError where the frames are too few to read them.

    Shapes: log_probs (S, V), tokens (N,) -> S indices.
    """
    frames, n = log_probs.shape[0], len(tokens)
    states = torch.full((2 * n + 1,), blank, dtype=torch.long)
    states[1::2] = torch.tensor(list(tokens), dtype=torch.long)
    # A state may be entered from itself, the state before, or (a token) the token before, unless
    # it is the same token: between two equal tokens the blank must be read.
    skip = torch.zeros(2 * n + 1, dtype=torch.bool)
    skip[3::2] = states[3::2] != states[1:-2:2]
    score = torch.full((2 * n + 1,), -torch.inf)
    score[:2] = log_probs[0, states[:2]].float()
    back = torch.zeros(frames, 2 * n + 1, dtype=torch.long)  # 0: stayed, 1: from the state before, 2: skipped
    for t in range(1, frames):
        before = F.pad(score[:-1], (1, 0), value=-torch.inf)  # (2N + 1,)
        skipped = F.pad(score[:-2], (2, 0), value=-torch.inf).masked_fill(~skip, -torch.inf)
        best, back[t] = torch.stack([score, before, skipped]).max(0)
        score = best + log_probs[t, states].float()
    last = 2 * n if n == 0 or score[2 * n] >= score[2 * n - 1] else 2 * n - 1
    if not torch.isfinite(score[last]):
        raise ValueError(f"{frames} frames are too few for CTC to read {n} tokens")
    path = [last]
    for t in range(frames - 1, 0, -1):
        path.append(path[-1] - int(back[t, path[-1]]))
    return [s // 2 if s % 2 else -1 for s in reversed(path)]


def ctc_words(
    log_probs: Tensor, tokens: Sequence[int], texts: Sequence[str], blank: int, frame_seconds: float
) -> tuple[Word, ...]:
    """The words of ``tokens`` timed by :func:`ctc_alignment`: a word starts at a token whose text
    (``texts``: each token's text after another, as ``Tokenizer.token_texts`` gives it) starts
    with a space, and runs from its first token's first frame to past its last token's last
    frame; its probability is the mean posterior of its tokens over the frames that read them.

    Shapes: log_probs (S, V), tokens (N,) -> words.
    """
    owner = torch.tensor(ctc_alignment(log_probs, tokens, blank))  # (S,)
    groups: list[list[int]] = []
    for k, token in enumerate(tokens):
        if not groups or texts[token].startswith(" "):
            groups.append([])
        groups[-1].append(k)
    out = []
    for group in groups:
        frames = torch.isin(owner, torch.tensor(group)).nonzero()[:, 0]  # every token has a frame
        probability = log_probs[frames, torch.tensor(tokens)[owner[frames]]].float().exp().mean()
        word = "".join(texts[tokens[k]] for k in group)
        start, end = float(frames[0]) * frame_seconds, float(frames[-1] + 1) * frame_seconds
        out.append(Word(word, round(start, 2), round(end, 2), float(probability)))
    return tuple(out)


@torch.no_grad()
def ctc_timed(
    model: SpeechEncoderDecoder, feats: Tensor, tokens: Sequence[int], texts: Sequence[str]
) -> tuple[Word, ...]:
    """The words of a transcript (``tokens``) of the features ``feats`` timed by the model's CTC
    head (:func:`ctc_words`); none where the head cannot read them in its frames.

    Shapes: feats (T, M) -> words.
    """
    device = next(model.parameters()).device
    memory, _ = model.encode(feats[None].to(device, next(model.parameters()).dtype))  # (1, S, D)
    log_probs = model.ctc_logits(memory)[0].float().log_softmax(-1).cpu()  # (S, V)
    seconds = feats.shape[0] * model.config.features.hop_length / model.config.features.sample_rate
    try:
        return ctc_words(log_probs, tokens, texts, model.config.blank, seconds / log_probs.shape[0])
    except ValueError:
        return ()
