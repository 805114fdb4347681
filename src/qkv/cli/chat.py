"""``qkv chat``: a multi-turn chat in a terminal (line editing, history) or over a pipe.

What is here: the command's arguments (``add_parser``) beside its handler: the turns read and
printed here, each reply the library's (``bundle.chat_reply`` through a model's chat template,
streamed as it is made; ``bundle.reply`` for a model that joins turns by a separator), the
terminal's commands (/reset, /system, /save, /help), and the decoding settings: each flag as
given, else the checkpoint's ``generation_config.json`` (said on stderr), else greedy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from qkv.cli.common import add_precision, number, positive_float, positive_int, probability, seed, temperature
from qkv.errors import UserError

EPILOG_CHAT = """examples:
  qkv chat --model runs/chatbot
  echo "hello , how are you ?" | qkv chat --model runs/chatbot
  qkv chat --model runs/chatbot --sample --top-p 0.9 --temperature 0.8 --seed 1
  qkv chat --model models/smollm2 --system "You are a terse assistant." --repetition-penalty 1.1
  qkv chat --model models/smollm2 --greedy --max-new-tokens 100

in a terminal, with a model that has a chat template:
  /reset          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt (/system alone: none)
  /save FILE      write the conversation so far as JSON messages
  /help           these commands
"""
HELP = """/reset          forget the conversation (the system prompt stays)
/system TEXT    set the system prompt (/system alone: none)
/save FILE      write the conversation so far as JSON ({"role", "content"} messages)
/help           these commands; an empty line or Ctrl-D ends the chat"""
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed")
min_probability = number(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _unescape(text: str) -> str:
    """``text`` with the escapes \\n, \\t and \\\\ replaced, left to right; any other backslash
    stays as typed (``unicode_escape`` would garble non-ASCII text and fail on a final backslash)."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def cmd_chat(args: argparse.Namespace) -> int:
    from qkv.bundle import load

    bundle = load(args.model, bf16=args.bf16, int8=args.int8, job="chat")
    templated = bundle.conversation is not None
    if not templated and (args.system is not None or args.repetition_penalty is not None):
        flag = "--system" if args.system is not None else "--repetition-penalty"
        raise UserError(f"{flag} needs a model with a chat template; {args.model} joins turns by a separator")
    settings = _settings(args, bundle)
    interactive = sys.stdin.isatty()
    save_history = _chat_history() if interactive else None
    if interactive:
        print(
            f"qkv chat with {args.model}; an empty line or Ctrl-D ends the chat, /help lists commands", file=sys.stderr
        )
    try:
        _chat_loop(args, bundle, settings, interactive=interactive)
    finally:
        if save_history is not None:
            save_history()
    return 0


def _settings(args: argparse.Namespace, bundle) -> dict:
    """How replies are decoded: each flag as given, else what the checkpoint's
    generation_config.json says (named on stderr), else greedy with no penalty."""
    from qkv.bundle import Sampling
    from qkv.conversation import GenerationDefaults

    defaults = bundle.conversation.defaults if bundle.conversation is not None else GenerationDefaults()
    flags = [f"--{n.replace('_', '-')}" for n in SAMPLING if getattr(args, n) is not None]
    if args.greedy and (args.sample or flags):
        raise UserError(f"--greedy picks the most likely token; it does not go with {', '.join(flags or ['--sample'])}")
    sample = not args.greedy and (args.sample or bool(flags) or bool(defaults.do_sample))
    taken: list[str] = []

    def setting(name: str, fallback):
        given, default = getattr(args, name), getattr(defaults, name, None)
        if given is not None:
            return given
        if default is not None:
            taken.append(f"{name} {default}")
            return default
        return fallback

    sampling = None
    if sample:
        if defaults.do_sample and not args.sample:
            taken.append("do_sample true")
        sampling = Sampling(
            temperature=setting("temperature", 1.0),
            top_k=setting("top_k", None) or None,
            top_p=setting("top_p", None),
            seed=args.seed,
            min_p=setting("min_p", None) or None,
        )
    templated = bundle.conversation is not None
    penalty = setting("repetition_penalty", 1.0) if templated else 1.0
    max_new = setting("max_new_tokens", 256 if templated else 60)
    if taken:
        source = bundle.conversation.source.parent / "generation_config.json"
        print(f"qkv chat: from {source}: {', '.join(taken)}", file=sys.stderr)
    choose = None if sampling is None else sampling.chooser(bundle.device)  # one generator for the whole chat
    return {"choose": choose, "repetition_penalty": penalty, "max_new_tokens": max_new}


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


def _chat_loop(args: argparse.Namespace, bundle, settings: dict, *, interactive: bool) -> None:
    """Read a turn, print the reply, until an empty line (a terminal), Ctrl-D or the end of stdin.
    In a terminal, a line that starts with "/" is a command (:data:`HELP`)."""
    from qkv.data import decode_lines

    state = {"turns": [], "system": args.system}
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
        if interactive and line.startswith("/"):
            print(_command(line, state, bundle), file=sys.stderr)
            continue
        state["turns"].append(line)
        if bundle.conversation is not None:
            answer = _streamed(bundle, state, settings, interactive=interactive)
        else:
            answer = _answer(args, bundle, state["turns"], settings)
            print(f"bot> {answer}" if interactive else answer, flush=True)
        state["turns"].append(answer)


def _answer(args: argparse.Namespace, bundle, turns: list[str], settings: dict) -> str:
    """The reply of a model that joins turns by the separator (``bundle.reply``)."""
    from qkv.bundle import reply

    separator = _unescape(args.separator)
    return reply(
        bundle, turns, separator=separator, max_new_tokens=settings["max_new_tokens"], choose=settings["choose"]
    )


def _streamed(bundle, state: dict, settings: dict, *, interactive: bool) -> str:
    """The reply through the model's chat template, printed piece by piece as it is made; what
    was dropped to fit the window is said on stderr. Returns the reply's text."""
    from qkv.bundle import as_messages, chat_reply

    dropped, pieces = chat_reply(
        bundle,
        as_messages(state["turns"], system=state["system"]),
        max_new_tokens=settings["max_new_tokens"],
        choose=settings["choose"],
        repetition_penalty=settings["repetition_penalty"],
    )
    if dropped:
        print(
            f"qkv chat: note: the {dropped} oldest message(s) no longer fit the window and were left out",
            file=sys.stderr,
        )
    if interactive:
        print("bot> ", end="", flush=True)
    text = ""
    for piece in pieces:
        if not text:
            piece = piece.lstrip()  # a reply's leading space or newline is the template's, not the text's
        text += piece
        print(piece, end="", flush=True)
    print(flush=True)
    return text.strip()


def _command(line: str, state: dict, bundle) -> str:
    """Do one of the terminal's commands (/reset, /system, /save, /help); what to say about it."""
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name == "/reset":
        state["turns"] = []
        return "(conversation forgotten)"
    if name == "/system":
        if bundle.conversation is None:
            return "(this model has no chat template: no system prompt)"
        state["system"] = rest or None
        return f"(system prompt: {rest!r})" if rest else "(no system prompt)"
    if name == "/save":
        if not rest:
            return "(give a file: /save FILE)"
        from qkv.bundle import as_messages
        from qkv.files import write_atomic

        messages = as_messages(state["turns"], system=state["system"])
        try:
            write_atomic(Path(rest).expanduser(), (json.dumps(messages, ensure_ascii=False, indent=2) + "\n").encode())
        except UserError as e:
            return f"(not saved: {e})"
        return f"(saved {len(messages)} message(s) to {rest})"
    if name == "/help":
        return HELP
    return f"(unknown command {name}; /help lists them)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``chat`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "chat",
        help="talk with a model, turn by turn (interactive, or one turn per stdin line)",
        description="A multi-turn chat. The dialogue so far is given to the model, newest turns first to be "
        "kept when it no longer fits the model's window. A model with a chat template (an imported Llama, "
        "Qwen2, Gemma, SmolLM, ...) reads the conversation as its template renders it, after the system prompt, "
        "and its reply, streamed as it is made, ends at its end-of-turn token; the oldest turns that no longer "
        "fit are left out, and qkv says so. Another decoder-only model continues the dialogue until it writes "
        "the separator; an encoder-decoder model reads the dialogue and writes the reply. Reading a pipe, each "
        "input line is one turn and each reply is printed after it.",
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
    p.add_argument(
        "--system", default=None, help="the system prompt (a model with a chat template; /system in the terminal)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="longest reply (default: generation_config.json's, else 256 with a chat template, 60 without)",
    )
    p.add_argument(
        "--sample",
        action="store_true",
        help="sample replies (default: as generation_config.json says, else greedy, or beam search; implied by the "
        "five options below)",
    )
    p.add_argument(
        "--greedy", action="store_true", help="pick the most likely token, whatever generation_config.json says"
    )
    p.add_argument("--temperature", type=temperature, default=None, help="sampling temperature (default: 1)")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens")
    p.add_argument(
        "--top-p", type=probability, default=None, help="sample from the smallest set of tokens with this probability"
    )
    p.add_argument(
        "--min-p",
        type=min_probability,
        default=None,
        help="sample among the tokens at least this share as likely as the likeliest (min-p)",
    )
    p.add_argument("--seed", type=seed, default=None, help="sampling seed (reproducible replies)")
    p.add_argument(
        "--repetition-penalty",
        type=positive_float,
        default=None,
        help="divide the scores of tokens already in the conversation by this (1.1-1.3 is usual; 1: none)",
    )
    add_precision(p)
    p.set_defaults(run=cmd_chat)
