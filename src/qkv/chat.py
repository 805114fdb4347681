"""Multi-turn chat on any text-generating model: the dialogue kept within the model's window.

What is here, for a model of qkv's own (turns joined by a separator): :func:`dialogue_context`
(the most recent turns that fit) and :func:`reply` (the next turn: a decoder-only model
continues the dialogue until it writes the separator or END; an encoder-decoder model reads
the dialogue as its source and writes the reply as its target: with separate vocabularies, the
dialogue is encoded by the source tokenizer and the reply decoded by the target one).

For a checkpoint with a chat template (``conversation.py``): :func:`template_prompt` (the
messages rendered, the oldest dropped until they fit) and :func:`template_reply` (the reply's
text, piece by piece as it is made, ending at an end-of-turn token).

How each token is picked, beyond ``decoding``'s greedy and :func:`~qkv.decoding.sampler`:
:func:`repetition_penalty` and :func:`min_p_filter` (pure functions on logits), :func:`draw`
(sampling with min-p) and :func:`penalized` (a choose function that penalises the tokens
already in the text), as transformers' ``generate`` applies them.

The window rule: the newest turns are kept whole, oldest dropped first; a single turn
longer than the room left is cut from its start (its end is what the reply answers). A
decoder-only model keeps room for ``max_new_tokens`` of reply. With a template, the system
message is kept and the oldest turns are dropped a user turn at a time (a conversation still
starts with the user, as templates require); a last message that alone does not fit is refused.

What is not here: the prompt loop and terminal handling (``cli/chat.py``), decoding
(``decoding/``), the template's rendering (``conversation.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from qkv.conversation import Conversation
from qkv.decoding import DecodingModel, beam_search, continuation, filter_logits, member, most_likely
from qkv.errors import UserError
from qkv.models.decoder_only import DecoderOnly
from qkv.streaming import INCOMPLETE
from qkv.tokenization import Tokenizer, Vocabularies

Choose = Callable[[Tensor], Tensor]  # logits (B, V) -> tokens (B,)


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


# ----------------------------------------------------------------------------- picking tokens


def repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's repetition penalty (Keskar et al., 2019, section 4.1, as transformers applies it):
    the logit of every token already in the text divided by θ where positive, multiplied by θ
    where negative, so θ > 1 makes it less likely either way.

    Shapes: logits (N, V); seen (N, V) or (V,) bool. Returns (N, V).
    """
    punished = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, punished, logits)


def min_p_filter(logits: Tensor, min_p: float) -> Tensor:
    """Min-p sampling (Nguyen et al., 2024, "Turning Up the Heat", section 3): tokens less likely
    than ``min_p`` times the likeliest token's probability are removed (-inf); the likeliest
    always stays. The threshold moves with the model's confidence, unlike top-p's mass.

    Shapes: (N, V) -> (N, V).
    """
    probs = logits.float().softmax(-1)  # (N, V)
    keep = probs >= min_p * probs.max(-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


def draw(
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Choose:
    """A choose function that draws each token after temperature, top-k, top-p and min-p, in
    transformers' order (:func:`~qkv.decoding.filter_logits`, then :func:`min_p_filter`).
    Shapes: the function maps logits (B, V) to tokens (B,)."""

    def choose(logits: Tensor) -> Tensor:
        filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)  # (B, V)
        if min_p is not None:
            filtered = min_p_filter(filtered, min_p)
        return torch.multinomial(filtered.softmax(-1), 1, generator=generator)[:, 0]  # (B,)

    return choose


def penalized(choose: Choose, *, penalty: float, seen: Sequence[int], vocab_size: int) -> Choose:
    """``choose`` after :func:`repetition_penalty` of the tokens of the text so far: ``seen``
    (the prompt's), then every token this function picks. One text (B = 1), or rows that share
    ``seen``. Shapes: the function maps logits (B, V) to tokens (B,)."""
    state: dict[str, Tensor] = {}

    def pick(logits: Tensor) -> Tensor:
        mask = state.get("seen")
        if mask is None:
            mask = torch.zeros(logits.shape[0], vocab_size, dtype=torch.bool, device=logits.device)  # (B, V)
            mask[:, [t for t in seen if 0 <= t < vocab_size]] = True
        tokens = choose(repetition_penalty(logits.float(), mask, penalty))  # (B,)
        state["seen"] = mask.scatter(1, tokens.clamp(min=0)[:, None], True)
        return tokens

    return pick


# ----------------------------------------------------------------------------- chat templates


def template_prompt(
    conversation: Conversation, tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]], *, room: int
) -> tuple[list[int], int]:
    """The token ids of ``messages`` rendered by the template with the assistant's turn begun,
    and how many of the oldest messages were dropped so that they fit ``room`` tokens: the
    system messages at the start stay, the turns after them go a user turn at a time. Encoded
    without the tokenizer's own special tokens (the template writes BEGIN where it wants one),
    as transformers' ``apply_chat_template`` encodes."""
    system = 0
    while system < len(messages) and messages[system].get("role") == "system":
        system += 1
    head, turns = list(messages[:system]), list(messages[system:])
    dropped = 0
    while True:
        ids = tokenizer.encode(conversation.render(head + turns), add_special_tokens=False)
        if len(ids) <= room:
            return ids, dropped
        if len(turns) <= 1:
            raise UserError(
                f"the last message is {len(ids)} tokens with the chat template; the model's window leaves "
                f"room for {room} (shorten it, or give fewer new tokens)"
            )
        turns.pop(0)
        dropped += 1
        while len(turns) > 1 and turns[0].get("role") != "user":  # a conversation starts with the user
            turns.pop(0)
            dropped += 1


def template_reply(
    model: DecodingModel,
    tokenizer: Tokenizer,
    conversation: Conversation,
    messages: Sequence[Mapping[str, str]],
    *,
    max_new_tokens: int,
    choose: Choose | None = None,
    repetition: float = 1.0,
) -> tuple[int, Iterator[str]]:
    """The assistant's next message after ``messages`` (the conversation so far, oldest
    first, each {"role", "content"}): how many of the oldest messages were dropped to fit the
    window (:func:`template_prompt`), and the pieces of the reply's text as they are made, each
    as soon as its characters are whole. The reply ends at one of the conversation's
    end-of-turn tokens (not part of it), at ``max_new_tokens`` or where the window is full.
    ``choose`` picks each token (None: the most likely), after a repetition penalty θ =
    ``repetition`` of every token of the prompt and the reply (1: none)."""
    window = model.config.max_len
    max_new_tokens = min(max_new_tokens, window - 1)
    prompt, dropped = template_prompt(conversation, tokenizer, messages, room=window - max_new_tokens + 1)
    pick = choose or most_likely
    if repetition != 1.0:
        pick = penalized(pick, penalty=repetition, seen=prompt, vocab_size=model.config.vocab_size)
    return dropped, _pieces(
        continuation(model, prompt, max_new_tokens=max_new_tokens, choose=pick), tokenizer, conversation.stops
    )


def _pieces(tokens: Iterator[int], tokenizer: Tokenizer, stops: Sequence[int]) -> Iterator[str]:
    """The text the tokens add, piece by piece, until a stop token: each piece once the
    characters it ends with are whole (a byte-level BPE splits one character across tokens)."""
    ids: list[int] = []
    shown = ""
    for token in tokens:
        if token in stops:
            break
        ids.append(token)
        text = tokenizer.decode(ids)
        if text.endswith(INCOMPLETE) or not text.startswith(shown):
            continue
        if len(text) > len(shown):
            yield text[len(shown) :]
            shown = text
    rest = tokenizer.decode(ids)
    if rest.startswith(shown) and len(rest) > len(shown):
        yield rest[len(shown) :]
