"""Tokenizers: a thin wrapper over Hugging Face ``tokenizers`` with qkv's special tokens.

What is here: :class:`Tokenizer`, which trains a word-level vocabulary (digits split one
by one) or loads any ``tokenizer.json``, encodes text to ids and decodes ids to text, and
knows the ids of padding, BEGIN, END and unknown (and, for masked-LM vocabularies, of the
mask token ``<mask>``, added after the others). Its file is stored inside a model
directory and its SHA-256 in ``config.json`` (``checkpoint.py``), so a model is never run
with a tokenizer it was not trained with. A tokenizer whose special tokens are not qkv's
(one converted from a Hugging Face checkpoint by ``hf.py``: BERT's [PAD], [CLS], [SEP],
[UNK], GPT-2's <|endoftext|>, Marian's BEGIN <pad>) names them in ``special_tokens.json``
beside its file. That file may also say ``"add_special_tokens": true``: then ``encode``
applies the tokenizer's post-processor, which a converted Marian tokenizer uses to end every
text with </s>, as MarianTokenizer ends sources (BERT's, which adds [CLS] and [SEP], is not
applied: qkv adds BEGIN and END itself where a model needs them).

A ``tokenizer.json`` may carry padding and truncation settings (a published
sentence-transformers checkpoint asks for fixed padding to 128 tokens and truncation at 128):
they are switched off whenever a :class:`Tokenizer` is made, loaded or imported, so ``encode``
gives a text's own ids, never [PAD]s or a cut, and the file a model directory stores holds
neither. qkv pads and masks its batches itself, and cuts a text to the model's window (for an
imported checkpoint, the window its authors set: ``hf/convert.py``).

:class:`Vocabularies` pairs the tokenizer that reads an encoder-decoder's source with the one
that writes (and scores) its target: one joint tokenizer for both, or two separate ones with
the same special tokens, stored as ``tokenizer.json`` (source) and ``target_tokenizer.json``.

What is not here: the tokenization algorithms themselves (the library's), batching.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from qkv.errors import UserError
from qkv.files import read_json_object

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3 in every vocabulary qkv trains
ROLES = ("pad", "bos", "eos", "unk")  # what each of SPECIALS is for
MASK = "<mask>"  # masked-LM vocabularies only: appended by Tokenizer.add_mask, after every other id
FILE = "tokenizer.json"
TARGET_FILE = "target_tokenizer.json"  # an encoder-decoder's target tokenizer, with separate vocabularies
SPECIALS_FILE = "special_tokens.json"  # beside FILE: {role: token or null}, when not qkv's SPECIALS
ADD_SPECIALS = "add_special_tokens"  # in SPECIALS_FILE: true when encode applies the post-processor


class Tokenizer:
    """Text ↔ token ids, and the ids ``pad_id``, ``bos_id``, ``eos_id``, ``unk_id``.

    A vocabulary qkv trains has them at 0–3 (``SPECIALS``). ``specials`` names other tokens
    for these roles ({"pad": "[PAD]", "bos": "[CLS]", ...}); a role mapped to None has no
    token and its id is None (GPT-2 has no padding token). With ``add_special_tokens``,
    ``encode`` lets the backend's post-processor add its tokens (Marian's </s> at the end of
    every text: the model was trained on sources that end with it). The backend's padding and
    truncation are switched off (on ``backend`` itself): how a text is batched and cut is qkv's
    to decide, not the file's.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        specials: dict[str, str | None] | None = None,
        add_special_tokens: bool = False,
    ) -> None:
        backend.no_padding()  # a file's fixed padding would make every text [PAD]s qkv reads as tokens
        backend.no_truncation()
        self.backend = backend
        self.path: Path | None = None  # the file it was loaded from, named in the library's errors
        self.prepare: Callable[[str], str] | None = None  # see reading()
        self.add_special_tokens = add_special_tokens
        self._token_texts: list[str] | None = None  # see token_texts()
        if specials is None:
            specials = dict(zip(ROLES, SPECIALS, strict=True))
        unknown = sorted(set(specials) - set(ROLES))
        if unknown:
            raise UserError(f"unknown special-token role(s) {', '.join(unknown)}; known: {', '.join(ROLES)}")
        self.specials: dict[str, str | None] = {role: specials.get(role) for role in ROLES}
        ids = {role: None if t is None else backend.token_to_id(t) for role, t in self.specials.items()}
        missing = [t for role, t in self.specials.items() if t is not None and ids[role] is None]
        if missing:
            raise UserError(f"tokenizer lacks the special token(s) {', '.join(missing)}")
        self.pad_id: int | None = ids["pad"]
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.unk_id: int | None = ids["unk"]

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
    def train_subword(cls, texts: Iterable[str], *, vocab_size: int, newlines: bool = False) -> Tokenizer:
        """A unigram subword vocabulary (Kudo, 2018) of at most ``vocab_size`` pieces, trained by SentencePiece.

        SentencePiece trains (deterministically: fixed thread count, no sampling of the
        input; the ``tokenizers`` unigram trainer orders equal-score pieces differently from
        process to process); the pieces and scores then run in a ``tokenizers`` Unigram model
        with Metaspace ("▁" marks a word start, so decoding restores the spaces). Every
        character of the training text is kept (coverage 1.0). The one normalization
        (:func:`cjk_spaces`) drops spaces next to Chinese characters and CJK punctuation, for
        training and for every text encoded later: word-segmented Chinese (Tatoeba's "我 爱 你 。")
        and ordinary unsegmented Chinese ("我爱你。") then give the same pieces, and output
        decodes as ordinary Chinese. Text without such characters is unchanged.

        ``newlines=True`` is for running text (a language model's stream, whose line breaks
        matter): "\\n" is a piece of its own that no other piece contains (a SentencePiece
        user-defined symbol), and every newline also starts a word, as a space does, so the
        first word of a line gets the same "▁word" piece as anywhere else (without that it
        would be spelt out from word-internal pieces). The normalizer writes "\\n" as "\\n "
        and the decoder removes exactly that space again, so decoding gives back the text,
        spaces and blank lines included. SentencePiece trains on the lines, each with its
        newline, so its statistics match what encoding sees. The rule lives in the saved
        ``tokenizer.json`` (normalizer and decoder), so any ``tokenizers`` user reads it alike.
        """
        import io

        import sentencepiece

        normalizer = cjk_spaces()
        if newlines:
            texts = (line for text in texts for line in text.splitlines(keepends=True))
        proto = io.BytesIO()
        try:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=(normalizer.normalize_str(text) for text in texts),
                model_writer=proto,
                vocab_size=vocab_size,
                model_type="unigram",
                **{f"{role}_id": i for i, role in enumerate(("pad", "bos", "eos", "unk"))},
                **{f"{role}_piece": t for role, t in zip(("pad", "bos", "eos", "unk"), SPECIALS, strict=True)},
                normalization_rule_name="identity",
                character_coverage=1.0,
                hard_vocab_limit=False,  # at most vocab_size: a small text may not fill it
                num_threads=2,
                minloglevel=2,
                **({"user_defined_symbols": ["\n"], "remove_extra_whitespaces": False} if newlines else {}),
            )
        except RuntimeError as e:  # e.g. a vocabulary larger than the text allows
            raise UserError(f"cannot train a {vocab_size}-piece vocabulary: {str(e).splitlines()[-1]}") from None
        processor = sentencepiece.SentencePieceProcessor(model_proto=proto.getvalue())
        vocab = [(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.get_piece_size())]
        backend = HFTokenizer(models.Unigram(vocab, unk_id=SPECIALS.index(UNK), byte_fallback=False))
        backend.add_special_tokens(list(SPECIALS))
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        if newlines:
            backend.normalizer = normalizers.Sequence([normalizer, normalizers.Replace("\n", "\n ")])
            # Fuse first: the space to remove follows "\n" in the next piece ("▁word").
            backend.decoder = decoders.Sequence([decoders.Metaspace(), decoders.Fuse(), decoders.Replace("\n ", "\n")])
        else:
            backend.normalizer = normalizer
            backend.decoder = decoders.Metaspace()
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
        """Read a ``tokenizer.json``, with the special-token roles of ``special_tokens.json``
        beside it if there is one (else qkv's ``SPECIALS``)."""
        specials, add_special_tokens = _read_specials(Path(path).with_name(SPECIALS_FILE))
        if not Path(path).is_file():
            raise UserError(
                f"cannot read tokenizer {path}: {'it is a directory' if Path(path).is_dir() else 'no such file'}"
            )
        try:
            backend = HFTokenizer.from_file(str(path))
        except BaseException as e:  # a bare Exception for unreadable files, or a Rust panic
            if not _library_error(e):
                raise
            raise UserError(f"cannot read tokenizer {path}: {_first_line(e)}") from None
        try:
            tokenizer = cls(backend, specials=specials, add_special_tokens=add_special_tokens)
        except UserError as e:  # the roles of special_tokens.json that the vocabulary lacks
            raise UserError(f"{path}: {e}") from None
        except BaseException as e:
            if not _library_error(e):
                raise
            raise UserError(f"cannot read tokenizer {path}: {_first_line(e)}") from None
        tokenizer.path = Path(path)
        return tokenizer

    def save(self, path: str | Path) -> dict[str, Path]:
        """Write the tokenizer to ``path`` and, when its special tokens are not qkv's (or
        ``encode`` adds special tokens), their roles to ``special_tokens.json`` beside it;
        returns the files written by name, as a model directory's ``files`` takes them."""
        path = Path(path)
        self.backend.save(str(path))
        if self.specials == dict(zip(ROLES, SPECIALS, strict=True)) and not self.add_special_tokens:
            return {path.name: path}
        sidecar = path.with_name(SPECIALS_FILE)
        written: dict = dict(self.specials)
        if self.add_special_tokens:
            written[ADD_SPECIALS] = True
        sidecar.write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")
        return {path.name: path, sidecar.name: sidecar}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    @property
    def mask_id(self) -> int | None:
        """The id of the masked-LM mask token (qkv's ``<mask>``, else BERT's ``[MASK]``); None without one."""
        for token in (MASK, "[MASK]"):
            found = self.backend.token_to_id(token)
            if found is not None:
                return found
        return None

    def add_mask(self) -> Tokenizer:
        """Give the vocabulary a mask token (``<mask>``, the next free id) unless it has one; returns self.

        Every other id keeps its meaning, so a tokenizer with a mask reads text exactly as
        before; the mask token is special (matched whole in text, dropped by ``decode``).
        """
        if self.mask_id is None:
            self.backend.add_special_tokens([MASK])
            self._token_texts = None
        return self

    def reading(self, prepare: Callable[[str], str]) -> Tokenizer:
        """This tokenizer (the same backend) with every text passed through ``prepare`` before
        it is encoded: a model trained on texts written one way reads its inputs so (the
        speech-translation cascade's translator reads sources as a recognizer writes them:
        ``loading.load_for_generation``). Decoding is unchanged."""
        reader = copy.copy(self)
        reader.prepare = prepare
        return reader

    def _prepared(self, text: str) -> str:
        return text if self.prepare is None else self.prepare(text)

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        """Ids of ``text``; ``add_special_tokens`` as in :meth:`encode_batch`."""
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        with self._library("encode a text"):
            return self.backend.encode(self._prepared(text), add_special_tokens=add).ids

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool | None = None) -> list[list[int]]:
        """Ids of each text; ``add_special_tokens`` overrides the tokenizer's own setting (a
        translation target must not end with a converted Marian tokenizer's </s>: the
        training batch appends END itself)."""
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        with self._library("encode a text"):
            prepared = [self._prepared(t) for t in texts]
            return [e.ids for e in self.backend.encode_batch(prepared, add_special_tokens=add)]

    def tokens(self, text: str) -> list[str]:
        """The token strings of ``text`` (for labelling attention pictures)."""
        with self._library("encode a text"):
            return self.backend.encode(self._prepared(text), add_special_tokens=self.add_special_tokens).tokens

    def id_to_token(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or UNK

    def decode(self, ids: list[int]) -> str:
        with self._library("decode ids"):
            return self.backend.decode(ids, skip_special_tokens=True)

    def token_texts(self) -> list[str]:
        """Each id's text as :meth:`decode` writes it after another token: "▁cat" is " cat", a
        word-level token gets the space decoding puts between words, a special token writes
        "" (what banning a word matches tokens against: ``decoding.BannedWords``). Found as
        what one id adds to the text of a word-like token before it; computed once."""
        if self._token_texts is None:
            ids = range(self.vocab_size)
            with self._library("decode ids"):
                alone = self.backend.decode_batch([[t] for t in ids], skip_special_tokens=True)
                anchor = next((t for t in ids if alone[t].strip().isalnum()), None)
                pairs = [[t] if anchor is None else [anchor, t] for t in ids]
                after = self.backend.decode_batch(pairs, skip_special_tokens=True)
            before = "" if anchor is None else alone[anchor]
            self._token_texts = [
                a[len(before) :] if a.startswith(before) else t for a, t in zip(after, alone, strict=True)
            ]
        return self._token_texts

    @contextmanager
    def _library(self, what: str) -> Iterator[None]:
        """The ``tokenizers`` library's refusals (a bare Exception, or a Rust panic: a
        BaseException) of a tokenizer loaded from a file: a UserError naming the file. A
        tokenizer read without complaint can still fail here (a WordLevel vocabulary without
        its unknown token fails on the first unknown word)."""
        try:
            yield
        except BaseException as e:
            if self.path is None or not _library_error(e):
                raise
            raise UserError(f"tokenizer {self.path} cannot {what}: {_first_line(e)}") from None

    def same_as(self, other: Tokenizer) -> bool:
        """Whether ``other`` tokenizes and numbers text as this one does: the same serialized
        pipeline and vocabulary, special tokens and settings (compared as loaded, not as file
        bytes: ``tokenizers`` may write a score it read back with other digits)."""
        return (self.specials, self.add_special_tokens, self.prepare, self.backend.to_str()) == (
            other.specials,
            other.add_special_tokens,
            other.prepare,
            other.backend.to_str(),
        )


@dataclass(frozen=True)
class Vocabularies:
    """The tokenizers of an encoder-decoder: ``source`` encodes what the encoder reads,
    ``target`` encodes and decodes what the decoder writes. Joint (one vocabulary): one
    tokenizer backend for both (the source side may read prepared texts: ``Tokenizer.reading``).
    Separate: two tokenizers with the same special tokens at the same ids, since the model has
    one ``pad_id``/``bos_id``/``eos_id`` for both sides (a source padded with
    another id would be attended to as text), and with the same ``special_tokens.json``
    settings (one such file beside both in a model directory).
    """

    source: Tokenizer
    target: Tokenizer

    def __post_init__(self) -> None:
        if self.separate:
            source, target = self.source, self.target
            sides = [
                (
                    role,
                    (source.specials[role], getattr(source, f"{role}_id")),
                    (target.specials[role], getattr(target, f"{role}_id")),
                )
                for role in ROLES
            ]
            differ = [f"{role} {a[0]} (id {a[1]}) vs {b[0]} (id {b[1]})" for role, a, b in sides if a != b]
            if differ:
                raise UserError(
                    f"the source and target tokenizers must have the same special tokens at the same ids "
                    f"(differ: {', '.join(differ)})"
                )
            if source.add_special_tokens != target.add_special_tokens:
                raise UserError(f"the source and target tokenizers differ in {ADD_SPECIALS} ({SPECIALS_FILE})")

    @classmethod
    def of(cls, tokenizers: Tokenizer | Vocabularies) -> Vocabularies:
        """``tokenizers`` as Vocabularies: one tokenizer is a joint vocabulary."""
        return tokenizers if isinstance(tokenizers, Vocabularies) else cls(tokenizers, tokenizers)

    @property
    def separate(self) -> bool:
        # Joint: one backend, though the source side may read its texts prepared (reading()).
        return self.target.backend is not self.source.backend

    def same_as(self, other: Vocabularies) -> bool:
        """Whether ``other`` is these vocabularies: joint or separate alike, each side the same."""
        return (
            self.separate == other.separate and self.source.same_as(other.source) and self.target.same_as(other.target)
        )

    def tables(self, *, src_vocab_size: int, tgt_vocab_size: int) -> list[tuple[Tokenizer, str, int]]:
        """Each tokenizer, its file name in a model directory and the size of the model's
        embedding table its ids must fit: separate, the source's and the target's; joint, the
        one tokenizer and the smaller table (its ids index both)."""
        if not self.separate:
            return [(self.source, FILE, min(src_vocab_size, tgt_vocab_size))]
        return [(self.source, FILE, src_vocab_size), (self.target, TARGET_FILE, tgt_vocab_size)]

    def save(self, directory: str | Path) -> dict[str, Path]:
        """Write ``tokenizer.json`` (the source's, or the joint one), ``target_tokenizer.json``
        when separate, and ``special_tokens.json`` when needed into ``directory``; returns the
        files written by name, as a model directory's ``files`` takes them."""
        directory = Path(directory)
        files = self.source.save(directory / FILE)
        if self.separate:
            # The target's special-token settings equal the source's (checked above): the one
            # special_tokens.json written beside tokenizer.json describes both.
            self.target.backend.save(str(directory / TARGET_FILE))
            files[TARGET_FILE] = directory / TARGET_FILE
        return files

    @classmethod
    def load(cls, directory: str | Path, *, files: Collection[str]) -> Vocabularies:
        """The vocabularies of a model directory whose config.json lists ``files``: separate
        when ``target_tokenizer.json`` is among them, else ``tokenizer.json`` for both sides."""
        directory = Path(directory)
        source = Tokenizer.load(directory / FILE)
        if TARGET_FILE not in files:
            return cls(source, source)
        target = Tokenizer.load(directory / TARGET_FILE)
        try:
            return cls(source, target)
        except UserError as e:
            raise UserError(f"{directory / TARGET_FILE}: {e}") from None


class SegmentationSampler:
    """Subword regularization (Kudo, 2018): a new segmentation of every text each epoch.

    A unigram vocabulary can split a text in many ways; ``encode`` always takes the most
    probable one (Viterbi). Training on sampled segmentations instead shows the model many
    spellings of each word in pieces, which regularises it (Kudo, section 5: the gains are
    largest on the smallest corpora). This is the paper's l-best sampling (section 3.2):
    SentencePiece finds the ``nbest`` most probable segmentations of each text once, when the
    sampler is built (deterministic: no random state); :meth:`sample` then draws one per text
    with probability ∝ P(segmentation)^alpha (equation 10), by a generator seeded with the
    caller's seed, so an epoch's draw is a function of (seed, epoch) and a resumed run
    draws the same. alpha → 0 is uniform over the l-best; large alpha is almost always the
    best one. (SentencePiece's own sampling, ``enable_sampling``, draws from a process-wide
    generator whose state the caller cannot restore, so a resumed run would draw differently.)

    Needs a unigram tokenizer with Metaspace pre-tokenization (the ones ``train_subword``
    makes) whose ``encode`` adds no special tokens. The first of each text's segmentations is
    the one ``tokenizer.encode`` gives: checked text by text when the sampler is built; a text
    SentencePiece reads otherwise (one that starts with a space, a special token written out)
    keeps that one segmentation only.
    """

    def __init__(self, tokenizer: Tokenizer, texts: list[str], *, nbest: int, alpha: float) -> None:
        import numpy as np

        if not 1 <= nbest <= MAX_NBEST or alpha <= 0:
            raise ValueError(f"nbest must be in 1..{MAX_NBEST} and alpha > 0, got {nbest} and {alpha}")
        processor, scores = _sentencepiece_of(tokenizer)
        normalizer = tokenizer.backend.normalizer
        best = tokenizer.encode_batch(list(texts))
        texts = [normalizer.normalize_str(t) for t in texts] if normalizer is not None else list(texts)
        self.alpha = alpha
        # Per text i: its segmentations' ids end to end, and where segmentation k starts and
        # ends, _flat[i][_offsets[i, k] : _offsets[i, k + 1]] (missing ones, beyond a short
        # text's count, are empty and scored -inf): arrays per text, not per segmentation.
        self._flat: list[np.ndarray] = []  # N arrays of ids, int32
        self._offsets = np.zeros((len(texts), nbest + 1), dtype=np.int64)  # (N, l + 1)
        self._scores = np.full((len(texts), nbest), -np.inf)  # (N, l) log P of each segmentation
        chunk = 2048  # the n-best lists of a chunk at a time as Python lists, then as arrays
        for start in range(0, len(texts), chunk):
            found = processor.nbest_encode(texts[start : start + chunk], nbest_size=nbest)
            for i, segmentations in enumerate(found, start):
                if not segmentations or segmentations[0] != best[i]:
                    segmentations = [best[i]]  # SentencePiece reads this text otherwise: no sampling
                lengths = [len(ids) for ids in segmentations]
                flat = np.fromiter((t for ids in segmentations for t in ids), dtype=np.int32, count=sum(lengths))
                ends = np.cumsum(lengths)
                self._flat.append(flat)
                self._offsets[i, 1 : len(lengths) + 1] = ends
                self._offsets[i, len(lengths) + 1 :] = ends[-1]
                if len(flat):  # every segmentation of a non-empty text has pieces
                    self._scores[i, : len(lengths)] = np.add.reduceat(scores[flat], ends - np.asarray(lengths))
                else:
                    self._scores[i, 0] = 0.0

    def __len__(self) -> int:
        return len(self._flat)

    def _segmentation(self, i: int, k: int) -> list[int]:
        """The ids of text i's k-th most probable segmentation."""
        return self._flat[i][self._offsets[i, k] : self._offsets[i, k + 1]].tolist()

    def best(self) -> list[list[int]]:
        """The most probable segmentation of every text (what ``Tokenizer.encode`` gives)."""
        return [self._segmentation(i, 0) for i in range(len(self))]

    def sample(self, seed: list[int]) -> list[list[int]]:
        """One segmentation per text, drawn ∝ P^alpha among its l-best (Gumbel-max: the
        argmax of alpha·log P + Gumbel noise is such a draw); ``seed`` (non-negative
        integers) seeds the draw."""
        import numpy as np

        noise = np.random.default_rng(seed).gumbel(size=self._scores.shape)  # (N, l)
        chosen = np.argmax(self.alpha * self._scores + noise, axis=1)  # (N,): -inf never wins
        return [self._segmentation(i, k) for i, k in enumerate(chosen.tolist())]


MAX_NBEST = 512  # SentencePiece's limit on n-best segmentations


def _sentencepiece_of(tokenizer: Tokenizer) -> tuple[Any, Any]:
    """A SentencePiece processor that segments as ``tokenizer``'s unigram model does (same
    pieces, scores and ids; "▁" before every word, as Metaspace writes spaces), and the
    piece scores (log probabilities) by id as a float64 array, the unknown piece's as
    SentencePiece scores it (the lowest piece score less 10)."""
    import numpy as np
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as pb

    spec = json.loads(tokenizer.backend.to_str())
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    problems = [
        (model.get("type") != "Unigram", f"a unigram vocabulary; this tokenizer's is {model.get('type')}"),
        (model.get("unk_id") is None, "a unigram vocabulary with an unknown-token piece"),
        (pre.get("type") != "Metaspace", f"Metaspace pre-tokenization; this tokenizer's is {pre.get('type')}"),
        (pre.get("replacement", "▁") != "▁", "Metaspace with the replacement '▁'"),
        (pre.get("prepend_scheme", "always") != "always", "Metaspace with prepend_scheme 'always'"),
        (not pre.get("split", True), "Metaspace that splits words (split: true)"),
        (tokenizer.add_special_tokens, "a tokenizer that adds no special tokens when encoding"),
    ]
    for failed, needs in problems:
        if failed:
            raise UserError(f"subword sampling needs {needs}")
    proto = pb.ModelProto()
    specials = {t for t in tokenizer.specials.values() if t is not None}
    for i, (piece, score) in enumerate(model["vocab"]):
        entry = proto.pieces.add()
        entry.piece, entry.score = piece, score
        if i == model["unk_id"]:
            entry.type = pb.ModelProto.SentencePiece.UNKNOWN
        elif piece in specials:
            entry.type = pb.ModelProto.SentencePiece.CONTROL  # padding, BEGIN, END: never matched in text
    proto.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    proto.trainer_spec.unk_id = model["unk_id"]
    proto.trainer_spec.bos_id = proto.trainer_spec.eos_id = proto.trainer_spec.pad_id = -1
    proto.normalizer_spec.name = "identity"  # the tokenizer's own normalizer runs first
    proto.normalizer_spec.add_dummy_prefix = True
    proto.normalizer_spec.remove_extra_whitespaces = False
    processor = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())
    scores = np.asarray([score for _, score in model["vocab"]], dtype=np.float64)
    normal = [
        score for i, (piece, score) in enumerate(model["vocab"]) if i != model["unk_id"] and piece not in specials
    ]
    scores[model["unk_id"]] = min(normal, default=0.0) - 10.0  # SentencePiece's kUnkPenalty
    return processor, scores


# Han characters, CJK symbols and punctuation (U+3000-303F: "。", "、"), full-width forms
# (U+FF00-FFEF: "！", "，"), in Oniguruma syntax (the ``tokenizers`` regex engine).
_CJK = r"[\p{Han}\x{3000}-\x{303f}\x{ff00}-\x{ffef}]"


def cjk_spaces() -> normalizers.Normalizer:
    """A normalizer that removes spaces next to a Chinese character or CJK punctuation.

    Chinese is written without spaces; corpora that come word-segmented (Tatoeba zh) add
    them. Removing them on both sides makes segmented and unsegmented text tokenize alike.
    """
    return normalizers.Replace(Regex(rf"(?<={_CJK}) +| +(?={_CJK})"), "")


def _library_error(error: BaseException) -> bool:
    """Whether ``error`` is how the ``tokenizers`` library refuses: a bare ``Exception`` (its
    errors have no class of their own) or a Rust panic (pyo3's ``PanicException``, which
    derives from BaseException so that ``except Exception`` lets it through)."""
    return type(error) is Exception or type(error).__name__ == "PanicException"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _read_specials(path: Path) -> tuple[dict[str, str | None] | None, bool]:
    """The roles in a ``special_tokens.json`` (None when there is no such file) and its
    ``add_special_tokens`` (false when absent)."""
    if not path.is_file():
        return None, False
    specials = read_json_object(path)
    add_special_tokens = specials.pop(ADD_SPECIALS, False)
    if not isinstance(add_special_tokens, bool):
        raise UserError(f"{path}: field {ADD_SPECIALS!r} must be true or false, got {add_special_tokens!r}")
    if not all(v is None or isinstance(v, str) for v in specials.values()):
        raise UserError(f"{path} must map roles ({', '.join(ROLES)}) to token strings or null")
    return specials, add_special_tokens
