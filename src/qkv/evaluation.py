"""Evaluation metrics: exact match, and BLEU / chrF through sacreBLEU (with its signature).

What is here: :func:`exact_match`, :func:`corpus_scores`, :func:`lm_loss` (a language
model's cross-entropy on a token stream, in non-overlapping windows). Metrics come from the
``sacrebleu`` library, never re-implemented; the signature it prints says exactly how a
score was computed (tokenization, casing, version), so scores compare across papers.

What is not here: decoding (``generation.py``), reading files (``cli.py``).
"""

from __future__ import annotations

import sacrebleu
import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.models.decoder_only import DecoderOnly


def exact_match(hypotheses: list[str], references: list[str]) -> float:
    """Fraction of hypotheses equal to their reference after stripping outer whitespace."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not references:
        return 0.0
    return sum(h.strip() == r.strip() for h, r in zip(hypotheses, references, strict=True)) / len(references)


def corpus_scores(
    hypotheses: list[str], references: list[str], *, tokenize: str = "13a", lowercase: bool = False
) -> dict:
    """Corpus BLEU and chrF of ``hypotheses`` against one reference each.

    ``tokenize`` is sacreBLEU's tokenizer ("13a" default, "zh" for Chinese, "none" for
    text that is already tokenized); ``lowercase`` compares case-insensitively.
    Returns {"bleu", "chrf", "exact_match", "bleu_signature", "chrf_signature"}.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu = sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=lowercase)
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
    x = ids[: full * context].view(full, context)  # (W, T): W whole windows
    y = ids[1 : full * context + 1].view(full, context)  # (W, T)
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, full, batch_size)]
    if n % context:
        batches.append((ids[full * context : n][None], ids[full * context + 1 :][None]))  # (1, T'): the rest
    total = 0.0
    for inputs, targets in batches:
        logits = model(inputs)  # (B, T, V)
        flat = logits.flatten(0, 1).float()  # (B*T, V)
        total += F.cross_entropy(flat, targets.flatten(), reduction="sum").item()  # targets (B*T,)
    return total / max(n, 1)
