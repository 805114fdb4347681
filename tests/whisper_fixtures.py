"""The tiny random Whisper checkpoints the Whisper tests share (tests/test_whisper.py,
test_whisper_rules.py, test_word_timing.py, test_longform.py, test_serve_audio.py), built with
``transformers`` and saved with ``save_pretrained``; nothing is downloaded.

What is here: Whisper's tokenizer layout in small (a byte-level BPE trained on :data:`CORPUS`,
then <|endoftext|>, :data:`SPECIALS` and timestamps: :func:`whisper_tokenizer`), the model's
config (D=22 with H=2, F=37, two layers a stack, 80 mel bins, a 1 s chunk:
max_source_positions=50, and a decoder window of 29: :func:`tiny_config`), the two checkpoints
(:func:`hf_whisper`: English-only or multilingual, with two timestamps; :func:`stamped_whisper`:
the 51 timestamps of its chunk and a generation config whose suppressed tokens bite), the feature
extractor's features of waveforms (:func:`hf_features`) and greedy ``generate``'s new tokens with
Whisper's logits processors (:func:`generated`), and a checkpoint beside its qkv import
(:func:`imported`).

What is not here: the tests, and qkv's side of any comparison. Importing this module needs
``transformers``: a test file importorskips it first.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import (
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperTokenizer,
)

from qkv.hf.convert import import_hf
from test_hf import perturb

CORPUS = [
    "Hello world, this is a tiny corpus.",
    "The quick brown fox jumps over the lazy dog!",
    "Guten Tag, wie geht es?",
]
SPECIALS = [
    "<|startoftranscript|>",
    "<|en|>",
    "<|de|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nocaptions|>",
    "<|notimestamps|>",
]
TIMESTAMPS = ["<|0.00|>", "<|0.02|>"]  # added, not special, as in Whisper's files
STAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(51)]  # a 1 s chunk's timestamps
MAX_INITIAL = 7  # stamped_whisper's max_initial_timestamp_index


def whisper_tokenizer(timestamps: list[str] = TIMESTAMPS) -> WhisperTokenizer:
    """Whisper's layout in small: byte-level BPE, then <|endoftext|>, the special tokens, ``timestamps``."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 20, vocab_size=290, min_frequency=1, special_tokens=[])
    model = json.loads(bpe._tokenizer.to_str())["model"]
    tokenizer = WhisperTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])  # + <|endoftext|>
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.add_tokens(timestamps)
    tokenizer.pad_token = "<|endoftext|>"
    return tokenizer


def tokenizer_with_stamps() -> WhisperTokenizer:
    """:func:`stamped_whisper`'s tokenizer: every timestamp of its 1 s chunk."""
    return whisper_tokenizer(STAMPS)


def tiny_config(tokenizer: WhisperTokenizer, *, tied: bool) -> WhisperConfig:
    """The tiny Whisper's config for ``tokenizer``, its output tied to the embedding or not."""
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    end = tokenizer.eos_token_id
    return WhisperConfig(
        vocab_size=len(tokenizer),
        d_model=22,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        num_mel_bins=80,
        max_source_positions=50,
        max_target_positions=29,
        pad_token_id=end,
        bos_token_id=end,
        eos_token_id=end,
        decoder_start_token_id=start,
        suppress_tokens=[],
        begin_suppress_tokens=None,
        tie_word_embeddings=tied,
    )


def save_extractor(directory: Path) -> None:
    """Whisper's feature extractor of 1 s chunks, saved in ``directory``."""
    WhisperFeatureExtractor(feature_size=80, chunk_length=1).save_pretrained(directory)


def hf_features(directory: Path, waves: list[np.ndarray]) -> torch.Tensor:
    """The saved WhisperFeatureExtractor's features of ``waves``: (B, M, T)."""
    extractor = WhisperFeatureExtractor.from_pretrained(directory)
    return extractor(waves, sampling_rate=16000, return_tensors="pt").input_features


def hf_whisper(directory: Path, *, multilingual: bool, tied: bool = True) -> WhisperForConditionalGeneration:
    """A random WhisperForConditionalGeneration saved in ``directory`` with its tokenizer, feature
    extractor (1 s chunks) and generation config (English-only: no languages or tasks)."""
    tokenizer = whisper_tokenizer()
    ids = dict(zip(SPECIALS, tokenizer.convert_tokens_to_ids(SPECIALS), strict=True))
    config = tiny_config(tokenizer, tied=tied)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    perturb(model, 1)  # the encoder's sinusoids (frozen) stay
    generation = model.generation_config
    generation._from_model_config = False  # else from_pretrained rebuilds it from config.json, without these
    generation.is_multilingual = multilingual
    generation.no_timestamps_token_id = ids["<|notimestamps|>"]
    if multilingual:
        generation.lang_to_id = {"<|en|>": ids["<|en|>"], "<|de|>": ids["<|de|>"]}
        generation.task_to_id = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    save_extractor(directory)
    return model


def stamped_waves(n: int = 6) -> list[np.ndarray]:
    """``n`` noisy tones of 0.4 s, 0.5 s, ...: what :func:`stamped_whisper` chose its suppressed tokens on."""
    g = np.random.default_rng(11)
    out = []
    for i in range(n):
        samples = int((0.4 + 0.1 * i) * 16000)
        out.append((0.3 * np.sin(np.arange(samples) * (0.03 + 0.02 * i)) + g.normal(0, 0.05, samples)).astype("f4"))
    return out


def stamped_whisper(directory: Path) -> WhisperForConditionalGeneration:
    """A random English-only Whisper (untied output) with the 51 timestamps of its 1 s chunk,
    saved; its generation config's suppressed tokens are ones it writes when nothing is (on
    :func:`stamped_waves`), and its first timestamp is at most :data:`MAX_INITIAL`."""
    tokenizer = tokenizer_with_stamps()
    ids = dict(zip(SPECIALS, tokenizer.convert_tokens_to_ids(SPECIALS), strict=True))
    end = tokenizer.eos_token_id
    config = tiny_config(tokenizer, tied=False)
    torch.manual_seed(3)
    model = WhisperForConditionalGeneration(config).eval()
    perturb(model, 4)
    with torch.no_grad():  # timestamps likelier, so that pairs, runs and the probability rule all occur
        model.proj_out.weight[ids["<|notimestamps|>"] + 1 :] *= 2.5
    g = model.generation_config
    g._from_model_config = False
    g.is_multilingual, g.no_timestamps_token_id = False, ids["<|notimestamps|>"]
    g.max_initial_timestamp_index = MAX_INITIAL
    g.suppress_tokens, g.begin_suppress_tokens = None, None
    prefix = [config.decoder_start_token_id, ids["<|notimestamps|>"]]
    save_extractor(directory)
    rows = generated(model, hf_features(directory, stamped_waves()), prefix)  # nothing suppressed yet
    suppressed = [t for t, _ in Counter(t for row in rows for t in row).most_common(2)]
    firsts = [t for t, _ in Counter(row[0] for row in rows).most_common() if t not in suppressed]
    g.suppress_tokens, g.begin_suppress_tokens = suppressed, [*firsts[:1], end]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def new_tokens(rows: list[list[int]], prefix: list[int], end: int) -> list[list[int]]:
    """What ``generate`` wrote after ``prefix`` (checked to be where every row starts), up to END."""
    out = []
    for row in rows:
        assert row[: len(prefix)] == prefix, (row, prefix)
        new = row[len(prefix) :]
        out.append(new[: new.index(end)] if end in new else new)
    return out


def generated(model, feats: torch.Tensor, prefix: list[int], *, timestamps: bool = False) -> list[list[int]]:
    """Greedy ``generate`` from ``prefix`` with transformers' own processors of Whisper's rules (the
    generation config's suppressed tokens; with ``timestamps``, ``WhisperTimeStampLogitsProcessor``),
    one call (Whisper's ``generate`` would also seek on through the window by its timestamps)."""
    from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    g = model.generation_config
    processors = []
    if g.begin_suppress_tokens:
        processors.append(SuppressTokensAtBeginLogitsProcessor(g.begin_suppress_tokens, len(prefix)))
    if g.suppress_tokens:
        processors.append(SuppressTokensLogitsProcessor(g.suppress_tokens))
    if timestamps:
        processors.append(WhisperTimeStampLogitsProcessor(g, begin_index=len(prefix)))
    end = model.config.eos_token_id
    plain = GenerationConfig(max_new_tokens=25, do_sample=False, num_beams=1, eos_token_id=end, pad_token_id=end)
    start = torch.tensor([prefix] * feats.shape[0])
    with torch.no_grad():
        out = GenerationMixin.generate(
            model,
            feats,
            generation_config=plain,
            decoder_input_ids=start,
            logits_processor=LogitsProcessorList(processors),
        ).tolist()
    return new_tokens(out, prefix, end)


def imported(root: Path, build: Callable[[Path], WhisperForConditionalGeneration]) -> tuple:
    """``build(root / "hf")``'s checkpoint imported into ``root / "qkv"``: the HF model and both directories."""
    model = build(root / "hf")
    import_hf(root / "hf", root / "qkv")
    return model, root / "hf", root / "qkv"
