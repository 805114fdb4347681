"""The served models: a loaded bundle each, with its name and the endpoints it answers.

What is here: :class:`Served` (a :class:`~qkv.bundle.Bundle` under the name the server gives it,
and a classifier's labels) and :func:`load_served` (the model directories of ``qkv serve``,
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

ENDPOINTS = {  # what the server answers, by kind (speech kinds: not yet)
    "encoder_decoder": ("translate", "chat", "attention"),
    "decoder_only": ("generate", "chat", "chat/completions", "completions", "attention"),
    "encoder_only": ("embed", "classify", "attention"),
}


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
    def window(self) -> int:
        return self.bundle.window

    @property
    def endpoints(self) -> tuple[str, ...]:
        found = ENDPOINTS[self.kind]
        if self.kind == "encoder_only" and not self.labels:
            return tuple(e for e in found if e != "classify")
        return found

    def layers(self) -> dict[str, int]:
        c = self.model.config
        if self.kind == "encoder_decoder":
            return {"encoder": c.n_encoder_layers, "decoder": c.n_decoder_layers}
        if self.kind == "decoder_only":
            return {"decoder": c.n_layers}
        return {"encoder": c.n_layers}

    def token_strings(self, tokenizer: Tokenizer, ids: list[int]) -> list[str]:
        return [tokenizer.id_to_token(i) for i in ids]


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
