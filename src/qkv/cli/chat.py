"""``qkv chat``: a multi-turn chat in a terminal (line editing, history) or over a pipe.

What is here: the command's arguments (``add_parser``) beside its handler: the turns read and
printed here, each reply the library's (``bundle.reply``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from qkv.cli.common import add_precision, positive_int, probability, sampling_of, seed, temperature
from qkv.errors import UserError

EPILOG_CHAT = """examples:
  qkv chat --model runs/chatbot
  echo "hello , how are you ?" | qkv chat --model runs/chatbot
  qkv chat --model runs/chatbot --sample --top-p 0.9 --temperature 0.8 --seed 1
"""


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _unescape(text: str) -> str:
    """``text`` with the escapes \\n, \\t and \\\\ replaced, left to right; any other backslash
    stays as typed (``unicode_escape`` would garble non-ASCII text and fail on a final backslash)."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def cmd_chat(args: argparse.Namespace) -> int:
    from qkv.bundle import load

    bundle = load(args.model, bf16=args.bf16, int8=args.int8, job="chat")
    sampling = sampling_of(args)
    choose = None if sampling is None else sampling.chooser(bundle.device)  # one generator for the whole chat
    separator = _unescape(args.separator)
    interactive = sys.stdin.isatty()
    save_history = _chat_history() if interactive else None
    if interactive:
        print(f"qkv chat with {args.model}; an empty line or Ctrl-D ends the chat", file=sys.stderr)
    try:
        _chat_loop(args, bundle, separator=separator, choose=choose, interactive=interactive)
    finally:
        if save_history is not None:
            save_history()
    return 0


CHAT_HISTORY = "QKV_CHAT_HISTORY"  # the environment variable naming the chat's history file


def _chat_history() -> Callable[[], None]:
    """Line editing and history for ``input()`` (GNU readline), the lines typed in earlier chats
    included: read from ``~/.qkv_chat_history`` (``$QKV_CHAT_HISTORY`` names another file; set
    empty, none is kept). Returns what saves the history (the newest 1,000 lines), atomically; a
    history that cannot be read (then it is left as it is) or written is a note on stderr, never
    the end of a chat."""
    try:
        import readline
    except ImportError:  # a Python built without GNU readline (or libedit): plain input()
        return lambda: None
    path = os.environ.get(CHAT_HISTORY, str(Path.home() / ".qkv_chat_history"))
    if not path:
        return lambda: None
    try:
        readline.read_history_file(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # not overwritten either: saving would lose the lines it holds
        print(f"qkv chat: note: cannot read the history {path} ({e.strerror or e}); not saving it", file=sys.stderr)
        return lambda: None
    readline.set_history_length(1000)

    def save() -> None:
        temporary = f"{path}.tmp-{os.getpid()}"
        try:
            readline.write_history_file(temporary)
            os.replace(temporary, path)
        except OSError as e:
            print(f"qkv chat: note: cannot save the history to {path}: {e.strerror or e}", file=sys.stderr)
            Path(temporary).unlink(missing_ok=True)

    return save


def _chat_loop(args: argparse.Namespace, bundle, *, separator: str, choose, interactive: bool) -> None:
    """Read a turn, print the reply, until an empty line (a terminal), Ctrl-D or the end of stdin."""
    from qkv.bundle import reply
    from qkv.data import decode_lines

    turns: list[str] = []
    number = 0
    while True:
        number += 1
        try:
            if interactive:
                line = input("you> ")
            else:
                # Read bytes, one line at a time (each turn is answered before the next is read),
                # so invalid UTF-8 is named by its line, as every other command names it.
                raw = sys.stdin.buffer.readline()
                if not raw:
                    break
                line = decode_lines([raw], "<stdin>", first=number)[0]
        except EOFError:
            break
        except UnicodeDecodeError as e:  # input() in a terminal decodes the bytes itself
            raise UserError(f"<stdin>:{number}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        line = line.strip()
        if not line:
            if interactive:
                break
            continue
        turns.append(line)
        answer = reply(bundle, turns, separator=separator, max_new_tokens=args.max_new_tokens, choose=choose)
        turns.append(answer)
        print(f"bot> {answer}" if interactive else answer, flush=True)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``chat`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "chat",
        help="talk with a model, turn by turn (interactive, or one turn per stdin line)",
        description="A multi-turn chat. The dialogue so far is given to the model, newest turns first to be "
        "kept when it no longer fits the model's window. A decoder-only model continues the dialogue until it "
        "writes the separator; an encoder-decoder model reads the dialogue and writes the reply. Reading a "
        "pipe, each input line is one turn and each reply one output line.",
        epilog=EPILOG_CHAT,
        formatter_class=raw,
    )
    p.add_argument("--model", required=True, help="model directory (decoder-only or encoder-decoder, with tokenizer)")
    p.add_argument(
        "--separator",
        default=" __eou__ ",
        help="text that ends a turn; \\n, \\t and \\\\ are a newline, a tab and a backslash "
        "(default: DailyDialog's ' __eou__ ')",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=60, help="longest reply (default: 60)")
    p.add_argument(
        "--sample",
        action="store_true",
        help="sample replies (default: greedy, or beam search; implied by the four options below)",
    )
    p.add_argument("--temperature", type=temperature, default=None, help="sampling temperature (default: 1)")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument(
        "--top-p", type=probability, default=None, help="sample from the smallest set of tokens with this probability"
    )
    p.add_argument("--seed", type=seed, default=None, help="sampling seed (reproducible replies)")
    add_precision(p)
    p.set_defaults(run=cmd_chat)
