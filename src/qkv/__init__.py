"""qkv: the Transformer, whole — attention, the three model families, generation, training.

Layers, bottom up (imports only point down this list):
    attention.py, layers.py, blocks.py       shared primitives
    models/                                  one file per family
    checkpoint.py, generation.py, training.py, evaluation.py, tokenization.py, tasks.py
    cli.py                                   the command line, the composition root
"""

__version__ = "0.1.0"
