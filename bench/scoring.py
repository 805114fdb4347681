"""Scores several bench scripts share, so that each computes them one way.

What is here: :func:`agreement` (how far two runs' greedy tokens agree: ``chat_speed.py``,
``chat_drift.py``), :func:`dnsmos` (DNSMOS P.835 and P.808 of 16 kHz speech, :func:`at_least`
padding the shortest) and :func:`speech_scores` (DNSMOS and an ASR judge's WER of spoken
sentences: ``tts_quality.py``, ``vocoder_quality.py``).
What is not here: the engines that speak or write, the judges (each script picks its own: qkv's
Whisper or faster-whisper's), the records (``record.py``).
"""

from __future__ import annotations

from collections.abc import Callable

RATE = 16_000  # DNSMOS's and the judges' rate, and the corpora's
SHORTEST = RATE // 10  # 0.1 s: a model that stops at once says less; DNSMOS loops its input to 9 s


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of positions with the same token, mean share of each output before its first difference)."""
    same = total = 0
    prefix = 0.0
    for a, b in zip(ours, reference, strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=True))
        total += len(b)
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        prefix += first / len(b)
    return same / total, prefix / len(reference)


def at_least(wave, samples: int):
    """``wave`` padded with silence to ``samples`` (an empty one cannot be looped or framed)."""
    import numpy as np

    return np.pad(wave, (0, max(0, samples - wave.size)))


def dnsmos(waves: list) -> dict[str, float]:
    """DNSMOS P.835 (SIG, BAK, OVRL) and P.808, each the mean over the waveforms (16 kHz)."""
    from speechmos import dnsmos as model

    scores = [model.run(at_least(w, SHORTEST), sr=RATE) for w in waves]
    names = {"SIG": "sig_mos", "BAK": "bak_mos", "OVRL": "ovrl_mos", "P.808": "p808_mos"}
    return {k: float(sum(s[v] for s in scores) / len(scores)) for k, v in names.items()}


def speech_scores(waves: list, texts: list[str], transcribe: Callable[[list], list[str]]) -> dict[str, float]:
    """Spoken sentences (16 kHz waveforms of ``texts``) scored: their :func:`dnsmos` and the WER
    in % of the judge ``transcribe`` (waveforms to transcripts) against the texts, compared as
    ``qkv.evaluation.error_rates`` compares them (lowercase, no punctuation)."""
    from qkv.evaluation import error_rates

    wer = 100 * error_rates(transcribe(waves), texts)["wer"]
    return {**dnsmos(waves), "WER": wer}
