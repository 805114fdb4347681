"""Data files: where the shared corpora live, and reading text with errors that name the line.

What is here: :func:`data_root` (``$QKV_DATA``, else ``../shared/data`` beside the project),
:func:`resolve` (a recipe's data path: as given, or under the data root),
:func:`read_text` and :func:`read_lines` (UTF-8, bad bytes reported as file:line), :func:`read_parallel` (aligned
sentence pairs from two files or a TSV, validated line by line),
:func:`batches_by_tokens` (length-bucketed batches under a token budget, shuffled per seed),
:func:`read_labelled` (a ``text<TAB>label`` TSV) and :func:`read_dailydialog` (DailyDialog's
dialogues split into utterances, with their dialog-act or emotion labels; a dialogue whose
label count differs from its utterance count is reported and skipped).
Corpora are read from there, never copied into the repository.

What is not here: tokenization (``tokenization.py``), batching (``losses.py``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from pathlib import Path

from qkv.errors import UserError

_PROJECT = Path(__file__).resolve().parents[2]  # src/qkv/data.py -> the project root


def data_root() -> Path:
    """``$QKV_DATA`` if set, else ``../shared/data`` next to the project (or the working directory)."""
    if os.environ.get("QKV_DATA"):
        return Path(os.environ["QKV_DATA"])
    for base in (Path.cwd(), _PROJECT):
        candidate = base.parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return _PROJECT.parent / "shared" / "data"


def resolve(path: str | Path) -> Path:
    """A data path as given if it exists, else relative to :func:`data_root`; UserError if neither."""
    given = Path(path).expanduser()
    if given.is_file():
        return given
    under_root = data_root() / given
    if not given.is_absolute() and under_root.is_file():
        return under_root
    if given.is_dir():
        raise UserError(f"{path} is a directory; give a file")
    raise UserError(f"data file {path} not found (also looked in {under_root}; set QKV_DATA to the data folder)")


def read_text(path: str | Path) -> str:
    """The whole file as text; invalid UTF-8 is a UserError naming the file and line."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not valid UTF-8 ({e.reason})") from None


def decode_lines(raw_lines: Iterable[bytes], name: str, *, first: int = 1) -> list[str]:
    """UTF-8 lines (bytes, e.g. a binary file or stdin's buffer) without their line ends;
    bad bytes are a UserError naming ``name`` and the line (``first``: the number of the first
    line given, for a reader that decodes line by line)."""
    lines = []
    for number, raw in enumerate(raw_lines, start=first):
        try:
            lines.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as e:
            raise UserError(f"{name}:{number}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    return lines


def read_lines(path: str | Path) -> list[str]:
    """Lines of a UTF-8 text file (see :func:`decode_lines`); a missing or unreadable file is a UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"input file {path} does not exist")
    try:
        with open(path, "rb") as f:
            return decode_lines(f, str(path))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None


def read_parallel(source: str | Path, target: str | Path | None = None) -> list[tuple[str, str]]:
    """Aligned sentence pairs from two files (line i with line i) or, with one path, a TSV of
    ``source<TAB>target`` lines.

    Refused with a UserError naming file and line: unequal line counts, an empty line on
    either side, a TSV line without exactly one tab, invalid UTF-8. A final empty line (a
    trailing newline) is not a sentence and is ignored.
    """
    if target is None:
        return _read_two_columns(resolve(source), ("source", "target"))
    src_path, tgt_path = resolve(source), resolve(target)
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        longer, shorter = (src_path, tgt_path) if len(src) > len(tgt) else (tgt_path, src_path)
        raise UserError(
            f"{longer}:{min(len(src), len(tgt)) + 1}: no matching line in {shorter} "
            f"({src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}); they must be aligned"
        )
    for path, lines in ((src_path, src), (tgt_path, tgt)):
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                raise UserError(f"{path}:{number}: empty line (every line must hold a sentence)")
    return list(zip(src, tgt, strict=True))


def batches_by_tokens(lengths: list[int], *, max_tokens: int, seed: int) -> list[list[int]]:
    """Group example indices into batches of at most ``max_tokens`` padded tokens.

    Examples are sorted by length (so a batch pads little), cut into batches whose longest
    example times the batch size stays within ``max_tokens``, and the batches shuffled with
    ``seed`` (one order per epoch: pass seed + epoch). An example longer than ``max_tokens``
    gets a batch of its own.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and max(lengths[i], lengths[current[-1]]) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    random.Random(seed).shuffle(batches)
    return batches


def read_labelled(path: str | Path) -> list[tuple[str, str]]:
    """(text, label) pairs of a ``text<TAB>label`` TSV (any label strings; outer spaces stripped).

    Refused with a UserError naming file and line: a line without exactly one tab, an empty
    text or an empty label, invalid UTF-8. A final newline is not a line.
    """
    return [(text.strip(), label.strip()) for text, label in _read_two_columns(resolve(path), ("text", "label"))]


def _read_two_columns(path: Path, names: tuple[str, str]) -> list[tuple[str, str]]:
    """The two tab-separated fields of every line; a line without exactly one tab or with an
    empty (all-blank) field is a UserError naming file, line and field."""
    rows = []
    for number, line in enumerate(read_lines(path), start=1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise UserError(f"{path}:{number}: expected {names[0]}<TAB>{names[1]}, found {len(fields)} field(s)")
        for name, text in zip(names, fields, strict=True):
            if not text.strip():
                raise UserError(f"{path}:{number}: the {name} is empty")
        rows.append((fields[0], fields[1]))
    return rows


# DailyDialog's label files hold numbers; these are their names, in the order of the numbers.
DAILYDIALOG_LABELS = {
    "act": ("inform", "question", "directive", "commissive"),  # 1, 2, 3, 4
    "emotion": ("no emotion", "anger", "disgust", "fear", "happiness", "sadness", "surprise"),  # 0 .. 6
}
_FIRST_LABEL = {"act": 1, "emotion": 0}
EOU = "__eou__"  # DailyDialog's end-of-utterance marker


def read_dailydialog(
    folder: str | Path, split: str, *, labels: str | None = None
) -> tuple[list[list[tuple[str, str | None]]], list[str]]:
    """The dialogues of DailyDialog's ``split`` ("train", "validation"), and the problems found.

    ``folder`` holds ``dialogues_{split}.txt`` (one dialogue per line, utterances ended by
    `` __eou__ ``) and, when ``labels`` is "act" or "emotion", ``dialogues_{labels}_{split}.txt``
    (one number per utterance); it is taken as given, else under :func:`data_root`. A dialogue
    is a list of (utterance, label name or None); empty utterances are left out. A dialogue
    whose number of labels differs from its number of utterances, or with a label that is not
    a known number, cannot be aligned: it is skipped and named in the problems, as
    "file:line: what". Files of different line counts are refused (UserError).
    """
    if labels is not None and labels not in DAILYDIALOG_LABELS:
        raise ValueError(f"labels must be one of {tuple(DAILYDIALOG_LABELS)} or None, got {labels!r}")
    text_path = resolve(Path(folder) / f"dialogues_{split}.txt")
    lines = read_lines(text_path)
    label_path = resolve(Path(folder) / f"dialogues_{labels}_{split}.txt") if labels is not None else None
    label_lines = read_lines(label_path) if label_path is not None else [None] * len(lines)
    if len(label_lines) != len(lines):
        raise UserError(
            f"{text_path} has {len(lines)} lines but {label_path} has {len(label_lines)}; they must be aligned"
        )
    names = DAILYDIALOG_LABELS[labels] if labels is not None else ()
    first = _FIRST_LABEL.get(labels or "", 0)
    dialogues: list[list[tuple[str, str | None]]] = []
    problems: list[str] = []
    for number, (line, label_line) in enumerate(zip(lines, label_lines, strict=True), start=1):
        utterances = [u.strip() for u in line.split(EOU)]
        if utterances and not utterances[-1]:
            utterances.pop()  # the text after the last marker
        if label_line is None:
            dialogues.append([(u, None) for u in utterances if u])
            continue
        values = label_line.split()
        if len(values) != len(utterances):
            problems.append(
                f"{text_path}:{number}: {len(utterances)} utterances but {len(values)} {labels} labels "
                f"({label_path}:{number}); dialogue skipped"
            )
            continue
        # isascii: str.isdigit also holds for "²" and "١", which int() refuses or reads otherwise
        known = [v.isascii() and v.isdigit() and 0 <= int(v) - first < len(names) for v in values]
        if not all(known):
            bad = values[known.index(False)]
            problems.append(f"{label_path}:{number}: {bad!r} is not a {labels} label; dialogue skipped")
            continue
        dialogues.append([(u, names[int(v) - first]) for u, v in zip(utterances, values, strict=True) if u])
    return dialogues, problems
