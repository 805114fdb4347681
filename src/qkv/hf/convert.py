"""Hugging Face checkpoints in and out: :func:`import_hf`, :func:`export_hf`, :func:`classifier_labels`.

What is here: the steps every family goes through, and the one choice of family, by the
checkpoint's ``architectures`` (import) or the qkv model's config class (export); this is the
only module that knows all the families. What is not: each family's config fields, weight names
and tokenizer (``bert.py``, ``gpt2.py``, ``marian.py``, ``whisper.py``), and what they share
(``common.py``).

Import: a local HF checkpoint directory -> a qkv model directory, tokenizer included. Tensors
the model does not use are left out and named in the summary (``ignored``; the CLI prints them
on stderr). Where config.json gives the padding, BEGIN or END id too, it must agree with the
tokenizer's. A tokenizer file's padding and truncation settings are not kept (qkv batches and
cuts texts itself; ``tokenization.py``); the summary's ``notes`` say when a file had them.

An encoder-only (BERT) import records in the model's config.json, under ``"embedding"``
(``qkv/embedding.py``), what ``qkv embed`` uses by default: the window (the tokens a text is cut
to, as the checkpoint's users have it cut: ``hf/sentence_transformers.window``) and, for a
sentence-transformers directory (``modules.json``; the HF model in it or in its Transformer
module's folder), its pooling and normalization; ``do_lower_case`` there lowercases in the
stored tokenizer, as sentence-transformers does. Modules qkv does not reproduce (Dense, ...)
are named in ``notes``.

Export: a qkv model directory or a training run (its final checkpoint) -> a new or empty
directory (not the working directory) that transformers loads with ``from_pretrained``,
written whole or not at all, flushed to disk (``files.atomic_directory``, as
``checkpoint.save_model`` writes): ``config.json``, ``model.safetensors`` (fp32), and
``tokenizer.json`` with a ``tokenizer_config.json`` for ``PreTrainedTokenizerFast`` (with the
mask token: qkv's ``<mask>`` or BERT's ``[MASK]``), or an imported Marian's own tokenizer files.
A speech model exports as Whisper: besides those, ``generation_config.json`` and
``preprocessor_config.json``; an imported Whisper's own files (``whisper.WHISPER_FILES``:
tokenizer_config.json, generation_config.json, ...) are written back as they were.

A Whisper import records in config.json, under ``"whisper"``, the ids of the tokens its decoder
starts from (``whisper.WhisperSettings``; ``whisper.start_tokens`` reads them).

RoBERTa, XLM-RoBERTa and DistilBERT are read, not written: an encoder-only model exports as the
BERT that computes the same (a RoBERTa's positions shifted, ``roberta.py``).

Not supported (a :class:`~qkv.errors.UserError` names the file and the field or tensor): other
architectures (the error lists those import reads); a qkv translation model trained with separate vocabularies
(``target_tokenizer.json``) is not exported, as Marian's separate vocabularies are
SentencePiece files qkv does not write. Generation settings (``generation_config.json``: beams,
forced END; Whisper's suppressed tokens) are not applied (a Whisper's file is kept for export), but
a Marian's ``bad_words_ids`` are recorded in config.json's ``hf`` and banned when it translates.
The models do not import this package.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from qkv.checkpoint import Config, build_model, check_output, load_model, model_dir, save_model
from qkv.embedding import FIELD, EmbeddingSettings
from qkv.errors import UserError
from qkv.files import atomic_directory
from qkv.hf.bert import BERT, bert_config, bert_fields, bert_labels, bert_to_qkv, bert_tokenizer, qkv_to_bert
from qkv.hf.common import (
    HF_CONFIG,
    TOKENIZER_CONFIG,
    WEIGHTS,
    HFConfig,
    TokenizerSettings,
    canonical_names,
    check_tensors,
    ignored_tensors,
    load_state,
    read_config,
    read_from,
    read_tensors,
    tokenizer_file_settings,
    untied_copies,
)
from qkv.hf.distilbert import DISTILBERT, distilbert_fields, distilbert_to_qkv, qkv_to_distilbert
from qkv.hf.gguf import GGUFCheckpoint, read_gguf
from qkv.hf.gpt2 import GPT2, gpt2_config, gpt2_fields, gpt2_to_qkv, gpt2_tokenizer, qkv_to_gpt2
from qkv.hf.llama import (
    CHAT_TEMPLATE,
    GENERATION_CONFIG,
    LLAMA,
    LLAMA_FILES,
    llama_architecture,
    llama_config,
    llama_fields,
    llama_to_qkv,
    llama_tokenizer,
    qkv_to_llama,
)
from qkv.hf.marian import (
    MARIAN,
    MARIAN_TOKENIZER_FILES,
    marian_bad_words,
    marian_config,
    marian_fields,
    marian_positions,
    marian_to_qkv,
    marian_tokenizers,
    qkv_to_marian,
)
from qkv.hf.roberta import ROBERTA, qkv_to_roberta, roberta_fields, roberta_to_qkv, roberta_tokenizer
from qkv.hf.sentence_transformers import (
    ST_CONFIG,
    SentenceTransformers,
    lowercase_first,
    read_sentence_transformers,
    window,
)
from qkv.hf.whisper import (
    PREPROCESSOR_CONFIG,
    WHISPER,
    WHISPER_FIELD,
    WHISPER_FILES,
    WhisperSettings,
    qkv_to_whisper,
    whisper_config,
    whisper_features,
    whisper_fields,
    whisper_generation_config,
    whisper_positions,
    whisper_preprocessor_config,
    whisper_settings,
    whisper_to_qkv,
    whisper_tokenizer,
)
from qkv.models.decoder_only import DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnlyConfig
from qkv.models.speech import SpeechConfig
from qkv.tokenization import FILE, TARGET_FILE, Tokenizer, Vocabularies

# The architectures import_hf reads, family by family (a new family adds its tuple here).
SUPPORTED = BERT + ROBERTA + DISTILBERT + GPT2 + LLAMA + MARIAN + WHISPER
Tokenizers = list[tuple[Tokenizer, Path]]  # each tokenizer and the file its vocabulary came from


@dataclass(frozen=True)
class _Family:
    """What import_hf does alike for every architecture of one family: the qkv model kind, the
    weight conversions (HF -> qkv, and qkv -> HF, whose output names what a checkpoint holds),
    the prefix a checkpoint of the base class stores its body under, and the config.json fields
    that give special-token ids (field -> role), which must agree with the tokenizer's."""

    kind: str
    to_qkv: Callable
    from_qkv: Callable
    prefix: str
    token_ids: Mapping[str, str]


_PAD_BOS_EOS = {"pad_token_id": "pad", "bos_token_id": "bos", "eos_token_id": "eos"}  # RoBERTa's: <s>, </s>
# The families import_hf reads, by architecture (a new family adds its tuple here and to SUPPORTED).
_FAMILIES = {
    # BERT's config.json has no ids for [CLS] and [SEP]
    **dict.fromkeys(BERT, _Family("encoder_only", bert_to_qkv, qkv_to_bert, "bert.", {"pad_token_id": "pad"})),
    **dict.fromkeys(ROBERTA, _Family("encoder_only", roberta_to_qkv, qkv_to_roberta, "roberta.", _PAD_BOS_EOS)),
    **dict.fromkeys(
        DISTILBERT,
        _Family("encoder_only", distilbert_to_qkv, qkv_to_distilbert, "distilbert.", {"pad_token_id": "pad"}),
    ),
    **dict.fromkeys(GPT2, _Family("decoder_only", gpt2_to_qkv, qkv_to_gpt2, "transformer.", _PAD_BOS_EOS)),
    **dict.fromkeys(LLAMA, _Family("decoder_only", llama_to_qkv, qkv_to_llama, "", _PAD_BOS_EOS)),
    # BEGIN: <|startoftranscript|>; bos_token_id is <|endoftext|>
    **dict.fromkeys(
        WHISPER,
        _Family(
            "speech_encoder_decoder",
            whisper_to_qkv,
            qkv_to_whisper,
            "",
            {"pad_token_id": "pad", "eos_token_id": "eos", "decoder_start_token_id": "bos"},
        ),
    ),
    # BEGIN is decoder_start_token_id's token
    **dict.fromkeys(
        MARIAN,
        _Family("encoder_decoder", marian_to_qkv, qkv_to_marian, "", {"pad_token_id": "pad", "eos_token_id": "eos"}),
    ),
}


@dataclass(frozen=True)
class _Checkpoint:
    """What import_hf reads first, whatever the family: ``src`` as given, the directory of the HF
    model (a sentence-transformers directory's Transformer module's folder, or a GGUF file's
    folder), its config and architecture, its tensors by stored name and the file they came from
    (named in errors), the sentence-transformers pipeline and the GGUF file where there is one."""

    src: Path
    hf_dir: Path
    config: HFConfig
    architecture: str
    stored: Mapping[str, torch.Tensor]
    file: Path
    st: SentenceTransformers | None = None
    gguf: GGUFCheckpoint | None = None


def import_hf(src: str | Path, dst: str | Path) -> dict:
    """Convert the HF checkpoint directory ``src`` into the qkv model directory ``dst``.

    Returns a summary: architecture, kind, model directory, parameter count, what became of
    the tokenizer, ``ignored``: the checkpoint's tensors that the model does not use (say,
    BERT's next-sentence head, or the pooler of a BertForMaskedLM checkpoint), by stored name,
    ``embedding``: what config.json records for ``qkv embed`` (encoder-only models; else None),
    and ``notes``: what the user should know (settings not kept, modules not reproduced).
    """
    src, dst = Path(src), Path(dst)
    check_output(dst)
    notes: list[str] = []
    checkpoint = _read_checkpoint(src)
    architecture, family = checkpoint.architecture, _FAMILIES[checkpoint.architecture]
    fields = _model_fields(checkpoint, notes)
    labels = _labels(checkpoint, fields)
    try:
        model = build_model(family.kind, fields)
    except UserError as e:
        raise UserError(f"{checkpoint.config.path}: {e}") from None
    ignored = _load_weights(model, checkpoint, family)
    extra: dict = {"hf": {"architecture": architecture}}
    if architecture in MARIAN:
        banned = marian_bad_words(checkpoint.hf_dir, checkpoint.config, model.config.tgt_vocab_size)
        if banned:
            extra["hf"]["bad_words_ids"] = banned  # applied when translating, as HF's generate applies them
    if labels is not None:
        extra["labels"] = labels  # as qkv's own classifiers store them (tasks/bert.py)
    with tempfile.TemporaryDirectory() as tmp:
        files, tokenizers, said = _tokenizers(checkpoint, model.config, Path(tmp), extra, notes)
        _embedding(checkpoint, family.kind, model.config, tokenizers, extra, notes)
        files.update(_vocabularies(checkpoint, family, model.config, tokenizers, tmp))
        save_model(model, dst, files=files, extra=extra)
    return {
        "architecture": architecture,
        "kind": family.kind,
        "model": str(dst),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer": said,
        "ignored": ignored,
        "embedding": extra.get(FIELD),
        "notes": notes,
    }


def _read_checkpoint(src: Path) -> _Checkpoint:
    """The config and tensors of a checkpoint directory, a sentence-transformers directory or a GGUF file."""
    gguf = read_gguf(src) if src.suffix == ".gguf" and not src.is_dir() else None
    if gguf is not None:  # one file holds what a checkpoint directory would (gguf.py)
        config, architecture = HFConfig(src, gguf.fields), gguf.fields["architectures"][0]
        return _Checkpoint(src, src.parent, config, architecture, gguf.tensors, src, gguf=gguf)
    st = read_sentence_transformers(src) if src.is_dir() else None
    hf_dir = st.model_dir if st is not None else src  # a Transformer module's folder holds the HF model
    config, architecture = read_config(hf_dir, SUPPORTED)
    file, stored = read_tensors(hf_dir)
    return _Checkpoint(src, hf_dir, config, architecture, stored, file, st=st)


def _model_fields(checkpoint: _Checkpoint, notes: list[str]) -> dict:
    """The qkv model config fields of the checkpoint's config (a Whisper's notes on its
    feature settings added to ``notes``)."""
    config, architecture, names = checkpoint.config, checkpoint.architecture, set(checkpoint.stored)
    if architecture in BERT:
        return bert_fields(config, architecture, names)
    if architecture in ROBERTA:
        return roberta_fields(config, architecture, names)
    if architecture in DISTILBERT:
        return distilbert_fields(config, architecture)
    if architecture in GPT2:
        return gpt2_fields(config)
    if architecture in LLAMA:
        return llama_fields(config, architecture)
    if architecture in WHISPER:
        features, feature_notes = whisper_features(checkpoint.hf_dir, config)
        notes += feature_notes
        return whisper_fields(config, features)
    return marian_fields(config)


def _labels(checkpoint: _Checkpoint, fields: dict) -> list[str] | None:
    """A sequence classifier's class names (None for any other model): config.json's, else HF's
    names where it has none (older files leave out two classes' defaults)."""
    if not checkpoint.architecture.endswith("ForSequenceClassification"):
        return None
    return bert_labels(checkpoint.config) or [f"LABEL_{i}" for i in range(fields["n_classes"])]


def _load_weights(model: nn.Module, checkpoint: _Checkpoint, family: _Family) -> list[str]:
    """Load the checkpoint's tensors into ``model`` (then in eval mode), each checked against
    the shape the model's config gives it; returns the stored names of those the model does not use."""
    architecture, file, config = checkpoint.architecture, checkpoint.file, model.config
    # What a checkpoint of this config holds, named and shaped: the export of a model built from it.
    expected = family.from_qkv(model.state_dict(), config)
    if architecture in BERT and config.type_vocab_size == 0:
        expected = {k: v for k, v in expected.items() if not k.endswith("token_type_embeddings.weight")}
    names = canonical_names(list(checkpoint.stored), expected, family.prefix)  # canonical name -> stored name
    tensors = {name: checkpoint.stored[original] for name, original in names.items()}
    read = read_from(tensors, config, file)  # expected name -> canonical name
    inputs = {name: tensors[read.get(name, name)] for name in expected if read.get(name, name) in tensors}
    used = {read.get(name, name) for name in expected}
    if isinstance(config, EncoderDecoderConfig):
        inputs.setdefault("final_logits_bias", torch.zeros(1, config.tgt_vocab_size))  # absent: zero
        used |= marian_positions(tensors, config, file)
    origin = {name: names.get(read.get(name, name), name) for name in expected}  # the name in the file
    check_tensors(file, architecture, inputs, expected, origin)
    if architecture in WHISPER:
        whisper_positions(inputs, file)
    load_state(model, family.to_qkv(inputs, config))
    model.eval()
    return ignored_tensors(tensors, used, names)


def _tokenizers(
    checkpoint: _Checkpoint, config: Config, tmp: Path, extra: dict, notes: list[str]
) -> tuple[dict[str, Path], Tokenizers, str]:
    """The files the model directory keeps from the checkpoint (name -> path, some written in
    ``tmp``), its tokenizers (one: joint, or a Marian's source and target: separate
    vocabularies) and what the summary says of them. A Whisper's start-token settings go in
    ``extra``; what the user should know, in ``notes``."""
    architecture, hf_dir, gguf = checkpoint.architecture, checkpoint.hf_dir, checkpoint.gguf
    if architecture in MARIAN:
        # The SentencePiece files are kept whatever happens, for export_hf to write back.
        files, tokenizers, said = marian_tokenizers(checkpoint.src, config)
    elif architecture in WHISPER:
        files, tokenizers, said = _whisper_tokenizer(checkpoint, config, extra, notes)
    elif gguf is not None:
        # The file's chat template and end-of-turn ids are kept for chat, as a checkpoint keeps them.
        files = _gguf_files(gguf, tmp)
        tokenizers = [(gguf.tokenizer, checkpoint.src)] if gguf.tokenizer is not None else []
        said = f"{FILE} (from the GGUF metadata)" if tokenizers else "none"
    elif architecture in LLAMA:
        files, tokenizers, said = _llama_tokenizer(checkpoint, notes)
    else:
        readers = {**dict.fromkeys(ROBERTA, roberta_tokenizer), **dict.fromkeys(GPT2, gpt2_tokenizer)}
        found = readers.get(architecture, bert_tokenizer)(hf_dir)  # BERT's for BERT and DistilBERT
        files, tokenizers, said = {}, [found] if found is not None else [], FILE if found is not None else "none"
    for _, source in tokenizers:
        dropped = tokenizer_file_settings(source)
        if dropped:
            notes.append(f"{source}: its {' and '.join(dropped)} are not kept (qkv pads, masks and cuts texts itself)")
    return files, tokenizers, said


def _whisper_tokenizer(
    checkpoint: _Checkpoint, config: SpeechConfig, extra: dict, notes: list[str]
) -> tuple[dict[str, Path], Tokenizers, str]:
    """A Whisper's kept files, tokenizer and summary; its start-token settings in ``extra``."""
    # HF's tokenizer, generation and feature settings are kept, for export_hf to write back.
    hf_dir = checkpoint.hf_dir
    files = {name: hf_dir / name for name in WHISPER_FILES if (hf_dir / name).is_file()}
    found = whisper_tokenizer(hf_dir, config)
    said = (FILE if found is not None else "none") + (f" (kept {', '.join(files)} for export)" if files else "")
    settings, settings_notes = whisper_settings(hf_dir, checkpoint.config, config, found[0] if found else None)
    extra[WHISPER_FIELD] = settings.record()
    notes += settings_notes
    return files, [found] if found is not None else [], said


def _llama_tokenizer(checkpoint: _Checkpoint, notes: list[str]) -> tuple[dict[str, Path], Tokenizers, str]:
    """A Llama-family checkpoint's kept files, tokenizer and summary."""
    # The tokenizer's settings, generation defaults and chat template are kept for chat and export.
    hf_dir = checkpoint.hf_dir
    files = {name: hf_dir / name for name in LLAMA_FILES if (hf_dir / name).is_file()}
    found = llama_tokenizer(hf_dir, checkpoint.config)
    if found is None and (hf_dir / "tokenizer.model").is_file():
        notes.append(f"{hf_dir / 'tokenizer.model'}: a SentencePiece model without tokenizer.json is not read")
    said = (FILE if found is not None else "none") + (f" (kept {', '.join(files)})" if files else "")
    return files, [found] if found is not None else [], said


def _embedding(
    checkpoint: _Checkpoint, kind: str, config: Config, tokenizers: Tokenizers, extra: dict, notes: list[str]
) -> None:
    """An encoder-only import's record for ``qkv embed`` in ``extra``; a sentence-transformers
    pipeline over any other model is named in ``notes`` as not read."""
    st = checkpoint.st
    if kind == "encoder_only":
        if st is not None and st.lowercase and tokenizers and lowercase_first(tokenizers[0][0].backend):
            notes.append(f"{ST_CONFIG} do_lower_case: the stored tokenizer lowercases every text first")
        extra[FIELD] = _embedding_record(config.max_len, checkpoint.hf_dir, st, notes)
    elif st is not None:
        notes.append(
            f"{checkpoint.src / 'modules.json'}: a sentence-transformers pipeline over a {checkpoint.architecture} "
            "is not read"
        )


def _vocabularies(
    checkpoint: _Checkpoint, family: _Family, config: Config, tokenizers: Tokenizers, tmp: str
) -> dict[str, Path]:
    """The tokenizer files of the model directory (written in ``tmp``; none without a
    tokenizer), each checked to fit the model: no more tokens than its vocabulary, and the
    special ids config.json gives."""
    if not tokenizers:
        return {}
    try:  # the model has one padding, BEGIN and END id for both sides
        vocabularies = Vocabularies(tokenizers[0][0], tokenizers[-1][0])  # one tokenizer: joint
    except UserError as e:
        raise UserError(f"{tokenizers[-1][1]}: {e}") from None
    if checkpoint.architecture in MARIAN:
        sizes = config.src_vocab_size, config.tgt_vocab_size
    else:
        sizes = config.vocab_size, config.vocab_size
    tables = vocabularies.tables(src_vocab_size=sizes[0], tgt_vocab_size=sizes[1])
    for (tokenizer, _, size), (_, source) in zip(tables, tokenizers, strict=True):
        if tokenizer.vocab_size > size:
            raise UserError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the model only {size}")
        _check_token_ids(checkpoint.config, tokenizer, family.token_ids, source)
    return vocabularies.save(tmp)


def _gguf_files(gguf: GGUFCheckpoint, directory: Path) -> dict[str, Path]:
    """A GGUF's chat template and end-of-turn ids as the files an imported checkpoint keeps
    (``chat_template.jinja``, ``generation_config.json``), written in ``directory``."""
    files = {}
    if gguf.template is not None:
        files[CHAT_TEMPLATE] = directory / CHAT_TEMPLATE
        files[CHAT_TEMPLATE].write_text(gguf.template, encoding="utf-8")
    if gguf.stops:
        files[GENERATION_CONFIG] = directory / GENERATION_CONFIG
        stops = sorted(set(gguf.stops), key=gguf.stops.index)
        files[GENERATION_CONFIG].write_text(json.dumps({"eos_token_id": stops}, indent=2) + "\n", encoding="utf-8")
    return files


def _embedding_record(positions: int, hf_dir: Path, st: SentenceTransformers | None, notes: list[str]) -> dict:
    """What an encoder-only import with ``positions`` positions records for ``qkv embed``
    (config.json's ``"embedding"``)."""
    length, why = window(positions, TokenizerSettings(hf_dir), st)
    if st is None:
        return EmbeddingSettings(max_len=length, source=f"window: {why}").record()
    if st.unsupported:
        notes.append(
            f"qkv embed does not give this checkpoint's sentence-transformers embeddings: it does not reproduce "
            f"{'; '.join(st.unsupported)}"
        )
    source = st.source() if st.max_seq_length is not None else f"{st.source()}; window: {why}"
    if st.unsupported:
        source += f"; not reproduced: {'; '.join(st.unsupported)}"
    if st.pooling is None:  # a pipeline qkv cannot compute: no pooling or normalization recorded
        return EmbeddingSettings(max_len=length, source=source).record()
    return EmbeddingSettings(st.pooling, st.normalize, length, source).record()


def export_hf(src: str | Path, dst: str | Path) -> dict:
    """Write the qkv model directory (or training run) ``src`` as the HF checkpoint directory ``dst``.

    ``dst`` must not exist or be an empty directory (not the working directory or one above
    it); it is written whole or not at all, flushed to disk. Returns a summary: architecture,
    model_type, directory and the files written.
    """
    src, dst = model_dir(Path(src)), Path(dst)
    check_output(dst, models=False)
    model, meta = load_model(src)
    if TARGET_FILE in meta["files"] and "source.spm" not in meta["files"]:
        # (An imported Marian's separate vocabularies are written back as its own files, below.)
        raise UserError(
            f"{src} has separate source and target vocabularies ({FILE}, {TARGET_FILE}); export-hf writes "
            f"one tokenizer for both, so it cannot export this model"
        )
    if meta["kind"] == "tts":  # no Hugging Face architecture is a Transformer-TTS with this post-net
        raise UserError(f"{src} holds a text-to-speech model; export-hf writes BERT, GPT-2, Marian and Whisper")
    config = model.config
    state = model.state_dict()
    if isinstance(config, EncoderOnlyConfig):
        hf_config = bert_config(config, classifier_labels(src, meta, config.n_classes))
        tensors = qkv_to_bert(state, config)
    elif isinstance(config, DecoderOnlyConfig) and config.positions == "rope":
        imported = (meta.get("hf") or {}).get("architecture")
        architecture = imported if imported in LLAMA else llama_architecture(config)
        hf_config, tensors = llama_config(config, architecture), qkv_to_llama(state, config)
    elif isinstance(config, DecoderOnlyConfig):
        hf_config, tensors = gpt2_config(config), qkv_to_gpt2(state, config)
    elif isinstance(config, SpeechConfig):
        # A qkv-trained speech model has no Whisper settings: it starts from BEGIN alone.
        record = meta.get(WHISPER_FIELD)
        start = (
            WhisperSettings()
            if record is None
            else WhisperSettings.from_record(record, src / HF_CONFIG, config.vocab_size)
        )
        hf_config, tensors = whisper_config(config, start), qkv_to_whisper(state, config)
    else:
        hf_config, tensors = marian_config(config), qkv_to_marian(state, config)
    tensors = untied_copies(config, tensors)
    hf_config["dtype"] = "float32"
    files = meta["files"]
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with atomic_directory(dst) as tmp:
            save_file(
                {k: v.detach().float().contiguous().clone() for k, v in tensors.items()},
                tmp / WEIGHTS,
                {"format": "pt"},
            )
            (tmp / HF_CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
            if isinstance(config, SpeechConfig):
                # An imported Whisper's own files as they were; the others written from the model.
                written = {
                    GENERATION_CONFIG: whisper_generation_config(config, start),
                    PREPROCESSOR_CONFIG: whisper_preprocessor_config(config.features),
                }
                for name in WHISPER_FILES:
                    if name in files:
                        shutil.copyfile(src / name, tmp / name)
                    elif name in written:
                        (tmp / name).write_text(json.dumps(written[name], indent=2) + "\n", encoding="utf-8")
            for name in LLAMA_FILES:  # an imported Llama's own tokenizer settings, generation defaults, template
                if name in files and not isinstance(config, SpeechConfig):
                    shutil.copyfile(src / name, tmp / name)
            if FILE in files and "source.spm" not in files:
                tokenizer = Tokenizer.load(src / FILE)
                shutil.copyfile(src / FILE, tmp / FILE)
                if TOKENIZER_CONFIG not in files:  # (an imported Whisper's was copied above)
                    window = (meta.get(FIELD) or {}).get("max_len") or config.max_len  # an import's recorded window
                    settings = _hf_tokenizer_config(tokenizer, meta["kind"], window)
                    (tmp / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
            else:
                # An imported Marian model's own files, which MarianTokenizer reads; the tokenizer.json
                # converted from them stays behind (transformers has no fast Marian tokenizer to read it).
                for name in MARIAN_TOKENIZER_FILES:
                    if name in files:
                        shutil.copyfile(src / name, tmp / name)
    except OSError as e:
        raise UserError(f"cannot write {dst}: {e.strerror or e}") from None
    return {
        "architecture": hf_config["architectures"][0],
        "model_type": hf_config["model_type"],
        "out": str(dst),
        "files": sorted(p.name for p in dst.iterdir()),
    }


def classifier_labels(src: Path, meta: dict, n_classes: int) -> list[str] | None:
    """A classifier's class names from its config.json: ``labels`` (qkv's classifiers and
    imports), else an older import's ``hf.id2label``; None when it has neither."""
    if not n_classes:
        return None
    labels = meta.get("labels")
    if labels is not None:
        if not isinstance(labels, list) or len(labels) != n_classes or not all(isinstance(x, str) for x in labels):
            raise UserError(f"{src / HF_CONFIG}: field 'labels' must list the {n_classes} class names (strings)")
        return labels
    hf = meta.get("hf")
    old = hf.get("id2label") if isinstance(hf, dict) else None
    if isinstance(old, dict) and set(old) == {str(i) for i in range(n_classes)}:
        return [str(old[str(i)]) for i in range(n_classes)]
    return None


def _check_token_ids(config: HFConfig, tokenizer: Tokenizer, fields: Mapping[str, str], source: Path) -> None:
    """Where config.json gives a special token's id (``fields``: field -> role) and the tokenizer
    has that role, the two must agree."""
    for field, role in fields.items():
        value = config.fields.get(field)
        values = value if isinstance(value, list) else [value]  # Llama 3's END: several ids, one of them
        have = getattr(tokenizer, f"{role}_id")
        if value is not None and have is not None and have not in values:
            raise UserError(
                f"{config.path}: field {field!r} is {value!r}, but the tokenizer ({source}) gives its {role} token "
                f"{tokenizer.specials[role]!r} the id {have}"
            )


def _hf_tokenizer_config(tokenizer: Tokenizer, kind: str, max_len: int) -> dict:
    """A tokenizer_config.json that loads tokenizer.json as it is, with its special tokens."""
    s = tokenizer.specials
    settings: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
    if kind == "encoder_only":  # BERT's names for BEGIN and END
        settings.update(cls_token=s["bos"], sep_token=s["eos"], pad_token=s["pad"], unk_token=s["unk"])
    else:
        settings.update(bos_token=s["bos"], eos_token=s["eos"], pad_token=s["pad"], unk_token=s["unk"])
    if tokenizer.mask_id is not None:  # qkv's <mask>, or an imported BERT's [MASK]
        settings["mask_token"] = tokenizer.backend.id_to_token(tokenizer.mask_id)
    return {k: v for k, v in settings.items() if v is not None}
