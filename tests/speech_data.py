"""Tiny speech corpora written in a test: "words" that are tone bursts, so a few-step model can
learn them. Shared by the speech task's, the resume and the command-line tests."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import soundfile

RATE = 16_000
TONES = {"do": 300.0, "mi": 700.0, "so": 1500.0, "ti": 3000.0}  # one pitch a word, mel bins apart


def tone_words(words: list[str], *, rng: random.Random, pitch: float = 1.0) -> np.ndarray:
    """A waveform saying ``words``: each a 0.12–0.18 s tone of its own pitch (times ``pitch``: a
    lower or higher voice), silences between."""
    parts = [np.zeros(int(RATE * rng.uniform(0.03, 0.08)))]
    for word in words:
        n = int(RATE * rng.uniform(0.12, 0.18))
        t = np.arange(n) / RATE
        parts.append(0.3 * np.sin(2 * np.pi * pitch * TONES[word] * t) * np.hanning(n))
        parts.append(np.zeros(int(RATE * rng.uniform(0.03, 0.08))))
    return np.concatenate(parts).astype(np.float32)


def tone_corpus(
    directory: Path, *, utterances: int = 12, seed: int = 0, speaker: str = "tones", pitch: float = 1.0
) -> Path:
    """``utterances`` WAV files of 1–3 tone words said by ``speaker`` (its tones ``pitch`` times
    :data:`TONES`') and their manifest (``directory/all.tsv``, the columns
    ``speech_corpora.read_manifest`` reads); returns the manifest's path."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["path\tseconds\tspeaker\ttext"]
    for i in range(utterances):
        words = [rng.choice(list(TONES)) for _ in range(rng.randint(1, 3))]
        wave = tone_words(words, rng=rng, pitch=pitch)
        name = f"utt{i:03d}.wav"
        soundfile.write(directory / name, wave, RATE, subtype="PCM_16")
        lines.append(f"{name}\t{len(wave) / RATE:.3f}\t{speaker}\t{' '.join(words)}")
    manifest = directory / "all.tsv"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def tiny_asr_overrides(manifest: Path) -> list[str]:
    """``--set`` overrides of an asr recipe that trains a tiny model on a tone corpus in seconds."""
    return [
        "task=asr",
        "data.corpus=manifests",
        f"data.train={manifest}",
        f"data.test={manifest}",
        "model.d_model=32",
        "model.n_heads=2",
        "model.d_ff=64",
        "model.n_encoder_layers=2",
        "model.n_decoder_layers=1",
        "model.max_len=16",
        "model.dropout=0.0",
        "model.features.n_mels=23",
        "train.batch_frames=400",
        "train.warmup=10",
        "train.lr=3e-3",
        "train.spec_augment=false",
        "train.label_smoothing=0.0",
        "decode.beam_size=2",
    ]
