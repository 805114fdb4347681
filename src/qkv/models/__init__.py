"""The three model families, one file each: encoder_decoder.py, encoder_only.py, decoder_only.py.

Nothing is re-exported here; import each model from its own module. Shared parts live in
``attention.py``, ``layers.py`` and ``blocks.py``; losses and decoding do not live here.
"""
