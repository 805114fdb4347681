"""A model directory loaded once, with everything known about it, and the jobs it does.

What is here: :func:`load` (a model directory or training run -> a :class:`Bundle`: the model
prepared for its jobs, its tokenizers, its config.json read once, and what that file records
about using it: the audio features, the decoding defaults of its recipe (:class:`DecodeDefaults`),
an imported Whisper's start tokens, an embedding's settings, a text-to-speech model's voices and
reading), and one function per job, which the command line calls and the bundle's methods wrap
for a Python user (``m = qkv.load("runs/de_en"); m.translate(["Ein Hund läuft."])``):
:func:`translations`, :func:`transcriptions` (its options one :class:`TranscriptionOptions`, as
openai/whisper's ``DecodingOptions``; with :func:`read_audio`, files as the model reads them),
:func:`speeches`, :func:`embeddings`, :func:`generations` (with :func:`window_fit`, the rule by
which inputs fit the model's window, and :func:`continued`, a language model's continuation
piece by piece), :func:`reply` and, for an imported chat model with a chat template
(``Bundle.conversation``), :func:`chat_reply` (the reply streamed piece by piece) with
:func:`as_messages` (a dialogue as the template's messages). The decoding jobs take constraints alike
(:func:`constraints`: a forced ``prefix``, banned words ``ban``, required words ``require`` and,
for translation, ``terms`` read by :func:`read_terms`), and apply an imported checkpoint's own
``bad_words_ids``.

A job the model cannot do, and an option that does not apply to it, is refused in one line
(a :class:`~qkv.errors.UserError`; an :class:`~qkv.errors.OptionError` names the option as the
library spells it, ``ctc_weight``, which a command names as its flag), never ignored.

This file only gathers the names; each is defined in one module of the package, bottom up:

    defaults.py        what the others share: JOBS, DOES, require, DecodeDefaults, Sampling, Audio
    constraints.py     constraints, Constraints, read_terms
    translation.py     translations
    transcription.py   transcriptions, TranscriptionOptions (WhisperOptions, OwnModelOptions),
                       Transcript, read_audio, long_transcript, whisper_rules, checked_heads,
                       ctc_timed_words, LM_WEIGHT
    speaking.py        speeches, piper_speeches, neural_vocoder, PIECE_PAUSE
    embedding.py       embeddings, Embedded
    generation.py      generations, Generated, window_cut, window_fit, WindowFit, continued,
                       reply, chat_reply, as_messages
    core.py            Bundle (its methods call the jobs) and load

The job modules name :class:`Bundle` for type checking only, so ``core.py`` imports them and no
import goes round. A test that replaces one of these names for the command line patches
``qkv.bundle`` (the commands import from here when they run); one that replaces a name a job
looks up patches the module that job is in.

What is not here: what loading is built on (``checkpoint.py``, ``loading.py``), the decoding
(``decoding/``, ``seq2seq.py``, ``chat.py``, ``streaming.py``), the tasks' own decoders
(``tasks/asr.py``'s ``transcribe``, ``tasks/tts.py``'s ``speak``), flags and printing (``cli/``).
"""

from __future__ import annotations

from qkv.bundle.constraints import Constraints, constraints, read_terms
from qkv.bundle.core import NEEDING, Bundle, load
from qkv.bundle.defaults import DOES, JOBS, Audio, DecodeDefaults, Sampling, require
from qkv.bundle.embedding import Embedded, embeddings
from qkv.bundle.generation import (
    Generated,
    WindowFit,
    as_messages,
    chat_reply,
    continued,
    generations,
    reply,
    window_cut,
    window_fit,
)
from qkv.bundle.speaking import PIECE_PAUSE, neural_vocoder, piper_speeches, speeches
from qkv.bundle.transcription import (
    LM_WEIGHT,
    OwnModelOptions,
    Transcript,
    TranscriptionOptions,
    WhisperOptions,
    checked_heads,
    ctc_timed_words,
    long_transcript,
    read_audio,
    transcriptions,
    whisper_rules,
)
from qkv.bundle.translation import TRANSLATE_CHUNK, translations

__all__ = [
    "DOES",
    "JOBS",
    "LM_WEIGHT",
    "NEEDING",
    "PIECE_PAUSE",
    "TRANSLATE_CHUNK",
    "Audio",
    "Bundle",
    "Constraints",
    "DecodeDefaults",
    "Embedded",
    "Generated",
    "OwnModelOptions",
    "Sampling",
    "Transcript",
    "TranscriptionOptions",
    "WhisperOptions",
    "WindowFit",
    "as_messages",
    "chat_reply",
    "checked_heads",
    "constraints",
    "continued",
    "ctc_timed_words",
    "embeddings",
    "generations",
    "load",
    "long_transcript",
    "neural_vocoder",
    "piper_speeches",
    "read_audio",
    "read_terms",
    "reply",
    "require",
    "speeches",
    "transcriptions",
    "translations",
    "whisper_rules",
    "window_cut",
    "window_fit",
]
