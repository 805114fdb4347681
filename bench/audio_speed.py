"""Audio front-end speed: qkv's log-mel features beside librosa's, in one run, on real speech.

    python bench/audio_speed.py              # all 3,000 FSDD recordings + 60 s of synthetic audio

FSDD (free-spoken-digit-dataset: 3,000 recordings of spoken digits, 8 kHz WAV, ~0.4 s each) is
read from ``$QKV_DATA/fsdd/recordings`` (default ``../shared/data``). Every file is read and
resampled to 16 kHz once with :func:`qkv.audio.load_many` (timed on its own); then the 80-bin
log-mel features (25 ms window, 10 ms hop) of every waveform are computed by

  * qkv, one waveform at a time (:func:`qkv.audio.features`),
  * qkv, batched: waveforms sorted by length, 64 to a batch (:func:`qkv.audio.batch_features`),
  * librosa, one waveform at a time (``librosa.feature.melspectrogram`` with the same settings,
    then ``np.log``), the peer,

and likewise for one 60 s synthetic waveform (a chirp in noise). The figure is seconds of audio
per second of compute ("x real time") on 2 threads, best of 3 passes; the target is ≥ 1000x. The
headline (the JSON record's ``figure``) is qkv batched on FSDD against librosa on FSDD.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(ROOT / "bench"))

import record  # noqa: E402

from qkv.audio import FeatureConfig, batch_features, features, load_many  # noqa: E402

TARGET = 1000.0  # x real time
BATCH = 64
REPEATS = 3


def data_root() -> Path:
    return Path(os.environ.get("QKV_DATA") or ROOT.parent / "shared" / "data")


def best_seconds(run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def synthetic(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    wave = 0.5 * np.sin(2 * np.pi * (100 * t + 3900 * t**2 / (2 * seconds)))  # 100 Hz -> 4 kHz chirp
    return (wave + 0.05 * np.random.default_rng(0).standard_normal(t.size)).astype(np.float32)


def main() -> None:
    argparse.ArgumentParser(
        description="Speed of qkv's log-mel features beside librosa's on the 3,000 FSDD recordings and 60 s of "
        "synthetic audio; appends the run to bench/results/audio_speed.json.",
        epilog="example: python bench/audio_speed.py",
    ).parse_args()
    import librosa

    torch.set_num_threads(2)
    config = FeatureConfig()
    rate = config.sample_rate
    paths = sorted((data_root() / "fsdd" / "recordings").glob("*.wav"))
    if not paths:
        sys.exit(f"no FSDD recordings under {data_root() / 'fsdd' / 'recordings'} (set QKV_DATA)")

    start = time.perf_counter()
    loaded, bad = load_many(paths, sample_rate=rate, skip_bad=True)
    load_s = time.perf_counter() - start
    waves = [x for _, x in loaded]  # (N,) each, 16 kHz
    arrays = [x.numpy() for x in waves]
    fsdd_seconds = sum(x.numel() for x in waves) / rate
    print(f"FSDD: {len(waves)} recordings, {fsdd_seconds:.1f} s of speech, {len(bad)} refused", flush=True)
    print(f"  read + resample 8 -> 16 kHz (soundfile + soxr): {fsdd_seconds / load_s:,.0f}x real time")

    by_length = sorted(waves, key=lambda x: x.numel())
    batches = [by_length[i : i + BATCH] for i in range(0, len(by_length), BATCH)]

    def librosa_one(y: np.ndarray) -> np.ndarray:
        mel = librosa.feature.melspectrogram(
            y=y, sr=rate, n_fft=config.n_fft, hop_length=config.hop_length, win_length=config.win_length,
            window="hann", center=True, pad_mode="constant", power=2.0, n_mels=config.n_mels, htk=False,
            norm="slaney",
        )  # fmt: skip
        return np.log(np.maximum(mel, 1e-10))

    librosa_one(arrays[0])  # warm-up: librosa builds and caches its filterbank
    features(waves[0], config)
    with torch.inference_mode():
        fsdd = {
            "qkv batched": best_seconds(lambda: [batch_features(b, config) for b in batches]),
            "qkv one by one": best_seconds(lambda: [features(x, config) for x in waves]),
            "librosa one by one": best_seconds(lambda: [librosa_one(y) for y in arrays]),
        }
        long = synthetic(60.0, rate)
        long_t = torch.from_numpy(long)
        synth = {
            "qkv": best_seconds(lambda: features(long_t, config)),
            "librosa": best_seconds(lambda: librosa_one(long)),
        }

    threads = torch.get_num_threads()
    print(f"log-mel, {config.n_mels} bins, 25 ms / 10 ms at 16 kHz, {threads} threads (target ≥ {TARGET:,.0f}x)")
    for name, seconds in fsdd.items():
        print(f"  FSDD   {name:20s} {fsdd_seconds / seconds:>10,.0f}x real time  ({seconds:.3f} s)")
    for name, seconds in synth.items():
        print(f"  60 s   {name:20s} {60.0 / seconds:>10,.0f}x real time  ({seconds:.4f} s)")

    figure = fsdd_seconds / fsdd["qkv batched"]
    verdict = "meets" if figure >= TARGET else "MISSES"
    print(f"qkv batched on FSDD: {figure:,.0f}x real time, {verdict} the target of {TARGET:,.0f}x")
    print(f"(load average over the last minute: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")

    record.append(
        "audio_speed",
        {
            "metric": "log-mel 80 bins, FSDD 3,000 recordings, batched",
            "figure": round(figure, 1),
            "unit": "x real time",
            "peer": "librosa.feature.melspectrogram + np.log, one recording at a time",
            "peer_figure": round(fsdd_seconds / fsdd["librosa one by one"], 1),
            "target": {"min": TARGET},
            "details": {
                "load_average_1min": round(os.getloadavg()[0], 2),  # other work on the machine during the run
                "fsdd_audio_seconds": round(fsdd_seconds, 2),
                "fsdd_read_resample_x_real_time": round(fsdd_seconds / load_s, 1),
                **{f"fsdd_{k.replace(' ', '_')}": round(fsdd_seconds / v, 1) for k, v in fsdd.items()},
                **{f"synthetic_60s_{k}": round(60.0 / v, 1) for k, v in synth.items()},
            },
        },
    )
    print("appended the run to bench/results/audio_speed.json")


if __name__ == "__main__":
    main()
