"""Marian: ``MarianMTModel`` <-> qkv ``encoder_decoder``, and MarianTokenizer's files as qkv tokenizers.

What is here: :func:`marian_fields` / :func:`marian_config` (HF ``config.json`` <-> qkv config
fields), :func:`marian_to_qkv` / :func:`qkv_to_marian` (weight names), :func:`marian_positions`
(a checkpoint's stored sinusoids, checked), :func:`marian_tokenizers` and
:func:`marian_tokenizer` (SentencePiece files -> qkv tokenizers). What is not: import and export
themselves (``convert.py``), what the families share (``common.py``).

The model: post-norm, sinusoids in two halves, √D-scaled embeddings, shared or separate
embeddings, ``final_logits_bias``. Decoding starts from the padding token, so the qkv
``bos_id`` is Marian's ``decoder_start_token_id``. Shared embeddings without
``tie_word_embeddings``: transformers 5.x then does not tie ``model.shared`` to the stacks'
``embed_tokens``, which it computes with; import reads the encoder's (refusing a decoder table
that differs: qkv shares one), export writes all three. ``activation_dropout`` is dropped
(training only). Not supported: different encoder and decoder widths or head counts.

The tokenizer: ``source.spm`` + ``vocab.json`` become a ``tokenizer.json`` that gives the ids
``MarianTokenizer`` gives a source text (``</s>`` appended) and, with a shared vocabulary, the
text its ``decode(ids, skip_special_tokens=True)`` gives. With separate vocabularies
(``separate_vocabs`` in ``tokenizer_config.json``) ``target.spm`` + ``target_vocab.json``
become qkv's ``target_tokenizer.json`` the same way: it encodes targets as MarianTokenizer's
target mode does and decodes as its ``decode`` does; the two sides must give the special tokens
the same ids (qkv's model has one padding, BEGIN and END id). So ``qkv translate`` and ``qkv
generate`` run an imported Marian. The SentencePiece files, the ``vocab.json`` files and
``tokenizer_config.json`` are kept in the qkv directory (with their SHA-256) and are what
export writes back. Refused: a ``source.spm`` other than a unigram model of normal and control
pieces (BPE, byte fallback, user-defined pieces). Not converted: a tokenizer whose files are
missing (say, ``separate_vocabs`` without ``target_vocab.json``); its files are kept and
exported, the model runs from token ids in Python and ``qkv translate`` refuses it.

Where the converted tokenizer still differs from ``MarianTokenizer``: a target-language code
(``>>fra<<``) is read wherever it stands (MarianTokenizer: at the start only, and an unknown
code as ``<unk>``); a ``source.spm`` piece that ``vocab.json`` lacks, which MarianTokenizer
reads as ``<unk>``, is segmented around instead; a text that only its normalization (NFKC)
turns into a special token's text (fullwidth ``＜pad＞``, where ``<`` and ``>`` have pieces)
reads as that token. Targets with a shared vocabulary (fine-tuning, teacher-forced loss) are
segmented with ``source.spm`` (MarianTokenizer: ``target.spm``), as qkv has one tokenizer for
both sides there; with separate vocabularies with ``target.spm``, as MarianTokenizer does.
(Either way without the tokenizer's ``</s>``: the batch appends END, the same id.)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from torch import Tensor

from qkv.errors import UserError
from qkv.files import read_json_object
from qkv.hf.common import (
    HF_CONFIG,
    TOKENIZER_CONFIG,
    HFConfig,
    State,
    TokenizerSettings,
    hf_activation,
    linear,
    require,
    same_heads,
)
from qkv.layers import sinusoidal_encoding
from qkv.models.encoder_decoder import EncoderDecoderConfig
from qkv.tokenization import FILE, TARGET_FILE, Tokenizer

if TYPE_CHECKING:  # protobuf-generated; imported where used, so that qkv.hf.marian loads without protobuf
    from sentencepiece.sentencepiece_model_pb2 import ModelProto

MARIAN = ("MarianMTModel",)
MARIAN_TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json", TOKENIZER_CONFIG)
# Suffixes of the vocab.json tokens the source SentencePiece model never produces, in the
# converted Unigram model: with a space in them they can never match text (the normalizer
# turns every space into "▁"), and the decoder removes the suffix (or, for a control piece
# such as <s>, the whole token, which SentencePiece decodes to nothing).
NOT_SOURCE, CONTROL = " (not in source.spm)", " (control)"


def marian_fields(config: HFConfig) -> dict:
    """The qkv ``encoder_decoder`` fields of a Marian config.json."""
    n_heads, d_ff = config.integer("encoder_attention_heads", 16), config.integer("encoder_ffn_dim", 4096)
    if config.integer("decoder_attention_heads", 16) != n_heads:
        raise config.refuse("decoder_attention_heads", f"qkv's stacks share one head count, here {n_heads}")
    if config.integer("decoder_ffn_dim", 4096) != d_ff:
        raise config.refuse("decoder_ffn_dim", f"qkv's stacks share one feed-forward width, here {d_ff}")
    share = config.flag("share_encoder_decoder_embeddings", True)
    src_vocab = config.integer("vocab_size")
    tgt_vocab = src_vocab
    if not share and config.fields.get("decoder_vocab_size") is not None:
        tgt_vocab = config.integer("decoder_vocab_size")
    pad_id = config.token_id("pad_token_id", 58100, tgt_vocab)
    bos_id = config.token_id("decoder_start_token_id", 58100, tgt_vocab)
    eos_id = config.token_id("eos_token_id", 0, tgt_vocab)
    for name, value in (("pad_token_id", pad_id), ("decoder_start_token_id", bos_id), ("eos_token_id", eos_id)):
        if value is None:
            raise UserError(f"{config.path}: field {name!r} must be a token id, got null")
    return {
        "d_model": config.integer("d_model", 1024),
        "n_heads": n_heads,
        "d_ff": d_ff,
        "activation": config.activation("activation_function", "gelu"),
        "norm": "layernorm",
        "norm_eps": 1e-5,  # Marian's LayerNorms keep torch's default epsilon
        "norm_first": False,
        "positions": "sinusoidal_halves",
        "max_len": config.integer("max_position_embeddings", 1024),
        "dropout": config.number("dropout", 0.1),
        "attention_dropout": config.number("attention_dropout", 0.0),
        "bias": True,
        "src_vocab_size": src_vocab,
        "tgt_vocab_size": tgt_vocab,
        "n_encoder_layers": config.integer("encoder_layers", 12),
        "n_decoder_layers": config.integer("decoder_layers", 12),
        "share_embeddings": share,
        "tie_output": config.flag("tie_word_embeddings", True),
        "scale_embeddings": config.flag("scale_embedding", False),
        "pad_id": pad_id,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "output_bias": True,
    }


def marian_bad_words(hf_dir: Path, config: HFConfig, vocab_size: int) -> list[list[int]] | None:
    """The token sequences a Marian checkpoint never generates (``bad_words_ids``: its
    generation_config.json's, else its config.json's; Marian's own ban its padding id, which HF's
    ``generate`` applies), checked to be lists of ids below ``vocab_size``; None where it has none."""
    path = hf_dir / "generation_config.json"
    generation = read_json_object(path) if path.is_file() else {}
    found = generation.get("bad_words_ids", config.fields.get("bad_words_ids"))
    if found is None:
        return None
    if not isinstance(found, list) or not all(
        isinstance(seq, list) and seq and all(type(t) is int and 0 <= t < vocab_size for t in seq) for seq in found
    ):
        raise config.refuse("bad_words_ids", f"must be lists of token ids below {vocab_size}")
    return found


def _marian_names(config: EncoderDecoderConfig) -> list[tuple[str, str]]:
    """(qkv name, HF name) of every Marian tensor but ``final_logits_bias`` (shaped (1, V) there)."""
    if config.share_embeddings:
        names = [("src_embed.token.weight", "model.shared.weight")]
    else:
        names = [
            ("src_embed.token.weight", "model.encoder.embed_tokens.weight"),
            ("tgt_embed.token.weight", "model.decoder.embed_tokens.weight"),
        ]
    if not config.tie_output:
        names.append(("output.weight", "lm_head.weight"))
    attention = (("w_q", "q_proj"), ("w_k", "k_proj"), ("w_v", "v_proj"), ("w_o", "out_proj"))
    for stack, n_layers in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        for i in range(n_layers):
            q, h = f"{stack}.blocks.{i}", f"model.{stack}.layers.{i}"
            for mine, theirs in attention:
                linear(names, f"{q}.self_attn.{mine}", f"{h}.self_attn.{theirs}")
                if stack == "decoder":
                    linear(names, f"{q}.cross_attn.{mine}", f"{h}.encoder_attn.{theirs}")
            linear(names, f"{q}.norm_1", f"{h}.self_attn_layer_norm")
            if stack == "decoder":
                linear(names, f"{q}.norm_2", f"{h}.encoder_attn_layer_norm")
            linear(names, f"{q}.ffn.w_1", f"{h}.fc1")
            linear(names, f"{q}.ffn.w_2", f"{h}.fc2")
            linear(names, f"{q}.norm_{3 if stack == 'decoder' else 2}", f"{h}.final_layer_norm")
    return names


def marian_to_qkv(tensors: Mapping[str, Tensor], config: EncoderDecoderConfig) -> State:
    """qkv ``encoder_decoder`` weights from Marian tensors (named as :func:`qkv_to_marian` writes them)."""
    state = {mine: tensors[theirs] for mine, theirs in _marian_names(config)}
    state["output.bias"] = tensors["final_logits_bias"].reshape(-1)  # (1, V) -> (V,)
    return state


def qkv_to_marian(state: Mapping[str, Tensor], config: EncoderDecoderConfig) -> State:
    """Marian tensors from qkv ``encoder_decoder`` weights (a zero ``final_logits_bias`` without an output bias)."""
    tensors = {theirs: state[mine] for mine, theirs in _marian_names(config)}
    bias = state["output.bias"] if config.output_bias else torch.zeros(config.tgt_vocab_size)
    tensors["final_logits_bias"] = bias.reshape(1, -1)  # (V,) -> (1, V)
    return tensors


def marian_config(config: EncoderDecoderConfig) -> dict:
    """The HF config.json of an encoder-decoder model that computes what Marian computes (else a UserError)."""
    target = "Marian"
    require(
        config,
        target,
        {
            "norm_first": False,
            "norm": "layernorm",
            "positions": "sinusoidal_halves",
            "bias": True,
            "attention": "softmax",
        },
    )
    same_heads(config, target)
    if abs(config.norm_eps - 1e-5) > 1e-12:
        raise UserError(f"cannot export as Marian: its LayerNorms use eps=1e-05, this model has {config.norm_eps}")
    activation = hf_activation(config.activation, target)
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": config.src_vocab_size,
        "decoder_vocab_size": config.tgt_vocab_size,
        "d_model": config.d_model,
        "encoder_layers": config.n_encoder_layers,
        "decoder_layers": config.n_decoder_layers,
        "encoder_attention_heads": config.n_heads,
        "decoder_attention_heads": config.n_heads,
        "encoder_ffn_dim": config.d_ff,
        "decoder_ffn_dim": config.d_ff,
        "activation_function": "swish" if activation == "silu" else activation,
        "dropout": config.dropout,
        "attention_dropout": config.attention_dropout,
        "activation_dropout": 0.0,
        "max_position_embeddings": config.max_len,
        "scale_embedding": config.scale_embeddings,
        "share_encoder_decoder_embeddings": config.share_embeddings,
        "tie_word_embeddings": config.tie_output,
        "pad_token_id": config.pad_id,
        "decoder_start_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "forced_eos_token_id": config.eos_id,
        "is_encoder_decoder": True,
    }


def marian_positions(tensors: Mapping[str, Tensor], config: EncoderDecoderConfig, file: Path) -> set[str]:
    """Marian checkpoints may hold the sinusoids, which qkv computes itself: they must be Marian's.
    Returns the names of those the checkpoint holds."""
    found = set()
    for stack in ("encoder", "decoder"):
        name = f"model.{stack}.embed_positions.weight"
        if name in tensors:
            stored = tensors[name].float()  # (positions, D)
            computed = sinusoidal_encoding(torch.arange(stored.shape[0]), config.d_model, halves=True)  # (positions, D)
            if stored.shape != computed.shape or (stored - computed).abs().max() > 1e-3:
                raise UserError(f"{file}: tensor {name!r} is not Marian's sinusoids, which qkv computes itself")
            found.add(name)
    return found


def marian_tokenizers(
    directory: Path, config: EncoderDecoderConfig
) -> tuple[dict[str, Path], list[tuple[Tokenizer, Path]], str]:
    """MarianTokenizer's files in ``directory`` (name -> path), the qkv tokenizers converted from
    them, each with the vocabulary file it came from (the source's, and with separate
    vocabularies the target's; none where a file is missing), and what became of them, as
    :func:`~qkv.hf.convert.import_hf`'s summary says it."""
    files = {name: directory / name for name in MARIAN_TOKENIZER_FILES if (directory / name).is_file()}
    kept = f"kept {', '.join(files)} for export"
    pairs = [("source.spm", "vocab.json")]
    if TokenizerSettings(directory).get("separate_vocabs"):  # MarianTokenizer's target mode reads these
        pairs.append(("target.spm", "target_vocab.json"))
    missing = [name for pair in pairs for name in pair if name not in files]
    if missing:
        return files, [], f"{kept}; not converted: {' and '.join(missing)} missing" if files else "none"
    tokenizers = []
    for spm_file, vocab_file in pairs:
        side = marian_tokenizer(directory, config, spm_file=spm_file, vocab_file=vocab_file)
        tokenizers.append((side, directory / vocab_file))
    converted = " and ".join(f"{a} + {b}" for a, b in pairs)
    return files, tokenizers, f"{FILE}{f' and {TARGET_FILE}' if len(pairs) == 2 else ''} from {converted} ({kept})"


def _read_spm(path: Path) -> ModelProto:
    """The protobuf of a SentencePiece model file."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except (OSError, DecodeError) as e:
        raise UserError(f"cannot read {path} as a SentencePiece model: {e}") from None
    if not proto.pieces:
        raise UserError(f"{path} is not a SentencePiece model: it has no pieces")
    return proto


def _check_spm(path: Path, proto: ModelProto) -> None:
    """Refuse what the conversion below does not reproduce (none of it occurs in Marian's models)."""
    from sentencepiece.sentencepiece_model_pb2 import ModelProto, TrainerSpec

    piece_type = ModelProto.SentencePiece
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    refused = [
        ("model_type", trainer.model_type != TrainerSpec.UNIGRAM, "only unigram models are"),
        ("byte_fallback", trainer.byte_fallback, "byte pieces are not"),
        ("treat_whitespace_as_suffix", trainer.treat_whitespace_as_suffix, "only word-initial ▁ is"),
        ("escape_whitespaces", not spec.escape_whitespaces, "spaces must become ▁"),
        ("denormalizer_spec", bool(proto.denormalizer_spec.precompiled_charsmap), "a denormalizer is not"),
    ]
    for field, bad, why in refused:
        if bad:
            raise UserError(f"{path}: {field} is not supported: {why}")
    for piece in proto.pieces:
        if piece.type not in (piece_type.NORMAL, piece_type.UNKNOWN, piece_type.CONTROL):
            kind = piece_type.Type.Name(piece.type).lower()
            raise UserError(f"{path}: piece {piece.piece!r} is {kind}; qkv converts normal and control pieces only")


def marian_tokenizer(directory: Path, config: EncoderDecoderConfig, *, spm_file: str, vocab_file: str) -> Tokenizer:
    """One side of MarianTokenizer as a ``tokenizers`` Unigram model over the ids of ``vocab_file``.

    The sides: the source's ``source.spm`` + ``vocab.json``, which with a shared vocabulary is
    the target's too; with separate vocabularies the target's ``target.spm`` +
    ``target_vocab.json`` (MarianTokenizer's target mode, and its decoding). Below, source.spm
    and vocab.json stand for either pair.

    MarianTokenizer segments a source text with source.spm, looks each piece up in vocab.json
    (a piece it lacks is <unk>) and appends </s>; it decodes ids through vocab.json and, with a
    shared vocabulary, source.spm, then strips the text. Rebuilt here as HF's converter of
    SentencePiece models does it: source.spm's normalizer (precompiled character map,
    whitespace rules) and Metaspace, then a Unigram model whose token i is vocab.json's id i,
    scored as in source.spm so that its best segmentation is SentencePiece's, and a
    post-processor that appends </s> (``Tokenizer.add_special_tokens``). BEGIN is the decoder's
    start token; multilingual models' target-language codes (>>fra<<) are added tokens.

    SentencePiece never produces most other vocab.json tokens (the target side's pieces, its
    own control pieces such as <s>), so they are kept out of the text's reach (NOT_SOURCE): a
    low score would not do, as the Unigram model prefers any piece to <unk>. It does produce,
    for a run of characters it has no piece for, the run's text as one piece, which vocab.json
    may hold (the target side's "É", or a rare character of the source side); a normalizer
    step turns every such run that vocab.json lacks into one U+FFFF (read as <unk>), so that a
    token made of such characters matches only a whole run, as MarianTokenizer's look-up does.
    The unmatched tokens get source.spm's lowest score: the Unigram model scores <unk> from the
    lowest score of its vocabulary, which must stay SentencePiece's.
    """
    spm_path, vocab_path = directory / spm_file, directory / vocab_file
    proto = _read_spm(spm_path)
    _check_spm(spm_path, proto)
    vocab = read_json_object(vocab_path)
    ids = list(vocab.values())
    if any(type(i) is not int for i in ids) or sorted(ids) != list(range(len(ids))):
        raise UserError(f"{vocab_path} must map tokens to the ids 0, 1, ..., N-1, each once")
    tokens = sorted(vocab, key=vocab.__getitem__)  # token i has id i
    settings = TokenizerSettings(directory)
    eos, _ = settings.token("eos_token", "</s>")
    unk, _ = settings.token("unk_token", "<unk>")
    pad, _ = settings.token("pad_token", "<pad>")
    if config.bos_id >= len(tokens):
        raise UserError(f"{vocab_path} has no id {config.bos_id} ({HF_CONFIG}'s decoder_start_token_id)")
    specials = {"pad": pad, "bos": tokens[config.bos_id], "eos": eos, "unk": unk}
    for role, token in specials.items():
        if token is None or token not in vocab:
            raise UserError(f"{vocab_path} lacks the {role} token {token!r}")
    codes = [t for t in tokens if t.startswith(">>") and t.endswith("<<")]  # MarianTokenizer's test
    whole = set(specials.values()) | set(codes)  # matched in the raw text, before the normalizer

    normal = type(proto).SentencePiece.NORMAL
    source = {p.piece: p for p in proto.pieces}
    lowest = min((p.score for p in proto.pieces if p.type == normal), default=0.0)
    # SentencePiece reads a character it has no one-character piece for as unknown.
    known = {p.piece for p in proto.pieces if p.type == normal and len(p.piece) == 1}
    scored: list[tuple[str, float]] = []
    surfaces = []  # tokens that are the text of a run of unknown characters
    for token in tokens:
        piece = source.get(token)
        if token in whole:
            scored.append((token, 0.0))  # SentencePiece scores its control pieces 0 too
        elif piece is not None and piece.type == normal:
            scored.append((token, piece.score))
        elif piece is None and token and not known.intersection(token):
            scored.append((token, lowest))  # one piece beats two or more: a whole run is this token
            surfaces.append(token)
        else:
            scored.append((token + (NOT_SOURCE if piece is None else CONTROL), lowest))
    backend = HFTokenizer(models.Unigram(scored, unk_id=vocab[unk], byte_fallback=False))

    spec = proto.normalizer_spec
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    steps.append(normalizers.Replace(" ", "▁"))
    if spec.add_dummy_prefix:
        # SentencePiece prefixes "▁" even to a text that starts with one; Metaspace would not.
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
    # A maximal run of unknown characters (none before it, at least one) that is not one of
    # the surfaces becomes U+FFFF, a noncharacter no vocabulary holds: one <unk>.
    unknown = "[^" + "".join(re.escape(c) for c in sorted(known)) + "]"
    run = rf"(?<!{unknown})(?={unknown})"
    if surfaces:
        run += rf"(?!(?:{'|'.join(re.escape(t) for t in surfaces)})(?!{unknown}))"
    steps.append(normalizers.Replace(Regex(rf"{run}{unknown}+"), "\uffff"))
    backend.normalizer = normalizers.Sequence(steps)
    # "always": every stretch of text between special tokens gets the prefix, as MarianTokenizer
    # hands each stretch to SentencePiece on its own; split=False: one Viterbi pass per stretch.
    scheme = "always" if spec.add_dummy_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(Regex(rf"\A.*{re.escape(CONTROL)}\z"), ""),
            decoders.Replace(NOT_SOURCE, ""),
            decoders.Replace("▁", " "),
            decoders.Fuse(),
            decoders.Replace(Regex(r"\A\s+|\s+\z"), ""),  # MarianTokenizer strips the decoded text
        ]
    )
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {eos}:0", pair=f"$A:0 $B:0 {eos}:0", special_tokens=[(eos, vocab[eos])]
    )
    backend.add_special_tokens(sorted(set(specials.values())))
    backend.add_tokens([AddedToken(code, normalized=False) for code in codes])
    return Tokenizer(backend, specials=specials, add_special_tokens=True)
