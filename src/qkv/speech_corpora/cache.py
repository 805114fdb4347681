"""The cache of built speech corpora: where it is (:func:`cache_root`) and how an entry is built
once, atomically, under a lock (:func:`cached_corpus`).

The cache (``$QKV_CACHE``, else ``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``) holds one
directory per corpus under ``speech/``, named by the corpus and a hash of everything that
determines its bytes: the SHA-256 of every input file, the generator's settings, the seed and the
versions of the tools (``espeak-ng --version``, ``sox --version``; numpy, soxr and libsndfile for
the digit strings). An entry::

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

What is not here: the corpora's keys and builders (``fsdd.py``, ``espeak.py``), the manifests'
format (``manifests.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from qkv.files import atomic_directory, check_writable
from qkv.speech_corpora.manifests import Corpus, Utterance, manifest_text

try:
    import fcntl
except ImportError:  # Windows: builds are not locked against each other there
    fcntl = None  # type: ignore[assignment]

SAMPLE_RATE = 16_000  # = qkv.audio.SAMPLE_RATE (not imported: audio.py loads torch, the builders need none)
FORMAT = 1  # the layout of a cache entry; a change makes every key new
CACHE_ENV = "QKV_CACHE"


def cache_root() -> Path:
    """Where qkv caches what it builds: ``$QKV_CACHE``, else ``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "qkv"
    return Path.home() / ".cache" / "qkv"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (made if missing); the kernel releases it when
    the process ends, however it ends."""
    with open(path, "a+b") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


def cached_corpus(
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
                (tmp / f"{split}.tsv").write_text(manifest_text(moved, entry, targets=targets), encoding="utf-8")
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
