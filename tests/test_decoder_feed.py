"""``Decoder.feed``: forced tokens (a prompt, Whisper's previous text) read in one call equal the
same tokens fed one step at a time, as the searches fed them before, for every adapter; and a
search from a long forced prefix writes what it wrote when the prefix was stepped through.

Random tiny models (prime sizes); the stepped form is written out here, as the reference.
"""

from __future__ import annotations

import pytest
import torch

from qkv.audio import FeatureConfig
from qkv.decoding import decoder_for, greedy
from qkv.decoding_copies import for_decoding
from qkv.ensemble import Ensemble
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder

SMALL = {"d_model": 15, "n_heads": 3, "d_ff": 7, "dropout": 0.0, "max_len": 31}
V, MELS = 17, 7
NAMES = ("text", "lm", "speech", "whisper-like, wide", "ensemble")


def speech(seed: int, **fields) -> SpeechEncoderDecoder:
    torch.manual_seed(seed)
    config = SpeechConfig(
        vocab_size=V, n_encoder_layers=1, n_decoder_layers=2, features=FeatureConfig(n_mels=MELS), **SMALL, **fields
    )
    return SpeechEncoderDecoder(config).eval()


def model_and_inputs(name: str) -> tuple[object, list]:
    """The model of one adapter (``name``, one of :data:`NAMES`) with two inputs of its kind."""
    torch.manual_seed(3)
    feats = [torch.randn(23, MELS), torch.randn(19, MELS)]  # padded to one batch: a source mask
    if name == "text":
        config = EncoderDecoderConfig(
            src_vocab_size=V, tgt_vocab_size=V, n_encoder_layers=1, n_decoder_layers=2, **SMALL
        )
        return EncoderDecoder(config).eval(), [[3, 4, 5, 6], [7, 8]]
    if name == "lm":  # left-padded prompts: a key mask
        return DecoderOnly(DecoderOnlyConfig(vocab_size=V, n_layers=2, **SMALL)).eval(), [[3, 4, 5], [6, 7]]
    if name == "speech":
        return speech(4), feats
    if name == "ensemble":
        return Ensemble((speech(6), speech(7))), feats
    whisper_like = speech(5, frontend="whisper", positions="learned", ctc=False, key_bias=False, norm_first=True)
    return for_decoding(whisper_like, wide=True), feats  # stacked Q/K/V, transposed wide weights


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_feed_equals_one_step_a_token(name: str) -> None:
    model, inputs = model_and_inputs(name)
    decoder = decoder_for(model)
    forced = torch.tensor([[9, 10, 11, 12, 13, 14, 15]] * len(inputs))  # (B, L)
    _, state = decoder.start(inputs)
    fed_logits, fed = decoder.feed(state, forced)  # (B, V)
    stepped = state
    for k in range(forced.shape[1]):
        step_logits, stepped = decoder.step(stepped, forced[:, k])
    assert fed_logits.shape == step_logits.shape == (len(inputs), V)
    torch.testing.assert_close(fed_logits, step_logits, atol=1e-5, rtol=1e-5)
    nxt = torch.tensor([3] * len(inputs))  # the states go on alike
    torch.testing.assert_close(decoder.step(fed, nxt)[0], decoder.step(stepped, nxt)[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_greedy_after_a_long_prefix_writes_what_stepping_through_it_wrote() -> None:
    """The explicit form: the prefix stepped through token by token, then greedy steps."""
    model = speech(8)
    feats = [torch.randn(29, MELS)]
    prefix = [model.config.bos_id, *range(3, 16)]  # a prompt of 13 tokens after BEGIN
    decoder = decoder_for(model)
    logits, state = decoder.start(feats)
    for t in prefix[1:]:
        logits, state = decoder.step(state, torch.tensor([t]))
    explicit = []
    for _ in range(8):
        token = logits.argmax(-1)  # (1,)
        if int(token) == model.config.eos_id:
            break
        explicit.append(int(token))
        logits, state = decoder.step(state, token)
    assert greedy(model, feats, max_new_tokens=8, prefix=prefix) == [explicit]
