"""Evaluation metrics: exact match, and BLEU / chrF through sacreBLEU (with its signature).

What is here: :func:`exact_match`, :func:`corpus_scores`. Metrics come from the
``sacrebleu`` library, never re-implemented; the signature it prints says exactly how a
score was computed (tokenization, casing, version), so scores compare across papers.

What is not here: decoding (``generation.py``), reading files (``cli.py``).
"""

from __future__ import annotations

import sacrebleu


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
