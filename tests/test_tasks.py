"""Tests of qkv.tasks: number words, the fixed held-out split and pair generation."""

from __future__ import annotations

import signal
from contextlib import contextmanager

import pytest

from qkv.tasks.numbers import LIMIT, held_out_numbers, is_held_out, number_to_words, numbers_pairs


@contextmanager
def time_limit(seconds: float):
    """Turn an endless loop into a TimeoutError (SIGALRM; the main thread, Unix only)."""

    def handler(signum, frame):
        raise TimeoutError(f"still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _number(source: str) -> int:
    return int(source.replace(",", ""))


@pytest.mark.parametrize(
    ("n", "words"),
    [
        (0, "zero"),
        (7, "seven"),
        (13, "thirteen"),
        (20, "twenty"),
        (21, "twenty one"),
        (100, "one hundred"),
        (101, "one hundred one"),
        (110, "one hundred ten"),
        (999, "nine hundred ninety nine"),
        (1000, "one thousand"),
        (1001, "one thousand one"),
        (4317, "four thousand three hundred seventeen"),
        (20013, "twenty thousand thirteen"),
        (100000, "one hundred thousand"),
        (700010, "seven hundred thousand ten"),
        (999999, "nine hundred ninety nine thousand nine hundred ninety nine"),
    ],
)
def test_number_to_words(n, words):
    assert number_to_words(n) == words


@pytest.mark.parametrize("n", [-1, LIMIT, LIMIT + 1, -1000])
def test_number_to_words_out_of_range(n):
    with pytest.raises(ValueError, match="out of range"):
        number_to_words(n)


def test_held_out_pairs_are_held_out_and_training_pairs_never_are():
    held = numbers_pairs(300, seed=0, held_out=True)
    train = numbers_pairs(3000, seed=0, held_out=False)
    assert len(held) == 300 and len(train) == 3000
    assert all(is_held_out(_number(s)) for s, _ in held)
    assert not any(is_held_out(_number(s)) for s, _ in train)
    # Each target is the words of its source.
    assert all(t == number_to_words(_number(s)) for s, t in held + train)


def test_no_number_below_100_is_held_out_and_about_one_percent_above():
    assert not any(is_held_out(n) for n in range(100))
    share = sum(is_held_out(n) for n in range(100, 100_100)) / 100_000
    assert 0.005 < share < 0.02


def test_pairs_are_deterministic_for_a_seed():
    for held_out in (False, True):
        a = numbers_pairs(200, seed=5, held_out=held_out)
        assert a == numbers_pairs(200, seed=5, held_out=held_out)
        assert a != numbers_pairs(200, seed=6, held_out=held_out)


def test_held_out_pairs_are_distinct():
    numbers = [_number(s) for s, _ in numbers_pairs(500, seed=2, held_out=True)]
    assert len(set(numbers)) == len(numbers)


def test_sources_appear_with_and_without_commas():
    pairs = numbers_pairs(2000, seed=0, held_out=False)
    big = [s for s, _ in pairs if _number(s) >= 1000]
    with_commas = [s for s in big if "," in s]
    assert with_commas and len(with_commas) < len(big)
    for s in big:
        n = _number(s)
        assert s in (f"{n:,}", str(n))
    # Short numbers are not drowned out (uniform over the number of digits).
    assert any(_number(s) < 10 for s, _ in pairs)


def test_asking_for_more_held_out_pairs_than_exist_fails_instead_of_looping():
    total = sum(is_held_out(n) for n in range(LIMIT))
    assert total == len(held_out_numbers())
    with time_limit(2.0), pytest.raises(ValueError):
        numbers_pairs(total + 1, seed=0, held_out=True)


def test_held_out_numbers_cover_every_ending():
    """The held-out set is not biased to some residues (every last-two-digit ending occurs)."""
    numbers = held_out_numbers()
    assert {n % 100 for n in numbers} == set(range(100))
    assert 0.005 < len(numbers) / LIMIT < 0.015
