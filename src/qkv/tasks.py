"""Built-in, offline sequence-to-sequence tasks: the data behind ``qkv demo``.

What is here: the *numbers* task, numbers written with digits → the same numbers in English
words ("4,317" → "four thousand three hundred seventeen"), for 0 ≤ n < 1,000,000. It has
real structure — place value, irregular teens and tens, words that depend on digits
several places away ("thousand" appears only if one of three digits is non-zero), inputs
with or without thousands separators — yet it needs no download.

The held-out split is fixed by the number itself (a multiplicative hash), not by a seed:
about 1% of the numbers from 100 up are never generated for training, so test examples are never seen
in training whatever the seed or the amount of training data.

What is not here: tokenization (``tokenization.py``), batching (``training.py``).
"""

from __future__ import annotations

import functools
import random

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
