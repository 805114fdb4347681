"""Tests of qkv.evaluation: exact match and sacreBLEU's BLEU / chrF with signatures."""

from __future__ import annotations

import pytest

from qkv.evaluation import corpus_scores, exact_match

REFS = ["the cat sat on the mat today", "a quick brown fox jumps over the lazy dog"]


def test_exact_match_values():
    assert exact_match(["a", "b", "c", "d"], ["a", "b", "x", "y"]) == 0.5
    assert exact_match(["  one two \n"], ["one two"]) == 1.0  # outer whitespace ignored
    assert exact_match(["one  two"], ["one two"]) == 0.0  # inner whitespace counts
    assert exact_match(["A"], ["a"]) == 0.0
    assert exact_match([], []) == 0.0


def test_exact_match_mismatched_lengths():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        exact_match(["a", "b"], ["a"])


def test_identical_corpus_scores_100():
    scores = corpus_scores(REFS, REFS)
    assert scores["bleu"] == 100.0
    assert scores["chrf"] == 100.0
    assert scores["exact_match"] == 1.0


def test_different_corpus_scores_between_0_and_100():
    hyps = ["the cat sat on a mat today", "a quick brown dog jumps over the lazy fox"]
    scores = corpus_scores(hyps, REFS)
    assert 0 < scores["bleu"] < 100 and 0 < scores["chrf"] < 100
    assert scores["exact_match"] == 0.0


def test_signatures():
    scores = corpus_scores(REFS, REFS)
    assert "nrefs:1" in scores["bleu_signature"] and "tok:13a" in scores["bleu_signature"]
    assert "case:mixed" in scores["bleu_signature"] and "version:" in scores["bleu_signature"]
    assert "nrefs:1" in scores["chrf_signature"] and "version:" in scores["chrf_signature"]
    lower = corpus_scores(REFS, REFS, lowercase=True)
    assert "case:lc" in lower["bleu_signature"]


def test_lowercase_ignores_case():
    upper = [r.upper() for r in REFS]
    assert corpus_scores(upper, REFS)["bleu"] < 100
    assert corpus_scores(upper, REFS, lowercase=True)["bleu"] == 100.0


def test_chinese_tokenizer():
    refs = ["我们今天去公园散步了。", "这本书非常有意思，我推荐给你。"]
    hyps = ["我们今天去公园散步。", "这本书很有意思，我推荐给你。"]
    same = corpus_scores(refs, refs, tokenize="zh")
    assert same["bleu"] == 100.0 and "tok:zh" in same["bleu_signature"]
    close = corpus_scores(hyps, refs, tokenize="zh")
    assert 0 < close["bleu"] < 100
    # Without Chinese word splitting whole sentences are single tokens: no 4-gram matches at all.
    assert corpus_scores(hyps, refs, tokenize="13a")["bleu"] < close["bleu"]


def test_corpus_scores_mismatched_lengths():
    with pytest.raises(ValueError, match="1 hypotheses but 2 references"):
        corpus_scores(REFS[:1], REFS)


def test_tokenized_text_scored_as_tokenized_gets_no_detokenize_warning(caplog):
    # tokenize="none" says the text is tokenized already (bench/mt.py en-de-lc, validation of
    # a model trained on tok/ files): sacreBLEU's "forgot to detokenize" warning would be noise
    # on every epoch. The 13a path still warns, as sacreBLEU intends.
    lines = [f"a dog runs number {i} ." for i in range(120)]
    with caplog.at_level("WARNING", logger="sacrebleu"):
        assert corpus_scores(lines, lines, tokenize="none")["bleu"] == 100.0
    assert "detokenize" not in caplog.text
    with caplog.at_level("WARNING", logger="sacrebleu"):
        corpus_scores(lines, lines, tokenize="13a")
    assert "detokenize" in caplog.text


# Cased, detokenized hypotheses and the same text as the official Multi30k tok/ files write it
# (Moses punctuation normalization and tokenization, lowercased, apostrophes escaped).
RAW = ["Two dogs play in the snow.", "A woman's hat, a man's coat.", "It costs $5.50!"]
TOKENIZED = ["two dogs play in the snow .", "a woman &apos;s hat , a man &apos;s coat .", "it costs $ 5.50 !"]


def test_moses_mode_is_the_official_tok_files_preprocessing():
    """tokenize="moses" (the published Multi30k metric): detokenized, cased hypotheses are
    Moses-normalized, tokenized and lowercased before sacreBLEU scores them, untokenized,
    against the tok/ references; the signature says so. sacreBLEU's own 13a does not match."""
    from qkv.evaluation import moses_lowercased

    assert moses_lowercased(RAW, lang="en") == TOKENIZED
    scores = corpus_scores(RAW, TOKENIZED, tokenize="moses")
    assert scores["bleu"] == 100.0
    assert "tok:none" in scores["bleu_signature"] and "case:lc" in scores["bleu_signature"]
    assert scores["bleu_signature"].endswith("|hyp:moses-lc-en")
    assert corpus_scores(RAW, TOKENIZED)["bleu"] < 100  # 13a, cased: what the tok/ files are not
    assert corpus_scores(RAW, TOKENIZED, lowercase=True)["bleu"] < 100  # 13a splits "&apos;s" apart


def test_evaluate_cli_moses_mode(tmp_path, capsys):
    """qkv evaluate --tokenize moses --json on files: BLEU 100 for the same text, with the signature."""
    import json

    from qkv.cli.main import main

    (tmp_path / "hyp.en").write_text("".join(f"{t}\n" for t in RAW), encoding="utf-8")
    (tmp_path / "ref.en").write_text("".join(f"{t}\n" for t in TOKENIZED), encoding="utf-8")
    argv = ["evaluate", "--hyp", str(tmp_path / "hyp.en"), "--ref", str(tmp_path / "ref.en"), "--tokenize", "moses"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bleu"] == 100.0 and "hyp:moses-lc-en" in result["bleu_signature"]
