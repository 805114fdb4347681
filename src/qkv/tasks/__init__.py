"""The tasks: one module each, holding its recipe defaults and value rules (a
:class:`~qkv.recipes.Task`) and its own parts of a run (``Task.prepare``; ``runner.train`` trains
every task). :data:`TASKS` lists them by the name a recipe's
``task`` gives; :func:`load_recipe` loads a recipe of any of them.

    numbers.py        the built-in demo: numbers written with digits -> English words
    translation.py    parallel text -> an encoder-decoder (resumable runs, BLEU)
    lm.py             text -> a decoder-only language model (chat data too)
    bert.py           masked-LM pretraining and classification -> an encoder-only model
    asr.py            speech -> text: speech recognition and speech translation (WER, BLEU)
    asr_data.py       the speech corpora, texts and features asr.py trains on (tts.py's validation split)
    tts.py            text -> speech: Transformer-TTS and Griffin-Lim

A new task is one module that defines a ``Task`` and one line in :data:`TASKS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qkv import recipes
from qkv.recipes import Task
from qkv.tasks import asr, bert, lm, numbers, translation, tts

TASKS: dict[str, Task] = {
    task.name: task for task in (numbers.TASK, lm.TASK, translation.TASK, bert.MLM, bert.CLASSIFY, asr.TASK, tts.TASK)
}


def load_recipe(path: str | Path | None, overrides: Sequence[str] = ()) -> recipes.Recipe:
    """:func:`qkv.recipes.load_recipe` over the known tasks; no task named: the numbers task."""
    return recipes.load_recipe(path, overrides, tasks=TASKS, default="numbers")
