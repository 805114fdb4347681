"""Tests of qkv.tokenization: word-level and subword tokenizers, special ids, files, errors, subword sampling."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from qkv.errors import UserError
from qkv.tasks.numbers import numbers_pairs
from qkv.tokenization import SegmentationSampler, Tokenizer, Vocabularies

SENTENCE = "four thousand three hundred seventeen"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    pairs = numbers_pairs(300, seed=0, held_out=False)
    return Tokenizer.train_word_level([s for pair in pairs for s in pair] + ["4,317", SENTENCE])


def test_special_ids(tokenizer):
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
    assert [tokenizer.id_to_token(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]


def test_digits_are_split_one_by_one(tokenizer):
    assert tokenizer.tokens("4,317") == ["4", ",", "3", "1", "7"]
    assert len(tokenizer.encode("4,317")) == 5
    assert tokenizer.tokens("905017") == list("905017")


def test_encode_decode_round_trip(tokenizer):
    ids = tokenizer.encode(SENTENCE)
    assert len(ids) == 5
    assert all(i >= 4 for i in ids)  # no special or unknown token
    assert tokenizer.decode(ids) == SENTENCE
    # Special tokens are skipped when decoding.
    assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id, tokenizer.pad_id]) == SENTENCE


def test_unknown_word_is_unk(tokenizer):
    ids = tokenizer.encode("four zebra")
    assert ids == [tokenizer.encode("four")[0], tokenizer.unk_id]


def test_encode_batch_matches_encode(tokenizer):
    texts = ["12", SENTENCE, "4,317"]
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]


def test_save_load_round_trip(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.vocab_size == tokenizer.vocab_size
    texts = ["4,317", SENTENCE, "zebra 99"]
    assert loaded.encode_batch(texts) == tokenizer.encode_batch(texts)
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_id, loaded.unk_id) == (0, 1, 2, 3)
    assert loaded.same_as(tokenizer) and tokenizer.same_as(loaded)


def test_same_as_tells_vocabularies_and_settings_apart(tokenizer, tmp_path):
    other = Tokenizer.train_word_level(["a wholly different vocabulary"])
    assert not tokenizer.same_as(other)
    tokenizer.save(tmp_path / "tokenizer.json")
    adding = Tokenizer.load(tmp_path / "tokenizer.json")
    adding.add_special_tokens = not tokenizer.add_special_tokens
    assert not tokenizer.same_as(adding)
    joint = Vocabularies.of(tokenizer)
    assert joint.same_as(Vocabularies.of(Tokenizer.load(tmp_path / "tokenizer.json")))
    assert not joint.same_as(Vocabularies(tokenizer, Tokenizer.load(tmp_path / "tokenizer.json")))  # joint vs separate


def test_tables_pair_each_tokenizer_with_the_table_it_must_fit(tokenizer, tmp_path):
    """Joint: one tokenizer.json, whose ids index both tables (the smaller counts); separate:
    tokenizer.json the source table, target_tokenizer.json the target's."""
    assert Vocabularies.of(tokenizer).tables(src_vocab_size=41, tgt_vocab_size=37) == [
        (tokenizer, "tokenizer.json", 37)
    ]
    tokenizer.save(tmp_path / "tokenizer.json")
    target = Tokenizer.load(tmp_path / "tokenizer.json")
    assert Vocabularies(tokenizer, target).tables(src_vocab_size=41, tgt_vocab_size=37) == [
        (tokenizer, "tokenizer.json", 41),
        (target, "target_tokenizer.json", 37),
    ]


def test_load_garbage_file_is_user_error(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(b"this is not a tokenizer \xff\x00")
    with pytest.raises(UserError, match=r"tokenizer\.json"):
        Tokenizer.load(path)


def test_load_missing_file_is_user_error(tmp_path):
    with pytest.raises(UserError, match=r"nope\.json"):
        Tokenizer.load(tmp_path / "nope.json")


def test_add_special_tokens_appends_end_and_survives_save_load(tokenizer, tmp_path):
    """A tokenizer whose post-processor ends texts with END (a converted Marian one) adds it on
    encode, keeps the setting through save/load, and leaves it out when asked (targets)."""
    from tokenizers import processors

    tokenizer.save(tmp_path / "tokenizer.json")
    adding = Tokenizer.load(tmp_path / "tokenizer.json")  # a copy, changed below
    adding.backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])
    adding.add_special_tokens = True
    plain = tokenizer.encode(SENTENCE)
    assert adding.encode(SENTENCE) == [*plain, adding.eos_id]
    assert adding.encode_batch([SENTENCE]) == [[*plain, adding.eos_id]]
    assert adding.encode_batch([SENTENCE], add_special_tokens=False) == [plain]
    (tmp_path / "b").mkdir()
    adding.save(tmp_path / "b" / "tokenizer.json")
    reloaded = Tokenizer.load(tmp_path / "b" / "tokenizer.json")
    assert reloaded.add_special_tokens and reloaded.encode(SENTENCE) == [*plain, reloaded.eos_id]


def test_segmented_and_unsegmented_chinese_give_the_same_pieces() -> None:
    """Tatoeba's Chinese is word-segmented; people type it without spaces. The subword
    tokenizer drops spaces next to Chinese characters and CJK punctuation, in training and in
    encoding, so both forms give the same ids and output decodes as ordinary Chinese. English
    spacing is untouched."""
    texts = ["我 爱 你 。", "Tom 是 我 的 朋友 ！", "我 有 3 个 苹果 。", "I love you .", "Tom is my friend !"] * 20
    tokenizer = Tokenizer.train_subword(texts, vocab_size=60)
    assert tokenizer.encode("我 爱 你 。") == tokenizer.encode("我爱你。")
    assert tokenizer.encode("Tom 是 我 的 朋友 ！") == tokenizer.encode("Tom是我的朋友！")
    assert tokenizer.decode(tokenizer.encode("我 有 3 个 苹果 。")) == "我有3个苹果。"
    assert tokenizer.decode(tokenizer.encode("I love you .")) == "I love you ."


def test_subword_newlines_are_pieces_and_text_round_trips(tmp_path) -> None:
    """newlines=True (a language model's running text): "\\n" is one piece that no other piece
    contains, the first word of a line gets the same "▁word" piece as mid-line, and decoding
    gives the text back (blank lines, indentation and double spaces included), from the saved
    file too; every prefix of the ids decodes to a prefix of the text (streamed output)."""
    text = "the cat sat\non the mat.\n\nthe dog  sat\n  on the cat\nthe end\n" * 15
    tokenizer = Tokenizer.train_subword([text], vocab_size=40, newlines=True)
    newline = tokenizer.backend.token_to_id("\n")
    assert tokenizer.encode("the end\nthe cat").count(newline) == 1
    assert all("\n" not in tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size) if i != newline)
    assert tokenizer.tokens("the cat\nthe cat") == [*tokenizer.tokens("the cat"), "\n", *tokenizer.tokens("the cat")]
    sample = "the dog\n\n  on the  mat.\nthe end"
    ids = tokenizer.encode(sample)
    assert tokenizer.decode(ids) == sample and tokenizer.decode(tokenizer.encode(text)) == text
    assert all(sample.startswith(tokenizer.decode(ids[:n])) for n in range(len(ids) + 1))
    tokenizer.save(tmp_path / "tokenizer.json")
    assert Tokenizer.load(tmp_path / "tokenizer.json").encode(sample) == ids
    plain = Tokenizer.train_subword(text.splitlines(), vocab_size=40)
    assert plain.decode(plain.encode("the cat\nthe dog")) != "the cat\nthe dog"  # what the option is for


SAMPLED = [
    "a man in a blue shirt is riding a bicycle .",
    "zwei hunde spielen im schnee miteinander .",
    "Tom 是 我 的 朋友 ！",
    "我爱你。",
    "the children are playing football outside",
    " a man riding",  # a leading space: SentencePiece would read an extra "▁"
    "",
]


@pytest.fixture(scope="module")
def unigram() -> Tokenizer:
    words = "a man woman in blue red shirt is riding bicycle bicycles ride zwei hunde hund spielen im schnee".split()
    rng = random.Random(3)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(400)]
    return Tokenizer.train_subword([*texts, *SAMPLED[2:4]], vocab_size=80)


def test_sampler_best_segmentation_is_encode(unigram) -> None:
    """The first of the l-best (from SentencePiece, rebuilt from the tokenizer's pieces) is
    what the ``tokenizers`` unigram model gives: same pieces, same ids, Chinese included."""
    sampler = SegmentationSampler(unigram, SAMPLED, nbest=8, alpha=0.5)
    assert len(sampler) == len(SAMPLED)
    assert sampler.best() == unigram.encode_batch(SAMPLED)


def test_sampler_draws_other_segmentations_of_the_same_text_reproducibly(unigram) -> None:
    sampler = SegmentationSampler(unigram, SAMPLED * 10, nbest=16, alpha=0.2)
    first, again, other = sampler.sample([0, 1]), sampler.sample([0, 1]), sampler.sample([0, 2])
    assert first == again and first != other  # a function of the seed
    assert first != sampler.best()  # other segmentations are drawn...
    assert [unigram.decode(ids) for ids in first] == [
        unigram.decode(ids) for ids in sampler.best()
    ]  # ...of the same text
    # A large alpha makes the best segmentation (far more probable than the next) almost certain.
    assert SegmentationSampler(unigram, SAMPLED, nbest=16, alpha=1000.0).sample([0]) == sampler.best()[: len(SAMPLED)]


def test_sampler_frequencies_follow_p_to_the_alpha(unigram) -> None:
    """Each segmentation is scored by the sum of its pieces' log probabilities (the scores in
    tokenizer.json), best first, and draws follow P^alpha over the l-best (Kudo, 2018, eq. 10)."""
    text = "bicycles riding"
    sampler = SegmentationSampler(unigram, [text] * 4000, nbest=4, alpha=0.5)
    pieces = dict(json.loads(unigram.backend.to_str())["model"]["vocab"])
    segmentations = [sampler._segmentation(0, k) for k in range(4) if np.isfinite(sampler._scores[0, k])]
    assert len(segmentations) > 1 and len({tuple(x) for x in segmentations}) == len(segmentations)
    scores = [sum(pieces[unigram.id_to_token(i)] for i in ids) for ids in segmentations]
    assert np.allclose(sampler._scores[0, : len(scores)], scores) and scores == sorted(scores, reverse=True)
    assert all(unigram.decode(ids) == text for ids in segmentations)
    expected = torch.softmax(torch.tensor(0.5 * np.asarray(scores)), 0).float()
    drawn = sampler.sample([7])
    observed = torch.tensor([sum(d == s for d in drawn) / len(drawn) for s in segmentations])
    assert torch.allclose(observed, expected, atol=0.03)


def test_sampler_refuses_what_it_cannot_read_alike(unigram, tmp_path) -> None:
    """Not a unigram model, or one read otherwise than by Metaspace: a clear error each."""
    with pytest.raises(UserError, match="subword sampling needs a unigram vocabulary; this tokenizer's is WordLevel"):
        SegmentationSampler(Tokenizer.train_word_level(["a b"]), ["a b"], nbest=4, alpha=0.1)
    spec = json.loads(unigram.backend.to_str())
    spec["pre_tokenizer"]["split"] = False
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match=r"needs Metaspace that splits words \(split: true\)"):
        SegmentationSampler(Tokenizer.load(tmp_path / "tokenizer.json"), ["a b"], nbest=4, alpha=0.1)
