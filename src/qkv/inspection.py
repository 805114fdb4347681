"""Looking inside a model: every attention map of one input, and a beam search's trace.

What is here:
  * :func:`attention_maps`: for one input, the attention weights A' of every layer and head:
    an encoder's self-attention, a decoder's masked self-attention and its cross-attention to
    the encoder output. One teacher-forced pass through the explicit path
    (:func:`~qkv.attention.attention_explicit`): while it runs, every
    :class:`~qkv.attention.MultiHeadAttention` is called with ``need_weights=True`` (PyTorch
    forward hooks, removed afterwards), whatever path the model takes otherwise (the fused
    kernel, stacked projections, int8 weights). The model itself is not changed.
  * :func:`beam_trace`: the beam search of one source written out step by step, with what
    each step kept (the live hypotheses, their scores and the beam each extends), what ended
    (reached END) and what was dropped (in the best 2W candidates of the step but not kept):
    :func:`~qkv.decoding.beam_search` itself, recorded by its ``on_step`` hook.

What is not here: pictures (``plots.py``, the server's page), the search (``decoding/``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qkv.attention import MultiHeadAttention
from qkv.decoding import BeamStep, Candidate, beam_search
from qkv.models.decoder_only import DecoderOnly
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.models.encoder_only import EncoderOnly

PARTS = ("encoder", "decoder", "cross")  # encoder self-, decoder masked self-, cross-attention


@dataclass(frozen=True)
class AttentionMaps:
    """Attention weights of one input, one (H, rows, columns) tensor per layer, first layer
    first; a part the model does not have is None.

    Shapes:
        encoder: one (H, S, S) per layer, the encoder's self-attention over the source (or the text).
        decoder: one (H, T, T) per layer, the decoder's masked self-attention (zero above the diagonal).
        cross: one (H, T, S) per layer, the decoder's attention to the encoder output.
    """

    encoder: list[Tensor] | None
    decoder: list[Tensor] | None
    cross: list[Tensor] | None


def _part(name: str) -> str:
    """Which kind of attention the MultiHeadAttention at module path ``name`` is."""
    if name.startswith("encoder."):
        return "encoder"
    return "cross" if name.endswith("cross_attn") else "decoder"


@contextmanager
def recording(model: torch.nn.Module) -> Iterator[dict[str, list[Tensor]]]:
    """While inside, every attention of ``model`` takes the explicit path and its weights
    (B, H, T, S) are appended, call by call, to the list of its part (:data:`PARTS`)."""
    found: dict[str, list[Tensor]] = {part: [] for part in PARTS}
    handles = []

    def explicit(module, args, kwargs):
        return args, {**kwargs, "need_weights": True}

    def keeper(part: str):
        def keep(module, args, kwargs, output):
            found[part].append(output[2])  # (B, H, T, S)

        return keep

    for name, module in model.named_modules():
        if isinstance(module, MultiHeadAttention):
            handles.append(module.register_forward_pre_hook(explicit, with_kwargs=True))
            handles.append(module.register_forward_hook(keeper(_part(name)), with_kwargs=True))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def attention_maps(
    model: EncoderDecoder | DecoderOnly | EncoderOnly, inputs: list[int], output: list[int] = ()
) -> AttentionMaps:
    """Every attention map while ``model`` reads ``inputs`` and ``output`` (token ids).

    An encoder-decoder reads ``inputs`` as its source and BEGIN + ``output`` as its target
    (row t of the decoder's maps is the step that writes (``output`` + END)[t]); a
    decoder-only model reads ``inputs`` + ``output`` as one sequence; an encoder-only model
    reads ``inputs`` (its text as the model frames it, e.g. [CLS] ... [SEP]). Everything read
    must fit the model's window (``max_len``), else ValueError.
    """
    device = next(model.parameters()).device
    window = model.config.max_len
    if isinstance(model, EncoderDecoder):
        sizes = {"source": len(inputs), "target": len(output) + 1}
    else:
        sizes = {"input": len(inputs) + len(output)}
    for what, n in sizes.items():
        if n > window:
            raise ValueError(f"the {what} has {n} tokens; the model's window is {window}")
        if n == 0:
            raise ValueError(f"the {what} is empty")
    with recording(model) as found:
        if isinstance(model, EncoderDecoder):
            src = torch.tensor([inputs], device=device)  # (1, S)
            valid = torch.ones_like(src, dtype=torch.bool)  # (1, S): every token real, pad ids too
            memory = model.encode(src, src_mask=valid)  # (1, S, D)
            tgt = torch.tensor([[model.config.bos_id, *output]], device=device)  # (1, T)
            model.decode(tgt, memory, src_mask=valid)
        elif isinstance(model, DecoderOnly):
            model.decode(torch.tensor([[*inputs, *output]], device=device))
        elif isinstance(model, EncoderOnly):
            tokens = torch.tensor([inputs], device=device)  # (1, S)
            model.encode(tokens, mask=torch.ones_like(tokens, dtype=torch.bool))
        else:
            raise TypeError(f"not a qkv model: {type(model).__name__}")
    return AttentionMaps(
        **{part: [w[0].float() for w in found[part]] or None for part in PARTS}  # one (H, T, S) per layer
    )


@dataclass(frozen=True)
class TraceStep:
    """What one step of beam search did: ``live`` (the W hypotheses kept, best first),
    ``ended`` (extensions by END among the step's best W, set aside as finished, or the live
    ones finished where the output reached its cap: ``capped``) and ``dropped`` (other
    extensions among the step's best 2W candidates that were not kept). Each is a
    :class:`~qkv.decoding.Candidate`: its tokens (END not included), its score (summed; for one
    that ended, log p / length^penalty, the score beam search ranks by) and its parent."""

    step: int
    live: list[Candidate] = field(default_factory=list)
    ended: list[Candidate] = field(default_factory=list)
    dropped: list[Candidate] = field(default_factory=list)
    capped: bool = False


@dataclass(frozen=True)
class BeamTrace:
    """A beam search of one source: its steps, and the finished hypotheses, best first."""

    steps: list[TraceStep]
    hypotheses: list[Candidate]


def beam_trace(
    model: EncoderDecoder, src: list[int], *, beam_size: int, max_new_tokens: int, length_penalty: float = 1.0
) -> BeamTrace:
    """Beam search of the source ``src`` (token ids), recorded step by step: the search is
    :func:`~qkv.decoding.beam_search` itself, and the record its ``on_step`` hook. Finished
    hypotheses are returned best first, all of them (beam search's n-best are the first
    ``nbest``)."""
    if not isinstance(model, EncoderDecoder):
        raise TypeError("a beam trace needs an encoder-decoder model")
    if not src:
        raise ValueError("the source is empty")
    steps: list[TraceStep] = []

    def record(event: BeamStep) -> None:
        steps.append(TraceStep(event.step, event.live, event.ended, event.dropped, event.capped))

    beam_search(
        model, [src], beam_size=beam_size, max_new_tokens=max_new_tokens, length_penalty=length_penalty, on_step=record
    )
    finished = [h for step in steps for h in step.ended]
    return BeamTrace(steps, sorted(finished, key=lambda h: -h.score))
