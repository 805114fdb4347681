"""A model directory loaded once, with everything known about it, and the jobs it does.

What is here: :func:`load` (a model directory or training run -> a :class:`Bundle`: the model
prepared for its jobs, its tokenizers, its config.json read once, and what that file records
about using it: the audio features, the decoding defaults of its recipe (:class:`DecodeDefaults`),
an imported Whisper's start tokens, an embedding's settings, a text-to-speech model's voices and
reading), and one function per job, which the command line calls and the bundle's methods wrap
for a Python user (``m = qkv.load("runs/de_en"); m.translate(["Ein Hund läuft."])``):
:func:`translations`, :func:`transcriptions` (with :func:`read_audio`, files as the model reads
them), :func:`speeches`, :func:`embeddings`, :func:`generations` (with :func:`window_fit`, the
rule by which inputs fit the model's window, and :func:`continued`, a language model's
continuation piece by piece), :func:`reply` and, for an imported chat model with a chat template
(``Bundle.conversation``), :func:`chat_reply` (the reply streamed piece by piece) with
:func:`as_messages` (a dialogue as the template's messages). The decoding jobs take constraints alike
(:func:`constraints`: a forced ``prefix``, banned words ``ban``, required words ``require`` and,
for translation, ``terms`` read by :func:`read_terms`), and apply an imported checkpoint's own
``bad_words_ids``.

A job the model cannot do, and an option that does not apply to it, is refused in one line
(a :class:`~qkv.errors.UserError`; an :class:`~qkv.errors.OptionError` names the option as the
library spells it, ``ctc_weight``, which a command names as its flag), never ignored.

What is not here: what loading is built on (``checkpoint.py``, ``loading.py``), the decoding
(``decoding/``, ``seq2seq.py``, ``chat.py``, ``streaming.py``), the tasks' own decoders
(``tasks/asr.py``'s ``transcribe``, ``tasks/tts.py``'s ``speak``), flags and printing (``cli/``).
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from qkv.audio import FeatureConfig, check_many, features
from qkv.audio_stream import AudioSource
from qkv.chat import draw, template_reply
from qkv.chat import reply as next_turn
from qkv.checkpoint import load_model, model_dir, read_meta
from qkv.conversation import Conversation
from qkv.decoding import (
    AT_START,
    BannedSequences,
    BannedWords,
    Required,
    Scorer,
    beam_search,
    constrained_beam_search,
    generate,
    greedy,
    most_likely,
    sampler,
)
from qkv.embedding import Choice, EmbeddingSettings, choose, sentence_embeddings
from qkv.ensemble import Ensemble
from qkv.errors import OptionError, UserError
from qkv.hf.whisper import WhisperSettings, most_likely_languages, settings_in
from qkv.loading import KIND_NAMES, check_options, load_fusion_lm, matching_vocabularies, prepared, reading_as_trained
from qkv.longform import LongForm, MelWindows, WhisperTokens, transcribe_long
from qkv.piper import Voice
from qkv.piper import speak as speak_piper
from qkv.recipes import upgrade_stored
from qkv.seq2seq import Translation, cut_source, translate
from qkv.speakable import FASTEST, TooLong, most_characters, split_text
from qkv.streaming import continuation_text
from qkv.subtitles import Heard, Segment
from qkv.synthesis import Synthesis
from qkv.tasks.asr import too_short, transcribe
from qkv.tasks.tts import speak, speaking_of
from qkv.tokenization import Tokenizer, Vocabularies
from qkv.vad import Vad, piece_waves, speech_pieces
from qkv.vocoder import write_wav
from qkv.word_timing import UNSPACED, ctc_timed

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
NEEDING = {  # what a model directory without its tokenizer cannot do, by kind
    "encoder_decoder": "translating",
    "decoder_only": "generating",
    "encoder_only": "embedding",
    "speech_encoder_decoder": "transcribing",
    "tts": "speaking",
    "vits": "speaking",
}
LM_WEIGHT = 0.3  # ESPnet's usual shallow-fusion weight; bench/asr.py --lm-weight measures others
TRANSLATE_CHUNK = 1024  # texts translated per call: bounded memory (each is batched by tokens inside)
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
    ) -> Heard | list[Heard]:
        """Each file's or waveform's transcript (one: its transcript), by :func:`transcriptions`:
        a :class:`~qkv.subtitles.Heard`, the text itself (a ``str``) with ``.segments`` (each
        with its start and end in seconds) and ``.language``. ``language`` and ``task``
        ("transcribe" or "translate"): an imported Whisper's, which reads audio of any length and
        times its segments with its timestamps (``timestamps``; None: yes for a Whisper, whose
        segments are then timed; a model of qkv's own gives one segment per input); ``prefix``,
        ``ban``, ``require``: constraints (:func:`constraints`). ``word_timestamps``: the segments
        carry their words, each timed (``Segment.words``, ``word_timing.py``): an imported
        Whisper's by its alignment heads, a model of qkv's own by its CTC head."""
        if word_timestamps and self.whisper is None and not getattr(self.model.config, "ctc", False):
            raise OptionError(
                "word_timestamps: for an imported Whisper, or a speech model with a CTC head", "word_timestamps"
            )
        one = _one_audio(audio)
        inputs = [audio] if one else list(audio)
        found = transcriptions(
            self,
            inputs,
            beam_size=beam_size,
            language=language,
            task=task,
            prefix=prefix,
            ban=ban,
            require=require,
            timestamps=word_timestamps or (self.whisper is not None if timestamps is None else timestamps),
            long_form=LongForm(word_timestamps=True) if word_timestamps else None,
        )
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


# ----------------------------------------------------------------------------- constraints


@dataclass(frozen=True)
class Constraints:
    """A decoding job's constraints as its search takes them (:func:`constraints`).

    Attributes:
        shown: the forced prefix's target tokens: decoded first (after an encoder-decoder's
            BEGIN, at the end of a language model's prompt) and part of every output.
        scorers: the bans (the checkpoint's ``bad_words_ids``, the banned words).
        required: each input's required terms (None: plain search, no term anywhere).
    """

    shown: list[int] = field(default_factory=list)
    scorers: tuple[Scorer, ...] = ()
    required: list[list[Required]] | None = None

    def forced(self, bundle: Bundle) -> list[int] | None:
        """An encoder-decoder's forced first tokens (BEGIN, then the prefix), or None: BEGIN alone."""
        return [bundle.model.config.bos_id, *self.shown] if self.shown else None


def constraints(
    bundle: Bundle,
    sources: Sequence[str | None],
    *,
    prefix: str | None = None,
    ban: Sequence[str] = (),
    require: Sequence[str] = (),
    terms: Sequence[tuple[str, str]] = (),
    beam_size: int = 1,
    sampling: bool = False,
) -> Constraints:
    """What a job's outputs must obey, for inputs whose texts are ``sources`` (None: audio).

    ``prefix``: text every output starts with, as written (encoded without special tokens; an
    imported Whisper's after a space, as openai/whisper does); it is part of the output text.
    ``ban``: words no output writes, however the tokens spell them (``decoding.BannedWords``:
    where a word starts, as written, and so also the words it starts). ``require``: words every
    output contains, and ``terms``: (source, target) pairs whose target is required of each input
    whose text holds the source as a word (as written); both need beam search
    (``decoding.constrained_beam_search``) and are forced as the tokenizer writes them at a
    text's start or after a space. A word the prefix already writes is not required again. An
    imported checkpoint's ``bad_words_ids`` (config.json's ``hf``) are banned whatever is given.
    Without any, a job decodes exactly as it does without constraints.
    """
    if (require or terms) and (sampling or beam_size < 2):
        named = [name for name, given in (("require", require), ("terms", terms)) if given]
        how = ("sampling", "draws each token") if sampling else ("beam_size", f"{beam_size} is greedy decoding")
        need = "needs" if len(named) == 1 else "need"
        raise OptionError(f"{' and '.join(named)} {need} beam search: {how[0]} {how[1]}", *named, how[0])
    target = bundle.vocab.target
    shown = _prefix_tokens(bundle, prefix)
    written = target.decode(shown)
    scorers: list[Scorer] = _checkpoint_bans(bundle, shown)
    words = _words(ban, "ban")
    if words:
        for word in words:
            if _starts_word(word, written):
                raise OptionError(f"prefix {prefix!r} writes the banned word {word!r}", "prefix", "ban")
        scorers.append(BannedWords(words, target.token_texts(), after=written))
    wanted = _words(require, "require")
    both = sorted(set(words) & set(wanted))
    if both:
        raise OptionError(f"{both[0]!r} is both banned and required", "ban", "require")
    if not wanted and not terms:
        return Constraints(shown, tuple(scorers), None)
    return Constraints(shown, tuple(scorers), _required(target, sources, wanted, terms, written))


def _required(
    target: Tokenizer,
    sources: Sequence[str | None],
    wanted: list[str],
    terms: Sequence[tuple[str, str]],
    written: str,
) -> list[list[Required]]:
    """Each input's required terms: the ``wanted`` words and the targets of the ``terms`` whose
    source its text holds, each once, but those the prefix (``written``) already writes. After a
    prefix, the output's first tokens follow text: a word may not be written there as at a
    text's start (it would be glued to the prefix, " A" + "dog")."""
    at_start = not written
    ways = {word: _ways(target, word, "require", at_start=at_start) for word in wanted}
    required = []
    for text in sources:
        # A substring test first: a long glossary meets each text in C before any pattern does.
        found = [t for s, t in terms if text is not None and s in text and _holds_word(text, s)]
        for word in found:
            if word not in ways:
                ways[word] = _ways(target, word, "terms", at_start=at_start)
        required.append([ways[word] for word in dict.fromkeys(wanted + found) if not _holds_word(written, word)])
    return required


def read_terms(path: str | Path) -> list[tuple[str, str]]:
    """Terminology from a file of SOURCE<TAB>TARGET lines (UTF-8; blank lines skipped), as
    :func:`translations` takes it; a line that is not two non-empty fields is refused naming
    the file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read terms {path}: {getattr(e, 'strerror', None) or 'not UTF-8 text'}") from None
    pairs = []
    for number, line in enumerate(lines, 1):
        fields = line.split("\t")
        if not line.strip():
            continue
        if len(fields) != 2 or not fields[0].strip() or not fields[1].strip():
            raise UserError(f"{path}:{number}: expected SOURCE<TAB>TARGET, two non-empty fields; got {line!r}")
        pairs.append((fields[0].strip(), fields[1].strip()))
    return pairs


def _words(given: Sequence[str], option: str) -> list[str]:
    """The words of a ``ban`` or ``require`` option, stripped, each once; an empty one refused."""
    if isinstance(given, str):
        raise OptionError(f"{option} is a list of words, not one string", option)
    words = [w.strip() for w in given]
    if any(not w for w in words):
        raise OptionError(f"{option}: give words, not an empty one", option)
    return list(dict.fromkeys(words))


def _starts_word(word: str, text: str) -> bool:
    """Whether ``text`` writes ``word`` where a word starts (as ``decoding.BannedWords`` matches)."""
    boundary = r"(?<!\w)" if re.match(r"\w", word) else ""  # a word starting with "$" starts anywhere
    return re.search(boundary + re.escape(word), text) is not None


def _holds_word(text: str, word: str) -> bool:
    """Whether ``text`` holds ``word`` as a word of its own (nothing of a word just before or after it)."""
    return re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", text) is not None


def _ways(tokenizer: Tokenizer, word: str, option: str, *, at_start: bool = True) -> Required:
    """A required word as token sequences: as the tokenizer writes it after a space (the tokens
    "a " + word adds to "a") and, where that differs and ``at_start``, at a text's start (only
    there: glued to other text it would write another word), without any unknown token."""
    alone = tuple(tokenizer.encode(word, add_special_tokens=False))
    head = tokenizer.encode("a", add_special_tokens=False)
    spaced = tokenizer.encode("a " + word, add_special_tokens=False)
    after_space = tuple(spaced[len(head) :]) if spaced[: len(head)] == head else ()
    ways = {w for w in (alone if at_start else (), after_space) if w and tokenizer.unk_id not in w}
    ways = {w if w == after_space else (AT_START, *w) for w in ways}
    if not ways:
        raise OptionError(f"{option} {word!r}: the model's vocabulary cannot write it", option)
    return Required(tuple(sorted(ways)))


def _prefix_tokens(bundle: Bundle, prefix: str | None) -> list[int]:
    """The target tokens of a forced ``prefix`` (none without one); one the vocabulary cannot
    write, or longer than half the window, is refused."""
    if prefix is None:
        return []
    target, half = bundle.vocab.target, bundle.window // 2
    ids = target.encode(" " + prefix.strip() if bundle.whisper is not None else prefix, add_special_tokens=False)
    if not ids or target.unk_id in ids:
        raise OptionError(f"prefix {prefix!r}: the model's vocabulary cannot write it", "prefix")
    if len(ids) > half:
        raise OptionError(f"prefix {prefix!r} is {len(ids)} tokens; the model's window takes at most {half}", "prefix")
    return ids


def _checkpoint_bans(bundle: Bundle, shown: list[int]) -> list[Scorer]:
    """An imported checkpoint's ``bad_words_ids`` (config.json's ``hf``), as Hugging Face's
    generation applies them (e.g. Marian's padding token, never written); none for others."""
    sequences = (bundle.meta.get("hf") or {}).get("bad_words_ids")
    if not sequences:
        return []
    vocab = getattr(bundle.model.config, "tgt_vocab_size", None) or bundle.model.config.vocab_size
    good = isinstance(sequences, list) and all(
        isinstance(seq, list) and seq and all(type(t) is int and 0 <= t < vocab for t in seq) for seq in sequences
    )
    if not good:
        raise UserError(f"{bundle.path / 'config.json'}: hf.bad_words_ids must be lists of token ids below {vocab}")
    return [BannedSequences(sequences, after=shown)]


# ----------------------------------------------------------------------------- translate


def translations(
    bundle: Bundle,
    texts: Sequence[str],
    *,
    beam_size: int | None = None,
    nbest: int = 1,
    length_penalty: float | None = None,
    max_len_a: float | None = None,
    max_len_b: int | None = None,
    max_tokens: int = 8192,
    ensemble: Sequence[Bundle] = (),
    on_batch: Callable[[int], None] | None = None,
    prefix: str | None = None,
    ban: Sequence[str] = (),
    require: Sequence[str] = (),
    terms: Sequence[tuple[str, str]] = (),
) -> list[list[Translation]]:
    """Each text's ``nbest`` best translations, in input order (``seq2seq.translate``: beam
    search over batches of similar length, at most ``max_tokens`` source tokens times the beam
    each; a source cut to the window; an empty text gives empty outputs). Unset settings are
    the recipe's (:attr:`Bundle.decode`). ``ensemble``: other encoder_decoder models with the
    same vocabularies, decoded with this one as one (the mean of their distributions).
    ``on_batch(n)`` after every n texts (a progress bar). ``prefix``, ``ban``, ``require``,
    ``terms``: constraints (:func:`constraints`; a translation's tokens and text start with the
    prefix's)."""
    bundle.require("translate")
    d = bundle.decode
    beam = d.beam_size if beam_size is None else beam_size
    if nbest > beam:
        raise OptionError(f"nbest {nbest} needs beam_size of at least {nbest}", "nbest", "beam_size")
    a = d.max_len_a if max_len_a is None else max_len_a
    b = d.max_len_b if max_len_b is None else max_len_b
    if a == 0 and b == 0:  # a*S + b = 0 tokens for every source: nothing could be written
        raise OptionError("max_len_a 0 and max_len_b 0 allow no output token; raise either", "max_len_a", "max_len_b")
    model = _ensemble(bundle, ensemble) if ensemble else bundle.model
    steer = constraints(bundle, texts, prefix=prefix, ban=ban, require=require, terms=terms, beam_size=beam)
    found: list[list[Translation]] = []
    for start in range(0, len(texts), TRANSLATE_CHUNK):
        chunk = list(texts[start : start + TRANSLATE_CHUNK])
        required = None if steer.required is None else steer.required[start : start + TRANSLATE_CHUNK]
        found += translate(
            model,
            bundle.vocab,
            chunk,
            beam_size=beam,
            nbest=nbest,
            length_penalty=d.length_penalty if length_penalty is None else length_penalty,
            max_len_a=a,
            max_len_b=b,
            max_tokens=max_tokens,
            prefix=steer.shown,
            scorers=steer.scorers,
            required=required,
        )
        if on_batch is not None:
            on_batch(len(chunk))
    return found


def _ensemble(bundle: Bundle, others: Sequence[Bundle]) -> Ensemble:
    """The bundle's model and the ``others``' as one :class:`~qkv.ensemble.Ensemble`; each must
    be an encoder_decoder with the bundle's vocabularies (the same tokenizers, special tokens
    and settings)."""
    models = [bundle.model]
    for other in others:
        if other.kind != "encoder_decoder":
            raise OptionError(
                f"ensemble {other.path} holds {KIND_NAMES[other.kind]}; translating together needs encoder_decoder "
                "models",
                "ensemble",
            )
        if not other.vocab.same_as(bundle.vocab):
            raise OptionError(
                f"ensemble {other.path}: its tokenizer, or how it reads sources (data.source_as_transcript), "
                f"differs from {bundle.path}'s; ensembled models must share their vocabularies",
                "ensemble",
            )
        try:  # Ensemble's own checks (special ids, vocabulary sizes), this model against the bundle's
            Ensemble((bundle.model, other.model))
        except ValueError as e:
            raise OptionError(f"ensemble {other.path} does not fit {bundle.path} ({e})", "ensemble") from None
        models.append(other.model)
    return Ensemble(tuple(models))


# ----------------------------------------------------------------------------- transcribe


@dataclass(frozen=True)
class Transcript:
    """One input's transcription: its text (stripped), its token ids, the language it was
    decoded as (an imported multilingual Whisper's, given or detected; else None), the seconds
    its features took, its share of its batch's decoding seconds, and its segments (with their
    times: an imported Whisper's by its timestamps, else one for the whole input)."""

    text: str
    ids: list[int]
    language: str | None
    feature_seconds: float
    decode_seconds: float
    segments: tuple[Segment, ...] = ()


def read_audio(
    bundle: Bundle, paths: Sequence[str | Path], *, max_seconds: float | None = None
) -> tuple[list[tuple[Path, AudioSource]], list[tuple[Path, str]]]:
    """Audio files as the speech model reads them, ``(good, bad)``: each good file as a source
    (``audio_stream.AudioSource``: checked, none of its samples kept; read again, a block at a
    time, when transcribed), in order; each bad one with why, never raised
    (``audio.check_many``): unreadable, longer than ``max_seconds`` (None: any length for an
    imported Whisper, which reads long audio a window at a time, and for other models, which
    read it piece by piece, cut by voice activity), or too short for the model's front-end."""
    bundle.require("transcribe")
    config = bundle.features
    checked, bad = check_many(paths, max_seconds=max_seconds)
    good = [(path, AudioSource(path, None, config.sample_rate, rate, frames)) for path, frames, rate in checked]
    short = [too_short(bundle.model, config.frames(round(s.seconds * config.sample_rate))) for _, s in good]
    bad += [
        (path, f"{1000 * source.seconds:.0f} ms is too short for this model")
        for (path, source), cut in zip(good, short, strict=True)
        if cut
    ]
    return [g for g, cut in zip(good, short, strict=True) if not cut], bad


def transcriptions(
    bundle: Bundle,
    audio: Sequence[Audio],
    *,
    beam_size: int | None = None,
    ctc_weight: float | None = None,
    ctc_only: bool = False,
    length_penalty: float | None = None,
    lm: str | Path | None = None,
    lm_weight: float | None = None,
    language: str | None = None,
    task: str | None = None,
    batch_size: int = 32,
    on_batch: Callable[[int], None] | None = None,
    prefix: str | None = None,
    ban: Sequence[str] = (),
    require: Sequence[str] = (),
    timestamps: bool = False,
    long_form: LongForm | None = None,
    on_seconds: Callable[[float], None] | None = None,
    vad: Vad | None = None,
) -> list[Transcript]:
    """Each input's transcript, in order: audio files (read at the model's rate) or mono
    waveforms (N,) at :attr:`Bundle.sample_rate`.

    An imported Whisper reads an input longer than its chunk (30 s), or any input with
    ``timestamps``, in windows as openai/whisper's ``transcribe`` does (``longform.py``: greedy
    with temperature fallback, each window after the previous text; ``long_form``: its
    settings, None: Whisper's defaults; ``on_seconds(s)`` after each window, with the seconds
    of audio read): its segments carry the timestamps' times. A model of qkv's own reads an
    input longer than ``vad.max_seconds`` (``vad``: None, :class:`~qkv.vad.Vad`'s defaults,
    30 s) piece by piece, cut where voice activity stops (``vad.py``), each piece a segment
    with its times. Other inputs are decoded in batches, each one segment from 0 to its end.
    Files are read a block at a time: memory does not grow with their length.

    Beam search of ``beam_size`` (1: greedy), joint with the CTC prefix score at
    ``ctc_weight``, or ``ctc_only`` (the CTC head's best path, no decoder); unset settings are
    the recipe's (:attr:`Bundle.decode`), but an imported Whisper decodes greedily, with its
    checkpoint's suppressed tokens (:func:`whisper_rules`), as transformers' ``generate`` does.
    ``lm``: a language model directory of the same
    tokens fused into the beam search at ``lm_weight`` (default :data:`LM_WEIGHT`). An imported
    Whisper starts from the tokens of ``language`` and ``task`` ("transcribe" or "translate"),
    a multilingual one without ``language`` from each input's own language, detected as
    Whisper does. ``on_batch(n)`` after every n inputs decoded (a progress bar). ``prefix``,
    ``ban``, ``require``: constraints (:func:`constraints`; the prefix follows an imported
    Whisper's start tokens, and a transcript's tokens and text start with it); not with
    ``ctc_only``, and ``require`` not joint with the CTC prefix score.
    """
    bundle.require("transcribe")
    d = bundle.decode
    # An imported Whisper decodes greedily unless told otherwise, as Whisper and transformers do.
    beam = (d.beam_size if bundle.whisper is None else 1) if beam_size is None else beam_size
    _check_transcription_options(
        bundle,
        lm,
        lm_weight,
        language,
        task,
        ctc_only,
        d.ctc_weight if ctc_weight is None else ctc_weight,
        prefix,
        ban,
        require,
    )
    steer = constraints(bundle, [None] * len(audio), prefix=prefix, ban=ban, require=require, beam_size=beam)
    fused = None
    if lm is not None:
        bf16 = bundle.precision == "bf16"
        fused = load_fusion_lm(str(lm), bundle.vocab.target, model=bundle.model, bf16=bf16, device=bundle.device)
    vad = vad or Vad()
    feats, seconds, sources, waves = [], [], [], []
    for i, item in enumerate(audio):
        sources.append(_source(bundle, item, i))
        began = time.perf_counter()
        cut = bundle.whisper is None and sources[-1].seconds > vad.max_seconds  # read piece by piece
        waves.append(None if cut else _head(bundle, sources[-1]))  # a Whisper's first chunk and a sample more
        feats.append(None if cut else features(waves[-1], bundle.features))  # (T, M): a Whisper's first chunk
        seconds.append(time.perf_counter() - began)
    starts, languages = _start_tokens(bundle, feats, language=language, task=task or "transcribe")
    found: list[Transcript | None] = [None] * len(feats)
    windowed = [i for i, w in enumerate(waves) if w is not None and _windowed(bundle, w, timestamps)]
    voiced = [i for i, w in enumerate(waves) if w is None]
    _check_pieced(vad, bool(windowed), bool(voiced), beam_size, prefix, require)
    for i in windowed:
        began = time.perf_counter()
        segments = long_transcript(bundle, sources[i], starts[i], long_form, steer.scorers, on_seconds)
        found[i] = _of_segments(segments, "", languages[i], seconds[i], began, on_batch)

    def decode(rows: list[Tensor], start, required, report: Callable[[int], None] | None):
        return transcribe(
            bundle.model,
            bundle.vocab.target,
            rows,
            beam_size=beam,
            ctc_weight=d.ctc_weight if ctc_weight is None else ctc_weight,
            ctc_only=ctc_only,
            length_penalty=d.length_penalty if length_penalty is None else length_penalty,
            batch_size=batch_size,
            prefix=_started_with(bundle, start, steer.shown),
            on_batch=report,
            lm=fused,
            lm_weight=LM_WEIGHT if lm_weight is None else lm_weight,
            scorers=[*whisper_rules(bundle), *steer.scorers],
            required=required,
        )

    for i in voiced:
        began = time.perf_counter()
        segments = _voiced(bundle, sources[i], vad, lambda rows: decode(rows, None, None, None), batch_size)
        found[i] = _of_segments(segments, " ", None, seconds[i], began, on_batch)
    groups: dict[tuple[int, ...] | None, list[int]] = {}
    for i, start in enumerate(starts):
        if found[i] is None:
            groups.setdefault(start, []).append(i)
    for start, rows in groups.items():
        required = None if steer.required is None else [steer.required[i] for i in rows]
        heard = decode([feats[i] for i in rows], start, required, on_batch)
        for i, h in zip(rows, heard, strict=True):
            ids = [*steer.shown, *h.ids]
            text = bundle.vocab.target.decode(ids) if steer.shown else h.text
            whole = Segment(0.0, waves[i].numel() / bundle.sample_rate, text.strip(), tuple(ids))
            found[i] = Transcript(text.strip(), ids, languages[i], seconds[i], h.seconds, (whole,))
    return [t for t in found if t is not None]


def _check_transcription_options(
    bundle: Bundle,
    lm: str | Path | None,
    lm_weight: float | None,
    language: str | None,
    task: str | None,
    ctc_only: bool,
    ctc_weight: float,
    prefix: str | None,
    ban: Sequence[str],
    require: Sequence[str],
) -> None:
    """:func:`transcriptions`' options that cannot go together, refused in one line."""
    if lm_weight is not None and lm is None:
        raise OptionError("lm_weight weighs the language model of lm; name one", "lm_weight", "lm")
    if bundle.whisper is None and (language is not None or task is not None):
        raise OptionError("language and task apply to imported Whisper models only", "language", "task")
    named = [name for name, given in (("prefix", prefix is not None), ("ban", ban), ("require", require)) if given]
    if ctc_only and named:
        raise OptionError(f"ctc_only decodes with the CTC head alone: no {' or '.join(named)}", "ctc_only", *named)
    if require and ctc_weight > 0:
        raise OptionError("require is searched for by the decoder alone: give ctc_weight 0", "require", "ctc_weight")


def _check_pieced(
    vad: Vad, windowed: bool, voiced: bool, beam_size: int | None, prefix: str | None, require: Sequence[str]
) -> None:
    """Inputs read in pieces (an imported Whisper's windows, or pieces cut by voice activity)
    take no per-transcript constraint, and a Whisper's windows no beam: refused in one line."""
    if voiced and (prefix is not None or require):
        raise OptionError(
            f"inputs longer than {vad.max_seconds:g} s are transcribed piece by piece, cut by voice activity: "
            "no prefix or require there",
            "prefix",
            "require",
        )
    if windowed and (beam_size not in (None, 1) or prefix is not None or require):
        raise OptionError(
            "an imported Whisper reads long audio (or gives timestamps) greedily, window by window: "
            "no beam_size, prefix or require there",
            "beam_size",
            "prefix",
            "require",
        )


def _of_segments(
    segments: list[Segment],
    joiner: str,
    language: str | None,
    read_seconds: float,
    began: float,
    on_batch: Callable[[int], None] | None,
) -> Transcript:
    """One input's transcript from the segments it was read in (its text: theirs joined by
    ``joiner``, stripped; ``began``: when its decoding started), reported as one input done."""
    ids = [t for s in segments for t in s.tokens]
    text = joiner.join(s.text for s in segments).strip()
    found = Transcript(text, ids, language, read_seconds, time.perf_counter() - began, tuple(segments))
    if on_batch is not None:
        on_batch(1)
    return found


def _voiced(
    bundle: Bundle, source: AudioSource, vad: Vad, decode: Callable[[list[Tensor]], list], batch_size: int
) -> list[Segment]:
    """A long input to a model of qkv's own, cut by voice activity (``vad.speech_pieces``): each
    piece decoded (``decode``: features -> transcriptions, ``batch_size`` pieces at a time, read
    as they come), a segment each with its times; pieces heard as nothing are left out."""
    rate, segments, batch = bundle.sample_rate, [], []
    pieces = piece_waves(source, speech_pieces(source, vad))
    for piece in itertools.chain(pieces, [None]):
        batch += [] if piece is None else [piece]
        if batch and (piece is None or len(batch) == batch_size):
            heard = decode([features(wave, bundle.features) for _, _, wave in batch])
            for (start, end, _), h in zip(batch, heard, strict=True):
                if h.text.strip():
                    segments.append(Segment(start / rate, end / rate, h.text.strip(), tuple(h.ids)))
            batch = []
    return segments


def _windowed(bundle: Bundle, wave: Tensor, timestamps: bool) -> bool:
    """Whether an imported Whisper reads an input window by window (longer than its chunk, or
    timed), given ``wave``, its :func:`_head`; never for other models."""
    if bundle.whisper is None:
        return False
    return timestamps or wave.numel() > bundle.features.chunk_seconds * bundle.sample_rate


def long_transcript(
    bundle: Bundle,
    wave: Tensor | AudioSource | MelWindows,
    start: tuple[int, ...],
    options: LongForm | None,
    bans: Sequence[Scorer] = (),
    on_seconds: Callable[[float], None] | None = None,
) -> list[Segment]:
    """An imported Whisper's segments of ``wave`` (``longform.transcribe_long``) from the start
    tokens ``start`` (<|notimestamps|> left out), with its rules and ``bans``."""
    settings, tokenizer = bundle.whisper, bundle.vocab.target
    if settings.no_timestamps_id is None:
        raise UserError(
            f"{bundle.path}: the model has no <|notimestamps|> token, so no timestamps to read long audio by"
        )
    token = tokenizer.backend.token_to_id
    ids = WhisperTokens(
        start=tuple(t for t in start if t != settings.no_timestamps_id),
        previous=token("<|startofprev|>"),
        no_speech=token("<|nospeech|>") if token("<|nospeech|>") is not None else token("<|nocaptions|>"),
        timestamp_begin=settings.no_timestamps_id + 1,
        eos=bundle.model.config.eos_id,
        rules=(*whisper_rules(bundle, timestamps=True), *bans),
        alignment_heads=checked_heads(bundle),
        spaced=not any(settings.languages.get(code) in start for code in UNSPACED),
    )
    return transcribe_long(bundle.model, tokenizer, wave, bundle.features, ids, options or LongForm(), on_seconds)


def ctc_timed_words(bundle: Bundle, item: Audio, i: int, found: Transcript) -> Transcript:
    """``found`` (one segment, the whole input) with its words timed by the CTC head (forced
    alignment, ``word_timing.ctc_timed``); none where the head cannot read them. The input is
    one the model reads whole (at most its window), so its samples are gathered whole here."""
    wave = torch.from_numpy(np.concatenate([np.zeros(0, np.float32), *_source(bundle, item, i).blocks()]))  # (Y,)
    feats = features(wave, bundle.features)  # (T, M)
    texts = bundle.vocab.target.token_texts()
    words = ctc_timed(bundle.model, feats, found.ids, texts)
    segments = tuple(replace(s, words=words) for s in found.segments[:1])
    return replace(found, segments=segments)


def checked_heads(bundle: Bundle) -> tuple[tuple[int, int], ...]:
    """An imported Whisper's alignment heads, each one the decoder has (else a UserError)."""
    c = bundle.model.config
    wrong = [pair for pair in bundle.whisper.alignment_heads if pair[0] >= c.n_decoder_layers or pair[1] >= c.n_heads]
    if wrong:
        raise UserError(
            f"{bundle.path}: alignment head(s) {wrong} not in the decoder ({c.n_decoder_layers} layers of {c.n_heads})"
        )
    return bundle.whisper.alignment_heads


def whisper_rules(bundle: Bundle, *, timestamps: bool = False) -> list[Scorer]:
    """An imported Whisper's decoding rules (suppressed tokens; with ``timestamps``, the timestamp
    rules) as scorers, as transformers' ``generate`` applies them; none for other models."""
    if bundle.whisper is None:
        return []
    return bundle.whisper.scorers(eos=bundle.model.config.eos_id, timestamps=timestamps)


def _started_with(bundle: Bundle, start: tuple[int, ...] | None, shown: list[int]) -> list[int] | None:
    """The decoder's forced first tokens: the start tokens (None: BEGIN alone), then the prefix's."""
    if not shown:
        return None if start is None else list(start)
    return [*(start or [bundle.model.config.bos_id]), *shown]


def _source(bundle: Bundle, item: Audio, i: int) -> AudioSource:
    """Input ``i``: a file (checked, any length, read at the model's rate when used), a mono
    waveform as given, or a source as it is."""
    config = bundle.features
    if isinstance(item, AudioSource):
        return item
    if isinstance(item, str | Path):
        return AudioSource.of_file(item, config.sample_rate)
    wave = torch.as_tensor(item, dtype=torch.float32)
    if wave.ndim != 1:
        raise UserError(f"input {i + 1}: a waveform is one channel of samples (N,), not {tuple(wave.shape)}")
    return AudioSource.of_wave(wave, config.sample_rate)


def _head(bundle: Bundle, source: AudioSource) -> Tensor:
    """What is read of an input before decoding: an imported Whisper's first chunk and one sample
    more (its features read the chunk; a longer input is read window by window from its source),
    else the whole input."""
    if bundle.whisper is None:
        return source.whole()
    return source.head(round(bundle.features.chunk_seconds * bundle.sample_rate) + 1)


def _start_tokens(
    bundle: Bundle, feats: list[Tensor], *, language: str | None, task: str
) -> tuple[list[tuple[int, ...] | None], list[str | None]]:
    """Each input's forced start tokens and language: None and None for a model of qkv's own
    (BEGIN alone); an imported Whisper's for ``language`` and ``task``, or, for a multilingual
    one without ``language``, for each input's own language, detected 16 inputs at a time."""
    settings, n = bundle.whisper, len(feats)
    if settings is None:
        return [None] * n, [None] * n
    where, start = bundle.path / "config.json", bundle.model.config.bos_id

    def prefix(code: str | None) -> tuple[int, ...]:
        return tuple(settings.prefix(start, language=code, task=task, timestamps=False, where=where))

    if language is not None or not settings.multilingual:
        return [prefix(language)] * n, [language] * n
    dtype = next(bundle.model.parameters()).dtype
    codes = [
        code
        for i in range(0, n, 16)
        for code in most_likely_languages(bundle.model, [f.to(dtype) for f in feats[i : i + 16]], settings, where=where)
    ]
    return [prefix(code) for code in codes], codes


# ----------------------------------------------------------------------------- speak


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
) -> list[tuple[Synthesis, Tensor]]:
    """Each text spoken (``tasks.tts.speak``): its synthesis (frames, whether it hit the cap)
    and waveform (N,) at :attr:`Bundle.sample_rate`, in order. ``speaker``: the voice, for a
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
        )
    if len(flat) == len(texts):
        return said
    ends = np.cumsum([0, *map(len, pieces)])
    return [_joined(said[a:b], bundle.sample_rate) for a, b in itertools.pairwise(ends)]


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


# ----------------------------------------------------------------------------- embed


@dataclass(frozen=True)
class Embedded:
    """What :func:`embeddings` gives: ``vectors`` (N, D) float32, one row per text; ``cut``:
    how many texts were cut to the window; ``settings``: the pooling, normalization and
    window used, and which came from where (``embedding.Choice``)."""

    vectors: Tensor
    cut: int
    settings: Choice


def embeddings(
    bundle: Bundle,
    texts: Sequence[str],
    *,
    pooling: str | None = None,
    normalize: bool | None = None,
    max_len: int | None = None,
    batch_size: int = 64,
) -> Embedded:
    """Each text's vector (``embedding.sentence_embeddings``): each setting as given, else as
    the model directory records it, else qkv's (mean pooling, not normalized, the whole
    window). An empty text gives a zero row."""
    bundle.require("embed")
    chosen = choose(
        bundle.embedding, model_max_len=bundle.window, pooling=pooling, normalize=normalize, max_len=max_len
    )
    vectors, cut = sentence_embeddings(
        bundle.model,
        bundle.vocab.source,
        list(texts),
        pooling=chosen.pooling,
        normalize=chosen.normalize,
        max_len=chosen.max_len,
        batch_size=batch_size,
    )
    return Embedded(vectors, cut, chosen)


# ----------------------------------------------------------------------------- generate


@dataclass(frozen=True)
class Generated:
    """One output of :func:`generations`: its text, its tokens, and its beam score (None: not
    from a beam search, or an empty input's)."""

    text: str
    tokens: list[int]
    score: float | None


@dataclass(frozen=True)
class WindowFit:
    """How :func:`generations` fits inputs to the model's window (``docs/textbook.md``, "The
    window"): ``cut``, the inputs longer than it (0-based); ``kept``, what each of them keeps,
    in words; ``room``, the most new tokens an output can have (the longest input's)."""

    cut: list[int]
    kept: str
    room: int


def window_cut(bundle: Bundle, ids: list[int]) -> list[int]:
    """An input's tokens within the window: a source keeps its first ``max_len`` (what a
    translation starts from; a final END stays, ``seq2seq.cut_source``), a prompt its newest
    ``max_len // 2`` (what a continuation follows, with room left to write)."""
    window = bundle.window
    if len(ids) <= window:
        return ids
    if bundle.kind == "decoder_only":
        return ids[-(window // 2) :]
    return cut_source(bundle.vocab.source, ids, window=window)


def window_fit(bundle: Bundle, texts: Sequence[str]) -> WindowFit:
    """What :func:`window_cut` does to ``texts``, and the room it leaves for outputs: an
    encoder-decoder writes up to its window whatever the source; a language model's output
    shares the window with its prompt."""
    window = bundle.window
    encoded = bundle.vocab.source.encode_batch(list(texts))
    cut = [i for i, ids in enumerate(encoded) if len(ids) > window]
    if bundle.kind != "decoder_only":
        return WindowFit(cut, f"their first {window}", window)
    longest = max((len(window_cut(bundle, ids)) for ids in encoded), default=0)
    return WindowFit(cut, f"their newest {window // 2}", window - max(1, longest) + 1)


def generations(
    bundle: Bundle,
    texts: Sequence[str],
    *,
    max_new_tokens: int = 64,
    beam_size: int = 1,
    nbest: int = 1,
    sampling: Sampling | None = None,
    batch_size: int = 64,
    prefix: str | None = None,
    ban: Sequence[str] = (),
    require: Sequence[str] = (),
) -> list[list[Generated]]:
    """Each input's outputs, in order: an encoder-decoder's for the text as its source, a
    language model's continuation of it as a prompt; greedy, the ``nbest`` best of a beam
    search of ``beam_size``, or drawn (``sampling``, one generator for the whole call: the same
    seed and ``batch_size`` give the same outputs). An input is cut to the window
    (:func:`window_cut`) and an output stops where the window is full; an empty input gives
    ``nbest`` empty outputs in its place. ``prefix``, ``ban``, ``require``: constraints
    (:func:`constraints`; a language model reads the prefix after the prompt, and an output's
    tokens and text start with it)."""
    bundle.require("generate")
    if nbest > beam_size:
        raise OptionError(f"nbest {nbest} needs beam_size of at least {nbest}", "nbest", "beam_size")
    if sampling is not None and beam_size > 1:
        raise OptionError("sampling draws one output per input: no beam_size above 1", "sampling", "beam_size")
    steer = constraints(
        bundle, texts, prefix=prefix, ban=ban, require=require, beam_size=beam_size, sampling=sampling is not None
    )
    chosen = None if sampling is None else sampling.chooser(bundle.device)
    read_after = steer.shown if bundle.kind == "decoder_only" else []  # a prompt goes on with the prefix
    found: list[list[Generated]] = []
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start : start + batch_size])
        todo = [i for i, text in enumerate(chunk) if text.strip()]
        encoded = bundle.vocab.source.encode_batch([chunk[i] for i in todo])
        inputs = [window_cut(bundle, [*ids, *read_after]) for ids in encoded]
        required = None if steer.required is None else [steer.required[start + i] for i in todo]
        outputs = _decoded(
            bundle,
            inputs,
            max_new_tokens=max_new_tokens,
            beam_size=beam_size,
            nbest=nbest,
            choose=chosen,
            steer=Constraints(steer.shown, steer.scorers, required),
        )
        results = dict(zip(todo, outputs, strict=True)) if inputs else {}
        found += [results.get(i, [Generated("", [], None)] * nbest) for i in range(len(chunk))]
    return found


def _decoded(
    bundle: Bundle,
    inputs: list[list[int]],
    *,
    max_new_tokens: int,
    beam_size: int,
    nbest: int,
    choose,
    steer: Constraints,
) -> list[list[Generated]]:
    """The outputs of token inputs: drawn by ``choose``, else constrained beam search with
    required terms, else beam search above beam 1, else greedy; each output's tokens and text
    start with the prefix's."""
    if not inputs:
        return []
    model, scorers = bundle.model, steer.scorers
    forced = None if bundle.kind == "decoder_only" else steer.forced(bundle)

    def output(tokens: list[int], score: float | None) -> Generated:
        written = [*steer.shown, *tokens]
        return Generated(bundle.vocab.target.decode(written), written, score)

    if choose is not None:
        drawn = generate(model, inputs, max_new_tokens=max_new_tokens, choose=choose, prefix=forced, scorers=scorers)
        return [[output(ids, None)] for ids in drawn]
    if steer.required is not None:
        hyps = constrained_beam_search(
            model,
            inputs,
            required=steer.required,
            beam_size=beam_size,
            max_new_tokens=max_new_tokens,
            nbest=nbest,
            prefix=forced,
            scorers=scorers,
        )
        return [[output(h.tokens, h.score) for h in hs] for hs in hyps]
    if beam_size > 1:
        hyps = beam_search(
            model,
            inputs,
            beam_size=beam_size,
            max_new_tokens=max_new_tokens,
            nbest=nbest,
            prefix=forced,
            scorers=scorers,
        )
        return [[output(h.tokens, h.score) for h in hs] for hs in hyps]
    return [
        [output(ids, None)]
        for ids in greedy(model, inputs, max_new_tokens=max_new_tokens, prefix=forced, scorers=scorers)
    ]


def continued(
    bundle: Bundle,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    sampling: Sampling | None = None,
    choose: Callable[[Tensor], Tensor] | None = None,
) -> Iterator[str]:
    """The pieces of text a language model's continuation of ``prompt`` adds, each as soon as
    it is whole (``streaming.continuation_text``): greedy, or drawn with ``sampling``, or picked
    by ``choose`` (a :meth:`Sampling.chooser` or ``decoding.most_likely`` the caller wraps: the
    server counts the tokens made through it). A prompt longer than the window keeps its newest
    ``max_len`` tokens, and the output slides on past the window."""
    bundle.require("generate")
    if bundle.kind != "decoder_only":
        raise UserError(
            f"{bundle.path} holds {KIND_NAMES[bundle.kind]}: it writes outputs of sources, not continuations"
        )
    if sampling is not None and choose is not None:
        raise OptionError("sampling and choose both pick the tokens: give one", "sampling", "choose")
    chosen = choose or (most_likely if sampling is None else sampling.chooser(bundle.device))
    ids = bundle.vocab.source.encode_batch([prompt])[0]
    return continuation_text(bundle.model, bundle.vocab, ids, max_new_tokens=max_new_tokens, choose=chosen)


# ----------------------------------------------------------------------------- chat


def reply(
    bundle: Bundle,
    turns: Sequence[str],
    *,
    separator: str = " __eou__ ",
    max_new_tokens: int = 60,
    beam_size: int = 4,
    choose: Callable[[Tensor], Tensor] | None = None,
    system: str | None = None,
    repetition_penalty: float = 1.0,
) -> str:
    """The model's next turn after ``turns`` (the dialogue so far, oldest first: the user's
    turns, then the model's, alternating). A model with a chat template (``bundle.conversation``)
    reads them as the template renders them, after ``system`` (:func:`chat_reply`); one without
    reads them joined by ``separator`` (``chat.reply``: the newest turns that fit the window).
    ``choose`` picks each token (a :meth:`Sampling.chooser`, kept across the turns of one chat);
    without it a language model is greedy and an encoder-decoder searches a beam of
    ``beam_size``; ``repetition_penalty`` θ (a language model's): CTRL's penalty of the tokens
    already in the text (1: none)."""
    bundle.require("chat")
    if bundle.conversation is not None:
        messages = as_messages(turns, system=system)
        _, pieces = chat_reply(
            bundle, messages, max_new_tokens=max_new_tokens, choose=choose, repetition_penalty=repetition_penalty
        )
        return "".join(pieces).strip()
    if system is not None:
        raise OptionError(f"{bundle.path} has no chat template: a system prompt needs one", "system")
    if repetition_penalty != 1.0:
        raise OptionError(f"{bundle.path} has no chat template: the repetition penalty needs one", "repetition_penalty")
    return next_turn(
        bundle.model,
        bundle.vocab,
        list(turns),
        separator=separator,
        max_new_tokens=max_new_tokens,
        beam_size=beam_size,
        choose=choose,
    )


def as_messages(turns: Sequence[str], *, system: str | None = None) -> list[dict[str, str]]:
    """A dialogue (the user's turn, the model's, ...) as a chat template's messages, after the
    system prompt where there is one."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def chat_reply(
    bundle: Bundle,
    messages: Sequence[dict[str, str]],
    *,
    max_new_tokens: int = 256,
    choose: Callable[[Tensor], Tensor] | None = None,
    repetition_penalty: float = 1.0,
) -> tuple[int, Iterator[str]]:
    """The assistant's next message after ``messages`` ({"role", "content"} each, oldest
    first) through the model's chat template (``chat.template_reply``): how many of the oldest
    messages were dropped to fit the window, and the reply's text piece by piece as it is made,
    ending at an end-of-turn token."""
    bundle.require("chat")
    if bundle.conversation is None:
        raise UserError(f"{bundle.path} has no chat template (chat_template.jinja or tokenizer_config.json)")
    if not repetition_penalty > 0:
        raise OptionError(f"repetition_penalty {repetition_penalty}: give a positive number", "repetition_penalty")
    return template_reply(
        bundle.model,
        bundle.vocab.target,
        bundle.conversation,
        messages,
        max_new_tokens=max_new_tokens,
        choose=choose,
        repetition=repetition_penalty,
    )


# ----------------------------------------------------------------------------- helpers


def _listed(texts: str | Sequence[str]) -> list[str]:
    """One text as a list of one; several as a list."""
    return [texts] if isinstance(texts, str) else list(texts)


def _one_audio(audio: Audio | Sequence[Audio]) -> bool:
    """Whether ``audio`` is one input (a path, or a waveform of one dimension) rather than several."""
    return isinstance(audio, str | Path) or (isinstance(audio, Tensor | np.ndarray) and audio.ndim == 1)


def _and(words: list[str]) -> str:
    """The words joined as prose: a; a and b; a, b and c."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"
