"""What the commands share: the argument parser class, option types, reading input lines,
writing output atomically, loading a model for decoding with its tokenizers, sampling options.

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


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2), not a usage dump."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


BF16_HELP = (
    "run the model in bfloat16 (weights cast on load): faster batched decoding on CPUs with "
    "AVX512-BF16 or AMX; outputs may differ slightly from float32 (check with qkv evaluate)"
)


INT8_HELP = (
    "run the linear layers with int8 weights (PyTorch dynamic quantization, one scale per "
    "output channel): faster decoding at every batch size on CPUs; outputs may differ slightly "
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


def load_for_generation(path: str, *, bf16: bool = False, int8: bool = False):
    """The model of ``path`` and its Vocabularies (a decoder-only model's: one tokenizer, joint)."""
    import torch

    from qkv.checkpoint import load_model, model_dir
    from qkv.generation import for_decoding, int8_linears

    path = str(model_dir(path))  # a training run: its final checkpoint
    model, meta = load_model(path)
    if meta["kind"] == "encoder_only":
        raise UserError(f"{path} holds an encoder_only model, which does not generate text")
    model = for_decoding(model)  # one stacked Q/K/V product per self-attention (tested equal)
    if bf16:
        # Half the bytes per weight: batched decoding reads every weight once per step, and
        # the CPU's bf16 matmul units (AVX512-BF16, AMX) do the rest (bench/mt_speed.py).
        model = model.to(torch.bfloat16)
    if int8:
        model = int8_linears(model)  # a quarter of the bytes: faster at every batch size
    return model, matching_vocabularies(path, model, files=meta.get("files", {}), use="generate")


def matching_tokenizer(path: str, model, *, files, use: str):
    """The model directory's tokenizer (:func:`matching_vocabularies`'s source side)."""
    return matching_vocabularies(path, model, files=files, use=use).source


def matching_vocabularies(path: str, model, *, files, use: str):
    """The model directory's Vocabularies (separate when ``files``, its config.json's, list
    target_tokenizer.json); refused, naming ``use`` (what needs it), when it has no
    tokenizer.json, and when a tokenizer has ids the model has no embedding for."""
    from qkv.checkpoint import model_dir
    from qkv.tokenization import FILE, Vocabularies

    if FILE not in files:
        raise UserError(f"{path} has no {FILE}; {use} needs a model saved with its tokenizer")
    vocab = Vocabularies.load(model_dir(path), files=files)
    c = model.config
    sizes = (c.src_vocab_size, c.tgt_vocab_size) if hasattr(c, "src_vocab_size") else (c.vocab_size, c.vocab_size)
    for tokenizer, name, size in vocab.tables(src_vocab_size=sizes[0], tgt_vocab_size=sizes[1]):
        if tokenizer.vocab_size > size:
            raise UserError(f"{path}: {name} has {tokenizer.vocab_size} tokens but the model only {size}")
    return vocab


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "seed")


def wants_sampling(args: argparse.Namespace) -> bool:
    """Whether to sample: ``--sample``, or any of ``--temperature``, ``--top-k``, ``--top-p``
    and ``--seed`` (which mean nothing to a search: whoever sets one means to sample)."""
    return args.sample or any(getattr(args, name) is not None for name in SAMPLING_OPTIONS)


def sampling_flags(args: argparse.Namespace) -> str:
    """The flags that asked for sampling, as typed (for an error message)."""
    given = [f"--{name.replace('_', '-')}" for name in SAMPLING_OPTIONS if getattr(args, name) is not None]
    return ", ".join((["--sample"] if args.sample else []) + given)
