"""The speaking job: :func:`speeches` (each text spoken by a text-to-speech model of qkv's own:
its synthesis and waveform; a text too long for the cap split at sentence ends and joined with
:data:`PIECE_PAUSE` s of silence), :func:`neural_vocoder` (a trained vocoder directory, checked
against the model's frames, to voice them in place of Griffin-Lim) and :func:`piper_speeches`
(each text spoken by an imported Piper voice), each in the voice asked for.

What is not here: the synthesis (``qkv.tasks.tts``'s ``speak``, ``qkv.synthesis``), the Piper
model (``qkv.piper``), splitting text (``qkv.speakable``), writing WAV files (``qkv.vocoder``,
through ``Bundle.write_wav``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from qkv.errors import OptionError, UserError
from qkv.models.mel_vocoder import MelVocoder
from qkv.piper import Voice
from qkv.piper import speak as speak_piper
from qkv.speakable import FASTEST, TooLong, most_characters, split_text
from qkv.synthesis import Synthesis
from qkv.tasks.tts import speak, speaking_of
from qkv.tasks.vocoder import load_vocoder
from qkv.vocoder import Vocoder

if TYPE_CHECKING:
    from qkv.bundle.core import Bundle


def speeches(
    bundle: Bundle,
    texts: Sequence[str],
    *,
    speaker: str | None = None,
    max_seconds: float = 20.0,
    stop_threshold: float | None = None,
    attention_window: Sequence[int] | None = None,
    batch_size: int = 16,
    seed: int | None = 0,
    on_batch: Callable[[int], None] | None = None,
    vocoder: Vocoder | None = None,
) -> list[tuple[Synthesis, Tensor]]:
    """Each text spoken (``tasks.tts.speak``): its synthesis (frames, whether it hit the cap)
    and waveform (N,) at :attr:`Bundle.sample_rate` (with ``vocoder``, e.g. :func:`neural_vocoder`'s:
    at its ``sample_rate``; None: Griffin-Lim), in order. ``speaker``: the voice, for a
    model of several (required there); ``stop_threshold`` and ``attention_window``: the
    recipe's unless given; ``seed``: the pre-net dropout's draws (None: fresh ones), without
    touching torch's global generator.

    A text longer than can be said within the cap (``max_seconds``, or the model's window:
    ``speakable.most_characters``) is split at sentence ends (``speakable.split_text``) before
    the model reads it; its pieces are spoken and joined with :data:`PIECE_PAUSE` s of silence
    (its synthesis: the pieces' frames, ``hit_cap`` if any piece hit it, no alignment). A word
    too long to be said in time is an OptionError naming ``max_seconds`` and both lengths."""
    bundle.require("speak")
    if bundle.kind == "vits":
        raise UserError(f"{bundle.path} is a Piper voice: it speaks through piper_speeches (Bundle.speak calls it)")
    if isinstance(vocoder, MelVocoder):
        _check_fits(bundle, vocoder)
    pieces = _pieces(bundle, texts, max_seconds)
    flat = [piece for split in pieces for piece in split]
    voices = _voices(bundle, speaker, len(flat))
    how = speaking_of(bundle.meta, stop_threshold=stop_threshold, attention_window=attention_window)
    devices = [bundle.device] if bundle.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        said = speak(
            bundle.model,
            bundle.vocab.source,
            flat,
            speakers=voices,
            batch_size=batch_size,
            max_seconds=max_seconds,
            on_batch=_scaled(on_batch, len(flat), len(texts)),
            symbols=how["symbols"],
            voice=how["voice"],
            stop_threshold=how["stop_threshold"],
            attention_window=how["attention_window"],
            vocoder=vocoder,
        )
    if len(flat) == len(texts):
        return said
    ends = np.cumsum([0, *map(len, pieces)])
    rate = bundle.sample_rate if vocoder is None else vocoder.sample_rate
    return [_joined(said[a:b], rate) for a, b in itertools.pairwise(ends)]


def neural_vocoder(directory: str | Path) -> MelVocoder:
    """The vocoder saved in ``directory`` (``tasks.vocoder.load_vocoder``: its adapter and its
    voice's generator); :func:`speeches` checks it reads the frames its model writes."""
    return load_vocoder(directory)


def _check_fits(bundle: Bundle, vocoder: MelVocoder) -> None:
    """A UserError line when ``vocoder`` reads other frames than ``bundle``'s model writes."""
    if bundle.kind == "vits":
        raise UserError(f"{bundle.path} is a Piper voice: it speaks through its own generator, not a vocoder")
    c, f = vocoder.config, bundle.features
    mine = (c.n_mels, c.mel_sample_rate, c.mel_hop)
    theirs = (f.n_mels, f.sample_rate, f.hop_length)
    if mine != theirs or f.kind != "logmel" or f.normalize:
        raise UserError(
            f"the vocoder reads {mine[0]} log-mels at {mine[1]} Hz, hop {mine[2]}; "
            f"{bundle.path} writes {f.kind} frames ({theirs[0]} bins at {theirs[1]} Hz, hop {theirs[2]}"
            f"{', normalised' if f.normalize else ''})"
        )


PIECE_PAUSE = 0.25  # seconds of silence between the pieces of a split text (a sentence's pause)


def _pieces(bundle: Bundle, texts: Sequence[str], max_seconds: float) -> list[list[str]]:
    """Each text as the pieces it is spoken in (itself, when it fits: ``speakable``)."""
    cap = min(max_seconds, bundle.longest_speech)
    limit = most_characters(cap)
    try:
        return [split_text(text, limit) if len(text) > limit else [text] for text in texts]
    except TooLong as e:
        why = "max_seconds; raise it" if cap == max_seconds else "the model's window, model.max_len steps"
        raise OptionError(
            f"cannot say a word of {len(e.word):,} characters in time: at most {limit:,} characters fit in "
            f"{cap:.1f} s ({why}), at {FASTEST:g} characters a second",
            "max_seconds",
        ) from None


def _scaled(on_batch: Callable[[int], None] | None, pieces: int, texts: int) -> Callable[[int], None] | None:
    """``on_batch`` told texts done where synthesis counts pieces done (in proportion: exact at the end)."""
    if on_batch is None or pieces == texts:
        return on_batch
    done = [0, 0]  # pieces, texts reported

    def report(n: int) -> None:
        done[0] += n
        now = done[0] * texts // pieces
        if now > done[1]:
            on_batch(now - done[1])
            done[1] = now

    return report


def _joined(said: Sequence[tuple[Synthesis, Tensor]], rate: int) -> tuple[Synthesis, Tensor]:
    """The pieces of one text as one: frames and waves in order, :data:`PIECE_PAUSE` s between waves."""
    if len(said) == 1:
        return said[0]
    pause = torch.zeros(round(PIECE_PAUSE * rate))  # (Y,)
    waves = [part for i, (_, wave) in enumerate(said) for part in ([pause, wave] if i else [wave])]
    mel = torch.cat([s.mel for s, _ in said])  # (T, M)
    return Synthesis(mel, any(s.hit_cap for s, _ in said), None), torch.cat(waves)


def _voices(bundle: Bundle, speaker: str | None, n: int) -> list[int] | None:
    """The speaker ids of ``n`` sentences in ``speaker``'s voice (None: the one voice)."""
    if speaker is None:
        if bundle.speakers:
            names = ", ".join(bundle.speakers)
            raise OptionError(f"{bundle.path} speaks in several voices: choose one with speaker ({names})", "speaker")
        return None
    if speaker not in bundle.speakers:
        known = ", ".join(bundle.speakers) if bundle.speakers else "none: it has one voice"
        raise OptionError(f"speaker {speaker!r}: the model's speakers are {known}", "speaker")
    return [bundle.speakers.index(speaker)] * n


def piper_speeches(
    bundle: Bundle,
    texts: Sequence[str],
    *,
    speaker: str | None = None,
    noise_scale: float | None = None,
    length_scale: float | None = None,
    noise_w: float | None = None,
    seed: int | None = 0,
) -> list[Tensor]:
    """Each text spoken by an imported Piper voice (``qkv.piper.speak``): a waveform (N,) at
    :attr:`Bundle.sample_rate`. The scales default to the voice's; ``seed``: the noise's draws
    (None: fresh ones)."""
    bundle.require("speak")
    voices = _voices(bundle, speaker, len(texts))
    voice = Voice.read(bundle.path)
    generator = torch.Generator(device=bundle.device)
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return [
        speak_piper(
            bundle.model,
            voice,
            text,
            speaker=None if voices is None else voices[i],
            noise_scale=noise_scale,
            length_scale=length_scale,
            noise_w=noise_w,
            generator=generator,
        )
        for i, text in enumerate(texts)
    ]
