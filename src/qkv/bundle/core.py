"""The bundle itself: :func:`load` (a model directory or training run -> a :class:`Bundle`: the
model prepared for its jobs, its tokenizers, its config.json read once, and what that file
records about using it: the audio features, the decoding defaults of its recipe, an imported
Whisper's start tokens, an embedding's settings, a text-to-speech model's voices and reading,
an imported chat model's template), and :class:`Bundle`, whose methods (``translate``,
``transcribe``, ``speak``, ``embed``, ``generate``, ``chat``) wrap the job functions for a
Python user.

What is not here: the jobs themselves (``translation.py``, ``transcription.py``,
``speaking.py``, ``embedding.py``, ``generation.py``, which this module imports; they name
:class:`Bundle` for type checking only), the constraints (``constraints.py``), what the modules
share (``defaults.py``), what loading is built on (``qkv.checkpoint``, ``qkv.loading``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.audio import FeatureConfig
from qkv.bundle.defaults import JOBS, Audio, DecodeDefaults, Sampling, _listed, _one_audio, require
from qkv.bundle.embedding import embeddings
from qkv.bundle.generation import continued, generations, reply
from qkv.bundle.speaking import piper_speeches, speeches
from qkv.bundle.transcription import TranscriptionOptions, WhisperOptions, ctc_timed_words, transcriptions
from qkv.bundle.translation import translations
from qkv.checkpoint import load_model, model_dir, read_meta
from qkv.conversation import Conversation
from qkv.embedding import EmbeddingSettings
from qkv.errors import OptionError, UserError
from qkv.hf.whisper import WhisperSettings, settings_in
from qkv.loading import KIND_NAMES, check_options, matching_vocabularies, prepared, reading_as_trained
from qkv.longform import LongForm
from qkv.subtitles import Heard
from qkv.tasks.tts import speaking_of
from qkv.tokenization import Vocabularies
from qkv.vocoder import write_wav

NEEDING = {  # what a model directory without its tokenizer cannot do, by kind
    "encoder_decoder": "translating",
    "decoder_only": "generating",
    "encoder_only": "embedding",
    "speech_encoder_decoder": "transcribing",
    "tts": "speaking",
    "vits": "speaking",
}


@dataclass(frozen=True, eq=False)
class Bundle:
    """A model directory loaded for use (:func:`load`): the model and everything known about it.

    Attributes:
        path: the model directory (of a training run: its final checkpoint).
        kind: the model's kind; :attr:`jobs` says what it does.
        model: the model as its jobs run it (``loading.prepared``: the decoding copy, the
            precision, the device).
        vocab: its tokenizers (one joint tokenizer as both sides but for an encoder-decoder
            with separate vocabularies; a text-to-speech model's symbols).
        meta: its config.json, read once.
        precision: "float32", "bf16" or "int8".
        decode: the decoding defaults of its recipe.
        features: the audio features a speech model reads or a text-to-speech model writes
            (None for a text model).
        whisper: an imported Whisper's start-token settings (else None).
        embedding: what an encoder_only model records for embedding (else None).
        speaking: how a text-to-speech model reads and when it stops, as its recipe says
            (``tasks.tts.speaking_of``; else None).
        speakers: a text-to-speech model's voices (empty: one voice).
        conversation: an imported chat model's template, end-of-turn tokens and sampling
            defaults (``conversation.Conversation``; None: it has no chat template, and chats
            with turns joined by a separator).
    """

    path: Path
    kind: str
    model: nn.Module
    vocab: Vocabularies
    meta: dict
    precision: str = "float32"
    decode: DecodeDefaults = field(default_factory=DecodeDefaults)
    features: FeatureConfig | None = None
    whisper: WhisperSettings | None = None
    embedding: EmbeddingSettings | None = None
    speaking: dict | None = None
    speakers: tuple[str, ...] = ()
    conversation: Conversation | None = None

    @property
    def jobs(self) -> tuple[str, ...]:
        return JOBS[self.kind]

    @property
    def window(self) -> int:
        """The model's window: its decoder's (or encoder's) positions, ``max_len``."""
        return self.model.config.max_len

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def sample_rate(self) -> int:
        """The rate of the audio a speech model reads or a text-to-speech model writes (Hz)."""
        if self.kind == "vits":
            return self.model.config.sample_rate
        if self.features is None:
            raise UserError(f"{self.path} holds {KIND_NAMES[self.kind]}, which neither reads nor writes audio")
        return self.features.sample_rate

    @property
    def longest_speech(self) -> float:
        """The seconds a text-to-speech model's window holds: ``max_len`` steps of r frames."""
        self.require("speak")
        c = self.model.config
        return c.max_len * c.reduction * c.features.hop_length / c.features.sample_rate

    def require(self, job: str) -> None:
        """Refuse, in one line naming what the model does, a ``job`` it cannot do."""
        require(self.path, self.kind, job)

    def translate(
        self,
        texts: str | Sequence[str],
        *,
        beam_size: int | None = None,
        prefix: str | None = None,
        ban: Sequence[str] = (),
        require: Sequence[str] = (),
        terms: Sequence[tuple[str, str]] = (),
    ) -> str | list[str]:
        """Each text's best translation (a text: its translation), by :func:`translations`, with
        its constraints (:func:`constraints`)."""
        found = translations(
            self, _listed(texts), beam_size=beam_size, prefix=prefix, ban=ban, require=require, terms=terms
        )
        best = [hyps[0].text for hyps in found]
        return best[0] if isinstance(texts, str) else best

    def transcribe(
        self,
        audio: Audio | Sequence[Audio],
        *,
        beam_size: int | None = None,
        language: str | None = None,
        task: str | None = None,
        prefix: str | None = None,
        ban: Sequence[str] = (),
        require: Sequence[str] = (),
        timestamps: bool | None = None,
        word_timestamps: bool = False,
        batched: int | None = None,
    ) -> Heard | list[Heard]:
        """Each file's or waveform's transcript (one: its transcript), by :func:`transcriptions`:
        a :class:`~qkv.subtitles.Heard`, the text itself (a ``str``) with ``.segments`` (each
        with its start and end in seconds) and ``.language``. ``language`` and ``task``
        ("transcribe" or "translate"): an imported Whisper's, which reads audio of any length and
        times its segments with its timestamps (``timestamps``; None: yes for a Whisper, whose
        segments are then timed; a model of qkv's own gives one segment per input); ``prefix``,
        ``ban``, ``require``: constraints (:func:`constraints`). ``word_timestamps``: the segments
        carry their words, each timed (``Segment.words``, ``word_timing.py``): an imported
        Whisper's by its alignment heads, a model of qkv's own by its CTC head. ``batched`` (N):
        an imported Whisper reads long audio as faster-whisper's batched mode does, its speech in
        chunks of at most 30 s (voice activity), N decoded at once, none after the previous text
        (faster; ``longform_batched.py``); None: 30 s windows in turn, each after the previous text."""
        if word_timestamps and self.whisper is None and not getattr(self.model.config, "ctc", False):
            raise OptionError(
                "word_timestamps: for an imported Whisper, or a speech model with a CTC head", "word_timestamps"
            )
        one = _one_audio(audio)
        inputs = [audio] if one else list(audio)
        whisper = WhisperOptions(
            language=language,
            task=task,
            timestamps=word_timestamps or (self.whisper is not None if timestamps is None else timestamps),
            long_form=LongForm(word_timestamps=True) if word_timestamps else None,
            batched=batched,
        )
        options = TranscriptionOptions(beam_size=beam_size, prefix=prefix, ban=ban, require=require, whisper=whisper)
        found = transcriptions(self, inputs, options)
        if word_timestamps and self.whisper is None:
            found = [ctc_timed_words(self, item, i, t) for i, (item, t) in enumerate(zip(inputs, found, strict=True))]
        heard = [Heard(t.text, t.segments, t.language) for t in found]
        return heard[0] if one else heard

    def speak(
        self, texts: str | Sequence[str], *, speaker: str | None = None, seed: int | None = 0
    ) -> Tensor | list[Tensor]:
        """Each text spoken: a waveform (N,) at :attr:`sample_rate` (a text: its waveform), by
        :func:`speeches` (an imported Piper voice: :func:`piper_speeches`); :meth:`write_wav` writes one."""
        if self.kind == "vits":
            waves = piper_speeches(self, _listed(texts), speaker=speaker, seed=seed)
            return waves[0] if isinstance(texts, str) else waves
        waves = [wave for _, wave in speeches(self, _listed(texts), speaker=speaker, seed=seed)]
        return waves[0] if isinstance(texts, str) else waves

    def write_wav(self, path: str | Path, waveform: Tensor, *, rate: int | None = None) -> Path:
        """Write ``waveform`` (at :attr:`sample_rate`) as a 16-bit WAV file at ``rate`` (default: the model's)."""
        return write_wav(path, waveform, self.sample_rate, rate=rate)

    def embed(self, texts: str | Sequence[str], *, pooling: str | None = None, normalize: bool | None = None) -> Tensor:
        """Each text's vector, by :func:`embeddings`. Shapes: texts N -> (N, D); a text -> (D,)."""
        vectors = embeddings(self, _listed(texts), pooling=pooling, normalize=normalize).vectors  # (N, D)
        return vectors[0] if isinstance(texts, str) else vectors

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        max_new_tokens: int = 64,
        beam_size: int = 1,
        sampling: Sampling | None = None,
        prefix: str | None = None,
        ban: Sequence[str] = (),
        require: Sequence[str] = (),
    ) -> str | list[str]:
        """Each input's output, by :func:`generations`: greedy, beam search or drawn, with its
        constraints (:func:`constraints`). One prompt to a language model, beam 1, without
        constraints, is continued past the window as it slides (:func:`continued`, as ``qkv
        generate --prompt`` streams it)."""
        plain = prefix is None and not ban and not require
        if isinstance(prompts, str) and self.kind == "decoder_only" and beam_size == 1 and plain:
            return "".join(continued(self, prompts, max_new_tokens=max_new_tokens, sampling=sampling))
        found = generations(
            self,
            _listed(prompts),
            max_new_tokens=max_new_tokens,
            beam_size=beam_size,
            sampling=sampling,
            prefix=prefix,
            ban=ban,
            require=require,
        )
        texts = [outputs[0].text for outputs in found]
        return texts[0] if isinstance(prompts, str) else texts

    def chat(
        self,
        turns: Sequence[str],
        *,
        separator: str = " __eou__ ",
        max_new_tokens: int = 60,
        sampling: Sampling | None = None,
        system: str | None = None,
        repetition_penalty: float = 1.0,
    ) -> str:
        """The next turn after ``turns`` (the dialogue so far, oldest first: the user's, the
        model's, ...), by :func:`reply`: through the model's chat template where it has one
        (``system``: the system prompt), else joined by ``separator``."""
        if isinstance(turns, str):
            raise TypeError("turns is the dialogue so far: a list of turns, oldest first")
        chosen = None if sampling is None else sampling.chooser(self.device)
        return reply(
            self,
            turns,
            separator=separator,
            max_new_tokens=max_new_tokens,
            choose=chosen,
            system=system,
            repetition_penalty=repetition_penalty,
        )


def load(
    path: str | Path, *, bf16: bool = False, int8: bool = False, device: str = "cpu", job: str | None = None
) -> Bundle:
    """The model directory (or training run) ``path``, loaded once for every job its model does.

    Its config.json is read (and every file it lists checked against its SHA-256) once. The
    model is prepared as its jobs run it: a decoding copy for the kinds that decode, in
    bfloat16 (``bf16``) or with int8 linear layers (``int8``: the decoding kinds, on the CPU),
    on ``device``; an option that does not apply to the kind is refused in one line. ``job``
    (one of :data:`DOES`): what the caller means to do, refused before the weights are read
    when the model cannot do it.
    """
    directory = model_dir(path)
    meta = read_meta(directory)  # the one read
    kind = meta["kind"]
    if job is not None:
        require(directory, kind, job)
    check_options(directory, kind, bf16=bf16, int8=int8, device=device)
    model, _ = load_model(directory, meta=meta)
    model = prepared(model, kind, bf16=bf16, int8=int8, device=device)
    vocab = (  # a Piper voice reads phonemes by its piper.json (qkv.piper), not a tokenizer
        matching_vocabularies(str(directory), model, files=meta.get("files", {}), use=NEEDING[kind])
        if kind != "vits"
        else None
    )
    config_file = directory / "config.json"
    return Bundle(
        path=directory,
        kind=kind,
        model=model,
        vocab=reading_as_trained(vocab, meta.get("recipe")) if vocab is not None else None,
        meta=meta,
        precision="bf16" if bf16 else "int8" if int8 else "float32",
        decode=DecodeDefaults.of(meta.get("recipe"), ctc=getattr(model, "ctc", None) is not None),
        features=getattr(model.config, "features", None),
        whisper=settings_in(meta, config_file) if "whisper" in meta else None,
        embedding=EmbeddingSettings.read(meta, config_file, model_max_len=model.config.max_len)
        if kind == "encoder_only"
        else None,
        speaking=speaking_of(meta) if kind == "tts" else None,
        speakers=tuple(meta.get("speakers") or ()),
        conversation=_conversation(directory, meta, model, vocab) if kind == "decoder_only" else None,
    )


def _conversation(directory: Path, meta: dict, model: nn.Module, vocab: Vocabularies | None) -> Conversation | None:
    """An imported chat model's template, end-of-turn ids and sampling defaults (None: no template)."""
    if vocab is None:
        return None
    token_of = vocab.target.backend.id_to_token
    return Conversation.read(directory, meta.get("files", {}), eos_id=model.config.eos_id, token_of=token_of)
