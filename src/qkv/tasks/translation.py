"""The translation task: recipe defaults and rules, and its parts of a run.

What is here: :data:`TASK`, :func:`prepare_translation` (parallel text, subword vocabularies:
joint or separate (:func:`vocabularies_for`), token-budget batches in epochs, subword
regularization, validation loss and BLEU) and :func:`train_translation`,
:func:`teacher_forced_loss`, :func:`over_long_note`.

What is not here: the loop, its validation, the run directory with its best/last/averaged
checkpoints and early stopping (``runner.py``, ``training.py``, ``runs.py``: every task's),
translating text with a trained model (``seq2seq.py``), recipe loading (``recipes.py``), the
decoding algorithms (``decoding/``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from qkv import recipes, runner
from qkv.checkpoint import build_model, load_model, model_dir, read_meta, sha256_file
from qkv.data import batches_by_tokens, read_parallel, resolve
from qkv.distributed import sharded_map, share
from qkv.errors import UserError
from qkv.evaluation import BLEU_TOKENIZERS, corpus_scores, normalize_transcript
from qkv.losses import seq2seq_batch, seq2seq_loss
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.recipes import (
    Recipe,
    Setup,
    Start,
    Task,
    TrainConfig,
    find_tokenizer,
    fine_tuning_fields,
    seq2seq_model,
    tokenizer_for,
)
from qkv.runs import read_run
from qkv.seq2seq import beam_translate
from qkv.tokenization import FILE as TOKENIZER_FILE
from qkv.tokenization import MAX_NBEST, TARGET_FILE, SegmentationSampler, Tokenizer, Vocabularies
from qkv.training import Epochs

# Translation from parallel text (two aligned files or one TSV per split); a 3+3-layer,
# width-256 Transformer with a joint unigram vocabulary and shared embeddings by default.
# Trains in epochs with validation after each, in a run directory (``runs.py``) that can be
# resumed.
TRANSLATION_MODEL: dict = {
    "d_model": 256,
    "n_heads": 4,
    "d_ff": 1024,
    "n_encoder_layers": 3,
    "n_decoder_layers": 3,
    "share_embeddings": True,
    "tie_output": True,
    "dropout": 0.1,
    "max_len": 256,
}


@dataclasses.dataclass(frozen=True)
class TranslationTrain(TrainConfig):
    """Translation's training (``train``): the shared settings with its defaults, in epochs of
    batches of up to ``max_tokens`` padded tokens, R-Drop, fine-tuning from ``init``."""

    epochs: int = 20
    max_tokens: int = 4096  # padded source or target tokens per batch
    warmup: int = 1000
    schedule: str = "inverse_sqrt"
    label_smoothing: float = 0.1
    rdrop: float = 0.0  # R-Drop's alpha (Liang et al., 2021): 0 off; > 0 runs each batch twice
    save_every: int = 0  # optimizer steps between mid-epoch checkpoints of last/ (0: validations only)
    # validation loss and BLEU: at every epoch's end, or every N steps (null: none)
    valid_every: int | str | None = "epoch"
    # a qkv model directory to start from (fine-tuning): its tokenizer and architecture are
    # used; the fields the model section names must agree with it, but for
    # ENCODER_DECODER_TUNING_FIELDS (unnamed ones are the pretrained model's)
    init: str | None = None
    tensorboard: bool = True
    deterministic: bool = False  # torch.use_deterministic_algorithms (exact resumption is tested with it)


@dataclasses.dataclass(frozen=True)
class TranslationData:
    """Translation's parallel text and vocabularies (``data``)."""

    # one TSV file of pairs, or two aligned files (source, target)
    train: Sequence[str] = ("multi30k/train.de", "multi30k/train.en")
    valid: Sequence[str] = ("multi30k/val.de", "multi30k/val.en")
    reverse: bool = False  # swap the sides: translate the second file/column into the first
    source_as_transcript: bool = False  # sources as a speech recognizer writes them (a cascade's MT)
    train_pairs: int | None = None  # use only the first N training pairs
    valid_pairs: int | None = None  # validate on the first N validation pairs
    # "joint": one vocabulary trained on both sides; "separate": a source vocabulary trained on
    # the source sentences and a target one on the target sentences (needs
    # model.share_embeddings=false), stored as tokenizer.json and target_tokenizer.json
    vocab: str = "joint"
    tokenizer: str | None = None  # an existing tokenizer.json: the joint one, or the source's (else one is trained)
    target_tokenizer: str | None = None  # separate only: an existing target tokenizer file (else one is trained)
    vocab_size: int = 8000
    src_vocab_size: int | None = None  # separate only: the source vocabulary's size (null: vocab_size)
    tgt_vocab_size: int | None = None  # separate only: the target vocabulary's size (null: vocab_size)
    long: str = "drop"
    # subword regularization (Kudo, 2018): each epoch, every training sentence in one of its
    # subword_nbest most probable segmentations, drawn with probability ∝ P^subword_alpha;
    # a unigram vocabulary only
    subword_nbest: int = 0  # 0: off (always the best segmentation)
    subword_alpha: float = 0.1
    bleu_tokenize: str = "13a"
    lowercase: bool = False


# The model fields a translation model fine-tuned from a pretrained one (train.init) may set
# for itself; every other field is the pretrained model's (regularisation only: none of these
# changes the weights' shapes or what they compute in eval mode).
ENCODER_DECODER_TUNING_FIELDS = ("dropout", "attention_dropout")


def _paths(value: list) -> bool:
    return 1 <= len(value) <= 2 and all(isinstance(v, str) and v for v in value)


def _check_vocabularies(recipe: Recipe, where: str) -> None:
    """The vocabulary keys of a translation recipe: the per-side ones only with separate
    vocabularies, which cannot share one embedding table."""
    data = recipe.data
    if data.vocab == "joint":
        for key in ("target_tokenizer", "src_vocab_size", "tgt_vocab_size"):
            if getattr(data, key) is not None:
                raise UserError(f"{where}: data.{key} needs data.vocab=separate (a joint vocabulary has one)")
    elif recipe.model.get("share_embeddings", False):
        raise UserError(
            f"{where}: model.share_embeddings=true needs data.vocab=joint (one vocabulary for source and "
            f"target); set model.share_embeddings=false for separate vocabularies"
        )


def vocabularies_for(
    data: TranslationData, *, checkpoint: Path | None, pairs: list[tuple[str, str]]
) -> tuple[Vocabularies, str]:
    """A translation run's vocabularies, as :func:`tokenizer_for` finds one tokenizer, per
    ``data.vocab``: joint (``data.tokenizer``, or one trained on both sides of ``pairs``), or
    separate (the source's from ``data.tokenizer`` or trained on the sources, of
    ``data.src_vocab_size`` pieces; the target's from ``data.target_tokenizer`` or trained on the
    targets, of ``data.tgt_vocab_size``). A checkpoint's must be of the same kind as the recipe's.
    """
    meta = read_meta(checkpoint) if checkpoint is not None else None
    separate = data.vocab == "separate"
    if meta is not None and (TARGET_FILE in meta["files"]) != separate:
        has = "separate" if TARGET_FILE in meta["files"] else "joint"
        raise UserError(
            f"{checkpoint} has a {has} vocabulary but the recipe says data.vocab={data.vocab}; set data.vocab={has}"
        )
    if not separate:
        tokenizer, said = tokenizer_for(data, checkpoint=checkpoint, pairs=pairs)
        return Vocabularies(tokenizer, tokenizer), said
    found = [
        find_tokenizer(
            data,
            key,
            file,
            checkpoint=checkpoint,
            meta=meta,
            texts=lambda side=side: (pair[side] for pair in pairs),
            vocab_size=int(getattr(data, size) or data.vocab_size),
        )
        for side, (key, file, size) in enumerate(
            [("tokenizer", TOKENIZER_FILE, "src_vocab_size"), ("target_tokenizer", TARGET_FILE, "tgt_vocab_size")]
        )
    ]
    (source, said_source), (target, said_target) = found
    said = f"{said_source} (source), {said_target} (target)"
    try:
        return Vocabularies(source, target), said
    except UserError as e:  # two given files that do not fit together
        raise UserError(f"data.vocab=separate: {e} (source: {said_source}; target: {said_target})") from None


# Train settings that may change when a run is resumed (runner.resumed_recipe); any other change
# would make the continued run differ from an uninterrupted one, so it is refused.
RESUME_MAY_CHANGE = ("epochs", "steps", *recipes.RESUME_MAY_CHANGE)
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


def _checkpoint_model(checkpoint: Path, recipe: Recipe, *, use: str) -> EncoderDecoder:
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


def _as_transcripts(pairs: list[tuple[str, str]], file: str) -> list[tuple[str, str]]:
    """The pairs with their sources as a recognizer writes them; a source without words (Multi30k's
    train.de:16510 is "@@") is left out and counted on stderr."""
    kept = [(a, b) for a, b in ((normalize_transcript(a), b) for a, b in pairs) if a]
    if len(kept) < len(pairs):
        print(f"qkv train: note: {file}: {len(pairs) - len(kept)} sources without words left out", file=sys.stderr)
    return kept


def prepare_translation(recipe: Recipe, start: Start) -> Setup:
    """An encoder-decoder on parallel text: the translation task's parts of a run, in a run
    directory (``runner.train`` starts it, trains, keeps the checkpoints, chooses the final one).

    The vocabulary (``data.vocab``) is a joint unigram model trained on both sides of the
    training pairs, or two separate ones, the source's trained on the sources and the target's
    on the targets (or given tokenizers, or the checkpoint's:
    :func:`~qkv.recipes.vocabularies_for`). Pairs longer than the model's window are dropped
    or truncated (``data.long``) and counted. Batches hold at most ``train.max_tokens``
    padded tokens, length-bucketed and reshuffled every epoch (seed + epoch), so the data
    order is a function of the seed and a position (epoch, batch) is enough to resume. With
    ``data.subword_nbest`` each epoch trains on its own draw of segmentations
    (:func:`_epoch_examples`), also a function of the seed and epoch.
    After every epoch: validation loss and BLEU (``decode.valid_beam``), TensorBoard scalars,
    ``best``/``last``/``epoch-NNN`` checkpoints, early stopping (``train.patience``). At the
    end: the last N epoch checkpoints averaged (``train.average_last``) and the final model,
    the better on validation BLEU with ``decode.beam_size`` of best and averaged, is named in
    ``run.json``. ``resume`` continues from ``last`` exactly as if never stopped; a run that had
    stopped (by a cap or patience the resumed recipe keeps) goes straight to choosing the final
    model. ``train.init`` fine-tunes a model directory: its tokenizers, its architecture (the
    fields the recipe's model section names must agree, but for ``ENCODER_DECODER_TUNING_FIELDS``)
    and weights.
    """
    run, resume = start.out, start.checkpoint is not None
    train, data = recipe.train, recipe.data
    # The position in the data order that resume restores means nothing if the files changed.
    data_sha256 = {str(path): sha256_file(resolve(path)) for path in dict.fromkeys([*data.train, *data.valid])}
    if resume:
        _check_same_data(read_run(run).get("data_sha256"), data_sha256, run)
    seed = int(train.seed)
    torch.manual_seed(seed)
    if train.deterministic:
        torch.use_deterministic_algorithms(True)
    pairs, valid = _read_pairs(data)
    vocab, vocabulary, model = _vocabularies_and_model(recipe, start, pairs)
    window = model.config.max_len
    examples, over_long, rows = _encode_pairs(vocab, pairs, window=window, long=data.long)
    if not examples:
        raise UserError("no training pair fits the model's window (model.max_len)")
    valid_examples, valid_over_long, _ = _encode_pairs(vocab, valid, window=window, long="truncate")
    _say_over_long(data, window, train=(over_long, len(pairs)), valid=(valid_over_long, len(valid)))
    nbest, alpha = int(data.subword_nbest), float(data.subword_alpha)
    kept = [pairs[i] for i in rows]
    drawn = _epoch_examples(vocab, kept, examples, nbest=nbest, alpha=alpha, window=window, seed=seed)
    batches = _EpochBatches(drawn, vocab.target, train, seed)
    validation = _Validation(recipe, vocab, valid, valid_examples)
    over = {"train": len(over_long), "valid": len(valid_over_long)}
    return Setup(
        model,
        batches.step_loss,
        vocab,
        validation.evaluate,
        score=validation.score,
        metric="bleu",
        higher=True,
        final_score=validation.final,
        epochs=Epochs(count=int(train.epochs), begin=batches.begin),
        meta={"data_sha256": data_sha256, "over_long_pairs": over},  # as run.json records them
        facts={"vocabulary": vocabulary, "over_long_pairs": over},
    )


def _read_pairs(data: TranslationData) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The training and validation pairs (source, target) the recipe's data section names."""
    pairs = read_parallel(*data.train)[: data.train_pairs]
    valid = read_parallel(*data.valid)[: data.valid_pairs]
    if data.reverse:
        pairs, valid = [(b, a) for a, b in pairs], [(b, a) for a, b in valid]
    if data.source_as_transcript:  # lowercase, no punctuation: what the cascade's first half writes
        where = data.train[-1 if data.reverse else 0], data.valid[-1 if data.reverse else 0]
        pairs, valid = (_as_transcripts(p, file) for p, file in zip((pairs, valid), where, strict=True))
    return pairs, valid


def _vocabularies_and_model(
    recipe: Recipe, start: Start, pairs: list[tuple[str, str]]
) -> tuple[Vocabularies, str, EncoderDecoder]:
    """The run's vocabularies, what the summary says of them, and its model: a new one of the
    recipe's model section, or, fine-tuning (``train.init``) and resuming (a fine-tuned run too),
    one of the checkpoint's architecture and weights."""
    resume = start.checkpoint is not None
    init = Path(recipe.train.init).expanduser() if recipe.train.init is not None else None
    start_from = start.checkpoint if resume else (model_dir(init) if init is not None else None)
    vocab, vocabulary = vocabularies_for(recipe.data, checkpoint=start_from, pairs=pairs)
    if start_from is None:
        return vocab, vocabulary, seq2seq_model(recipe, vocab)
    return vocab, vocabulary, _checkpoint_model(start_from, recipe, use="--resume" if resume else "train.init")


def _say_over_long(
    data: TranslationData, window: int, *, train: tuple[list[int], int], valid: tuple[list[int], int]
) -> None:
    """Name the over-long pairs on stderr before training (``train``, ``valid``: their indices
    and how many pairs there are), as well as counting them in the summary and run.json: a user
    who did not expect over-long lines learns which ones at once."""
    actions = {"drop": "dropped (data.long: drop)", "truncate": "truncated (data.long: truncate)"}
    for (ids, total), files, action in (
        (train, data.train, actions[data.long]),
        (valid, data.valid, "truncated for validation loss"),
    ):
        if ids:
            note = over_long_note(ids, files=list(files), total=total, window=window, action=action)
            print(f"qkv train: note: {note}", file=sys.stderr)


class _EpochBatches:
    """The epochs of a run (:class:`~qkv.training.Epochs`): each epoch's examples
    (``drawn(epoch)``, :func:`_epoch_examples`) in batches of at most ``train.max_tokens``
    padded tokens, length-bucketed and reshuffled every epoch (seed + epoch): the order is a
    function of the seed and the epoch alone."""

    def __init__(self, drawn: Callable[[int], list], target: Tokenizer, train: TranslationTrain, seed: int) -> None:
        self.drawn, self.target, self.train, self.seed = drawn, target, train, seed
        self.examples: list[tuple[list[int], list[int]]] = []  # the epoch being trained: its examples
        self.order: list[list[int]] = []  # and its batches, by index into them

    def begin(self, epoch: int) -> int:
        self.examples = self.drawn(epoch)
        lengths = [max(len(s), len(t) + 1) for s, t in self.examples]
        self.order = batches_by_tokens(lengths, max_tokens=int(self.train.max_tokens), seed=self.seed + epoch)
        return len(self.order)

    def step_loss(self, m: EncoderDecoder, b: int) -> tuple[torch.Tensor, int]:
        """The loss of batch ``b`` of the epoch and its target tokens (this worker's share)."""
        batch, target = self.order[b], self.target
        mine, counted = share(len(batch))  # this worker's rows of the batch (all of them alone)
        rows = [self.examples[batch[i]] for i in mine]
        s, t_in, t_out = seq2seq_batch(rows, pad_id=target.pad_id, bos_id=target.bos_id, eos_id=target.eos_id)
        smoothing, rdrop = self.train.label_smoothing, self.train.rdrop
        loss, n = seq2seq_loss(m, s, t_in, t_out, pad_id=target.pad_id, label_smoothing=smoothing, rdrop=rdrop)
        return loss, n if counted else 0


@dataclasses.dataclass(frozen=True)
class _Validation:
    """Validation of a translation run on the pairs ``valid`` (``examples``: their token ids):
    teacher-forced loss, and BLEU and chrF of the beam search's translations."""

    recipe: Recipe
    vocab: Vocabularies
    valid: list[tuple[str, str]]
    examples: list[tuple[list[int], list[int]]]

    def final(self, whole: EncoderDecoder) -> dict:
        """The scores at the final beam (``decode.beam_size``), which choose the final checkpoint."""
        return self.translated(whole, self.recipe.decode.beam_size)

    def translated(self, whole: EncoderDecoder, beam: int) -> dict:
        """BLEU and chrF of the validation sources translated with beam width ``beam``, the
        translations, and the seconds it took."""
        start, decode, data = time.perf_counter(), self.recipe.decode, self.recipe.data
        # On N workers each decodes every N-th sentence; all score the same gathered list.
        hypotheses = sharded_map(
            lambda sources: beam_translate(
                whole,
                self.vocab,
                list(sources),
                beam_size=beam,
                length_penalty=float(decode.length_penalty),
                max_len_a=float(decode.max_len_a),
                max_len_b=decode.max_len_b,
            ),
            [a for a, _ in self.valid],
        )
        references = [b for _, b in self.valid]
        scores = corpus_scores(hypotheses, references, tokenize=data.bleu_tokenize, lowercase=data.lowercase)
        return {**scores, "seconds": round(time.perf_counter() - start, 1), "hypotheses": hypotheses}

    def score(self, whole: EncoderDecoder) -> dict[str, float]:
        """Each validation: loss, BLEU and chrF at ``decode.valid_beam``."""
        max_tokens = int(self.recipe.train.max_tokens)
        valid_loss = teacher_forced_loss(whole, self.vocab.target, self.examples, max_tokens=max_tokens)
        scores = self.translated(whole, self.recipe.decode.valid_beam)
        return {"loss": round(valid_loss, 4), "bleu": scores["bleu"], "chrf": scores["chrf"]}

    def evaluate(self, whole: EncoderDecoder, out: Path, validated: dict | None) -> tuple[dict, dict]:
        """The final checkpoint's validation at the final beam: measured when the candidates were
        compared, or (a run without validation) now."""
        scores = validated if validated is not None else self.final(whole)
        keys = ("bleu", "chrf", "bleu_signature", "hypotheses")
        return {}, {**{k: scores[k] for k in keys}, "eval_seconds": scores["seconds"]}


def train_translation(recipe: Recipe, out: str | Path, *, progress: bool = True, resume: bool = False) -> dict:
    """Train an encoder-decoder on parallel text as ``recipe`` says (:func:`prepare_translation`)
    in the run directory ``out``; ``resume`` continues it."""
    return runner.train(TASK, recipe, out, progress=progress, resume=resume)


def report(summary: dict, recipe: Recipe) -> tuple[dict, str]:
    """The run's scores for the command line: validation BLEU and chrF of the final checkpoint."""
    keys = ("bleu", "chrf", "bleu_signature", "final", "epochs", "stopped_by", "over_long_pairs")
    said = (
        f"validation BLEU {summary['bleu']} chrF {summary['chrf']} ({summary['bleu_signature']}) "
        f"of the {summary['final']} checkpoint after {summary['epochs']} epochs (stopped by "
        f"{summary['stopped_by']}); over-long pairs: {summary['over_long_pairs']['train']} in training "
        f"(data.long: {recipe.data.long}), {summary['over_long_pairs']['valid']} in validation (truncated)"
    )
    return {k: summary[k] for k in keys}, said


TASK = Task(
    name="translation",
    model=TRANSLATION_MODEL,
    train=TranslationTrain,
    data=TranslationData,
    decode=("beam_size", "valid_beam", "length_penalty", "max_len_a", "max_len_b"),
    model_kind="encoder_decoder",
    prepare=prepare_translation,
    report=report,
    rules={
        ("train", "epochs"): (int, lambda v: v > 0, "a positive integer"),
        ("train", "deterministic"): (bool, lambda v: True, "true or false"),
        ("data", "reverse"): (bool, lambda v: True, "true or false"),
        ("data", "train_pairs"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
        ("data", "valid_pairs"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
        ("data", "target_tokenizer"): (
            (str, type(None)),
            lambda v: v is None or bool(v),
            "a tokenizer file path or null",
        ),
        ("data", "vocab"): (str, lambda v: v in ("joint", "separate"), "joint or separate"),
        ("data", "src_vocab_size"): ((int, type(None)), lambda v: v is None or v > 8, "an integer > 8 or null"),
        ("data", "tgt_vocab_size"): ((int, type(None)), lambda v: v is None or v > 8, "an integer > 8 or null"),
        ("data", "subword_nbest"): (
            int,
            lambda v: 0 <= v <= MAX_NBEST,
            f"an integer in 0..{MAX_NBEST} (0: no subword sampling)",
        ),
        ("data", "subword_alpha"): ((int, float), lambda v: v > 0, "a number > 0"),
        ("train", "rdrop"): ((int, float), lambda v: v >= 0, "a number >= 0 (0: no R-Drop)"),
        ("train", "max_tokens"): (int, lambda v: v > 0, "a positive integer"),
        ("data", "train"): (list, _paths, "a list of one TSV path or two aligned file paths"),
        ("data", "valid"): (list, _paths, "a list of one TSV path or two aligned file paths"),
        ("data", "long"): (str, lambda v: v in ("drop", "truncate"), "drop or truncate"),
        ("data", "bleu_tokenize"): (str, lambda v: v in BLEU_TOKENIZERS, f"one of {', '.join(BLEU_TOKENIZERS)}"),
        ("data", "lowercase"): (bool, lambda v: True, "true or false"),
        ("data", "source_as_transcript"): (bool, lambda v: True, "true or false"),
    },
    check=_check_vocabularies,
    tuning_fields=ENCODER_DECODER_TUNING_FIELDS,
    run_directory=True,
    resume_may_change=RESUME_MAY_CHANGE,
    resume_may_name=TOKENIZER_KEYS,
)
