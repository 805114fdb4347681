"""The ``qkv`` command line, one module per command (its arguments beside its handler):

    main.py        the composition root: assembles the parsers, runs a command, exit status
    common.py      what the commands share: option types, input lines, atomic output, loading a model
    demo.py  train.py  translate.py  generate.py  chat.py  evaluate.py  hf.py  embed.py

Speech (``transcribe``, ``speak``) and ``serve`` join as modules of their own.
"""
