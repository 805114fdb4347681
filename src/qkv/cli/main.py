"""The ``qkv`` command line: the composition root. Assembles every command's parser; runs one.

Every user mistake (missing file, bad option value, a model of the wrong kind) ends in one
line on stderr and exit status 2; success exits 0. Progress goes to stderr, results to stdout,
so commands compose in pipes.

What is not here: the commands (one module each in this package, arguments beside handler)
and any model, training or decoding logic (the modules they wire).
"""

from __future__ import annotations

import argparse
import errno
import sys

from qkv import __version__
from qkv.cli import (
    chat,
    check,
    demo,
    embed,
    evaluate,
    export_onnx,
    generate,
    hf,
    serve,
    speak,
    train,
    transcribe,
    translate,
)
from qkv.cli.common import Parser
from qkv.errors import OptionError, Stopped, UserError
from qkv.memory import choose_allocator

# The library's options whose flag is not the option with dashes (ctc_weight: --ctc-weight).
FLAGS = {"beam_size": "--beam", "sampling": "--sample"}

# The errors of a path itself, which no existence check catches (Path.exists raises them).
PATH_ERRORS = {errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="qkv",
        description="qkv: the Transformer, whole. Train, run and score encoder-decoder, encoder-only "
        "and decoder-only models.",
        epilog="run `qkv COMMAND --help` for each command's options and an example",
    )
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    demo.add_parser(sub)
    train.add_parser(sub)
    translate.add_parser(sub)
    transcribe.add_parser(sub)
    speak.add_parser(sub)
    generate.add_parser(sub)
    chat.add_parser(sub)
    evaluate.add_parser(sub)
    hf.add_import_parser(sub)
    hf.add_import_gguf_parser(sub)
    hf.add_export_parser(sub)
    export_onnx.add_parser(sub)
    embed.add_parser(sub)
    check.add_parser(sub)
    serve.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UserError as e:  # a library's OptionError names its options as flags here
        said = e.said(FLAGS) if isinstance(e, OptionError) else str(e)
        print(f"qkv {args.command}: error: {one_line(said)}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"qkv {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        if e.errno not in PATH_ERRORS or e.filename is None:
            raise
        # A path the user gave that the system refuses (a name too long, a loop of links) where
        # no check named it first: said in one line all the same.
        print(f"qkv {args.command}: error: {one_line(str(e.filename))}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


# What str.splitlines breaks at: an error quoting a file's text or a name keeps them written out.
_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}


def one_line(message: str) -> str:
    """``message`` on one line: line breaks written as escapes (``\\n``, ``\\r``, ...)."""
    return message.translate(_LINE_BREAKS)


def console_main() -> int:
    """The ``qkv`` program and ``python -m qkv``: :func:`main` on the faster allocator.

    TCMalloc makes CPU training up to 1.7x faster (``memory.py``); the restart that loads it
    replaces the whole interpreter, so only these entry points choose, never :func:`main`.
    """
    choose_allocator()
    return main()
