"""The work each endpoint asks of a model, as the model thread runs it.

What is here: one function per job, each over a list of inputs (the batcher joins the inputs of
requests that arrive together) returning one result per input, each through the job function of
``qkv.bundle`` that the command line calls: :func:`translate` (``bundle.translations``, as ``qkv
translate``), :func:`embed` (``bundle.embeddings``, as ``qkv embed``), :func:`classify`
(``tasks.bert.predict_labels``: a classifier has no job of the bundle's yet); and the generations
that continuous batching cannot decode, each request alone (``routes/generate.py``, ``routes/chat.py``
say which): :func:`generate_batch` (``bundle.generations``: a beam or constraints),
:func:`continuation_pieces` and :func:`continue_alone` (``bundle.continued``, as ``qkv generate
--prompt`` streams it, sliding past the window), :func:`chat` (``bundle.reply``, as ``qkv chat``:
an encoder-decoder's reply); and the sampling options of a request as the library's
:class:`~qkv.bundle.Sampling`.

What is not here: the attention view (``attention.py``), HTTP (``routes/``), batching
(``batching.py``), continuous batching (``continuous.py``: every other generation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import Tensor

from qkv.bundle import Sampling, continued, embeddings, generations, reply, translations
from qkv.decoding import most_likely
from qkv.serve.models import Served
from qkv.streaming import decoded_after
from qkv.tasks.bert import predict_labels


def sampling_of(options: dict, *, seed: int | None = None) -> Sampling | None:
    """The draws a request asks for (``options``: temperature, top_k, top_p and whether it
    samples at all), None for the most likely token each step."""
    if not options["sampling"]:
        return None
    return Sampling(
        temperature=options["temperature"] or 1.0, top_k=options["top_k"], top_p=options["top_p"], seed=seed
    )


def translate(
    served: Served,
    texts: list[str],
    *,
    beam_size,
    nbest,
    length_penalty,
    max_len_a,
    max_len_b,
    prefix=None,
    ban=(),
    require=(),
    terms=(),
):
    """Per text, its ``nbest`` (text, score, tokens written) outputs; ``prefix``, ``ban``,
    ``require``, ``terms``: constraints (``bundle.constraints``)."""
    found = translations(
        served.bundle,
        texts,
        beam_size=beam_size,
        nbest=nbest,
        length_penalty=length_penalty,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        prefix=prefix,
        ban=ban,
        require=require,
        terms=terms,
    )
    return [[(h.text, h.score, len(h.tokens)) for h in hyps] for hyps in found]


def fits_without_sliding(served: Served, prompt: list[int], max_new_tokens: int) -> bool:
    """Whether a prompt and its continuation fit the window: then continuous batching decodes
    it as the streamed continuation would (no slide), sharing forward passes."""
    return max(1, len(prompt)) + max_new_tokens - 1 <= served.window


def generate_batch(
    served: Served,
    prompts: list[str],
    *,
    max_new_tokens: int,
    options: dict,
    beam_size: int = 1,
    seed: int | None = None,
    prefix: str | None = None,
    ban: tuple[str, ...] = (),
    require: tuple[str, ...] = (),
):
    """Continuations of prompts (none blank; each cut to the window), decoded as one batch
    (greedy, beam search of ``beam_size``, or one generator: unseeded, or ``seed``; the server
    gives it one prompt at a time): per prompt, (text, tokens made). Each text is what the tokens
    add after the prompt (``streaming.decoded_after``), as the stream gives it; ``prefix``,
    ``ban``, ``require``: constraints (``bundle.constraints``; the prefix's tokens count as made)."""
    found = generations(
        served.bundle,
        prompts,
        max_new_tokens=max_new_tokens,
        beam_size=beam_size,
        sampling=sampling_of(options, seed=seed),
        prefix=prefix,
        ban=ban,
        require=require,
    )
    encoded = served.vocab.source.encode_batch(prompts)
    target = served.vocab.target
    return [
        (decoded_after(target, ids, out.tokens), len(out.tokens)) for ids, (out,) in zip(encoded, found, strict=True)
    ]


def continuation_pieces(
    served: Served, prompt: str, max_new_tokens: int, *, seed: int | None, options: dict
) -> tuple[Iterator[str], list[int]]:
    """The pieces of text of one prompt's continuation, as ``qkv generate --prompt`` prints
    them (sliding past the window), and a one-item list that counts the tokens made so far."""
    sampling = sampling_of(options, seed=seed)
    choose = most_likely if sampling is None else sampling.chooser(served.bundle.device)
    made = [0]
    eos = served.model.config.eos_id

    def counted(logits: Tensor) -> Tensor:
        chosen = choose(logits)  # (1,)
        made[0] += int((chosen != eos).sum())  # END is chosen, never written
        return chosen

    pieces = continued(served.bundle, prompt, max_new_tokens=max_new_tokens, choose=counted)
    return pieces, made


def continue_alone(served: Served, prompt: str, max_new_tokens: int, *, seed: int | None, options: dict):
    """One prompt's continuation, whole: (text, tokens made)."""
    pieces, made = continuation_pieces(served, prompt, max_new_tokens, seed=seed, options=options)
    return "".join(pieces), made[0]


def chat(served: Served, dialogues: list[list[str]], *, separator, max_new_tokens, beam_size, seed, options):
    """Per dialogue, the model's next turn."""
    sampling = sampling_of(options, seed=seed)
    choose: Callable[[Tensor], Tensor] | None = None if sampling is None else sampling.chooser(served.bundle.device)
    return [
        reply(
            served.bundle,
            turns,
            separator=separator,
            max_new_tokens=max_new_tokens,
            beam_size=beam_size,
            choose=choose,
        )
        for turns in dialogues
    ]


def embed(served: Served, texts: list[str], *, pooling, normalize):
    """Per text, its vector (a list of floats) and the settings' sentence (``qkv embed``'s choice)."""
    found = embeddings(served.bundle, texts, pooling=pooling, normalize=normalize)
    return [(row, found.settings.said) for row in found.vectors.float().tolist()]


def classify(served: Served, texts: list[str]):
    """Per text, its predicted label."""
    return predict_labels(served.model, served.vocab.source, texts, labels=served.labels)
