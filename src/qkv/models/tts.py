"""Text-to-speech: a Transformer whose decoder writes log-mel frames, r at a time (Transformer-TTS,
Li et al., 2019, "Neural Speech Synthesis with Transformer Network").

What is here: :class:`TTSConfig` and :class:`TransformerTTS`: a text encoder (token embedding,
a convolutional pre-net, scaled sinusoidal positions, the encoder stack of ``blocks.py``, an
optional speaker embedding added to its output), and a mel decoder (a pre-net of two ReLU layers
whose dropout stays on at inference, scaled positions, the decoder stack with masked
self-attention and cross-attention to the text, a linear head writing ``reduction`` frames per
step, a stop-token head, and a convolutional post-net that refines the whole spectrogram with a
residual). :func:`group_frames` / :func:`ungroup_frames` are the reduction-factor reshapes and
:func:`decoder_inputs` the frames the decoder reads (teacher forcing). The model returns
frames and logits, never losses.

The features are the un-normalised log-mel kind of ``qkv.audio`` (``features.normalize`` is
false: a vocoder must invert them); they are a field of the config, saved in ``config.json``.

What is not here: losses (``losses.py``: ``tts_loss``, ``guided_attention_loss``),
autoregressive synthesis with the KV cache (``synthesis.py``), the vocoder (``vocoder.py``).

Shapes use the legend of ``attention.py``: text (B, S) token ids, S positions; mel (B, T, M);
U = T / r decoder steps, r = ``reduction``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.audio import FeatureConfig
from qkv.blocks import BlockCache, BlockConfig, DecoderStack, EncoderStack, cache_length, check_fields
from qkv.layers import Dropout, dropout, sinusoidal_encoding


@dataclass(frozen=True)
class TTSConfig(BlockConfig):
    """A Transformer-TTS model: the per-block settings of :class:`BlockConfig` plus these.

    Attributes:
        vocab_size: input symbols V (characters or phonemes, specials included).
        n_encoder_layers, n_decoder_layers: blocks in each stack.
        features: the log-mel settings the model writes (``normalize`` must be false); M =
            ``features.n_mels``.
        reduction: r, frames written per decoder step (Tacotron's reduction factor; 2–4 make
            the decoder's sequence r times shorter, which is what lets alignment learn fast).
        encoder_convs: convolutions of the encoder pre-net (kernel 5, ReLU, dropout).
        prenet_dim: width of the decoder pre-net's two layers.
        prenet_dropout: the decoder pre-net's dropout, kept on at inference (Li et al., 2019,
            section 3.4, after Tacotron 2): without it the decoder copies its input frame.
        postnet_layers, postnet_channels: the post-net's 1-D convolutions (kernel 5, tanh).
        n_speakers: speakers with an embedding added to the encoder output (0: one voice).
        pad_id: the padding symbol.
        mel_mean, mel_std: the training frames' mean and standard deviation (one number each,
            over every bin): the model reads and writes frames scaled to (x − mean) / std, so
            the losses weigh loud and quiet bins alike and the go frame (zeros) is the mean.
            :meth:`TransformerTTS.scale` and :meth:`~TransformerTTS.unscale` convert.
    """

    vocab_size: int = 100
    n_encoder_layers: int = 4
    n_decoder_layers: int = 4
    features: FeatureConfig = field(default_factory=FeatureConfig)
    reduction: int = 2
    encoder_convs: int = 3
    prenet_dim: int = 256
    prenet_dropout: float = 0.5
    postnet_layers: int = 5
    postnet_channels: int = 256
    n_speakers: int = 0
    pad_id: int = 0
    mel_mean: float = 0.0
    mel_std: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", FeatureConfig.of(self.features))  # config.json holds a dict
        super().__post_init__()
        check_fields(
            self,
            positive_ints=("vocab_size", "n_encoder_layers", "n_decoder_layers", "reduction", "prenet_dim"),
        )
        for name in ("encoder_convs", "postnet_layers", "postnet_channels", "n_speakers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.postnet_layers == 1 or (self.postnet_layers and not self.postnet_channels):
            raise ValueError("postnet_layers must be 0 or at least 2, with postnet_channels > 0")
        if not 0.0 <= self.prenet_dropout < 1.0:
            raise ValueError(f"prenet_dropout must be in [0, 1), got {self.prenet_dropout!r}")
        if self.features.kind != "logmel" or self.features.normalize:
            raise ValueError(
                "features must be un-normalised log-mels (kind logmel, normalize false): a vocoder inverts them"
            )
        if isinstance(self.pad_id, bool) or not isinstance(self.pad_id, int) or not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id={self.pad_id!r} is outside the vocabulary")
        for name in ("mel_mean", "mel_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < float("inf"):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.mel_std <= 0:
            raise ValueError(f"mel_std must be positive, got {self.mel_std!r}")
        if self.positions not in ("sinusoidal", "sinusoidal_halves"):
            raise ValueError(
                f"positions must be sinusoidal or sinusoidal_halves for a TTS model, got {self.positions!r}"
            )


def group_frames(mel: Tensor, reduction: int) -> Tensor:
    """Frames in groups of r, one group per decoder step: (B, T, M) -> (B, T / r, r·M).

    T must be a multiple of r (pad first). :func:`ungroup_frames` is the inverse.
    """
    b, t, m = mel.shape
    if t % reduction:
        raise ValueError(f"{t} frames are not a multiple of the reduction factor {reduction}")
    return mel.reshape(b, t // reduction, reduction * m)  # (B, U, r·M)


def ungroup_frames(groups: Tensor, n_mels: int) -> Tensor:
    """The inverse of :func:`group_frames`: (B, U, r·M) -> (B, U·r, M)."""
    b, u, rm = groups.shape
    return groups.reshape(b, u * (rm // n_mels), n_mels)  # (B, T, M)


def decoder_inputs(mel: Tensor, reduction: int) -> Tensor:
    """What the decoder reads at each step under teacher forcing: the last frame of the previous
    group, and at step 0 an all-zero "go" frame (Tacotron; Li et al., 2019, section 3.4).

    Shapes: mel (B, T, M), T a multiple of r -> (B, T / r, M).
    """
    last = mel[:, reduction - 1 :: reduction]  # (B, U, M): each group's last frame
    return torch.cat([torch.zeros_like(last[:, :1]), last[:, :-1]], dim=1)  # (B, U, M)


class ScaledPositions(nn.Module):
    """x + α·PE with a trainable scalar α (Li et al., 2019, section 3.3: the text and the mel
    frames live on different scales, so each side learns how much position to add).

    Shapes: x (B, T, D), positions (T,) -> (B, T, D).
    """

    def __init__(self, halves: bool) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))
        self.halves = halves

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        pe = sinusoidal_encoding(positions, x.shape[-1], halves=self.halves).to(x.dtype)  # (T, D)
        return x + self.alpha * pe


class EncoderPrenet(nn.Module):
    """Convolutions over the embedded text (kernel 5, ReLU, dropout), then a linear projection
    (Li et al., 2019, section 3.2). Padding positions are zeroed before every convolution, so
    an utterance in a padded batch reads exactly what it reads alone.

    Shapes: x (B, S, D), valid (B, S) bool -> (B, S, D).
    """

    def __init__(self, d_model: int, n_convs: int, p: float) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(d_model, d_model, kernel_size=5, padding=2) for _ in range(n_convs))
        self.dropout = Dropout(p)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        keep = valid[:, None, :].to(x.dtype)  # (B, 1, S)
        h = x.transpose(1, 2)  # (B, D, S)
        for conv in self.convs:
            h = self.dropout(F.relu(conv(h * keep)))  # (B, D, S)
        return self.proj(h.transpose(1, 2))  # (B, S, D)


class DecoderPrenet(nn.Module):
    """Two ReLU layers with dropout that is on whenever ``always`` (inference included), then a
    projection to D (Li et al., 2019, section 3.4). ``keep``: the two layers' dropout
    multipliers given (each element 0 or 1 / (1 - p), as :func:`~qkv.layers.dropout` scales)
    instead of drawn, so that the draws are the caller's (an ONNX graph takes them as an input).

    Shapes: frames (B, U, M), keep (2, B, U, prenet_dim) -> (B, U, D).
    """

    def __init__(self, n_mels: int, width: int, d_model: int, p: float) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(n_mels, width)
        self.fc_2 = nn.Linear(width, width)
        self.proj = nn.Linear(width, d_model)
        self.p = p

    def forward(self, frames: Tensor, *, always: bool = True, keep: Tensor | None = None) -> Tensor:
        if keep is not None:
            h = F.relu(self.fc_1(frames)) * keep[0]  # (B, U, prenet_dim)
            return self.proj(F.relu(self.fc_2(h)) * keep[1])  # (B, U, D)
        on = always or self.training
        h = dropout(F.relu(self.fc_1(frames)), self.p, training=on)  # (B, U, prenet_dim)
        h = dropout(F.relu(self.fc_2(h)), self.p, training=on)  # (B, U, prenet_dim)
        return self.proj(h)  # (B, U, D)


class Postnet(nn.Module):
    """Five 1-D convolutions over the whole spectrogram (kernel 5, tanh but the last, dropout)
    whose output is added to the decoder's frames (Tacotron 2; Li et al., 2019, section 3.5).

    Shapes: mel (B, T, M), valid (B, T) bool -> (B, T, M).
    """

    def __init__(self, n_mels: int, channels: int, layers: int, p: float) -> None:
        super().__init__()
        sizes = [n_mels] + [channels] * (layers - 1) + [n_mels]
        self.convs = nn.ModuleList(nn.Conv1d(a, b, kernel_size=5, padding=2) for a, b in itertools.pairwise(sizes))
        self.dropout = Dropout(p)

    def forward(self, mel: Tensor, valid: Tensor) -> Tensor:
        keep = valid[:, None, :].to(mel.dtype)  # (B, 1, T)
        h = mel.transpose(1, 2)  # (B, M, T)
        for i, conv in enumerate(self.convs):
            h = conv(h * keep)  # (B, channels, T) or, the last, (B, M, T)
            if i < len(self.convs) - 1:
                h = self.dropout(torch.tanh(h))
        return mel + h.transpose(1, 2) * keep.transpose(1, 2)  # (B, T, M)


@dataclass
class TTSOutput:
    """One decoder pass: the frames it wrote (before the post-net), the stop logits, its cache,
    and the cross-attention weights of every block when asked.

    Shapes: mel (B, U·r, M); stop (B, U·r); weights: per block (B, H, U, S).
    """

    mel: Tensor
    stop: Tensor
    cache: list[BlockCache]
    weights: list[Tensor] | None


class TransformerTTS(nn.Module):
    """Text (or phonemes) in, log-mel frames out (scaled: :meth:`scale`, :meth:`unscale`).

    Shapes:
        text (B, S) ids; text_valid (B, S) bool; speakers (B,) ids or None;
        mel (B, T, M) with T a multiple of r (teacher forcing); mel_valid (B, T) bool.
    """

    def __init__(self, config: TTSConfig) -> None:
        super().__init__()
        self.config = c = config
        n_mels = c.features.n_mels
        halves = c.positions == "sinusoidal_halves"
        self.embed = nn.Embedding(c.vocab_size, c.d_model, padding_idx=c.pad_id)
        self.encoder_prenet = EncoderPrenet(c.d_model, c.encoder_convs, c.dropout)
        self.encoder_positions = ScaledPositions(halves)
        self.encoder_dropout = Dropout(c.dropout)
        self.encoder = EncoderStack(c, c.n_encoder_layers)
        self.speaker = nn.Embedding(c.n_speakers, c.d_model) if c.n_speakers else None
        self.decoder_prenet = DecoderPrenet(n_mels, c.prenet_dim, c.d_model, c.prenet_dropout)
        self.decoder_positions = ScaledPositions(halves)
        self.decoder_dropout = Dropout(c.dropout)
        self.decoder = DecoderStack(c, c.n_decoder_layers, cross_attention=True)
        self.mel_head = nn.Linear(c.d_model, c.reduction * n_mels)
        self.stop_head = nn.Linear(c.d_model, c.reduction)
        self.postnet = Postnet(n_mels, c.postnet_channels, c.postnet_layers, c.dropout) if c.postnet_layers else None

    def scale(self, mel: Tensor) -> Tensor:
        """Log-mel frames as the model reads and writes them: (x − mel_mean) / mel_std."""
        return (mel - self.config.mel_mean) / self.config.mel_std

    def unscale(self, frames: Tensor) -> Tensor:
        """The model's frames as log-mels again (what a vocoder inverts)."""
        return frames * self.config.mel_std + self.config.mel_mean

    def encode(self, text: Tensor, text_valid: Tensor | None = None, speakers: Tensor | None = None) -> Tensor:
        """The text's encoder output (the memory cross-attention reads), with the speaker's
        embedding added at every position.

        Shapes: text (B, S), text_valid (B, S) bool (None: all real), speakers (B,) -> (B, S, D).
        """
        if text_valid is None:
            text_valid = text != self.config.pad_id  # (B, S)
        if (speakers is None) != (self.speaker is None):
            raise ValueError("speakers are needed exactly when the model has speaker embeddings (n_speakers > 0)")
        positions = torch.arange(text.shape[1], device=text.device)  # (S,)
        x = self.encoder_prenet(self.embed(text), text_valid)  # (B, S, D)
        x = self.encoder_dropout(self.encoder_positions(x, positions))  # (B, S, D)
        memory = self.encoder(x, valid=text_valid, positions=positions)  # (B, S, D)
        if self.speaker is not None:
            memory = memory + self.speaker(speakers)[:, None, :]  # (B, S, D)
        return memory

    def decode(
        self,
        frames: Tensor,
        memory: Tensor,
        *,
        memory_valid: Tensor | None,
        cache: list[BlockCache] | None = None,
        need_weights: bool = False,
        prenet_dropout: bool = True,
        prenet_keep: Tensor | None = None,
    ) -> TTSOutput:
        """The next groups of frames from the frames read so far: each step reads one frame
        (:func:`decoder_inputs`) and writes r (``cache`` from an earlier call: ``frames`` holds
        only the new steps). ``prenet_dropout=False`` switches the pre-net's dropout off (for
        tests that compare two ways of decoding; synthesis keeps it on); ``prenet_keep``: its
        dropout multipliers given instead of drawn (:class:`DecoderPrenet`).

        Shapes: frames (B, U, M); memory (B, S, D); memory_valid (B, S);
        prenet_keep (2, B, U, prenet_dim) -> TTSOutput.
        """
        past = cache_length(cache)
        positions = torch.arange(past, past + frames.shape[1], device=frames.device)  # (U,)
        x = self.decoder_prenet(frames, always=prenet_dropout, keep=prenet_keep)  # (B, U, D)
        x = self.decoder_dropout(self.decoder_positions(x, positions))  # (B, U, D)
        x, cache, weights = self.decoder(
            x, positions=positions, memory=memory, memory_mask=memory_valid, cache=cache, need_weights=need_weights
        )  # (B, U, D)
        mel = ungroup_frames(self.mel_head(x), self.config.features.n_mels)  # (B, U·r, M)
        stop = self.stop_head(x).reshape(x.shape[0], -1)  # (B, U·r)
        return TTSOutput(mel, stop, cache, weights)

    def refine(self, mel: Tensor, valid: Tensor | None = None) -> Tensor:
        """The post-net's refined frames (the decoder's own when there is no post-net).

        Shapes: mel (B, T, M), valid (B, T) bool (None: all real) -> (B, T, M).
        """
        if self.postnet is None:
            return mel
        if valid is None:
            valid = torch.ones(mel.shape[:2], dtype=torch.bool, device=mel.device)  # (B, T)
        return self.postnet(mel, valid)

    def forward(
        self,
        text: Tensor,
        text_valid: Tensor,
        mel: Tensor,
        mel_valid: Tensor,
        speakers: Tensor | None = None,
        *,
        need_weights: bool = False,
        prenet_dropout: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor, list[Tensor] | None]:
        """Teacher-forced frames before and after the post-net, stop logits, and (with
        ``need_weights``) every decoder block's cross-attention.

        Shapes: -> mel (B, T, M), refined (B, T, M), stop (B, T), weights per block (B, H, U, S).
        """
        memory = self.encode(text, text_valid, speakers)  # (B, S, D)
        out = self.decode(
            decoder_inputs(mel, self.config.reduction),
            memory,
            memory_valid=text_valid,
            need_weights=need_weights,
            prenet_dropout=prenet_dropout,
        )
        return out.mel, self.refine(out.mel, mel_valid), out.stop, out.weights
