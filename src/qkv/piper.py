"""Speaking with an imported Piper voice: text to espeak-ng phonemes as Piper makes them, to the
voice's phoneme ids, to a waveform by :class:`~qkv.models.vits.Vits`.

What is here: :class:`Voice` (what a voice's ``piper.json`` says about reading text),
:func:`phonemize` (sentences of phonemes), :func:`phoneme_ids` (Piper's id rules: ``^`` first,
``$`` last, the pad ``_`` after every phoneme) and :func:`speak` (a text's sentences spoken one
by one, each scaled to peak 1 as Piper does, and joined).

Phonemes come from espeak-ng through ``piper-tts``'s bridge (``pip install piper-tts``), not
the ``espeak-ng`` program qkv's corpora call: a voice was trained on the phonemes of that
espeak-ng build (its data ships with piper-tts), and only its library call reports each
clause's punctuation (``espeak_TextToPhonemesWithTerminator``, which the espeak-ng 1.51 of
Debian and Ubuntu lacks), which Piper keeps as phonemes. What qkv does on top of the bridge is
Piper's own: language-switch marks dropped, the clause's punctuation kept (with a space after
``, : ;``), Unicode NFD (accents become phonemes of their own), sentences where espeak-ng ends
them.

What is not here: the model (``models/vits.py``), reading a Piper ONNX file (``hf/piper.py``),
``[[ raw phonemes ]]`` blocks and vowel clusters (no espeak-ng English voice uses them).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qkv.errors import UserError
from qkv.files import read_json_object
from qkv.models.vits import Vits

BOS, EOS, PAD = "^", "$", "_"  # Piper's begin, end and between-phonemes symbols
VOICE_FILE = "piper.json"  # the voice's .onnx.json in a qkv model directory (hf/piper.py writes it)
_LANGUAGE_SWITCH = re.compile(r"\([^)]+\)")  # espeak-ng's "(fr)word(en)" marks around foreign words
_NOT_A_SENTENCE_END = (",", ":", ";")
_INSTALL = "pip install piper-tts"


@dataclass(frozen=True)
class Voice:
    """How a Piper voice reads: its espeak-ng voice, its phoneme → ids map and its speakers.

    Attributes:
        espeak_voice: the espeak-ng voice its phonemes come from (e.g. "en-us").
        id_map: each phoneme (a Unicode code point) to its ids.
        speakers: the speakers' names by id (empty: one voice).
    """

    espeak_voice: str
    id_map: Mapping[str, Sequence[int]]
    speakers: tuple[str, ...] = ()

    @classmethod
    def read(cls, directory: str | Path) -> Voice:
        """The voice of a model directory that ``qkv import-hf VOICE.onnx`` wrote."""
        path = Path(directory) / VOICE_FILE
        if not path.is_file():
            raise UserError(f"{path} is missing: import the voice with qkv import-hf VOICE.onnx DIR")
        data = read_json_object(path)
        id_map = data.get("phoneme_id_map")
        if not isinstance(id_map, dict) or any(s not in id_map for s in (BOS, EOS, PAD)):
            raise UserError(f"{path}: phoneme_id_map is missing or lacks {BOS!r}, {EOS!r} or {PAD!r}")
        speakers = data.get("speaker_id_map") or {}
        return cls(
            espeak_voice=str((data.get("espeak") or {}).get("voice", "en-us")),
            id_map={str(k): tuple(int(i) for i in v) for k, v in id_map.items()},
            speakers=tuple(sorted(speakers, key=speakers.get)),
        )


def _bridge():
    """piper-tts's espeak-ng bridge, initialised with the espeak-ng data it ships."""
    try:
        from piper import espeakbridge
        from piper.phonemize_espeak import ESPEAK_DATA_DIR
    except ImportError:
        raise UserError(f"speaking with a Piper voice needs piper-tts's espeak-ng phonemes: {_INSTALL}") from None
    espeakbridge.initialize(str(ESPEAK_DATA_DIR))
    return espeakbridge


def phonemize(text: str, espeak_voice: str) -> list[list[str]]:
    """``text``'s sentences as Piper phonemizes them: each a list of phonemes (code points,
    punctuation included), sentences split where espeak-ng ends them."""
    bridge = _bridge()
    try:
        bridge.set_voice(espeak_voice)
    except RuntimeError:
        raise UserError(f"espeak-ng has no voice {espeak_voice!r}") from None
    sentences: list[list[str]] = []
    current: list[str] = []
    for phonemes, terminator, sentence_ends in bridge.get_phonemes(text):
        clause = _LANGUAGE_SWITCH.sub("", phonemes) + terminator
        if terminator in _NOT_A_SENTENCE_END:
            clause += " "
        current.extend(unicodedata.normalize("NFD", clause))
        if sentence_ends:
            sentences.append(current)
            current = []
    if current:
        sentences.append(current)
    return [s for s in sentences if s]


def phoneme_ids(phonemes: Sequence[str], id_map: Mapping[str, Sequence[int]]) -> list[int]:
    """Piper's ids of one sentence: ``^``, then each phoneme's ids followed by the pad's, then
    ``$`` (the pad between phonemes is what the voice learnt; a phoneme the map lacks is
    skipped, as Piper skips it)."""
    ids = [*id_map[BOS], *id_map[PAD]]
    for phoneme in phonemes:
        if phoneme in id_map:
            ids += [*id_map[phoneme], *id_map[PAD]]
    return ids + list(id_map[EOS])


def speak(
    model: Vits,
    voice: Voice,
    text: str,
    *,
    speaker: int | None = None,
    noise_scale: float | None = None,
    length_scale: float | None = None,
    noise_w: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``text`` spoken: each sentence synthesized alone, scaled to peak 1 (Piper's
    ``normalize_audio``) and the sentences joined; the scales default to the voice's.
    Shapes: -> (samples,) at ``model.config.sample_rate``."""
    device = next(model.parameters()).device
    pieces = []
    for sentence in phonemize(text, voice.espeak_voice):
        ids = torch.tensor([phoneme_ids(sentence, voice.id_map)], device=device)  # (1, S)
        speech = model(
            ids,
            torch.tensor([ids.shape[1]], device=device),
            speakers=None if speaker is None else torch.tensor([speaker], device=device),
            noise_scale=noise_scale,
            length_scale=length_scale,
            noise_w=noise_w,
            generator=generator,
        )
        wave = speech.waveform[0, : int(speech.lengths[0])]
        peak = wave.abs().max()
        pieces.append((wave / peak if peak >= 1e-8 else torch.zeros_like(wave)).clamp(-1, 1))
    return torch.cat(pieces) if pieces else torch.zeros(0, device=device)
