"""The numbers task, built in and offline: the data, recipe defaults and runner behind ``qkv demo``.

What is here: the *numbers* task, numbers written with digits → the same numbers in English
words ("4,317" → "four thousand three hundred seventeen"), for 0 ≤ n < 1,000,000. It has
real structure — place value, irregular teens and tens, words that depend on digits
several places away ("thousand" appears only if one of three digits is non-zero), inputs
with or without thousands separators — yet it needs no download.

The held-out split is fixed by the number itself (a multiplicative hash), not by a seed:
about 1% of the numbers from 100 up are never generated for training, so test examples are never seen
in training whatever the seed or the amount of training data.

What is here besides the data: :data:`TASK` (the recipe defaults and rules), its parts of a run
:func:`prepare_numbers` (tokenizer, model, step loss, validation, held-out exact match; the runner
trains and saves), :func:`train_numbers` and :func:`evaluate_numbers`.

What is not here: tokenization (``tokenization.py``), batching (``losses.py``), decoding text
(``seq2seq.py``), the demo's printing and pictures (``cli/``).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from pathlib import Path

import torch

from qkv import runner
from qkv.distributed import share
from qkv.errors import UserError
from qkv.evaluation import exact_match
from qkv.losses import seq2seq_batch, seq2seq_loss
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.recipes import Recipe, Setup, Start, Task, TrainConfig, require_steps, seq2seq_model
from qkv.seq2seq import beam_translate
from qkv.tokenization import FILE as TOKENIZER_FILE
from qkv.tokenization import Tokenizer, Vocabularies

ONES = "zero one two three four five six seven eight nine".split()
TEENS = "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
LIMIT = 1_000_000


def _below_thousand(n: int) -> list[str]:
    words = []
    hundreds, rest = divmod(n, 100)
    if hundreds:
        words += [ONES[hundreds], "hundred"]
    if 10 <= rest < 20:
        words.append(TEENS[rest - 10])
    else:
        tens, ones = divmod(rest, 10)
        if tens:
            words.append(TENS[tens])
        if ones:
            words.append(ONES[ones])
    return words


def number_to_words(n: int) -> str:
    """English words for 0 ≤ n < 1,000,000, e.g. 4317 → "four thousand three hundred seventeen"."""
    if not 0 <= n < LIMIT:
        raise ValueError(f"number out of range: {n}")
    if n == 0:
        return "zero"
    thousands, rest = divmod(n, 1000)
    words = []
    if thousands:
        words += [*_below_thousand(thousands), "thousand"]
    return " ".join(words + _below_thousand(rest))


def is_held_out(n: int) -> bool:
    """True for the ~1% of numbers ≥ 100 reserved for evaluation (Knuth's multiplicative hash).

    The test reads the hash's high bits: its low bits repeat with period 4, which would
    hold out only multiples of 4.

    Numbers below 100 are the task's lexicon ("zero", "seventeen", ...): a word never seen
    in training cannot be produced, so none of them is held out.
    """
    return n >= 100 and (((n * 2654435761) & 0xFFFFFFFF) >> 16) % 100 == 0


def format_digits(n: int, *, commas: bool) -> str:
    return f"{n:,}" if commas else str(n)


def _sample_number(rng: random.Random) -> int:
    # Uniform over the number of digits first, so short numbers are not drowned out.
    digits = rng.randint(1, 6)
    return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


@functools.cache
def held_out_numbers() -> tuple[int, ...]:
    """All held-out numbers (10,011 of them), ascending."""
    return tuple(n for n in range(100, LIMIT) if is_held_out(n))


def numbers_pairs(count: int, *, seed: int, held_out: bool) -> list[tuple[str, str]]:
    """``count`` (source, target) pairs, drawn from the training or the held-out numbers.

    Both draw the number of digits uniformly first. Training pairs may repeat (they are
    sampled); held-out pairs are distinct, so at most 10,011 of them exist.
    """
    rng = random.Random(seed)
    if held_out:
        pool = held_out_numbers()
        if count > len(pool):
            raise ValueError(f"only {len(pool)} held-out numbers exist; asked for {count}")
        groups: dict[int, list[int]] = {}
        for n in pool:
            groups.setdefault(len(str(n)), []).append(n)
        for group in groups.values():
            rng.shuffle(group)
        numbers = []
        while len(numbers) < count:
            digits = rng.choice(sorted(d for d, group in groups.items() if group))
            numbers.append(groups[digits].pop())
    else:
        numbers = []
        while len(numbers) < count:
            n = _sample_number(rng)
            if not is_held_out(n):
                numbers.append(n)
    return [(format_digits(n, commas=rng.random() < 0.5), number_to_words(n)) for n in numbers]


# The model section's defaults: a small encoder-decoder that learns the task in ~100 s.
NUMBERS_MODEL: dict = {
    "d_model": 64,
    "n_heads": 4,
    "d_ff": 256,
    "n_encoder_layers": 2,
    "n_decoder_layers": 2,
    "share_embeddings": True,
    "tie_output": True,
    "dropout": 0.0,
    "max_len": 64,
}


@dataclasses.dataclass(frozen=True)
class NumbersTrain(TrainConfig):
    """The numbers task's training (``train``): the shared settings with its defaults, and a
    batch of ``batch_size`` fresh pairs every step."""

    steps: int | None = 3000  # ~100 s on 2 Zen 4 cores
    lr: float = 3e-3
    warmup: int = 100
    batch_size: int = 128


@dataclasses.dataclass(frozen=True)
class NumbersData:
    """The numbers task's data (``data``): ``eval_examples`` held-out numbers scored at the end
    (and as many others at each validation)."""

    eval_examples: int = 1000


# The longest numbers target is 10 words ("seven hundred seventy seven thousand ..."):
# BEGIN + 10 words are 11 decoder positions; the longest source is 7 tokens.
NUMBERS_MIN_LEN = 11


def _check(recipe: Recipe, where: str) -> None:
    require_steps(recipe, where)
    if recipe.model.get("max_len", 512) < NUMBERS_MIN_LEN:
        raise UserError(f"{where}: model.max_len must be at least {NUMBERS_MIN_LEN} for the numbers task")


def evaluate_numbers(
    model: EncoderDecoder, tokenizer: Tokenizer | Vocabularies, *, pairs: list[tuple[str, str]], beam_size: int
) -> tuple[float, list[str]]:
    """Exact match of beam-search outputs on (digits, words) pairs; returns it and the outputs."""
    outputs = beam_translate(model, tokenizer, [a for a, _ in pairs], beam_size=beam_size, max_len_a=2.0)
    return exact_match(outputs, [b for _, b in pairs]), outputs


def prepare_numbers(recipe: Recipe, start: Start) -> Setup:
    """The numbers task's parts of a run (``runner.train`` does the rest): a word-level
    vocabulary, the recipe's encoder-decoder, fresh pairs every step, validation by exact match
    on held-out numbers, and the evaluation: exact match on other held-out numbers (with the
    outputs, to show examples)."""
    train, data = recipe.train, recipe.data
    seed = train.seed
    torch.manual_seed(seed)
    if start.checkpoint is not None:
        tokenizer = Tokenizer.load(start.checkpoint / TOKENIZER_FILE)
    else:
        # The vocabulary is closed (digits, a comma, 31 words), so a modest sample covers it.
        pairs = numbers_pairs(20_000, seed=seed, held_out=False)
        tokenizer = Tokenizer.train_word_level(s for pair in pairs for s in pair)
    model = seq2seq_model(recipe, tokenizer)
    batch_size, beam = train.batch_size, recipe.decode.beam_size

    def step_loss(m: EncoderDecoder, step: int) -> tuple[torch.Tensor, int]:
        # Fresh examples every step (never a held-out number), fixed by (seed, step).
        pairs = numbers_pairs(batch_size, seed=seed * 1_000_003 + step, held_out=False)
        mine, counted = share(len(pairs))  # this worker's rows of the step's batch (all of it alone)
        pairs = [pairs[i] for i in mine]
        src = tokenizer.encode_batch([a for a, _ in pairs])
        tgt = tokenizer.encode_batch([b for _, b in pairs])
        s, t_in, t_out = seq2seq_batch(
            list(zip(src, tgt, strict=True)), pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        )
        loss, n = seq2seq_loss(m, s, t_in, t_out, pad_id=tokenizer.pad_id, label_smoothing=train.label_smoothing)
        return loss, n if counted else 0

    # Validation (train.valid_every): other held-out numbers than the test's, exact match.
    valid_pairs = numbers_pairs(data.eval_examples, seed=seed + 2, held_out=True)

    def score(m: EncoderDecoder) -> dict[str, float]:
        exact, _ = evaluate_numbers(m, tokenizer, pairs=valid_pairs, beam_size=beam)
        return {"exact_match": exact}

    def evaluate(m: EncoderDecoder, out: Path, validated: dict | None) -> tuple[dict, dict]:
        held_out = numbers_pairs(data.eval_examples, seed=seed + 1, held_out=True)
        began = time.perf_counter()
        exact, outputs = evaluate_numbers(m, tokenizer, pairs=held_out, beam_size=beam)
        seconds = time.perf_counter() - began
        return {"exact_match": exact}, {
            "exact_match": exact,
            "eval_seconds": seconds,
            "held_out": held_out,
            "outputs": outputs,
        }

    return Setup(model, step_loss, tokenizer, evaluate, score=score, metric="exact_match", higher=True)


def train_numbers(recipe: Recipe, out: str | Path, *, progress: bool = True, resume: bool = False) -> dict:
    """Train the numbers task as ``recipe`` says; save the model directory to ``out``.

    Returns a summary: exact match on held-out numbers, timings, and what is needed to
    show examples (model, tokenizer, held-out pairs, outputs, losses).
    """
    return runner.train(TASK, recipe, out, progress=progress, resume=resume)


def report(summary: dict, recipe: Recipe) -> tuple[dict, str]:
    """The run's score for the command line: held-out exact match."""
    return {"exact_match": round(summary["exact_match"], 4)}, f"held-out exact match {summary['exact_match']:.1%}"


TASK = Task(
    name="numbers",
    model=NUMBERS_MODEL,
    train=NumbersTrain,
    data=NumbersData,
    decode=("beam_size",),
    model_kind="encoder_decoder",
    prepare=prepare_numbers,
    report=report,
    rules={
        ("data", "eval_examples"): (int, lambda v: 0 < v <= 10_000, "an integer in 1..10000 (held-out numbers)"),
    },
    check=_check,
)
