"""Starting a speech model from trained ones: the front-end and encoder from a speech model
(``train.init_encoder``), the token embedding, decoder stack and output layer from a translation
model (``train.init_decoder``), each checked field by field before anything is copied.

What is not here: the speech task that calls these (``tasks/asr.py``), the models
(``models/speech.py``, ``models/encoder_decoder.py``), checkpoints (``checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qkv.blocks import BlockConfig
from qkv.checkpoint import load_model, model_dir, read_meta
from qkv.errors import UserError
from qkv.models.speech import SpeechEncoderDecoder
from qkv.tokenization import Tokenizer, Vocabularies

# The config fields that decide what the front-end and encoder compute: every per-block field
# but the decoder's window, its positions and the dropouts, and the speech encoder's own fields.
_NOT_ENCODER = ("max_len", "positions", "dropout", "attention_dropout")
ENCODER_FIELDS = (
    *(f.name for f in dataclasses.fields(BlockConfig) if f.name not in _NOT_ENCODER),
    *("n_encoder_layers", "features", "frontend", "conv_channels", "encoder_positions", "key_bias"),
)
ENCODER_PARTS = ("frontend.", "encoder.")  # the state-dict prefixes of the front-end and the encoder


# What train.init_encoder and train.init_decoder read: a model of this kind, said so.
SOURCES = {
    "init_encoder": ("speech_encoder_decoder", "a speech model"),
    "init_decoder": ("encoder_decoder", "a translation model"),
}


def pretrained_source(train: object, key: str, last: Path | None) -> Path | None:
    """The model directory ``train.<key>`` (``init_encoder`` or ``init_decoder``) names (a
    training run: its final checkpoint), checked before any data is read: a UserError beginning
    with the key if it is missing, unreadable or not of the kind :data:`SOURCES` says. None when
    the key is unset or the run resumes (its checkpoint holds those parts already)."""
    if getattr(train, key) is None or last is not None:
        return None
    try:
        directory = model_dir(Path(getattr(train, key)).expanduser())
        kind = read_meta(directory)["kind"]
    except UserError as e:
        raise UserError(f"train.{key}: {e}") from None
    wanted, what = SOURCES[key]
    if kind != wanted:
        raise UserError(f"train.{key}: {directory} holds a {kind} model; this needs {what}")
    return directory


def init_encoder(model: SpeechEncoderDecoder, source: str | Path) -> Path:
    """Start ``model``'s front-end and encoder from the speech model in ``source``; the decoder,
    embeddings, output layer and CTC head stay as built. Speech translation learns faster from an
    encoder that has already learnt to listen, trained on speech recognition (Bansal et al.,
    2019, "Pre-training on High-Resource Speech Recognition Improves Low-Resource
    Speech-to-Text Translation"): the decoder then reads encoder frames that mean sounds instead
    of learning to listen and to translate at once. The encoder fields (:data:`ENCODER_FIELDS`)
    must agree, else a UserError names the first that differs. Returns the model directory read."""
    directory = model_dir(Path(source).expanduser())
    try:  # load_model checks the kind and the file against its config
        pretrained, _ = load_model(directory, kind="speech_encoder_decoder")
    except UserError as e:
        raise UserError(f"train.init_encoder: {e}") from None
    for name in ENCODER_FIELDS:
        theirs, ours = getattr(pretrained.config, name), getattr(model.config, name)
        if theirs != ours:
            raise UserError(f"train.init_encoder: {directory} has model {name}={theirs}; the recipe says {ours}")
    # Equal encoder fields build equal encoder parameters: every one of ours is in the file.
    model.load_state_dict(
        {k: v for k, v in pretrained.state_dict().items() if k.startswith(ENCODER_PARTS)}, strict=False
    )
    return directory


# The config fields that decide what the decoder computes from its tokens and the encoder output:
# every per-block field but the dropouts and the window (a learned window is checked apart),
# and the decoder's own fields. A translation model's names for its parts -> ours.
_NOT_DECODER = ("max_len", "dropout", "attention_dropout")
DECODER_FIELDS = (
    *(f.name for f in dataclasses.fields(BlockConfig) if f.name not in _NOT_DECODER),
    *("n_decoder_layers", "scale_embeddings", "tie_output"),
)
DECODER_PARTS = {"tgt_embed.": "embed.", "decoder.": "decoder.", "output.": "output."}
IDS = ("pad_id", "bos_id", "eos_id")


def decoder_tokenizer(directory: Path) -> Tokenizer:
    """The target tokenizer of the translation model in ``directory`` (its own with separate
    vocabularies, else the joint one; as the translation task reads them). A decoder started
    from that model must write the same pieces, so the speech model takes this tokenizer in
    place of ``data.tokenizer``."""
    try:
        return Vocabularies.load(directory, files=read_meta(directory)["files"]).target
    except UserError as e:
        raise UserError(f"train.init_decoder: {e}") from None


def init_decoder(model: SpeechEncoderDecoder, source: str | Path) -> Path:
    """Start ``model``'s token embedding, decoder stack and output layer from the translation
    model in ``source``; the front-end, encoder and CTC head stay as they are. End-to-end speech
    translation learns little from its few thousand steps if its decoder must also learn to
    write the target language: starting the encoder from speech recognition and the decoder
    from text translation is the standard remedy (Bérard et al., 2018, "End-to-End Automatic
    Speech Translation of Audiobooks"; ESPnet's ST recipes do the same), and the cross-attention
    then only has to learn to read sounds where it read words. The decoder fields
    (:data:`DECODER_FIELDS`) and the vocabulary must agree, else a UserError names the first
    that differs. Returns the model directory read."""
    directory = model_dir(Path(source).expanduser())
    try:  # load_model checks the kind and the file against its config
        pretrained, _ = load_model(directory, kind="encoder_decoder")
    except UserError as e:
        raise UserError(f"train.init_decoder: {e}") from None
    theirs, ours = pretrained.config, model.config
    differ = [(n, getattr(theirs, n), getattr(ours, n)) for n in DECODER_FIELDS]
    differ = [(name, t, o) for name, t, o in differ if t != o]
    if differ:
        name, t, o = differ[0]
        raise UserError(f"train.init_decoder: {directory} has model {name}={t}; the recipe says {o}")
    vocabulary = [(theirs.tgt_vocab_size, ours.vocab_size), *((getattr(theirs, n), getattr(ours, n)) for n in IDS)]
    if any(t != o for t, o in vocabulary):
        raise UserError(f"train.init_decoder: {directory} writes another vocabulary (size, padding, BEGIN, END ids)")
    if ours.positions == "learned" and theirs.max_len < ours.max_len:
        raise UserError(
            f"train.init_decoder: {directory} learnt {theirs.max_len} positions; model.max_len is {ours.max_len}"
        )
    if theirs.output_bias:
        raise UserError(f"train.init_decoder: {directory} has output_bias=true; a speech model's output layer has none")
    if ours.bias and not ours.key_bias:
        raise UserError(f"train.init_decoder: model.key_bias is false; {directory}'s decoder has key biases")
    state = {}
    for name, value in pretrained.state_dict().items():
        for prefix, mine in DECODER_PARTS.items():
            if name.startswith(prefix):
                state[mine + name[len(prefix) :]] = value
    if "embed.position.weight" in state:  # learned positions: our window is a prefix of theirs
        state["embed.position.weight"] = state["embed.position.weight"][: ours.max_len]
    # Equal decoder fields build equal decoder parameters; the loaded model names a shared or
    # tied tensor under each of its names, so every one of ours is there (checked all the same).
    loaded = model.load_state_dict(state, strict=False)
    missing = [k for k in loaded.missing_keys if k.startswith(tuple(DECODER_PARTS.values()))]
    if missing or loaded.unexpected_keys:
        raise UserError(
            f"train.init_decoder: {directory} lacks {missing[:1]} or has extra {loaded.unexpected_keys[:1]}"
        )
    return directory
