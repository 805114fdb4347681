"""One optimizer step of each model family on a fixed batch, run the same way by the test (one
process, the whole batch) and by the workers torchrun starts (each its share of the batch).

As a script (``torchrun --nproc-per-node 2 tests/distributed_cases.py PARALLEL OUT``) every
worker joins the group, takes its rows of every family's batch (``qkv.distributed.share``),
takes one ``Trainer`` step wrapped for PARALLEL (ddp or fsdp), and rank 0 writes the whole
weights after the step to ``OUT/FAMILY.safetensors`` and the step's loss to ``OUT/losses.json``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.audio import FeatureConfig, pad_features
from qkv.losses import (
    seq2seq_batch,
    seq2seq_loss,
    sequence_loss,
    share_loss,
    speech_loss,
    speech_tokens,
    tts_counts,
    tts_loss,
)
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder
from qkv.models.tts import TransformerTTS, TTSConfig
from qkv.tasks.tts import tts_batch
from qkv.training import Trainer

FAMILIES = ("encoder_decoder", "encoder_only", "decoder_only", "speech_encoder_decoder", "tts")
ROWS = 7  # odd: the two workers' shares differ in size (4 and 3 rows)
V, D, H, F, T = 23, 16, 2, 32, 11  # vocabulary, width, heads, feed-forward, longest sequence
M = 13  # mel bins of the speech and TTS cases
PAD, BOS, EOS = 0, 1, 2
SETTINGS = {"lr": 1e-3, "warmup": 0, "total_steps": 10}  # one step: no warm-up ramp


def _lengths(generator: torch.Generator) -> list[int]:
    return torch.randint(3, T, (ROWS,), generator=generator).tolist()


def _tokens(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(3, V, (n,), generator=generator).tolist()


def case(family: str) -> tuple[nn.Module, Callable[[nn.Module, list[int]], tuple[Tensor, int]]]:
    """A tiny model of ``family`` (fixed seed, no dropout) and the loss of any rows of its batch:
    ``loss(model, rows) -> (mean loss over the rows' tokens, their number)``."""
    torch.manual_seed(11)
    g = torch.Generator().manual_seed(5)
    # No biases: AdamW's first step moves every parameter by about lr·g/|g|, so one whose true
    # gradient is zero (a key bias: softmax ignores a constant added to every score) would move
    # by ±lr on floating-point noise alone, in whichever direction the summation order gives.
    common = {"d_model": D, "n_heads": H, "d_ff": F, "max_len": T + 2, "dropout": 0.0, "bias": False}
    if family == "encoder_decoder":
        model = EncoderDecoder(
            EncoderDecoderConfig(src_vocab_size=V, tgt_vocab_size=V, n_encoder_layers=2, n_decoder_layers=2, **common)
        )
        pairs = [(_tokens(a, g), _tokens(b, g)) for a, b in zip(_lengths(g), _lengths(g), strict=True)]

        def loss(m: nn.Module, rows: list[int]) -> tuple[Tensor, int]:
            s, t_in, t_out = seq2seq_batch([pairs[i] for i in rows], pad_id=PAD, bos_id=BOS, eos_id=EOS)
            return seq2seq_loss(m, s, t_in, t_out, pad_id=PAD)

        return model, loss
    if family == "encoder_only":
        model = EncoderOnly(EncoderOnlyConfig(vocab_size=V, n_layers=2, n_classes=3, mlm_head=False, **common))
        texts = [_tokens(n, g) for n in _lengths(g)]
        labels = torch.randint(3, (ROWS,), generator=g)

        def loss(m: nn.Module, rows: list[int]) -> tuple[Tensor, int]:
            width = max(len(texts[i]) for i in rows)
            x = torch.tensor([texts[i] + [PAD] * (width - len(texts[i])) for i in rows])  # (B, S)
            logits = m.classify(x, mask=x != PAD)  # (B, C)
            return sequence_loss(logits[:, None], labels[rows][:, None], ignore_id=None), len(rows)

        return model, loss
    if family == "speech_encoder_decoder":
        return _speech_case(common, g)
    if family == "tts":
        return _tts_case(common, g)
    model = DecoderOnly(DecoderOnlyConfig(vocab_size=V, n_layers=2, **common))
    blocks = torch.randint(3, V, (ROWS, T + 1), generator=g)  # (B, T + 1)

    def loss(m: nn.Module, rows: list[int]) -> tuple[Tensor, int]:
        x, y = blocks[rows, :-1], blocks[rows, 1:]  # (B, T) each
        return sequence_loss(m(x), y, ignore_id=None), y.numel()

    return model, loss


def _speech_case(common: dict, g: torch.Generator) -> tuple[nn.Module, Callable]:
    """The asr task's step: the joint CTC/attention loss (λ = 0.3, label smoothing) of feature
    frames, a share weighted by its frames (the task's seconds of audio) and its terms divided by
    the whole batch's tokens (``losses.share_loss``), as ``tasks.asr`` computes it."""
    features = FeatureConfig(n_mels=M, normalize=False)
    config = SpeechConfig(
        vocab_size=V, n_encoder_layers=2, n_decoder_layers=1, features=features, key_bias=False, **common
    )
    model = SpeechEncoderDecoder(config)
    feats = [torch.randn(int(n), M, generator=g) for n in torch.randint(29, 53, (ROWS,), generator=g)]
    targets = [_tokens(n, g) for n in _lengths(g)]

    def batch(rows: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        f, v = pad_features([feats[i] for i in rows])  # (B, T, M), (B, T)
        _, t_in, t_out = seq2seq_batch([([], targets[i]) for i in rows], pad_id=PAD, bos_id=BOS, eos_id=EOS)
        return f, v, t_in, t_out

    _, every_valid, _, every_out = batch(list(range(ROWS)))
    whole = speech_tokens(every_out, pad_id=PAD, eos_id=EOS)

    def loss(m: nn.Module, rows: list[int]) -> tuple[Tensor, float]:
        f, v, t_in, t_out = batch(rows)
        part, _ = speech_loss(m, f, v, t_in, t_out, pad_id=PAD, ctc_weight=0.3, label_smoothing=0.1, whole=whole)
        return share_loss(part, float(v.sum()), float(every_valid.sum())), float(v.sum())

    return model, loss


def _tts_case(common: dict, g: torch.Generator) -> tuple[nn.Module, Callable]:
    """The tts task's step: frames, stop token and guided attention (each a mean over its own
    count: frames, text × step pairs), a share weighted by its frames and divided by the whole
    batch's counts (``losses.share_loss``), as ``tasks.tts`` computes it. No pre-net dropout,
    whose draws depend on how rows fall to workers."""
    config = TTSConfig(
        vocab_size=V,
        n_encoder_layers=1,
        n_decoder_layers=2,
        features=FeatureConfig(n_mels=M, normalize=False),
        reduction=3,
        encoder_convs=1,
        prenet_dim=8,
        prenet_dropout=0.0,
        postnet_layers=2,
        postnet_channels=5,
        pad_id=PAD,
        **common,
    )
    model = TransformerTTS(config)
    texts = [_tokens(n, g) for n in _lengths(g)]
    mels = [torch.randn(int(n), M, generator=g) for n in torch.randint(7, 3 * T, (ROWS,), generator=g)]
    every = tts_batch(model, mels, texts, PAD)
    whole = tts_counts(every[3], every[1], reduction=config.reduction)

    def loss(m: nn.Module, rows: list[int]) -> tuple[Tensor, float]:
        mel, valid, text, text_valid = tts_batch(m, [mels[i] for i in rows], [texts[i] for i in rows], PAD)
        part, _, _ = tts_loss(m, text, text_valid, mel, valid, guided_weight=1.0, whole=whole)
        return share_loss(part, float(valid.sum()), float(every[1].sum())), float(valid.sum())

    return model, loss


def main(parallel: str, out: Path) -> None:
    from safetensors.torch import save_file

    from qkv import distributed

    world = distributed.start()
    losses = {}
    for family in FAMILIES:
        model, loss = case(family)
        trainer = Trainer(model, **SETTINGS, parallel=parallel)

        def batch(model: nn.Module = model, loss: Callable = loss) -> tuple[Tensor, int]:
            mine, counted = distributed.share(ROWS)
            value, n = loss(model, mine)
            return value, n if counted else 0

        losses[family], _ = trainer.step([batch])
        state = distributed.full_state(model)  # collective under FSDP
        if world.main:
            save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, out / f"{family}.safetensors")
    if world.main:
        (out / "losses.json").write_text(json.dumps(losses))
    distributed.finish()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
