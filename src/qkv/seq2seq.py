"""Encoder-decoder outputs as text: batched translation of sentences, n-best, alignments.

What is here: :func:`translate` and :func:`beam_translate` (token-budget batches of sentences,
beam search, a max length relative to each source), :func:`source_ids` / :func:`cut_source`
(sources cut to the window), :func:`cross_attention` and :func:`alignments` (from the last
decoder layer's cross-attention weights). What takes the model's tokenizers takes one tokenizer
(a joint vocabulary) or :class:`~qkv.tokenization.Vocabularies`, and encodes sources with the
source tokenizer, decodes outputs with the target one. Every encoder-decoder task (numbers,
translation, and speech translation to come) and the command line decode through here.

What is not here: the decoding algorithms (``decoding/``, which knows no tokenizer), the
task runners (``tasks/``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from qkv.decoding import Required, Scorer, beam_search, constrained_beam_search
from qkv.ensemble import Ensemble
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.tokenization import Tokenizer, Vocabularies


def cross_attention(model: EncoderDecoder, *, src: list[int], out: list[int]) -> torch.Tensor:
    """Cross-attention weights of the last decoder layer while it produces ``out`` + END.

    Row t is the step that reads BEGIN + out[:t] and produces (out + [END])[t].

    Shapes: returns (H, T, S) with T = len(out) + 1 and S = len(src).
    """
    c = model.config
    source = torch.tensor([src])  # (1, S)
    target = torch.tensor([[c.bos_id, *out]])  # (1, T)
    with torch.no_grad():
        memory = model.encode(source)  # (1, S, D)
        attention = model.decode(target, memory, src_mask=source != c.pad_id, need_weights=True).attention
    return attention[-1][0]  # (H, T, S)


class Translation(NamedTuple):
    """One scored output of :func:`translate`: detokenized text, token ids, beam score."""

    text: str
    tokens: list[int]
    score: float


def translate(
    model: EncoderDecoder | Ensemble,
    tokenizers: Tokenizer | Vocabularies,
    texts: list[str],
    *,
    beam_size: int,
    nbest: int = 1,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    max_tokens: int = 8192,
    prefix: Sequence[int] = (),
    scorers: Sequence[Scorer] = (),
    required: Sequence[Sequence[Required]] | None = None,
) -> list[list[Translation]]:
    """The ``nbest`` best outputs of every text, in input order.

    Texts are decoded in batches of similar length holding at most ``max_tokens`` source
    tokens times the beam width. A source longer than the model's window is cut to it; an
    output may have at most ⌊a·S⌋ + b tokens, S its own source's length (the max-length rule
    of fairseq's ``--max-len-a/-b``). An empty (or all-blank) text gives empty outputs. Texts are
    encoded with the source tokenizer, outputs decoded with the target one.

    Constraints (``decoding``): ``prefix``, target tokens every output starts with (forced
    after BEGIN, and part of each output's tokens and text; the cap counts the tokens after
    them); ``scorers``, full scorers such as bans; ``required``, each text's required terms,
    searched for by ``decoding.constrained_beam_search`` (None: plain beam search).
    """
    vocab = Vocabularies.of(tokenizers)
    forced = [model.config.bos_id, *prefix] if prefix else None
    sources = source_ids(vocab.source, texts, window=model.config.max_len)
    found: list[list[Translation]] = [[Translation("", [], 0.0)] * nbest for _ in texts]
    todo = sorted((i for i in range(len(texts)) if texts[i].strip() and sources[i]), key=lambda i: len(sources[i]))
    budget = max(1, max_tokens // beam_size)
    k = 0
    while k < len(todo):
        end = k + 1  # sorted by length: the chunk's last source is its longest
        while end < len(todo) and len(sources[todo[end]]) * (end - k + 1) <= budget:
            end += 1
        chunk, k = todo[k:end], end
        # At least one token (END): a small a with b = 0 rounds a short source's cap to 0.
        caps = [max(1, int(max_len_a * len(sources[i])) + max_len_b) for i in chunk]
        inputs = [sources[i] for i in chunk]
        if required is None:
            hypotheses = beam_search(
                model,
                inputs,
                beam_size=beam_size,
                nbest=nbest,
                length_penalty=length_penalty,
                max_new_tokens=caps,
                prefix=forced,
                scorers=scorers,
            )
        else:
            hypotheses = constrained_beam_search(
                model,
                inputs,
                required=[required[i] for i in chunk],
                beam_size=beam_size,
                nbest=nbest,
                length_penalty=length_penalty,
                max_new_tokens=caps,
                prefix=forced,
                scorers=scorers,
            )
        for i, hyps in zip(chunk, hypotheses, strict=True):
            written = [[*prefix, *h.tokens] for h in hyps]
            found[i] = [Translation(vocab.target.decode(t), t, h.score) for t, h in zip(written, hyps, strict=True)]
            # Always nbest outputs, so they can be matched to inputs by counting.
            found[i] += [Translation("", [], float("-inf"))] * (nbest - len(found[i]))
    return found


def source_ids(tokenizer: Tokenizer, texts: list[str], *, window: int) -> list[list[int]]:
    """Encoder ids of each text, cut to the window. A tokenizer that ends sources with END
    (a converted Marian one) keeps it when the text is cut: the model only saw sources ending so."""
    return [cut_source(tokenizer, ids, window=window) for ids in tokenizer.encode_batch(texts)]


def cut_source(tokenizer: Tokenizer, ids: list[int], *, window: int) -> list[int]:
    """``ids`` cut to the window, keeping a final END the tokenizer added (see :func:`source_ids`)."""
    if len(ids) <= window:
        return ids
    if tokenizer.add_special_tokens and tokenizer.eos_id is not None and ids[-1] == tokenizer.eos_id:
        return [*ids[: window - 1], tokenizer.eos_id]
    return ids[:window]


def beam_translate(
    model: EncoderDecoder | Ensemble,
    tokenizers: Tokenizer | Vocabularies,
    texts: list[str],
    *,
    beam_size: int,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
) -> list[str]:
    """The best output of every text, in order (:func:`translate`)."""
    found = translate(
        model,
        tokenizers,
        texts,
        beam_size=beam_size,
        length_penalty=length_penalty,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
    )
    return [hyps[0].text for hyps in found]


@torch.no_grad()
def alignments(model: EncoderDecoder, *, src: list[list[int]], out: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Hard alignments from cross-attention: each output token (END excluded) paired with the
    source token its last decoder layer attends to most, averaged over heads (as fairseq's
    ``--print-alignment`` does with its alignment layer). Pairs are (source index, output index).
    """
    found: list[list[tuple[int, int]]] = []
    for s, o in zip(src, out, strict=True):
        if not s or not o:
            found.append([])
            continue
        weights = cross_attention(model, src=s, out=o)  # (H, T, S)
        best = weights.mean(0)[: len(o)].argmax(-1).tolist()  # (T,): END's row dropped
        found.append([(j, t) for t, j in enumerate(best)])
    return found
