"""What a speech corpus is: :class:`Utterance` (an audio file, its transcript, its speaker, its
length and, for speech translation, the ``target`` text), :class:`Corpus` (named splits of
utterances, read back from a cache entry with :meth:`Corpus.load`) and the manifests that list
them (:func:`read_manifest`; :func:`manifest_text` writes one).

What is not here: building corpora (``fsdd.py``, ``espeak.py``) and the cache they are built
into (``cache.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qkv.data import read_lines
from qkv.errors import UserError
from qkv.files import read_json_object


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
        if not 0 < seconds < math.inf:  # NaN fails too: a length batches are made by
            raise UserError(f"{path}:{number}: seconds must be a positive finite number, got {fields[1]!r}")
        target = fields[4] if width == 5 else None
        utterances.append(Utterance(path.parent / fields[0], fields[3], fields[2], seconds, target))
    if not utterances:
        raise UserError(f"{path} has no utterances: only its header line")
    return utterances


def manifest_text(utterances: Sequence[Utterance], entry: Path, *, targets: bool) -> str:
    """The manifest :func:`read_manifest` reads back: paths relative to ``entry``, the target
    column only with ``targets``."""
    rows = ["\t".join(MANIFEST_COLUMNS if targets else MANIFEST_COLUMNS[:4])]
    for u in utterances:
        fields = [u.path.relative_to(entry).as_posix(), repr(u.seconds), u.speaker, u.text]
        rows.append("\t".join([*fields, u.target or ""] if targets else fields))
    return "\n".join(rows) + "\n"
