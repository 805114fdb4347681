"""The generating and chatting jobs: :func:`generations` (each input's outputs, as
:class:`Generated`: greedy, beam search or drawn, with constraints) with :func:`window_cut` and
:func:`window_fit` (:class:`WindowFit`: the rule by which inputs fit the model's window),
:func:`continued` (a language model's continuation piece by piece, past the window), and the
chat: :func:`reply` (the next turn), :func:`chat_reply` (through an imported model's chat
template, streamed) with :func:`as_messages` (a dialogue as the template's messages).

What is not here: the searches (``qkv.decoding``), the streamed text (``qkv.streaming``), chat
turns and templates (``qkv.chat``, ``qkv.conversation``), the sampling's settings
(``defaults.py``'s :class:`~qkv.bundle.defaults.Sampling`), the constraints (``constraints.py``),
translation (``translation.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from qkv.bundle.constraints import Constraints, constraints
from qkv.bundle.defaults import Sampling
from qkv.chat import reply as next_turn
from qkv.chat import template_reply
from qkv.decoding import beam_search, constrained_beam_search, generate, greedy, most_likely
from qkv.errors import OptionError, UserError
from qkv.loading import KIND_NAMES
from qkv.seq2seq import cut_source
from qkv.streaming import continuation_text

if TYPE_CHECKING:
    from qkv.bundle.core import Bundle


@dataclass(frozen=True)
class Generated:
    """One output of :func:`generations`: its text, its tokens, and its beam score (None: not
    from a beam search, or an empty input's)."""

    text: str
    tokens: list[int]
    score: float | None


@dataclass(frozen=True)
class WindowFit:
    """How :func:`generations` fits inputs to the model's window (``docs/textbook.md``, "The
    window"): ``cut``, the inputs longer than it (0-based); ``kept``, what each of them keeps,
    in words; ``room``, the most new tokens an output can have (the longest input's)."""

    cut: list[int]
    kept: str
    room: int


def window_cut(bundle: Bundle, ids: list[int]) -> list[int]:
    """An input's tokens within the window: a source keeps its first ``max_len`` (what a
    translation starts from; a final END stays, ``seq2seq.cut_source``), a prompt its newest
    ``max_len // 2`` (what a continuation follows, with room left to write)."""
    window = bundle.window
    if len(ids) <= window:
        return ids
    if bundle.kind == "decoder_only":
        return ids[-(window // 2) :]
    return cut_source(bundle.vocab.source, ids, window=window)


def window_fit(bundle: Bundle, texts: Sequence[str]) -> WindowFit:
    """What :func:`window_cut` does to ``texts``, and the room it leaves for outputs: an
    encoder-decoder writes up to its window whatever the source; a language model's output
    shares the window with its prompt."""
    window = bundle.window
    encoded = bundle.vocab.source.encode_batch(list(texts))
    cut = [i for i, ids in enumerate(encoded) if len(ids) > window]
    if bundle.kind != "decoder_only":
        return WindowFit(cut, f"their first {window}", window)
    longest = max((len(window_cut(bundle, ids)) for ids in encoded), default=0)
    return WindowFit(cut, f"their newest {window // 2}", window - max(1, longest) + 1)


def generations(
    bundle: Bundle,
    texts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    beam_size: int = 1,
    nbest: int = 1,
    sampling: Sampling | None = None,
    batch_size: int = 64,
    prefix: str | None = None,
    ban: Sequence[str] = (),
    require: Sequence[str] = (),
) -> list[list[Generated]]:
    """Each input's outputs, in order: an encoder-decoder's for the text as its source, a
    language model's continuation of it as a prompt; greedy, the ``nbest`` best of a beam
    search of ``beam_size``, or drawn (``sampling``, one generator for the whole call: the same
    seed and ``batch_size`` give the same outputs). An input is cut to the window
    (:func:`window_cut`) and an output stops where the window is full; an empty input gives
    ``nbest`` empty outputs in its place. ``prefix``, ``ban``, ``require``: constraints
    (:func:`constraints`; a language model reads the prefix after the prompt, and an output's
    tokens and text start with it)."""
    bundle.require("generate")
    if nbest > beam_size:
        raise OptionError(f"nbest {nbest} needs beam_size of at least {nbest}", "nbest", "beam_size")
    if sampling is not None and beam_size > 1:
        raise OptionError("sampling draws one output per input: no beam_size above 1", "sampling", "beam_size")
    steer = constraints(
        bundle, texts, prefix=prefix, ban=ban, require=require, beam_size=beam_size, sampling=sampling is not None
    )
    chosen = None if sampling is None else sampling.chooser(bundle.device)
    read_after = steer.shown if bundle.kind == "decoder_only" else []  # a prompt goes on with the prefix
    found: list[list[Generated]] = []
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start : start + batch_size])
        todo = [i for i, text in enumerate(chunk) if text.strip()]
        encoded = bundle.vocab.source.encode_batch([chunk[i] for i in todo])
        inputs = [window_cut(bundle, [*ids, *read_after]) for ids in encoded]
        required = None if steer.required is None else [steer.required[start + i] for i in todo]
        outputs = _decoded(
            bundle,
            inputs,
            max_new_tokens=max_new_tokens,
            beam_size=beam_size,
            nbest=nbest,
            choose=chosen,
            steer=Constraints(steer.shown, steer.scorers, required),
        )
        results = dict(zip(todo, outputs, strict=True)) if inputs else {}
        found += [results.get(i, [Generated("", [], None)] * nbest) for i in range(len(chunk))]
    return found


def _decoded(
    bundle: Bundle,
    inputs: list[list[int]],
    *,
    max_new_tokens: int,
    beam_size: int,
    nbest: int,
    choose,
    steer: Constraints,
) -> list[list[Generated]]:
    """The outputs of token inputs: drawn by ``choose``, else constrained beam search with
    required terms, else beam search above beam 1, else greedy; each output's tokens and text
    start with the prefix's."""
    if not inputs:
        return []
    model, scorers = bundle.model, steer.scorers
    forced = None if bundle.kind == "decoder_only" else steer.forced(bundle)

    def output(tokens: list[int], score: float | None) -> Generated:
        written = [*steer.shown, *tokens]
        return Generated(bundle.vocab.target.decode(written), written, score)

    if choose is not None:
        drawn = generate(model, inputs, max_new_tokens=max_new_tokens, choose=choose, prefix=forced, scorers=scorers)
        return [[output(ids, None)] for ids in drawn]
    if steer.required is not None:
        hyps = constrained_beam_search(
            model,
            inputs,
            required=steer.required,
            beam_size=beam_size,
            max_new_tokens=max_new_tokens,
            nbest=nbest,
            prefix=forced,
            scorers=scorers,
        )
        return [[output(h.tokens, h.score) for h in hs] for hs in hyps]
    if beam_size > 1:
        hyps = beam_search(
            model,
            inputs,
            beam_size=beam_size,
            max_new_tokens=max_new_tokens,
            nbest=nbest,
            prefix=forced,
            scorers=scorers,
        )
        return [[output(h.tokens, h.score) for h in hs] for hs in hyps]
    return [
        [output(ids, None)]
        for ids in greedy(model, inputs, max_new_tokens=max_new_tokens, prefix=forced, scorers=scorers)
    ]


def continued(
    bundle: Bundle,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    sampling: Sampling | None = None,
    choose: Callable[[Tensor], Tensor] | None = None,
) -> Iterator[str]:
    """The pieces of text a language model's continuation of ``prompt`` adds, each as soon as
    it is whole (``streaming.continuation_text``): greedy, or drawn with ``sampling``, or picked
    by ``choose`` (a :meth:`Sampling.chooser` or ``decoding.most_likely`` the caller wraps: the
    server counts the tokens made through it). A prompt longer than the window keeps its newest
    ``max_len`` tokens, and the output slides on past the window."""
    bundle.require("generate")
    if bundle.kind != "decoder_only":
        raise UserError(
            f"{bundle.path} holds {KIND_NAMES[bundle.kind]}: it writes outputs of sources, not continuations"
        )
    if sampling is not None and choose is not None:
        raise OptionError("sampling and choose both pick the tokens: give one", "sampling", "choose")
    chosen = choose or (most_likely if sampling is None else sampling.chooser(bundle.device))
    ids = bundle.vocab.source.encode_batch([prompt])[0]
    return continuation_text(bundle.model, bundle.vocab, ids, max_new_tokens=max_new_tokens, choose=chosen)


# ----------------------------------------------------------------------------- chat


def reply(
    bundle: Bundle,
    turns: Sequence[str],
    *,
    separator: str = " __eou__ ",
    max_new_tokens: int = 60,
    beam_size: int = 4,
    choose: Callable[[Tensor], Tensor] | None = None,
    system: str | None = None,
    repetition_penalty: float = 1.0,
) -> str:
    """The model's next turn after ``turns`` (the dialogue so far, oldest first: the user's
    turns, then the model's, alternating). A model with a chat template (``bundle.conversation``)
    reads them as the template renders them, after ``system`` (:func:`chat_reply`); one without
    reads them joined by ``separator`` (``chat.reply``: the newest turns that fit the window).
    ``choose`` picks each token (a :meth:`Sampling.chooser`, kept across the turns of one chat);
    without it a language model is greedy and an encoder-decoder searches a beam of
    ``beam_size``; ``repetition_penalty`` θ (a language model's): CTRL's penalty of the tokens
    already in the text (1: none)."""
    bundle.require("chat")
    if bundle.conversation is not None:
        messages = as_messages(turns, system=system)
        _, pieces = chat_reply(
            bundle, messages, max_new_tokens=max_new_tokens, choose=choose, repetition_penalty=repetition_penalty
        )
        return "".join(pieces).strip()
    if system is not None:
        raise OptionError(f"{bundle.path} has no chat template: a system prompt needs one", "system")
    if repetition_penalty != 1.0:
        raise OptionError(f"{bundle.path} has no chat template: the repetition penalty needs one", "repetition_penalty")
    return next_turn(
        bundle.model,
        bundle.vocab,
        list(turns),
        separator=separator,
        max_new_tokens=max_new_tokens,
        beam_size=beam_size,
        choose=choose,
    )


def as_messages(turns: Sequence[str], *, system: str | None = None) -> list[dict[str, str]]:
    """A dialogue (the user's turn, the model's, ...) as a chat template's messages, after the
    system prompt where there is one."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def chat_reply(
    bundle: Bundle,
    messages: Sequence[dict[str, str]],
    *,
    max_new_tokens: int = 256,
    choose: Callable[[Tensor], Tensor] | None = None,
    repetition_penalty: float = 1.0,
) -> tuple[int, Iterator[str]]:
    """The assistant's next message after ``messages`` ({"role", "content"} each, oldest
    first) through the model's chat template (``chat.template_reply``): how many of the oldest
    messages were dropped to fit the window, and the reply's text piece by piece as it is made,
    ending at an end-of-turn token."""
    bundle.require("chat")
    if bundle.conversation is None:
        raise UserError(f"{bundle.path} has no chat template (chat_template.jinja or tokenizer_config.json)")
    if not repetition_penalty > 0:
        raise OptionError(f"repetition_penalty {repetition_penalty}: give a positive number", "repetition_penalty")
    return template_reply(
        bundle.model,
        bundle.vocab.target,
        bundle.conversation,
        messages,
        max_new_tokens=max_new_tokens,
        choose=choose,
        repetition=repetition_penalty,
    )
