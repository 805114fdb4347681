"""Real checkpoints, real results: what ``qkv import-hf`` and ``qkv embed`` give on checkpoints as
people publish them, against transformers and sentence-transformers.

Published checkpoints carry tokenizer settings that random test models do not: a
sentence-transformers MiniLM's ``tokenizer.json`` asks for fixed padding to 128 tokens and
truncation at 128 (qkv once read every sentence as 128 ids, mostly [PAD], and its embeddings
had cosine 0.2 to Hugging Face's); lowercasing and accent stripping, Chinese character
splitting, template post-processors, and a ``modules.json`` / ``1_Pooling/config.json`` /
``sentence_bert_config.json`` pipeline that says how to pool. The local models here are built to
carry exactly those settings (small random BERTs whose weights are moved off their initial
values); tokenizers are compared id for id with transformers' on accents, CJK, emoji, long
inputs and empty lines; embeddings must be within cosine 0.9999 of transformers' (the same
pooling, by hand) and sentence-transformers' (when installed).

Real files, when present under ``$QKV_HF_REAL`` (default ``/tmp/hfreal``; see
``bench/hf_real.py``): the sentence-transformers all-MiniLM-L6-v2 checkpoint, GPT-2's and
Whisper's tokenizer files. Nothing is downloaded; without them those tests are skipped, saying so.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import (  # noqa: E402
    BertWordPieceTokenizer,
    ByteLevelBPETokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, PreTrainedTokenizerFast  # noqa: E402

from qkv.checkpoint import load_model, save_model  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.embedding import EmbeddingSettings, choose, frame, sentence_embeddings  # noqa: E402
from qkv.errors import UserError  # noqa: E402
from qkv.hf.convert import SUPPORTED, export_hf, import_hf  # noqa: E402
from qkv.hf.gpt2 import gpt2_tokenizer  # noqa: E402
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig  # noqa: E402
from qkv.tokenization import Tokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

try:
    from sentence_transformers import SentenceTransformer
except ImportError:  # an optional peer: the transformers comparison still runs
    SentenceTransformer = None

REAL = Path(os.environ.get("QKV_HF_REAL", "/tmp/hfreal"))
MIN_COSINE = 0.9999

LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)  # > every window below
TEXTS = [
    "A man is eating food.",
    "Crème brûlée, naïve café — ÀÉÎÕÜ ß résumé",
    "Das Wetter in München ist heute schön, sagt Jürgen.",
    "我爱北京天安门。東京タワーは高い",
    "emoji 🚀🍕 and 👍🏽 too",
    "UPPER case  and   spaces\tand a tab",
    "[MASK] stays one token, [SEP] too",
    LONG,
]
BLANK = ["", "   ", "\t"]  # empty lines: qkv embeds them as zero rows
CORPUS = [*TEXTS[:-1]] * 10 + [LONG, "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , ! ?"]


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter off its initial value (LayerNorm 1/0, zero biases), so each matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))


# ------------------------------------------------------------------------ tokenizer files


def wordpiece(*, lowercase: bool = True, strip_accents: bool | None = None, pad_to: int | None = 128) -> HFTokenizer:
    """A BERT WordPiece tokenizer as published ones are: BertNormalizer (lowercasing, accents,
    Chinese characters split), BertPreTokenizer, a [CLS] $A [SEP] template, the WordPiece
    decoder, and (``pad_to``) fixed padding and truncation at that length, as all-MiniLM-L6-v2's."""
    trained = BertWordPieceTokenizer(lowercase=lowercase, strip_accents=strip_accents, handle_chinese_chars=True)
    trained.train_from_iterator(CORPUS, vocab_size=220, min_frequency=1)
    backend: HFTokenizer = trained._tokenizer
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    if pad_to is not None:
        backend.enable_padding(length=pad_to, pad_id=backend.token_to_id("[PAD]"), pad_token="[PAD]")
        backend.enable_truncation(max_length=pad_to)
    return backend


def unigram() -> HFTokenizer:
    """An XLM-R-like Unigram tokenizer: NFKC, Metaspace, a <s> $A </s> template, padding and truncation."""
    backend = HFTokenizer(models.Unigram())
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    trainer = trainers.UnigramTrainer(vocab_size=150, special_tokens=specials, unk_token="<unk>")
    backend.train_from_iterator(CORPUS, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    backend.enable_padding(length=64, pad_id=1, pad_token="<pad>")
    backend.enable_truncation(max_length=16)
    return backend


def byte_bpe() -> HFTokenizer:
    """A RoBERTa-like byte-level BPE: BOS/EOS template, padding to the longest, truncation."""
    trained = ByteLevelBPETokenizer(add_prefix_space=True)
    trained.train_from_iterator(
        CORPUS, vocab_size=320, min_frequency=1, special_tokens=["<s>", "<pad>", "</s>", "<unk>"]
    )
    backend: HFTokenizer = trained._tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    backend.enable_padding(pad_id=1, pad_token="<pad>")
    backend.enable_truncation(max_length=8)
    return backend


BERT_SPECIALS = {"pad": "[PAD]", "bos": "[CLS]", "eos": "[SEP]", "unk": "[UNK]"}
ROBERTA_SPECIALS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}
HF_NAMES = {"pad": "pad_token", "bos": "cls_token", "eos": "sep_token", "unk": "unk_token"}


def hf_fast(path: Path, specials: dict[str, str]) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), **{HF_NAMES[role]: token for role, token in specials.items()}
    )


def assert_same_tokenization(ours: Tokenizer, theirs, texts: list[str], *, window: int) -> None:
    """Ids without special tokens, framed ids ([BEGIN] text [END] cut to ``window``) against the
    tokenizer's own template with ``truncation=True``, and decoding: all as transformers gives."""
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        framed, _ = frame(ours, [text], max_len=window)
        assert framed[0] == theirs(text, truncation=True, max_length=window)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize(
    ("build", "specials"),
    [
        (lambda: wordpiece(lowercase=True, strip_accents=None), BERT_SPECIALS),  # uncased: lowercase + accents
        (lambda: wordpiece(lowercase=False, strip_accents=False), BERT_SPECIALS),  # cased, accents kept
        (lambda: wordpiece(lowercase=True, strip_accents=False), BERT_SPECIALS),  # lowercase, accents kept
        (unigram, ROBERTA_SPECIALS),
        (byte_bpe, ROBERTA_SPECIALS),
    ],
    ids=["uncased-wordpiece", "cased-wordpiece", "lowercase-accents-kept", "unigram", "byte-bpe"],
)
def test_tokenizer_file_settings_never_decide_and_ids_are_transformers(build, specials, tmp_path: Path) -> None:
    """A tokenizer.json with padding and truncation: loaded by qkv, it gives a text's own ids
    (neither [PAD]s nor a cut), the ones transformers gives, framed as transformers' template
    frames them, on accents, CJK, emoji, a long text, special tokens written out and empty lines;
    and the file qkv stores holds neither setting."""
    path = tmp_path / "tokenizer.json"
    build().save(str(path))
    ours = Tokenizer(HFTokenizer.from_file(str(path)), specials=specials)
    assert ours.backend.padding is None and ours.backend.truncation is None
    assert len(ours.encode(LONG)) > 128 and ours.encode("") == []
    assert_same_tokenization(ours, hf_fast(path, specials), TEXTS + BLANK, window=24)
    ours.save(tmp_path / "stored.json")
    stored = json.loads((tmp_path / "stored.json").read_text(encoding="utf-8"))
    assert stored["padding"] is None and stored["truncation"] is None


def test_qkv_tokenizers_give_the_same_ids_as_before(tmp_path: Path) -> None:
    """qkv's own tokenizers never had padding or truncation: loading one leaves its pipeline as
    saved (the same serialized form, so the same ids) and its file untouched (its SHA-256 in a
    model directory still matches)."""
    trained = Tokenizer.train_word_level(CORPUS)
    path = tmp_path / "tokenizer.json"
    trained.save(path)
    before = path.read_bytes()
    loaded = Tokenizer.load(path)
    assert loaded.backend.to_str() == trained.backend.to_str() and path.read_bytes() == before
    assert loaded.encode_batch(TEXTS) == trained.encode_batch(TEXTS)


def test_a_model_imported_before_the_fix_reads_its_padded_tokenizer_right(tmp_path: Path) -> None:
    """A model directory whose stored tokenizer.json still asks for fixed padding (an import
    made before qkv switched it off) loads as it is (the file's SHA-256 matches) and encodes
    each text to its own ids."""
    path = tmp_path / "padded.json"
    wordpiece().save(str(path))
    vocab = HFTokenizer.from_file(str(path)).get_vocab_size()
    model = EncoderOnly(EncoderOnlyConfig(vocab_size=vocab, d_model=8, n_heads=2, d_ff=16, n_layers=1, max_len=160))
    sidecar = tmp_path / "special_tokens.json"
    sidecar.write_text(json.dumps(BERT_SPECIALS))
    save_model(model, tmp_path / "old", files={"tokenizer.json": path, "special_tokens.json": sidecar})
    load_model(tmp_path / "old")  # the stored file is as it was: its SHA-256 matches
    tokenizer = Tokenizer.load(tmp_path / "old" / "tokenizer.json")
    assert tokenizer.encode("a man") == hf_fast(path, BERT_SPECIALS)("a man", add_special_tokens=False)["input_ids"]
    assert len(tokenizer.encode("a man")) < 5


# ------------------------------------------------------------------------ checkpoints


def bert_checkpoint(
    directory: Path,
    backend: HFTokenizer,
    *,
    positions: int = 160,
    model_max_length: int | None = 512,
    tokenizer_class: str = "PreTrainedTokenizerFast",
    seed: int = 0,
) -> Path:
    """A small random BertModel saved as transformers saves one, with ``backend`` as its
    tokenizer.json and a tokenizer_config.json naming BERT's special tokens."""
    directory.mkdir(parents=True, exist_ok=True)
    config = BertConfig(
        vocab_size=backend.get_vocab_size(),
        hidden_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=40,
        max_position_embeddings=positions,
    )
    torch.manual_seed(seed)
    model = BertModel(config)
    perturb(model, seed)
    model.save_pretrained(directory)
    backend.save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": tokenizer_class, **{HF_NAMES[r]: t for r, t in BERT_SPECIALS.items()}}
    settings["mask_token"] = "[MASK]"
    if model_max_length is not None:
        settings["model_max_length"] = model_max_length
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return directory


def sentence_transformers_dir(
    directory: Path,
    backend: HFTokenizer,
    *,
    pooling: dict,
    normalize: bool,
    max_seq_length: int | None,
    do_lower_case: bool = False,
    nested: bool = False,
    extra_modules: tuple[dict, ...] = (),
) -> Path:
    """A sentence-transformers directory: modules.json (Transformer, Pooling, Normalize without
    a folder, as published ones list it), 1_Pooling/config.json, sentence_bert_config.json; the
    HF model in the directory itself or (``nested``) in 0_Transformer, as older versions save it."""
    model_path = "0_Transformer" if nested else ""
    bert_checkpoint(directory / model_path, backend)
    modules = [
        {"idx": 0, "name": "0", "path": model_path, "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        *extra_modules,
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules), encoding="utf-8")
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 24, **pooling}))
    st_config = {"max_seq_length": max_seq_length, "do_lower_case": do_lower_case}
    (directory / model_path / "sentence_bert_config.json").write_text(json.dumps(st_config), encoding="utf-8")
    return directory


def legacy_pooling(mode: str) -> dict:
    """1_Pooling/config.json as sentence-transformers 2.x writes it: one boolean per mode."""
    names = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "mean_sqrt_len": "mean_sqrt_len_tokens"}
    return {f"pooling_mode_{name}": mode == m for m, name in names.items()}


@torch.no_grad()
def transformers_embeddings(
    directory: Path, texts: list[str], *, pooling: str, normalize: bool, max_len: int, lowercase: bool = False
) -> torch.Tensor:
    """What a transformers user computes: the tokenizer's own template, ``truncation=True`` at
    ``max_len``, padding to the longest, the pooling by hand over the attention mask; ``lowercase``:
    sentence_bert_config.json's do_lower_case."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory).eval()
    if lowercase:  # as sentence-transformers applies do_lower_case: a Lowercase normalizer first
        backend = tokenizer.backend_tokenizer
        backend.normalizer = normalizers.Sequence([normalizers.Lowercase(), backend.normalizer])
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    h = model(**batch).last_hidden_state  # (B, S, D)
    mask = batch["attention_mask"].bool()  # (B, S)
    total = (h * mask[..., None]).sum(1)
    count = mask.sum(1, keepdim=True).float()
    vectors = {
        "mean": lambda: total / count,
        "mean_sqrt_len": lambda: total / count.sqrt(),
        "max": lambda: h.masked_fill(~mask[..., None], float("-inf")).max(1).values,
        "cls": lambda: h[:, 0],
    }[pooling]()
    return torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors


def sentence_transformers_embeddings(directory: Path, texts: list[str]) -> torch.Tensor:
    model = SentenceTransformer(str(directory), device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=4).float().cpu()


def embed_with_cli(model: Path, texts: list[str], tmp_path: Path, *options: str) -> tuple[torch.Tensor, str]:
    """``qkv embed`` of ``texts`` (one per line): the vectors and what it said on stderr."""
    source, output = tmp_path / "in.txt", tmp_path / "vectors.npy"
    source.write_text("".join(f"{t}\n" for t in texts), encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["embed", "--model", str(model), "--input", str(source), "--output", str(output), *options])
    assert rc == 0, err.getvalue()
    return torch.from_numpy(np.load(output)), err.getvalue()


def assert_match(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    assert cosine.min().item() >= MIN_COSINE, cosine
    assert (ours - theirs).abs().max().item() < 1e-4


def test_fixed_padding_regression_minilm_symptom(tmp_path: Path, capsys) -> None:
    """The all-MiniLM-L6-v2 symptom, rebuilt locally: a sentence-transformers checkpoint whose
    tokenizer.json pads every text to 128 tokens and truncates at 128, loaded by transformers as
    a BertTokenizer; mean pooling, Normalize, max_seq_length 128 (< 160 positions). qkv import-hf
    says the padding and truncation are not kept; qkv embed, with no option, pools as the
    checkpoint says and gives transformers' and sentence-transformers' vectors (cosine >= 0.9999)."""
    src = sentence_transformers_dir(
        tmp_path / "st", wordpiece(), pooling=legacy_pooling("mean"), normalize=True, max_seq_length=128
    )
    tokenizer_config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "tokenizer_class": "BertTokenizer"}))
    assert main(["import-hf", str(src), str(tmp_path / "qkv")]) == 0
    captured = capsys.readouterr()
    assert "fixed padding to 128 tokens and truncation at 128 tokens are not kept" in captured.err
    assert "pooling mean, normalize True, max_len 128" in captured.out
    meta = json.loads((tmp_path / "qkv" / "config.json").read_text())
    assert meta["embedding"]["pooling"] == "mean" and meta["embedding"]["max_len"] == 128
    stored = json.loads((tmp_path / "qkv" / "tokenizer.json").read_text())
    assert stored["padding"] is None and stored["truncation"] is None

    vectors, said = embed_with_cli(tmp_path / "qkv", TEXTS, tmp_path)
    assert "mean pooling, normalized, window 128 tokens" in said and "recorded in the model directory" in said
    assert "1 line(s) cut to the window of 128 tokens" in said
    assert_match(vectors, transformers_embeddings(src, TEXTS, pooling="mean", normalize=True, max_len=128))
    if SentenceTransformer is not None:
        assert_match(vectors, sentence_transformers_embeddings(src, TEXTS))
    # Exported back, transformers cuts at the same window, and the tokenizer pads no text.
    export_hf(tmp_path / "qkv", tmp_path / "exported")
    assert json.loads((tmp_path / "exported" / "tokenizer_config.json").read_text())["model_max_length"] == 128
    back = AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert (
        back(LONG, truncation=True)["input_ids"]
        == AutoTokenizer.from_pretrained(src)(LONG, truncation=True, max_length=128)["input_ids"]
    )


POOLING_CASES = [
    ("cls", False, legacy_pooling("cls")),
    ("max", True, legacy_pooling("max")),
    ("mean_sqrt_len", False, {"pooling_mode": "mean_sqrt_len_tokens"}),  # sentence-transformers >= 5's form
    ("mean", False, {"pooling_mode": "mean"}),
]


@pytest.mark.parametrize(("pooling", "normalize", "config"), POOLING_CASES, ids=[c[0] for c in POOLING_CASES])
def test_pooling_variants_are_sentence_transformers(pooling, normalize, config, tmp_path: Path) -> None:
    src = sentence_transformers_dir(
        tmp_path / "st", wordpiece(pad_to=None), pooling=config, normalize=normalize, max_seq_length=40
    )
    summary = import_hf(src, tmp_path / "qkv")
    assert summary["embedding"]["pooling"] == pooling and summary["embedding"].get("normalize") == normalize
    model, meta = load_model(tmp_path / "qkv")
    tokenizer = Tokenizer.load(tmp_path / "qkv" / "tokenizer.json")
    chosen = choose(EmbeddingSettings.read(meta, "config.json", model_max_len=160), model_max_len=160)
    assert (chosen.pooling, chosen.normalize, chosen.max_len) == (pooling, normalize, 40)
    ours, cut = sentence_embeddings(
        model, tokenizer, TEXTS, pooling=pooling, normalize=normalize, max_len=chosen.max_len, batch_size=3
    )
    assert cut == 1
    assert_match(ours, transformers_embeddings(src, TEXTS, pooling=pooling, normalize=normalize, max_len=40))
    if SentenceTransformer is not None:
        assert_match(ours, sentence_transformers_embeddings(src, TEXTS))


def test_nested_transformer_folder_and_do_lower_case(tmp_path: Path) -> None:
    """An older layout (the HF model in 0_Transformer) whose cased tokenizer sentence-transformers
    lowercases (do_lower_case): qkv's stored tokenizer lowercases too, and the vectors agree."""
    src = sentence_transformers_dir(
        tmp_path / "st",
        wordpiece(lowercase=False, strip_accents=False),
        pooling=legacy_pooling("mean"),
        normalize=True,
        max_seq_length=None,  # the window is then tokenizer_config.json's model_max_length, at most the positions
        do_lower_case=True,
        nested=True,
    )
    summary = import_hf(src, tmp_path / "qkv")
    assert any("do_lower_case" in note for note in summary["notes"])
    assert summary["embedding"]["max_len"] == 160 and "160 positions" in summary["embedding"]["source"]
    vectors, _ = embed_with_cli(tmp_path / "qkv", TEXTS, tmp_path)
    lowered = transformers_embeddings(
        src / "0_Transformer", TEXTS, pooling="mean", normalize=True, max_len=160, lowercase=True
    )
    assert_match(vectors, lowered)
    if SentenceTransformer is not None:
        assert_match(vectors, sentence_transformers_embeddings(src, TEXTS))


def test_modules_qkv_does_not_reproduce_are_named(tmp_path: Path, capsys) -> None:
    """A Dense module after the pooling: the Transformer is imported, and import-hf and embed say
    that the checkpoint's sentence-transformers embeddings are not what qkv embed gives."""
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    src = sentence_transformers_dir(
        tmp_path / "st", wordpiece(), pooling=legacy_pooling("cls"), normalize=False, max_seq_length=64,
        extra_modules=(dense,),
    )  # fmt: skip
    assert main(["import-hf", str(src), str(tmp_path / "qkv")]) == 0
    err = capsys.readouterr().err
    assert "does not reproduce module 2_Dense (Dense)" in err
    _, said = embed_with_cli(tmp_path / "qkv", TEXTS[:2], tmp_path)
    assert "not reproduced: module 2_Dense (Dense)" in said
    weighted = {"pooling_mode": "weightedmean"}
    (src / "1_Pooling" / "config.json").write_text(json.dumps(weighted))
    summary = import_hf(src, tmp_path / "qkv2")
    assert "pooling" not in summary["embedding"] and "weightedmean" in " ".join(summary["notes"])


def test_plain_bert_window_and_options(tmp_path: Path, capsys) -> None:
    """A BERT checkpoint without sentence-transformers files: its window is tokenizer_config.json's
    model_max_length (what transformers cuts to with truncation=True), pooling is qkv's default
    (mean, not normalized), and each option overrides what was recorded; stderr says which."""
    src = bert_checkpoint(tmp_path / "bert", wordpiece(), model_max_length=48)
    summary = import_hf(src, tmp_path / "qkv")
    assert summary["embedding"] == {"max_len": 48, "source": "window: tokenizer_config.json model_max_length 48"}
    vectors, said = embed_with_cli(tmp_path / "qkv", TEXTS + BLANK, tmp_path)
    assert (
        "mean pooling, not normalized, window 48 tokens" in said and "pooling and normalization: qkv's default" in said
    )
    assert not vectors[len(TEXTS) :].any()  # empty lines: zero rows
    assert_match(
        vectors[: len(TEXTS)], transformers_embeddings(src, TEXTS, pooling="mean", normalize=False, max_len=48)
    )
    vectors, said = embed_with_cli(
        tmp_path / "qkv", TEXTS, tmp_path, "--pooling", "max", "--normalize", "--max-len", "20"
    )
    assert "pooling: --pooling; normalization: --normalize; window: --max-len" in said
    assert_match(vectors, transformers_embeddings(src, TEXTS, pooling="max", normalize=True, max_len=20))
    out = tmp_path / "x.npy"
    capsys.readouterr()
    assert main(["embed", "--model", str(tmp_path / "qkv"), "--output", str(out), "--max-len", "161"]) == 2
    assert "161" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):
        main(["embed", "--help"])
    help_text = capsys.readouterr().out
    assert all(word in help_text for word in ("--pooling", "--no-normalize", "--max-len", "sentence-transformers"))


def test_a_recorded_setting_is_checked(tmp_path: Path) -> None:
    src = bert_checkpoint(tmp_path / "bert", wordpiece(), model_max_length=None)
    assert import_hf(src, tmp_path / "qkv")["embedding"]["max_len"] == 160
    for bad, match in (
        ({"pooling": "sum"}, r"pooling must be one of"),
        ({"max_len": 161}, r"max_len must be an integer in \[1, 160\]"),
        ({"normalize": "yes"}, r"normalize must be true or false"),
        ({"windows": 3}, r"unknown key"),
    ):
        with pytest.raises(UserError, match=match):
            EmbeddingSettings.read({"embedding": bad}, "config.json", model_max_len=160)


# ------------------------------------------------------------------------ RoBERTa, XLM-R, DistilBERT


def family_checkpoint(directory: Path, architecture: str) -> Path:
    """A small random RoBERTa (byte-level BPE), XLM-R (Unigram) or DistilBERT (WordPiece) of class
    ``architecture``, saved as transformers saves one with a tokenizer.json that pads and
    truncates."""
    directory.mkdir(parents=True)
    roberta = "Roberta" in architecture
    backend = (byte_bpe() if architecture.startswith("Roberta") else unigram()) if roberta else wordpiece()
    specials = ROBERTA_SPECIALS if roberta else BERT_SPECIALS
    mask = "<mask>" if roberta else "[MASK]"
    backend.add_special_tokens([mask])
    backend.save(str(directory / "tokenizer.json"))
    names = {HF_NAMES[r]: t for r, t in specials.items()}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "mask_token": mask, "model_max_length": 48}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    vocab = backend.get_vocab_size()
    if roberta:
        config = getattr(transformers, "XLMRobertaConfig" if architecture.startswith("XLM") else "RobertaConfig")(
            vocab_size=vocab, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
            max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
            num_labels=3,
        )  # fmt: skip
    else:
        config = transformers.DistilBertConfig(
            vocab_size=vocab, dim=24, n_heads=4, hidden_dim=40, n_layers=2, max_position_embeddings=64
        )
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    perturb(model, 5)
    model.save_pretrained(directory)
    return directory


FAMILIES = [
    "RobertaModel",
    "RobertaForMaskedLM",
    "RobertaForSequenceClassification",
    "XLMRobertaModel",
    "DistilBertModel",
    "DistilBertForMaskedLM",
]


@pytest.mark.parametrize("architecture", FAMILIES)
def test_roberta_xlmr_distilbert_compute_what_transformers_does(architecture: str, tmp_path: Path) -> None:
    """Hidden states and the head's logits on a padded batch, token ids framed to the window
    (tokenizer_config.json's model_max_length, 48) and mean-pooled embeddings: as transformers."""
    src = family_checkpoint(tmp_path / "hf", architecture)
    summary = import_hf(src, tmp_path / "qkv")
    assert summary["architecture"] == architecture and summary["embedding"]["max_len"] == 48
    model, _ = load_model(tmp_path / "qkv")
    assert model.config.max_len == 64  # RoBERTa: 66 positions less pad_token_id + 1
    ours_tokenizer = Tokenizer.load(tmp_path / "qkv" / "tokenizer.json")
    hf_tokenizer = AutoTokenizer.from_pretrained(src)
    assert_same_tokenization(ours_tokenizer, hf_tokenizer, TEXTS + BLANK, window=48)

    hf = getattr(transformers, architecture).from_pretrained(src).eval()
    batch = hf_tokenizer(TEXTS, padding=True, truncation=True, max_length=48, return_tensors="pt")
    batch.pop("token_type_ids", None)
    x, mask = batch["input_ids"], batch["attention_mask"].bool()
    with torch.no_grad():
        out = hf(**batch, output_hidden_states=True)
        hidden = model.encode(x, mask=mask)
        assert (hidden[mask] - out.hidden_states[-1][mask]).abs().max() < 1e-4
        if architecture.endswith("ForMaskedLM"):
            assert (model(x, mask=mask)[mask] - out.logits[mask]).abs().max() < 1e-4
        elif architecture.endswith("ForSequenceClassification"):
            assert (model.classify(x, mask=mask) - out.logits).abs().max() < 1e-4
    if not architecture.endswith("Model"):
        return
    vectors, said = embed_with_cli(tmp_path / "qkv", TEXTS, tmp_path)
    assert "window 48 tokens" in said
    assert_match(vectors, transformers_embeddings(src, TEXTS, pooling="mean", normalize=False, max_len=48))
    if architecture == "RobertaModel":  # exported, a RoBERTa is a BertModel that computes the same
        export_hf(tmp_path / "qkv", tmp_path / "exported")
        back = BertModel.from_pretrained(tmp_path / "exported").eval()
        with torch.no_grad():
            again = back(input_ids=x, attention_mask=mask.long()).last_hidden_state
        assert (again[mask] - out.hidden_states[-1][mask]).abs().max() < 1e-4


@pytest.mark.parametrize("architecture", ["XLMRobertaModel", "DistilBertModel"])
def test_sentence_transformers_over_xlmr_and_distilbert(architecture: str, tmp_path: Path) -> None:
    src = family_checkpoint(tmp_path / "st", architecture)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (src / "modules.json").write_text(json.dumps(modules))
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 24, "pooling_mode": "cls"}))
    (src / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    assert import_hf(src, tmp_path / "qkv")["embedding"]["max_len"] == 32
    vectors, said = embed_with_cli(tmp_path / "qkv", TEXTS, tmp_path)
    assert "cls pooling, normalized, window 32 tokens" in said
    assert_match(vectors, transformers_embeddings(src, TEXTS, pooling="cls", normalize=True, max_len=32))
    if SentenceTransformer is not None:
        assert_match(vectors, sentence_transformers_embeddings(src, TEXTS))


@pytest.mark.parametrize(
    "architecture",
    [
        "MPNetForMaskedLM",
        "T5ForConditionalGeneration",
        "FalconForCausalLM",
        "DebertaV2Model",
        "DistilBertForSequenceClassification",  # its head (pre_classifier + ReLU) is not qkv's pooler
    ],
)
def test_unsupported_families_are_refused_by_name(architecture: str, tmp_path: Path) -> None:
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    with pytest.raises(UserError) as error:
        import_hf(src, tmp_path / "qkv")
    message = str(error.value)
    assert architecture in message and all(name in message for name in SUPPORTED)
    assert not (tmp_path / "qkv").exists()


# ------------------------------------------------------------------------ real files


def real(name: str, *needed: str) -> Path:
    path = REAL / name
    missing = [n for n in needed if not (path / n).exists()]
    if missing:
        pytest.skip(
            f"real checkpoint files not present: {path} lacks {', '.join(missing)} (set QKV_HF_REAL to the folder "
            "holding them; see bench/hf_real.py)"
        )
    return path


def test_real_minilm_matches_transformers_and_sentence_transformers(tmp_path: Path) -> None:
    """The published sentence-transformers/all-MiniLM-L6-v2 (tokenizer.json: fixed padding 128,
    truncation 128; max_seq_length 256; mean pooling; Normalize listed without a folder)."""
    src = real("all-MiniLM-L6-v2", "config.json", "model.safetensors", "tokenizer.json", "modules.json")
    summary = import_hf(src, tmp_path / "qkv")
    assert summary["embedding"]["pooling"] == "mean" and summary["embedding"]["normalize"] is True
    assert summary["embedding"]["max_len"] == 256
    vectors, said = embed_with_cli(tmp_path / "qkv", TEXTS, tmp_path)
    assert "mean pooling, normalized, window 256 tokens" in said
    hf_tokenizer = AutoTokenizer.from_pretrained(src)
    assert_same_tokenization(
        Tokenizer.load(tmp_path / "qkv" / "tokenizer.json"), hf_tokenizer, TEXTS + BLANK, window=256
    )
    assert_match(vectors, transformers_embeddings(src, TEXTS, pooling="mean", normalize=True, max_len=256))
    if SentenceTransformer is not None:
        assert_match(vectors, sentence_transformers_embeddings(src, TEXTS))


def test_real_gpt2_tokenizer_files() -> None:
    """GPT-2's published vocab.json and merges.txt, as import-hf reads them, against transformers."""
    src = real("gpt2-tokenizer", "vocab.json", "merges.txt")
    ours, _ = gpt2_tokenizer(src)
    theirs = AutoTokenizer.from_pretrained(src)
    for text in TEXTS + BLANK + ["<|endoftext|> ends", " leading space and trailing  "]:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_real_whisper_tokenizer_json() -> None:
    """A published tokenizer.json with a BOS/EOS template and many added special tokens (Whisper's)."""
    path = real("whisper-tiny.en-ct2", "tokenizer.json") / "tokenizer.json"
    ours = Tokenizer(HFTokenizer.from_file(str(path)), specials={"eos": "<|endoftext|>"})
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(path))
    for text in TEXTS + BLANK + ["<|endoftext|> and <|notimestamps|> are special"]:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
