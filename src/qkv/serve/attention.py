"""Every attention map of one input, and the beam search's trace, as ``POST /v1/attention`` gives them.

What is here: :func:`attention_view` (run on the model thread): the tokens and every attention
map of one input, read through the explicit path (``inspection.attention_maps``), after decoding
the model's own output when none is given (``decoding.beam_search``, or its trace,
``inspection.beam_trace``); :class:`TooLong`, an input or output that does not fit the window.

What is not here: HTTP (``routes/attention.py``), the page that draws the maps (``static/``).
"""

from __future__ import annotations

from qkv.decoding import beam_search, greedy
from qkv.embedding import frame
from qkv.inspection import attention_maps, beam_trace
from qkv.serve.models import Served


class TooLong(ValueError):
    """An input (or the output to read) does not fit the model's window."""


def _rounded(maps) -> list | None:
    """One (H, T, S) tensor per layer as nested lists, 4 decimals (the page draws 256 shades).
    Rounded in float64: a float32 0.1851 would reach JSON as 0.1851000040769577."""
    if maps is None:
        return None
    return [((w.double() * 10_000).round() / 10_000).tolist() for w in maps]


def attention_view(
    served: Served, texts: list[str], *, output, beam_size, length_penalty, max_new_tokens, trace
) -> list[dict]:
    """For the one text of ``texts``: the tokens, every attention map (``inspection.attention_maps``)
    and, for an encoder-decoder asked for it, the beam search's trace (``inspection.beam_trace``),
    as the fields of :class:`~qkv.serve.schemas.AttentionResponse` (but the model's name and kind)."""
    (text,) = texts
    if served.kind == "encoder_decoder":
        decoding = {"beam_size": beam_size, "length_penalty": length_penalty, "trace": trace}
        found, maps, out = _encoder_decoder_view(served, text, output, max_new_tokens, **decoding)
    elif served.kind == "decoder_only":
        found, maps, out = _decoder_only_view(served, text, output, max_new_tokens)
    else:
        (ids,), _ = frame(served.vocab.source, [text], max_len=served.window)
        found, maps, out = (
            {"source_tokens": served.token_strings(served.vocab.source, ids)},
            attention_maps(served.model, ids),
            [],
        )
    found = {"trace": None, "source_tokens": [], "target_tokens": [], "predicted_tokens": [], **found}
    found["output"] = served.vocab.target.decode(out) if served.kind != "encoder_only" else ""
    found["encoder"], found["decoder"], found["cross"] = (_rounded(m) for m in (maps.encoder, maps.decoder, maps.cross))
    found["layers"], found["heads"] = max(served.layers().values()), served.model.config.n_heads
    return [found]


def _encoder_decoder_view(served: Served, text: str, output, max_new_tokens, *, beam_size, length_penalty, trace):
    """An encoder-decoder's tokens (and trace), maps and output tokens: the output given, else its own."""
    model, source, target, window = served.model, served.vocab.source, served.vocab.target, served.window
    tokens = served.token_strings
    found: dict = {}
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
    found["source_tokens"] = tokens(source, src)
    found["target_tokens"] = tokens(target, [model.config.bos_id, *out])
    found["predicted_tokens"] = tokens(target, [*out, model.config.eos_id])
    return found, attention_maps(model, src, out), out


def _decoder_only_view(served: Served, text: str, output, max_new_tokens):
    """A language model's tokens, maps and output tokens: the output given (cut to the window),
    else its greedy continuation within the window (32 tokens by default)."""
    model, source, target, window = served.model, served.vocab.source, served.vocab.target, served.window
    tokens = served.token_strings
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
            (out,) = greedy(model, [prompt], max_new_tokens=room)
            ended = len(out) < room
    read = [*prompt, *out]
    last = [tokens(target, [model.config.eos_id])[0] if ended and model.config.eos_id is not None else "…"]
    found = {"target_tokens": tokens(target, read), "predicted_tokens": tokens(target, read[1:]) + last}
    return found, attention_maps(model, prompt, out), out


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
