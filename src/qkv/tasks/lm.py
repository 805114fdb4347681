"""The language-modelling task (decoder-only, GPT): :data:`TASK`, its parts of a run :func:`prepare_lm`,
and the token stream it trains and validates on (:func:`split_documents`, :func:`token_stream`),
shared with ``qkv evaluate --text``.

Character-level or subword vocabularies, one text stream or one document per line / per
DailyDialog dialogue, contiguous-block batches, scored by validation loss in nats per token.

What is not here: recipe loading and the shared runner pieces (``recipes.py``), sampling and
the KV cache (``decoding/``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from pathlib import Path

import torch

from qkv import runner
from qkv.checkpoint import (
    build_model,
    model_dir,
)
from qkv.data import (
    EOU,
    read_dailydialog,
    read_text,
    resolve,
)
from qkv.distributed import share
from qkv.errors import UserError
from qkv.evaluation import (
    lm_loss,
    normalize_transcript,
    span_loss,
)
from qkv.losses import (
    on_model,
    sequence_loss,
)
from qkv.models.decoder_only import DecoderOnly
from qkv.recipes import Recipe, Setup, Start, Task, TrainConfig, require_steps, step_seed
from qkv.tokenization import FILE as TOKENIZER_FILE
from qkv.tokenization import Tokenizer

# Character-level language modelling; the defaults are nanoGPT's Shakespeare CPU
# configuration (4 layers, 4 heads, width 128, context 64, batch 12, 2,000 steps).
LM_MODEL: dict = {
    "d_model": 128,
    "n_heads": 4,
    "d_ff": 512,
    "n_layers": 4,
    "max_len": 64,
    "dropout": 0.0,
    "positions": "learned",
    "activation": "gelu",
    "bias": False,
    "scale_embeddings": False,
    "tie_output": True,
}


@dataclasses.dataclass(frozen=True)
class LmTrain(TrainConfig):
    """A language model's training (``train``): the shared settings with nanoGPT's Shakespeare
    defaults, and ``batch_size`` windows of the context's length per step."""

    steps: int | None = 2000
    batch_size: int = 12
    warmup: int = 100
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    beta2: float = 0.99


@dataclasses.dataclass(frozen=True)
class LmData:
    """A language model's text (``data``)."""

    text: str = "tinyshakespeare/input.txt"
    valid_text: str | None = None  # a separate validation file (else the last val_fraction of the text)
    val_fraction: float = 0.1
    # "text": one stream; "lines": every line a document ending with END; "dailydialog": the
    # dialogues of the DailyDialog folder data.text (train / validation splits), one per document
    documents: str = "text"
    # "char", "subword" (a unigram vocabulary of vocab_size; newlines are pieces), or a model
    # directory whose tokenizer is taken as it is (an LM fused with that model needs its tokens)
    tokenizer: str = "char"
    transcripts: bool = False  # lines as a speech recognizer writes them (lowercase, no punctuation)
    vocab_size: int = 4000
    eval_batch_size: int = 64


def _check(recipe: Recipe, where: str) -> None:
    require_steps(recipe, where)
    tokenizer = recipe.data.tokenizer
    if not isinstance(tokenizer, str) or not tokenizer:
        raise UserError(f"{where}: data.tokenizer must be char, subword or a model directory for the lm task")
    if recipe.data.transcripts and recipe.data.documents != "lines":
        raise UserError(f"{where}: data.transcripts=true needs data.documents=lines (one transcript per line)")
    if recipe.data.valid_text is not None and not isinstance(recipe.data.valid_text, str):
        raise UserError(f"{where}: data.valid_text must be a file path or null")


def _tokenizer_of(path: str) -> Tokenizer:
    """``data.tokenizer`` naming a model directory (or a training run): its tokenizer, as it is."""
    directory = model_dir(path)
    if not (directory / TOKENIZER_FILE).is_file():
        raise UserError(f"data.tokenizer: {path} is not char, subword or a model directory with a {TOKENIZER_FILE}")
    return Tokenizer.load(directory / TOKENIZER_FILE)


def documents_of(meta: dict) -> tuple[str, bool]:
    """How the language model of a model directory's config.json read its text: the recipe's
    ``data.documents`` ("text" for a model saved without a recipe: imported, or older) and
    ``data.transcripts`` (False without one)."""
    recipe = meta.get("recipe")
    data = recipe.get("data") if isinstance(recipe, dict) else None
    data = data if isinstance(data, dict) else {}
    documents = data.get("documents", "text")
    return documents if documents in ("text", "lines", "dailydialog") else "text", data.get("transcripts") is True


def documents_in(text: str, *, documents: str, transcripts: bool) -> list[str]:
    """The documents of ``text`` (:func:`split_documents`); with ``transcripts`` written as a
    speech recognizer writes them (``normalize_transcript``), those left without words left out."""
    docs = split_documents(text, documents=documents)
    return [t for t in map(normalize_transcript, docs) if t] if transcripts else docs


def split_documents(text: str, *, documents: str) -> list[str]:
    """The documents of ``text``: itself for ``documents="text"`` (one stream), else every
    non-empty line ("lines", and "dailydialog", whose dialogues are joined one per line)."""
    if documents == "text":
        return [text]
    return [line for line in text.splitlines() if line.strip()]


def token_stream(tokenizer: Tokenizer, docs: list[str], *, documents: str) -> torch.Tensor:
    """The token ids a language model trains and is validated on: the documents' ids, one after
    another, each but a "text" stream ending with END (so the model learns where one ends).
    ``qkv evaluate --text`` builds its stream with this too, so its loss is the validation loss.

    Shapes: returns (N,) int64.
    """
    end = [tokenizer.eos_id] if documents != "text" else []
    return torch.tensor([i for ids in tokenizer.encode_batch(docs) for i in [*ids, *end]], dtype=torch.long)


def reply_spans(tokenizer: Tokenizer, dialogues: list[list[str]], *, context: int) -> tuple[list[tuple[int, int]], int]:
    """Where each reply lies in the token stream of ``dialogues`` (as :func:`token_stream` builds
    it for ``documents="dailydialog"``: utterances joined by " __eou__ ", each dialogue ending
    with " __eou__" and END): (start, end) of every utterance but a dialogue's first, with its
    " __eou__" (a reply ends there, as ``qkv chat`` stops there). What a chatbot is scored on:
    the next utterance given the dialogue so far. A reply longer than the window
    (``context`` tokens) is left out. Also returns the stream's length, to check it against.
    """
    spans, offset = [], 0
    for turns in dialogues:
        ends = [len(tokenizer.encode(f" {EOU} ".join(turns[: i + 1]) + f" {EOU}")) for i in range(len(turns))]
        # Pieces never span a space, so each prefix's ids begin the whole dialogue's ids.
        spans += [(offset + a, offset + b) for a, b in itertools.pairwise(ends) if b - a <= context]
        offset += ends[-1] + 1  # + END
    return spans, offset


def _texts(data: LmData, problems: list[str]) -> tuple[Path, str, str, list[list[str]] | None]:
    """Where the text is, the training and the validation text, and DailyDialog's validation
    dialogues' utterances (else None): DailyDialog's splits (each dialogue a line of turns, each
    ending with EOU; a dialogue whose act labels do not line up added to ``problems``), or
    ``data.text`` and ``data.valid_text``, or the text's last ``val_fraction`` held out."""
    if data.documents == "dailydialog":
        path = Path(data.text)
        split_docs, split_turns = {}, {}
        for split in ("train", "validation"):
            dialogues, _ = read_dailydialog(path, split)
            split_turns[split] = [[u for u, _ in d] for d in dialogues if d]
            split_docs[split] = [f" {EOU} ".join(turns) + f" {EOU}" for turns in split_turns[split]]
            # The text needs no labels, but a dialogue whose act labels do not line up is
            # reported (the known DailyDialog quirk); its text is still used.
            _, misaligned = read_dailydialog(path, split, labels="act")
            problems += [f"{p.replace('; dialogue skipped', '')}; its text is still used" for p in misaligned]
        return path, "\n".join(split_docs["train"]), "\n".join(split_docs["validation"]), split_turns["validation"]
    path = resolve(data.text)
    text = read_text(path)
    if data.valid_text is not None:
        return path, text, read_text(resolve(data.valid_text)), None
    split = int(len(text) * (1 - float(data.val_fraction)))
    if split < 2 or len(text) - split < 2:
        raise UserError(f"{path}: too short to split into training and validation text")
    return path, text[:split], text[split:], None


def _lm_tokenizer(data: LmData, train_docs: list[str], last: Path | None) -> Tokenizer:
    """The run's tokenizer: a resumed run's own, another model's (``data.tokenizer`` a model
    directory), or one learnt from ``train_docs`` (characters or unigram subwords)."""
    if last is not None:
        return Tokenizer.load(last / TOKENIZER_FILE)
    if data.tokenizer not in ("char", "subword"):
        return _tokenizer_of(data.tokenizer)
    if data.tokenizer == "subword":
        # A text stream keeps its line breaks as pieces; documents (lines) have none.
        return Tokenizer.train_subword(train_docs, vocab_size=int(data.vocab_size), newlines=data.documents == "text")
    return Tokenizer.train_char_level(train_docs)


def prepare_lm(recipe: Recipe, start: Start) -> Setup:
    """The language-modelling task's parts of a run (``runner.train`` does the rest).

    Validation text is ``data.valid_text`` or else the text's last ``val_fraction``, as nanoGPT
    splits Tiny Shakespeare. ``data.documents="lines"`` makes every non-empty line a document
    that ends with END (a DailyDialog dialogue, say), so the model learns where one ends.
    Tokens are characters or unigram subwords (a text stream's newlines are pieces too), or
    those of another model's tokenizer (``data.tokenizer`` a model directory: a language model
    to fuse into that speech model's beam search, ``data.transcripts`` lines written as its
    transcripts are).
    Batches are ``batch_size`` random contiguous blocks of ``max_len`` + 1 tokens of the
    training stream. The validation loss is measured on the whole validation stream in
    non-overlapping windows of the context length (:func:`~qkv.evaluation.lm_loss`); it is the
    validation score too (``train.valid_every``).
    """
    last = start.checkpoint
    train, data = recipe.train, recipe.data
    seed = int(train.seed)
    problems: list[str] = []
    path, train_text, valid_text, valid_turns = _texts(data, problems)
    # data.transcripts: the text a fused language model scores is what the recognizer writes.
    read = {"documents": data.documents, "transcripts": bool(data.transcripts)}
    train_docs, valid_docs = documents_in(train_text, **read), documents_in(valid_text, **read)
    wordless = len(split_documents(train_text, documents=data.documents)) - len(train_docs)
    if wordless:
        problems.append(f"{wordless} training lines without words left out")
    if not train_docs or not valid_docs:
        raise UserError(f"{path}: no training or no validation text")
    torch.manual_seed(seed)
    tokenizer = _lm_tokenizer(data, train_docs, last)
    train_ids = token_stream(tokenizer, train_docs, documents=data.documents)
    val_ids = token_stream(tokenizer, valid_docs, documents=data.documents)
    fields = {**recipe.model, "vocab_size": tokenizer.vocab_size}
    model = build_model("decoder_only", fields)
    context, batch_size = model.config.max_len, int(train.batch_size)
    if len(train_ids) <= context + 1:
        raise UserError(f"{path}: the training text is shorter than one context window ({context + 1} tokens)")

    def step_loss(m: DecoderOnly, step: int) -> tuple[torch.Tensor, int]:
        # The blocks of a step are fixed by (seed, step) alone, so a resumed run draws the same.
        generator = torch.Generator().manual_seed(step_seed(seed, step))
        starts = torch.randint(len(train_ids) - context, (batch_size,), generator=generator)
        mine, counted = share(batch_size)  # this worker's rows of the step's batch (all of it alone)
        starts = starts[mine]
        x = torch.stack([train_ids[s : s + context] for s in starts])  # (B, T)
        y = torch.stack([train_ids[s + 1 : s + context + 1] for s in starts])  # (B, T)
        x, y = on_model(m, x, y)  # train.device
        loss = sequence_loss(m(x), y, ignore_id=None, label_smoothing=train.label_smoothing)
        return loss, y.numel() if counted else 0

    batch = int(data.eval_batch_size)

    def score(m: DecoderOnly) -> dict[str, float]:  # validation (train.valid_every): the validation loss
        return {"loss": lm_loss(m, val_ids, context=context, batch_size=batch)}

    def evaluate(m: DecoderOnly, out: Path, validated: dict | None) -> tuple[dict, dict]:
        began = time.perf_counter()
        val_loss = lm_loss(m, val_ids, context=context, batch_size=batch)
        reply: dict = {}
        if valid_turns is not None:
            spans, length = reply_spans(tokenizer, valid_turns, context=context)
            if length == len(val_ids):
                reply_loss, reply_tokens = span_loss(m, val_ids, spans, context=context, batch_size=batch)
                reply = {"reply_loss": reply_loss, "reply_tokens": reply_tokens, "replies": len(spans)}
            else:  # an utterance with a line separator of its own (str.splitlines) would shift the documents
                problems.append("the validation replies could not be located in the token stream; no reply_loss")
        seconds = time.perf_counter() - began
        scores = {"val_loss": val_loss, **reply}
        return scores, {**scores, "val_tokens": len(val_ids), "eval_seconds": seconds}

    return Setup(model, step_loss, tokenizer, evaluate, score=score, facts={"problems": problems})


def train_lm(recipe: Recipe, out: str | Path, *, progress: bool = True, resume: bool = False) -> dict:
    """Train a decoder-only language model as ``recipe`` says (:func:`prepare_lm`); save it to ``out``."""
    return runner.train(TASK, recipe, out, progress=progress, resume=resume)


def report(summary: dict, recipe: Recipe) -> tuple[dict, str]:
    """The run's scores for the command line: validation loss (and, for dialogues, the replies')."""
    score = {"val_loss": round(summary["val_loss"], 4)}
    said = f"val_loss={summary['val_loss']:.4f} (nats/token on the validation split)"
    if "reply_loss" in summary:  # dialogues: each reply given the dialogue before it
        score["reply_loss"] = round(summary["reply_loss"], 4)
        said += (
            f"; reply_loss={summary['reply_loss']:.4f} (perplexity {math.exp(summary['reply_loss']):.1f}) "
            f"on {summary['replies']} validation replies, each given the dialogue before it"
        )
    return score, said


TASK = Task(
    name="lm",
    model=LM_MODEL,
    train=LmTrain,
    data=LmData,
    model_kind="decoder_only",
    prepare=prepare_lm,
    report=report,
    rules={
        ("data", "text"): (str, lambda v: bool(v), "a file path"),
        ("data", "documents"): (str, lambda v: v in ("text", "lines", "dailydialog"), "text, lines or dailydialog"),
        ("data", "transcripts"): (bool, lambda v: True, "true or false"),
    },
    check=_check,
)
