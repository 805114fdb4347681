"""What the bundle's modules share: which jobs each kind of model does (:data:`JOBS`,
:data:`DOES`) and :func:`require`, which refuses in one line a job a model cannot do; how a
model decodes unless told otherwise (:class:`DecodeDefaults`, read from its recipe); a
generating job's sampling (:class:`Sampling`); what a transcribing job takes as audio
(:data:`Audio`); and the small helpers of the bundle's methods (one text or several, one audio
input or several, words joined as prose).

What is not here: the bundle and loading (``core.py``), the constraints (``constraints.py``),
the jobs (``translation.py``, ``transcription.py``, ``speaking.py``, ``embedding.py``,
``generation.py``). This is the package's lowest module: it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from qkv.audio_stream import AudioSource
from qkv.chat import draw
from qkv.decoding import sampler
from qkv.errors import OptionError, UserError
from qkv.loading import KIND_NAMES
from qkv.recipes import upgrade_stored

JOBS = {  # what each kind of model does
    "encoder_decoder": ("translate", "generate", "chat"),
    "decoder_only": ("generate", "chat"),
    "encoder_only": ("embed",),
    "speech_encoder_decoder": ("transcribe",),
    "tts": ("speak",),
    "vits": ("speak",),
}
DOES = {
    "translate": "translates",
    "generate": "generates",
    "chat": "chats",
    "embed": "embeds texts",
    "transcribe": "transcribes audio",
    "speak": "speaks",
}
Audio = str | Path | Tensor | np.ndarray | AudioSource  # a file, a mono waveform (N,) at the model's rate, or a source


@dataclass(frozen=True)
class DecodeDefaults:
    """How a model's jobs decode unless told otherwise: its recipe's ``decode`` settings where
    it records them (what its test split was scored with; a model trained before the decode
    section: its ``data`` settings, :func:`~qkv.recipes.upgrade_stored`), else qkv's.

    Attributes:
        beam_size: beam width (``decode.beam_size``; else 4).
        length_penalty: score = log p / length^penalty (``decode.length_penalty``; else 1).
        max_len_a, max_len_b: an output of a source of S tokens has at most a·S + b tokens
            (``decode.max_len_a``, ``decode.max_len_b``; else 1.5 and 10, fairseq's rule).
        ctc_weight: the CTC prefix score's weight in joint decoding, for a speech model with a
            CTC head (``decode.ctc_weight``; else 0: attention alone).
    """

    beam_size: int = 4
    length_penalty: float = 1.0
    max_len_a: float = 1.5
    max_len_b: int = 10
    ctc_weight: float = 0.0

    @classmethod
    def of(cls, recipe: dict | None, *, ctc: bool) -> DecodeDefaults:
        """The defaults ``recipe`` (a model directory's, or None) records; ``ctc``: the model has a CTC head."""
        decode, base = upgrade_stored(recipe).get("decode") or {}, cls()
        return cls(
            beam_size=int(decode.get("beam_size", base.beam_size)),
            length_penalty=float(decode.get("length_penalty", base.length_penalty)),
            max_len_a=float(decode.get("max_len_a", base.max_len_a)),
            max_len_b=int(decode.get("max_len_b", base.max_len_b)),
            ctc_weight=float(decode.get("ctc_weight", base.ctc_weight)) if ctc else 0.0,
        )


@dataclass(frozen=True)
class Sampling:
    """Each token drawn from the model's distribution instead of searched for.

    Attributes:
        temperature: the logits are divided by it (at least 0.001; 1: as the model says).
        top_k: draw among the k most likely tokens (None: all).
        top_p: draw from the smallest set of tokens with this probability (None: all).
        seed: the draws' seed (None: a fresh one): one call with a seed is reproducible.
        min_p: draw among the tokens at least this share as likely as the likeliest (min-p,
            ``chat.min_p_filter``; None: all).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 1e-3:  # below it the scaled logits overflow
            raise OptionError(f"temperature {self.temperature}: give at least 0.001", "temperature")
        if self.top_k is not None and self.top_k < 1:
            raise OptionError(f"top_k {self.top_k}: give a positive number of tokens", "top_k")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise OptionError(f"top_p {self.top_p}: give a probability in (0, 1]", "top_p")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise OptionError(f"min_p {self.min_p}: give a probability in [0, 1]", "min_p")

    def chooser(self, device: torch.device) -> Callable[[Tensor], Tensor]:
        """What picks each token (``decoding.sampler``; with min-p, ``chat.draw``), one generator
        for all its draws."""
        generator = torch.Generator(device=device)
        if self.seed is not None:
            generator.manual_seed(self.seed)
        else:
            generator.seed()
        if self.min_p is not None:
            return draw(
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, generator=generator
            )
        return sampler(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, generator=generator)

    @classmethod
    def of(cls, defaults, *, seed: int | None = None) -> Sampling | None:
        """The sampling a checkpoint's ``generation_config.json`` asks for
        (:class:`~qkv.conversation.GenerationDefaults`), or None where it does not sample."""
        if not defaults.do_sample:
            return None
        return cls(
            temperature=defaults.temperature if defaults.temperature is not None else 1.0,
            top_k=defaults.top_k or None,
            top_p=defaults.top_p,
            seed=seed,
            min_p=defaults.min_p or None,
        )


def require(path: Path, kind: str, job: str) -> None:
    """Refuse a ``job`` a ``kind`` model (in ``path``) cannot do: one line saying what it does
    and which kind does the job."""
    if job not in DOES:
        raise ValueError(f"unknown job {job!r}; the jobs: {', '.join(DOES)}")
    if job in JOBS[kind]:
        return
    does = _and([DOES[j] for j in JOBS[kind]])
    doers = " or ".join(KIND_NAMES[k] for k, jobs in JOBS.items() if job in jobs)
    raise UserError(f"{path} holds {KIND_NAMES[kind]}: it {does}; it cannot {job}: {doers} does")


def _listed(texts: str | Sequence[str]) -> list[str]:
    """One text as a list of one; several as a list."""
    return [texts] if isinstance(texts, str) else list(texts)


def _one_audio(audio: Audio | Sequence[Audio]) -> bool:
    """Whether ``audio`` is one input (a path, or a waveform of one dimension) rather than several."""
    return isinstance(audio, str | Path) or (isinstance(audio, Tensor | np.ndarray) and audio.ndim == 1)


def _and(words: list[str]) -> str:
    """The words joined as prose: a; a and b; a, b and c."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"
