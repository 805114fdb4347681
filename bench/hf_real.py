"""Real checkpoints, real results: ``qkv import-hf`` on checkpoints a user has, against transformers.

    python bench/hf_real.py                       # every checkpoint under $QKV_HF_REAL (default /tmp/hfreal)
    python bench/hf_real.py ~/hf/all-MiniLM-L6-v2 ~/hf/bert-base-uncased ~/hf/gpt2 ~/hf/opus-mt-en-de
    python bench/hf_real.py --selftest            # tiny random BERT (sentence-transformers), GPT-2, Marian
    python bench/hf_real.py --no-record PATH ...  # print the table only

Nothing is downloaded: each argument is a directory the user already has (what
``save_pretrained`` or sentence-transformers' ``save`` writes). Each is imported with qkv
(``import_hf``) into a temporary directory, then run beside transformers on a fixed set of
sentences (English, German, French accents, Chinese, Japanese, emoji, a [MASK] written out, odd
spacing, and a long one, past a 256-token window):

* BERT-like (``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``, and a
  sentence-transformers directory over one): token ids (qkv's [CLS] text [SEP] cut to the window
  vs the HF tokenizer with ``truncation=True``), last hidden states and the head's logits on the
  same ids (max abs difference over real tokens), and ``qkv embed``'s vectors with the settings
  the model directory records (its pooling, normalization and window) against the same pooling
  computed by hand on transformers' hidden states and, for a sentence-transformers directory,
  against sentence-transformers' own ``encode`` (min cosine, max abs difference);
* GPT-2 (``GPT2LMHeadModel``): ids, logits (max abs difference) and greedy continuations of
  five prompts (24 new tokens) against ``generate(do_sample=False)``: identical or not;
* Marian (``MarianMTModel``): ids, logits teacher-forced on HF's greedy output, and greedy
  translations (32 new tokens): identical or not;
* anything else: refused by import-hf, which names the architectures it reads (the row says so).

The table: checkpoint, architecture, ids identical, max |Δ| of hidden states and of logits, min
cosine of embeddings to transformers and to sentence-transformers, greedy outputs identical.
Each checkpoint's headline goes to ``bench/results/hf_real.json`` through ``bench/record.py``
(target: cosine >= 0.9999 for embeddings, every greedy output identical), all figures in its
``details``. ``--selftest`` builds small random checkpoints (a sentence-transformers BERT whose
tokenizer.json pads to 128, a GPT-2 over GPT-2's real tokenizer files where present, a Marian)
to check this script's own paths; their records are not written.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import transformers  # noqa: E402

from qkv.checkpoint import load_model  # noqa: E402
from qkv.decoding import greedy  # noqa: E402
from qkv.embedding import EmbeddingSettings, choose, frame, pool, sentence_embeddings  # noqa: E402
from qkv.errors import UserError  # noqa: E402
from qkv.hf.convert import import_hf  # noqa: E402
from qkv.hf.sentence_transformers import read_sentence_transformers  # noqa: E402
from qkv.tokenization import Tokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

REAL = Path(os.environ.get("QKV_HF_REAL", "/tmp/hfreal"))
MIN_COSINE = 0.9999
LONG = " ".join(f"Sentence number {i} of a long paragraph keeps going, and going." for i in range(40))
SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog.",
    "Das Wetter in München ist heute schön, sagt Jürgen.",
    "Crème brûlée, naïve café — ÀÉÎÕÜ résumé",
    "我爱北京天安门。",
    "東京タワーは高いです。",
    "I love pizza 🍕 and rockets 🚀 👍🏽",
    "The capital of France is [MASK].",
    "  odd   spacing\tand a tab  ",
    LONG,  # > 256 tokens: cut to the window on both sides
]
PROMPTS = SENTENCES[:5]
GREEDY_NEW = 24
MARIAN_NEW = 32


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min().item()


# ------------------------------------------------------------------------ families


@torch.no_grad()
def bert_like(src: Path, hf_dir: Path, architecture: str, qkv_dir: Path) -> dict:
    model, meta = load_model(qkv_dir)
    tokenizer = Tokenizer.load(qkv_dir / "tokenizer.json")
    positions = model.config.max_len
    chosen = choose(
        EmbeddingSettings.read(meta, qkv_dir / "config.json", model_max_len=positions), model_max_len=positions
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf = getattr(transformers, architecture).from_pretrained(hf_dir).eval()
    batch = hf_tokenizer(SENTENCES, padding=True, truncation=True, max_length=chosen.max_len, return_tensors="pt")
    if "token_type_ids" not in inspect.signature(hf.forward).parameters:  # DistilBERT has no token types
        batch.pop("token_type_ids", None)
    mask = batch["attention_mask"].bool()  # (B, S)
    rows, _ = frame(tokenizer, SENTENCES, max_len=chosen.max_len)
    theirs = [ids[: int(m.sum())] for ids, m in zip(batch["input_ids"].tolist(), mask, strict=True)]
    same_ids = sum(a == b for a, b in zip(rows, theirs, strict=True))

    # The models on the same ids (HF's), so that a difference is the model's, not the tokenizer's.
    x, types = batch["input_ids"], batch.get("token_type_ids")
    out = hf(**batch, output_hidden_states=True)
    h_hf = out.hidden_states[-1]  # (B, S, D)
    h_qkv = model.encode(x, mask=mask, token_types=types)
    result = {"ids_identical": f"{same_ids}/{len(SENTENCES)}", "hidden_max_abs": max_diff(h_qkv[mask], h_hf[mask])}
    if architecture == "BertForMaskedLM":
        result["logits_max_abs"] = max_diff(model(x, mask=mask, token_types=types)[mask], out.logits[mask])
    elif architecture == "BertForSequenceClassification":
        result["logits_max_abs"] = max_diff(model.classify(x, mask=mask, token_types=types), out.logits)

    ours, _ = sentence_embeddings(
        model, tokenizer, SENTENCES, pooling=chosen.pooling, normalize=chosen.normalize, max_len=chosen.max_len
    )
    by_hand = pool(h_hf, mask, chosen.pooling)
    if chosen.normalize:
        by_hand = torch.nn.functional.normalize(by_hand, dim=-1)
    result.update(
        embedding=f"{chosen.pooling}{', normalized' if chosen.normalize else ''}, window {chosen.max_len}",
        cosine_transformers=min_cosine(ours, by_hand),
        embedding_max_abs_transformers=max_diff(ours, by_hand),
    )
    if (src / "modules.json").is_file():
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(src), device="cpu")
        reference = st.encode(SENTENCES, convert_to_tensor=True, batch_size=16).cpu()
        result.update(
            cosine_sentence_transformers=min_cosine(ours, reference),
            embedding_max_abs_sentence_transformers=max_diff(ours, reference),
        )
    return result


def hf_greedy(hf, prompts: list[list[int]], *, pad: int, eos: int, new: int) -> list[list[int]]:
    """HF greedy decoding of a left-padded batch; the new tokens of each row, cut before END."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=new, pad_token_id=pad
    )
    return [row[: row.index(eos)] if eos in row else row for row in out[:, width:].tolist()]


@torch.no_grad()
def gpt2(hf_dir: Path, qkv_dir: Path) -> dict:
    model, _ = load_model(qkv_dir)
    tokenizer = Tokenizer.load(qkv_dir / "tokenizer.json")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ours_ids = [tokenizer.encode(s) for s in SENTENCES]
    theirs_ids = [hf_tokenizer(s)["input_ids"] for s in SENTENCES]
    same_ids = sum(a == b for a, b in zip(ours_ids, theirs_ids, strict=True))
    rows = [ids[: model.config.max_len] for ids in theirs_ids]
    width = max(len(r) for r in rows)
    eos = model.config.eos_id if model.config.eos_id is not None else 0
    x = torch.tensor([r + [eos] * (width - len(r)) for r in rows])
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    expected = hf(input_ids=x, attention_mask=mask.long()).logits
    logits = model.decode(x, key_mask=mask).logits
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    ours = greedy(model, prompts, max_new_tokens=GREEDY_NEW)
    theirs = hf_greedy(hf, prompts, pad=eos, eos=eos, new=GREEDY_NEW)
    return {
        "ids_identical": f"{same_ids}/{len(SENTENCES)}",
        "logits_max_abs": max_diff(logits[mask], expected[mask]),
        "greedy_identical": f"{sum(a == b for a, b in zip(ours, theirs, strict=True))}/{len(prompts)}",
        "greedy_new_tokens": sum(len(row) for row in ours),
    }


@torch.no_grad()
def marian(hf_dir: Path, qkv_dir: Path) -> dict:
    model, _ = load_model(qkv_dir)
    tokenizer = Tokenizer.load(qkv_dir / "tokenizer.json")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
    sources = SENTENCES[:-1]  # the long one passes Marian's 512 positions in some vocabularies
    ours_ids = tokenizer.encode_batch(sources)
    theirs_ids = hf_tokenizer(sources)["input_ids"]
    same_ids = sum(a == b for a, b in zip(ours_ids, theirs_ids, strict=True))
    c = model.config
    batch = hf_tokenizer(sources, return_tensors="pt", padding=True)
    out = hf.generate(**batch, do_sample=False, num_beams=1, max_new_tokens=MARIAN_NEW)  # (B, T): start, ..., END/pad
    expected = hf(**batch, decoder_input_ids=out).logits  # teacher-forced on HF's own output
    logits = model(batch["input_ids"], out)  # the source's padding is its pad id, as HF's mask says
    real = out != c.pad_id
    real[:, 0] = True  # the start token (the padding id) is read
    theirs = [row[1:] for row in out.tolist()]
    theirs = [row[: row.index(c.eos_id)] if c.eos_id in row else [t for t in row if t != c.pad_id] for row in theirs]
    ours = greedy(model, ours_ids, max_new_tokens=MARIAN_NEW)
    return {
        "ids_identical": f"{same_ids}/{len(sources)}",
        "logits_max_abs": max_diff(logits[real], expected[real]),
        "greedy_identical": f"{sum(a == b for a, b in zip(ours, theirs, strict=True))}/{len(sources)}",
        "greedy_new_tokens": sum(len(row) for row in ours),
    }


# ------------------------------------------------------------------------ one checkpoint


def run_one(src: Path) -> dict:
    """Import ``src`` with qkv and compare; a row of the table (``refused``: why not)."""
    row: dict = {"checkpoint": src.name, "path": str(src)}
    try:
        st = read_sentence_transformers(src)
    except UserError as e:
        return {**row, "architecture": "?", "refused": str(e)}
    hf_dir = st.model_dir if st is not None else src
    try:
        architectures = json.loads((hf_dir / "config.json").read_text(encoding="utf-8")).get("architectures") or ["?"]
    except (OSError, ValueError):
        architectures = ["?"]
    row["architecture"] = architectures[0] + (" (sentence-transformers)" if st is not None else "")
    with tempfile.TemporaryDirectory() as tmp:
        qkv_dir = Path(tmp) / "qkv"
        start = time.perf_counter()
        try:
            summary = import_hf(src, qkv_dir)
        except UserError as e:
            return {**row, "refused": str(e)}
        row["import_seconds"] = round(time.perf_counter() - start, 2)
        row["notes"] = summary["notes"]
        kind = summary["kind"]
        if kind == "encoder_only":
            row.update(bert_like(src, hf_dir, summary["architecture"], qkv_dir))
        elif kind == "decoder_only":
            row.update(gpt2(hf_dir, qkv_dir))
        else:
            row.update(marian(hf_dir, qkv_dir))
    return row


def discover(root: Path) -> list[Path]:
    """The checkpoint directories under ``root``: those with a config.json or a modules.json."""
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.iterdir() if p.is_dir() and ((p / "config.json").is_file() or (p / "modules.json").is_file())
    )


# ------------------------------------------------------------------------ the table and records


def fmt(value, digits: str = ".2e") -> str:
    if value is None:
        return "-"
    return format(value, digits) if isinstance(value, float) else str(value)


def table(rows: list[dict]) -> str:
    head = [
        "checkpoint",
        "architecture",
        "ids same",
        "max|Δ| hidden",
        "max|Δ| logits",
        "cos HF",
        "cos ST",
        "greedy same",
    ]
    lines = [head]
    for r in rows:
        if "refused" in r:  # the reason follows the table
            lines.append([r["checkpoint"], r["architecture"], "refused", "", "", "", "", ""])
            continue
        lines.append(
            [
                r["checkpoint"],
                r["architecture"],
                r.get("ids_identical", "-"),
                fmt(r.get("hidden_max_abs")),
                fmt(r.get("logits_max_abs")),
                fmt(r.get("cosine_transformers"), ".7f"),
                fmt(r.get("cosine_sentence_transformers"), ".7f"),
                r.get("greedy_identical", "-"),
            ]
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    text = [" | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def record_of(row: dict) -> dict | None:
    """The checkpoint's headline figure, for bench/results/hf_real.json (None for a refused one)."""
    if "refused" in row:
        return None
    details = {
        k: (round(v, 7) if "cosine" in k else float(f"{v:.3g}")) if isinstance(v, float) else v
        for k, v in row.items()
        if k not in ("checkpoint", "path", "notes")
    }
    name = row["checkpoint"]
    if "cosine_sentence_transformers" in row:
        metric, figure, peer = (
            "min cosine of qkv embed to sentence-transformers",
            row["cosine_sentence_transformers"],
            "sentence-transformers",
        )
    elif "cosine_transformers" in row:
        metric, figure, peer = (
            "min cosine of qkv embed to transformers (same pooling)",
            row["cosine_transformers"],
            "transformers",
        )
    else:
        done, total = (int(n) for n in row["greedy_identical"].split("/"))
        metric, figure, peer = "greedy outputs identical to transformers", done / total, "transformers generate"
        return {
            "metric": f"{name}: {metric}",
            "figure": figure,
            "unit": "fraction of inputs",
            "peer": peer,
            "target": {"min": 1.0},
            "details": details,
        }
    return {
        "metric": f"{name}: {metric}",
        "figure": round(figure, 7),
        "unit": "cosine",
        "peer": peer,
        "target": {"min": MIN_COSINE},
        "details": details,
        "notes": f"{len(SENTENCES)} sentences (German, French accents, Chinese, Japanese, emoji, [MASK], a long one)",
    }


def write_records(rows: list[dict]) -> Path:
    records = [r for r in map(record_of, rows) if r is not None]
    if (ROOT / "bench" / "record.py").is_file():
        import record  # bench/record.py: commit, date, machine and command filled in

        for r in records:
            r.setdefault("machine", {})["transformers"] = transformers.__version__
            if "sentence_transformers" in sys.modules:
                r["machine"]["sentence-transformers"] = sys.modules["sentence_transformers"].__version__
        record.append_run("hf_real", records)
        return ROOT / "bench" / "results" / "hf_real.json"
    path = ROOT / "bench" / "results" / "hf_real.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs += [{"name": "hf_real", "date": date, "command": " ".join(sys.argv), **r} for r in records]
    path.write_text(json.dumps(runs, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------ --selftest


def selftest_checkpoints(root: Path) -> list[Path]:
    """Small random checkpoints with published-style files: a sentence-transformers BERT whose
    tokenizer.json pads to 128 and truncates at 128 (mean pooling, Normalize, max_seq_length 256);
    a GPT-2 over GPT-2's real vocab.json/merges.txt where $QKV_HF_REAL has them (else a byte-level
    BPE trained here); a Marian over two SentencePiece models trained here."""
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer, processors

    corpus = SENTENCES * 5 + ["a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , ! ?"]

    def perturb(model: torch.nn.Module, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))

    made = []
    # BERT, sentence-transformers layout
    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(corpus, vocab_size=300, min_frequency=1)
    backend = wp._tokenizer
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    backend.enable_padding(length=128, pad_id=backend.token_to_id("[PAD]"), pad_token="[PAD]")
    backend.enable_truncation(max_length=128)
    settings = {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 512}
    settings |= {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
    settings["mask_token"] = "[MASK]"
    vocab = backend.get_vocab_size()
    for name, config, pooling in (
        (
            "tiny-st-bert",
            transformers.BertConfig(
                vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48
            ),
            "mean",
        ),
        (
            "tiny-st-distilbert",
            transformers.DistilBertConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=48),
            "cls",
        ),
    ):
        st = root / name
        st.mkdir(parents=True)
        backend.save(str(st / "tokenizer.json"))
        (st / "tokenizer_config.json").write_text(json.dumps(settings))
        torch.manual_seed(0)
        model = transformers.AutoModel.from_config(config)
        perturb(model, 1)
        model.save_pretrained(st)
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]
        (st / "modules.json").write_text(json.dumps(modules))
        (st / "1_Pooling").mkdir()
        pooling_config = {"word_embedding_dimension": 32, "pooling_mode": pooling}
        (st / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
        (st / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
        made.append(st)

    # GPT-2
    g2 = root / "tiny-gpt2"
    g2.mkdir()
    real = REAL / "gpt2-tokenizer"
    if (real / "vocab.json").is_file() and (real / "merges.txt").is_file():
        for name in ("vocab.json", "merges.txt"):
            (g2 / name).write_bytes((real / name).read_bytes())
    else:
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(corpus, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
        bpe.save_model(str(g2))
    hf_tokenizer = transformers.GPT2Tokenizer.from_pretrained(g2)
    eos = hf_tokenizer.eos_token_id
    config = transformers.GPT2Config(
        vocab_size=len(hf_tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=512,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    perturb(model, 2)
    model.save_pretrained(g2)
    made.append(g2)

    # Marian
    import sentencepiece

    mt = root / "tiny-marian"
    mt.mkdir()
    for side in ("source", "target"):
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus if side == "source" else [t.upper() for t in corpus]),
            model_prefix=str(mt / side),
            vocab_size=120,
            hard_vocab_limit=False,
            minloglevel=2,
        )
        (mt / f"{side}.model").rename(mt / f"{side}.spm")
    vocab = {"</s>": 0, "<unk>": 1}
    for side in ("source", "target"):
        processor = sentencepiece.SentencePieceProcessor(model_file=str(mt / f"{side}.spm"))
        for i in range(processor.get_piece_size()):
            vocab.setdefault(processor.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    (mt / "vocab.json").write_text(json.dumps(vocab))
    marian_tokenizer = transformers.MarianTokenizer(
        str(mt / "source.spm"), str(mt / "target.spm"), str(mt / "vocab.json")
    )
    marian_tokenizer.save_pretrained(mt)
    pad = vocab["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=512,
        pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config)
    perturb(model, 3)
    model.save_pretrained(mt)
    made.append(mt)
    return made


# ------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help=f"checkpoint directories (default: those under {REAL})")
    parser.add_argument("--selftest", action="store_true", help="small random checkpoints built here (no record)")
    parser.add_argument("--no-record", action="store_true", help="print the table only")
    parser.add_argument("--json", action="store_true", help="also print every row as a JSON line")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        paths = selftest_checkpoints(Path(tmp)) if args.selftest else (args.paths or discover(REAL))
        if not paths:
            print(f"no checkpoints: give their directories, or put them under {REAL} (QKV_HF_REAL)", file=sys.stderr)
            return 2
        rows = []
        for path in paths:
            print(f"{path} ...", file=sys.stderr, flush=True)
            rows.append(run_one(Path(path)))
    print(table(rows))
    for row in rows:
        if "refused" in row:
            print(f"refused: {row['checkpoint']}: {row['refused']}")
        for note in row.get("notes", []):
            print(f"note: {row['checkpoint']}: {note}")
        if args.json:
            print(json.dumps(row, ensure_ascii=False))
    if not args.selftest and not args.no_record:
        print(f"records -> {write_records(rows)}", file=sys.stderr)
    failed = [
        r["checkpoint"]
        for r in rows
        if "refused" not in r
        and (
            min(r.get("cosine_transformers", 1.0), r.get("cosine_sentence_transformers", 1.0)) < MIN_COSINE
            or ("greedy_identical" in r and r["greedy_identical"].split("/")[0] != r["greedy_identical"].split("/")[1])
        )
    ]
    if failed:
        print(f"below target: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
