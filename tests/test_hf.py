"""Tests of qkv.hf: Hugging Face BERT, GPT-2 and Marian checkpoints in and out of qkv.

Small random HF models (tiny, mostly odd sizes: D=15 with H=3, F=22; the weights are moved
off their initial values so every tensor matters) are saved with ``save_pretrained``,
imported, compared with the original (hidden states and logits within 1e-4, with padding;
greedy generations identical; tokenization identical), exported back, loaded with
``from_pretrained`` and compared again. Tokenizers are trained here with the ``tokenizers``
library (and ``sentencepiece`` for Marian); nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    BertTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Tokenizer,
    MarianConfig,
    MarianMTModel,
)

from qkv.checkpoint import load_model, read_meta, save_model  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.decoding import greedy  # noqa: E402
from qkv.errors import UserError  # noqa: E402
from qkv.hf.common import HFConfig, load_state  # noqa: E402
from qkv.hf.convert import export_hf, import_hf  # noqa: E402
from qkv.hf.gpt2 import gpt2_fields  # noqa: E402
from qkv.layers import sinusoidal_encoding  # noqa: E402
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig  # noqa: E402
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig  # noqa: E402
from qkv.tokenization import Tokenizer, Vocabularies  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ATOL = 1e-4
TEXTS = [
    "Hello world, this is a tiny corpus.",
    "The quick brown fox jumps over the lazy dog!",
    "Café naïve résumé: 123 456 7.5%",
    "UPPER case  and   spaces\tand a tab",
    "unseen words like zyxw and 東京 🚀 [MASK] too",
]
CORPUS = TEXTS[:3] * 20 + ["a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , ! ?"]


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every trainable parameter off its initial value (LayerNorm 1/0, zero biases); frozen
    ones (Marian's sinusoids, which HF recomputes rather than saves) stay. Vectors move less, so
    that no bias dominates the logits whatever the input."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a - b).abs().max().item() <= ATOL, (a - b).abs().max().item()


# ------------------------------------------------------------------------ tokenizers


@pytest.fixture(scope="module")
def bert_vocab(tmp_path_factory) -> Path:
    """A directory holding only a WordPiece vocab.txt (the legacy BERT tokenizer files)."""
    directory = tmp_path_factory.mktemp("bert_vocab")
    trained = BertWordPieceTokenizer(lowercase=True)
    trained.train_from_iterator(CORPUS, vocab_size=90, min_frequency=1)
    trained.save_model(str(directory))
    return directory


@pytest.fixture(scope="module")
def gpt2_vocab(tmp_path_factory) -> Path:
    """A directory holding a byte-level BPE vocab.json + merges.txt (the legacy GPT-2 files)."""
    directory = tmp_path_factory.mktemp("gpt2_vocab")
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    trained.save_model(str(directory))
    return directory


# ------------------------------------------------------------------------------ BERT


def bert_inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(5, vocab, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, 3:] = False
    tokens[~mask] = 0
    types = (torch.arange(9) >= 4).long().expand(3, 9).clone()
    return tokens, mask, types


def bert_outputs(model, tokens, mask, types) -> list[torch.Tensor]:
    """HF BERT: last hidden states (real tokens) and the class's logits."""
    with torch.no_grad():
        out = model(input_ids=tokens, attention_mask=mask.long(), token_type_ids=types, output_hidden_states=True)
    hidden = out.last_hidden_state if isinstance(model, BertModel) else out.hidden_states[-1]
    logits = out.pooler_output if isinstance(model, BertModel) else out.logits
    return [hidden[mask], logits[mask] if logits.dim() == 3 else logits]


@pytest.mark.parametrize("architecture", [BertModel, BertForMaskedLM, BertForSequenceClassification])
def test_bert_round_trip(architecture, bert_vocab: Path, tmp_path: Path) -> None:
    """BERT -> encoder_only -> BERT: hidden states, MLM / classifier logits, tokenizer all agree."""
    hf_tokenizer = BertTokenizer.from_pretrained(bert_vocab)
    vocab = len(hf_tokenizer)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=15,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=22,
        max_position_embeddings=23,
        type_vocab_size=2,
        num_labels=3,
    )
    torch.manual_seed(0)
    hf = architecture(config).eval()
    perturb(hf, 1)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    if architecture is BertModel:
        # The legacy files: vocab.txt only, and weights in a pytorch_model.bin with gamma/beta names.
        shutil.copy(bert_vocab / "vocab.txt", src / "vocab.txt")
        state = {
            k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
            for k, v in load_file(src / "model.safetensors").items()
        }
        torch.save(state, src / "pytorch_model.bin")
        (src / "model.safetensors").unlink()
    else:
        hf_tokenizer.save_pretrained(src)

    summary = import_hf(src, tmp_path / "qkv")
    assert summary["kind"] == "encoder_only" and summary["tokenizer"] == "tokenizer.json"
    model, meta = load_model(tmp_path / "qkv")
    assert meta["hf"]["architecture"] == architecture.__name__
    assert summary["ignored"] == []
    if architecture is BertForSequenceClassification:
        assert meta["labels"] == ["LABEL_0", "LABEL_1", "LABEL_2"]
    tokens, mask, types = bert_inputs(vocab)
    with torch.no_grad():
        hidden = model.encode(tokens, mask=mask, token_types=types)
        if architecture is BertForMaskedLM:
            logits = model(tokens, mask=mask, token_types=types)[mask]
        elif architecture is BertForSequenceClassification:
            logits = model.classify(tokens, mask=mask, token_types=types)
        else:
            logits = torch.tanh(model.pooler(hidden[:, 0]))  # the pooler output BertModel returns
    expected = bert_outputs(hf, tokens, mask, types)
    assert_close(hidden[mask], expected[0])
    assert_close(logits, expected[1])

    tokenizer = Tokenizer.load(tmp_path / "qkv" / "tokenizer.json")
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (
        hf_tokenizer.pad_token_id,
        hf_tokenizer.cls_token_id,
        hf_tokenizer.sep_token_id,
    )
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer(text, add_special_tokens=False).input_ids, text

    out = tmp_path / "exported"
    export_hf(tmp_path / "qkv", out)
    back, info = architecture.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for a, b in zip(bert_outputs(back.eval(), tokens, mask, types), expected, strict=True):
        assert_close(a, b)
    back_tokenizer = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert back_tokenizer(text).input_ids == hf_tokenizer(text).input_ids, text


def test_bert_mlm_untied_and_ignored_tensors(tmp_path: Path, capsys) -> None:
    """BertForMaskedLM with tie_word_embeddings=False computes with cls.predictions.decoder.bias, not
    cls.predictions.bias: logits agree both ways. The tensors the model does not use (the next-sentence
    head, a pooler, the stale bias) are named in the summary and on one stderr line."""
    vocab = 31
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=15,
        num_hidden_layers=1,
        num_attention_heads=3,
        intermediate_size=22,
        max_position_embeddings=23,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = BertForMaskedLM(config).eval()
    perturb(hf, 3)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    tensors = load_file(src / "model.safetensors")
    assert not torch.equal(tensors["cls.predictions.bias"], tensors["cls.predictions.decoder.bias"])
    g = torch.Generator().manual_seed(9)
    unused = {
        "cls.seq_relationship.weight": torch.randn(2, 15, generator=g),
        "cls.seq_relationship.bias": torch.randn(2, generator=g),
        "bert.pooler.dense.weight": torch.randn(15, 15, generator=g),
        "bert.pooler.dense.bias": torch.randn(15, generator=g),
    }
    save_file({**tensors, **unused}, src / "model.safetensors", {"format": "pt"})

    assert main(["import-hf", str(src), str(tmp_path / "qkv"), "--json"]) == 0
    captured = capsys.readouterr()
    ignored = sorted([*unused, "cls.predictions.bias"])
    assert json.loads(captured.out)["ignored"] == ignored
    assert len(captured.err.strip().splitlines()) == 1 and all(name in captured.err for name in ignored)
    model, _ = load_model(tmp_path / "qkv")
    assert not model.config.tie_output and not model.config.pooler
    tokens, mask, types = bert_inputs(vocab)
    expected = bert_outputs(hf, tokens, mask, types)
    with torch.no_grad():
        assert_close(model(tokens, mask=mask, token_types=types)[mask], expected[1])

    out = tmp_path / "exported"
    export_hf(tmp_path / "qkv", out)
    back, info = BertForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for a, b in zip(bert_outputs(back.eval(), tokens, mask, types), expected, strict=True):
        assert_close(a, b)


def test_native_classifier_exports_labels_and_mask(tmp_path: Path) -> None:
    """A qkv classifier's label names become id2label/label2id and its tokenizer's <mask> the mask_token;
    the classifier's logits agree; importing it back stores the label names again."""
    tokenizer = Tokenizer.train_word_level(CORPUS).add_mask()
    tokenizer.save(tmp_path / "tokenizer.json")
    config = EncoderOnlyConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=15,
        n_heads=3,
        d_ff=22,
        n_layers=1,
        max_len=23,
        norm_first=False,
        positions="learned",
        scale_embeddings=False,
        embedding_norm=True,
        activation="gelu",
        type_vocab_size=2,
        n_classes=3,
        pooler=True,
        mlm_head=False,
    )
    torch.manual_seed(0)
    model = EncoderOnly(config).eval()
    perturb(model, 4)
    labels = ["négatif", "neutral", "positive"]
    files = {"tokenizer.json": tmp_path / "tokenizer.json"}
    save_model(model, tmp_path / "native", files=files, extra={"task": "classify", "labels": labels})

    out = tmp_path / "hf"
    export_hf(tmp_path / "native", out)
    settings = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert settings["mask_token"] == "<mask>"
    assert AutoTokenizer.from_pretrained(out).mask_token_id == tokenizer.mask_id
    back = BertForSequenceClassification.from_pretrained(out).eval()
    assert back.config.id2label == dict(enumerate(labels))
    assert back.config.label2id == {name: i for i, name in enumerate(labels)}
    tokens, mask, types = bert_inputs(tokenizer.vocab_size)
    with torch.no_grad():
        assert_close(model.classify(tokens, mask=mask, token_types=types), bert_outputs(back, tokens, mask, types)[1])

    import_hf(out, tmp_path / "again")
    assert load_model(tmp_path / "again")[1]["labels"] == labels


# ----------------------------------------------------------------------------- GPT-2


def gpt2_model(vocab: int, *, tied: bool, eos: int) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=vocab,
        n_embd=15,
        n_layer=2,
        n_head=3,
        n_inner=22,
        n_positions=37,
        bos_token_id=eos,
        eos_token_id=eos,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    perturb(model, 2)
    return model


def hf_greedy(model, prompts: list[list[int]], *, pad: int, eos: int, new: int) -> list[list[int]]:
    """HF greedy decoding of a left-padded batch; the new tokens of each row, cut before END."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=new, pad_token_id=pad
    )
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos)] if eos in row else row)
    return rows


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt2_round_trip(tied: bool, gpt2_vocab: Path, tmp_path: Path, capsys) -> None:
    """GPT-2 -> decoder_only -> GPT-2: logits with padding, greedy generations and tokenizer agree."""
    hf_tokenizer = GPT2Tokenizer.from_pretrained(gpt2_vocab)
    eos = hf_tokenizer.eos_token_id
    hf = gpt2_model(len(hf_tokenizer), tied=tied, eos=eos)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    if tied:
        hf_tokenizer.save_pretrained(src)  # tokenizer.json
    else:
        for name in ("vocab.json", "merges.txt"):  # the legacy files
            shutil.copy(gpt2_vocab / name, src / name)

    assert main(["import-hf", str(src), str(tmp_path / "qkv"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["architecture"] == "GPT2LMHeadModel" and summary["kind"] == "decoder_only"
    model, _ = load_model(tmp_path / "qkv")
    assert isinstance(model, DecoderOnly) and model.config.tie_output == tied

    tokens = torch.randint(1, len(hf_tokenizer), (3, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, 5:] = False  # right padding: the real tokens must not see it
    with torch.no_grad():
        expected = hf(input_ids=tokens, attention_mask=mask.long(), output_hidden_states=True)
        ours = model.decode(tokens, key_mask=mask)
    assert_close(ours.logits[mask], expected.logits[mask])

    tokenizer = Tokenizer.load(tmp_path / "qkv" / "tokenizer.json")
    assert tokenizer.pad_id is None and tokenizer.eos_id == eos
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer(text).input_ids, text
    prompts = [tokenizer.encode(t) for t in ("Hello world", "The quick brown fox jumps", "a")]
    generated = greedy(model, prompts, max_new_tokens=12)
    assert generated == hf_greedy(hf, prompts, pad=eos, eos=eos, new=12)
    assert any(len(set(row)) > 2 for row in generated)  # the model does not just repeat one token

    # The CLI end to end: tokenizer (with GPT-2's special tokens) + greedy decoding. (--output, not the
    # streamed stdout, which shows bytes of a character split across tokens as they come.)
    written = tmp_path / "out.txt"
    argv = ["generate", "--model", str(tmp_path / "qkv"), "--prompt", "Hello world", "--output", str(written)]
    assert main([*argv, "--max-new-tokens", "12"]) == 0
    text = hf_tokenizer.decode(generated[0], skip_special_tokens=True)
    assert written.read_text(encoding="utf-8") == text.replace("\\", "\\\\").replace("\n", "\\n") + "\n"

    out = tmp_path / "exported"
    assert main(["export-hf", str(tmp_path / "qkv"), str(out)]) == 0
    assert "GPT2LMHeadModel" in capsys.readouterr().out
    back, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert_close(back.eval()(input_ids=tokens, attention_mask=mask.long()).logits[mask], expected.logits[mask])
    assert hf_greedy(back, prompts, pad=eos, eos=eos, new=12) == generated
    back_tokenizer = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert back_tokenizer(text).input_ids == hf_tokenizer(text).input_ids, text


# ---------------------------------------------------------------------------- Marian


def marian_tokenizer(directory: Path, extra: tuple[str, ...] = (), *, separate: bool = False):
    """A MarianTokenizer over two tiny SentencePiece models, saved (and returned) in ``directory``;
    ``extra`` tokens go into vocab.json after the pieces of both sides, before <pad>. With
    ``separate``: vocab.json has the source pieces (and ``extra``), target_vocab.json the target's,
    each after </s>, <unk> and <pad> (ids 0, 1, 2 on both sides; the tables differ in size)."""
    sentencepiece = pytest.importorskip("sentencepiece")
    from transformers import MarianTokenizer

    directory.mkdir()
    for side in ("source", "target"):
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(CORPUS if side == "source" else [t.upper() for t in CORPUS]),
            model_prefix=str(directory / side),
            vocab_size=60,
            hard_vocab_limit=False,
            minloglevel=2,
        )
        (directory / f"{side}.model").rename(directory / f"{side}.spm")
    pieces = []
    for side in ("source", "target"):
        processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / f"{side}.spm"))
        pieces.append([processor.id_to_piece(i) for i in range(processor.get_piece_size())])

    def write(name: str, first: dict[str, int], tokens: list[str]) -> None:  # ids in order, each token once
        vocab = dict(first)
        for token in tokens:
            vocab.setdefault(token, len(vocab))
        (directory / name).write_text(json.dumps(vocab))

    spm_files = [str(directory / n) for n in ("source.spm", "target.spm", "vocab.json")]
    if separate:
        write("vocab.json", {"</s>": 0, "<unk>": 1, "<pad>": 2}, [*pieces[0], *extra])
        write("target_vocab.json", {"</s>": 0, "<unk>": 1, "<pad>": 2}, pieces[1])
        target = str(directory / "target_vocab.json")
        tokenizer = MarianTokenizer(*spm_files, target_vocab_file=target, separate_vocabs=True)
    else:  # (no piece is "<pad>": it comes last)
        write("vocab.json", {"</s>": 0, "<unk>": 1}, [*pieces[0], *pieces[1], *extra, "<pad>"])
        tokenizer = MarianTokenizer(*spm_files)
    tokenizer.save_pretrained(directory)
    return tokenizer


def marian_model(src_vocab: int, tgt_vocab: int, pad: int, **extra) -> MarianMTModel:
    """A small random Marian (END = 0, decoding from the padding token, no forced END)."""
    config = MarianConfig(
        vocab_size=src_vocab,
        decoder_vocab_size=tgt_vocab,
        d_model=15,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=3,
        decoder_attention_heads=3,
        encoder_ffn_dim=22,
        decoder_ffn_dim=22,
        max_position_embeddings=48,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=None,
        **extra,
    )
    torch.manual_seed(0)
    hf = MarianMTModel(config).eval()
    perturb(hf, 6)
    with torch.no_grad():
        hf.final_logits_bias.normal_(std=0.2, generator=torch.Generator().manual_seed(5))
    return hf


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])
def test_marian_round_trip(shared: bool, tmp_path: Path) -> None:
    """Marian -> encoder_decoder -> Marian: encoder states and logits with source padding, greedy
    translations (decoding starts from the padding token) and the SentencePiece files agree."""
    if shared:
        hf_tokenizer = marian_tokenizer(tmp_path / "tokenizer")
        src_vocab = tgt_vocab = len(hf_tokenizer)
        pad, extra = hf_tokenizer.pad_token_id, {"activation_function": "swish", "scale_embedding": True}
    else:
        hf_tokenizer, src_vocab, tgt_vocab, pad = None, 41, 29, 28
        extra = {"activation_function": "gelu", "share_encoder_decoder_embeddings": False, "tie_word_embeddings": False}
    hf = marian_model(src_vocab, tgt_vocab, pad, **extra)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    if hf_tokenizer is not None:
        hf_tokenizer.save_pretrained(src)

    summary = import_hf(src, tmp_path / "qkv")
    assert summary["kind"] == "encoder_decoder"
    model, meta = load_model(tmp_path / "qkv")
    assert model.config.bos_id == model.config.pad_id == pad and model.config.output_bias

    if hf_tokenizer is not None:
        sources = [ids for ids in hf_tokenizer(TEXTS[:3]).input_ids]  # each ends with END
        assert {"source.spm", "target.spm", "vocab.json"} <= set(meta["files"])
    else:
        g = torch.Generator().manual_seed(6)
        sources = [[*torch.randint(1, pad, (n,), generator=g).tolist(), 0] for n in (6, 3, 9)]
    width = max(len(s) for s in sources)
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sources])
    mask = ids != pad
    target = torch.randint(1, pad, (3, 6), generator=torch.Generator().manual_seed(7))
    target[:, 0] = pad  # decoding starts from the padding token
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long(), decoder_input_ids=target)
        assert_close(model.encode(ids, src_mask=mask)[mask], expected.encoder_last_hidden_state[mask])
        assert_close(model(ids, target), expected.logits)

    new = 10
    with torch.no_grad():
        hf_out = hf.generate(
            input_ids=ids, attention_mask=mask.long(), do_sample=False, num_beams=1, max_new_tokens=new
        )
    hf_rows = [row[1:] for row in hf_out.tolist()]  # drop the start token
    hf_rows = [row[: row.index(0)] if 0 in row else row for row in hf_rows]
    generated = greedy(model, sources, max_new_tokens=new)
    assert generated == hf_rows
    assert len({tuple(row) for row in generated}) > 1  # the translations depend on the source

    out = tmp_path / "exported"
    export_hf(tmp_path / "qkv", out)
    back, info = MarianMTModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        again = back.eval()(input_ids=ids, attention_mask=mask.long(), decoder_input_ids=target)
    assert_close(again.logits, expected.logits)
    if hf_tokenizer is not None:
        from transformers import MarianTokenizer

        back_tokenizer = MarianTokenizer.from_pretrained(out)
        assert back_tokenizer(TEXTS).input_ids == hf_tokenizer(TEXTS).input_ids
        assert back_tokenizer(text_target=TEXTS).input_ids == hf_tokenizer(text_target=TEXTS).input_ids


def test_marian_shared_untied(tmp_path: Path) -> None:
    """share_encoder_decoder_embeddings without tie_word_embeddings: transformers 5.x computes with
    encoder.embed_tokens and decoder.embed_tokens (model.shared is unused). Equal tables import as the
    encoder's and export under all three names; different ones are refused, naming the file."""
    pad = 40
    hf = marian_model(41, 41, pad, tie_word_embeddings=False)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    with pytest.raises(UserError, match=r"model\.safetensors: tensors 'model\.encoder\.embed_tokens\.weight' and"):
        import_hf(src, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    with torch.no_grad():
        hf.model.decoder.embed_tokens.weight.copy_(hf.model.encoder.embed_tokens.weight)
    shutil.rmtree(src)
    hf.save_pretrained(src)
    summary = import_hf(src, tmp_path / "qkv")
    assert summary["ignored"] == ["model.shared.weight"]  # perturbed, and unused by HF too
    model, _ = load_model(tmp_path / "qkv")
    assert model.config.share_embeddings and not model.config.tie_output
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(1, pad, (2, 7), generator=g)
    ids[1, 5:] = pad
    target = torch.randint(1, pad, (2, 5), generator=g)
    target[:, 0] = pad
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=(ids != pad).long(), decoder_input_ids=target).logits
        assert_close(model(ids, target), expected)

    out = tmp_path / "exported"
    export_hf(tmp_path / "qkv", out)
    back, info = MarianMTModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        again = back.eval()(input_ids=ids, attention_mask=(ids != pad).long(), decoder_input_ids=target).logits
    assert_close(again, expected)


# Source texts for Marian's tokenizer: punctuation, digits, accents, runs of spaces, a tab, a
# character no piece or token has (🚀: <unk>), an unknown run vocab.json holds as a token (東京),
# a capital only the target side has a piece for (É: MarianTokenizer finds it in vocab.json), a
# "▁" in the text, a special token in the text, a target-language code (read at the start only).
MARIAN_TEXTS = [
    *TEXTS,
    "École 東京 🚀 fin",
    "  leading and trailing  ",
    "a\u2581b </s> c",
    ">>fra<< Hello world!",
    "",
]


@pytest.fixture(scope="module")
def marian_files(tmp_path_factory) -> Path:
    """MarianTokenizer's files, vocab.json with a language code and an unknown run (東京) added."""
    directory = tmp_path_factory.mktemp("marian") / "tokenizer"
    marian_tokenizer(directory, extra=(">>fra<<", "東京"))
    return directory


def import_marian(files: Path, tmp_path: Path) -> tuple[MarianMTModel, Path]:
    """A random shared-vocabulary Marian saved with ``files``, imported; the model and qkv directory."""
    from transformers import MarianTokenizer

    hf_tokenizer = MarianTokenizer.from_pretrained(files)
    hf = marian_model(len(hf_tokenizer), len(hf_tokenizer), hf_tokenizer.pad_token_id)
    hf.save_pretrained(tmp_path / "hf")
    hf_tokenizer.save_pretrained(tmp_path / "hf")
    summary = import_hf(tmp_path / "hf", tmp_path / "qkv")
    assert summary["tokenizer"].startswith("tokenizer.json from source.spm + vocab.json ("), summary
    return hf, tmp_path / "qkv"


def translate_as_hf_greedy(hf: MarianMTModel, hf_tokenizer, qkv: Path, tmp_path: Path) -> tuple[dict, torch.Tensor]:
    """Asserts that qkv translate (greedy) on the imported ``qkv`` writes what HF's own pipeline
    gives: MarianTokenizer (which appends </s>), greedy generate, decode; outputs that are text
    and depend on the source. Returns HF's tokenized sources and its output ids."""
    sources = [*TEXTS[:4], "Café 123", "a b c"]
    (tmp_path / "in.txt").write_text("".join(f"{s}\n" for s in sources), encoding="utf-8")
    new = 16
    # --max-len-a 0 --max-len-b N caps every output at N new tokens, as max_new_tokens=N does in HF.
    argv = ["translate", "--model", str(qkv), "--input", str(tmp_path / "in.txt"), "--beam", "1"]
    argv += ["--max-len-a", "0", "--max-len-b", str(new), "--output", str(tmp_path / "out.txt"), "--quiet"]
    assert main(argv) == 0
    batch = hf_tokenizer(sources, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=new)
    expected = hf_tokenizer.batch_decode(out, skip_special_tokens=True)
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines() == expected
    assert len(set(expected)) > 1 and all(expected)
    return batch, out


def test_marian_tokenizer_is_marians(marian_files: Path, tmp_path: Path) -> None:
    """The converted tokenizer encodes sources (</s> appended) and decodes ids as MarianTokenizer does."""
    from transformers import MarianTokenizer

    hf_tokenizer = MarianTokenizer.from_pretrained(marian_files)
    _, qkv = import_marian(marian_files, tmp_path)
    model, meta = load_model(qkv)
    assert {"tokenizer.json", "special_tokens.json", "source.spm", "vocab.json"} <= set(meta["files"])
    tokenizer = Tokenizer.load(qkv / "tokenizer.json")
    c = model.config
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (c.pad_id, c.bos_id, c.eos_id)
    assert tokenizer.vocab_size == len(hf_tokenizer)
    expected = hf_tokenizer(MARIAN_TEXTS).input_ids
    assert tokenizer.encode_batch(MARIAN_TEXTS) == expected
    for text, ids in zip(MARIAN_TEXTS, expected, strict=True):
        assert tokenizer.encode(text) == ids, text
    assert {hf_tokenizer.unk_token_id, *hf_tokenizer.convert_tokens_to_ids(["É", "東京"])} <= set(expected[5])
    # Decoding any ids (target pieces, <s>, <unk>, END, padding, the language code) as
    # MarianTokenizer.decode(skip_special_tokens=True) does: through vocab.json, then stripped.
    every_kind = ["▁", "<s>", "É", "a", "東京", ">>fra<<", "<unk>", "▁", "</s>", "<pad>", "▁"]
    g = torch.Generator().manual_seed(8)
    samples = [torch.randint(0, len(hf_tokenizer), (n,), generator=g).tolist() for n in (0, 1, 2, 5, 9, 14) * 8]
    for ids in [hf_tokenizer.convert_tokens_to_ids(every_kind), *samples]:
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), ids


def test_marian_translate_end_to_end(marian_files: Path, tmp_path: Path) -> None:
    """qkv translate on an imported Marian (greedy) writes what HF's greedy generate + decode gives;
    export-hf then writes the original SentencePiece and vocabulary files back, byte for byte."""
    from transformers import MarianTokenizer

    hf_tokenizer = MarianTokenizer.from_pretrained(marian_files)
    hf, qkv = import_marian(marian_files, tmp_path)
    translate_as_hf_greedy(hf, hf_tokenizer, qkv, tmp_path)

    exported = tmp_path / "exported"
    export_hf(qkv, exported)
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    assert not (exported / "tokenizer.json").exists()  # qkv's conversion stays in qkv
    assert MarianTokenizer.from_pretrained(exported)(MARIAN_TEXTS).input_ids == hf_tokenizer(MARIAN_TEXTS).input_ids


def test_marian_bad_words_are_recorded_and_never_translated(marian_files: Path, tmp_path: Path) -> None:
    """A Marian's bad_words_ids (its generation_config.json) land in config.json's ``hf`` and qkv
    translate never writes them: its greedy output equals HF's generate with the same ban, and
    differs from the output without it (the banned token was the model's choice)."""
    from transformers import MarianTokenizer

    hf_tokenizer = MarianTokenizer.from_pretrained(marian_files)
    hf, _ = import_marian(marian_files, tmp_path / "plain")
    sources = [*TEXTS[:4], "Café 123"]
    batch = hf_tokenizer(sources, return_tensors="pt", padding=True)
    with torch.no_grad():
        free = hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=12)
    chosen = int(free[0, 1])  # the first token the model writes, banned below
    banned_dir = tmp_path / "banned-hf"
    hf.save_pretrained(banned_dir)
    hf_tokenizer.save_pretrained(banned_dir)
    generation = json.loads((banned_dir / "generation_config.json").read_text())
    (banned_dir / "generation_config.json").write_text(json.dumps({**generation, "bad_words_ids": [[chosen]]}))
    import_hf(banned_dir, tmp_path / "qkv")
    assert read_meta(tmp_path / "qkv")["hf"]["bad_words_ids"] == [[chosen]]
    with torch.no_grad():
        out = hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=12, bad_words_ids=[[chosen]])
    expected = hf_tokenizer.batch_decode(out, skip_special_tokens=True)
    assert expected != hf_tokenizer.batch_decode(free, skip_special_tokens=True)
    (tmp_path / "in.txt").write_text("".join(f"{s}\n" for s in sources), encoding="utf-8")
    argv = ["translate", "--model", str(tmp_path / "qkv"), "--input", str(tmp_path / "in.txt"), "--beam", "1"]
    argv += ["--max-len-a", "0", "--max-len-b", "12", "--output", str(tmp_path / "out.txt"), "--quiet"]
    assert main(argv) == 0
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines() == expected


@pytest.fixture(scope="module")
def marian_separate_files(tmp_path_factory) -> Path:
    """A separate-vocabulary MarianTokenizer's files (source.spm + vocab.json, target.spm +
    target_vocab.json), the language code and the unknown run (東京) on the source side."""
    directory = tmp_path_factory.mktemp("marian-separate") / "tokenizer"
    marian_tokenizer(directory, extra=(">>fra<<", "東京"), separate=True)
    return directory


def import_separate_marian(files: Path, tmp_path: Path) -> tuple[MarianMTModel, Path]:
    """A random Marian with separate embeddings saved with the separate vocabularies ``files``,
    imported; the model and qkv directory."""
    from transformers import MarianTokenizer

    hf_tokenizer = MarianTokenizer.from_pretrained(files)
    sizes = [len(json.loads((files / name).read_text())) for name in ("vocab.json", "target_vocab.json")]
    assert sizes[0] != sizes[1]  # two tables of their own sizes
    hf = marian_model(*sizes, hf_tokenizer.pad_token_id, share_encoder_decoder_embeddings=False)
    hf.save_pretrained(tmp_path / "hf")
    hf_tokenizer.save_pretrained(tmp_path / "hf")
    summary = import_hf(tmp_path / "hf", tmp_path / "qkv")
    assert summary["tokenizer"].startswith(
        "tokenizer.json and target_tokenizer.json from source.spm + vocab.json and target.spm + target_vocab.json"
    ), summary
    return hf, tmp_path / "qkv"


def test_marian_separate_vocabularies_are_marians(marian_separate_files: Path, tmp_path: Path) -> None:
    """Separate vocabularies become qkv's: tokenizer.json encodes sources as MarianTokenizer does,
    target_tokenizer.json encodes targets as its target mode does and decodes ids as its decode
    does (through target_vocab.json)."""
    from transformers import MarianTokenizer

    hf_tokenizer = MarianTokenizer.from_pretrained(marian_separate_files)
    _, qkv = import_separate_marian(marian_separate_files, tmp_path)
    model, meta = load_model(qkv)
    assert {"tokenizer.json", "target_tokenizer.json", "target.spm", "target_vocab.json"} <= set(meta["files"])
    vocab = Vocabularies.load(qkv, files=meta["files"])
    assert vocab.separate
    c = model.config
    assert (vocab.target.vocab_size, vocab.source.vocab_size) == (c.tgt_vocab_size, c.src_vocab_size)
    assert (vocab.target.pad_id, vocab.target.bos_id, vocab.target.eos_id) == (c.pad_id, c.bos_id, c.eos_id)
    assert vocab.source.encode_batch(MARIAN_TEXTS) == hf_tokenizer(MARIAN_TEXTS).input_ids
    # A language code the target vocabulary lacks is <unk> to MarianTokenizer (documented difference).
    targets = [t for t in MARIAN_TEXTS if not t.startswith(">>")]
    expected = hf_tokenizer(text_target=targets).input_ids
    assert vocab.target.encode_batch(targets) == expected
    assert expected != hf_tokenizer(targets).input_ids  # the two sides really differ
    g = torch.Generator().manual_seed(8)
    samples = [torch.randint(0, c.tgt_vocab_size, (n,), generator=g).tolist() for n in (0, 1, 2, 5, 9, 14) * 8]
    for ids in samples:
        assert vocab.target.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), ids


def test_marian_separate_translate_and_export(marian_separate_files: Path, tmp_path: Path) -> None:
    """qkv translate on an imported separate-vocabulary Marian writes what HF's greedy generate +
    decode gives; export-hf writes the original files back, byte for byte."""
    from transformers import MarianTokenizer

    hf_tokenizer = MarianTokenizer.from_pretrained(marian_separate_files)
    hf, qkv = import_separate_marian(marian_separate_files, tmp_path)
    batch, out = translate_as_hf_greedy(hf, hf_tokenizer, qkv, tmp_path)

    exported = tmp_path / "exported"
    export_hf(qkv, exported)
    for name in ("source.spm", "target.spm", "vocab.json", "target_vocab.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    back = MarianTokenizer.from_pretrained(exported)
    assert back(text_target=TEXTS).input_ids == hf_tokenizer(text_target=TEXTS).input_ids
    back_model, info = MarianMTModel.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():  # (generate would differ: export writes forced_eos_token_id, the original has none)
        assert_close(
            back_model.eval()(**batch, decoder_input_ids=out).logits, hf(**batch, decoder_input_ids=out).logits
        )


def test_marian_tokenizer_not_converted(marian_separate_files: Path, tmp_path: Path) -> None:
    """Separate vocabularies without target_vocab.json are kept for export, not converted; ones
    whose special tokens differ in id are refused, as is a BPE source.spm, naming the file."""
    sentencepiece = pytest.importorskip("sentencepiece")
    vocab = json.loads((marian_separate_files / "vocab.json").read_text())
    target = json.loads((marian_separate_files / "target_vocab.json").read_text())
    src = tmp_path / "hf"
    marian_model(len(vocab), len(target), vocab["<pad>"], share_encoder_decoder_embeddings=False).save_pretrained(src)
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
        shutil.copy(marian_separate_files / name, src / name)
    summary = import_hf(src, tmp_path / "missing")
    assert summary["tokenizer"].endswith("not converted: target_vocab.json missing"), summary
    assert "tokenizer.json" not in load_model(tmp_path / "missing")[1]["files"]

    # <unk> at another id on the target side: the model has one id for each special token.
    third = next(token for token, i in target.items() if i == 3)
    target["<unk>"], target[third] = target[third], target["<unk>"]
    (src / "target_vocab.json").write_text(json.dumps(target))
    with pytest.raises(UserError, match=r"target_vocab\.json: .*same special tokens at the same ids"):
        import_hf(src, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    (src / "tokenizer_config.json").unlink()
    (src / "target_vocab.json").unlink()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(tmp_path / "bpe"),
        model_type="bpe",
        vocab_size=60,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    shutil.copy(tmp_path / "bpe.model", src / "source.spm")
    with pytest.raises(UserError, match=r"source\.spm: model_type is not supported: only unigram"):
        import_hf(src, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("d_model", [14, 15])
def test_sinusoidal_halves_is_marian_layout(d_model: int) -> None:
    """positions="sinusoidal_halves" equals HF's MarianSinusoidalPositionalEmbedding, odd widths included."""
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    table = MarianSinusoidalPositionalEmbedding(40, d_model).create_weight()
    assert_close(sinusoidal_encoding(torch.arange(40), d_model, halves=True), table)


# ---------------------------------------------------------------------------- errors


@pytest.fixture
def tiny_gpt2(tmp_path: Path) -> Path:
    src = tmp_path / "hf"
    gpt2_model(11, tied=True, eos=0).save_pretrained(src)
    return src


def test_unknown_architecture_is_refused(tiny_gpt2: Path, tmp_path: Path, capsys) -> None:
    config = json.loads((tiny_gpt2 / "config.json").read_text())
    config["architectures"] = ["T5ForConditionalGeneration"]
    (tiny_gpt2 / "config.json").write_text(json.dumps(config))
    rc = main(["import-hf", str(tiny_gpt2), str(tmp_path / "qkv")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "T5ForConditionalGeneration" in err and str(tiny_gpt2 / "config.json") in err
    assert not (tmp_path / "qkv").exists()


def test_missing_tensor_is_refused(tiny_gpt2: Path, tmp_path: Path) -> None:
    tensors = load_file(tiny_gpt2 / "model.safetensors")
    del tensors["transformer.h.1.attn.c_attn.weight"]
    save_file(tensors, tiny_gpt2 / "model.safetensors")
    with pytest.raises(UserError, match=r"model\.safetensors.*'transformer\.h\.1\.attn\.c_attn\.weight' is missing"):
        import_hf(tiny_gpt2, tmp_path / "qkv")


def test_wrong_shape_and_bad_field_are_refused(tiny_gpt2: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_gpt2 / "config.json").read_text())
    (tiny_gpt2 / "config.json").write_text(json.dumps({**config, "n_inner": 23}))
    with pytest.raises(
        UserError, match=r"'transformer\.h\.0\.mlp\.c_fc\.bias' has shape \(22,\); config\.json implies \(23,\)"
    ):
        import_hf(tiny_gpt2, tmp_path / "qkv")
    (tiny_gpt2 / "config.json").write_text(json.dumps({**config, "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(UserError, match="scale_attn_by_inverse_layer_idx"):
        import_hf(tiny_gpt2, tmp_path / "qkv")
    (tiny_gpt2 / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"neither model\.safetensors nor pytorch_model\.bin"):
        import_hf(tiny_gpt2, tmp_path / "qkv")


def test_export_refuses_what_hf_cannot_express(tmp_path: Path) -> None:
    """A qkv-native decoder-only model (sinusoidal positions, √D scaling) is no GPT-2; the field is named.
    A BERT-style masked-LM model with a pooler is refused too (BertForMaskedLM would drop the pooler)."""
    config = DecoderOnlyConfig(d_model=15, n_heads=3, d_ff=11, vocab_size=13, n_layers=1, max_len=16)
    save_model(DecoderOnly(config), tmp_path / "native")
    with pytest.raises(UserError, match=r"positions='learned'.*positions='sinusoidal'"):
        export_hf(tmp_path / "native", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    bert = EncoderOnlyConfig(
        d_model=15,
        n_heads=3,
        d_ff=11,
        vocab_size=13,
        n_layers=1,
        max_len=16,
        norm_first=False,
        positions="learned",
        scale_embeddings=False,
        embedding_norm=True,
        activation="gelu",
        pooler=True,
    )
    save_model(EncoderOnly(bert), tmp_path / "mlm")
    with pytest.raises(UserError, match=r"BertForMaskedLM.*pooler=True"):
        export_hf(tmp_path / "mlm", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def native_gpt2(directory: Path) -> None:
    """A qkv decoder-only model that GPT-2 can express, saved in ``directory``."""
    config = DecoderOnlyConfig(
        d_model=15,
        n_heads=3,
        d_ff=11,
        vocab_size=13,
        n_layers=1,
        max_len=16,
        positions="learned",
        scale_embeddings=False,
        activation="gelu_tanh",
    )
    save_model(DecoderOnly(config), directory)


def test_export_takes_a_run_and_refuses_bad_destinations(tmp_path: Path, monkeypatch, capsys) -> None:
    """export-hf reads a training run's final checkpoint; it refuses the working directory, a directory
    that is not empty, and names the destination when it cannot be written."""
    run = tmp_path / "run"
    native_gpt2(run / "best")
    (run / "run.json").write_text(json.dumps({"final": "best"}), encoding="utf-8")
    assert main(["export-hf", str(run), str(tmp_path / "out")]) == 0
    assert "GPT2LMHeadModel" in capsys.readouterr().out
    assert GPT2LMHeadModel.from_pretrained(tmp_path / "out") is not None

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory", encoding="utf-8")
    for dst, message in (
        (".", "current directory"),
        (str(tmp_path), "current directory"),
        (str(tmp_path / "out"), "not an empty directory"),
        (str(blocker / "out"), f"cannot write {blocker / 'out'}"),
    ):
        assert main(["export-hf", str(run), dst]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert not any(work.iterdir()) and blocker.read_text(encoding="utf-8") == "not a directory"


def test_gpt2_export_of_a_model_without_biases(tmp_path: Path) -> None:
    """A decoder-only model trained without linear biases (the Shakespeare and chat recipes'
    bias=false, exact GELU) exports as GPT-2 with zero biases: the same logits, the same greedy
    continuation."""
    torch.manual_seed(5)
    config = DecoderOnlyConfig(
        d_model=15,
        n_heads=3,
        d_ff=11,
        vocab_size=13,
        n_layers=2,
        max_len=16,
        positions="learned",
        scale_embeddings=False,
        activation="gelu",
        bias=False,
        dropout=0.0,
    )
    model = DecoderOnly(config).eval()
    save_model(model, tmp_path / "native")
    export_hf(tmp_path / "native", tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 13, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=0)
        continued = hf.generate(
            tokens[:1], attention_mask=torch.ones_like(tokens[:1]), max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    assert continued[0, 9:].tolist() == greedy(model, [tokens[0].tolist()], max_new_tokens=5)[0]


def test_gpt2_default_begin_and_end() -> None:
    """GPT2Config's default BEGIN/END 50256 applies only to a vocabulary that has that id."""
    fields = {"n_embd": 15, "n_head": 3, "n_layer": 1}
    small = gpt2_fields(HFConfig(Path("config.json"), {**fields, "vocab_size": 11}))
    assert small["bos_id"] is None and small["eos_id"] is None
    full = gpt2_fields(HFConfig(Path("config.json"), {**fields, "vocab_size": 50257}))
    assert full["bos_id"] == full["eos_id"] == 50256
    given = gpt2_fields(HFConfig(Path("config.json"), {**fields, "vocab_size": 11, "eos_token_id": 3}))
    assert given["bos_id"] is None and given["eos_id"] == 3


def test_quantized_and_mis_shaped_weights_are_refused(tiny_gpt2: Path, tmp_path: Path) -> None:
    """A quantization_config or an integer tensor is refused, naming the file and field or tensor; the
    state loading refuses a tensor that would only broadcast into a parameter."""
    config = json.loads((tiny_gpt2 / "config.json").read_text())
    (tiny_gpt2 / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "x"}}))
    with pytest.raises(UserError, match=r"config\.json: field 'quantization_config'"):
        import_hf(tiny_gpt2, tmp_path / "qkv")
    (tiny_gpt2 / "config.json").write_text(json.dumps(config))
    tensors = load_file(tiny_gpt2 / "model.safetensors")
    name = "transformer.h.0.mlp.c_fc.weight"
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, tiny_gpt2 / "model.safetensors")
    with pytest.raises(
        UserError, match=r"model\.safetensors: tensor 'transformer\.h\.0\.mlp\.c_fc\.weight' is torch\.int8"
    ):
        import_hf(tiny_gpt2, tmp_path / "qkv")
    assert not (tmp_path / "qkv").exists()

    model = DecoderOnly(DecoderOnlyConfig(d_model=15, n_heads=3, d_ff=11, vocab_size=13, n_layers=1, max_len=16))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    state["decoder.norm.bias"] = torch.zeros(1)  # (1,) broadcasts into (15,)
    with pytest.raises(RuntimeError, match=r"decoder\.norm\.bias shape \(1,\)"):
        load_state(model, state)


@pytest.fixture
def tiny_bert(tmp_path: Path) -> Path:
    """A small BERT classifier checkpoint with a vocab.txt (the legacy tokenizer file)."""
    src = tmp_path / "hf"
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmno"]
    config = BertConfig(
        vocab_size=len(tokens),
        hidden_size=15,
        num_hidden_layers=1,
        num_attention_heads=3,
        intermediate_size=22,
        max_position_embeddings=23,
        num_labels=2,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(src)
    (src / "vocab.txt").write_text("".join(f"{t}\n" for t in tokens), encoding="utf-8")
    return src


def test_bert_files_are_checked(tiny_bert: Path, tmp_path: Path) -> None:
    """Bad tokenizer files, label names and token ids are UserErrors naming the file and field; a
    default special token the vocabulary lacks leaves its role empty."""
    config = json.loads((tiny_bert / "config.json").read_text())
    vocab = (tiny_bert / "vocab.txt").read_text(encoding="utf-8")
    settings = tiny_bert / "tokenizer_config.json"
    cases = [
        ("config.json", {**config, "id2label": {"1": "a", "2": "b"}}, r"config\.json: field 'id2label' must map"),
        ("config.json", {**config, "pad_token_id": 3}, r"config\.json: field 'pad_token_id' is 3, .*vocab\.txt.* id 0"),
        ("tokenizer_config.json", {"do_lower_case": "yes"}, r"tokenizer_config\.json: field 'do_lower_case' must be"),
        ("tokenizer_config.json", {"strip_accents": 1}, r"tokenizer_config\.json: field 'strip_accents' must be"),
        (
            "tokenizer_config.json",
            {"cls_token": "[BOS]"},
            r"vocab\.txt: tokenizer lacks the special token\(s\) \[BOS\]",
        ),
    ]
    for name, content, message in cases:
        (tiny_bert / name).write_text(json.dumps(content), encoding="utf-8")
        with pytest.raises(UserError, match=message):
            import_hf(tiny_bert, tmp_path / "qkv")
        (tiny_bert / "config.json").write_text(json.dumps(config), encoding="utf-8")
        settings.unlink(missing_ok=True)
    (tiny_bert / "vocab.txt").write_bytes(b"[PAD]\n[UNK]\n\xff\xfe\n")
    with pytest.raises(UserError, match=r"cannot read .*vocab\.txt"):
        import_hf(tiny_bert, tmp_path / "qkv")
    assert not (tmp_path / "qkv").exists()

    (tiny_bert / "vocab.txt").write_text(vocab.replace("[CLS]", "[C]").replace("[SEP]", "[S]"), encoding="utf-8")
    assert import_hf(tiny_bert, tmp_path / "qkv")["tokenizer"] == "tokenizer.json"
    tokenizer = Tokenizer.load(tmp_path / "qkv" / "tokenizer.json")
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, None, None, 1)
    assert load_model(tmp_path / "qkv")[1]["labels"] == ["LABEL_0", "LABEL_1"]


def test_gpt2_token_ids_must_agree(gpt2_vocab: Path, tmp_path: Path) -> None:
    """config.json's bos_token_id and the tokenizer's BEGIN token must be the same id."""
    src = tmp_path / "hf"
    gpt2_model(
        len(json.loads((gpt2_vocab / "vocab.json").read_text(encoding="utf-8"))), tied=True, eos=5
    ).save_pretrained(src)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(gpt2_vocab / name, src / name)
    with pytest.raises(UserError, match=r"config\.json: field 'bos_token_id' is 5, .*'<\|endoftext\|>' the id 0"):
        import_hf(src, tmp_path / "qkv")


@pytest.mark.parametrize("command", ["import-hf", "export-hf"])
def test_help_has_an_example(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "example" in out and f"qkv {command}" in out


def test_imported_classifier_is_scored_by_evaluate_tsv(tiny_bert: Path, tmp_path: Path, capsys) -> None:
    """An imported BertForSequenceClassification has label names but no qkv task: `qkv evaluate
    --tsv` scores it, with the accuracy and macro-F1 of the original model's own predictions."""
    from qkv.evaluation import accuracy, macro_f1

    config = json.loads((tiny_bert / "config.json").read_text())
    config["id2label"], config["label2id"] = {"0": "neg", "1": "pos"}, {"neg": 0, "pos": 1}
    (tiny_bert / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert main(["import-hf", str(tiny_bert), str(tmp_path / "qkv")]) == 0
    generator = torch.Generator().manual_seed(3)
    letters = "abcdefghijklmno"
    texts = [" ".join(letters[i] for i in torch.randint(15, (5,), generator=generator)) for _ in range(31)]
    gold = ["neg" if i % 3 else "pos" for i in range(31)]
    lines = "".join(f"{t}\t{g}\n" for t, g in zip(texts, gold, strict=True))
    (tmp_path / "eval.tsv").write_text(lines, encoding="utf-8")
    capsys.readouterr()
    assert main(["evaluate", "--model", str(tmp_path / "qkv"), "--tsv", str(tmp_path / "eval.tsv"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)

    hf_tokenizer = BertTokenizer(str(tiny_bert / "vocab.txt"))
    hf_model = BertForSequenceClassification.from_pretrained(tiny_bert).eval()
    with torch.no_grad():
        logits = hf_model(**hf_tokenizer(texts, return_tensors="pt", padding=True)).logits
    predicted = [["neg", "pos"][i] for i in logits.argmax(-1).tolist()]
    assert result["examples"] == 31
    assert result["accuracy"] == round(accuracy(predicted, gold), 4)
    assert result["macro_f1"] == round(macro_f1(predicted, gold), 4)
