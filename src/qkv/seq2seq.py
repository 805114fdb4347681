"""Encoder-decoder task runners and batch decoding: the numbers demo and translation.

What is here: :func:`train_numbers` (the built-in numbers task end to end: data, tokenizer,
model, training, held-out exact match, model directory), :func:`train_translation` (parallel
text, subword vocabularies: joint or separate, token-budget batches, epochs with validation
loss and BLEU, a resumable run directory, best/last/averaged checkpoints, early stopping),
:func:`translate` and :func:`beam_translate` (token-budget batches of sentences, greedy or
beam, a max length relative to each source), :func:`alignments` and :func:`cross_attention`
(from cross-attention weights). What takes the model's tokenizers takes one tokenizer (a
joint vocabulary) or :class:`~qkv.tokenization.Vocabularies`, and encodes sources with the
source tokenizer, targets and outputs with the target one.

What is not here: recipe loading and the shared runner pieces (``recipes.py``), the decoding
algorithms (``generation.py``), run directories (``runs.py``).
"""

from __future__ import annotations

import functools
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from qkv import __version__
from qkv.checkpoint import (
    RUN_FILE,
    build_model,
    check_output,
    load_model,
    model_dir,
    sha256_file,
)
from qkv.data import (
    batches_by_tokens,
    read_parallel,
    resolve,
)
from qkv.errors import UserError
from qkv.evaluation import (
    corpus_scores,
    exact_match,
)
from qkv.generation import Ensemble, beam_search
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.recipes import (
    DEFAULTS,
    ENCODER_DECODER_TUNING_FIELDS,
    fine_tuning_fields,
    fit_recipe,
    fit_summary,
    save_model_dir,
    seq2seq_model,
    vocabularies_for,
)
from qkv.runs import (
    Scalars,
    average_checkpoints,
    check_run_output,
    load_checkpoint,
    read_run,
    save_checkpoint,
    write_json,
)
from qkv.tasks import numbers_pairs
from qkv.tokenization import SegmentationSampler, Tokenizer, Vocabularies
from qkv.training import (
    FitResult,
    Trainer,
    seq2seq_batch,
    seq2seq_loss,
)


def cross_attention(model: EncoderDecoder, *, src: list[int], out: list[int]) -> torch.Tensor:
    """Cross-attention weights of the last decoder layer while it produces ``out`` + END.

    Row t is the step that reads BEGIN + out[:t] and produces (out + [END])[t].

    Shapes: returns (H, T, S) with T = len(out) + 1 and S = len(src).
    """
    c = model.config
    source = torch.tensor([src])  # (1, S)
    target = torch.tensor([[c.bos_id, *out]])  # (1, T)
    with torch.no_grad():
        memory = model.encode(source)  # (1, S, D)
        attention = model.decode(target, memory, src_mask=source != c.pad_id, need_weights=True).attention
    return attention[-1][0]  # (H, T, S)


def evaluate_numbers(
    model: EncoderDecoder, tokenizer: Tokenizer | Vocabularies, *, pairs: list[tuple[str, str]], beam_size: int
) -> tuple[float, list[str]]:
    """Exact match of beam-search outputs on (digits, words) pairs; returns it and the outputs."""
    outputs = beam_translate(model, tokenizer, [a for a, _ in pairs], beam_size=beam_size, max_len_a=2.0)
    return exact_match(outputs, [b for _, b in pairs]), outputs


class Translation(NamedTuple):
    """One scored output of :func:`translate`: detokenized text, token ids, beam score."""

    text: str
    tokens: list[int]
    score: float


def translate(
    model: EncoderDecoder | Ensemble,
    tokenizers: Tokenizer | Vocabularies,
    texts: list[str],
    *,
    beam_size: int,
    nbest: int = 1,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
    max_tokens: int = 8192,
) -> list[list[Translation]]:
    """The ``nbest`` best outputs of every text, in input order.

    Texts are decoded in batches of similar length holding at most ``max_tokens`` source
    tokens times the beam width. A source longer than the model's window is cut to it; an
    output may have at most ⌊a·S⌋ + b tokens, S its own source's length (the max-length rule
    of fairseq's ``--max-len-a/-b``). An empty (or all-blank) text gives empty outputs. Texts are
    encoded with the source tokenizer, outputs decoded with the target one.
    """
    vocab = Vocabularies.of(tokenizers)
    sources = source_ids(vocab.source, texts, window=model.config.max_len)
    found: list[list[Translation]] = [[Translation("", [], 0.0)] * nbest for _ in texts]
    todo = sorted((i for i in range(len(texts)) if texts[i].strip() and sources[i]), key=lambda i: len(sources[i]))
    budget = max(1, max_tokens // beam_size)
    k = 0
    while k < len(todo):
        end = k + 1  # sorted by length: the chunk's last source is its longest
        while end < len(todo) and len(sources[todo[end]]) * (end - k + 1) <= budget:
            end += 1
        chunk, k = todo[k:end], end
        hypotheses = beam_search(
            model,
            [sources[i] for i in chunk],
            beam_size=beam_size,
            nbest=nbest,
            length_penalty=length_penalty,
            max_new_tokens=[int(max_len_a * len(sources[i])) + max_len_b for i in chunk],
        )
        for i, hyps in zip(chunk, hypotheses, strict=True):
            found[i] = [Translation(vocab.target.decode(h.tokens), h.tokens, h.score) for h in hyps]
            # Always nbest outputs, so they can be matched to inputs by counting.
            found[i] += [Translation("", [], float("-inf"))] * (nbest - len(found[i]))
    return found


def source_ids(tokenizer: Tokenizer, texts: list[str], *, window: int) -> list[list[int]]:
    """Encoder ids of each text, cut to the window. A tokenizer that ends sources with END
    (a converted Marian one) keeps it when the text is cut: the model only saw sources ending so."""
    return [cut_source(tokenizer, ids, window=window) for ids in tokenizer.encode_batch(texts)]


def cut_source(tokenizer: Tokenizer, ids: list[int], *, window: int) -> list[int]:
    """``ids`` cut to the window, keeping a final END the tokenizer added (see :func:`source_ids`)."""
    if len(ids) <= window:
        return ids
    if tokenizer.add_special_tokens and tokenizer.eos_id is not None and ids[-1] == tokenizer.eos_id:
        return [*ids[: window - 1], tokenizer.eos_id]
    return ids[:window]


def beam_translate(
    model: EncoderDecoder | Ensemble,
    tokenizers: Tokenizer | Vocabularies,
    texts: list[str],
    *,
    beam_size: int,
    length_penalty: float = 1.0,
    max_len_a: float = 1.5,
    max_len_b: int = 10,
) -> list[str]:
    """The best output of every text, in order (:func:`translate`)."""
    found = translate(
        model,
        tokenizers,
        texts,
        beam_size=beam_size,
        length_penalty=length_penalty,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
    )
    return [hyps[0].text for hyps in found]


@torch.no_grad()
def alignments(model: EncoderDecoder, *, src: list[list[int]], out: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Hard alignments from cross-attention: each output token (END excluded) paired with the
    source token its last decoder layer attends to most, averaged over heads (as fairseq's
    ``--print-alignment`` does with its alignment layer). Pairs are (source index, output index).
    """
    found: list[list[tuple[int, int]]] = []
    for s, o in zip(src, out, strict=True):
        if not s or not o:
            found.append([])
            continue
        weights = cross_attention(model, src=s, out=o)  # (H, T, S)
        best = weights.mean(0)[: len(o)].argmax(-1).tolist()  # (T,): END's row dropped
        found.append([(j, t) for t, j in enumerate(best)])
    return found


def train_numbers(recipe: dict, out: str | Path, *, progress: bool = True) -> dict:
    """Train the numbers task as ``recipe`` says; save the model directory to ``out``.

    Returns a summary: exact match on held-out numbers, timings, and what is needed to
    show examples (model, tokenizer, held-out pairs, outputs, losses).
    """
    check_output(out)
    train, data = recipe["train"], recipe["data"]
    seed = int(train["seed"])
    torch.manual_seed(seed)
    # The vocabulary is closed (digits, a comma, 31 words), so a modest sample covers it.
    tokenizer = Tokenizer.train_word_level(s for pair in numbers_pairs(20_000, seed=seed, held_out=False) for s in pair)
    model = seq2seq_model(recipe, tokenizer)
    batch_size = int(train["batch_size"])

    def step_loss(m: EncoderDecoder, step: int) -> tuple[torch.Tensor, int]:
        # Fresh examples every step (never a held-out number), fixed by (seed, step).
        pairs = numbers_pairs(batch_size, seed=seed * 1_000_003 + step, held_out=False)
        src = tokenizer.encode_batch([a for a, _ in pairs])
        tgt = tokenizer.encode_batch([b for _, b in pairs])
        s, t_in, t_out = seq2seq_batch(
            list(zip(src, tgt, strict=True)), pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        )
        return seq2seq_loss(m, s, t_in, t_out, pad_id=tokenizer.pad_id, label_smoothing=train["label_smoothing"])

    result = fit_recipe(model, step_loss, train, progress=progress, desc="qkv numbers")
    held_out = numbers_pairs(int(data["eval_examples"]), seed=seed + 1, held_out=True)
    start = time.perf_counter()
    score, outputs = evaluate_numbers(model, tokenizer, pairs=held_out, beam_size=int(data["beam_size"]))
    eval_seconds = time.perf_counter() - start
    save_model_dir(model, tokenizer, out, extra={"task": "numbers", "recipe": recipe, "exact_match": score})
    return {
        "exact_match": score,
        "eval_seconds": eval_seconds,
        **fit_summary(result, model, tokenizer),
        "held_out": held_out,
        "outputs": outputs,
    }


# Train settings that may change when a run is resumed; any other change would make the
# continued run differ from an uninterrupted one, so it is refused.
RESUME_MAY_CHANGE = ("epochs", "steps", "seconds", "patience", "average_last", "save_every", "tensorboard")
TOKENIZER_KEYS = (("data", "tokenizer"), ("data", "target_tokenizer"))  # may be named on resume, SHA-256 checked


def _check_same_data(saved: dict | None, now: dict[str, str], run: Path) -> None:
    """Refuse to resume ``run`` when a data file's SHA-256 differs from the one it began with
    (runs from before the hashes were recorded are not checked)."""
    changed = [path for path, digest in now.items() if saved is not None and saved.get(path, digest) != digest]
    if changed:
        raise UserError(
            f"--resume: {', '.join(map(str, (resolve(p) for p in changed)))} changed since {run} began "
            "(SHA-256 differs): the saved position in the data order would point elsewhere; start a new run"
        )


def _resumed_recipe(recipe: dict, saved: dict, run: Path) -> dict:
    """The run's own recipe with only the RESUME_MAY_CHANGE train keys taken from ``recipe``."""
    # Keys added to recipes after the run began take their defaults, which do what the run did
    # (data.vocab: joint), so an older run resumes.
    saved = {
        **saved,
        **{
            k: {**v, **saved.get(k, {})}
            for k, v in DEFAULTS["translation"].items()
            # a fine-tuned run's model section holds only what its recipe named (load_recipe)
            if isinstance(v, dict) and not (k == "model" and saved.get("train", {}).get("init"))
        },
    }
    differ = []
    for section, value in recipe.items():
        if not isinstance(value, dict):
            if value != saved.get(section):
                differ.append(section)
            continue
        for key, v in value.items():
            # A tokenizer file may be named: it is checked against the checkpoint's (SHA-256).
            may_change = (section == "train" and key in RESUME_MAY_CHANGE) or (section, key) in TOKENIZER_KEYS
            if not may_change and v != saved.get(section, {}).get(key):
                differ.append(f"{section}.{key}")
    if differ:
        raise UserError(
            f"--resume: the recipe differs from the one {run} was trained with in {', '.join(differ)}; "
            f"only train.{', train.'.join(RESUME_MAY_CHANGE)} may change"
        )
    return {
        **saved,
        "train": {**saved["train"], **{k: recipe["train"][k] for k in RESUME_MAY_CHANGE}},
        "data": {**saved["data"], **{k: recipe["data"][k] or saved["data"][k] for _, k in TOKENIZER_KEYS}},
    }


@torch.no_grad()
def teacher_forced_loss(
    model: EncoderDecoder, tokenizer: Tokenizer, examples: list[tuple[list[int], list[int]]], *, max_tokens: int
) -> float:
    """Mean cross-entropy per target token (END included, no label smoothing) of ``examples``
    (token ids, targets in the vocabulary of ``tokenizer``: the target tokenizer)."""
    model.eval()
    lengths = [max(len(s), len(t) + 1) for s, t in examples]
    total, count = 0.0, 0
    for rows in batches_by_tokens(lengths, max_tokens=max_tokens, seed=0):
        s, t_in, t_out = seq2seq_batch(
            [examples[i] for i in rows], pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        )
        loss, n = seq2seq_loss(model, s, t_in, t_out, pad_id=tokenizer.pad_id)
        total += loss.item() * n
        count += n
    return total / max(count, 1)


def _encode_pairs(
    tokenizers: Tokenizer | Vocabularies, pairs: list[tuple[str, str]], *, window: int, long: str
) -> tuple[list[tuple[list[int], list[int]]], list[int], list[int]]:
    """Token ids of the pairs (sources by the source tokenizer, targets by the target one),
    over-long ones (a source over the window, a target over the window less BEGIN) dropped or
    truncated (``long``); the indices of the over-long pairs; and the index of the pair each
    example is (all of them unless some were dropped)."""
    vocab = Vocabularies.of(tokenizers)
    sources = vocab.source.encode_batch([a for a, _ in pairs])
    targets = vocab.target.encode_batch([b for _, b in pairs], add_special_tokens=False)  # END comes from the batch
    examples, over_long, rows = [], [], []
    for i, (s, t) in enumerate(zip(sources, targets, strict=True)):
        if len(s) > window or len(t) > window - 1:
            over_long.append(i)
            if long == "drop":
                continue
            s, t = s[:window], t[: window - 1]
        examples.append((s, t))
        rows.append(i)
    return examples, over_long, rows


def _epoch_examples(
    tokenizers: Tokenizer | Vocabularies,
    kept: list[tuple[str, str]],
    examples: list[tuple[list[int], list[int]]],
    *,
    nbest: int,
    alpha: float,
    window: int,
    seed: int,
) -> Callable[[int], list[tuple[list[int], list[int]]]]:
    """The training examples of each epoch: ``examples`` (the best segmentation of each pair
    of ``kept``, from :func:`_encode_pairs`) every time, or, with ``nbest`` > 0
    (``data.subword_nbest``), a new segmentation of both sides each epoch drawn by
    :class:`~qkv.tokenization.SegmentationSampler` (seeded with seed and epoch: a resumed run
    sees the same pieces). The same pairs in the same places either way; a draw longer than
    the window falls back to that pair's best segmentation. The last epoch's draw is kept
    (the schedule's length is counted on epoch 0's, which the first epoch then reuses)."""
    if not nbest:
        return lambda epoch: examples
    vocab = Vocabularies.of(tokenizers)
    samplers = []
    for side, tokenizer, texts in (
        ("source", vocab.source, [a for a, _ in kept]),
        ("target", vocab.target, [b for _, b in kept]),
    ):
        try:
            samplers.append(SegmentationSampler(tokenizer, texts, nbest=nbest, alpha=alpha))
        except UserError as e:
            raise UserError(f"data.subword_nbest: the {side} tokenizer: {e}") from None
    sources, targets = samplers
    key = seed % 2**64  # numpy seeds are non-negative; train.seed may be any integer

    @functools.lru_cache(maxsize=1)
    def drawn(epoch: int) -> list[tuple[list[int], list[int]]]:
        src, tgt = sources.sample([key, epoch, 0]), targets.sample([key, epoch, 1])
        return [
            (s, t) if len(s) <= window and len(t) <= window - 1 else best
            for s, t, best in zip(src, tgt, examples, strict=True)
        ]

    return drawn


def over_long_note(over_long: list[int], *, files: list[str], total: int, window: int, action: str) -> str:
    """One line naming the over-long pairs by line number (pair i is line i + 1 of its files:
    :func:`~qkv.data.read_parallel` keeps every line), the first ten of them."""
    lines = ", ".join(str(i + 1) for i in over_long[:10]) + (", ..." if len(over_long) > 10 else "")
    return (
        f"{' + '.join(files)}: {len(over_long)} of {total} pairs are longer than the model's window "
        f"({window} tokens) and were {action}: line{'s' if len(over_long) > 1 else ''} {lines}"
    )


def _checkpoint_model(checkpoint: Path, recipe: dict, *, use: str) -> EncoderDecoder:
    """A model with ``checkpoint``'s architecture and weights, but for the recipe's
    ENCODER_DECODER_TUNING_FIELDS (:func:`~qkv.recipes.fine_tuning_fields`); ``use``
    (train.init or --resume) begins its errors."""
    pretrained, _ = load_model(checkpoint, kind="encoder_decoder")
    fields = fine_tuning_fields(pretrained, recipe, checkpoint, may_differ=ENCODER_DECODER_TUNING_FIELDS, use=use)
    model = build_model("encoder_decoder", fields)
    try:
        missing, unexpected = model.load_state_dict(pretrained.state_dict(), strict=False)
    except RuntimeError as e:  # a shape mismatch
        raise UserError(f"{use}: {checkpoint} does not fit its own config: {str(e).splitlines()[0]}") from None
    if missing or unexpected:
        raise UserError(f"{use}: {checkpoint} does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def train_translation(recipe: dict, out: str | Path, *, progress: bool = True, resume: bool = False) -> dict:
    """Train an encoder-decoder on parallel text as ``recipe`` says, in the run directory ``out``.

    The vocabulary (``data.vocab``) is a joint unigram model trained on both sides of the
    training pairs, or two separate ones, the source's trained on the sources and the target's
    on the targets (or given tokenizers, or the checkpoint's:
    :func:`~qkv.recipes.vocabularies_for`). Pairs longer than the model's window are dropped
    or truncated (``data.long``) and counted. Batches hold at most ``train.max_tokens``
    padded tokens, length-bucketed and reshuffled every epoch (seed + epoch), so the data
    order is a function of the seed and a position (epoch, batch) is enough to resume. With
    ``data.subword_nbest`` each epoch trains on its own draw of segmentations
    (:func:`_epoch_examples`), also a function of the seed and epoch.
    After every epoch: validation loss and BLEU (``data.valid_beam``), TensorBoard scalars,
    ``best``/``last``/``epoch-NNN`` checkpoints, early stopping (``train.patience``). At the
    end: the last N epoch checkpoints averaged (``train.average_last``) and the final model,
    the better on validation BLEU with ``data.beam_size`` of best and averaged, is named in
    ``run.json``. ``resume`` continues from ``last`` exactly as if never stopped; a run that had
    stopped (by a cap or patience the resumed recipe keeps) goes straight to choosing the final
    model. ``train.init`` fine-tunes a model directory: its tokenizers, its architecture (the
    fields the recipe's model section names must agree, but for ``ENCODER_DECODER_TUNING_FIELDS``)
    and weights.
    """
    run = Path(out)
    check_run_output(run, resume=resume)
    if resume:
        recipe = _resumed_recipe(recipe, read_run(run)["recipe"], run)
    train, data = recipe["train"], recipe["data"]
    # The position in the data order that resume restores means nothing if the files changed.
    data_sha256 = {str(path): sha256_file(resolve(path)) for path in dict.fromkeys([*data["train"], *data["valid"]])}
    if resume:
        _check_same_data(read_run(run).get("data_sha256"), data_sha256, run)
    seed = int(train["seed"])
    torch.manual_seed(seed)
    if train["deterministic"]:
        torch.use_deterministic_algorithms(True)
    pairs = read_parallel(*data["train"])[: data["train_pairs"]]
    valid = read_parallel(*data["valid"])[: data["valid_pairs"]]
    if data["reverse"]:
        pairs, valid = [(b, a) for a, b in pairs], [(b, a) for a, b in valid]
    init = Path(train["init"]).expanduser() if train["init"] is not None else None
    start_from = run / "last" if resume else (model_dir(init) if init is not None else None)
    vocab, vocabulary = vocabularies_for(data, checkpoint=start_from, pairs=pairs)
    target = vocab.target  # its special ids are the model's (and the source tokenizer's)
    # Fine-tuning, and resuming (a fine-tuned run too), take the checkpoint's architecture, not
    # the recipe's model section over the config defaults.
    if start_from is None:
        model = seq2seq_model(recipe, vocab)
    else:
        model = _checkpoint_model(start_from, recipe, use="--resume" if resume else "train.init")
    window = model.config.max_len
    examples, over_long, rows = _encode_pairs(vocab, pairs, window=window, long=data["long"])
    if not examples:
        raise UserError("no training pair fits the model's window (model.max_len)")
    valid_examples, valid_over_long, _ = _encode_pairs(vocab, valid, window=window, long="truncate")
    # Said on stderr before training, as well as counted in the summary and run.json: a user
    # who did not expect over-long lines learns which ones at once.
    actions = {"drop": "dropped (data.long: drop)", "truncate": "truncated (data.long: truncate)"}
    for ids, files, total, action in (
        (over_long, data["train"], len(pairs), actions[data["long"]]),
        (valid_over_long, data["valid"], len(valid), "truncated for validation loss"),
    ):
        if ids:
            note = over_long_note(ids, files=list(files), total=total, window=window, action=action)
            print(f"qkv train: note: {note}", file=sys.stderr)
    epoch_examples = _epoch_examples(
        vocab,
        [pairs[i] for i in rows],
        examples,
        nbest=int(data["subword_nbest"]),
        alpha=float(data["subword_alpha"]),
        window=window,
        seed=seed,
    )
    max_tokens, accumulate = int(train["max_tokens"]), int(train["accumulate"])
    # Optimizer steps per epoch: fixed with one segmentation per pair; with subword sampling the
    # first epoch's count stands for all (for the progress bar and a schedule's length: an
    # epoch of sampled pieces holds a few batches more or fewer). Epochs, not this, end a run.
    lengths = [max(len(s), len(t) + 1) for s, t in epoch_examples(0)]
    steps_per_epoch = math.ceil(len(batches_by_tokens(lengths, max_tokens=max_tokens, seed=seed)) / accumulate)
    step_cap = int(train["steps"]) if train["steps"] is not None else None
    total_steps = int(train["epochs"]) * steps_per_epoch
    if step_cap is not None:
        total_steps = min(total_steps, step_cap)
    trainer = Trainer(
        model,
        lr=float(train["lr"]),
        warmup=int(train["warmup"]),
        total_steps=total_steps,
        schedule=train["schedule"],
        min_lr=float(train["min_lr"]),
        weight_decay=float(train["weight_decay"]),
        clip=float(train["clip"]),
        betas=(0.9, float(train["beta2"])),
        bf16=train["bf16"],
    )
    state = {
        "epoch": 0,
        "batch": 0,
        "tokens": 0,
        "seconds": 0.0,
        "history": [],
        "losses": [],
        "best": None,
        "bad": 0,
        "stopped_by": None,
    }
    if resume:
        state = load_checkpoint(run / "last", trainer)
    run.mkdir(parents=True, exist_ok=True)
    scalars = Scalars(run / "tensorboard" if train["tensorboard"] else None)
    with tempfile.TemporaryDirectory() as tmp:
        # target_tokenizer.json with separate vocabularies; special_tokens.json too, when there
        # is one (a fine-tuned imported model's tokens)
        tokenizer_files = vocab.save(tmp)
        extra = {"task": "translation", "recipe": recipe}

        def save(name: str, *, resumable: bool = False, scores: dict | None = None) -> None:
            save_checkpoint(
                model,
                run / name,
                files=tokenizer_files,
                extra={**extra, **({"valid_scores": scores} if scores else {})},
                trainer=trainer if resumable else None,
                progress=state if resumable else None,
            )

        def record(final: str) -> None:
            over = {"train": len(over_long), "valid": len(valid_over_long)}
            write_json(
                run / RUN_FILE,
                {
                    "qkv_version": __version__,
                    "recipe": recipe,
                    "final": final,
                    "data_sha256": data_sha256,
                    "over_long_pairs": over,
                    **state,
                },
            )

        def validate(beam: int) -> dict:
            start = time.perf_counter()
            model.eval()  # no dropout: a run stopped mid-epoch (steps, seconds) ends in training mode
            hypotheses = beam_translate(
                model,
                vocab,
                [a for a, _ in valid],
                beam_size=beam,
                length_penalty=float(data["length_penalty"]),
                max_len_a=float(data["max_len_a"]),
                max_len_b=int(data["max_len_b"]),
            )
            scores = corpus_scores(
                hypotheses, [b for _, b in valid], tokenize=data["bleu_tokenize"], lowercase=data["lowercase"]
            )
            return {**scores, "seconds": round(time.perf_counter() - start, 1), "hypotheses": hypotheses}

        if not resume:
            save("last", resumable=True)
            record("last")

        def batch_loss(batch: list[int]) -> tuple[torch.Tensor, int]:  # this epoch's examples
            s, t_in, t_out = seq2seq_batch(
                [epoch_data[i] for i in batch], pad_id=target.pad_id, bos_id=target.bos_id, eos_id=target.eos_id
            )
            smoothing, rdrop = train["label_smoothing"], train["rdrop"]
            return seq2seq_loss(model, s, t_in, t_out, pad_id=target.pad_id, label_smoothing=smoothing, rdrop=rdrop)

        bar = tqdm(
            total=total_steps,
            initial=trainer.steps,
            desc="qkv translation",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )
        seconds_cap = train["seconds"]

        def stopped() -> str | None:
            # Checked before every step and epoch, not only after: a resumed run that had already
            # stopped (its last/ saved, then killed while the final models were compared, or run
            # again) must go straight to the end, not train one more step or epoch. A cap raised
            # on --resume (RESUME_MAY_CHANGE) lets it continue.
            if train["patience"] is not None and state["bad"] >= int(train["patience"]):
                return "patience"
            if state["epoch"] >= int(train["epochs"]):
                return "epochs"
            if step_cap is not None and trainer.steps >= step_cap:
                return "steps"
            if seconds_cap is not None and state["seconds"] >= seconds_cap:
                return "seconds"
            return None

        stop = None
        session_start, session_tokens = time.perf_counter(), 0
        while stop is None:
            stop = stopped()
            if stop is not None:
                break
            tick = time.perf_counter()  # an epoch's draw of segmentations is training time
            epoch_data = epoch_examples(state["epoch"])
            lengths = [max(len(s), len(t) + 1) for s, t in epoch_data]
            order = batches_by_tokens(lengths, max_tokens=max_tokens, seed=seed + state["epoch"])
            while state["batch"] < len(order):
                stop = stopped()
                if stop is not None:
                    break
                group = order[state["batch"] : state["batch"] + accumulate]
                loss, n_tokens = trainer.step([lambda batch=batch: batch_loss(batch) for batch in group])
                now = time.perf_counter()
                state["seconds"] += now - tick
                tick = now
                state["batch"] += len(group)
                state["tokens"] += n_tokens
                session_tokens += n_tokens
                state["losses"].append(round(loss, 4))
                bar.update(1)
                if trainer.steps % 10 == 0:
                    rate = session_tokens / max(now - session_start, 1e-9)
                    bar.set_postfix(
                        epoch=state["epoch"] + 1, loss=f"{loss:.3f}", lr=f"{trainer.lr:.2e}", tok_s=f"{rate:.0f}"
                    )
                    scalars.add("train/loss", loss, trainer.steps)
                    scalars.add("train/lr", trainer.lr, trainer.steps)
                    scalars.add("train/tokens_per_second", rate, trainer.steps)
                if (
                    train["save_every"]
                    and trainer.steps % int(train["save_every"]) == 0
                    and state["batch"] < len(order)
                ):
                    save("last", resumable=True)
            if state["batch"] >= len(order):  # the epoch is complete: validate, keep checkpoints
                scores = validate(int(data["valid_beam"]))
                valid_loss = teacher_forced_loss(model, target, valid_examples, max_tokens=max_tokens)
                state["epoch"] += 1
                state["batch"] = 0
                entry = {
                    "epoch": state["epoch"],
                    "step": trainer.steps,
                    "train_seconds": round(state["seconds"], 1),
                    "valid_loss": round(valid_loss, 4),
                    "valid_bleu": scores["bleu"],
                    "valid_chrf": scores["chrf"],
                }
                state["history"].append(entry)
                scalars.add("valid/loss", valid_loss, trainer.steps)
                scalars.add("valid/bleu", scores["bleu"], trainer.steps)
                scalars.add("valid/chrf", scores["chrf"], trainer.steps)
                if progress:
                    tqdm.write(
                        f"epoch {entry['epoch']}: step {entry['step']}, valid loss {valid_loss:.4f}, "
                        f"BLEU {scores['bleu']} (beam {data['valid_beam']}, {scores['seconds']}s)"
                    )
                if state["best"] is None or scores["bleu"] > state["best"]["valid_bleu"]:
                    state["best"], state["bad"] = entry, 0
                    save("best")
                else:
                    state["bad"] += 1
                keep = int(train["average_last"])
                if keep:
                    save(f"epoch-{state['epoch']:03d}")
                    for old in sorted(run.glob("epoch-[0-9][0-9][0-9]"))[:-keep]:
                        shutil.rmtree(old)
            stop = stopped()
            state["stopped_by"] = stop  # in last/ and run.json while the final models are compared
            save("last", resumable=True)
            record("last")
        state["stopped_by"] = stop  # a resumed run that stopped at once: this session's verdict
        bar.close()
        scalars.close()

        # The final model: best and (if asked) averaged, compared on validation BLEU at the final beam.
        candidates = {}
        if (run / "best").is_dir():
            best_model, _ = load_model(run / "best")
            model.load_state_dict(best_model.state_dict())
            candidates["best"] = validate(int(data["beam_size"]))
        epochs = sorted(run.glob("epoch-[0-9][0-9][0-9]"))
        if len(epochs) > 1:
            average_checkpoints(epochs, model)
            candidates["averaged"] = validate(int(data["beam_size"]))
            save("averaged", scores={k: v for k, v in candidates["averaged"].items() if k != "hypotheses"})
        if not candidates:  # stopped before the first epoch ended
            last_model, _ = load_model(run / "last")
            model.load_state_dict(last_model.state_dict())
            candidates["last"] = validate(int(data["beam_size"]))
        final = max(candidates, key=lambda name: candidates[name]["bleu"])
        if final != "averaged":
            final_model, _ = load_model(run / final)
            model.load_state_dict(final_model.state_dict())
        scores = candidates[final]
        model.eval()  # the returned model is for inference (bench/mt.py translates the test set with it)
        state["final_scores"] = {
            name: {k: v for k, v in c.items() if k != "hypotheses"} for name, c in candidates.items()
        }
        record(final)
    result = FitResult(steps=trainer.steps, seconds=state["seconds"], losses=state["losses"], tokens=state["tokens"])
    return {
        "bleu": scores["bleu"],
        "chrf": scores["chrf"],
        "bleu_signature": scores["bleu_signature"],
        "final": final,
        "epochs": state["epoch"],
        "stopped_by": stop,
        "history": state["history"],
        "vocabulary": vocabulary,
        "over_long_pairs": {"train": len(over_long), "valid": len(valid_over_long)},  # as in run.json
        "eval_seconds": scores["seconds"],
        **fit_summary(result, model, vocab),  # "tokenizer": the Vocabularies
        "hypotheses": scores["hypotheses"],
    }
