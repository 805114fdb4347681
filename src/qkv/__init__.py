"""qkv: the Transformer, whole — attention, the three model families, generation, training.

Layers, bottom up (a module imports from its own layer or the ones below, never above; the
contracts in pyproject.toml, checked by ``lint-imports`` in the test command, enforce it):

    errors.py files.py memory.py              foundation: user errors, atomic writes, malloc choice
    attention.py layers.py audio.py           primitives: shape legend, attention, FFN, norms; audio features
    blocks.py                                 encoder and decoder blocks and stacks
    models/                                   one file per family (config dataclass at the top)
    checkpoint.py generation.py training.py   model-agnostic: model directories, decoding, training,
    losses.py evaluation.py tokenization.py   the families' losses, scores, tokenizers, corpora, pictures
    data.py plots.py
    hf/ runs.py chat.py seq2seq.py            model-agnostic, built on those: Hugging Face checkpoints, run
    embedding.py loading.py streaming.py      directories, chat turns, text in/out of encoder-decoders,
    inspection.py                             sentence vectors, loading for decoding, streamed text,
                                              every attention map and the beam trace
    recipes.py                                recipes, and what every task shares
    runner.py                                 the one runner: start, fit, save, evaluate (every task)
    tasks/                                    one module per task: its recipe defaults and its parts of a run
    serve/                                    the HTTP server and its page (an adapter, as cli/ is)
    cli/                                      the command line: the composition root (qkv serve starts serve/)

This file holds only the version; importing qkv loads nothing else.
"""

__version__ = "0.1.0"
