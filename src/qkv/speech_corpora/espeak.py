"""Speech synthesized by ``espeak-ng``:

  * :func:`espeak_corpus`: Multi30k's captions (train, val, test2016) spoken by ``espeak-ng``
    (one process per sentence, piped through ``sox`` to 16 kHz) with voices, variants, speeds and
    pitches drawn per sentence; val and test are spoken only by variants never used in training.
    For ``language="de"`` the German caption is the transcript and the English one the target.
    Built once into the cache (``cache.py``) on every core (``pool.py``);
  * :func:`espeak_phonemes`: texts in IPA phonemes (text-to-speech's phoneme input).

The tools are needed only to build (and to compute a corpus's key, which holds their versions):
without them qkv imports and runs, and building a corpus that needs one is a one-line UserError
naming it.

What is not here: recorded speech (``fsdd.py``), reading audio for a model (``qkv.audio``).
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from qkv.data import read_lines, read_parallel, resolve
from qkv.errors import UserError
from qkv.files import sha256_file
from qkv.speech_corpora.cache import SAMPLE_RATE, cached_corpus
from qkv.speech_corpora.manifests import Corpus, Utterance
from qkv.speech_corpora.pool import check_count, check_seed, run_all, stall, worker_count

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
        check_count("sentences", sentences)
    check_seed(seed)
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
        n = worker_count(workers)
        # Threads suffice: each job's work is done by its two processes (espeak-ng, then sox).
        executor = ThreadPoolExecutor(n) if n > 1 and jobs else None
        results = run_all(jobs, _speak, executor, desc=f"espeak-ng Multi30k {language} ({n} workers)")
        splits: dict[str, list[Utterance]] = {split: [] for split in texts}
        for (split, text, target, speaker, out), seconds in zip(meta, results, strict=True):
            splits[split].append(Utterance(out, text, speaker, seconds, target))
        return splits

    return cached_corpus(name, key, cache, build)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _speak(espeak: str, sox: str, voice: str, speed: int, pitch: int, text: str, out: Path, index: int) -> float:
    """Speak ``text`` into the FLAC file ``out`` (espeak-ng's 22,050 Hz WAV piped through sox,
    which resamples to 16 kHz without dither, so the bytes repeat); its length in seconds."""
    import soundfile

    stall(index)
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

    n = worker_count(workers)
    if n == 1 or len(texts) < 2:
        return [one(t) for t in texts]
    with ThreadPoolExecutor(n) as pool:  # each job's work is done by its espeak-ng process
        return list(pool.map(one, texts))


def _last_line(stderr: bytes) -> str:
    lines = stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no message"
