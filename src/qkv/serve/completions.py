"""The work of the routes decoded by continuous batching (OpenAI's in ``routes/openai.py``, and
``/v1/generate`` and ``/v1/chat``): prompts in, texts out.

What is here:
  * :class:`Ask`, one completion to make (its prompt's token ids, its cap, how its text ends
    and is read), and the prompts of the two routes: :func:`chat_ask` (the messages through the
    model's chat template, the oldest dropped to fit the window, as ``qkv chat`` fits them; a
    model without a template reads its turns joined by qkv's separator, as ``/v1/chat`` does)
    and :func:`text_ask` (a prompt as ``/v1/generate`` reads it, within the window);
  * :class:`Reader`, one row's tokens as text: whole characters only (byte-level BPE splits
    them across tokens), ended by an end-of-turn token or a stop string (cut before it), and
    the tail that may yet begin a stop string held back, so that streamed pieces never hold
    what the whole text cuts;
  * :class:`Picking`, how a request picks its tokens (greedy or drawn, and a repetition penalty
    of each row's own text), each request with its own picker (and generator).

The decoding itself is the scheduler's (``serve/continuous.py``): continuous batching, a
request joining a running batch at its next step. Streamed and whole answers go through the
same :class:`Reader`: the pieces of a stream joined are the whole answer's text for the same
request (greedy, or the same seed).

What is not here: HTTP, the OpenAI shapes and the limits (``routes/openai.py``,
``openai_schemas.py``), the template's rendering (``qkv.conversation``), the scheduling and the
step loop (``serve/continuous.py``, ``qkv.decoding.continuous``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.bundle import Sampling
from qkv.chat import dialogue_context, repetition_penalty, template_prompt
from qkv.decoding import DONE, most_likely
from qkv.serve.errors import ApiError
from qkv.serve.models import Served
from qkv.streaming import INCOMPLETE
from qkv.tokenization import Tokenizer

SEPARATOR = " __eou__ "  # what ends a turn for a model without a chat template (qkv chat's, /v1/chat's default)
Choose = Callable[[Tensor], Tensor]  # logits (B, V) -> tokens (B,)


@dataclass(frozen=True)
class Ask:
    """One completion to make.

    Attributes:
        prompt: the token ids the model reads (never empty: an empty prompt is BEGIN).
        max_new_tokens: the most tokens it writes (fewer where the window is full).
        stops: texts that end it, cut before (OpenAI's ``stop``; a separator's marker).
        stop_ids: tokens that end it beside the model's END (a template's end of turn).
        after_prompt: its text is what its tokens add after the prompt's text (a completion:
            a SentencePiece word keeps its leading space); else its tokens decoded alone and
            stripped of the spaces around them (a chat reply, as ``qkv chat`` gives it).
    """

    prompt: tuple[int, ...]
    max_new_tokens: int
    stops: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    after_prompt: bool = True


@dataclass(frozen=True)
class Answer:
    """One completion made: its text, how many tokens it wrote, and why it ended ("stop": END,
    an end-of-turn token or a stop string; "length": its cap or the window)."""

    text: str
    tokens: int
    finish_reason: str


@dataclass(frozen=True)
class Picking:
    """How a request picks its tokens: drawn with
    ``sampling`` (None: the most likely), after CTRL's repetition penalty θ = ``penalty`` of
    each row's own text, its prompt and what it has written (1: none; ``qkv chat``'s
    ``--repetition-penalty``)."""

    sampling: Sampling | None = None
    penalty: float = 1.0

    def picker(self, device: torch.device, prompts: Sequence[Sequence[int]], vocab_size: int) -> Choose:
        """A token picker for the rows of ``prompts``, one generator for all its draws.
        Shapes: (B, V) -> (B,)."""
        choose = most_likely if self.sampling is None else self.sampling.chooser(device)
        if self.penalty == 1.0:
            return choose
        seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)  # (B, V)
        for i, prompt in enumerate(prompts):
            seen[i, [t for t in prompt if 0 <= t < vocab_size]] = True

        def pick(logits: Tensor) -> Tensor:
            nonlocal seen
            tokens = choose(repetition_penalty(logits.float(), seen, self.penalty))  # (B,)
            seen = seen.scatter(1, tokens.clamp(min=0)[:, None], True)  # (B, V)
            return tokens

        return pick


def chat_ask(
    served: Served,
    messages: Sequence[Mapping[str, str]],
    *,
    max_new_tokens: int,
    stops: tuple[str, ...],
    separator: str = SEPARATOR,
):
    """The :class:`Ask` of a chat (``messages``: role and content each, oldest first): the
    newest messages that leave ``max_new_tokens`` of the window for the reply. A model
    without a chat template reads the turns' texts joined by ``separator`` and stops where it
    writes the separator's text (``chat.reply``'s marker); it takes no system message."""
    window, tokenizer = served.window, served.vocab.source
    if max_new_tokens >= window:
        raise ApiError(
            422,
            "too_many",
            f"max_tokens {max_new_tokens} leaves no room for the conversation in model {served.name}'s "
            f"window of {window} tokens",
        )
    room = window - max_new_tokens + 1  # the last new token is never read back (DecoderOnlyDecoder.caps)
    conversation = served.bundle.conversation
    if conversation is not None:
        prompt, _ = template_prompt(conversation, tokenizer, messages, room=room)
        return Ask(tuple(prompt), max_new_tokens, stops, tuple(conversation.stops), after_prompt=False)
    if any(m["role"] == "system" for m in messages):
        raise ApiError(422, "invalid_request", f"model {served.name} has no chat template: a system message needs one")
    turns = [m["content"] for m in messages]
    prompt = dialogue_context(turns, tokenizer, room=room, separator=separator)
    marker = separator.strip() or separator
    return Ask(tuple(prompt), max_new_tokens, (*stops, marker), (), after_prompt=False)


def text_ask(served: Served, prompt: str, *, max_new_tokens: int | None, default: int, stops: tuple[str, ...]):
    """The :class:`Ask` of a completion of ``prompt``: read as ``/v1/generate`` reads it (an
    empty one: BEGIN); with ``max_new_tokens`` it must fit the window with them, without
    (``None``) it writes at most ``default`` tokens, fewer where the window is full."""
    ids = served.vocab.source.encode(prompt) or [served.vocab.source.bos_id]
    window = served.window
    if max_new_tokens is None:
        if len(ids) > window:
            raise ApiError(
                422, "too_long", f"the prompt has {len(ids)} tokens; model {served.name} reads at most {window}"
            )
        max_new_tokens = max(1, min(default, window - len(ids) + 1))
    elif len(ids) + max_new_tokens - 1 > window:
        raise ApiError(
            422,
            "too_long",
            f"model {served.name} reads at most {window} tokens; the prompt ({len(ids)}) and max_tokens "
            f"({max_new_tokens}) ask for {len(ids) + max_new_tokens - 1}",
        )
    return Ask(tuple(ids), max_new_tokens, stops)


class Reader:
    """One row's tokens as text, piece by piece (see the module): :meth:`feed` each token the
    search writes; :meth:`end` once it writes no more; ``text``, ``tokens`` and
    ``finish_reason`` (None while it goes on) after."""

    def __init__(self, tokenizer: Tokenizer, ask: Ask, eos_id: int | None) -> None:
        self.tokenizer, self.ask = tokenizer, ask
        self.ends = {*ask.stop_ids, *(() if eos_id is None else (eos_id,))}
        self.head = list(ask.prompt) if ask.after_prompt else []
        self.head_text = tokenizer.decode(self.head) if self.head else ""
        self.ids: list[int] = []
        self.given = ""  # the text given so far (a prefix of every later text)
        self.text = ""
        self.finish_reason: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def decoded(self) -> str:
        """The text of the tokens so far (after the prompt's, or alone and stripped at its start)."""
        if not self.head:
            return self.tokenizer.decode(self.ids).lstrip()
        text = self.tokenizer.decode([*self.head, *self.ids])
        return text[len(self.head_text) :] if text.startswith(self.head_text) else self.tokenizer.decode(self.ids)

    def feed(self, token: int) -> str:
        """The piece of text ``token`` adds that is sure to stay ('' while it may not)."""
        if self.finish_reason is not None or token == DONE:
            return ""
        if token in self.ends:
            return self.end("stop")
        self.ids.append(token)
        text = self.decoded()
        cut = min((i for i in (text.find(s) for s in self.ask.stops) if i >= 0), default=-1)
        if cut >= 0:
            return self.end("stop", text[:cut])
        return self.give(text[: len(text) - held(text, self.ask.stops, strip=not self.ask.after_prompt)])

    def end(self, reason: str, text: str | None = None) -> str:
        """End the text ("stop" or "length"); the rest of it not yet given."""
        if self.finish_reason is not None:
            return ""
        text = self.decoded() if text is None else text
        self.text, self.finish_reason = text if self.ask.after_prompt else text.rstrip(), reason
        return self.give(self.text)

    def give(self, text: str) -> str:
        if not text.startswith(self.given) or len(text) <= len(self.given):
            return ""  # decoding a further token changed the text given: wait for it to settle
        piece, self.given = text[len(self.given) :], text
        return piece


def held(text: str, stops: Sequence[str], *, strip: bool) -> int:
    """How many characters at the end of ``text`` a stream holds back: an incomplete
    character, the longest tail that begins a stop string, and (``strip``) trailing spaces
    that a reply's end strips."""
    n = len(text) - len(text.rstrip(INCOMPLETE))
    rest = text[: len(text) - n]
    tail = max((k for s in stops for k in range(min(len(s) - 1, len(rest)), 0, -1) if rest.endswith(s[:k])), default=0)
    rest = rest[: len(rest) - tail]
    spaces = len(rest) - len(rest.rstrip()) if strip else 0
    return n + tail + spaces
