"""Model directories: save and load a model as ``config.json`` + ``model.safetensors``.

A model directory holds:
    config.json         {"qkv_version", "kind", "config": {...}, "files": {name: sha256}, ...}
    model.safetensors   the weights (tied tensors stored once); never pickle
    other files         e.g. tokenizer.json, listed with their SHA-256 under "files"

Writes are atomic (``files.atomic_directory``): everything is written into a temporary
sibling directory, flushed to disk, that then replaces the target, so a crash never leaves a
half-written model (directories cannot be swapped in one rename, so for an instant the previous
version sits at ``.NAME.old``). Loading checks every file and tensor against the config and
refuses, naming the problem, with a :class:`~qkv.errors.UserError`.

What is not here: training state (optimizer, schedule; ``training.py``), tokenizer logic
(``tokenization.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from qkv import __version__
from qkv.errors import UserError
from qkv.files import atomic_directory, check_writable, read_json_object
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig

KINDS = ("encoder_decoder", "encoder_only", "decoder_only")
RUN_FILE = "run.json"  # marks a training run directory (``runs.py``)
Model = EncoderDecoder | EncoderOnly | DecoderOnly


def kind_of(model: nn.Module) -> str:
    """The kind name stored in ``config.json`` for a model instance."""
    if isinstance(model, EncoderDecoder):
        return "encoder_decoder"
    if isinstance(model, EncoderOnly):
        return "encoder_only"
    if isinstance(model, DecoderOnly):
        return "decoder_only"
    raise TypeError(f"not a qkv model: {type(model).__name__}")


def make_config(kind: str, fields: dict) -> EncoderDecoderConfig | EncoderOnlyConfig | DecoderOnlyConfig:
    """The config of a model ``kind`` from its fields; unknown or bad fields are a UserError."""
    if kind == "encoder_decoder":
        config_class = EncoderDecoderConfig
    elif kind == "encoder_only":
        config_class = EncoderOnlyConfig
    elif kind == "decoder_only":
        config_class = DecoderOnlyConfig
    else:
        raise UserError(f"unknown model kind {kind!r}; expected one of {', '.join(KINDS)}")
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise UserError(f"unknown {kind} config field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return config_class(**fields)
    except (TypeError, ValueError) as e:
        raise UserError(f"bad {kind} config: {e}") from None


def build_model(kind: str, fields: dict) -> Model:
    """Build a freshly initialised model of ``kind`` from config fields; bad fields are a UserError."""
    config = make_config(kind, fields)
    if isinstance(config, EncoderDecoderConfig):
        return EncoderDecoder(config)
    if isinstance(config, EncoderOnlyConfig):
        return EncoderOnly(config)
    return DecoderOnly(config)


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with each shared tensor (tied embeddings) kept once, under its first name."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor
    return state


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_output(directory: str | Path, *, models: bool = True) -> None:
    """Refuse (UserError) an output path that a save must not replace: anything but nothing, an
    empty directory or (with ``models``) an earlier qkv model directory; never the working
    directory or one above it, which the save would move away; nor one whose parent the
    process may not write in (the save makes it there). Call it before long work."""
    directory = Path(directory)
    check_writable(directory, inside=False)
    if not directory.exists():
        return
    resolved, cwd = directory.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise UserError(f"{directory} is the current directory or one above it; choose another output directory")
    if not _replaceable(directory, models=models):
        what = "a qkv model directory" if models else "an empty directory"
        raise UserError(f"{directory} exists and is not {what}; choose another output directory")


def _replaceable(directory: Path, *, models: bool) -> bool:
    """Only an empty directory or (with ``models``) an earlier qkv model directory may be replaced."""
    if not directory.is_dir():
        return False
    if not any(directory.iterdir()):
        return True
    if not models:
        return False
    try:
        return json.loads((directory / "config.json").read_text(encoding="utf-8")).get("kind") in KINDS
    except (OSError, ValueError, AttributeError):
        return False


def save_model(
    model: Model, directory: str | Path, *, files: dict[str, Path] | None = None, extra: dict | None = None
) -> Path:
    """Write ``model`` (and copies of ``files``, keyed by their name in the directory) atomically.

    ``extra`` adds JSON fields to config.json (e.g. the task a demo model was trained on).
    """
    if any(getattr(m, "w_qkv", None) is not None for m in model.modules()):
        # generation.for_decoding's stacked projections: a decoding copy, not qkv's layout
        raise ValueError("a model prepared for decoding (for_decoding) cannot be saved; save the original")
    directory = Path(directory)
    check_output(directory)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {directory.parent}: {e.strerror}") from None
    with atomic_directory(directory) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in _unique_state(model).items()}
        save_file(state, tmp / "model.safetensors")
        hashes = {}
        for name, source in (files or {}).items():
            shutil.copyfile(source, tmp / name)
            hashes[name] = sha256_file(tmp / name)
        reserved = {"qkv_version", "kind", "config", "files"}
        if reserved & set(extra or {}):
            raise ValueError(f"extra may not set {', '.join(sorted(reserved & set(extra)))}")
        meta = {
            "qkv_version": __version__,
            "kind": kind_of(model),
            "config": dataclasses.asdict(model.config),
            "files": hashes,
            **(extra or {}),
        }
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return directory


def model_dir(directory: str | Path) -> Path:
    """The model directory that ``directory`` names: itself, or for a training run directory
    (``runs.py``) the checkpoint its ``run.json`` calls final."""
    directory = Path(directory)
    if (directory / "config.json").is_file() or not (directory / RUN_FILE).is_file():
        return directory
    try:
        final = json.loads((directory / RUN_FILE).read_text(encoding="utf-8"))["final"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{directory / RUN_FILE} names no final checkpoint; is the run finished?") from None
    if not isinstance(final, str) or not final or "/" in final or final.startswith("."):
        raise UserError(f"{directory / RUN_FILE}: 'final' must name a checkpoint directory of the run")
    return directory / final


def read_meta(directory: str | Path) -> dict:
    """Read and check ``config.json`` of a model directory or run (UserError on any problem)."""
    directory = model_dir(directory)
    if not directory.is_dir():
        raise UserError(f"model directory {directory} does not exist")
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{path} is missing: {directory} is not a qkv model directory")
    meta = read_json_object(path)
    for key in ("kind", "config"):
        if key not in meta:
            raise UserError(f"{path} has no {key!r} field")
    if not isinstance(meta["config"], dict):
        raise UserError(f"{path}: 'config' must be a JSON object")
    files = meta.setdefault("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise UserError(f"{path}: 'files' must map file names to SHA-256 strings")
    for name, digest in files.items():
        file = directory / name
        if not file.is_file():
            raise UserError(f"{file} is missing (listed in {path})")
        if sha256_file(file) != digest:
            raise UserError(f"{file} does not match the SHA-256 recorded in {path}; it was changed or replaced")
    return meta


def load_model(directory: str | Path, *, kind: str | None = None) -> tuple[Model, dict]:
    """Load a model directory; returns the model (in eval mode) and its config.json contents.

    ``kind`` refuses a model of another kind. Nothing is unpickled: weights come from
    safetensors and are checked name by name and shape by shape against the config.
    """
    directory = model_dir(directory)
    meta = read_meta(directory)
    if kind is not None and meta["kind"] != kind:
        raise UserError(f"{directory} holds a {meta['kind']} model; this needs a {kind} model")
    model = build_model(meta["kind"], meta["config"])
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{weights} is missing")
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as e:
        raise UserError(f"{weights} cannot be read as safetensors: {e}") from None
    expected = _unique_state(model)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        parts = [
            f"missing {', '.join(missing[:5])}" if missing else "",
            f"unexpected {', '.join(unexpected[:5])}" if unexpected else "",
        ]
        raise UserError(f"{weights} does not match its config: {'; '.join(p for p in parts if p)}")
    for name, target in expected.items():
        if tensors[name].shape != target.shape:
            raise UserError(
                f"{weights}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                f"the config needs {tuple(target.shape)}"
            )
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name])
    return model.eval(), meta
