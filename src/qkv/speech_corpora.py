"""Speech corpora that qkv builds itself: real digits (FSDD) and synthetic captions (espeak-ng),
cached, deterministic to the byte, built in parallel on every core with progress.

What is here:
  * :class:`Utterance` (an audio file, its transcript, its speaker, its length and, for speech
    translation, the ``target`` text) and :class:`Corpus` (named splits of utterances, read back
    from a cache entry with :meth:`Corpus.load`);
  * :func:`fsdd_digits`: the Free Spoken Digit Dataset's standard split (recordings 0–4 of every
    digit and speaker are the test set, 5–49 the training set), listed in place, nothing built;
  * :func:`fsdd_digit_strings`: utterances of 1–7 digits ("three one four"), one speaker's
    recordings joined by random silences with light white noise, one speaker held out for the
    test set;
  * :func:`espeak_phonemes`: texts in IPA phonemes (text-to-speech's phoneme input);
  * :func:`espeak_corpus`: Multi30k's captions (train, val, test2016) spoken by ``espeak-ng``
    (one process per sentence, piped through ``sox`` to 16 kHz) with voices, variants, speeds and
    pitches drawn per sentence; val and test are spoken only by variants never used in training.
    For ``language="de"`` the German caption is the transcript and the English one the target.

The cache (:func:`cache_root`: ``$QKV_CACHE``, else ``$XDG_CACHE_HOME/qkv``, else
``~/.cache/qkv``) holds one directory per corpus under ``speech/``, named by the corpus and a
hash of everything that determines its bytes: the SHA-256 of every input file, the generator's
settings, the seed and the versions of the tools (``espeak-ng --version``, ``sox --version``;
numpy, soxr and libsndfile for the digit strings). An entry::

    speech/fsdd-digit-strings-0123456789abcdef/
        corpus.json          the name, the key (inputs, settings, tools), utterances and hours per split
        train.tsv test.tsv   manifests: path (relative to the entry), seconds, speaker, text[, target]
        audio/train/000000.flac ...

Audio is FLAC, 16 kHz, 16-bit mono: lossless, so a model reads the very samples a WAV would
hold, at about 55% of a WAV's size on espeak's speech (pauses compress well), and read by
``soundfile`` (``qkv.audio.load_audio``) like a WAV. An entry is built in a temporary sibling
(``qkv.files.atomic_directory``: every file flushed, then one rename), under a lock file, so a
half-written entry is never used; a build that was killed leaves only its temporary sibling,
which the next build removes before it builds the entry again.

Each utterance's random choices come from a generator seeded with (seed, split, index), so the
bytes do not depend on the number of workers. The tools are needed only to build (and, for
espeak corpora, to compute the key): without them qkv imports and runs, and building a corpus
that needs one is a one-line UserError naming it.

What is not here: reading audio and features (``audio.py``), tokenizing transcripts, batching.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from qkv.data import data_root, read_lines, read_parallel, resolve
from qkv.errors import UserError
from qkv.files import atomic_directory, check_writable, read_json_object
from qkv.progress import progress

try:
    import fcntl
except ImportError:  # Windows: builds are not locked against each other there
    fcntl = None  # type: ignore[assignment]

SAMPLE_RATE = 16_000  # = qkv.audio.SAMPLE_RATE (not imported: audio.py loads torch, the builders need none)
FORMAT = 1  # the layout of a cache entry; a change makes every key new
CACHE_ENV = "QKV_CACHE"
STALL_ENV = "QKV_SPEECH_STALL_AT"  # tests only: a build stops (sleeps) at this utterance index, to be killed

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FSDD_TEST_INDICES = range(0, 5)  # the standard split: recordings 0–4 of every digit and speaker
DIGIT_STRING_LENGTHS = (1, 7)  # digits per utterance, inclusive
SILENCE_SECONDS = (0.05, 0.4)  # before, between and after the digits, uniform
_FSDD_NAME = re.compile(r"^(\d)_([A-Za-z]+)_(\d+)\.wav$")

# espeak-ng's built-in voices (mbrola voices need the separate mbrola program) and variants
# (espeak-ng --voices=variant). Variants change the voice's formants, pitch and breathiness.
ESPEAK_VOICES = {
    "en": ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029", "en-us-nyc"),
    "de": ("de",),
}
TRAIN_VARIANTS = ("m1", "m2", "m3", "m4", "m5", "f1", "f2", "f3", "klatt", "klatt2", "Andy", "Annie")
TEST_VARIANTS = ("m6", "m7", "f4", "f5", "klatt3")  # never in training: val and test speak only with these
SPEEDS = (140, 200)  # words per minute, inclusive (espeak-ng's default is 175)
PITCHES = (30, 70)  # 0..99, inclusive (default 50)
MULTI30K_SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
_SPLIT_CODES = {"train": 0, "val": 1, "test": 2}


# ---------------------------------------------------------------------------------------------
# What a corpus is
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Utterance:
    """One recording: its audio file, what is said, who says it, how long it is (seconds) and,
    for speech translation, the text in the other language (``target``; None otherwise)."""

    path: Path
    text: str
    speaker: str
    seconds: float
    target: str | None = None


@dataclass(frozen=True, eq=False)
class Corpus:
    """Named splits ("train", "val", "test") of utterances; ``root`` is the cache entry (or, for
    a corpus listed in place, the folder of its recordings)."""

    name: str
    root: Path
    splits: Mapping[str, list[Utterance]] = field(default_factory=dict)

    def __getitem__(self, split: str) -> list[Utterance]:
        if split not in self.splits:
            raise UserError(f"corpus {self.name} has no split {split!r} (it has {', '.join(self.splits)})")
        return self.splits[split]

    def hours(self, split: str) -> float:
        return sum(u.seconds for u in self[split]) / 3600

    @staticmethod
    def load(entry: str | Path) -> Corpus:
        """A built corpus from its cache entry (``corpus.json`` and one manifest per split)."""
        entry = Path(entry)
        meta = read_json_object(entry / "corpus.json")
        return Corpus(meta["name"], entry, {split: read_manifest(entry / f"{split}.tsv") for split in meta["splits"]})


MANIFEST_COLUMNS = ("path", "seconds", "speaker", "text", "target")


def read_manifest(path: str | Path) -> list[Utterance]:
    """The utterances of a manifest: a TSV with a header, columns path (relative to the
    manifest's folder, or absolute), seconds, speaker, text and optionally target."""
    path = Path(path)
    lines = read_lines(path)
    if not lines or tuple(lines[0].split("\t")) not in (MANIFEST_COLUMNS[:4], MANIFEST_COLUMNS):
        raise UserError(f"{path}:1: expected the header {chr(9).join(MANIFEST_COLUMNS[:4])}[<TAB>target]")
    width = len(lines[0].split("\t"))
    utterances = []
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split("\t")
        if len(fields) != width:
            raise UserError(f"{path}:{number}: expected {width} tab-separated fields, found {len(fields)}")
        try:
            seconds = float(fields[1])
        except ValueError:
            raise UserError(f"{path}:{number}: seconds {fields[1]!r} is not a number") from None
        target = fields[4] if width == 5 else None
        utterances.append(Utterance(path.parent / fields[0], fields[3], fields[2], seconds, target))
    return utterances


def _manifest(utterances: Sequence[Utterance], entry: Path, *, targets: bool) -> str:
    rows = ["\t".join(MANIFEST_COLUMNS if targets else MANIFEST_COLUMNS[:4])]
    for u in utterances:
        fields = [u.path.relative_to(entry).as_posix(), repr(u.seconds), u.speaker, u.text]
        rows.append("\t".join([*fields, u.target or ""] if targets else fields))
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """Where qkv caches what it builds: ``$QKV_CACHE``, else ``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "qkv"
    return Path.home() / ".cache" / "qkv"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (made if missing); the kernel releases it when
    the process ends, however it ends."""
    with open(path, "a+b") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


def _cached(
    name: str, key: dict, cache: str | Path | None, build: Callable[[Path], dict[str, list[Utterance]]]
) -> Corpus:
    """The corpus of ``key`` from the cache, built by ``build(directory) -> splits`` when missing."""
    key = {"format": FORMAT, "corpus": name, **key}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    folder = Path(cache).expanduser() if cache is not None else cache_root()
    folder = folder / "speech"
    entry = folder / f"{name}-{digest[:16]}"
    if (entry / "corpus.json").is_file():
        return Corpus.load(entry)
    check_writable(folder, inside=True)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / f"{entry.name}.lock"):
        if (entry / "corpus.json").is_file():  # another process built it while this one waited
            return Corpus.load(entry)
        for stale in folder.glob(f".{entry.name}.*"):  # left by a build that was killed (the lock is free)
            shutil.rmtree(stale, ignore_errors=True)
        print(f"qkv: building the speech corpus {name} in {entry} (once: it is cached)", file=sys.stderr, flush=True)
        with atomic_directory(entry) as tmp:
            splits = build(tmp)
            targets = any(u.target is not None for us in splits.values() for u in us)
            for split, utterances in splits.items():
                moved = [_moved(u, tmp, entry) for u in utterances]
                (tmp / f"{split}.tsv").write_text(_manifest(moved, entry, targets=targets), encoding="utf-8")
            meta = {
                "name": name,
                "key": key,
                "splits": {split: len(us) for split, us in splits.items()},
                "hours": {split: round(sum(u.seconds for u in us) / 3600, 4) for split, us in splits.items()},
                "audio": "FLAC, 16 kHz, 16-bit, mono",
            }
            (tmp / "corpus.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return Corpus.load(entry)


def _moved(u: Utterance, tmp: Path, entry: Path) -> Utterance:
    return Utterance(entry / u.path.relative_to(tmp), u.text, u.speaker, u.seconds, u.target)


def _workers(workers: int | None) -> int:
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise UserError(f"workers must be a positive integer, got {workers!r}")
        return workers
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))  # the cores this process may run on
    return os.cpu_count() or 1


def _run_all(jobs: Sequence[tuple], work: Callable, executor: Executor | None, *, desc: str) -> list:
    """``work(*job)`` for every job, on ``executor`` (None: here, one by one), with progress; the
    results in the jobs' order."""
    results: list = [None] * len(jobs)
    bar = progress(len(jobs), desc=desc, unit="utterance")
    try:
        if executor is None:
            for i, job in enumerate(jobs):
                results[i] = work(*job)
                bar.update(1)
        else:
            futures = {executor.submit(work, *job): i for i, job in enumerate(jobs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update(1)
    finally:
        bar.close()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
    return results


def _stall(index: int) -> None:
    """Tests only: stop for good at utterance ``$QKV_SPEECH_STALL_AT`` so the build can be killed midway."""
    at = os.environ.get(STALL_ENV)
    if at and index >= int(at):
        time.sleep(3600)


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError(f"seed must be a non-negative integer, got {seed!r}")


def _check_count(name: str, value: int, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise UserError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")


# ---------------------------------------------------------------------------------------------
# FSDD: the standard split, and digit strings
# ---------------------------------------------------------------------------------------------


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
    _check_count("train_utterances", train_utterances, allow_zero=True)
    _check_count("test_utterances", test_utterances, allow_zero=True)
    _check_seed(seed)
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
        n = _workers(workers)
        context = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
        executor = ProcessPoolExecutor(n, mp_context=context) if n > 1 and jobs else None
        results = _run_all([job[3:] for job in jobs], _digit_string, executor, desc=f"FSDD digit strings ({n} workers)")
        splits: dict[str, list[Utterance]] = {"train": [], "test": []}
        for (split, speaker, digits, *_, out), seconds in zip(jobs, results, strict=True):
            splits[split].append(Utterance(out, " ".join(DIGIT_WORDS[d] for d in digits), speaker, seconds))
        return splits

    return _cached("fsdd-digit-strings", key, cache, build)


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

    _stall(noise_seed[2])
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


# ---------------------------------------------------------------------------------------------
# espeak-ng: Multi30k captions, spoken
# ---------------------------------------------------------------------------------------------

_INSTALL = "install it (Debian/Ubuntu: apt-get install espeak-ng sox; or run scripts/setup.sh as root)"


def _tool(name: str, corpus: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise UserError(f"{name} not found on PATH; it is needed to build the speech corpus {corpus}: {_INSTALL}")
    return path


def _version(tool: str) -> str:
    """The first line of ``tool --version`` (the program's name and version)."""
    done = subprocess.run([tool, "--version"], capture_output=True, text=True, check=False)
    return (done.stdout or done.stderr).strip().splitlines()[0].strip() if (done.stdout or done.stderr) else ""


def _espeak_names(espeak: str) -> tuple[set[str], set[str]]:
    """The voices (languages and voice files, lower case) and variants espeak-ng knows."""

    def listing(*args: str) -> list[str]:
        return subprocess.run([espeak, *args], capture_output=True, text=True, check=False).stdout.splitlines()[1:]

    voices = set()
    for line in listing("--voices"):
        fields = line.split()
        if len(fields) >= 5:
            voices |= {fields[1].lower(), fields[3].lower(), fields[4].rsplit("/", 1)[-1].lower()}
    variants = set()
    for line in listing("--voices=variant"):
        m = re.search(r"!v/(.*?)(?:\s{2,}|$)", line)
        if m:
            variants.add(m.group(1).strip())
    return voices, variants


def _range(name: str, value: Sequence[int], low: int, high: int) -> tuple[int, int]:
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and low <= value[0] <= value[1] <= high
    )
    if not ok:
        raise UserError(f"{name} must be [lowest, highest], integers within {low}..{high}, got {value!r}")
    return (value[0], value[1])


def _names(name: str, value: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise UserError(f"{name} must be a non-empty list of names, got {value!r}")
    return tuple(value)


def espeak_corpus(
    *,
    language: str,
    sentences: int | None = None,
    voices: Sequence[str] | None = None,
    train_variants: Sequence[str] = TRAIN_VARIANTS,
    test_variants: Sequence[str] = TEST_VARIANTS,
    speeds: Sequence[int] = SPEEDS,
    pitches: Sequence[int] = PITCHES,
    seed: int = 0,
    cache: str | Path | None = None,
    data_dir: str | Path | None = None,
    workers: int | None = None,
    unseen_test_voices: bool = True,
) -> Corpus:
    """Multi30k's captions in ``language`` ("en" or "de") spoken by espeak-ng, built once and
    cached: splits "train" (29,000), "val" (1,014) and "test" (test2016, 1,000).

    Every sentence is spoken once, by a voice from ``voices`` (default: espeak-ng's built-in
    voices of the language, :data:`ESPEAK_VOICES`), a variant from ``train_variants`` (train) or
    ``test_variants`` (val and test; the two lists must not share a name), a speed in words per
    minute drawn from ``speeds`` and a pitch (0–99) from ``pitches`` (inclusive ranges), all
    drawn from (seed, split, index). The speaker is "voice+variant". For "de" the transcript is
    the German caption and ``target`` the English one (speech translation). Runs of white space
    in a caption become one space. ``sentences``: only the first that many of each split
    (None: all). ``data_dir``: the ``multi30k`` folder, default ``$QKV_DATA/multi30k``.
    ``workers``: sentences spoken at once, default one per core. ``unseen_test_voices=False``
    lets val and test share the training variants (one voice for text-to-speech, whose test
    sentences are references in the voice it learnt).
    """
    if language not in ESPEAK_VOICES:
        raise UserError(f"language must be one of {', '.join(ESPEAK_VOICES)}, got {language!r}")
    if sentences is not None:
        _check_count("sentences", sentences)
    _check_seed(seed)
    voices = _names("voices", voices if voices is not None else ESPEAK_VOICES[language])
    train_variants, test_variants = _names("train_variants", train_variants), _names("test_variants", test_variants)
    shared = sorted(set(train_variants) & set(test_variants))
    if shared and unseen_test_voices:
        raise UserError(f"test_variants must differ from train_variants; both hold {', '.join(shared)}")
    speeds, pitches = _range("speeds", speeds, 80, 450), _range("pitches", pitches, 0, 99)
    name = f"espeak-multi30k-{language}"
    espeak, sox = _tool("espeak-ng", name), _tool("sox", name)
    known_voices, known_variants = _espeak_names(espeak)
    for v in voices:
        if v.lower() not in known_voices:
            raise UserError(f"espeak-ng has no voice {v!r} (espeak-ng --voices lists them)")
    for v in (*train_variants, *test_variants):
        if v not in known_variants:
            raise UserError(f"espeak-ng has no variant {v!r} (espeak-ng --voices=variant lists them)")

    folder = Path(data_dir).expanduser() if data_dir is not None else Path("multi30k")
    texts: dict[str, list[tuple[str, str | None]]] = {}
    files: dict[str, str] = {}
    for split, stem in MULTI30K_SPLITS.items():
        if language == "de":
            source, target = resolve(folder / f"{stem}.de"), resolve(folder / f"{stem}.en")
            pairs: list[tuple[str, str | None]] = list(read_parallel(source, target))
            paths = [source, target]
        else:
            source = resolve(folder / f"{stem}.en")
            pairs = [(line, None) for line in read_lines(source)]
            paths = [source]
            for number, (line, _) in enumerate(pairs, start=1):
                if not line.strip():
                    raise UserError(f"{source}:{number}: empty line (every line must hold a sentence)")
        texts[split] = [(_one_line(s), _one_line(t) if t is not None else None) for s, t in pairs[:sentences]]
        files.update({p.name: sha256_file(p) for p in paths})
    key = {
        "inputs": files,
        "settings": {
            "language": language,
            "sentences": sentences,
            "voices": voices,
            "train_variants": train_variants,
            "test_variants": test_variants,
            "speeds": speeds,
            "pitches": pitches,
            "seed": seed,
            "sample_rate": SAMPLE_RATE,
            # Only when set: the keys of corpora built before this option existed stay the same.
            **({} if unseen_test_voices else {"unseen_test_voices": False}),
        },
        "tools": {
            "espeak-ng": _version(espeak),
            "sox": _version(sox),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",  # random.Random's draws
        },
    }

    def build(tmp: Path) -> dict[str, list[Utterance]]:
        jobs, meta = [], []
        for split, pairs in texts.items():
            (tmp / "audio" / split).mkdir(parents=True)
            variants = train_variants if split == "train" else test_variants
            for index, (text, target) in enumerate(pairs):
                rng = random.Random(f"qkv espeak/{seed}/{split}/{index}")
                voice, variant = rng.choice(voices), rng.choice(variants)
                speed, pitch = rng.randint(*speeds), rng.randint(*pitches)
                out = tmp / "audio" / split / f"{index:06d}.flac"
                jobs.append((espeak, sox, f"{voice}+{variant}", speed, pitch, text, out, index))
                meta.append((split, text, target, f"{voice}+{variant}", out))
        n = _workers(workers)
        # Threads suffice: each job's work is done by its two processes (espeak-ng, then sox).
        executor = ThreadPoolExecutor(n) if n > 1 and jobs else None
        results = _run_all(jobs, _speak, executor, desc=f"espeak-ng Multi30k {language} ({n} workers)")
        splits: dict[str, list[Utterance]] = {split: [] for split in texts}
        for (split, text, target, speaker, out), seconds in zip(meta, results, strict=True):
            splits[split].append(Utterance(out, text, speaker, seconds, target))
        return splits

    return _cached(name, key, cache, build)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _speak(espeak: str, sox: str, voice: str, speed: int, pitch: int, text: str, out: Path, index: int) -> float:
    """Speak ``text`` into the FLAC file ``out`` (espeak-ng's 22,050 Hz WAV piped through sox,
    which resamples to 16 kHz without dither, so the bytes repeat); its length in seconds."""
    import soundfile

    _stall(index)
    speak = [espeak, "-b", "1", "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout"]  # -b 1: UTF-8 text
    wav = subprocess.run(speak, input=text.encode(), capture_output=True, check=False)
    if wav.returncode != 0 or not wav.stdout:
        raise UserError(f"espeak-ng failed to speak {text!r} with voice {voice}: {_last_line(wav.stderr)}")
    convert = [
        sox,
        "-V1",
        "-R",
        "-D",
        "-t",
        "wav",
        "-",
        "-r",
        str(SAMPLE_RATE),
        "-b",
        "16",
        "-c",
        "1",
        "-t",
        "flac",
        str(out),
    ]
    done = subprocess.run(convert, input=wav.stdout, capture_output=True, check=False)
    if done.returncode != 0:
        raise UserError(f"sox failed to convert espeak-ng's audio of {text!r}: {_last_line(done.stderr)}")
    return soundfile.info(str(out)).frames / SAMPLE_RATE


def espeak_phonemes(texts: Sequence[str], *, voice: str = "en-us", workers: int | None = None) -> list[str]:
    """Each text's phonemes in IPA, as ``espeak-ng -q --ipa -v VOICE`` writes them (one process
    per text, ``workers`` at once, default one per core), its lines joined by a space: what a
    text-to-speech model reads with ``data.symbols: phonemes``. A UserError names the text
    espeak-ng fails on, or the missing tool."""
    espeak = _tool("espeak-ng", "phonemes")

    def one(text: str) -> str:
        done = subprocess.run(
            [espeak, "-q", "--ipa", "-b", "1", "-v", voice], input=text.encode(), capture_output=True, check=False
        )
        if done.returncode != 0:
            raise UserError(f"espeak-ng failed on {text!r} with voice {voice}: {_last_line(done.stderr)}")
        return " ".join(done.stdout.decode(errors="replace").split())

    n = _workers(workers)
    if n == 1 or len(texts) < 2:
        return [one(t) for t in texts]
    with ThreadPoolExecutor(n) as pool:  # each job's work is done by its espeak-ng process
        return list(pool.map(one, texts))


def _last_line(stderr: bytes) -> str:
    lines = stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"
