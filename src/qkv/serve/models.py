"""The served models, and the work each endpoint asks of them.

What is here: :class:`Served` (a model loaded for serving: its name, kind, tokenizers, window
and which endpoints it answers), :func:`load_served` (the model directories of ``qkv serve``;
a mistake is a :class:`~qkv.errors.UserError` before the server starts), and the functions the
model thread runs: each takes a list of inputs (the batcher joins requests' inputs) and returns
one result per input, through the library functions the command line uses.

What is not here: HTTP (``app.py``), batching (``batching.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qkv.errors import UserError
from qkv.models.decoder_only import DecoderOnly
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.models.encoder_only import EncoderOnly
from qkv.tokenization import Tokenizer, Vocabularies

ENDPOINTS = {
    "encoder_decoder": ("translate", "chat", "attention"),
    "decoder_only": ("generate", "chat", "attention"),
    "encoder_only": ("embed", "classify", "attention"),
}


@dataclass
class Served:
    """A model loaded for serving. ``model`` is prepared for decoding (``for_decoding``, and
    bf16 or int8 when asked) for the generating kinds; ``labels`` are a classifier's class
    names (None for other models)."""

    name: str
    path: str
    kind: str
    model: EncoderDecoder | DecoderOnly | EncoderOnly
    vocab: Vocabularies
    meta: dict
    labels: list[str] | None = None

    @property
    def window(self) -> int:
        return self.model.config.max_len

    @property
    def endpoints(self) -> tuple[str, ...]:
        found = ENDPOINTS[self.kind]
        if self.kind == "encoder_only" and not self.labels:
            return tuple(e for e in found if e != "classify")
        return found

    def layers(self) -> dict[str, int]:
        c = self.model.config
        if isinstance(self.model, EncoderDecoder):
            return {"encoder": c.n_encoder_layers, "decoder": c.n_decoder_layers}
        if isinstance(self.model, DecoderOnly):
            return {"decoder": c.n_layers}
        return {"encoder": c.n_layers}

    def token_strings(self, tokenizer: Tokenizer, ids: list[int]) -> list[str]:
        return [tokenizer.id_to_token(i) for i in ids]


def load_served(paths: list[str], *, bf16: bool = False, int8: bool = False) -> dict[str, Served]:
    """The models of ``paths`` (model or training-run directories), named by their directory
    (a run: the run's directory), the second of one name with ``-2`` and so on."""
    from qkv.checkpoint import load_model, model_dir, read_meta
    from qkv.loading import check_options, load_for_generation, matching_tokenizer

    served: dict[str, Served] = {}
    for path in paths:
        directory = model_dir(path)
        if not directory.is_dir():
            raise UserError(f"--model {path}: no such directory")
        meta = read_meta(directory)
        if meta["kind"] not in ENDPOINTS:
            raise UserError(f"--model {path}: the server does not serve {meta['kind']} models yet")
        check_options(directory, meta["kind"], bf16=bf16, int8=int8)  # int8 for an encoder: refused, not ignored
        name = Path(path).resolve().name or "model"
        base, n = name, 1
        while name in served:
            n += 1
            name = f"{base}-{n}"
        if meta["kind"] == "encoder_only":
            model, meta = load_model(directory, kind="encoder_only")
            if bf16:
                model = model.to(torch.bfloat16)
            tokenizer = matching_tokenizer(str(directory), model, files=meta.get("files", {}), use="serve")
            labels = meta.get("labels") if model.config.n_classes else None
            served[name] = Served(name, str(path), "encoder_only", model, Vocabularies.of(tokenizer), meta, labels)
        else:
            model, vocab = load_for_generation(str(directory), bf16=bf16, int8=int8)
            served[name] = Served(name, str(path), meta["kind"], model, vocab, meta)
    return served


# ----------------------------------------------------------------------------- the work


def translate(served: Served, texts: list[str], *, beam_size, nbest, length_penalty, max_len_a, max_len_b):
    """Per text, its ``nbest`` (text, score) outputs (``seq2seq.translate``, as ``qkv translate``)."""
    from qkv.seq2seq import translate as translate_texts

    found = translate_texts(
        served.model,
        served.vocab,
        texts,
        beam_size=beam_size,
        nbest=nbest,
        length_penalty=length_penalty,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
    )
    return [[(h.text, h.score, len(h.tokens)) for h in hyps] for hyps in found]


class TooLong(ValueError):
    """An input (or the output to read) does not fit the model's window."""


def chooser(*, seed: int | None, options: dict):
    """The ``choose`` of a decoding loop: the most likely token, or a draw from the filtered
    distribution (``options``: temperature, top_k, top_p, sampling), seeded when asked."""
    from qkv.decoding import most_likely, sampler

    if not options["sampling"]:
        return most_likely
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return sampler(
        temperature=options["temperature"] or 1.0, top_k=options["top_k"], top_p=options["top_p"], generator=generator
    )


def fits_without_sliding(served: Served, prompt: list[int], max_new_tokens: int) -> bool:
    """Whether a prompt and its continuation fit the window: then a batch decodes it as the
    streamed continuation would (no slide), and it may share a forward pass."""
    return max(1, len(prompt)) + max_new_tokens - 1 <= served.window


def generate_batch(served: Served, prompts: list[list[int]], *, max_new_tokens: int, options: dict):
    """Continuations of prompts that fit the window (:func:`fits_without_sliding`), decoded as
    one batch (greedy, or one unseeded sampler): per prompt, (text, tokens made)."""
    from qkv.decoding import generate
    from qkv.streaming import decoded_after

    rows = [p or [served.vocab.source.bos_id] for p in prompts]
    choose = chooser(seed=None, options=options)
    made = generate(served.model, rows, max_new_tokens=max_new_tokens, choose=choose)
    return [(decoded_after(served.vocab.target, row, ids), len(ids)) for row, ids in zip(rows, made, strict=True)]


def continuation_pieces(served: Served, prompt: list[int], max_new_tokens: int, *, seed: int | None, options: dict):
    """The pieces of text of one prompt's continuation, as ``qkv generate --prompt`` prints
    them (``streaming.continuation_text``: sliding past the window), and a one-item list that
    counts the tokens made so far."""
    from qkv.streaming import continuation_text

    choose = chooser(seed=seed, options=options)
    made = [0]
    eos = served.model.config.eos_id

    def counted(logits):
        chosen = choose(logits)  # (1,)
        made[0] += int((chosen != eos).sum())  # END is chosen, never written
        return chosen

    pieces = continuation_text(served.model, served.vocab, prompt, max_new_tokens=max_new_tokens, choose=counted)
    return pieces, made


def continue_alone(served: Served, prompt: list[int], max_new_tokens: int, *, seed: int | None, options: dict):
    """One prompt's continuation, whole: (text, tokens made)."""
    pieces, made = continuation_pieces(served, prompt, max_new_tokens, seed=seed, options=options)
    return "".join(pieces), made[0]


def chat(served: Served, dialogues: list[list[str]], *, separator, max_new_tokens, beam_size, seed, options):
    """Per dialogue, the model's next turn (``chat.reply``, as ``qkv chat``)."""
    from qkv.chat import reply

    choose = chooser(seed=seed, options=options) if options["sampling"] else None
    return [
        reply(
            served.model,
            served.vocab,
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
    from qkv.checkpoint import model_dir
    from qkv.embedding import EmbeddingSettings, choose, sentence_embeddings

    positions = served.window
    recorded = EmbeddingSettings.read(served.meta, model_dir(served.path) / "config.json", model_max_len=positions)
    chosen = choose(recorded, model_max_len=positions, pooling=pooling, normalize=normalize)
    vectors, _ = sentence_embeddings(
        served.model,
        served.vocab.source,
        texts,
        pooling=chosen.pooling,
        normalize=chosen.normalize,
        max_len=chosen.max_len,
    )
    return [(row, chosen.said) for row in vectors.float().tolist()]


def classify(served: Served, texts: list[str]):
    """Per text, its predicted label (``tasks.bert.predict_labels``)."""
    from qkv.tasks.bert import predict_labels

    return predict_labels(served.model, served.vocab.source, texts, labels=served.labels)


# ----------------------------------------------------------------------------- attention


def _rounded(maps) -> list | None:
    """One (H, T, S) tensor per layer as nested lists, 4 decimals (the page draws 256 shades)."""
    if maps is None:
        return None
    return [((w * 10_000).round() / 10_000).tolist() for w in maps]


def attention_view(
    served: Served, texts: list[str], *, output, beam_size, length_penalty, max_new_tokens, trace
) -> list[dict]:
    """For the one text of ``texts``: the tokens, every attention map (``inspection.attention_maps``)
    and, for an encoder-decoder asked for it, the beam search's trace (``inspection.beam_trace``),
    as the fields of :class:`~qkv.serve.schemas.AttentionResponse` (but the model's name and kind)."""
    from qkv.decoding import beam_search
    from qkv.embedding import frame
    from qkv.inspection import attention_maps, beam_trace

    (text,) = texts
    model, source, target = served.model, served.vocab.source, served.vocab.target
    window = served.window
    tokens = served.token_strings
    found: dict = {"trace": None, "source_tokens": [], "target_tokens": [], "predicted_tokens": []}
    if served.kind == "encoder_decoder":
        src = source.encode(text)
        if not src or len(src) > window:
            raise TooLong(f"the text has {len(src)} tokens; model {served.name} reads 1 to {window}")
        if output is not None:
            out = target.encode(output, add_special_tokens=False)
            if len(out) + 1 > window:
                raise TooLong(f"the output has {len(out)} tokens; model {served.name} writes at most {window - 1}")
        else:
            cap = max_new_tokens or int(1.5 * len(src)) + 10  # qkv translate's length rule by default
            if trace:
                traced = beam_trace(model, src, beam_size=beam_size, max_new_tokens=cap, length_penalty=length_penalty)
                found["trace"] = _trace(served, traced, beam_size)
                out = traced.hypotheses[0].tokens
            else:
                out = beam_search(model, [src], beam_size=beam_size, max_new_tokens=cap, length_penalty=length_penalty)
                out = out[0][0].tokens
        maps = attention_maps(model, src, out)
        found["source_tokens"] = tokens(source, src)
        found["target_tokens"] = tokens(target, [model.config.bos_id, *out])
        found["predicted_tokens"] = tokens(target, [*out, model.config.eos_id])
    elif served.kind == "decoder_only":
        prompt = source.encode(text) or [source.bos_id]
        if len(prompt) > window:
            raise TooLong(f"the prompt has {len(prompt)} tokens; model {served.name} reads at most {window}")
        ended = False
        if output is not None:
            out = target.encode(output, add_special_tokens=False)[: window - len(prompt)]
        else:
            room = min(max_new_tokens or 32, window - len(prompt))
            out = []
            if room > 0:
                (out,) = generate_tokens(served, [prompt], room)
                ended = len(out) < room
        maps = attention_maps(model, prompt, out)
        read = [*prompt, *out]
        found["target_tokens"] = tokens(target, read)
        last = [tokens(target, [model.config.eos_id])[0] if ended and model.config.eos_id is not None else "…"]
        found["predicted_tokens"] = tokens(target, read[1:]) + last
    else:
        (ids,), _ = frame(source, [text], max_len=window)
        maps = attention_maps(model, ids)
        found["source_tokens"] = tokens(source, ids)
        out = []
    found["output"] = target.decode(out) if served.kind != "encoder_only" else ""
    found["encoder"], found["decoder"], found["cross"] = (
        _rounded(maps.encoder),
        _rounded(maps.decoder),
        _rounded(maps.cross),
    )
    layers = served.layers()
    found["layers"], found["heads"] = max(layers.values()), model.config.n_heads
    return [found]


def generate_tokens(served: Served, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (token ids) of prompts that fit the window."""
    from qkv.decoding import greedy

    return greedy(served.model, prompts, max_new_tokens=max_new_tokens)


def _trace(served: Served, traced, beam_size: int) -> dict:
    """An ``inspection.BeamTrace`` as the API's Trace: tokens as strings, texts decoded."""
    target = served.vocab.target

    def hyp(h) -> dict:
        return {
            "tokens": served.token_strings(target, h.tokens),
            "text": target.decode(h.tokens),
            "score": h.score,
            "parent": h.parent,
        }

    steps = [
        {
            "step": st.step,
            "live": [hyp(h) for h in st.live],
            "ended": [hyp(h) for h in st.ended],
            "dropped": [hyp(h) for h in st.dropped],
            "capped": st.capped,
        }
        for st in traced.steps
    ]
    return {"beam_size": beam_size, "steps": steps, "hypotheses": [hyp(h) for h in traced.hypotheses]}
