"""What the commands share: the argument parser class, option types, reading input lines,
writing output atomically, sampling options; loading a model for decoding with its tokenizers
(``qkv.loading``, which the server shares, imported here for the commands).

What is not here: any command (one module each in this package) or the assembly (``main.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from qkv.errors import UserError
from qkv.files import write_atomic
from qkv.loading import load_for_generation, matching_tokenizer, matching_vocabularies  # noqa: F401 (the commands')


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2), not a usage dump."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


BF16_HELP = (
    "run the model in bfloat16 (weights cast on load): faster batched decoding on CPUs with "
    "AVX512-BF16 or AMX; outputs may differ slightly from float32 (check with qkv evaluate)"
)


INT8_HELP = (
    "run the linear layers with int8 weights (one scale per output channel, float activations; "
    "the vocabulary projection in bfloat16): faster decoding on CPUs; outputs may differ slightly "
    "from float32 (check with qkv evaluate)"
)


def add_precision(p: argparse.ArgumentParser) -> None:
    """--bf16 or --int8 (not both): the weights' precision for decoding."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--bf16", action="store_true", help=BF16_HELP)
    group.add_argument("--int8", action="store_true", help=INT8_HELP)


def number(convert: Callable[[str], float], test: Callable[[float], bool], what: str) -> Callable[[str], float]:
    """An argparse type: ``convert`` the text, then require ``test`` (else say ``what`` is expected)."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = number(int, lambda v: v > 0, "a positive integer")


positive_float = number(float, lambda v: v > 0, "a positive number")


# What torch.Generator.manual_seed takes (a larger one overflows inside PyTorch).
seed = number(int, lambda v: -(2**63) <= v < 2**64, "an integer seed from -2**63 to 2**64 - 1")


# Below 0.001 the scaled logits overflow; greedy decoding is the limit anyway.
temperature = number(float, lambda v: v >= 1e-3, "a temperature of at least 0.001")


probability = number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def read_input_lines(path: str | None) -> list[str]:
    """Lines of a UTF-8 file (or stdin for None / "-"); bad bytes name the file and line."""
    from qkv.data import decode_lines
    from qkv.data import read_lines as read_file_lines

    if path is None or path == "-":
        return decode_lines(sys.stdin.buffer, "<stdin>")
    return read_file_lines(path)


class Output:
    """Lines to stdout, or to a file that appears atomically once all lines are written."""

    def __init__(self, path: str | None) -> None:
        self.path = None if path in (None, "-") else Path(path)
        if self.path is not None and not self.path.parent.is_dir():
            raise UserError(f"cannot write {self.path}: directory {self.path.parent} does not exist")
        if self.path is not None and self.path.is_dir():
            raise UserError(f"cannot write {self.path}: it is a directory")
        if self.path is not None and not os.access(self.path.parent, os.W_OK):
            raise UserError(f"cannot write {self.path}: directory {self.path.parent} is not writable")
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        if self.path is None:
            print(line, flush=True)
        else:
            self.lines.append(line)

    def close(self) -> None:
        if self.path is not None:
            write_atomic(self.path, "".join(f"{line}\n" for line in self.lines).encode())


def chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "seed")


def wants_sampling(args: argparse.Namespace) -> bool:
    """Whether to sample: ``--sample``, or any of ``--temperature``, ``--top-k``, ``--top-p``
    and ``--seed`` (which mean nothing to a search: whoever sets one means to sample)."""
    return args.sample or any(getattr(args, name) is not None for name in SAMPLING_OPTIONS)


def sampling_of(args: argparse.Namespace):  # -> qkv.bundle.Sampling | None
    """The sampling the flags ask for (:func:`wants_sampling`: the temperature 1 unless given),
    else None: a search."""
    if not wants_sampling(args):
        return None
    from qkv.bundle import Sampling

    return Sampling(temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def sampling_flags(args: argparse.Namespace) -> str:
    """The flags that asked for sampling, as typed (for an error message)."""
    given = [f"--{name.replace('_', '-')}" for name in SAMPLING_OPTIONS if getattr(args, name) is not None]
    return ", ".join((["--sample"] if args.sample else []) + given)


def add_constraints(p: argparse.ArgumentParser, *, terms: bool = False) -> None:
    """--prefix, --ban and --require (and, for translation, --terms): what every output obeys
    (``bundle.constraints``)."""
    group = p.add_argument_group("constraints (docs/translation.md, 'Constraints')")
    group.add_argument(
        "--prefix",
        metavar="TEXT",
        help="every output starts with TEXT, written as part of the output: the model goes on from it as if it "
        "had written it (a language model reads it after its prompt, an imported Whisper after its start tokens "
        "and a space)",
    )
    group.add_argument(
        "--ban",
        action="append",
        default=[],
        metavar="WORD",
        help="never write WORD, however the tokens would spell it; matched where a word starts and as written, so "
        "the words it starts are banned too (repeatable)",
    )
    group.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="WORD",
        help="every output contains WORD: lexically constrained beam search, so --beam 2 or more (repeatable)",
    )
    if terms:
        group.add_argument(
            "--terms",
            metavar="FILE",
            help="terminology: lines of SOURCE<TAB>TARGET; TARGET is required (as --require) of each input that "
            "holds SOURCE as a word",
        )


def add_threads(p: argparse.ArgumentParser) -> None:
    """--threads N: the CPU threads torch computes with (default: torch's, one per core)."""
    p.add_argument(
        "--threads",
        type=positive_int,
        help="CPU threads to compute with (default: all cores, torch's default); fewer leave cores to other work",
    )


def use_threads(threads: int | None) -> None:
    """Apply --threads before the work (torch.set_num_threads; None leaves torch's default)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
