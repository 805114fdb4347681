"""qkv: the Transformer, whole — attention, the three model families, generation, training.

Layers, bottom up (a module imports from its own layer or the ones below, never above):
    errors.py, files.py, memory.py           user errors; atomic writes, JSON reading; malloc choice
    attention.py, layers.py, blocks.py       shared primitives
    models/                                  one file per family
    checkpoint.py, generation.py, training.py, evaluation.py, tokenization.py, tasks.py,
    data.py, runs.py, hf.py                  model-agnostic: files, decoding, training, scores
    recipes.py                               recipe files and what every task runner shares
    seq2seq.py, lm.py, bert.py, chat.py,     task runners, chat and pictures used by the command
    plots.py                                 line
    cli.py                                   the command line, the composition root

This file holds only the version; importing qkv loads nothing else.
"""

__version__ = "0.1.0"
