"""Corpora from the Free Spoken Digit Dataset (FSDD):

  * :func:`fsdd_digits`: FSDD's standard split (recordings 0–4 of every digit and speaker are the
    test set, 5–49 the training set), listed in place, nothing built;
  * :func:`fsdd_digit_strings`: utterances of 1–7 digits ("three one four"), one speaker's
    recordings joined by random silences with light white noise, one speaker held out for the
    test set, built once into the cache (``cache.py``) on every core (``pool.py``).

What is not here: reading audio for a model (``qkv.audio``), synthetic speech (``espeak.py``).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import random
import re
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from qkv.data import data_root
from qkv.errors import UserError
from qkv.files import sha256_file
from qkv.speech_corpora.cache import SAMPLE_RATE, cached_corpus
from qkv.speech_corpora.manifests import Corpus, Utterance
from qkv.speech_corpora.pool import check_count, check_seed, run_all, stall, worker_count

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FSDD_TEST_INDICES = range(0, 5)  # the standard split: recordings 0–4 of every digit and speaker
DIGIT_STRING_LENGTHS = (1, 7)  # digits per utterance, inclusive
SILENCE_SECONDS = (0.05, 0.4)  # before, between and after the digits, uniform
_FSDD_NAME = re.compile(r"^(\d)_([A-Za-z]+)_(\d+)\.wav$")
_SPLIT_CODES = {"train": 0, "val": 1, "test": 2}


@dataclass(frozen=True)
class _Recording:
    path: Path
    digit: int
    speaker: str
    index: int


def _fsdd(data_dir: str | Path | None) -> list[_Recording]:
    folder = Path(data_dir).expanduser() if data_dir is not None else data_root() / "fsdd"
    recordings = folder / "recordings" if (folder / "recordings").is_dir() else folder
    found = []
    if recordings.is_dir():
        for path in sorted(recordings.iterdir()):
            m = _FSDD_NAME.match(path.name)
            if m:
                found.append(_Recording(path, int(m.group(1)), m.group(2), int(m.group(3))))
    if not found:
        raise UserError(
            f"no FSDD recordings ({{digit}}_{{speaker}}_{{index}}.wav) in {recordings}; "
            "pass data_dir or set QKV_DATA to the folder holding fsdd/"
        )
    return found


def fsdd_digits(data_dir: str | Path | None = None) -> Corpus:
    """FSDD's standard split, read in place (8 kHz WAV files; ``qkv.audio.load_audio`` resamples):
    "test" holds recordings 0–4 of every digit and speaker (300), "train" the rest (2,700). The
    transcript is the digit's English word ("zero" … "nine").

    ``data_dir``: the ``fsdd`` folder (or its ``recordings``), default ``$QKV_DATA/fsdd``.
    """
    import soundfile  # imported on use, as in audio.py

    recordings = _fsdd(data_dir)
    splits: dict[str, list[Utterance]] = {"train": [], "test": []}
    for r in recordings:
        info = soundfile.info(str(r.path))
        utterance = Utterance(r.path, DIGIT_WORDS[r.digit], r.speaker, info.frames / info.samplerate)
        splits["test" if r.index in FSDD_TEST_INDICES else "train"].append(utterance)
    return Corpus("fsdd-digits", recordings[0].path.parent, splits)


def valid_speeds(speeds: Sequence[float]) -> bool:
    """Whether ``speeds`` can perturb digit strings: one or more numbers from 0.5 to 2."""
    return bool(speeds) and all(
        isinstance(f, (int, float)) and not isinstance(f, bool) and 0.5 <= f <= 2 for f in speeds
    )


def fsdd_digit_strings(
    *,
    held_out: str | None,
    train_utterances: int,
    test_utterances: int,
    seed: int,
    snr_db: float = 30.0,
    speeds: Sequence[float] = (1.0,),
    cache: str | Path | None = None,
    data_dir: str | Path | None = None,
    workers: int | None = None,
) -> Corpus:
    """Strings of 1–7 spoken digits made from FSDD, built once and cached: "train" and "test".

    Each utterance takes one speaker (any but ``held_out`` in train, ``held_out`` in test, so the
    held-out speaker's recordings are only in test; ``held_out=None``: any speaker in both, as
    text-to-speech in every voice wants), draws its digits and, for each digit, one of
    that speaker's recordings of it, and joins them with silences of 0.05–0.4 s (also before the
    first and after the last). The 8 kHz signal is resampled to 16 kHz with soxr (as
    ``qkv.audio`` does) and white noise is added at ``snr_db`` below the speech's power. The
    transcript is the digits' words: "three one four". ``speeds``: each training string is
    played at one of these speeds, drawn at random (speed perturbation, Ko et al., 2015: 0.9, 1.0,
    1.1; a faster string is shorter and higher, as a smaller speaker's would be); test strings
    never. ``workers``: processes, default one per core.
    """
    recordings = _fsdd(data_dir)
    speakers = sorted({r.speaker for r in recordings})
    if held_out is not None and held_out not in speakers:
        raise UserError(f"held_out speaker {held_out!r} is not in FSDD (its speakers: {', '.join(speakers)})")
    check_count("train_utterances", train_utterances, allow_zero=True)
    check_count("test_utterances", test_utterances, allow_zero=True)
    check_seed(seed)
    if not isinstance(snr_db, (int, float)) or isinstance(snr_db, bool) or not 0 < snr_db < 200:
        raise UserError(f"snr_db must be a number of decibels above 0, got {snr_db!r}")
    speeds = tuple(speeds)
    if not valid_speeds(speeds):
        raise UserError(f"speeds must be one or more numbers from 0.5 to 2, got {list(speeds)!r}")
    import numpy
    import soundfile
    import soxr

    inputs = hashlib.sha256()
    for r in recordings:
        inputs.update(f"{r.path.name}\t{sha256_file(r.path)}\n".encode())
    key = {
        "inputs": {"fsdd/recordings": inputs.hexdigest()},
        "settings": {
            "held_out": held_out,
            "train_utterances": train_utterances,
            "test_utterances": test_utterances,
            "seed": seed,
            "snr_db": float(snr_db),
            "digits": DIGIT_STRING_LENGTHS,
            "silence_seconds": SILENCE_SECONDS,
            "sample_rate": SAMPLE_RATE,
            # Named only when used, so that the corpora built before speeds existed keep their key.
            **({"speeds": [float(f) for f in speeds]} if speeds != (1.0,) else {}),
        },
        "tools": {
            "numpy": numpy.__version__,
            "soxr": soxr.__version__,
            "libsndfile": soundfile.__libsndfile_version__,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",  # random.Random's draws
        },
    }
    by_speaker: dict[str, dict[int, list[Path]]] = {}
    for r in recordings:
        by_speaker.setdefault(r.speaker, {}).setdefault(r.digit, []).append(r.path)
    train_speakers = [s for s in speakers if s != held_out]

    def build(tmp: Path) -> dict[str, list[Utterance]]:
        jobs = []
        for split, count in (("train", train_utterances), ("test", test_utterances)):
            (tmp / "audio" / split).mkdir(parents=True)
            for index in range(count):
                rng = random.Random(f"qkv fsdd digit strings/{seed}/{split}/{index}")
                speaker = held_out if split == "test" and held_out is not None else rng.choice(train_speakers)
                digits = [rng.randrange(10) for _ in range(rng.randint(*DIGIT_STRING_LENGTHS))]
                parts = [rng.choice(by_speaker[speaker][d]) for d in digits]
                silences = [rng.uniform(*SILENCE_SECONDS) for _ in range(len(digits) + 1)]
                noise_seed = (seed, _SPLIT_CODES[split], index)
                # Drawn last, so that every other draw is the same whatever the speeds.
                speed = float(rng.choice(speeds)) if split == "train" and speeds != (1.0,) else 1.0
                out = tmp / "audio" / split / f"{index:06d}.flac"
                jobs.append((split, speaker, digits, parts, silences, snr_db, noise_seed, speed, out))
        n = worker_count(workers)
        context = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
        executor = ProcessPoolExecutor(n, mp_context=context) if n > 1 and jobs else None
        results = run_all([job[3:] for job in jobs], _digit_string, executor, desc=f"FSDD digit strings ({n} workers)")
        splits: dict[str, list[Utterance]] = {"train": [], "test": []}
        for (split, speaker, digits, *_, out), seconds in zip(jobs, results, strict=True):
            splits[split].append(Utterance(out, " ".join(DIGIT_WORDS[d] for d in digits), speaker, seconds))
        return splits

    return cached_corpus("fsdd-digit-strings", key, cache, build)


def _digit_string(
    parts: list[Path],
    silences: list[float],
    snr_db: float,
    noise_seed: tuple[int, int, int],
    speed: float,
    out: Path,
) -> float:
    """Write one digit string (a worker's job): the recordings ``parts`` with ``silences`` around
    and between them, at 16 kHz with noise, played at ``speed``; its length in seconds."""
    import numpy as np
    import soundfile
    import soxr

    stall(noise_seed[2])
    pieces, speech = [], []
    rate = None
    for i, path in enumerate(parts):
        samples, file_rate = soundfile.read(str(path), dtype="float32", always_2d=True)  # (Y, channels)
        mono = samples.mean(axis=1)
        rate = rate or file_rate
        if file_rate != rate:
            mono = soxr.resample(mono, file_rate, rate)
        pieces += [np.zeros(round(silences[i] * rate), dtype=np.float32), mono]
        speech.append(mono)
    pieces.append(np.zeros(round(silences[-1] * rate), dtype=np.float32))
    signal = np.concatenate(pieces)
    if rate * speed != SAMPLE_RATE:
        # Read as if sampled speed times faster: 1/speed of the length, every frequency times speed.
        signal = soxr.resample(signal, rate * speed, SAMPLE_RATE)
    power = float(np.mean(np.square(np.concatenate(speech), dtype=np.float64)))
    rng = np.random.default_rng(list(noise_seed))
    noisy = signal.astype(np.float64) + rng.standard_normal(len(signal)) * np.sqrt(power / 10 ** (snr_db / 10))
    pcm = np.clip(np.round(noisy * 32768), -32768, 32767).astype(np.int16)
    soundfile.write(str(out), pcm, SAMPLE_RATE, format="FLAC", subtype="PCM_16")
    return len(pcm) / SAMPLE_RATE
