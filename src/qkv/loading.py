"""A model directory loaded for use: the model prepared for decoding and its tokenizers.

What is here: :func:`check_options` (which precisions and devices apply to which kind of
model: the one rule :func:`qkv.bundle.load` and the server share), :func:`prepared` (a model as
its jobs run it: stacked for decoding, bfloat16 or int8, on its device), :func:`load_for_generation`
(a generating model, so prepared, with its :class:`~qkv.tokenization.Vocabularies`),
:func:`load_fusion_lm` (a language model to fuse into a speech model's beam search),
:func:`matching_vocabularies` and :func:`matching_tokenizer` (a model directory's tokenizers,
refused when they do not fit the model). The command line and the server load models through
here (or through ``bundle/``, built on it), so both refuse the same mistakes with the same words.

What is not here: reading and checking the directory itself (``checkpoint.py``), the decoding
preparations (``decoding_copies.for_decoding``, ``decoding_copies.int8_linears``), everything
else a loaded model carries and the jobs it does (``bundle/``).
"""

from __future__ import annotations

from qkv.errors import OptionError, UserError

# The kinds that write tokens step by step over a KV cache: stacked Q/K/V and int8 linear
# layers are decoding copies (decoding_copies.py), for these alone.
DECODING_KINDS = ("encoder_decoder", "decoder_only", "speech_encoder_decoder")
KIND_NAMES = {  # each kind as a message names it
    "encoder_decoder": "an encoder_decoder model",
    "decoder_only": "a decoder_only model",
    "encoder_only": "an encoder_only model",
    "speech_encoder_decoder": "a speech model (speech_encoder_decoder)",
    "tts": "a text-to-speech model (tts)",
    "vits": "a Piper voice (vits)",
}


def check_options(path: object, kind: str, *, bf16: bool = False, int8: bool = False, device: object = "cpu") -> None:
    """Refuse, in one line naming the option and the kind, a precision that does not apply to a
    ``kind`` model in ``path``: int8 linear layers speed up decoding, so only the kinds that
    decode take them (and only on the CPU, where their int8-weight kernel runs); a
    text-to-speech model synthesizes in float32; one precision at a time."""
    import torch

    if bf16 and int8:
        raise OptionError("bf16 and int8 are exclusive: one precision at a time", "bf16", "int8")
    if int8 and kind not in DECODING_KINDS:
        raise OptionError(
            f"int8 does not apply to {path}: it holds {KIND_NAMES[kind]}, which decodes nothing "
            "(int8 linear layers speed up decoding)",
            "int8",
        )
    if bf16 and kind in ("tts", "vits"):
        raise OptionError(f"bf16 does not apply to {path}: {KIND_NAMES[kind]} synthesizes in float32", "bf16")
    if int8 and torch.device(device).type != "cpu":
        raise OptionError(f"int8 runs on the CPU only (its int8-weight kernel), not on {device}", "int8")


def prepared(model, kind: str, *, bf16: bool = False, int8: bool = False, device: object = "cpu"):
    """A copy of ``model``, a ``kind`` model, as its jobs run it (:func:`check_options` first): a
    decoding kind with one stacked Q/K/V product per self-attention (tested equal); in bfloat16
    (half the bytes per weight: batched decoding reads every weight once per step, and the CPU's
    bf16 matmul units, AVX512-BF16 and AMX, do the rest; bench/mt_speed.py) or with int8 linear
    layers (int8 weights: a quarter of the bytes; qkv.int8); in bfloat16 on the CPU, with the
    linear layers' weights packed once for oneDNN (``decoding_copies.packed_linears``: the same
    outputs, a quarter less CPU time a greedy step); in float32 on the CPU, with the
    widening layers' weights stored transposed (``decoding_copies.for_decoding``: faster one-row
    products, tested equal); on ``device``."""
    import torch

    from qkv.decoding_copies import for_decoding, int8_linears, packed_linears

    cpu = torch.device(device).type == "cpu"
    if kind in DECODING_KINDS:
        model = for_decoding(model, wide=not (bf16 or int8) and cpu)
    if bf16:
        model = model.to(torch.bfloat16)
        model = packed_linears(model) if kind in DECODING_KINDS and cpu else model
    if int8:  # a speech model's layers kept float (bfloat16 where native), its argmax float32's: Whisper's words
        model = int8_linears(model, float_decoder=kind == "speech_encoder_decoder")
    return model.to(device).eval()


def load_for_generation(path: str, *, bf16: bool = False, int8: bool = False, speech: bool = False):
    """The model of ``path`` and its Vocabularies (a decoder-only model's: one tokenizer, joint).

    ``speech``: the caller reads audio and wants a speech encoder-decoder; otherwise text in,
    and a speech model is refused as a text-to-speech model always is, naming what it does.
    A translation model trained with ``data.source_as_transcript`` reads every source
    lowercased without punctuation, as it learnt (the source tokenizer prepares each text:
    ``Tokenizer.reading``). Its config.json is read once.
    """
    from qkv.checkpoint import load_model, model_dir, read_meta

    path = str(model_dir(path))  # a training run: its final checkpoint
    meta = read_meta(path)
    kind = meta["kind"]
    if kind in ("tts", "vits"):
        raise UserError(f"{path} holds a text-to-speech model: it speaks text and writes none")
    if speech and kind != "speech_encoder_decoder":
        raise UserError(f"{path} holds a {kind} model, which reads text; this needs a speech model")
    if not speech and kind == "speech_encoder_decoder":
        raise UserError(f"{path} holds a speech model, which reads audio and transcribes it")
    if kind == "encoder_only":
        raise UserError(f"{path} holds an encoder_only model, which does not generate text")
    check_options(path, kind, bf16=bf16, int8=int8)
    model, meta = load_model(path, meta=meta)
    model = prepared(model, kind, bf16=bf16, int8=int8)
    vocab = matching_vocabularies(path, model, files=meta.get("files", {}), use="generating")
    return model, reading_as_trained(vocab, meta.get("recipe"))


def reading_as_trained(vocab, recipe: dict | None):
    """``vocab`` (Vocabularies, or one joint Tokenizer) reading sources as the model learnt
    them: a translation model trained with ``data.source_as_transcript`` reads every source
    as a speech recognizer writes it, typed text and transcripts alike; others as given."""
    from qkv.evaluation import normalize_transcript
    from qkv.tokenization import Vocabularies

    vocab = Vocabularies.of(vocab)
    if not ((recipe or {}).get("data") or {}).get("source_as_transcript"):
        return vocab
    return Vocabularies(vocab.source.reading(normalize_transcript), vocab.target)


def load_fusion_lm(path: str, tokenizer, *, model, bf16: bool = False, device: object = "cpu"):
    """The decoder-only language model of ``path``, prepared for decoding, to fuse into the
    beam search of ``model``, whose output tokenizer is ``tokenizer`` (``beam_search``'s
    ``lm``). Refused (an :class:`~qkv.errors.OptionError` about ``lm``), naming how to train one
    (the lm task with ``data.tokenizer`` = the model's directory, ``data.documents=lines``),
    unless it has that tokenizer, learnt where a text ends (END after every line) and has a
    window as long as the model's."""
    from qkv.checkpoint import load_model, model_dir, read_meta

    path = str(model_dir(path))
    meta = read_meta(path)
    if meta["kind"] != "decoder_only":
        raise OptionError(f"lm {path} holds a {meta['kind']} model; fusion needs a decoder-only language model", "lm")
    lm, meta = load_model(path, kind="decoder_only", meta=meta)
    how = "train one with recipes/speech_en_lm.yaml (data.tokenizer: the speech model's directory)"
    theirs = matching_tokenizer(path, lm, files=meta.get("files", {}), use="fusion")
    if not theirs.same_as(tokenizer) or lm.config.vocab_size != model.config.vocab_size:
        raise OptionError(f"lm {path}: its tokens are not the speech model's; {how}", "lm")
    if ((meta.get("recipe") or {}).get("data") or {}).get("documents") != "lines":
        raise OptionError(f"lm {path} never learnt where a text ends (data.documents=lines); {how}", "lm")
    if lm.config.max_len < model.config.max_len:
        raise OptionError(
            f"lm {path}: its window ({lm.config.max_len}) is shorter than the speech model's "
            f"({model.config.max_len}); {how}",
            "lm",
        )
    return prepared(lm, "decoder_only", bf16=bf16, device=device)  # stacked Q/K/V, as the model has


def matching_tokenizer(path: str, model, *, files, use: str):
    """The model directory's tokenizer (:func:`matching_vocabularies`'s source side)."""
    return matching_vocabularies(path, model, files=files, use=use).source


def matching_vocabularies(path: str, model, *, files, use: str):
    """The model directory's Vocabularies (separate when ``files``, its config.json's, list
    target_tokenizer.json); refused, naming ``use`` (what needs it), when it has no
    tokenizer.json, and when a tokenizer has ids the model has no embedding for."""
    from qkv.checkpoint import model_dir
    from qkv.tokenization import FILE, Vocabularies

    if FILE not in files:
        raise UserError(f"{path} has no {FILE}; {use} needs a model saved with its tokenizer")
    vocab = Vocabularies.load(model_dir(path), files=files)
    c = model.config
    sizes = (c.src_vocab_size, c.tgt_vocab_size) if hasattr(c, "src_vocab_size") else (c.vocab_size, c.vocab_size)
    for tokenizer, name, size in vocab.tables(src_vocab_size=sizes[0], tgt_vocab_size=sizes[1]):
        if tokenizer.vocab_size > size:
            raise UserError(f"{path}: {name} has {tokenizer.vocab_size} tokens but the model only {size}")
    return vocab
