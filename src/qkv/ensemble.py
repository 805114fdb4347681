"""Several models decoding as one: :class:`Ensemble` (its members' checks and window).

What is here: the ensemble's definition only. How it decodes (the mean of its members'
next-token distributions, each member with its own encoder output and KV cache) is
``decoding/``'s, which takes an ensemble wherever it takes a model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder


@dataclass(frozen=True)
class Ensemble:
    """Models of one vocabulary and family that decode as one: at every step the next-token
    distribution is the mean of theirs, p = (1/n) Σᵢ pᵢ over the n models (fairseq's ensemble rule; each model
    keeps its own encoder output and KV cache). ``decoding/``'s ``greedy``, ``sample``,
    ``stream``, ``continuation`` and ``beam_search`` take one wherever they take a model, and
    an ensemble of one model decodes exactly as that model (tested);
    ``decoding_copies.for_decoding`` and ``int8_linears`` apply to each member. Its ``config`` is the
    first model's, with the smallest window (``max_len``) of all.
    """

    models: tuple[EncoderDecoder | SpeechEncoderDecoder | DecoderOnly, ...]

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("an ensemble needs at least one model")
        first = self.models[0]
        if not isinstance(first, EncoderDecoder | SpeechEncoderDecoder | DecoderOnly):
            raise ValueError(
                f"ensemble members are encoder-decoder, speech or decoder-only models, not {type(first).__name__}"
            )
        if isinstance(first, EncoderDecoder):
            vocab: tuple[str, ...] = ("src_vocab_size", "tgt_vocab_size")
        elif isinstance(first, SpeechEncoderDecoder):
            vocab = ("vocab_size", "features", "blank")  # one input: the same features
        else:
            vocab = ("vocab_size",)
        for i, m in enumerate(self.models[1:], 1):
            if type(m) is not type(first):
                raise ValueError(f"ensemble model {i} is a {type(m).__name__}, model 0 a {type(first).__name__}")
            for field in ("pad_id", "bos_id", "eos_id", *vocab):
                theirs, ours = getattr(m.config, field), getattr(first.config, field)
                if theirs != ours:
                    raise ValueError(f"ensemble model {i} has {field}={theirs}, model 0 {field}={ours}")

    @property
    def config(self) -> EncoderDecoderConfig | SpeechConfig | DecoderOnlyConfig:
        return replace(self.models[0].config, max_len=min(m.config.max_len for m in self.models))
