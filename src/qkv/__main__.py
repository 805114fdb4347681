"""``python -m qkv``: the same as the ``qkv`` command."""

from qkv.cli.main import console_main

if __name__ == "__main__":
    raise SystemExit(console_main())
