"""The speech encoder–decoder: log-mel frames in, tokens out (speech recognition, speech translation).

What is here: :class:`SpeechConfig` and :class:`SpeechEncoderDecoder`: a convolutional front-end
that shortens the frames (:class:`Conv2dSubsampling`, ESPnet's ×4; or :class:`WhisperConv`,
Whisper's ×2) and says which of its output frames are real, fixed sinusoidal positions (qkv's
layouts or Whisper's, :func:`whisper_sinusoids`), the encoder and decoder stacks of
``blocks.py``, an output layer over the vocabulary and an optional CTC head on the encoder
output (Graves et al., 2006). ``encode(features, valid)`` gives the memory and its valid
frames; ``decode`` is :meth:`~qkv.models.encoder_decoder.EncoderDecoder.decode`'s (same
arguments, KV cache, attention weights), so decoding treats both alike; ``ctc_logits(memory)``
is the CTC head's output; ``forward`` gives teacher-forced logits. The model returns logits,
never losses.

The feature settings (:class:`~qkv.audio.FeatureConfig`) are a field of the config
(``features``): they are saved with it in ``config.json`` (a nested object) and loaded with it,
so a checkpoint says how its input frames must be computed, and the model's mel bins M are the
features' ``n_mels``. The model does not compute features: callers run ``qkv.audio``.

What is not here: features (``audio.py``), the CTC and joint losses (``losses.py``:
``ctc_loss``, ``speech_loss``), decoding and CTC prefix scores (``decoding/``).

Shapes use the legend of ``attention.py``: features (B, T, M) with T frames and M mel bins;
the encoder output (B, S, D) with S frames after subsampling; T' and M' are the frames and
mel bins after the first of two convolutions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.audio import FeatureConfig
from qkv.blocks import (
    BlockCache,
    BlockConfig,
    DecoderOutput,
    DecoderStack,
    EncoderStack,
    cache_length,
    check_fields,
    decode_row,
)
from qkv.layers import Dropout, InputEmbedding, exporting, sinusoidal_encoding

FRONTENDS = ("conv2d", "whisper")
ENCODER_POSITIONS = ("sinusoidal", "sinusoidal_halves", "whisper", "none")
DECODER_POSITIONS = ("sinusoidal", "sinusoidal_halves", "learned")
CONV2D_MIN_FRAMES = 7  # two 3-wide convolutions of stride 2 need 7 frames (and 7 mel bins) for one output


@dataclass(frozen=True)
class SpeechConfig(BlockConfig):
    """A speech encoder–decoder: the per-block settings of :class:`BlockConfig` plus these.

    Attributes:
        vocab_size: output vocabulary V (the decoder's and the CTC head's).
        n_encoder_layers, n_decoder_layers: blocks in each stack.
        features: the feature settings the model was trained on (a
            :class:`~qkv.audio.FeatureConfig`, or its dict from ``config.json``); M =
            ``features.n_mels``.
        frontend: ``"conv2d"``: ESPnet's Conv2dSubsampling, two Conv2d (3×3, stride 2, D
            channels) over (time, mel), each followed by ReLU, then a linear map to D: S =
            ((T − 1) // 2 − 1) // 2. ``"whisper"``: Whisper's two Conv1d over time (mel bins as
            channels, kernel 3, padding 1, stride 1 then 2), each followed by GELU: S = ⌈T/2⌉.
        conv_channels: the conv2d front-end's channels (None: D, as ESPnet). Its second
            convolution costs D²·9 per (frame, mel bin) pair it computes, which at D = 144 is
            several times the whole encoder's work; 32–64 channels keep it small on a CPU.
        encoder_positions: positions added to the front-end's output: ``"sinusoidal"``,
            ``"sinusoidal_halves"`` (:func:`~qkv.layers.sinusoidal_encoding`'s layouts),
            ``"whisper"`` (:func:`whisper_sinusoids`) or ``"none"``.
        positions: the decoder's positions: ``"learned"`` (Whisper), ``"sinusoidal"`` or
            ``"sinusoidal_halves"``; ``max_len`` is the decoder's window (Whisper: 448).
        scale_embeddings: multiply the decoder's token embeddings by √D (Whisper: no).
        tie_output: the output layer reuses the decoder's token embedding (Whisper: yes).
        key_bias: with ``bias``, whether the key projections have biases (Whisper: no).
        ctc: a CTC head, a linear map of the encoder output to the vocabulary (Whisper: no).
        pad_id, bos_id, eos_id: padding, BEGIN (Whisper's decoder_start_token_id) and END ids.
        blank_id: the CTC blank (None: ``pad_id``, which no target holds).

    The per-block fields keep their meaning: ``norm_first`` with final norms (Whisper: pre-norm
    LayerNorm), ``activation`` (Whisper: ``"gelu"``), ``bias``, ``dropout``.
    """

    vocab_size: int = 5000
    n_encoder_layers: int = 12
    n_decoder_layers: int = 6
    features: FeatureConfig = field(default_factory=FeatureConfig)
    frontend: str = "conv2d"
    conv_channels: int | None = None
    encoder_positions: str = "sinusoidal"
    scale_embeddings: bool = True
    tie_output: bool = True
    key_bias: bool = True
    ctc: bool = True
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    blank_id: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", FeatureConfig.of(self.features))  # config.json holds a dict
        super().__post_init__()
        choices = {"frontend": FRONTENDS, "encoder_positions": ENCODER_POSITIONS, "positions": DECODER_POSITIONS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed} for a speech model, got {getattr(self, name)!r}")
        check_fields(
            self,
            positive_ints=("vocab_size", "n_encoder_layers", "n_decoder_layers"),
            booleans=("scale_embeddings", "tie_output", "key_bias", "ctc"),
        )
        for name in ("pad_id", "bos_id", "eos_id", "blank_id"):
            value = getattr(self, name)
            if value is None and name == "blank_id":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value!r} is outside the vocabulary")
        if self.ctc and self.blank == self.eos_id:
            raise ValueError(f"the CTC blank ({self.blank}) must not be END (eos_id): joint decoding scores END")
        if self.conv_channels is not None and (
            isinstance(self.conv_channels, bool) or not isinstance(self.conv_channels, int) or self.conv_channels < 1
        ):
            raise ValueError(f"conv_channels must be a positive integer or null, got {self.conv_channels!r}")
        if self.frontend == "conv2d" and self.features.n_mels < CONV2D_MIN_FRAMES:
            raise ValueError(f"the conv2d front-end needs at least {CONV2D_MIN_FRAMES} mel bins")
        if self.encoder_positions == "whisper" and (self.d_model % 2 or self.d_model < 4):
            raise ValueError("encoder_positions='whisper' needs an even d_model of at least 4")

    @property
    def blank(self) -> int:
        """The CTC blank id: ``blank_id``, or ``pad_id`` when that is None."""
        return self.pad_id if self.blank_id is None else self.blank_id


def whisper_sinusoids(positions: Tensor, d_model: int) -> Tensor:
    """Whisper's fixed encoder positions (Radford et al., 2022; ``sinusoids`` in openai/whisper and
    transformers): sin(pos · 10000^(−i / (D/2 − 1))) in dimensions i < D/2, the cosines of the
    same angles in the rest. ``positions="sinusoidal_halves"`` has the same layout with
    timescales 10000^(−i / (D/2)), so the two differ.

    Shapes: positions (T,) integers -> (T, D) float32.
    """
    rates = _whisper_rates(d_model, positions.device)  # (D/2,)
    angles = positions.to(torch.float32)[:, None] * rates[None, :]  # (T, D/2)
    return torch.cat([angles.sin(), angles.cos()], dim=1)  # (T, D)


_RATES: dict[tuple[int, torch.device], Tensor] = {}  # (D, device) -> the rates of whisper_sinusoids


def _whisper_rates(d_model: int, device: torch.device) -> Tensor:
    """The rates 10000^(−i / (D/2 − 1)) of :func:`whisper_sinusoids`, computed once per width and
    device and kept, so that an exported graph holds PyTorch's own values as a constant: an
    exporter that computes exp again rounds an ulp differently, which angles of up to 1,500 radians
    turn into differences of 1e-4 (6e-3 at Whisper tiny's encoder output). While tracing (export) a
    value computed then is never kept (it may be a placeholder); an eager call keeps it first.

    Shapes: returns (D/2,) float32.
    """
    key = (d_model, torch.device(device))
    if key in _RATES:
        return _RATES[key]
    half = d_model // 2
    rates = torch.exp(-math.log(10000.0) / (half - 1) * torch.arange(half, device=device, dtype=torch.float32))
    if not exporting():
        _RATES[key] = rates
    return rates  # (D/2,)


def _frames_mask(lengths: Tensor, frames: int) -> Tensor:
    """True at the first ``lengths[b]`` of ``frames`` positions. Shapes: (B,) -> (B, frames)."""
    return torch.arange(frames, device=lengths.device)[None, :] < lengths[:, None]  # (B, frames)


class Conv2dSubsampling(nn.Module):
    """ESPnet's Conv2dSubsampling (Dong et al., 2018, "Speech-Transformer"): frames ÷ 4.

    Two Conv2d over (time, mel) with ``channels`` channels (ESPnet: D), kernel 3, stride 2, no
    padding, each followed by ReLU; the channels × M'' remaining mel bins of a frame are mapped to D by
    one linear layer. An output frame is real when all 7 input frames it reads are: S_b =
    ((T_b − 1) // 2 − 1) // 2 of T_b real frames, so padding never reaches a real output.

    Shapes:
        features (B, T, M), valid (B, T) bool (real frames first) -> (B, S, D), valid (B, S).
    """

    def __init__(self, n_mels: int, d_model: int, channels: int | None = None) -> None:
        super().__init__()
        channels = channels or d_model
        self.conv_1 = nn.Conv2d(1, channels, kernel_size=3, stride=2)
        self.conv_2 = nn.Conv2d(channels, channels, kernel_size=3, stride=2)
        self.proj = nn.Linear(channels * self.lengths(torch.tensor(n_mels)).item(), d_model)

    @staticmethod
    def lengths(frames: Tensor) -> Tensor:
        """Output frames of ``frames`` input frames (0 below 7). Shapes: any integer tensor, same out."""
        return ((frames - 1).div(2, rounding_mode="floor") - 1).div(2, rounding_mode="floor").clamp(min=0)

    def forward(self, features: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        if features.shape[1] < CONV2D_MIN_FRAMES:
            raise ValueError(f"the conv2d front-end needs at least {CONV2D_MIN_FRAMES} frames, got {features.shape[1]}")
        x = features.to(self.conv_1.weight.dtype)[:, None]  # (B, 1, T, M)
        x = F.relu(self.conv_1(x))  # (B, channels, T', M')
        x = F.relu(self.conv_2(x))  # (B, channels, S, M'')
        b, c, s, m = x.shape
        x = self.proj(x.transpose(1, 2).reshape(b, s, c * m))  # (B, S, D)
        return x, _frames_mask(self.lengths(valid.sum(1)), s)  # (B, S, D), (B, S)


class WhisperConv(nn.Module):
    """Whisper's front-end (Radford et al., 2022, section 2.2): frames ÷ 2.

    Conv1d over time (M mel bins in, D channels out, kernel 3, padding 1), GELU, Conv1d (D to
    D, kernel 3, stride 2, padding 1), GELU. Padding frames are zeroed before each convolution,
    so a real output sees zeros beyond its utterance's end exactly as an unpadded one does:
    S_b = ⌈T_b / 2⌉ of T_b real frames.

    Shapes:
        features (B, T, M), valid (B, T) bool (real frames first) -> (B, S, D), valid (B, S).
    """

    def __init__(self, n_mels: int, d_model: int) -> None:
        super().__init__()
        self.conv_1 = nn.Conv1d(n_mels, d_model, kernel_size=3, padding=1)
        self.conv_2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)

    @staticmethod
    def lengths(frames: Tensor) -> Tensor:
        """Output frames of ``frames`` input frames. Shapes: any integer tensor, same out."""
        return (frames + 1).div(2, rounding_mode="floor")

    def forward(self, features: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        x = features.to(self.conv_1.weight.dtype).transpose(1, 2)  # (B, M, T)
        if not exporting() and bool(valid.all()):  # a graph keeps one path; padded batches take the other
            fold = _foldable_tail(x)
            if fold is not None:
                return self._folded(x, *fold), valid.new_ones(x.shape[0], x.shape[2] - x.shape[2] // 2)
        keep = valid[:, None, :].to(self.conv_1.weight.dtype)  # (B, 1, T)
        x = x * keep  # (B, M, T)
        x = F.gelu(self.conv_1(x)) * keep  # (B, D, T)
        # Contiguous (B, S, D): the transposed view would make every later elementwise result
        # (positions, residual adds) keep its strides, and each norm and product copy it again.
        x = F.gelu(self.conv_2(x)).transpose(1, 2).contiguous()  # (B, S, D)
        return x, _frames_mask(self.lengths(valid.sum(1)), x.shape[1])  # (B, S, D), (B, S)

    def _folded(self, x: Tensor, kept: int, cut: int) -> Tensor:
        """:meth:`forward`'s frames when frames ``kept`` to ``kept + cut`` of every row lie inside
        a run of equal frames (:func:`_foldable_tail`): the convolutions read the frames without
        them, and the ``cut // 2`` outputs they would have given, all equal to the output at
        ``kept // 2`` (every one reads 5 equal frames), are copies of it.

        Shapes: x (B, M, T), every frame real -> (B, S, D), S = ⌈T/2⌉.
        """
        short = torch.cat([x[:, :, :kept], x[:, :, kept + cut :]], dim=2)  # (B, M, T - cut)
        y = F.gelu(self.conv_2(F.gelu(self.conv_1(short))))  # (B, D, S - cut/2)
        b, d, _ = y.shape
        m, n = kept // 2, cut // 2
        out = y.new_empty(b, x.shape[2] - x.shape[2] // 2, d)  # (B, S, D)
        out[:, :m] = y[:, :, :m].transpose(1, 2)
        out[:, m : m + n] = y[:, :, m : m + 1].transpose(1, 2)  # (B, 1, D) repeated
        out[:, m + n :] = y[:, :, m:].transpose(1, 2)
        return out


# Frames kept on either side of a folded run (WhisperConv._folded): the two convolutions read 5 input
# frames an output (kernel 3, then kernel 3 at stride 2), so the outputs beside the fold must still
# read equal frames on both of its sides, and the last ones the zeros past the end.
FOLD_MARGIN = 4
# Fold only runs at least this long: a short one would save less than the copies cost.
FOLD_MIN = 64


def _foldable_tail(x: Tensor) -> tuple[int, int] | None:
    """Whisper pads every input's audio with zeros to 30 s, so a short file's last frames are one
    log-mel column repeated (2,900 of a 1-s file's 3,000), and two convolutions give every output
    that reads only such frames one and the same value. Where every row of the batch ends in such a
    run, ``(kept, cut)``: the first frame to leave out (an even number, at least
    :data:`FOLD_MARGIN` into the run of the row whose run starts last) and how many (even, leaving
    :data:`FOLD_MARGIN` or one more at the end); None where that is under :data:`FOLD_MIN` frames.

    Shapes: x (B, M, T).
    """
    t = x.shape[2]
    if t < FOLD_MIN + 3 * FOLD_MARGIN:
        return None
    same = (x == x[:, :, -1:]).all(dim=1).all(dim=0)  # (T,) frames equal to the last in every row
    differ = (~same).nonzero()  # (P, 1)
    start = 0 if differ.numel() == 0 else int(differ[-1]) + 1  # the runs' latest start
    kept = start + FOLD_MARGIN + start % 2  # even
    cut = t - FOLD_MARGIN - t % 2 - kept  # even: T - cut keeps T's parity
    return (kept, cut) if cut >= FOLD_MIN else None


class SpeechEncoderDecoder(nn.Module):
    """Speech encoder–decoder Transformer: features in, next-token logits (and CTC logits) out.

    Shapes:
        features: (B, T, M) log-mel frames; valid: (B, T) bool, True at real frames (each
        row's real frames first, as ``qkv.audio.pad_features`` gives them);
        tgt: (B, L) token ids starting with BEGIN (bos_id).
        forward returns logits (B, L, V): position i predicts tgt[i + 1].
    """

    def __init__(self, config: SpeechConfig) -> None:
        super().__init__()
        self.config = c = config
        n_mels = c.features.n_mels
        self.frontend = (
            Conv2dSubsampling(n_mels, c.d_model, c.conv_channels)
            if c.frontend == "conv2d"
            else WhisperConv(n_mels, c.d_model)
        )
        self.frontend_dropout = Dropout(c.dropout)
        self.encoder = EncoderStack(c, c.n_encoder_layers, key_bias=c.key_bias)
        self.embed = InputEmbedding(
            c.vocab_size,
            c.d_model,
            positions=c.positions,
            max_len=c.max_len,
            scale=c.scale_embeddings,
            dropout=c.dropout,
        )
        self.decoder = DecoderStack(c, c.n_decoder_layers, cross_attention=True, key_bias=c.key_bias)
        self.output = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_output:
            self.output.weight = self.embed.token.weight
        self.ctc = nn.Linear(c.d_model, c.vocab_size) if c.ctc else None

    def subsampled(self, frames: Tensor) -> Tensor:
        """How many encoder frames (S) the front-end makes of ``frames`` input frames (T)."""
        return self.frontend.lengths(frames)

    def encode(self, features: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Read the frames: the front-end, positions, the encoder stack.

        Every utterance must keep at least one frame after subsampling (ValueError otherwise).

        Shapes: features (B, T, M), valid (B, T) bool (None: all real) -> memory (B, S, D) and
        memory_valid (B, S) bool, the mask that :meth:`decode` takes as ``src_mask``.
        """
        if features.dim() != 3 or features.shape[-1] != self.config.features.n_mels:
            raise ValueError(f"features must be (B, T, {self.config.features.n_mels}), got {tuple(features.shape)}")
        if valid is None:
            valid = torch.ones(features.shape[:2], dtype=torch.bool, device=features.device)  # (B, T)
        x, memory_valid = self.frontend(features, valid)  # (B, S, D), (B, S)
        if not exporting() and not bool(memory_valid[:, 0].all()):  # a graph cannot raise: checked by its caller
            short = int(valid.sum(1).min())
            raise ValueError(
                f"an utterance of {short} frames has no frame left after the {self.config.frontend} front-end"
            )
        positions = torch.arange(x.shape[1], device=x.device)  # (S,)
        kind = self.config.encoder_positions
        if kind == "whisper":
            x = x + whisper_sinusoids(positions, x.shape[-1]).to(x.dtype)  # (B, S, D)
        elif kind != "none":
            x = x + sinusoidal_encoding(positions, x.shape[-1], halves=kind == "sinusoidal_halves").to(x.dtype)
        x = self.frontend_dropout(x)
        return self.encoder(x, valid=memory_valid, positions=positions), memory_valid  # (B, S, D), (B, S)

    def ctc_logits(self, memory: Tensor) -> Tensor:
        """The CTC head's logits at every encoder frame (the blank is ``config.blank``).

        Shapes: memory (B, S, D) -> (B, S, V).
        """
        if self.ctc is None:
            raise ValueError("this speech model has no CTC head (ctc=False)")
        return self.ctc(memory)  # (B, S, V)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        src_mask: Tensor | None,
        cache: list[BlockCache] | None = None,
        need_weights: bool = False,
        only: Tensor | None = None,
    ) -> DecoderOutput:
        """Predict the next tokens from the tokens so far and the encoder output: exactly
        :meth:`~qkv.models.encoder_decoder.EncoderDecoder.decode` (a ``cache`` from an earlier
        call and ``tgt`` holding only the new positions; ``only`` to compute logits at some
        positions; cross-attention weights with ``need_weights``).

        Shapes:
            tgt: (B, L); memory: (B, S, D); src_mask: (B, S) bool, :meth:`encode`'s
            memory_valid (None: every frame real); only: (B, L) bool or None.
            returns logits (B, L, V), or (N, V) with ``only``, the cache, and optionally the
            cross-attention weights (B, H, L, S) per block.
        """
        past = cache_length(cache)
        positions = torch.arange(past, past + tgt.shape[1], device=tgt.device)  # (L,)
        x = self.embed(tgt, positions)  # (B, L, D)
        x, cache, weights = self.decoder(
            x, positions=positions, memory=memory, memory_mask=src_mask, cache=cache, need_weights=need_weights
        )  # (B, L, D)
        if only is not None:
            x = x[only]  # (N, D)
        return DecoderOutput(self.output(x), cache, weights)  # (B, L, V) or (N, V)

    def decode_row(self, tokens: Tensor, *, cache: list[BlockCache]) -> DecoderOutput:
        """:meth:`decode` of one new token per row over frames without padding: exactly
        :meth:`~qkv.models.encoder_decoder.EncoderDecoder.decode_row` (where
        ``self.decoder.rows_ready(cache)``; the cross-attention keys and values in ``cache``).

        Shapes: tokens (N,). Returns logits (N, V) and the cache.
        """
        return decode_row(self.embed, self.decoder, self.output, tokens, cache)  # (N, V)

    def forward(self, features: Tensor, valid: Tensor | None, tgt: Tensor, *, only: Tensor | None = None) -> Tensor:
        """Teacher-forced logits, at every target position or where ``only`` is True.

        Shapes: features (B, T, M), valid (B, T), tgt (B, L), only (B, L) bool -> (B, L, V),
        or (N, V) with ``only``.
        """
        memory, memory_valid = self.encode(features, valid)  # (B, S, D), (B, S)
        return self.decode(tgt, memory, src_mask=memory_valid, only=only).logits  # (B, L, V) or (N, V)
