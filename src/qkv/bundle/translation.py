"""The translating job: :func:`translations` (each text's n best translations, by the recipe's
decoding defaults unless told otherwise, with constraints, alone or with an ensemble of models
of the same vocabularies), :data:`TRANSLATE_CHUNK` texts per call.

What is not here: the beam search over batches and cutting a source to the window
(``qkv.seq2seq``), the ensemble's decoding (``qkv.ensemble``), the constraints
(``constraints.py``), generation with an encoder-decoder (``generation.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from qkv.bundle.constraints import constraints
from qkv.ensemble import Ensemble
from qkv.errors import OptionError
from qkv.loading import KIND_NAMES
from qkv.seq2seq import Translation, translate

if TYPE_CHECKING:
    from qkv.bundle.core import Bundle


TRANSLATE_CHUNK = 1024  # texts translated per call: bounded memory (each is batched by tokens inside)


def translations(
    bundle: Bundle,
    texts: Sequence[str],
    *,
    beam_size: int | None = None,
    nbest: int = 1,
    length_penalty: float | None = None,
    max_len_a: float | None = None,
    max_len_b: int | None = None,
    max_tokens: int = 8192,
    ensemble: Sequence[Bundle] = (),
    on_batch: Callable[[int], None] | None = None,
    prefix: str | None = None,
    ban: Sequence[str] = (),
    require: Sequence[str] = (),
    terms: Sequence[tuple[str, str]] = (),
) -> list[list[Translation]]:
    """Each text's ``nbest`` best translations, in input order (``seq2seq.translate``: beam
    search over batches of similar length, at most ``max_tokens`` source tokens times the beam
    each; a source cut to the window; an empty text gives empty outputs). Unset settings are
    the recipe's (:attr:`Bundle.decode`). ``ensemble``: other encoder_decoder models with the
    same vocabularies, decoded with this one as one (the mean of their distributions).
    ``on_batch(n)`` after every n texts (a progress bar). ``prefix``, ``ban``, ``require``,
    ``terms``: constraints (:func:`constraints`; a translation's tokens and text start with the
    prefix's)."""
    bundle.require("translate")
    d = bundle.decode
    beam = d.beam_size if beam_size is None else beam_size
    if nbest > beam:
        raise OptionError(f"nbest {nbest} needs beam_size of at least {nbest}", "nbest", "beam_size")
    a = d.max_len_a if max_len_a is None else max_len_a
    b = d.max_len_b if max_len_b is None else max_len_b
    if a == 0 and b == 0:  # a*S + b = 0 tokens for every source: nothing could be written
        raise OptionError("max_len_a 0 and max_len_b 0 allow no output token; raise either", "max_len_a", "max_len_b")
    model = _ensemble(bundle, ensemble) if ensemble else bundle.model
    steer = constraints(bundle, texts, prefix=prefix, ban=ban, require=require, terms=terms, beam_size=beam)
    found: list[list[Translation]] = []
    for start in range(0, len(texts), TRANSLATE_CHUNK):
        chunk = list(texts[start : start + TRANSLATE_CHUNK])
        required = None if steer.required is None else steer.required[start : start + TRANSLATE_CHUNK]
        found += translate(
            model,
            bundle.vocab,
            chunk,
            beam_size=beam,
            nbest=nbest,
            length_penalty=d.length_penalty if length_penalty is None else length_penalty,
            max_len_a=a,
            max_len_b=b,
            max_tokens=max_tokens,
            prefix=steer.shown,
            scorers=steer.scorers,
            required=required,
        )
        if on_batch is not None:
            on_batch(len(chunk))
    return found


def _ensemble(bundle: Bundle, others: Sequence[Bundle]) -> Ensemble:
    """The bundle's model and the ``others``' as one :class:`~qkv.ensemble.Ensemble`; each must
    be an encoder_decoder with the bundle's vocabularies (the same tokenizers, special tokens
    and settings)."""
    models = [bundle.model]
    for other in others:
        if other.kind != "encoder_decoder":
            raise OptionError(
                f"ensemble {other.path} holds {KIND_NAMES[other.kind]}; translating together needs encoder_decoder "
                "models",
                "ensemble",
            )
        if not other.vocab.same_as(bundle.vocab):
            raise OptionError(
                f"ensemble {other.path}: its tokenizer, or how it reads sources (data.source_as_transcript), "
                f"differs from {bundle.path}'s; ensembled models must share their vocabularies",
                "ensemble",
            )
        try:  # Ensemble's own checks (special ids, vocabulary sizes), this model against the bundle's
            Ensemble((bundle.model, other.model))
        except ValueError as e:
            raise OptionError(f"ensemble {other.path} does not fit {bundle.path} ({e})", "ensemble") from None
        models.append(other.model)
    return Ensemble(tuple(models))
