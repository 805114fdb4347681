"""A language model's continuation of a prompt as text, piece by piece as it is made.

What is here: :func:`continuation_text`, which ``qkv generate --prompt`` prints and the server
streams: the new tokens of :func:`~qkv.decoding.continuation` (sliding the window past
``max_len``, the window rule of ``docs/textbook.md``) decoded into the pieces of text they add;
:func:`decoded_after`, the text some new tokens add after a prompt (the first rule below).

Two rules make the pieces add up to the text a reader expects:
  * the continuation is decoded after the prompt and cut where the prompt's text ends:
    decoded alone, its first piece would lose its leading space (a SentencePiece "▁word" at
    the start of a text decodes as "word");
  * while the text ends in U+FFFD, a character whose bytes span several tokens (byte-level
    BPE) is incomplete, and nothing is given until its last byte arrives.

What is not here: the decoding loop (``decoding/``), printing or sending (the adapters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import Tensor

from qkv.decoding import DecodingModel, continuation
from qkv.tokenization import Tokenizer, Vocabularies

INCOMPLETE = "\ufffd"  # what a tokenizer decodes a character's first bytes to


def decoded_after(tokenizer: Tokenizer, prompt: list[int], ids: list[int], *, head: str | None = None) -> str:
    """The text the tokens ``ids`` add after ``prompt``: both decoded together, cut where the
    prompt's text (``head``, if already decoded) ends; ``ids`` alone where decoding them
    changed the prompt's text."""
    head = tokenizer.decode(prompt) if head is None else head
    text = tokenizer.decode([*prompt, *ids])
    return text[len(head) :] if text.startswith(head) else tokenizer.decode(ids)


def continuation_text(
    model: DecodingModel,
    tokenizers: Tokenizer | Vocabularies,
    prompt: list[int],
    *,
    max_new_tokens: int,
    choose: Callable[[Tensor], Tensor],
) -> Iterator[str]:
    """The pieces of text the continuation of ``prompt`` (token ids; empty: BEGIN) adds, in
    order, each as soon as it is whole; joined, they are the continuation's text. A prompt
    longer than the window keeps its newest ``max_len`` tokens, and the output slides on past
    the window (:func:`~qkv.decoding.continuation` with ``slide=True``)."""
    vocab = Vocabularies.of(tokenizers)
    target = vocab.target
    prompt = prompt or [vocab.source.bos_id]
    head = target.decode(prompt)

    def continued(ids: list[int]) -> str:
        return decoded_after(target, prompt, ids, head=head)

    ids: list[int] = []
    shown = ""
    for token in continuation(model, prompt, max_new_tokens=max_new_tokens, choose=choose, slide=True):
        ids.append(token)
        text = continued(ids)
        if text.endswith(INCOMPLETE):
            continue  # wait for the rest of the character
        if len(text) > len(shown):
            yield text[len(shown) :]
        shown = text
    rest = continued(ids)[len(shown) :]
    if rest:
        yield rest
