"""qkv: the Transformer, whole — attention, the three model families, generation, training.

Layers, bottom up (imports only point down this list):
    attention.py, layers.py, blocks.py       shared primitives
    models/                                  one file per family
    checkpoint.py, generation.py, training.py, evaluation.py, tokenization.py, tasks.py,
    data.py, errors.py
    recipes.py                               recipe files and what every task runner shares
    seq2seq.py, lm.py, bert.py, plots.py     task runners and pictures used by the command line
    cli.py                                   the command line, the composition root

This file holds only the version; importing qkv loads nothing else.
"""

__version__ = "0.1.0"
