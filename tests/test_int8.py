"""Weight-only int8 (``--int8``, qkv.int8): the int8 linear is a per-channel quantize → matmul →
dequantize computed by hand; the fast kernels equal the explicit product up to bfloat16
rounding; the copy replaces every linear layer, the encoder's included, and keeps the vocabulary
projection in bfloat16. Slow: on the real Whisper tiny.en, int8 transcripts equal float32's on
at least 95% of FSDD test files (greedy)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from qkv.audio import FeatureConfig
from qkv.decoding_copies import for_decoding, int8_linears
from qkv.int8 import Bf16Linear, Int8Linear, int8_linear, quantize_channels
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder

WHISPER = Path("/tmp/whisper-tiny.en")


def _linear(k: int, n: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight[0] *= 50.0  # one loud row: per-channel scales keep the others fine
    return linear


def test_int8_linear_is_a_per_channel_quantize_matmul_dequantize() -> None:
    """Each output row gets its own scale max|row|/127; the layer computes x @ (q * scale)ᵀ + b."""
    linear = _linear(7, 13, seed=0)
    x = torch.randn(3, 5, 7)  # K = 7: not a multiple of 16, the explicit product runs
    w = linear.weight.detach()
    scale = torch.stack([row.abs().max() / 127 for row in w])  # (13,) by hand, row by row
    q = torch.stack([torch.round(row / s) for row, s in zip(w, scale, strict=True)])  # (13, 7)
    expected = x @ (q * scale[:, None]).T + linear.bias.detach()  # (3, 5, 13)
    got_q, got_scale = quantize_channels(w)
    assert got_q.dtype == torch.int8 and torch.equal(got_q.float(), q)
    assert torch.allclose(got_scale, scale)
    layer = Int8Linear(linear)
    assert torch.allclose(layer(x), expected, atol=1e-5)
    # per channel: the quiet rows lose far less than the loud row's scale would cost them
    error = (q * scale[:, None] - w).abs()[1:].max()
    assert error <= scale[1:].max() / 2 + 1e-7 and error < scale[0] / 4


@pytest.mark.parametrize("rows", [1, 5, 40])  # the int8-weight kernel (few rows), the bf16 GEMM (many)
def test_fast_path_equals_the_explicit_product(rows: int) -> None:
    linear = _linear(32, 13, seed=rows)
    layer = Int8Linear(linear)
    x = torch.randn(rows, 32)
    assert layer.fast(x)
    reference = int8_linear(x.bfloat16().float(), layer.q, layer.scale_bf16.float(), layer.bias)  # (rows, 13)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 13)
    assert torch.allclose(got, reference, rtol=2**-7, atol=1e-3 * reference.abs().max().item())
    bf16 = Bf16Linear(linear)
    assert torch.allclose(bf16(x), linear(x), rtol=2**-6, atol=2e-2 * linear(x).abs().max().item())


def test_int8_copy_quantizes_the_encoder_and_keeps_the_output_in_bf16() -> None:
    torch.manual_seed(3)
    config = SpeechConfig(
        vocab_size=11,
        features=FeatureConfig(n_mels=7),
        d_model=16,
        n_heads=2,
        d_ff=32,
        n_encoder_layers=1,
        n_decoder_layers=1,
        dropout=0.0,
    )
    model = SpeechEncoderDecoder(config).eval()
    quantized = int8_linears(for_decoding(model))
    assert isinstance(quantized.output, Bf16Linear)
    assert any(isinstance(m, Int8Linear) for m in quantized.encoder.modules())
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the original is untouched


@pytest.mark.slow
def test_whisper_tiny_int8_keeps_the_float32_words(tmp_path) -> None:
    """The real Whisper tiny.en: greedy int8 transcripts equal float32's on ≥ 95% of 20 FSDD test
    files. Needs `bash bench/fetch_whisper_tiny.sh` and the corpus in $QKV_DATA/fsdd."""
    data = Path(os.environ.get("QKV_DATA", "/work/shared/data")) / "fsdd"
    if not (WHISPER / "model.safetensors").is_file() or not (data / "recordings").is_dir():
        pytest.skip("needs /tmp/whisper-tiny.en (bash bench/fetch_whisper_tiny.sh) and FSDD in $QKV_DATA/fsdd")
    import qkv
    from qkv.hf.convert import import_hf
    from qkv.speech_corpora import fsdd_digits

    import_hf(WHISPER, tmp_path / "whisper")
    files = [u.path for u in fsdd_digits(data)["test"][:20]]
    fp32 = qkv.load(tmp_path / "whisper").transcribe(files, beam_size=1)
    int8 = qkv.load(tmp_path / "whisper", int8=True).transcribe(files, beam_size=1)
    assert sum(a == b for a, b in zip(fp32, int8, strict=True)) >= 19
