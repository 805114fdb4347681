"""What a decoding job's outputs must obey: :func:`constraints` (a forced ``prefix``, banned
words ``ban``, required words ``require`` and, for translation, ``terms`` read by
:func:`read_terms`; an imported checkpoint's own ``bad_words_ids`` always) as
:class:`Constraints`, what the searches take: the prefix's tokens, the bans as scorers, each
input's required terms.

What is not here: the searches that obey them and the scorers themselves (``qkv.decoding``:
``BannedWords``, ``BannedSequences``, ``Required``, ``constrained_beam_search``), the jobs that
take them (``translation.py``, ``transcription.py``, ``generation.py``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qkv.decoding import AT_START, BannedSequences, BannedWords, Required, Scorer
from qkv.errors import OptionError, UserError
from qkv.tokenization import Tokenizer

if TYPE_CHECKING:
    from qkv.bundle.core import Bundle


@dataclass(frozen=True)
class Constraints:
    """A decoding job's constraints as its search takes them (:func:`constraints`).

    Attributes:
        shown: the forced prefix's target tokens: decoded first (after an encoder-decoder's
            BEGIN, at the end of a language model's prompt) and part of every output.
        scorers: the bans (the checkpoint's ``bad_words_ids``, the banned words).
        required: each input's required terms (None: plain search, no term anywhere).
    """

    shown: list[int] = field(default_factory=list)
    scorers: tuple[Scorer, ...] = ()
    required: list[list[Required]] | None = None

    def forced(self, bundle: Bundle) -> list[int] | None:
        """An encoder-decoder's forced first tokens (BEGIN, then the prefix), or None: BEGIN alone."""
        return [bundle.model.config.bos_id, *self.shown] if self.shown else None


def constraints(
    bundle: Bundle,
    sources: Sequence[str | None],
    *,
    prefix: str | None = None,
    ban: Sequence[str] = (),
    require: Sequence[str] = (),
    terms: Sequence[tuple[str, str]] = (),
    beam_size: int = 1,
    sampling: bool = False,
) -> Constraints:
    """What a job's outputs must obey, for inputs whose texts are ``sources`` (None: audio).

    ``prefix``: text every output starts with, as written (encoded without special tokens; an
    imported Whisper's after a space, as openai/whisper does); it is part of the output text.
    ``ban``: words no output writes, however the tokens spell them (``decoding.BannedWords``:
    where a word starts, as written, and so also the words it starts). ``require``: words every
    output contains, and ``terms``: (source, target) pairs whose target is required of each input
    whose text holds the source as a word (as written); both need beam search
    (``decoding.constrained_beam_search``) and are forced as the tokenizer writes them at a
    text's start or after a space. A word the prefix already writes is not required again. An
    imported checkpoint's ``bad_words_ids`` (config.json's ``hf``) are banned whatever is given.
    Without any, a job decodes exactly as it does without constraints.
    """
    if (require or terms) and (sampling or beam_size < 2):
        named = [name for name, given in (("require", require), ("terms", terms)) if given]
        how = ("sampling", "draws each token") if sampling else ("beam_size", f"{beam_size} is greedy decoding")
        need = "needs" if len(named) == 1 else "need"
        raise OptionError(f"{' and '.join(named)} {need} beam search: {how[0]} {how[1]}", *named, how[0])
    target = bundle.vocab.target
    shown = _prefix_tokens(bundle, prefix)
    written = target.decode(shown)
    scorers: list[Scorer] = _checkpoint_bans(bundle, shown)
    words = _words(ban, "ban")
    if words:
        for word in words:
            if _starts_word(word, written):
                raise OptionError(f"prefix {prefix!r} writes the banned word {word!r}", "prefix", "ban")
        scorers.append(BannedWords(words, target.token_texts(), after=written))
    wanted = _words(require, "require")
    both = sorted(set(words) & set(wanted))
    if both:
        raise OptionError(f"{both[0]!r} is both banned and required", "ban", "require")
    if not wanted and not terms:
        return Constraints(shown, tuple(scorers), None)
    return Constraints(shown, tuple(scorers), _required(target, sources, wanted, terms, written))


def _required(
    target: Tokenizer,
    sources: Sequence[str | None],
    wanted: list[str],
    terms: Sequence[tuple[str, str]],
    written: str,
) -> list[list[Required]]:
    """Each input's required terms: the ``wanted`` words and the targets of the ``terms`` whose
    source its text holds, each once, but those the prefix (``written``) already writes. After a
    prefix, the output's first tokens follow text: a word may not be written there as at a
    text's start (it would be glued to the prefix, " A" + "dog")."""
    at_start = not written
    ways = {word: _ways(target, word, "require", at_start=at_start) for word in wanted}
    required = []
    for text in sources:
        # A substring test first: a long glossary meets each text in C before any pattern does.
        found = [t for s, t in terms if text is not None and s in text and _holds_word(text, s)]
        for word in found:
            if word not in ways:
                ways[word] = _ways(target, word, "terms", at_start=at_start)
        required.append([ways[word] for word in dict.fromkeys(wanted + found) if not _holds_word(written, word)])
    return required


def read_terms(path: str | Path) -> list[tuple[str, str]]:
    """Terminology from a file of SOURCE<TAB>TARGET lines (UTF-8; blank lines skipped), as
    :func:`translations` takes it; a line that is not two non-empty fields is refused naming
    the file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read terms {path}: {getattr(e, 'strerror', None) or 'not UTF-8 text'}") from None
    pairs = []
    for number, line in enumerate(lines, 1):
        fields = line.split("\t")
        if not line.strip():
            continue
        if len(fields) != 2 or not fields[0].strip() or not fields[1].strip():
            raise UserError(f"{path}:{number}: expected SOURCE<TAB>TARGET, two non-empty fields; got {line!r}")
        pairs.append((fields[0].strip(), fields[1].strip()))
    return pairs


def _words(given: Sequence[str], option: str) -> list[str]:
    """The words of a ``ban`` or ``require`` option, stripped, each once; an empty one refused."""
    if isinstance(given, str):
        raise OptionError(f"{option} is a list of words, not one string", option)
    words = [w.strip() for w in given]
    if any(not w for w in words):
        raise OptionError(f"{option}: give words, not an empty one", option)
    return list(dict.fromkeys(words))


def _starts_word(word: str, text: str) -> bool:
    """Whether ``text`` writes ``word`` where a word starts (as ``decoding.BannedWords`` matches)."""
    boundary = r"(?<!\w)" if re.match(r"\w", word) else ""  # a word starting with "$" starts anywhere
    return re.search(boundary + re.escape(word), text) is not None


def _holds_word(text: str, word: str) -> bool:
    """Whether ``text`` holds ``word`` as a word of its own (nothing of a word just before or after it)."""
    return re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", text) is not None


def _ways(tokenizer: Tokenizer, word: str, option: str, *, at_start: bool = True) -> Required:
    """A required word as token sequences: as the tokenizer writes it after a space (the tokens
    "a " + word adds to "a") and, where that differs and ``at_start``, at a text's start (only
    there: glued to other text it would write another word), without any unknown token."""
    alone = tuple(tokenizer.encode(word, add_special_tokens=False))
    head = tokenizer.encode("a", add_special_tokens=False)
    spaced = tokenizer.encode("a " + word, add_special_tokens=False)
    after_space = tuple(spaced[len(head) :]) if spaced[: len(head)] == head else ()
    ways = {w for w in (alone if at_start else (), after_space) if w and tokenizer.unk_id not in w}
    ways = {w if w == after_space else (AT_START, *w) for w in ways}
    if not ways:
        raise OptionError(f"{option} {word!r}: the model's vocabulary cannot write it", option)
    return Required(tuple(sorted(ways)))


def _prefix_tokens(bundle: Bundle, prefix: str | None) -> list[int]:
    """The target tokens of a forced ``prefix`` (none without one); one the vocabulary cannot
    write, or longer than half the window, is refused."""
    if prefix is None:
        return []
    target, half = bundle.vocab.target, bundle.window // 2
    ids = target.encode(" " + prefix.strip() if bundle.whisper is not None else prefix, add_special_tokens=False)
    if not ids or target.unk_id in ids:
        raise OptionError(f"prefix {prefix!r}: the model's vocabulary cannot write it", "prefix")
    if len(ids) > half:
        raise OptionError(f"prefix {prefix!r} is {len(ids)} tokens; the model's window takes at most {half}", "prefix")
    return ids


def _checkpoint_bans(bundle: Bundle, shown: list[int]) -> list[Scorer]:
    """An imported checkpoint's ``bad_words_ids`` (config.json's ``hf``), as Hugging Face's
    generation applies them (e.g. Marian's padding token, never written); none for others."""
    sequences = (bundle.meta.get("hf") or {}).get("bad_words_ids")
    if not sequences:
        return []
    vocab = getattr(bundle.model.config, "tgt_vocab_size", None) or bundle.model.config.vocab_size
    good = isinstance(sequences, list) and all(
        isinstance(seq, list) and seq and all(type(t) is int and 0 <= t < vocab for t in seq) for seq in sequences
    )
    if not good:
        raise UserError(f"{bundle.path / 'config.json'}: hf.bad_words_ids must be lists of token ids below {vocab}")
    return [BannedSequences(sequences, after=shown)]
