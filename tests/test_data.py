"""Parallel-text reading, token-budget batching and subword tokenizers (the ground for translation)."""

from __future__ import annotations

import pytest

from qkv.data import batches_by_tokens, read_parallel
from qkv.errors import UserError
from qkv.tokenization import Tokenizer


def test_read_parallel_two_files_and_tsv(tmp_path) -> None:
    """Aligned files and a TSV give the same pairs; a trailing newline is not a sentence."""
    (tmp_path / "a.de").write_text("Ein Hund.\nZwei Katzen.\n")
    (tmp_path / "a.en").write_text("A dog.\nTwo cats.\n")
    (tmp_path / "a.tsv").write_text("Ein Hund.\tA dog.\nZwei Katzen.\tTwo cats.\n")
    expected = [("Ein Hund.", "A dog."), ("Zwei Katzen.", "Two cats.")]
    assert read_parallel(tmp_path / "a.de", tmp_path / "a.en") == expected
    assert read_parallel(tmp_path / "a.tsv") == expected


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"s": b"a\nb\nc\n", "t": b"x\ny\n"}, r"s:3: no matching line in .*t \(.*s has 3 lines, .*t has 2\)"),
        ({"s": b"a\n", "t": b"x\ny\n"}, r"t:2: no matching line in .*s\b"),
        ({"s": b"a\n\nc\n", "t": b"x\ny\nz\n"}, "s:2: empty line"),
        ({"s": b"a\nb\n", "t": b"x\n\xff\n"}, "t:2: not valid UTF-8"),
        ({"tsv": b"a\tx\nb x\n"}, "tsv:2: expected source<TAB>target"),
        ({"tsv": b"a\tx\n\ty\n"}, "tsv:2: the source is empty"),
    ],
    ids=["unequal", "unequal-target-longer", "empty", "utf8", "tab", "empty-side"],
)
def test_read_parallel_names_file_and_line(tmp_path, files, message) -> None:
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    paths = [tmp_path / name for name in files]
    with pytest.raises(UserError, match=message):
        read_parallel(*paths)


def test_batches_by_tokens_respect_the_budget_and_cover_everything() -> None:
    """Every example once; padded size within budget (unless one example alone exceeds it); seeded order."""
    lengths = [(i * 7919) % 37 + 1 for i in range(211)] + [50]
    batches = batches_by_tokens(lengths, max_tokens=97, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert max(lengths[i] for i in batch) * len(batch) <= 97 or len(batch) == 1
    assert batches == batches_by_tokens(lengths, max_tokens=97, seed=3)
    assert batches != batches_by_tokens(lengths, max_tokens=97, seed=4)
    with pytest.raises(ValueError):
        batches_by_tokens(lengths, max_tokens=0, seed=0)


def test_subword_tokenizer_round_trip_on_cased_and_chinese_text() -> None:
    """Unigram pieces of the asked size decode back to the text (spaces restored; Chinese
    comes back without the word-segmentation spaces, see tokenization.cjk_spaces)."""
    texts = ["Two young men are playing soccer.", "A dog runs on the beach.", "湯姆 買 了 箇 手機 。"] * 30
    tokenizer = Tokenizer.train_subword(texts, vocab_size=61)
    assert tokenizer.vocab_size <= 61
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
    for text, expected in zip(texts[:3], [*texts[:2], "湯姆買了箇手機。"], strict=True):
        assert tokenizer.decode(tokenizer.encode(text)) == expected
