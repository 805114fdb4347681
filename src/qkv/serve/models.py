"""The served models: a loaded bundle each, with its name and the endpoints it answers.

What is here: :class:`Served` (a :class:`~qkv.bundle.Bundle` under the name the server gives it,
and a classifier's labels; the endpoints it answers, by kind, :data:`ENDPOINTS`, and for a speech
model by what it writes, :func:`speech_tasks`) and :func:`load_served` (the model directories of ``qkv serve``,
loaded by ``bundle.load`` as the command line loads them; a mistake is a
:class:`~qkv.errors.UserError` before the server starts).

What is not here: the work (``jobs.py``, ``attention.py``), HTTP (``app.py``, ``routes/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from qkv.bundle import Bundle, load
from qkv.checkpoint import model_dir
from qkv.errors import UserError
from qkv.tokenization import Tokenizer, Vocabularies

ENDPOINTS = {  # what the server answers, by kind
    "encoder_decoder": ("translate", "chat", "attention"),
    "decoder_only": ("generate", "chat", "chat/completions", "completions", "attention"),
    "encoder_only": ("embed", "classify", "attention"),
    "speech_encoder_decoder": ("audio/transcriptions", "audio/translations"),  # as speech_tasks says
    "tts": ("audio/speech",),
    "vits": ("audio/speech",),
}
SPEECH_ENDPOINTS = {"transcribe": "audio/transcriptions", "translate": "audio/translations"}  # by task


@dataclass(frozen=True, eq=False)
class Served:
    """A model loaded for serving: ``bundle`` (the model prepared for its jobs, its tokenizers,
    its config.json), the ``name`` requests call it by, and a classifier's class names
    (``labels``; None for other models)."""

    name: str
    bundle: Bundle
    labels: list[str] | None = None

    @property
    def kind(self) -> str:
        return self.bundle.kind

    @property
    def model(self) -> nn.Module:
        return self.bundle.model

    @property
    def vocab(self) -> Vocabularies:
        return self.bundle.vocab

    @property
    def window(self) -> int | None:
        """The model's window in tokens (a Piper voice has none: None)."""
        return None if self.kind == "vits" else self.bundle.window

    @property
    def endpoints(self) -> tuple[str, ...]:
        found = ENDPOINTS[self.kind]
        if self.kind == "encoder_only" and not self.labels:
            return tuple(e for e in found if e != "classify")
        if self.kind == "speech_encoder_decoder":
            return tuple(SPEECH_ENDPOINTS[task] for task in speech_tasks(self.bundle))
        return found

    def layers(self) -> dict[str, int]:
        c = self.model.config
        if hasattr(c, "n_encoder_layers"):  # encoder-decoders of text, of speech, and Transformer-TTS
            return {"encoder": c.n_encoder_layers, "decoder": c.n_decoder_layers}
        if self.kind == "decoder_only":
            return {"decoder": c.n_layers}
        return {"encoder": c.n_layers}

    def token_strings(self, tokenizer: Tokenizer, ids: list[int]) -> list[str]:
        return [tokenizer.id_to_token(i) for i in ids]


def speech_tasks(bundle: Bundle) -> tuple[str, ...]:
    """What a speech model writes: "transcribe" (the words heard), "translate" (English text),
    or both. An imported Whisper transcribes, and a multilingual one translates too (its
    <|translate|> token); a model of qkv's own does what its recipe taught it (``data.translate``)."""
    if bundle.whisper is not None:
        both = bundle.whisper.multilingual and "translate" in bundle.whisper.tasks
        return ("transcribe", "translate") if both else ("transcribe",)
    data = (bundle.meta.get("recipe") or {}).get("data") or {}
    return ("translate",) if data.get("translate") else ("transcribe",)


def load_served(paths: list[str], *, bf16: bool = False, int8: bool = False) -> dict[str, Served]:
    """The models of ``paths`` (model or training-run directories), named by their directory
    (a run: the run's directory), the second of one name with ``-2`` and so on."""
    served: dict[str, Served] = {}
    for path in paths:
        if not model_dir(path).is_dir():
            raise UserError(f"--model {path}: no such directory")
        bundle = load(path, bf16=bf16, int8=int8)
        if bundle.kind not in ENDPOINTS:
            raise UserError(f"--model {path}: the server does not serve {bundle.kind} models yet")
        name = Path(path).resolve().name or "model"
        base, n = name, 1
        while name in served:
            n += 1
            name = f"{base}-{n}"
        labels = bundle.meta.get("labels") if bundle.kind == "encoder_only" and bundle.model.config.n_classes else None
        served[name] = Served(name, bundle, labels)
    return served
