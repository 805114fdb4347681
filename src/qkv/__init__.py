"""qkv: the Transformer, whole — attention, the three model families, generation, training.

Layers, bottom up (a module imports from its own layer or the ones below, never above; the
contracts in pyproject.toml, checked by ``lint-imports`` in the test command, enforce it):

    errors.py files.py memory.py              foundation: user errors, atomic writes, malloc choice
    attention.py layers.py audio.py           primitives: shape legend, attention, FFN, norms; audio features
    blocks.py                                 encoder and decoder blocks and stacks
    models/                                   one file per family (config dataclass at the top)
    checkpoint.py decoding/ training.py      model-agnostic: model directories, decoding, training,
    losses.py evaluation.py tokenization.py   the families' losses, scores, tokenizers, corpora, pictures
    data.py plots.py
    hf/ runs.py chat.py seq2seq.py            model-agnostic, built on those: Hugging Face checkpoints, run
    embedding.py loading.py streaming.py      directories, chat turns, text in/out of encoder-decoders,
    inspection.py                             sentence vectors, loading for decoding, streamed text,
                                              every attention map and the beam trace
    recipes.py                                recipes, and what every task shares
    runner.py                                 the one runner: start, fit, save, evaluate (every task)
    tasks/                                    one module per task: its recipe defaults and its parts of a run
    bundle/                                   a model directory loaded once (core.py), and one module per job
    serve/                                    the HTTP server and its page (an adapter, as cli/ is)
    cli/                                      the command line: the composition root (qkv serve starts serve/)

This file holds the version and :func:`load`, which imports ``bundle/`` when it is called:
importing qkv loads nothing else.

    import qkv
    m = qkv.load("runs/de_en")
    m.translate(["Ein Hund läuft."])
"""

from __future__ import annotations

__version__ = "0.1.0"


def load(path, *, bf16: bool = False, int8: bool = False, device: str = "cpu"):
    """The model directory (or training run) ``path``, loaded once for every job its model does:
    a :class:`qkv.bundle.Bundle`, whose methods ``translate``, ``transcribe``, ``speak``,
    ``embed``, ``generate`` and ``chat`` do them (:func:`qkv.bundle.load`)."""
    from qkv.bundle import load as load_bundle

    return load_bundle(path, bf16=bf16, int8=int8, device=device)
