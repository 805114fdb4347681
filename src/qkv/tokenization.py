"""Tokenizers: a thin wrapper over Hugging Face ``tokenizers`` with qkv's special tokens.

What is here: :class:`Tokenizer`, which trains a word-level vocabulary (digits split one
by one) or loads any ``tokenizer.json``, encodes text to ids and decodes ids to text, and
knows the ids of padding, BEGIN, END and unknown. Its file is stored inside a model
directory and its SHA-256 in ``config.json`` (``checkpoint.py``), so a model is never run
with a tokenizer it was not trained with.

What is not here: the tokenization algorithms themselves (the library's), batching.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from qkv.errors import UserError

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3 in every vocabulary qkv trains
FILE = "tokenizer.json"


class Tokenizer:
    """Text ↔ token ids. ``pad_id``, ``bos_id``, ``eos_id``, ``unk_id`` are fixed at 0–3."""

    def __init__(self, backend: HFTokenizer) -> None:
        self.backend = backend
        ids = [backend.token_to_id(t) for t in SPECIALS]
        if None in ids:
            missing = [t for t, i in zip(SPECIALS, ids, strict=True) if i is None]
            raise UserError(f"tokenizer lacks the special token(s) {', '.join(missing)}")
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = ids

    @classmethod
    def train_word_level(cls, texts: Iterable[str]) -> Tokenizer:
        """A whitespace/punctuation word vocabulary with every digit its own token.

        Splitting digits lets a model read "4,317" digit by digit (place value) rather than
        as one opaque word.
        """
        backend = HFTokenizer(models.WordLevel(unk_token=UNK))
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
        )
        backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
        backend.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=list(SPECIALS)))
        return cls(backend)

    @classmethod
    def train_subword(cls, texts: Iterable[str], *, vocab_size: int) -> Tokenizer:
        """A SentencePiece-style unigram subword vocabulary (Kudo, 2018) of ``vocab_size`` pieces.

        Words are marked with "▁" (Metaspace) so decoding restores the spaces; text that is
        already segmented (Tatoeba's Chinese) and unsegmented text both work.
        """
        backend = HFTokenizer(models.Unigram())
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), unk_token=UNK)
        backend.train_from_iterator(texts, trainer)
        return cls(backend)

    @classmethod
    def train_char_level(cls, texts: Iterable[str]) -> Tokenizer:
        """One token per character (newlines and spaces included); decoding concatenates.

        The special tokens still take ids 0–3, so a character model's vocabulary is the
        distinct characters plus four.
        """
        backend = HFTokenizer(models.WordLevel(unk_token=UNK))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=list(SPECIALS)))
        return cls(backend)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # the library raises a bare Exception for unreadable files
            raise UserError(f"cannot read tokenizer {path}: {e}") from None

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def tokens(self, text: str) -> list[str]:
        """The token strings of ``text`` (for labelling attention pictures)."""
        return self.backend.encode(text, add_special_tokens=False).tokens

    def id_to_token(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or UNK

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)
