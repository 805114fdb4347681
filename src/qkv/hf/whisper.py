"""Whisper: ``WhisperForConditionalGeneration`` <-> qkv ``speech_encoder_decoder``, and its start tokens.

What is here: :func:`whisper_features` (``preprocessor_config.json`` -> qkv's
:class:`~qkv.audio.FeatureConfig`), :func:`whisper_fields` / :func:`whisper_config` (HF
``config.json`` <-> qkv config fields), :func:`whisper_to_qkv` / :func:`qkv_to_whisper` (weight
names), :func:`whisper_positions` (the stored encoder sinusoids, checked),
:func:`whisper_tokenizer`, :class:`WhisperSettings` (the ids of the decoder's start tokens, read
by :func:`whisper_settings`), the HF files export writes where an import kept none
(:func:`whisper_generation_config`, :func:`whisper_preprocessor_config`), and what transcription
uses: :func:`start_tokens` and :func:`detect_language` (and, for settings already read with
:func:`settings_in`, :meth:`WhisperSettings.prefix` and :func:`most_likely_languages`). What is not: import and export
themselves (``convert.py``), what the families share (``common.py``), the features
(``audio.py``), the model (``models/speech.py``) and decoding (``decoding/``, whose
``prefix`` takes :func:`start_tokens`).

The model (Radford et al., 2022): two Conv1d with GELU, Whisper's sinusoids on the encoder,
learned decoder positions, pre-norm LayerNorm (eps 1e-5) with a final norm on each stack, an
exact-GELU feed-forward, biases everywhere but the key projections, and the output tied to the
decoder's token embedding (``proj_out`` where ``tie_word_embeddings`` is false). The checkpoint's
encoder positions (``model.encoder.embed_positions.weight``) must be Whisper's sinusoids, which
qkv computes itself, to within 1e-3: OpenAI published float16 weights, whose rounded table HF
computes with, so on such a checkpoint logits differ by more than float32 rounding (whisper-tiny.en
on 30 s of speech: 6e-3 of logits near 27; the greedy transcript the same). HF's encoder
reads exactly 2 · ``max_source_positions`` frames (3,000: 30 s); qkv's Whisper features are cut
or padded to one chunk of that many frames, so the model's ``features.chunk_seconds`` is their
duration. Dropped (training or other heads only): ``activation_dropout``, layer drop,
SpecAugment's settings, ``use_weighted_layer_sum`` and ``classifier_proj_size``. Not supported:
different encoder and decoder head counts or feed-forward widths (qkv's stacks share them), an
odd ``d_model``.

The features: ``preprocessor_config.json`` (WhisperFeatureExtractor's settings) gives the mel
bins, sampling rate, FFT size, hop and chunk; without it, Whisper's (16 kHz, 400, 160) and the
chunk ``max_source_positions`` implies. Its ``dither`` (noise added to the waveform) is not
reproduced, and said so in the summary's notes.

The tokenizer: ``tokenizer.json`` as it is (byte-level BPE, Whisper's special tokens added).
Padding, END and unknown are <|endoftext|> (or what ``tokenizer_config.json`` names); BEGIN is
the decoder's start token, <|startoftranscript|> (the token of ``decoder_start_token_id``).
Decoding drops special tokens; timestamp tokens (<|1.20|>, which HF's files do not mark
special) decode as their text. Without ``tokenizer.json`` (only ``vocab.json`` and
``merges.txt``) nothing is converted. HF's files (:data:`WHISPER_FILES`: tokenizer_config.json,
generation_config.json, preprocessor_config.json, ...) are kept in the qkv directory, with their
SHA-256, for export to write back.

Start tokens: the decoder starts from <|startoftranscript|>; a multilingual model then reads a
language token (<|de|>) and a task token (<|transcribe|> or <|translate|>), an English-only one
(``.en``) neither; then <|notimestamps|> unless timestamps are asked for. The ids come from
``generation_config.json`` (``is_multilingual``, ``lang_to_id``, ``task_to_id``,
``no_timestamps_token_id``; where it lacks them, from the tokenizer's tokens) and are stored in
the qkv model's ``config.json`` under ``"whisper"`` (:class:`WhisperSettings`), with what
transcription applies as HF's ``generate`` does (``decoding/whisper_rules.py``): the
``suppress_tokens`` and ``begin_suppress_tokens`` it masks and the latest first timestamp
(``max_initial_timestamp_index``), and the ``alignment_heads`` word timestamps read
(``word_timing.py``). Long-form transcription, previous-text prompts and
temperature fallback are ``longform.py``'s.

Shapes: features (T, M) per input, as ``decoding/`` takes them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qkv.audio import FeatureConfig, pad_features
from qkv.checkpoint import model_dir, read_meta
from qkv.decoding import Scorer, whisper_scorers
from qkv.errors import UserError
from qkv.files import read_json_object
from qkv.hf.common import (
    HF_CONFIG,
    TOKENIZER_CONFIG,
    HFConfig,
    State,
    TokenizerSettings,
    hf_activation,
    linear,
    load_tokenizer,
    qkv_tokenizer,
    require,
    same_heads,
)
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder, whisper_sinusoids
from qkv.tokenization import FILE, Tokenizer

WHISPER = ("WhisperForConditionalGeneration",)
GENERATION_CONFIG = "generation_config.json"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
# HF's files an import keeps for export to write back (tokenizer.json becomes qkv's own).
WHISPER_FILES = (
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "added_tokens.json",
    "normalizer.json",
    GENERATION_CONFIG,
    PREPROCESSOR_CONFIG,
)
WHISPER_FIELD = "whisper"  # the qkv model's config.json key holding WhisperSettings.record()
TASKS = ("transcribe", "translate")
LANGUAGE_TOKEN = re.compile(r"<\|([a-z]{2,3})\|>")  # <|en|>, <|haw|>; not <|nocaptions|>
# HF's rule for a checkpoint that does not say: the multilingual vocabulary has 51,865 tokens
# or more, the English-only one 51,864.
MULTILINGUAL_VOCAB = 51865
# Whisper's feature extractor, where preprocessor_config.json does not say otherwise.
SAMPLE_RATE, N_FFT, HOP = 16000, 400, 160
MEL_TOP = 8000.0  # WhisperFeatureExtractor's mel filters end at 8 kHz whatever the rate


def whisper_features(directory: Path, config: HFConfig) -> tuple[FeatureConfig, list[str]]:
    """The features a Whisper checkpoint reads, and notes on what qkv does not reproduce
    (``dither``): from ``preprocessor_config.json`` where there is one, else Whisper's."""
    n_mels = config.integer("num_mel_bins", 80)
    frames = 2 * config.integer("max_source_positions", 1500)  # what the encoder reads
    path = directory / PREPROCESSOR_CONFIG
    notes: list[str] = []
    if path.is_file():
        pre = HFConfig(path, read_json_object(path))
        if pre.integer("feature_size", n_mels) != n_mels:
            raise UserError(
                f"{path}: field 'feature_size' is {pre.fields['feature_size']!r}, but {HF_CONFIG}'s "
                f"num_mel_bins is {n_mels}"
            )
        rate, n_fft = pre.integer("sampling_rate", SAMPLE_RATE), pre.integer("n_fft", N_FFT)
        hop, chunk = pre.integer("hop_length", HOP), pre.integer("chunk_length", 30)
        if chunk * rate // hop != frames:
            raise UserError(
                f"{path}: chunk_length={chunk} s gives {chunk * rate // hop} frames, but the encoder reads "
                f"{frames} ({HF_CONFIG}: max_source_positions={frames // 2})"
            )
        if pre.number("dither", 0.0) != 0.0:
            notes.append(f"{path}: dither={pre.fields['dither']} (noise added to the waveform) is not reproduced")
        where = path
    else:
        rate, n_fft, hop, chunk, where = SAMPLE_RATE, N_FFT, HOP, frames * HOP / SAMPLE_RATE, config.path
    try:
        features = dataclasses.replace(
            FeatureConfig.whisper(n_mels),
            sample_rate=rate,
            n_fft=n_fft,
            win_length=n_fft,
            hop_length=hop,
            chunk_seconds=float(chunk),
            f_max=None if rate / 2 == MEL_TOP else MEL_TOP,
        )
    except ValueError as e:
        raise UserError(f"{where}: these feature settings are not supported: {e}") from None
    return features, notes


def whisper_fields(config: HFConfig, features: FeatureConfig) -> dict:
    """The qkv ``speech_encoder_decoder`` fields of a Whisper config.json reading ``features``."""
    n_heads, d_ff = config.integer("encoder_attention_heads", 6), config.integer("encoder_ffn_dim", 1536)
    if config.integer("decoder_attention_heads", 6) != n_heads:
        raise config.refuse("decoder_attention_heads", f"qkv's stacks share one head count, here {n_heads}")
    if config.integer("decoder_ffn_dim", 1536) != d_ff:
        raise config.refuse("decoder_ffn_dim", f"qkv's stacks share one feed-forward width, here {d_ff}")
    d_model = config.integer("d_model", 384)
    if d_model % 2:
        raise config.refuse("d_model", "Whisper's encoder sinusoids need an even width")
    vocab = config.integer("vocab_size", 51865)
    ids = {}
    for name, default in (("pad_token_id", 50256), ("decoder_start_token_id", 50257), ("eos_token_id", 50256)):
        ids[name] = config.token_id(name, default, vocab)
        if ids[name] is None:
            raise UserError(f"{config.path}: field {name!r} must be a token id, got null")
    return {
        "d_model": d_model,
        "n_heads": n_heads,
        "d_ff": d_ff,
        "activation": config.activation("activation_function", "gelu"),
        "norm": "layernorm",
        "norm_eps": 1e-5,  # Whisper's LayerNorms keep torch's default epsilon
        "norm_first": True,
        "positions": "learned",
        "max_len": config.integer("max_target_positions", 448),
        "dropout": config.number("dropout", 0.0),
        "attention_dropout": config.number("attention_dropout", 0.0),
        "bias": True,
        "vocab_size": vocab,
        "n_encoder_layers": config.integer("encoder_layers", 4),
        "n_decoder_layers": config.integer("decoder_layers", 4),
        "features": features.to_dict(),
        "frontend": "whisper",
        "encoder_positions": "whisper",
        "scale_embeddings": config.flag("scale_embedding", False),
        "tie_output": config.flag("tie_word_embeddings", True),
        "key_bias": False,
        "ctc": False,
        "pad_id": ids["pad_token_id"],
        "bos_id": ids["decoder_start_token_id"],
        "eos_id": ids["eos_token_id"],
    }


def _whisper_names(config: SpeechConfig) -> list[tuple[str, str]]:
    """(qkv name, HF name) of every Whisper tensor but the encoder's sinusoids."""
    names: list[tuple[str, str]] = []
    linear(names, "frontend.conv_1", "model.encoder.conv1")
    linear(names, "frontend.conv_2", "model.encoder.conv2")
    names += [
        ("embed.token.weight", "model.decoder.embed_tokens.weight"),
        ("embed.position.weight", "model.decoder.embed_positions.weight"),
    ]
    if not config.tie_output:
        names.append(("output.weight", "proj_out.weight"))
    attention = (("w_q", "q_proj"), ("w_k", "k_proj"), ("w_v", "v_proj"), ("w_o", "out_proj"))
    for stack, n_layers in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        for i in range(n_layers):
            q, h = f"{stack}.blocks.{i}", f"model.{stack}.layers.{i}"
            sublayers = [("self_attn", "self_attn")] + ([("cross_attn", "encoder_attn")] if stack == "decoder" else [])
            for mine, theirs in sublayers:
                for w, p in attention:
                    linear(names, f"{q}.{mine}.{w}", f"{h}.{theirs}.{p}", bias=w != "w_k")  # Whisper's keys: no bias
            linear(names, f"{q}.norm_1", f"{h}.self_attn_layer_norm")
            if stack == "decoder":
                linear(names, f"{q}.norm_2", f"{h}.encoder_attn_layer_norm")
            linear(names, f"{q}.ffn.w_1", f"{h}.fc1")
            linear(names, f"{q}.ffn.w_2", f"{h}.fc2")
            linear(names, f"{q}.norm_{3 if stack == 'decoder' else 2}", f"{h}.final_layer_norm")
        linear(names, f"{stack}.norm", f"model.{stack}.layer_norm")
    return names


ENCODER_POSITIONS = "model.encoder.embed_positions.weight"


def whisper_to_qkv(tensors: Mapping[str, Tensor], config: SpeechConfig) -> State:
    """qkv ``speech_encoder_decoder`` weights from Whisper tensors (named as :func:`qkv_to_whisper`
    writes them; the encoder's sinusoids, which qkv computes, are checked by :func:`whisper_positions`)."""
    return {mine: tensors[theirs] for mine, theirs in _whisper_names(config)}


def qkv_to_whisper(state: Mapping[str, Tensor], config: SpeechConfig) -> State:
    """Whisper tensors from qkv ``speech_encoder_decoder`` weights, the encoder's sinusoids included
    (a parameter in HF's model, which it loads rather than computes)."""
    tensors = {theirs: state[mine] for mine, theirs in _whisper_names(config)}
    positions = _source_positions(config)
    tensors[ENCODER_POSITIONS] = whisper_sinusoids(torch.arange(positions), config.d_model)  # (S, D)
    return tensors


def _source_positions(config: SpeechConfig) -> int:
    """HF's ``max_source_positions``: the encoder frames of one chunk of features."""
    return (config.features.frames(0) + 1) // 2


def whisper_positions(tensors: Mapping[str, Tensor], file: Path) -> None:
    """The checkpoint's encoder positions must be Whisper's sinusoids, which qkv computes itself
    (to within fp16 rounding: checkpoints are often stored in half precision)."""
    stored = tensors[ENCODER_POSITIONS].float()  # (S, D)
    computed = whisper_sinusoids(torch.arange(stored.shape[0]), stored.shape[1])  # (S, D)
    if (stored - computed).abs().max() > 1e-3:
        raise UserError(f"{file}: tensor {ENCODER_POSITIONS!r} is not Whisper's sinusoids, which qkv computes itself")


def whisper_config(config: SpeechConfig, settings: WhisperSettings) -> dict:
    """The HF config.json of a speech model that computes what Whisper computes (else a UserError)."""
    target = "Whisper"
    require(
        config,
        target,
        {
            "frontend": "whisper",
            "encoder_positions": "whisper",
            "positions": "learned",
            "norm_first": True,
            "norm": "layernorm",
            "bias": True,
            "key_bias": False,
            "ctc": False,
            "attention": "softmax",
        },
    )
    same_heads(config, target)
    if abs(config.norm_eps - 1e-5) > 1e-12:
        raise UserError(f"cannot export as Whisper: its LayerNorms use eps=1e-05, this model has {config.norm_eps}")
    _check_features(config.features)
    return {
        "architectures": list(WHISPER),
        "model_type": "whisper",
        "vocab_size": config.vocab_size,
        "num_mel_bins": config.features.n_mels,
        "d_model": config.d_model,
        "encoder_layers": config.n_encoder_layers,
        "decoder_layers": config.n_decoder_layers,
        "encoder_attention_heads": config.n_heads,
        "decoder_attention_heads": config.n_heads,
        "encoder_ffn_dim": config.d_ff,
        "decoder_ffn_dim": config.d_ff,
        "activation_function": hf_activation(config.activation, target),
        "dropout": config.dropout,
        "attention_dropout": config.attention_dropout,
        "activation_dropout": 0.0,
        "max_source_positions": _source_positions(config),
        "max_target_positions": config.max_len,
        "scale_embedding": config.scale_embeddings,
        "tie_word_embeddings": config.tie_output,
        "pad_token_id": config.pad_id,
        "bos_token_id": config.eos_id,  # Whisper's bos_token is <|endoftext|>; decoding starts from decoder_start
        "eos_token_id": config.eos_id,
        "decoder_start_token_id": config.bos_id,
        "suppress_tokens": list(settings.suppress_tokens),
        "begin_suppress_tokens": list(settings.begin_suppress_tokens) or None,
        "is_encoder_decoder": True,
    }


def _check_features(features: FeatureConfig) -> None:
    """Refuse features WhisperFeatureExtractor does not compute."""
    why = None
    if features.kind != "whisper":
        why = f"features.kind={features.kind!r} (Whisper's log-mel is 'whisper')"
    elif features.normalize or features.f_min != 0.0 or features.f_max not in (None, MEL_TOP):
        why = "its features normalize or change the mel band"
    elif features.f_max is None and features.sample_rate / 2 != MEL_TOP:
        why = f"its mel filters end at {features.sample_rate / 2:g} Hz; WhisperFeatureExtractor's at 8 kHz"
    elif not float(features.chunk_seconds).is_integer():
        why = f"features.chunk_seconds={features.chunk_seconds} is not whole seconds (chunk_length)"
    elif features.frames(0) % 2:
        why = f"its chunk has {features.frames(0)} frames; Whisper's encoder reads an even number"
    if why is not None:
        raise UserError(f"cannot export as Whisper: {why}")


def whisper_preprocessor_config(features: FeatureConfig) -> dict:
    """WhisperFeatureExtractor's ``preprocessor_config.json`` for ``features``."""
    _check_features(features)
    chunk = int(features.chunk_seconds)
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": features.n_mels,
        "sampling_rate": features.sample_rate,
        "hop_length": features.hop_length,
        "n_fft": features.n_fft,
        "chunk_length": chunk,
        "n_samples": chunk * features.sample_rate,
        "nb_max_frames": chunk * features.sample_rate // features.hop_length,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
        "dither": 0.0,
    }


# ---------------------------------------------------------------------- tokenizer and start tokens


WHISPER_ROLES = {
    "pad": ("pad_token", "<|endoftext|>"),
    "eos": ("eos_token", "<|endoftext|>"),
    "unk": ("unk_token", "<|endoftext|>"),
}


def whisper_tokenizer(directory: Path, config: SpeechConfig) -> tuple[Tokenizer, Path] | None:
    """Whisper's ``tokenizer.json`` with its roles (BEGIN: the token of the decoder's start id)
    and the file; None without that file."""
    path = directory / FILE
    if not path.is_file():
        return None
    tokenizer = load_tokenizer(path, TokenizerSettings(directory), WHISPER_ROLES)
    start = tokenizer.backend.id_to_token(config.bos_id)
    if start is None:
        raise UserError(f"{path} has no token {config.bos_id} ({HF_CONFIG}'s decoder_start_token_id)")
    return qkv_tokenizer(path, tokenizer.backend, {**tokenizer.specials, "bos": start}), path


@dataclass(frozen=True)
class WhisperSettings:
    """The ids of the tokens a Whisper decoder starts from (besides BEGIN, the model's
    ``bos_id``), as a qkv model directory's config.json holds them under ``"whisper"``.

    Attributes:
        multilingual: whether the decoder reads a language and a task token.
        languages: language code ("de") -> the id of its token (<|de|>).
        tasks: "transcribe" / "translate" -> the id of its token.
        no_timestamps_id: <|notimestamps|>'s id (None: the model has no such token).
        suppress_tokens, begin_suppress_tokens: what HF's ``generate`` masks (always, and at
            the first step), as transcription does.
        max_initial_timestamp: the latest first timestamp, in 20 ms steps (generation_config's
            ``max_initial_timestamp_index``; None: any).
        alignment_heads: the (decoder layer, head) pairs whose cross-attention follows the
            speech, which word timestamps read (generation_config's ``alignment_heads``; empty:
            none named, and every head of the upper half of the layers is read, as openai/whisper does).
    """

    multilingual: bool = False
    languages: Mapping[str, int] = dataclasses.field(default_factory=dict)
    tasks: Mapping[str, int] = dataclasses.field(default_factory=dict)
    no_timestamps_id: int | None = None
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    max_initial_timestamp: int | None = None
    alignment_heads: tuple[tuple[int, int], ...] = ()

    def record(self) -> dict:
        """As config.json holds it."""
        return {
            "multilingual": self.multilingual,
            "languages": dict(self.languages),
            "tasks": dict(self.tasks),
            "no_timestamps_id": self.no_timestamps_id,
            "suppress_tokens": list(self.suppress_tokens),
            "begin_suppress_tokens": list(self.begin_suppress_tokens),
            "max_initial_timestamp": self.max_initial_timestamp,
            "alignment_heads": [list(pair) for pair in self.alignment_heads],
        }

    @staticmethod
    def from_record(record: object, path: Path, vocab_size: int) -> WhisperSettings:
        """The settings in config.json's ``"whisper"`` (``path``: that file); a UserError names
        the field that is wrong."""
        where = f"{path}: field '{WHISPER_FIELD}'"
        if not isinstance(record, dict):
            raise UserError(f"{where} must be a JSON object")
        unknown = sorted(set(record) - {f.name for f in dataclasses.fields(WhisperSettings)})
        if unknown:
            raise UserError(f"{where} has unknown setting(s) {', '.join(unknown)}")

        def ids(name: str, value: object) -> None:
            values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
            if not all(type(v) is int and 0 <= v < vocab_size for v in values):
                raise UserError(f"{where}: {name!r} must hold token ids in [0, {vocab_size}), got {value!r}")

        languages, tasks = record.get("languages", {}), record.get("tasks", {})
        for name, value in (("languages", languages), ("tasks", tasks)):
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise UserError(f"{where}: {name!r} must map names to token ids")
            ids(name, value)
        if not set(tasks) <= set(TASKS):
            raise UserError(f"{where}: 'tasks' may name {' and '.join(TASKS)}, got {', '.join(sorted(tasks))}")
        lists = {}
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            lists[name] = record.get(name, [])
            if not isinstance(lists[name], list):
                raise UserError(f"{where}: {name!r} must be a list of token ids")
            ids(name, lists[name])
        multilingual, no_timestamps = record.get("multilingual", False), record.get("no_timestamps_id")
        if not isinstance(multilingual, bool):
            raise UserError(f"{where}: 'multilingual' must be true or false, got {multilingual!r}")
        if no_timestamps is not None:
            ids("no_timestamps_id", no_timestamps)
        initial = record.get("max_initial_timestamp")
        if initial is not None and (type(initial) is not int or initial < 0):
            raise UserError(f"{where}: 'max_initial_timestamp' must be a number of steps >= 0, got {initial!r}")
        return WhisperSettings(
            multilingual,
            languages,
            tasks,
            no_timestamps,
            tuple(lists["suppress_tokens"]),
            tuple(lists["begin_suppress_tokens"]),
            initial,
            alignment_heads(record.get("alignment_heads", []), where),
        )

    def scorers(self, *, eos: int, timestamps: bool = False) -> list[Scorer]:
        """Whisper's decoding rules as scorers (``decoding.whisper_scorers``): the suppressed
        tokens, and with ``timestamps`` the timestamp rules (timestamps follow <|notimestamps|>)."""
        return whisper_scorers(
            eos=eos,
            suppress=self.suppress_tokens,
            begin_suppress=self.begin_suppress_tokens,
            no_timestamps=self.no_timestamps_id,
            timestamps=timestamps,
            max_initial=self.max_initial_timestamp,
        )

    def prefix(self, start_id: int, *, language: str | None, task: str, timestamps: bool, where: Path) -> list[int]:
        """The start tokens (see :func:`start_tokens`); ``where`` is named in errors."""
        tokens = [start_id]
        if not self.multilingual:
            if language is not None or task != "transcribe":
                asked = f"language {language!r}" if language is not None else f"task {task!r}"
                raise UserError(f"{where}: the model is English-only (it transcribes English); {asked} is not possible")
        else:
            if language is None:
                raise UserError(
                    f"{where}: the model is multilingual: give a language ({', '.join(self.languages) or 'none known'})"
                    " or detect it"
                )
            token = LANGUAGE_TOKEN.fullmatch(language)  # "<|de|>" names "de"
            code = token.group(1) if token else language
            if code not in self.languages:
                raise UserError(
                    f"{where}: unknown language {language!r}; the model knows {', '.join(self.languages) or 'none'}"
                )
            if task not in self.tasks:
                raise UserError(f"{where}: unknown task {task!r}; the model knows {', '.join(self.tasks) or 'none'}")
            tokens += [self.languages[code], self.tasks[task]]
        if not timestamps and self.no_timestamps_id is not None:
            tokens.append(self.no_timestamps_id)
        return tokens


def whisper_settings(
    directory: Path, config: HFConfig, model: SpeechConfig, tokenizer: Tokenizer | None
) -> tuple[WhisperSettings, list[str]]:
    """The start-token settings and decoding rules of the checkpoint in ``directory``
    (generation_config.json's, else config.json's, else the tokenizer's tokens), and notes (none)."""
    path = directory / GENERATION_CONFIG
    generation = HFConfig(path, read_json_object(path) if path.is_file() else {})
    vocab = model.vocab_size

    def named_ids(name: str, pattern: re.Pattern | None) -> dict[str, int]:
        value = generation.fields.get(name) or {}
        if not isinstance(value, dict) or not all(type(v) is int and 0 <= v < vocab for v in value.values()):
            raise UserError(f"{path}: field {name!r} must map tokens to ids in [0, {vocab})")
        if pattern is None:
            return dict(value)
        named = {k: v for k, v in value.items() if isinstance(k, str) and pattern.fullmatch(k)}
        if len(named) != len(value):
            raise UserError(f"{path}: field {name!r} must map language tokens such as '<|en|>' to ids")
        return {pattern.fullmatch(k).group(1): v for k, v in sorted(named.items(), key=lambda kv: kv[1])}  # by id

    languages, tasks = named_ids("lang_to_id", LANGUAGE_TOKEN), named_ids("task_to_id", None)
    if not set(tasks) <= set(TASKS):
        raise UserError(f"{path}: field 'task_to_id' may name {' and '.join(TASKS)}, got {', '.join(sorted(tasks))}")
    if generation.fields.get("is_multilingual") is not None:
        multilingual = generation.flag("is_multilingual", False)
    elif "lang_to_id" in generation.fields:
        multilingual = bool(languages)
    else:
        multilingual = vocab >= MULTILINGUAL_VOCAB
    # Where an older generation config lacks them: the tokenizer's added tokens (<|de|>, <|translate|>).
    added = tokenizer.backend.get_added_tokens_decoder() if tokenizer is not None else {}
    vocabulary = {token.content: i for i, token in added.items() if i < vocab}
    if multilingual and not languages:
        languages = {
            m.group(1): i
            for t, i in sorted(vocabulary.items(), key=lambda kv: kv[1])
            if (m := LANGUAGE_TOKEN.fullmatch(t))
        }
    if multilingual and not tasks:
        tasks = {t: vocabulary[f"<|{t}|>"] for t in TASKS if f"<|{t}|>" in vocabulary}
    no_timestamps = generation.token_id("no_timestamps_token_id", None, vocab)
    if no_timestamps is None:
        no_timestamps = vocabulary.get("<|notimestamps|>")
    lists = {}
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        source = generation if generation.fields.get(name) is not None else config
        value = source.fields.get(name) or []
        if not isinstance(value, list) or not all(type(v) is int and 0 <= v < vocab for v in value):
            raise UserError(f"{source.path}: field {name!r} must be a list of token ids in [0, {vocab})")
        lists[name] = tuple(value)
    initial = generation.fields.get("max_initial_timestamp_index")
    if initial is not None and (type(initial) is not int or initial < 0):
        raise UserError(f"{path}: field 'max_initial_timestamp_index' must be an integer >= 0, got {initial!r}")
    settings = WhisperSettings(
        multilingual,
        languages,
        tasks,
        no_timestamps,
        lists["suppress_tokens"],
        lists["begin_suppress_tokens"],
        initial,
        alignment_heads(generation.fields.get("alignment_heads") or [], str(path)),
    )
    return settings, []


def alignment_heads(value: object, where: str) -> tuple[tuple[int, int], ...]:
    """(layer, head) pairs from a JSON list of two-integer lists; a UserError (naming ``where``)
    for anything else. Whether the model has such heads is checked where they are read."""
    pairs = value if isinstance(value, list) else [None]
    if not all(isinstance(p, list) and len(p) == 2 and all(type(i) is int and i >= 0 for i in p) for p in pairs):
        raise UserError(f"{where}: 'alignment_heads' must be a list of [layer, head] pairs, got {value!r}")
    return tuple((layer, head) for layer, head in pairs)


def whisper_generation_config(config: SpeechConfig, settings: WhisperSettings) -> dict:
    """A ``generation_config.json`` that starts HF's ``generate`` as :func:`start_tokens` starts qkv."""
    generation = {
        "decoder_start_token_id": config.bos_id,
        "bos_token_id": config.eos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
        "max_length": config.max_len,
        "is_multilingual": settings.multilingual,
        "suppress_tokens": list(settings.suppress_tokens),
        "begin_suppress_tokens": list(settings.begin_suppress_tokens) or None,
    }
    if settings.multilingual:
        generation["lang_to_id"] = {f"<|{code}|>": i for code, i in settings.languages.items()}
        generation["task_to_id"] = dict(settings.tasks)
    if settings.no_timestamps_id is not None:
        generation["no_timestamps_token_id"] = settings.no_timestamps_id
    if settings.max_initial_timestamp is not None:
        generation["max_initial_timestamp_index"] = settings.max_initial_timestamp
    if settings.alignment_heads:
        generation["alignment_heads"] = [list(pair) for pair in settings.alignment_heads]
    return generation


def _settings_of(directory: str | Path) -> tuple[WhisperSettings, dict, Path]:
    """A model directory's Whisper settings, its config.json contents and that file's path."""
    directory = model_dir(directory)
    meta, path = read_meta(directory), directory / HF_CONFIG
    return settings_in(meta, path), meta, path


def settings_in(meta: dict, path: Path) -> WhisperSettings:
    """The Whisper settings in ``meta``, the contents of a model directory's config.json (read
    from ``path``, which errors name); a UserError where it holds none or bad ones."""
    if meta.get("kind") != "speech_encoder_decoder" or WHISPER_FIELD not in meta:
        raise UserError(
            f"{path} has no {WHISPER_FIELD!r} settings: it is not a Whisper model imported with qkv import-hf"
        )
    vocab = meta["config"].get("vocab_size")
    if type(vocab) is not int or vocab < 1:
        raise UserError(f"{path}: config field 'vocab_size' must be a positive integer")
    return WhisperSettings.from_record(meta[WHISPER_FIELD], path, vocab)


def start_tokens(
    directory: str | Path, *, language: str | None = None, task: str = "transcribe", timestamps: bool = False
) -> list[int]:
    """The tokens an imported Whisper model in ``directory`` starts decoding from (``prefix`` of
    :func:`~qkv.decoding.greedy` and :func:`~qkv.decoding.beam_search`).

    <|startoftranscript|>; for a multilingual model the language's token (``language``: a code
    such as "de" or the token "<|de|>"; required: :func:`detect_language` finds one) and the
    task's (``task``: "transcribe" or "translate"); then <|notimestamps|> unless
    ``timestamps``. An English-only model takes no language and only the task "transcribe".
    A language or task the model does not know is a UserError naming it and listing the known.
    """
    settings, meta, path = _settings_of(directory)
    start = meta["config"].get("bos_id")
    if type(start) is not int:
        raise UserError(f"{path}: config field 'bos_id' must be a token id")
    return settings.prefix(start, language=language, task=task, timestamps=timestamps, where=path)


@torch.no_grad()
def detect_language(model: SpeechEncoderDecoder, inputs: list[Tensor], directory: str | Path) -> list[str]:
    """Each input's most likely language code, as Whisper (and HF's ``detect_language``) finds
    it: the language token the decoder ranks highest right after <|startoftranscript|>.
    ``directory`` is the model's (its known languages). A UserError for an English-only model.

    Shapes: inputs B tensors (T, M) -> B codes.
    """
    settings, _, path = _settings_of(directory)
    return most_likely_languages(model, inputs, settings, where=path)


@torch.no_grad()
def most_likely_languages(
    model: SpeechEncoderDecoder, inputs: list[Tensor], settings: WhisperSettings, *, where: Path
) -> list[str]:
    """:func:`detect_language` with the model's settings already read (``where``: their file).

    Shapes: inputs B tensors (T, M) -> B codes.
    """
    if not settings.multilingual or not settings.languages:
        raise UserError(f"{where}: the model is English-only; it has no languages to detect")
    device = next(model.parameters()).device
    features, valid = pad_features([f.to(device) for f in inputs])  # (B, T, M), (B, T)
    memory, memory_valid = model.encode(features, valid)  # (B, S, D), (B, S)
    start = torch.full((len(inputs), 1), model.config.bos_id, dtype=torch.long, device=memory.device)  # (B, 1)
    logits = model.decode(start, memory, src_mask=memory_valid).logits[:, -1]  # (B, V)
    codes = list(settings.languages)
    ids = torch.tensor([settings.languages[c] for c in codes], device=logits.device)  # (languages,)
    return [codes[i] for i in logits[:, ids].argmax(-1).tolist()]
