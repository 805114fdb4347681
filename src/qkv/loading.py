"""A model directory loaded for use: the model prepared for decoding and its tokenizers.

What is here: :func:`load_for_generation` (a generating model, stacked for decoding and
optionally in bfloat16 or int8, with its :class:`~qkv.tokenization.Vocabularies`),
:func:`matching_vocabularies` and :func:`matching_tokenizer` (a model directory's tokenizers,
refused when they do not fit the model). The command line and the server load models
through here, so both refuse the same mistakes with the same words.

What is not here: reading and checking the directory itself (``checkpoint.py``), the decoding
preparations (``decoding_copies.for_decoding``, ``decoding_copies.int8_linears``).
"""

from __future__ import annotations

from qkv.errors import UserError


def load_for_generation(path: str, *, bf16: bool = False, int8: bool = False, speech: bool = False):
    """The model of ``path`` and its Vocabularies (a decoder-only model's: one tokenizer, joint).

    ``speech``: the caller reads audio (``qkv transcribe``) and wants a speech encoder-decoder;
    otherwise text in, and a speech model is refused as a text-to-speech model always is,
    naming the command that runs it. A translation model trained with
    ``data.source_as_transcript`` reads every source lowercased without punctuation, as it
    learnt (the source tokenizer prepares each text: ``Tokenizer.reading``).
    """
    import torch

    from qkv.checkpoint import load_model, model_dir, read_meta
    from qkv.decoding_copies import for_decoding, int8_linears

    path = str(model_dir(path))  # a training run: its final checkpoint
    kind = read_meta(path)["kind"]
    if kind == "tts":
        raise UserError(f"{path} holds a text-to-speech model: it speaks text (qkv speak) and writes none")
    if speech and kind != "speech_encoder_decoder":
        raise UserError(f"{path} holds a {kind} model, which reads text; this needs a speech model")
    if not speech and kind == "speech_encoder_decoder":
        raise UserError(f"{path} holds a speech model, which reads audio: use qkv transcribe")
    model, meta = load_model(path)
    if meta["kind"] == "encoder_only":
        raise UserError(f"{path} holds an encoder_only model, which does not generate text")
    model = for_decoding(model)  # one stacked Q/K/V product per self-attention (tested equal)
    if bf16:
        # Half the bytes per weight: batched decoding reads every weight once per step, and
        # the CPU's bf16 matmul units (AVX512-BF16, AMX) do the rest (bench/mt_speed.py).
        model = model.to(torch.bfloat16)
    if int8:
        model = int8_linears(model)  # a quarter of the bytes: faster at every batch size
    vocab = matching_vocabularies(path, model, files=meta.get("files", {}), use="generate")
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


def load_fusion_lm(path: str, tokenizer, *, model, bf16: bool = False):
    """The decoder-only language model of ``path``, prepared for decoding, to fuse into the
    beam search of ``model``, whose output tokenizer is ``tokenizer`` (``beam_search``'s
    ``lm``). Refused, naming how to train one (the lm task with ``data.tokenizer`` = the
    model's directory, ``data.documents=lines``), unless it has that tokenizer, learnt where
    a text ends (END after every line) and has a window as long as the model's."""
    import torch

    from qkv.checkpoint import load_model, model_dir, read_meta
    from qkv.decoding_copies import for_decoding

    path = str(model_dir(path))
    kind = read_meta(path)["kind"]
    if kind != "decoder_only":
        raise UserError(f"--lm {path} holds a {kind} model; fusion needs a decoder-only language model")
    lm, meta = load_model(path, kind="decoder_only")
    how = "train one with recipes/speech_en_lm.yaml (data.tokenizer: the speech model's directory)"
    theirs = matching_tokenizer(path, lm, files=meta.get("files", {}), use="--lm")
    if not theirs.same_as(tokenizer) or lm.config.vocab_size != model.config.vocab_size:
        raise UserError(f"--lm {path}: its tokens are not the speech model's; {how}")
    if ((meta.get("recipe") or {}).get("data") or {}).get("documents") != "lines":
        raise UserError(f"--lm {path} never learnt where a text ends (data.documents=lines); {how}")
    if lm.config.max_len < model.config.max_len:
        raise UserError(
            f"--lm {path}: its window ({lm.config.max_len}) is shorter than the speech model's "
            f"({model.config.max_len}); {how}"
        )
    lm = for_decoding(lm)  # one stacked Q/K/V product per self-attention, as the model has
    return lm.to(torch.bfloat16) if bf16 else lm


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
