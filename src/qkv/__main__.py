"""``python -m qkv``: the same as the ``qkv`` command."""

from qkv.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
