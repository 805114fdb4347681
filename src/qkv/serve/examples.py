"""An example input for each served model, for the page's placeholder (``GET /v1/models``).

What is here: :func:`example_input`, a sentence the model can read: the numbers task's digits,
else a sentence in the source language its recipe names (``multi30k/train.de``,
``tatoeba-zh-en/train.tsv``, ``reverse``), else one for its kind (a sentence to translate, a
prompt to continue, a line of dialogue to classify), the first its tokenizer reads without an
unknown token and within the window (else the first words of one it reads);
:func:`source_language`, the language code a recipe's training files name.

What is not here: the route (``routes/info.py``), the page (``static/``).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from qkv.serve.models import Served

NUMBERS = ("52,017", "4,317")  # the numbers task reads digits (tasks/numbers.py)
SENTENCES = {  # one per language the shipped recipes translate, the same sentence
    "de": "Ein Hund läuft über die Wiese.",
    "en": "A dog runs on the grass.",
    "zh": "一只狗在草地上跑。",
    "fr": "Un chien court dans l'herbe.",
}
BY_KIND = {  # what a model of each kind is given when its recipe names no language
    "encoder_decoder": (SENTENCES["en"], SENTENCES["de"], SENTENCES["zh"]),
    "decoder_only": ("To be, or not to be", "Once upon a time", "Es war einmal", "从前"),
    "encoder_only": ("Could you tell me the way to the station?",),
}
PAIR = re.compile(r"(?<![a-z])([a-z]{2})[-_]([a-z]{2})(?![a-z])")


def source_language(train: list[str] | str | None, *, reverse: bool = False) -> str | None:
    """The code of the language a translation recipe reads, from its training files: two files
    end in their languages (``train.de``, ``train.en``); one TSV's path names the pair
    (``tatoeba-zh-en``). ``reverse``: the second side is the source. None when they do not say."""
    files = [train] if isinstance(train, str) else list(train or [])
    if len(files) == 2:
        suffix = PurePosixPath(files[1 if reverse else 0]).suffix.lstrip(".").lower()
        return suffix if suffix.isalpha() and 2 <= len(suffix) <= 3 else None
    if len(files) == 1 and (pair := PAIR.search(files[0].lower())):
        return pair.group(2 if reverse else 1)
    return None


def _candidates(served: Served) -> list[str]:
    """The example inputs worth trying for ``served``, best first."""
    recipe = served.bundle.meta.get("recipe") or {}
    task = served.bundle.meta.get("task")
    found: list[str] = list(NUMBERS) if task == "numbers" else []
    data = recipe.get("data") or {}
    language = source_language(data.get("train"), reverse=bool(data.get("reverse"))) if task == "translation" else None
    if language in SENTENCES:
        found.append(SENTENCES[language])
    more = [*BY_KIND.get(served.kind, ()), *SENTENCES.values()]
    return found + [s for s in dict.fromkeys(more) if s not in found]


def example_input(served: Served) -> str:
    """The first candidate (:func:`_candidates`) that ``served``'s source tokenizer reads
    without an unknown token and that fits (a language model's prompt: half its window, the rest
    for its continuation); else the first words of the first one it reads that fit; else the
    first candidate."""
    candidates = _candidates(served)
    tokenizer = served.vocab.source if served.vocab is not None else None
    if tokenizer is None:
        return candidates[0]
    room = served.window // 2 if served.kind == "decoder_only" else served.window
    lengths = {text: tokenizer.encode(text) for text in candidates}
    readable = [t for t, ids in lengths.items() if ids and (tokenizer.unk_id is None or tokenizer.unk_id not in ids)]
    for text in readable:
        if len(lengths[text]) <= room:
            return text
    for text in readable:
        words = text.split()
        fitting = [" ".join(words[:n]) for n in range(len(words), 0, -1)]
        if (cut := next((w for w in fitting if len(tokenizer.encode(w)) <= room), None)) is not None:
            return cut
    return candidates[0]
