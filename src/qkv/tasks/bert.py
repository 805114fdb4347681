"""The encoder-only (BERT) tasks: masked-LM pretraining (:data:`MLM`) and sequence
classification (:data:`CLASSIFY`), their recipe defaults, rules and parts of a run.

What is here: :func:`prepare_mlm` (15% of tokens selected: 80% [MASK], 10% random, 10% kept),
:func:`prepare_classifier` (from scratch or from a pretrained encoder; accuracy and macro-F1
beside the majority class), :func:`train_mlm`, :func:`train_classifier` and :func:`predict_labels`.

What is not here: recipe loading (``recipes.py``), the runner (``runner.py``), the model
(``models/encoder_only.py``), sentence embeddings (``embedding.py``, for ``qkv embed``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path

import torch

from qkv import runner
from qkv.checkpoint import (
    build_model,
    load_model,
    model_dir,
)
from qkv.data import (
    DAILYDIALOG_LABELS,
    read_dailydialog,
    read_labelled,
    read_lines,
    resolve,
)
from qkv.decoding import pad_rows
from qkv.distributed import share
from qkv.errors import UserError
from qkv.evaluation import (
    accuracy,
    macro_f1,
    masked_lm_scores,
)
from qkv.losses import (
    IGNORE,
    mask_tokens,
    on_model,
    sequence_loss,
)
from qkv.models.encoder_only import EncoderOnly
from qkv.recipes import (
    Recipe,
    Setup,
    Start,
    Task,
    TrainConfig,
    fine_tuning_fields,
    require_steps,
    step_seed,
    tokenizer_for,
)
from qkv.tokenization import Tokenizer

# Encoder-only models (BERT) on sentences: masked-LM pretraining (mlm) and sequence
# classification (classify), on DailyDialog by default (its utterances; its dialog acts).
# Sized to train in about 10-20 minutes each on 2 CPU cores. A classifier fine-tuned from a
# pretrained model (train.init) takes its architecture (a field the recipe names must agree);
# the fields of ENCODER_HEAD_FIELDS may differ.
ENCODER_MODEL: dict = {
    "d_model": 256,
    "n_heads": 4,
    "d_ff": 1024,
    "n_layers": 4,
    "max_len": 64,
    "dropout": 0.1,
    "positions": "learned",
    "activation": "gelu",
    "norm_first": True,
}


ENCODER_HEAD_FIELDS = ("dropout", "attention_dropout", "pooling", "pooler", "n_classes", "mlm_head")


MLM_MODEL: dict = dict(ENCODER_MODEL)


@dataclasses.dataclass(frozen=True)
class MlmTrain(TrainConfig):
    """Masked-LM pretraining (``train``): the shared settings with its defaults, and ``batch_size``
    sentences per step."""

    steps: int | None = 4000
    batch_size: int = 64  # sentences per step
    warmup: int = 400
    min_lr: float = 1e-5


@dataclasses.dataclass(frozen=True)
class MlmData:
    """Masked-LM pretraining's sentences (``data``): DailyDialog's utterances or a file of
    sentences."""

    dailydialog: str | None = "text"  # "text": DailyDialog's utterances (train / validation splits); null: sentences
    dailydialog_dir: str = "dailydialog"  # the DailyDialog folder (as given, or under $QKV_DATA)
    sentences: str | None = None  # a text file, one sentence per line (with dailydialog: null)
    valid_sentences: str | None = None  # its validation file (null: the last val_fraction of the sentences)
    val_fraction: float = 0.05
    train_examples: int | None = None  # use only the first N training sentences
    valid_examples: int | None = None  # validate on the first N validation sentences
    tokenizer: str | None = None  # an existing tokenizer.json (else a unigram vocabulary is trained); a mask is added
    vocab_size: int = 8000
    mask_rate: float = 0.15  # the share of tokens selected for prediction (80% masked, 10% random, 10% kept)
    eval_batch_size: int = 64


CLASSIFY_MODEL: dict = {**ENCODER_MODEL, "pooling": "mean"}


@dataclasses.dataclass(frozen=True)
class ClassifyTrain(TrainConfig):
    """A classifier's training (``train``): the shared settings with its defaults, ``batch_size``
    examples per step, and ``init``: a pretrained encoder to fine-tune."""

    steps: int | None = 2000
    batch_size: int = 32  # examples per step
    lr: float = 3e-4
    warmup: int = 200
    init: str | None = None  # a pretrained encoder_only model directory (its tokenizer is used); null: from scratch


@dataclasses.dataclass(frozen=True)
class ClassifyData:
    """A classifier's labelled examples (``data``): DailyDialog's dialogue acts or emotions, or TSV
    files."""

    dailydialog: str | None = "act"  # "act" or "emotion": DailyDialog's per-utterance labels; null: train_tsv
    dailydialog_dir: str = "dailydialog"
    context: bool = False  # DailyDialog: read the previous utterance too ([BEGIN] previous [END] utterance [END])
    train_tsv: str | None = None  # text<TAB>label lines (with dailydialog: null)
    valid_tsv: str | None = None  # its validation file (null: the last val_fraction of the training lines)
    val_fraction: float = 0.1
    train_examples: int | None = None
    valid_examples: int | None = None
    tokenizer: str | None = None
    vocab_size: int = 8000
    eval_batch_size: int = 64


def _check(recipe: Recipe, where: str) -> None:
    """The data sources of an mlm or classify recipe: DailyDialog or a file, exactly one."""
    require_steps(recipe, where)
    data, task = recipe.data, recipe.task
    own_file, own_valid = ("sentences", "valid_sentences") if task == "mlm" else ("train_tsv", "valid_tsv")
    kinds = ("text",) if task == "mlm" else ("act", "emotion")
    if data.dailydialog is not None:
        if data.dailydialog not in kinds:
            wanted = "text (its utterances)" if task == "mlm" else "act or emotion (its labels)"
            raise UserError(f"{where}: data.dailydialog must be {wanted} or null for the {task} task")
        for key in (own_file, own_valid):
            if getattr(data, key) is not None:
                raise UserError(f"{where}: data.{key} and data.dailydialog exclude each other; set one to null")
    elif getattr(data, own_file) is None:
        raise UserError(f"{where}: set data.{own_file} (a file) or data.dailydialog for the {task} task")
    if task == "classify" and data.context and data.dailydialog is None:
        raise UserError(f"{where}: data.context needs data.dailydialog (a TSV line has no previous utterance)")


def _frame(
    tokenizer: Tokenizer, texts: list[str], *, max_len: int, contexts: list[str | None] | None = None
) -> tuple[list[list[int]], int]:
    """Token ids as the encoder reads them, and how many texts were cut to fit ``max_len``.

    [BEGIN] text [END] (BERT's [CLS] text [SEP]), or with a context [BEGIN] context [END]
    text [END]: the text is cut at its end to fit, then the context at its start to fill the
    room that is left (no room: no context).
    """
    begin = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    end = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    room = max_len - len(begin) - len(end)
    if room < 1:
        raise UserError(f"model.max_len={max_len} leaves no room for text between BEGIN and END")
    text_ids = tokenizer.encode_batch(texts)
    context_ids = tokenizer.encode_batch([c or "" for c in contexts]) if contexts is not None else None
    rows, cut = [], 0
    for i, ids in enumerate(text_ids):
        if len(ids) > room:
            ids, cut = ids[:room], cut + 1
        row = begin + ids + end
        keep = max_len - len(row) - len(end)  # context tokens that fit
        if context_ids is not None and context_ids[i] and keep > 0:
            row = begin + context_ids[i][-keep:] + end + ids + end
        rows.append(row)
    return rows, cut


def _special_ids(tokenizer: Tokenizer) -> list[int]:
    ids = (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id, tokenizer.mask_id)
    return sorted({i for i in ids if i is not None})


def _masked(
    rows: list[list[int]], tokenizer: Tokenizer, *, random_ids: torch.Tensor, rate: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A masked-LM batch: corrupted ids (B, S), real-token mask (B, S), labels (B, S) (``IGNORE``
    where nothing is predicted); special tokens and padding are never selected."""
    x, valid = pad_rows(rows, tokenizer.pad_id)  # (B, S), (B, S)
    maskable = valid & ~torch.isin(x, torch.tensor(_special_ids(tokenizer)))  # (B, S)
    inputs, labels = mask_tokens(
        x, maskable=maskable, mask_id=tokenizer.mask_id, random_ids=random_ids, generator=generator, rate=rate
    )
    return inputs, valid, labels


def _mlm_sentences(data: MlmData) -> tuple[list[str], list[str], str]:
    """Training and validation sentences of an mlm recipe, and where they come from."""
    if data.dailydialog is not None:
        folder = data.dailydialog_dir
        train = [u for dialogue in read_dailydialog(folder, "train")[0] for u, _ in dialogue]
        valid = [u for dialogue in read_dailydialog(folder, "validation")[0] for u, _ in dialogue]
        source = f"DailyDialog utterances ({folder})"
    else:
        path = resolve(data.sentences)
        train = [line for line in read_lines(path) if line.strip()]
        source = str(path)
        if data.valid_sentences is not None:
            valid = [line for line in read_lines(resolve(data.valid_sentences)) if line.strip()]
        else:
            split = int(len(train) * (1 - float(data.val_fraction)))
            train, valid = train[:split], train[split:]
    train, valid = train[: data.train_examples], valid[: data.valid_examples]
    if not train or not valid:
        raise UserError(f"{source}: too few sentences for training and validation ({len(train)} and {len(valid)})")
    return train, valid, source


def prepare_mlm(recipe: Recipe, start: Start) -> Setup:
    """Masked-LM pretraining of an encoder-only model (Devlin et al., 2019): the task's parts of a run.

    Sentences (DailyDialog's utterances, or the lines of a text file) are framed as [BEGIN]
    sentence [END] and cut to the model's window; a unigram vocabulary (or the given
    tokenizer) gets a mask token. Every step takes ``batch_size`` random sentences and selects
    ``mask_rate`` of their ordinary tokens (:func:`~qkv.losses.mask_tokens`: 80% masked,
    10% random, 10% kept); the loss is the cross-entropy at the selected positions only. At
    the end: the loss and accuracy at the selected positions of the validation sentences
    (masked with a fixed seed, so the number is comparable between runs); the loss is the
    validation score too (``train.valid_every``).
    """
    last = start.checkpoint
    train, data = recipe.train, recipe.data
    seed = int(train.seed)
    torch.manual_seed(seed)
    sentences, valid, source = _mlm_sentences(data)
    tokenizer, vocabulary = tokenizer_for(data, checkpoint=last, pairs=[(s,) for s in sentences])
    tokenizer.add_mask()
    fields = {**recipe.model, "vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id}
    model = build_model("encoder_only", fields)
    window = model.config.max_len
    examples, truncated = _frame(tokenizer, sentences, max_len=window)
    valid_examples, _ = _frame(tokenizer, valid, max_len=window)
    specials = set(_special_ids(tokenizer))
    random_ids = torch.tensor([i for i in range(tokenizer.vocab_size) if i not in specials])
    rate, batch_size = float(data.mask_rate), int(train.batch_size)
    # The validation sentences are masked once, now, with their own seed (the same for every run).
    valid_generator = torch.Generator().manual_seed(seed + 1)
    size = int(data.eval_batch_size)
    valid_batches = [
        _masked(valid_examples[i : i + size], tokenizer, random_ids=random_ids, rate=rate, generator=valid_generator)
        for i in range(0, len(valid_examples), size)
    ]
    if not any((labels != IGNORE).any() for _, _, labels in valid_batches):
        raise UserError(
            f"no token of the {len(valid_examples)} validation sentence(s) was selected for masking; give more"
        )

    def step_loss(m: EncoderOnly, step: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(step_seed(seed, step))  # resumed runs draw the same
        for _ in range(100):  # redrawn in the rare case that no token of the batch was selected
            rows = torch.randint(len(examples), (batch_size,), generator=generator).tolist()
            inputs, valid_tokens, labels = _masked(
                [examples[i] for i in rows], tokenizer, random_ids=random_ids, rate=rate, generator=generator
            )
            selected = labels != IGNORE  # (B, S)
            if selected.any():
                break
        else:
            raise UserError(f"{source}: no token to mask (the sentences hold only special or unknown tokens)")
        # This worker's rows of the masked batch (all of it alone): masks drawn for the whole batch.
        mine, counted = share(len(rows))
        inputs, valid_tokens, labels, selected = inputs[mine], valid_tokens[mine], labels[mine], selected[mine]
        inputs, valid_tokens, labels, selected = on_model(m, inputs, valid_tokens, labels, selected)  # train.device
        logits = m(inputs, mask=valid_tokens, only=selected)  # (N, V)
        targets = labels[selected]  # (N,)
        if len(targets) == 0:  # this worker's rows hold no masked token: a zero loss, gradients for none
            return logits.sum() * 0.0, 0
        loss = sequence_loss(  # (1, N, V) against (1, N)
            logits[None], targets[None], ignore_id=None, label_smoothing=train.label_smoothing
        )
        return loss, len(targets) if counted else 0

    def score(m: EncoderOnly) -> dict[str, float]:  # validation (train.valid_every): the masked-LM loss
        loss, accuracy_, _ = masked_lm_scores(m, valid_batches)
        return {"loss": loss, "accuracy": accuracy_}

    def evaluate(m: EncoderOnly, out: Path, validated: dict | None) -> tuple[dict, dict]:
        began = time.perf_counter()
        valid_loss, valid_accuracy, valid_masked = masked_lm_scores(m, valid_batches)
        scores = {"valid_loss": valid_loss, "valid_accuracy": valid_accuracy, "valid_masked": valid_masked}
        return scores, {**scores, "eval_seconds": time.perf_counter() - began}

    facts = {
        "train_sentences": len(examples),
        "valid_sentences": len(valid_examples),
        "truncated": truncated,
        "source": source,
        "vocabulary": vocabulary,
    }
    return Setup(model, step_loss, tokenizer, evaluate, score=score, facts=facts, unit="masked_tok")


def train_mlm(recipe: Recipe, out: str | Path, *, progress: bool = True, resume: bool = False) -> dict:
    """Pretrain an encoder-only model by masked-LM as ``recipe`` says (:func:`prepare_mlm`); save
    it to ``out``."""
    return runner.train(MLM, recipe, out, progress=progress, resume=resume)


Labelled = tuple[str | None, str, str]  # (context or None, text, label)


def _classify_examples(data: ClassifyData) -> tuple[list[Labelled], list[Labelled], list[str], list[str], str]:
    """Training and validation examples of a classify recipe, the label names (class ids in
    order), the problems found in the data (DailyDialog lines skipped) and the source."""
    problems: list[str] = []
    if data.dailydialog is not None:
        folder, kind = data.dailydialog_dir, data.dailydialog
        splits = []
        for split in ("train", "validation"):
            dialogues, found = read_dailydialog(folder, split, labels=kind)
            problems += found
            examples: list[Labelled] = []
            for dialogue in dialogues:
                previous = None
                for text, label in dialogue:
                    examples.append((previous if data.context else None, text, str(label)))
                    previous = text
            splits.append(examples)
        train, valid = splits
        names = list(DAILYDIALOG_LABELS[kind])
        source = f"DailyDialog {kind} labels ({folder})"
    else:
        path = resolve(data.train_tsv)
        train = [(None, text, label) for text, label in read_labelled(path)]
        source = str(path)
        if data.valid_tsv is not None:
            valid_path = resolve(data.valid_tsv)
            valid = [(None, text, label) for text, label in read_labelled(valid_path)]
            names = sorted({label for _, _, label in train})
            for number, (_, _, label) in enumerate(valid, start=1):
                if label not in names:
                    raise UserError(f"{valid_path}:{number}: label {label!r} does not occur in {path}")
        else:
            split = int(len(train) * (1 - float(data.val_fraction)))
            names = sorted({label for _, _, label in train})
            train, valid = train[:split], train[split:]
    train, valid = train[: data.train_examples], valid[: data.valid_examples]
    if not train or not valid:
        raise UserError(f"{source}: too few examples for training and validation ({len(train)} and {len(valid)})")
    if len(names) < 2:
        raise UserError(f"{source}: the training examples have {len(names)} label(s); classification needs two")
    return train, valid, names, problems, source


def _load_encoder(model: EncoderOnly, pretrained: EncoderOnly, init: Path) -> None:
    """Copy a pretrained encoder's weights into ``model``, all but its masked-LM and
    classification heads (the new classifier starts fresh; a pretrained pooler is kept)."""
    state = {k: v for k, v in pretrained.state_dict().items() if not k.startswith(("mlm_", "classifier."))}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("classifier.", "pooler."))]
    if missing or unexpected:
        raise UserError(f"train.init: {init} does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")


@torch.no_grad()
def _predict(model: EncoderOnly, rows: list[list[int]], *, batch_size: int) -> list[int]:
    """The most likely class of every row of ids, in order (batched by similar length)."""
    model.eval()
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    predicted = [0] * len(rows)
    for k in range(0, len(order), batch_size):
        chunk = order[k : k + batch_size]
        x, valid = pad_rows([rows[i] for i in chunk], model.config.pad_id)  # (B, S), (B, S)
        for i, c in zip(chunk, model.classify(x, mask=valid).argmax(-1).tolist(), strict=True):
            predicted[i] = c
    return predicted


def predict_labels(
    model: EncoderOnly,
    tokenizer: Tokenizer,
    texts: list[str],
    *,
    labels: list[str],
    contexts: list[str | None] | None = None,
    batch_size: int = 64,
) -> list[str]:
    """The predicted label name of every text (``labels``: the names of the class ids, as a
    classify model directory stores them in config.json under "labels")."""
    if model.config.n_classes != len(labels):
        raise UserError(f"the model has {model.config.n_classes} classes but {len(labels)} label names")
    rows, _ = _frame(tokenizer, texts, max_len=model.config.max_len, contexts=contexts)
    return [labels[c] for c in _predict(model, rows, batch_size=batch_size)]


def prepare_classifier(recipe: Recipe, start: Start) -> Setup:
    """An encoder-only sequence classifier: the task's parts of a run.

    Examples are (text, label): DailyDialog utterances with their dialog act or emotion
    (optionally read together with the previous utterance, ``data.context``), or the lines of
    a ``text<TAB>label`` file. From scratch (a vocabulary trained on the training texts, or
    ``data.tokenizer``), or from a pretrained model (``train.init``: its encoder weights and
    its tokenizer and architecture; a different ``data.tokenizer`` is refused; a model field
    the recipe names must agree, but for ``ENCODER_HEAD_FIELDS``). Every step takes ``batch_size`` random
    examples (the reported tokens are examples). At the end: accuracy and macro-F1 on the
    validation split, beside the majority class of the training labels. The label names are
    saved in config.json ("labels"), in class-id order.
    """
    last = start.checkpoint
    train, data = recipe.train, recipe.data
    seed = int(train.seed)
    torch.manual_seed(seed)
    examples, valid, names, problems, source = _classify_examples(data)
    init = Path(train.init).expanduser() if train.init is not None else None
    start_from = model_dir(init) if init is not None else None
    texts = [(text,) for _, text, _ in examples]
    # Resumed: the unfinished run's own tokenizer (the same as a fresh run would make or take).
    tokenizer, vocabulary = tokenizer_for(data, checkpoint=last or start_from, pairs=texts)
    fields = {**recipe.model, "vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id}
    pretrained = None
    if start_from is not None:
        pretrained, _ = load_model(start_from, kind="encoder_only")
        fields = fine_tuning_fields(pretrained, recipe, start_from, may_differ=ENCODER_HEAD_FIELDS)
    model = build_model("encoder_only", {**fields, "n_classes": len(names), "mlm_head": False})
    if pretrained is not None:
        _load_encoder(model, pretrained, start_from)
    window = model.config.max_len
    contexts = [context for context, _, _ in examples] if data.context else None
    rows, truncated = _frame(tokenizer, [text for _, text, _ in examples], max_len=window, contexts=contexts)
    index = {name: i for i, name in enumerate(names)}
    targets = torch.tensor([index[label] for _, _, label in examples])  # (N,)
    batch_size = int(train.batch_size)

    def step_loss(m: EncoderOnly, step: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(step_seed(seed, step))  # resumed runs draw the same
        pick = torch.randint(len(rows), (batch_size,), generator=generator)  # (B,)
        mine, counted = share(batch_size)  # this worker's rows of the step's batch (all of it alone)
        pick = pick[mine]
        x, valid_tokens = pad_rows([rows[i] for i in pick.tolist()], model.config.pad_id)  # (B, S), (B, S)
        x, valid_tokens, wanted = on_model(m, x, valid_tokens, targets[pick])  # train.device
        logits = m.classify(x, mask=valid_tokens)  # (B, classes)
        loss = sequence_loss(  # one "token" per example: (B, 1, classes) against (B, 1)
            logits[:, None], wanted[:, None], ignore_id=None, label_smoothing=train.label_smoothing
        )
        return loss, len(pick) if counted else 0

    valid_texts = [text for _, text, _ in valid]
    valid_contexts = [context for context, _, _ in valid] if data.context else None
    gold = [label for _, _, label in valid]

    def score(m: EncoderOnly) -> dict[str, float]:  # validation (train.valid_every): accuracy
        batch = int(data.eval_batch_size)
        predicted = predict_labels(m, tokenizer, valid_texts, labels=names, contexts=valid_contexts, batch_size=batch)
        return {"accuracy": accuracy(predicted, gold), "macro_f1": macro_f1(predicted, gold)}

    def evaluate(m: EncoderOnly, out: Path, validated: dict | None) -> tuple[dict, dict]:
        began = time.perf_counter()
        batch = int(data.eval_batch_size)
        predicted = predict_labels(m, tokenizer, valid_texts, labels=names, contexts=valid_contexts, batch_size=batch)
        majority = Counter(label for _, _, label in examples).most_common(1)[0][0]
        scores = {
            "accuracy": accuracy(predicted, gold),
            "macro_f1": macro_f1(predicted, gold),
            "majority": {
                "label": majority,
                "accuracy": accuracy([majority] * len(gold), gold),
                "macro_f1": macro_f1([majority] * len(gold), gold),
            },
        }
        return scores, {**scores, "eval_seconds": time.perf_counter() - began, "predictions": predicted}

    initialized_from = str(start_from) if start_from is not None else None
    facts = {
        "labels": names,
        "train_examples": len(examples),
        "valid_examples": len(valid),
        "problems": problems,
        "truncated": truncated,
        "source": source,
        "init": initialized_from,
        "vocabulary": vocabulary,
    }
    meta = {"labels": names, "init": initialized_from}  # predict_labels reads the label names from config.json
    return Setup(
        model,
        step_loss,
        tokenizer,
        evaluate,
        score=score,
        metric="accuracy",
        higher=True,
        meta=meta,
        facts=facts,
        unit="ex",
    )


def train_classifier(recipe: Recipe, out: str | Path, *, progress: bool = True, resume: bool = False) -> dict:
    """Train an encoder-only sequence classifier as ``recipe`` says (:func:`prepare_classifier`);
    save it to ``out``."""
    return runner.train(CLASSIFY, recipe, out, progress=progress, resume=resume)


def report_mlm(summary: dict, recipe: Recipe) -> tuple[dict, str]:
    """The run's scores for the command line: masked-LM loss and accuracy on validation."""
    score = {k: round(summary[k], 4) for k in ("valid_loss", "valid_accuracy")}
    said = (
        f"validation masked-LM loss {summary['valid_loss']:.4f} nats, accuracy {summary['valid_accuracy']:.1%} "
        f"on {summary['valid_masked']} masked tokens; {summary['truncated']} training sentences cut to the window"
    )
    return score, said


def report_classify(summary: dict, recipe: Recipe) -> tuple[dict, str]:
    """The run's scores for the command line: accuracy and macro-F1 beside the majority class."""
    majority = summary["majority"]
    score = {
        "accuracy": round(summary["accuracy"], 4),
        "macro_f1": round(summary["macro_f1"], 4),
        "majority": {k: round(v, 4) if isinstance(v, float) else v for k, v in majority.items()},
        "skipped": len(summary["problems"]),
    }
    said = (
        f"validation accuracy {summary['accuracy']:.1%}, macro-F1 {summary['macro_f1']:.3f} on "
        f"{summary['valid_examples']} examples (majority class {majority['label']!r}: accuracy "
        f"{majority['accuracy']:.1%}, macro-F1 {majority['macro_f1']:.3f})"
    )
    return score, said


_RULES: dict = {
    ("data", "dailydialog"): (
        (str, type(None)),
        lambda v: v is None or v in ("text", "act", "emotion"),
        "text (utterances, for mlm), act or emotion (labels, for classify), or null",
    ),
    ("data", "dailydialog_dir"): (str, lambda v: bool(v), "a DailyDialog folder"),
    ("data", "sentences"): ((str, type(None)), lambda v: v is None or bool(v), "a text file or null"),
    ("data", "valid_sentences"): ((str, type(None)), lambda v: v is None or bool(v), "a text file or null"),
    ("data", "train_tsv"): ((str, type(None)), lambda v: v is None or bool(v), "a text<TAB>label file or null"),
    ("data", "valid_tsv"): ((str, type(None)), lambda v: v is None or bool(v), "a text<TAB>label file or null"),
    ("data", "train_examples"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
    ("data", "valid_examples"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
    ("data", "mask_rate"): ((int, float), lambda v: 0 < v < 1, "a number in (0, 1)"),
    ("data", "context"): (bool, lambda v: True, "true or false"),
}


MLM = Task(
    name="mlm",
    model=MLM_MODEL,
    train=MlmTrain,
    data=MlmData,
    model_kind="encoder_only",
    prepare=prepare_mlm,
    report=report_mlm,
    rules=_RULES,
    check=_check,
    rate_unit="masked_tokens",
    loss_name="cross-entropy (nats/masked token)",
)


CLASSIFY = Task(
    name="classify",
    model=CLASSIFY_MODEL,
    train=ClassifyTrain,
    data=ClassifyData,
    model_kind="encoder_only",
    prepare=prepare_classifier,
    report=report_classify,
    rules=_RULES,
    check=_check,
    tuning_fields=ENCODER_HEAD_FIELDS,
    rate_unit="examples",
    loss_name="cross-entropy (nats/example)",
)
