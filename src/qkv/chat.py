"""Multi-turn chat on any text-generating model: the dialogue kept within the model's window.

What is here: :func:`dialogue_context` (the most recent turns that fit, joined by a
separator) and :func:`reply` (the next turn: a decoder-only model continues the dialogue
until it writes the separator or END; an encoder-decoder model reads the dialogue as its
source and writes the reply as its target: with separate vocabularies, the dialogue is
encoded by the source tokenizer and the reply decoded by the target one).

The window rule: the newest turns are kept whole, oldest dropped first; a single turn
longer than the room left is cut from its start (its end is what the reply answers). A
decoder-only model keeps room for ``max_new_tokens`` of reply.

What is not here: the prompt loop and terminal handling (``cli.py``), decoding (``decoding/``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from qkv.decoding import DecodingModel, beam_search, continuation, member, most_likely
from qkv.models.decoder_only import DecoderOnly
from qkv.tokenization import Tokenizer, Vocabularies


def dialogue_context(turns: list[str], tokenizer: Tokenizer, *, room: int, separator: str) -> list[int]:
    """Token ids of the newest turns that fit in ``room`` tokens, each followed by ``separator``
    (less its trailing spaces)."""
    if room < 1:
        raise ValueError(f"no room for any context (room={room})")
    kept: list[int] = []
    # Trailing spaces of the separator are left out: with word-start markers (SentencePiece's
    # "▁") a final space would become a lone "▁" piece the model never saw at a turn's end;
    # the space belongs to the next word, which the model writes.
    end = separator.rstrip(" ") or separator
    for turn in reversed(turns):
        # No special tokens per turn: a converted Marian tokenizer would end every turn with
        # </s>; an encoder-decoder's source gets its one END in reply().
        ids = tokenizer.encode(turn + end, add_special_tokens=False)
        if len(kept) + len(ids) > room:
            if not kept:
                kept = ids[-room:]  # a single over-long turn: keep its end
            break
        kept = ids + kept
    return kept


def reply(
    model: DecodingModel,
    tokenizers: Tokenizer | Vocabularies,
    turns: list[str],
    *,
    separator: str,
    max_new_tokens: int,
    beam_size: int = 4,
    choose: Callable[[Tensor], Tensor] | None = None,
) -> str:
    """The model's next turn after ``turns`` (the dialogue so far, oldest first).

    ``choose`` picks each token (e.g. a :func:`~qkv.decoding.sampler`); without it a
    decoder-only model is greedy and an encoder-decoder model uses beam search.
    """
    vocab = Vocabularies.of(tokenizers)
    source, target = vocab.source, vocab.target  # one tokenizer but for separate vocabularies
    window = model.config.max_len
    if isinstance(member(model), DecoderOnly):  # a decoder-only model or an ensemble of them
        max_new_tokens = min(max_new_tokens, window - 1)
        context = dialogue_context(turns, source, room=window - max_new_tokens + 1, separator=separator)
        marker = separator.strip() or separator  # " __eou__ " ends a turn at "__eou__"; "\n" at "\n"
        ids: list[int] = []
        text = ""
        for token in continuation(model, context, max_new_tokens=max_new_tokens, choose=choose or most_likely):
            ids.append(token)
            text = target.decode(ids)
            if marker in text:
                break
        cut = text.find(marker)
        return (text[:cut] if cut >= 0 else text).strip()
    # A tokenizer that ends sources with END (a converted Marian one) ends the dialogue with it
    # once, as the model saw every training source end.
    ends = source.add_special_tokens and source.eos_id is not None
    context = dialogue_context(turns, source, room=window - ends, separator=separator)
    if ends:
        context.append(source.eos_id)
    if choose is not None:
        return target.decode(list(continuation(model, context, max_new_tokens=max_new_tokens, choose=choose))).strip()
    best = beam_search(model, [context], beam_size=beam_size, max_new_tokens=max_new_tokens)
    return target.decode(best[0][0].tokens).strip()
