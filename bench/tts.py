"""Text-to-speech benchmark: intelligibility (qkv's own speech recognition of the synthesized
speech), mel-cepstral distortion against the reference recordings, and synthesis speed.

    python bench/tts.py --tts runs/tts_en --asr runs/speech_en              # 200 held-out sentences
    python bench/tts.py --tts runs/tts_en --asr runs/speech_en --sentences 50 --no-record

The sentences are the first ``--sentences`` of the TTS recipe's test split (Multi30k test2016,
never trained on), each with its espeak-ng recording in the voice the model learnt. Measured:

* WER of ASR(TTS(text)) against the text, beside the same ASR's WER on the recordings of the
  same sentences (the issue's target: ≤ 15% on TTS output). The ASR model is qkv's, trained on
  espeak-ng speech (``recipes/speech_en.yaml``), decoding with its recipe's settings.
* The same ASR on copy synthesis: Griffin-Lim of each recording's own log-mel (the model's
  features), what the vocoder alone costs: the WER a TTS model that wrote the recordings' mels
  exactly would get, so the gap above splits into the model's share and the vocoder's.
* The same ASR on the model's teacher-forced frames (each step reading the recording's previous
  frames, as in training) through the same vocoder: a model that predicts well here but not
  when it reads its own frames suffers from exposure bias; one that fails here too is underfit.
* Mel-cepstral distance between each synthesized waveform (vocoder included) and its
  recording, computed by the ``mel-cepstral-distance`` package with its defaults (Kubichek,
  1993: 20 log10 mel bands of 32 ms frames every 8 ms, cepstral coefficients 1–15, frames
  aligned by DTW, no dB scaling), the mean over sentences. For scale: two FSDD recordings of
  one digit by one speaker are about 6 apart, by two speakers about 9.
* Speed: seconds of synthesis (batches of 16, Griffin-Lim included) per second of speech
  (real-time factor; the issue's target ≤ 0.3).

For a model trained on FSDD digit strings in six real voices (``recipes/tts_fsdd.yaml``), the
sentences are that recipe's test strings, each synthesized in the voice of the speaker who
recorded it, and the ASR is qkv's digit-string model (``recipes/fsdd_digit_strings.yaml``).
Intelligibility is then reported per speaker as digits right, 1 − WER (insertions count against
it), beside the same ASR on that speaker's recordings of the same strings (the issue's target:
≥ 95% for every speaker)::

    python bench/tts.py --tts runs/tts_fsdd --asr runs/bench_digit_strings

Records go to ``bench/results/tts.json`` (``--no-record``: print only).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def mel_cepstral_distance(waveform, rate: int, reference: Path) -> float:
    """The mel-cepstral distance (``mel-cepstral-distance``'s defaults, DTW) between a
    synthesized waveform and a recording; both pass through WAV files, the only kind the
    package reads (the espeak-ng corpora are FLAC)."""
    import tempfile

    import soundfile
    from mel_cepstral_distance import compare_audio_files

    with tempfile.TemporaryDirectory() as tmp:
        path, recording = Path(tmp) / "synthesized.wav", Path(tmp) / "recording.wav"
        soundfile.write(path, waveform.float().numpy(), rate)
        samples, recorded_rate = soundfile.read(reference, dtype="float32")
        soundfile.write(recording, samples, recorded_rate)
        distance, _penalty = compare_audio_files(str(recording), str(path))
    return float(distance)


def teacher_forced(tts, tokenizer, utterance, reading: dict, voices: list[str]):
    """The TTS model's post-net frames for a test recording under teacher forcing (each decoder
    step reads the recording's previous frames, as in training; the pre-net's dropout on, as
    always), as log-mels a vocoder inverts: (T, M) for the recording's T frames."""
    import torch

    from qkv.audio import features, load_audio
    from qkv.tasks.tts import symbol_ids

    c, r = tts.config.features, tts.config.reduction
    mel = tts.scale(features(load_audio(utterance.path, sample_rate=c.sample_rate, max_seconds=None), c))  # (T, M)
    frames = mel.shape[0]
    mel = torch.nn.functional.pad(mel, (0, 0, 0, (-frames) % r))[None]  # (1, T', M): whole steps of r frames
    valid = (torch.arange(mel.shape[1]) < frames)[None]  # (1, T')
    text = torch.tensor(symbol_ids(tokenizer, [utterance.text], **reading))  # (1, S)
    speakers = torch.tensor([voices.index(utterance.speaker)]) if voices else None
    with torch.no_grad():
        _, refined, _, _ = tts(text, torch.ones_like(text, dtype=torch.bool), mel, valid, speakers)
    return tts.unscale(refined[0, :frames])


def wer_record(metric: str, wer: float, peer: str, peer_wer: float, *, details: dict, target=None) -> dict:
    """A bench record of a word error rate (fractions in, percentages recorded) beside a peer's."""
    return {
        "metric": metric,
        "figure": round(100 * wer, 2),
        "unit": "%",
        "peer": peer,
        "peer_figure": round(100 * peer_wer, 2),
        "target": target,
        "details": details,
    }


def main() -> int:
    from qkv.cli.common import number

    p = argparse.ArgumentParser(
        description="TTS benchmark: ASR WER of synthesized speech, mel-cepstral distortion, real-time factor.",
        epilog="example: python bench/tts.py --tts runs/tts_en --asr runs/speech_en",
    )
    p.add_argument("--tts", required=True, help="a TTS model directory (trained with a tts recipe)")
    p.add_argument(
        "--asr",
        required=True,
        help="a speech recognition model directory (speech_en, or fsdd_digit_strings for FSDD voices)",
    )
    p.add_argument(
        "--sentences",
        type=int,
        default=None,
        help="held-out sentences to speak (default 200; FSDD: the whole test split)",
    )
    p.add_argument(
        "--stop-threshold",
        type=number(float, lambda v: 0 < v < 1, "a probability between 0 and 1"),
        help="end a sentence when its stop probability passes this (default: the recipe's)",
    )
    p.add_argument(
        "--attention-window",
        nargs=2,
        type=number(int, lambda v: v >= 0, "an integer >= 0"),
        metavar=("BACK", "AHEAD"),
        help="keep cross-attention near its peak while speaking (default: the recipe's decode.attention_window)",
    )
    p.add_argument("--no-record", action="store_true", help="print, do not write bench/results/tts.json")
    args = p.parse_args()
    from qkv.memory import choose_allocator

    print(f"allocator: {choose_allocator()}", flush=True)  # as qkv train does (memory.py)

    import torch

    from qkv.audio import features, load_audio
    from qkv.checkpoint import load_model, model_dir
    from qkv.evaluation import error_rates
    from qkv.tasks import TASKS
    from qkv.tasks.asr import transcribe
    from qkv.tasks.tts import load_corpus, speak, speaking_of
    from qkv.tokenization import FILE, Tokenizer
    from qkv.vocoder import GriffinLim

    tts_dir, asr_dir = model_dir(args.tts), model_dir(args.asr)
    tts, tts_meta = load_model(tts_dir, kind="tts")
    asr, asr_meta = load_model(asr_dir, kind="speech_encoder_decoder")
    tts_tokens, asr_tokens = Tokenizer.load(tts_dir / FILE), Tokenizer.load(asr_dir / FILE)
    voices = list(tts_meta.get("speakers") or [])  # FSDD: the speakers, in embedding order
    count = args.sentences if args.sentences is not None else (None if voices else 200)
    test = load_corpus(TASKS["tts"].from_stored(tts_meta["recipe"]).data)["test"][:count]
    texts = [u.text for u in test]
    unknown = sorted({u.speaker for u in test} - set(voices)) if voices else []
    if unknown:
        raise SystemExit(f"{tts_dir} has no voice for the test speaker(s) {', '.join(unknown)}")
    speakers = [voices.index(u.speaker) for u in test] if voices else None  # each in its speaker's voice
    torch.manual_seed(0)
    start = time.perf_counter()
    settings = speaking_of(tts_meta, stop_threshold=args.stop_threshold, attention_window=args.attention_window)
    spoken = speak(tts, tts_tokens, texts, speakers=speakers, **settings)
    seconds = time.perf_counter() - start
    rate = tts.config.features.sample_rate
    audio = sum(w.numel() for _, w in spoken) / rate
    stopped = sum(not s.hit_cap for s, _ in spoken) / len(spoken)

    decoding = TASKS["asr"].from_stored(asr_meta["recipe"]).decode
    options = {"beam_size": decoding.beam_size, "ctc_weight": float(decoding.ctc_weight)}
    config = asr.config.features
    synthesized = [features(w.float(), config) for _, w in spoken]
    recorded = [features(load_audio(u.path, max_seconds=None), config) for u in test]
    tts_features, vocoder = tts.config.features, GriffinLim(tts.config.features)
    copied = [
        features(vocoder(features(load_audio(u.path, sample_rate=rate, max_seconds=None), tts_features)), config)
        for u in test
    ]
    reading = {"symbols": settings["symbols"], "voice": settings["voice"]}
    forced = [features(vocoder(teacher_forced(tts, tts_tokens, u, reading, voices)), config) for u in test]
    ours = [t.text for t in transcribe(asr, asr_tokens, synthesized, **options)]
    theirs = [t.text for t in transcribe(asr, asr_tokens, recorded, **options)]
    vocoded = [t.text for t in transcribe(asr, asr_tokens, copied, **options)]
    guided = [t.text for t in transcribe(asr, asr_tokens, forced, **options)]
    wer_tts, wer_ref = error_rates(ours, texts)["wer"], error_rates(theirs, texts)["wer"]
    wer_copy, wer_forced = error_rates(vocoded, texts)["wer"], error_rates(guided, texts)["wer"]

    mcd = [mel_cepstral_distance(w, rate, Path(u.path)) for (_, w), u in zip(spoken, test, strict=True)]
    mcd_mean = sum(mcd) / len(mcd)
    print(
        f"WER of qkv ASR on qkv TTS: {100 * wer_tts:.2f}%  |  on the recordings: {100 * wer_ref:.2f}%  |  "
        f"on Griffin-Lim of the recordings' mels (the vocoder alone): {100 * wer_copy:.2f}%  |  "
        f"on the model's teacher-forced frames: {100 * wer_forced:.2f}%"
    )
    print(
        f"mel-cepstral distance (DTW) {mcd_mean:.2f}; real-time factor {seconds / audio:.3f}; "
        f"{100 * stopped:.0f}% stopped"
    )
    common = {
        "sentences": len(test),
        "tts": str(tts_dir),
        "asr": str(asr_dir),
        "stop threshold": settings["stop_threshold"],
        **({"attention window": list(settings["attention_window"])} if settings["attention_window"] else {}),
    }
    per_speaker = []
    for name in voices:
        rows = [i for i, u in enumerate(test) if u.speaker == name]
        if not rows:
            continue
        right = 1 - error_rates([ours[i] for i in rows], [texts[i] for i in rows])["wer"]
        reference = 1 - error_rates([theirs[i] for i in rows], [texts[i] for i in rows])["wer"]
        print(
            f"  {name}: {100 * right:.2f}% digits right on TTS  |  {100 * reference:.2f}% on the recordings"
            f" ({len(rows)} strings)"
        )
        per_speaker.append(
            {
                "metric": f"FSDD voice {name}: digits right (1 - WER) of qkv ASR on qkv TTS",
                "figure": round(100 * right, 2),
                "unit": "%",
                "peer": "the same ASR on the speaker's recordings of the same strings",
                "peer_figure": round(100 * reference, 2),
                "target": {"min": 95},
                "details": {**common, "speaker": name, "strings": len(rows)},
            }
        )
    if not args.no_record:
        import record

        corpus = "FSDD digit strings, every voice" if voices else "Multi30k test2016"
        record.append_run(
            "tts",
            [
                *per_speaker,
                wer_record(
                    f"intelligibility: WER of qkv ASR on qkv TTS, {corpus}",
                    wer_tts,
                    "the same ASR on the recordings" if voices else "the same ASR on the espeak-ng recordings",
                    wer_ref,
                    target=None if voices else {"max": 15},
                    details={**common, "stopped by the stop token": round(stopped, 4)},
                ),
                wer_record(
                    f"intelligibility: WER of qkv ASR on Griffin-Lim of the recordings' mels, {corpus}",
                    wer_copy,
                    "the same ASR on the recordings",
                    wer_ref,
                    details={**common, "what": "copy synthesis: the vocoder alone, no TTS model"},
                ),
                wer_record(
                    f"intelligibility: WER of qkv ASR on qkv TTS teacher-forced by the recordings, {corpus}",
                    wer_forced,
                    "the same ASR on qkv TTS reading its own frames",
                    wer_tts,
                    details={**common, "what": "each step reads the recording's previous frames, as in training"},
                ),
                {
                    "metric": "mel-cepstral distance (Kubichek; mel-cepstral-distance defaults, DTW) to the recordings",
                    "figure": round(mcd_mean, 2),
                    "unit": "",
                    "details": common,
                },
                {
                    "metric": "synthesis real-time factor, batches of 16, Griffin-Lim included",
                    "figure": round(seconds / audio, 3),
                    "unit": "s per s of speech",
                    "target": {"max": 0.3},
                    "details": {**common, "speech seconds": round(audio, 1), "seconds": round(seconds, 1)},
                },
            ],
        )
    return 0


if __name__ == "__main__":
    from qkv.errors import UserError

    try:
        sys.exit(main())
    except UserError as e:  # a mistake in the command: one line, exit 2, as qkv's commands do
        print(f"tts.py: {e}", file=sys.stderr)
        sys.exit(2)
