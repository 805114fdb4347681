"""Evaluation metrics: exact match, BLEU / chrF through sacreBLEU (with its signature), and
word / character error rates through jiwer.

What is here: :func:`exact_match`, :func:`corpus_scores`, :func:`error_rates` (WER and CER of
transcripts, with :func:`normalize_transcript`), :func:`lm_loss` (a language
model's cross-entropy on a token stream, in non-overlapping windows), :func:`masked_lm_scores`
(a masked-LM's loss and accuracy at the masked positions) and the classification metrics
:func:`accuracy` and :func:`macro_f1`. BLEU and chrF come from the ``sacrebleu`` library,
never re-implemented; the signature it prints says exactly how a score was computed
(tokenization, casing, version), so scores compare across papers.

What is not here: decoding (``decoding/``), reading files (``cli.py``).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Hashable, Iterable, Sequence

import sacrebleu
import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.models.decoder_only import DecoderOnly
from qkv.models.encoder_only import EncoderOnly


def exact_match(hypotheses: list[str], references: list[str]) -> float:
    """Fraction of hypotheses equal to their reference after stripping outer whitespace."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not references:
        return 0.0
    return sum(h.strip() == r.strip() for h, r in zip(hypotheses, references, strict=True)) / len(references)


def moses_lowercased(texts: list[str], *, lang: str) -> list[str]:
    """Moses punctuation normalization + tokenization, lowercased: the preprocessing of the
    official Multi30k ``*.lc.norm.tok.*`` files (checked: it reproduces test2016's English
    reference from the raw file on 977 of 1,000 lines, German 992), via ``sacremoses``."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(normalizer.normalize(t), escape=True, return_str=True).lower() for t in texts]


BLEU_TOKENIZERS = ("13a", "zh", "intl", "char", "none", "moses")


def corpus_scores(
    hypotheses: list[str],
    references: list[str],
    *,
    tokenize: str = "13a",
    lowercase: bool = False,
    lang: str = "en",
) -> dict:
    """Corpus BLEU and chrF of ``hypotheses`` against one reference each.

    ``tokenize`` is sacreBLEU's tokenizer ("13a" default, "zh" for Chinese, "none" for
    text that is already tokenized), or "moses": the published-table metric of Multi30k,
    where references are the official lowercased tokenized files and the (detokenized,
    cased) hypotheses get the same preprocessing (:func:`moses_lowercased` in ``lang``)
    before sacreBLEU compares them token by token ("none"). ``lowercase`` compares
    case-insensitively. Returns {"bleu", "chrf", "exact_match", "bleu_signature",
    "chrf_signature"}.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if tokenize not in BLEU_TOKENIZERS:
        raise ValueError(f"tokenize must be one of {BLEU_TOKENIZERS}, got {tokenize!r}")
    if tokenize == "moses":
        scores = corpus_scores(moses_lowercased(hypotheses, lang=lang), references, tokenize="none", lowercase=True)
        for key in ("bleu_signature", "chrf_signature"):
            scores[key] += f"|hyp:moses-lc-{lang}"
        return scores
    # "none" says the text is tokenized already: sacreBLEU's warning about tokenized periods is moot.
    bleu = sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=lowercase, force=tokenize == "none")
    chrf = sacrebleu.metrics.CHRF(lowercase=lowercase)
    bleu_score = bleu.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    return {
        "bleu": round(bleu_score.score, 2),
        "chrf": round(chrf_score.score, 2),
        "exact_match": round(exact_match(hypotheses, references), 4),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


_NOT_WORD = re.compile(r"[^\w' ]+")  # anything but letters, digits, apostrophes and spaces


def normalize_transcript(text: str) -> str:
    """A transcript as word error rates compare it: Unicode NFKC, lowercase, punctuation (but
    the apostrophe of "don't") made a space, runs of spaces one. Speech carries no commas or
    capitals, so an ASR system is scored on the words (as Whisper's English normalizer and
    ESPnet's scoring do, more simply)."""
    text = _NOT_WORD.sub(" ", unicodedata.normalize("NFKC", text).lower())
    return " ".join(text.replace("_", " ").split())


def error_rates(hypotheses: list[str], references: list[str], *, normalize: bool = True) -> dict:
    """Corpus word and character error rates, computed by ``jiwer``: (S + D + I) / N over all
    utterances together (N the reference words, or characters for CER), with the counts.

    ``normalize``: compare :func:`normalize_transcript` of both sides (else the texts with
    outer spaces stripped). An empty reference (after normalization) is a ValueError naming
    its index: its error rate is undefined. Returns {"wer", "cer", "substitutions",
    "deletions", "insertions", "words", "sentence_accuracy"}.
    """
    import jiwer  # imported on use: only scoring speech needs it

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not references:
        raise ValueError("no references to score")
    prepare = normalize_transcript if normalize else str.strip
    hyps, refs = [prepare(h) for h in hypotheses], [prepare(r) for r in references]
    for i, r in enumerate(refs):
        if not r:
            raise ValueError(f"reference {i + 1} is empty{' after normalization' if normalize else ''}")
    words = jiwer.process_words(refs, hyps)
    chars = jiwer.process_characters(refs, hyps)
    return {
        "wer": words.wer,
        "cer": chars.cer,
        "substitutions": words.substitutions,
        "deletions": words.deletions,
        "insertions": words.insertions,
        "words": words.hits + words.substitutions + words.deletions,
        "sentence_accuracy": exact_match(hyps, refs),
    }


@torch.no_grad()
def lm_loss(model: DecoderOnly, ids: Tensor, *, context: int, batch_size: int = 64) -> float:
    """Mean next-token cross-entropy (nats per token) over all of ``ids``.

    The stream is cut into non-overlapping windows of ``context`` tokens; every token but
    the first is predicted exactly once, from the tokens before it in its window (the last,
    shorter window included).

    Shapes: ids (N,) -> a float.
    """
    model.eval()
    n = len(ids) - 1  # tokens that get predicted
    full = n // context
    x = ids[: full * context].view(full, context)  # (N, T): N whole windows
    y = ids[1 : full * context + 1].view(full, context)  # (N, T)
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, full, batch_size)]
    if n % context:
        batches.append((ids[full * context : n][None], ids[full * context + 1 :][None]))  # (1, T'): the rest
    total = 0.0
    for inputs, targets in batches:
        logits = model(inputs)  # (B, T, V)
        flat = logits.flatten(0, 1).float()  # (B*T, V)
        total += F.cross_entropy(flat, targets.flatten(), reduction="sum").item()  # targets (B*T,)
    return total / max(n, 1)


@torch.no_grad()
def span_loss(
    model: DecoderOnly, ids: Tensor, spans: Sequence[tuple[int, int]], *, context: int, batch_size: int = 64
) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats per token) of the tokens ``ids[start:end]`` of each
    span, each predicted from everything before it that fits in the window: the input is the
    ``context`` tokens ending just before ``end`` (fewer at the stream's start). A dialogue's
    reply given the turns before it is such a span. Returns the loss and the tokens scored.

    Shapes: ids (N,) -> a float and a count; each span needs 1 <= start < end <= N and
    end - start <= context (the window must hold the span and one token before it).
    """
    model.eval()
    for start, end in spans:
        if not (1 <= start < end <= len(ids) and end - start <= context):
            raise ValueError(f"span ({start}, {end}) does not fit a stream of {len(ids)} and a window of {context}")
    total, count = 0.0, 0
    for i in range(0, len(spans), batch_size):
        chunk = spans[i : i + batch_size]
        firsts = [max(0, end - 1 - context) for _, end in chunk]  # each window: ids[first : end - 1]
        width = max(end - 1 - first for (_, end), first in zip(chunk, firsts, strict=True))
        x = torch.zeros((len(chunk), width), dtype=torch.long)  # (B, T), right-padded
        y = torch.full((len(chunk), width), -100, dtype=torch.long)  # (B, T): -100 is not scored
        for row, ((start, end), first) in enumerate(zip(chunk, firsts, strict=True)):
            n = end - 1 - first
            x[row, :n] = ids[first : end - 1]
            y[row, start - 1 - first : n] = ids[start:end]  # position t predicts token t + 1
        # Right padding is never attended by real positions (causal), so no mask is needed.
        logits = model(x).float()  # (B, T, V)
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum").item()
        count += int((y != -100).sum())
    return total / max(count, 1), count


@torch.no_grad()
def masked_lm_scores(model: EncoderOnly, batches: Iterable[tuple[Tensor, Tensor, Tensor]]) -> tuple[float, float, int]:
    """Mean cross-entropy (nats) and accuracy of a masked-LM's predictions, and their number.

    Each batch is (inputs, valid, labels): the corrupted tokens (B, S), True at real
    (non-padding) tokens (B, S), and the original token at each position to score, a
    negative value elsewhere (B, S). Only the scored positions count.
    """
    model.eval()
    total, correct, count = 0.0, 0, 0
    for inputs, valid, labels in batches:
        scored = labels >= 0  # (B, S)
        if not scored.any():
            continue
        logits = model(inputs, mask=valid, only=scored).float()  # (N, V)
        targets = labels[scored]  # (N,)
        total += F.cross_entropy(logits, targets, reduction="sum").item()
        correct += int((logits.argmax(-1) == targets).sum())
        count += len(targets)
    return total / max(count, 1), correct / max(count, 1), count


def accuracy(predicted: Sequence[Hashable], gold: Sequence[Hashable]) -> float:
    """Fraction of predictions equal to the gold label (0.0 for no examples)."""
    if len(predicted) != len(gold):
        raise ValueError(f"{len(predicted)} predictions but {len(gold)} gold labels")
    return sum(p == g for p, g in zip(predicted, gold, strict=True)) / len(gold) if gold else 0.0


def macro_f1(predicted: Sequence[Hashable], gold: Sequence[Hashable]) -> float:
    """The unweighted mean over classes of F1 = 2·TP / (2·TP + FP + FN).

    The classes are those that occur in ``gold`` or ``predicted`` (as scikit-learn's
    ``f1_score(average="macro")`` takes them); a class never predicted correctly scores 0.
    0.0 for no examples.
    """
    if len(predicted) != len(gold):
        raise ValueError(f"{len(predicted)} predictions but {len(gold)} gold labels")
    classes = set(gold) | set(predicted)
    if not classes:
        return 0.0
    scores = []
    for c in classes:
        tp = sum(p == c and g == c for p, g in zip(predicted, gold, strict=True))
        fp = sum(p == c and g != c for p, g in zip(predicted, gold, strict=True))
        fn = sum(p != c and g == c for p, g in zip(predicted, gold, strict=True))
        scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)
