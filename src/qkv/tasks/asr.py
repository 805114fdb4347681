"""Speech in, text out: the speech-recognition and speech-translation task (:data:`TASK`, named
``asr``), its parts of a run :func:`prepare_asr`, and :func:`transcribe`, which ``qkv transcribe``,
the server and the benchmarks share.

A recipe names a corpus (``data.corpus``): FSDD's spoken digits (the standard split, or digit
strings with one speaker held out), Multi30k captions spoken by espeak-ng in English (speech
recognition) or German (with ``data.translate``: English text out, speech translation), or
manifests of the user's own recordings. The corpus is built and cached by
``speech_corpora/``; every utterance's log-mel features are computed once, kept in memory
(float16) and batched by length under a budget of feature frames. Each step draws its batch and
its SpecAugment masks from (seed, step) alone, so a resumed run trains exactly as an
uninterrupted one. The loss is the joint CTC/attention loss (``training.speech_loss``); the
test split is decoded by beam search, joint with the CTC prefix score when ``decode.ctc_weight``
> 0, and scored by WER / CER (jiwer) or, for translation, BLEU (sacreBLEU).

What is not here: the recipe's ``data`` section, the corpus it names, the texts to learn and
every utterance's features (``tasks/asr_data.py``), starting the encoder or decoder from trained
models (``tasks/asr_init.py``), features (``audio.py``), the corpora
(``speech_corpora/``), the model (``models/speech.py``), decoding and CTC scoring
(``decoding/``), the command line (``cli/transcribe.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qkv import runner
from qkv.audio import FeatureConfig, pad_features, spec_augment
from qkv.checkpoint import build_model
from qkv.decoding import Required, Scorer, beam_search, constrained_beam_search, ctc_greedy, joint_scorers
from qkv.distributed import share
from qkv.errors import OptionError, UserError
from qkv.evaluation import corpus_scores, error_rates
from qkv.loading import load_fusion_lm
from qkv.losses import seq2seq_batch, share_loss, speech_loss, speech_tokens
from qkv.models.decoder_only import DecoderOnly
from qkv.models.speech import SpeechEncoderDecoder
from qkv.plots import speech_attention
from qkv.progress import progress as progress_bar
from qkv.recipes import (
    Recipe,
    Setup,
    Start,
    Task,
    TrainConfig,
    batch_of_step,
    length_batches,
    require_steps,
    step_seed,
)
from qkv.speech_corpora import Corpus, valid_speeds
from qkv.tasks.asr_data import CORPORA, AsrData, compute_features, load_corpus, output_text, validation_split
from qkv.tasks.asr_init import IDS, decoder_tokenizer, init_decoder, init_encoder, pretrained_source
from qkv.tokenization import FILE as TOKENIZER_FILE
from qkv.tokenization import Tokenizer

# A small speech Transformer that trains on two CPU cores: ESPnet's conv2d front-end (×4 fewer
# frames), 6 encoder and 3 decoder blocks of width 144 (the encoder does the listening; a
# transcript's decoder needs little), pre-norm, CTC weight 0.3 (Kim et al., 2017).
ASR_MODEL: dict = {
    "d_model": 144,
    "n_heads": 4,
    "d_ff": 576,
    "n_encoder_layers": 6,
    "n_decoder_layers": 3,
    "max_len": 160,
    "dropout": 0.1,
    "frontend": "conv2d",
    "encoder_positions": "sinusoidal",
    "positions": "sinusoidal",
    "ctc": True,
    "features": {"kind": "logmel", "n_mels": 80, "normalize": True},
}


@dataclasses.dataclass(frozen=True)
class AsrTrain(TrainConfig):
    """Speech recognition's training (``train``): the shared settings with its defaults, batches of
    up to ``batch_frames`` feature frames, the CTC loss weight, SpecAugment, and encoder/decoder
    initialisation from other models."""

    steps: int | None = 3000
    batch_frames: int = 12000  # feature frames (10 ms each) per batch, padding included: 120 s of audio
    warmup: int = 300
    min_lr: float = 1e-5
    ctc_loss_weight: float = 0.3  # λ of the loss λ·CTC + (1 − λ)·attention (decoding's: decode.ctc_weight)
    spec_augment: bool = True
    freq_masks: int = 2
    freq_width: int = 15
    time_masks: int = 2
    time_width: int = 40
    time_ratio: float = 0.2
    time_warp: int = 0
    init_encoder: str | None = None  # a speech model directory whose front-end and encoder start ours
    init_decoder: str | None = None  # a translation model whose decoder (and target tokenizer) start ours
    label_smoothing: float = 0.1


def _check(recipe: Recipe, where: str) -> None:
    require_steps(recipe, where)
    data = recipe.data
    if data.translate and data.corpus not in ("espeak_de", "manifests"):
        raise UserError(f"{where}: data.translate needs data.corpus espeak_de or manifests with a target column")
    if data.corpus == "manifests" and (data.train is None or data.test is None):
        raise UserError(f"{where}: data.corpus manifests needs data.train and data.test (manifest TSV files)")
    if not recipe.model.get("ctc", True):
        for key, value in (
            ("train.ctc_loss_weight", recipe.train.ctc_loss_weight),
            ("decode.ctc_weight", recipe.decode.ctc_weight),
        ):
            if value > 0:
                raise UserError(f"{where}: {key} must be 0 for a model without a CTC head (model.ctc: false)")
    if not isinstance(recipe.model.get("features", {}), dict):
        raise UserError(f"{where}: model.features must be a mapping of feature settings")


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def too_short(model: SpeechEncoderDecoder, frames: int) -> bool:
    """Whether ``frames`` feature frames leave the model's front-end no frame to encode (the
    conv2d front-end reads 7 frames, 70 ms at a 10 ms hop, for its first output)."""
    return int(model.subsampled(torch.tensor(frames))) < 1


@dataclass(frozen=True)
class Transcription:
    """One decoded utterance: its text, its token ids, and its share of its batch's decoding
    time in seconds (the batch's time over its utterances)."""

    text: str
    ids: list[int]
    seconds: float = 0.0


@torch.no_grad()
def transcribe(
    model: SpeechEncoderDecoder,
    tokenizer: Tokenizer,
    feats: Sequence[Tensor],
    *,
    beam_size: int = 4,
    ctc_weight: float = 0.0,
    ctc_only: bool = False,
    length_penalty: float = 1.0,
    batch_size: int = 32,
    prefix: list[int] | None = None,
    on_batch: Callable[[int], None] | None = None,
    lm: DecoderOnly | None = None,
    lm_weight: float = 0.0,
    scorers: Sequence[Scorer] = (),
    required: Sequence[Sequence[Required]] | None = None,
) -> list[Transcription]:
    """Decode feature tensors, in batches of similar length (less padding), results in input order.

    Beam search (``beam_size``; 1 is greedy), joint with the CTC prefix score when
    ``ctc_weight`` > 0 (the model needs a CTC head); ``ctc_only``: CTC best-path decoding, no
    decoder. ``prefix``: the decoder's forced first tokens (an imported Whisper's start
    tokens); None: BEGIN alone. ``on_batch(n)`` is called after each batch of n. ``lm``,
    ``lm_weight``: a language model of the same tokens fused into the beam search
    (``loading.load_fusion_lm``; ``decoding.LanguageModelScore``). ``scorers``: more full
    scorers (bans, ``decoding.BannedWords``); ``required``: each input's required terms, searched
    for by ``decoding.constrained_beam_search`` (not joint with the CTC prefix score).

    Shapes: feats: N tensors (T_n, M) -> N transcriptions.
    """
    if ctc_weight and model.ctc is None:
        raise OptionError("ctc_weight weighs a CTC prefix score: it needs a model with a CTC head", "ctc_weight")
    if ctc_only and model.ctc is None:
        raise OptionError("ctc_only decodes with the CTC head alone: this model has none", "ctc_only")
    if ctc_only and lm is not None:
        raise OptionError("lm is fused into the beam search; ctc_only decodes without one", "lm", "ctc_only")
    for i, f in enumerate(feats):
        if too_short(model, f.shape[0]):
            raise UserError(f"input {i + 1} is too short for the model: {f.shape[0]} frames leave its front-end none")
    if ctc_only and (scorers or required is not None):
        raise OptionError("ctc_only decodes with the CTC head alone: no bans or required terms", "ctc_only")
    if required is not None and ctc_weight:
        raise OptionError("required terms are searched for by the decoder alone: not with ctc_weight", "ctc_weight")
    decoder_weight, joint = joint_scorers(ctc_weight=ctc_weight if ctc_weight > 0 else None, lm=lm, lm_weight=lm_weight)
    scorers = [*joint, *scorers]
    order = sorted(range(len(feats)), key=lambda i: feats[i].shape[0])
    results: list[Transcription | None] = [None] * len(feats)
    dtype = next(model.parameters()).dtype
    for start in range(0, len(order), batch_size):
        began = time.perf_counter()
        rows = order[start : start + batch_size]
        inputs = [feats[i].to(dtype) for i in rows]
        if ctc_only:
            outputs = ctc_greedy(model, inputs)
        else:
            search = beam_search
            if required is not None:  # dynamic beam allocation, the same search otherwise
                search = functools.partial(constrained_beam_search, required=[required[i] for i in rows])
            best = search(
                model,
                inputs,
                beam_size=beam_size,
                max_new_tokens=model.config.max_len,
                length_penalty=length_penalty,
                prefix=prefix,
                decoder_weight=decoder_weight,
                scorers=scorers,
            )
            outputs = [hyps[0].tokens for hyps in best]
        share = (time.perf_counter() - began) / len(rows)
        for i, ids in zip(rows, outputs, strict=True):
            ids = [t for t in ids if t != model.config.eos_id]
            results[i] = Transcription(tokenizer.decode(ids), ids, share)
        if on_batch is not None:
            on_batch(len(rows))
    return [r for r in results if r is not None]


def cross_attention(model: SpeechEncoderDecoder, feats: Tensor, ids: list[int]) -> Tensor:
    """The last decoder block's cross-attention while the model writes ``ids`` + END from the
    features ``feats``; row t reads BEGIN + ids[:t].

    Shapes: feats (T, M) -> (H, L, S), L = len(ids) + 1, S the encoder frames.
    """
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        memory, valid = model.encode(feats[None].to(dtype))  # (1, S, D), (1, S)
        tgt = torch.tensor([[model.config.bos_id, *ids]])  # (1, L)
        attention = model.decode(tgt, memory, src_mask=valid, need_weights=True).attention
    return attention[-1][0].float()  # (H, L, S)


def draw_cross_attention(
    model: SpeechEncoderDecoder, tokenizer: Tokenizer, feats: Tensor, ids: list[int], path: Path, *, title: str
) -> Path:
    """PNG of :func:`cross_attention` under the utterance's spectrogram
    (``plots.speech_attention``)."""
    weights = cross_attention(model, feats, ids)
    labels = [tokenizer.id_to_token(t) for t in ids] + ["END"]
    labels = [label.replace(" ", "␣") for label in labels]
    c = model.config.features
    return speech_attention(
        feats.float().numpy(),
        weights.numpy(),
        output=labels,
        seconds_per_frame=c.hop_length / c.sample_rate,
        path=path,
        title=title,
    )


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def _started(recipe: Recipe, tokenizer: Tokenizer, source: Path | None, writer: Path | None) -> SpeechEncoderDecoder:
    """The recipe's model for ``tokenizer``'s vocabulary, seeded, its encoder started from
    ``source``'s and its decoder from ``writer``'s where they are given."""
    torch.manual_seed(int(recipe.train.seed))
    fields = {**recipe.model, "vocab_size": tokenizer.vocab_size, **{n: getattr(tokenizer, n) for n in IDS}}
    model = build_model("speech_encoder_decoder", fields)
    if source is not None:
        init_encoder(model, source)
    if writer is not None:
        init_decoder(model, writer)
    return model


def _tokenizer(data: AsrData, texts: list[str], last: Path | None) -> Tokenizer:
    if last is not None:
        return Tokenizer.load(last / TOKENIZER_FILE)
    if data.tokenizer == "char":
        return Tokenizer.train_char_level(texts)
    if data.tokenizer == "subword":
        return Tokenizer.train_subword(texts, vocab_size=int(data.vocab_size))
    path = Path(data.tokenizer)
    if not path.is_file():
        raise UserError(f"data.tokenizer: {path} does not exist (char, subword or a tokenizer.json)")
    return Tokenizer.load(path)


def _trainable(
    model: SpeechEncoderDecoder, tokenizer: Tokenizer, utts: list, texts: list[str], problems: list[str], *, progress
) -> tuple[list[Tensor], list[list[int]]]:
    """The training utterances' features (T, M) and target ids, of those the model can learn
    from: a transcript longer than the decoder's window, or audio too short for its front-end,
    is left out (how many, added to ``problems``); none left is a UserError."""
    targets = tokenizer.encode_batch(texts, add_special_tokens=False)  # the batch adds BEGIN and END
    keep = [i for i, ids in enumerate(targets) if len(ids) + 1 <= model.config.max_len]
    if len(keep) < len(targets):
        problems.append(
            f"{len(targets) - len(keep)} training transcripts longer than max_len={model.config.max_len} "
            "tokens were left out"
        )
    if not keep:
        raise UserError("no training utterance fits the model's window (max_len)")
    utts, targets = [utts[i] for i in keep], [targets[i] for i in keep]
    feats = compute_features(utts, model.config.features, progress=progress, desc="features (train)")
    audible = [i for i, f in enumerate(feats) if not too_short(model, f.shape[0])]
    if len(audible) < len(feats):
        problems.append(f"{len(feats) - len(audible)} training utterances too short for the front-end left out")
        feats, targets = [feats[i] for i in audible], [targets[i] for i in audible]
    if not feats:
        raise UserError("no training utterance is long enough for the model's front-end")
    return feats, targets


def _step_loss(
    model: SpeechEncoderDecoder, train: AsrTrain, feats: list[Tensor], targets: list[list[int]]
) -> Callable[[SpeechEncoderDecoder, int], tuple[Tensor, float]]:
    """The training step's loss (``Setup.step_loss``): the step's batch of ``feats`` (T, M) and
    ``targets`` (length batches of at most ``train.batch_frames`` frames, drawn by step and seed),
    SpecAugment as ``train`` says, this worker's share of the joint CTC/attention loss, weighted
    by its seconds of audio, and those seconds (0 for a worker that does not count them)."""
    c, seed = model.config, int(train.seed)
    batches = length_batches([f.shape[0] for f in feats], int(train.batch_frames))
    augment = {
        k: getattr(train, k)
        for k in ("freq_masks", "freq_width", "time_masks", "time_width", "time_ratio", "time_warp")
    }
    seconds_per_frame = c.features.hop_length / c.features.sample_rate

    def step_loss(m: SpeechEncoderDecoder, step: int) -> tuple[Tensor, float]:
        rows = batches[batch_of_step(len(batches), step, seed)]
        x, valid = pad_features([feats[i].float() for i in rows])  # (B, T, M), (B, T)
        if train.spec_augment:
            generator = torch.Generator().manual_seed(step_seed(seed, step))
            x = spec_augment(x, generator, valid=valid, **augment)  # (B, T, M)
        _, t_in, t_out = seq2seq_batch(
            [([], targets[i]) for i in rows], pad_id=c.pad_id, bos_id=c.bos_id, eos_id=c.eos_id
        )  # (B, L) each
        # This worker's rows (all of them alone), cut after the whole batch's SpecAugment draws.
        mine, counted = share(len(rows))
        # A share's loss is its part of the whole batch's (the terms' means are over the whole
        # batch's tokens), weighted by its seconds of audio, the count the rate reports.
        whole = speech_tokens(t_out, pad_id=c.pad_id, eos_id=c.eos_id) if len(mine) < len(rows) else None
        all_seconds = float(valid.sum()) * seconds_per_frame
        x, valid, t_in, t_out = x[mine], valid[mine], t_in[mine], t_out[mine]
        part, _ = speech_loss(
            m,
            x,
            valid,
            t_in,
            t_out,
            pad_id=c.pad_id,
            ctc_weight=float(train.ctc_loss_weight),
            label_smoothing=float(train.label_smoothing),
            whole=whole,
        )
        seconds = float(valid.sum()) * seconds_per_frame
        return share_loss(part, seconds, all_seconds), seconds if counted else 0.0

    return step_loss


def prepare_asr(recipe: Recipe, start: Start) -> Setup:
    """A speech encoder–decoder's parts of a run: corpus, features, tokenizer, model (its encoder
    and decoder started from pretrained ones where the recipe says), step loss, validation (WER
    or BLEU on the validation split) and the evaluation on the test split.

    Transcripts (or translations) longer than the decoder's window are left out of training
    and named in ``problems``. The model directory also gets ``cross_attention.png``: the
    first test utterance's spectrogram with the attention of the words the model wrote.
    """
    last, progress = start.checkpoint, start.progress
    train, data = recipe.train, recipe.data
    problems: list[str] = []
    # The sources of the encoder and decoder are checked before the corpus is read; resumed, the
    # checkpoint holds those parts already and the sources are only named (as the recipe gives them).
    source, writer = pretrained_source(train, "init_encoder", last), pretrained_source(train, "init_decoder", last)
    # Recorded as read where they are read now; resumed, as the recipe names them.
    encoder_from = str(source) if source is not None else train.init_encoder
    decoder_from = str(writer) if writer is not None else train.init_decoder
    # With a translator's decoder the vocabulary is known at once: the model is built and checked
    # against its sources before the corpus (which may take minutes to build) is read.
    tokenizer = decoder_tokenizer(writer) if writer is not None else None
    model = _started(recipe, tokenizer, source, writer) if tokenizer is not None else None
    corpus, test_split = load_corpus(data)
    translate, normalize = bool(data.translate), bool(data.normalize)
    train_utts = corpus["train"]
    texts = [output_text(u, translate=translate, normalize=normalize) for u in train_utts]
    if tokenizer is None or model is None:
        tokenizer = _tokenizer(data, texts, last)
        model = _started(recipe, tokenizer, source, writer)
    config = model.config.features
    train_feats, targets = _trainable(model, tokenizer, train_utts, texts, problems, progress=progress)
    step_loss = _step_loss(model, train, train_feats, targets)
    validate = validation_scorer(corpus, tokenizer, recipe, config, progress=progress) if train.valid_every else None

    def evaluate(m: SpeechEncoderDecoder, out: Path, validated: dict | None) -> tuple[dict, dict]:
        train_feats.clear()  # the training features' memory, before the test set's
        evaluation = score_model(m, tokenizer, recipe, progress=progress, test=(corpus, test_split))
        first = evaluation["first_features"]
        draw_cross_attention(
            m,
            tokenizer,
            first,
            evaluation["first_ids"],
            out / "cross_attention.png",
            title=f"{evaluation['first_path']}: {evaluation['hypotheses'][0]!r}",
        )
        recorded = {k: v for k, v in evaluation.items() if not isinstance(v, (list, Tensor))}
        return recorded, {k: v for k, v in evaluation.items() if not k.startswith("first_")}

    return Setup(
        model,
        step_loss,
        tokenizer,
        evaluate,
        score=validate,
        metric="bleu" if translate else "wer",
        higher=translate,
        meta={"init_encoder": encoder_from, "init_decoder": decoder_from},
        facts={"problems": problems, "init_encoder": encoder_from, "init_decoder": decoder_from},
        unit="audio_s",
    )


def train_asr(recipe: Recipe, out: str | Path, *, progress: bool = True, resume: bool = False) -> dict:
    """Train a speech encoder–decoder as ``recipe`` says (:func:`prepare_asr`), score it on the
    test split, save it to ``out``."""
    return runner.train(TASK, recipe, out, progress=progress, resume=resume)


def as_recipe_says(
    model: SpeechEncoderDecoder,
    tokenizer: Tokenizer,
    feats: list[Tensor],
    recipe: Recipe,
    *,
    on_batch: Callable[[int], None] | None = None,
    lm: DecoderOnly | None = None,
    lm_weight: float = 0.0,
) -> list:
    """``feats`` decoded with the recipe's ``decode`` settings (beam, CTC weight, length penalty)
    in batches of ``data.eval_batch_size``: what validation and the final scoring both do."""
    decode = recipe.decode
    return transcribe(
        model,
        tokenizer,
        feats,
        beam_size=decode.beam_size,
        ctc_weight=float(decode.ctc_weight),
        length_penalty=float(decode.length_penalty),
        batch_size=recipe.data.eval_batch_size,
        on_batch=on_batch,
        lm=lm,
        lm_weight=lm_weight,
    )


def validation_scorer(
    corpus: Corpus, tokenizer: Tokenizer, recipe: Recipe, config: FeatureConfig, *, progress: bool
) -> Callable[[SpeechEncoderDecoder], dict[str, float]]:
    """Validation for ``train.valid_every``: the validation split (:func:`validation_split`)
    decoded as the test split is (the recipe's beam and CTC weight) and scored: WER and CER, or
    BLEU and chrF for translation. Its features are computed once, now."""
    data = recipe.data
    utterances = validation_split(corpus, data)
    translate = bool(data.translate)
    feats = compute_features(utterances, config, progress=progress, desc="features (validation)")
    references = [output_text(u, translate=translate, normalize=False) for u in utterances]

    def score(model: SpeechEncoderDecoder) -> dict[str, float]:
        decoded = as_recipe_says(model, tokenizer, feats, recipe)
        scores = _scores([d.text for d in decoded], references, translate=translate)
        return {k: v for k, v in scores.items() if k in ("wer", "cer", "bleu", "chrf")}

    return score


def score_model(
    model: SpeechEncoderDecoder,
    tokenizer: Tokenizer,
    recipe: Recipe,
    *,
    progress: bool = True,
    test: tuple[Corpus, str] | None = None,
    lm: DecoderOnly | None = None,
    lm_weight: float | None = None,
) -> dict:
    """Decode the recipe's test split (``data.test_limit`` of it) with the recipe's decoding
    settings and score it: WER, CER and utterance accuracy, or BLEU for translation; with
    the hypotheses, references, timings and decoding speed (seconds of audio per second).
    ``test``: the corpus and split, when the caller has them (else :func:`load_corpus`).
    ``lm``, ``lm_weight``: a language model fused into the beam search (:func:`transcribe`);
    None: the recipe's ``decode.lm`` and ``decode.lm_weight`` (no ``decode.lm``: none)."""
    data, decode = recipe.data, recipe.decode
    if lm is None and decode.lm is not None:
        lm = load_fusion_lm(decode.lm, tokenizer, model=model)
    lm_weight = (decode.lm_weight if lm is not None else 0.0) if lm_weight is None else lm_weight
    corpus, split = test if test is not None else load_corpus(data)
    utterances = corpus[split][: data.test_limit] if data.test_limit else corpus[split]
    translate = bool(data.translate)
    config = model.config.features
    start = time.perf_counter()
    feats = compute_features(utterances, config, progress=progress, desc="features (test)")
    bar = progress_bar(total=len(utterances), desc="decoding (test)", unit="utt", disable=not progress)
    decoded = as_recipe_says(model, tokenizer, feats, recipe, on_batch=bar.update, lm=lm, lm_weight=lm_weight)
    bar.close()
    seconds = time.perf_counter() - start
    hypotheses = [d.text for d in decoded]
    references = [output_text(u, translate=translate, normalize=False) for u in utterances]
    audio = sum(f.shape[0] for f in feats) * config.hop_length / config.sample_rate
    return {
        **_scores(hypotheses, references, translate=translate),
        "test_utterances": len(utterances),
        "test_split": f"{corpus.name}/{split}",
        "hypotheses": hypotheses,
        "references": references,
        "paths": [str(u.path) for u in utterances],
        "eval_seconds": seconds,
        "decode_audio_seconds_per_second": audio / max(seconds, 1e-9),
        "first_features": feats[0],
        "first_ids": decoded[0].ids,
        "first_path": utterances[0].path.name,
    }


def _scores(hypotheses: list[str], references: list[str], *, translate: bool) -> dict:
    if translate:  # the measure: sacreBLEU, 13a, lowercased
        bleu = corpus_scores(hypotheses, references, tokenize="13a", lowercase=True)
        return {"bleu": bleu["bleu"], "chrf": bleu["chrf"], "bleu_signature": bleu["bleu_signature"]}
    rates = error_rates(hypotheses, references)
    return {
        "wer": rates["wer"],
        "cer": rates["cer"],
        "accuracy": rates["sentence_accuracy"],
        "words": rates["words"],
    }


def report(summary: dict, recipe: Recipe) -> tuple[dict, str]:
    """The run's scores for the command line: WER / CER and utterance accuracy, or BLEU."""
    n, split = summary["test_utterances"], summary["test_split"]
    if "bleu" in summary:
        score = {"bleu": summary["bleu"], "chrf": summary["chrf"]}
        return score, f"BLEU={summary['bleu']:.2f} (sacreBLEU, 13a, lowercased) on {n} utterances of {split}"
    score = {k: round(summary[k], 4) for k in ("wer", "cer", "accuracy")}
    said = (
        f"WER={100 * summary['wer']:.2f}% CER={100 * summary['cer']:.2f}% "
        f"({100 * summary['accuracy']:.1f}% of utterances exactly right) on {n} utterances of {split}"
    )
    return score, said


def _corpus_name(v: object) -> bool:
    return v in CORPORA


TASK = Task(
    name="asr",
    model=ASR_MODEL,
    train=AsrTrain,
    data=AsrData,
    decode=("beam_size", "ctc_weight", "length_penalty", "lm", "lm_weight"),
    model_kind="speech_encoder_decoder",
    prepare=prepare_asr,
    report=report,
    rules={
        ("data", "corpus"): (str, _corpus_name, f"one of {', '.join(CORPORA)}"),
        ("data", "translate"): (bool, lambda v: True, "true or false"),
        ("data", "normalize"): (bool, lambda v: True, "true or false"),
        ("data", "held_out"): (str, lambda v: bool(v), "an FSDD speaker's name"),
        ("data", "train_utterances"): (int, lambda v: v > 0, "a positive integer"),
        ("data", "test_utterances"): (int, lambda v: v > 0, "a positive integer"),
        ("data", "speed_perturb"): (list, valid_speeds, "a list of speeds from 0.5 to 2, such as [0.9, 1.0, 1.1]"),
        ("data", "sentences"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
        ("data", "corpus_seed"): (int, lambda v: 0 <= v < 2**32, "an integer from 0 to 2**32 - 1"),
        ("data", "train"): ((str, type(None)), lambda v: v is None or bool(v), "a manifest TSV path or null"),
        ("data", "test"): ((str, type(None)), lambda v: v is None or bool(v), "a manifest TSV path or null"),
        ("data", "tokenizer"): (str, lambda v: bool(v), "char, subword or a tokenizer.json path"),
        ("data", "test_limit"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
        ("data", "valid"): ((str, type(None)), lambda v: v is None or bool(v), "a manifest TSV path or null"),
        ("data", "valid_limit"): ((int, type(None)), lambda v: v is None or v > 0, "a positive integer or null"),
        ("train", "batch_frames"): (int, lambda v: v > 0, "a positive integer (feature frames per batch)"),
        ("train", "ctc_loss_weight"): ((int, float), lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        ("train", "spec_augment"): (bool, lambda v: True, "true or false"),
        ("train", "freq_masks"): (int, lambda v: v >= 0, "an integer >= 0"),
        ("train", "freq_width"): (int, lambda v: v >= 0, "an integer >= 0"),
        ("train", "time_masks"): (int, lambda v: v >= 0, "an integer >= 0"),
        ("train", "time_width"): (int, lambda v: v >= 0, "an integer >= 0"),
        ("train", "time_ratio"): ((int, float), lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        ("train", "time_warp"): (int, lambda v: v >= 0, "an integer >= 0"),
        ("train", "init_encoder"): ((str, type(None)), lambda v: v is None or bool(v), "a model directory or null"),
        ("train", "init_decoder"): ((str, type(None)), lambda v: v is None or bool(v), "a model directory or null"),
    },
    check=_check,
    rate_unit="audio_seconds",
    loss_name="λ·CTC + (1 − λ)·cross-entropy",
)
