"""Constrained decoding: bans (token sequences, words however spelt), required terms
(lexically constrained beam search with dynamic beam allocation) and a forced prefix, through
the engine's searches (mock decoders with known log-probabilities, tiny random models) and
through the bundle's jobs and the command line.

Properties: every output obeys its constraints; without constraints nothing changes, bit for
bit; a required term that greedy decoding misses is found; what cannot be honoured is refused
in one line.
"""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import qkv
from qkv import bundle as bundles
from qkv.audio import FeatureConfig
from qkv.checkpoint import save_model
from qkv.cli.main import main
from qkv.decoding import (
    AT_START,
    BannedSequences,
    BannedWords,
    CTCPrefixScore,
    Required,
    bank_sizes,
    beam_search,
    constrained_beam_search,
    generate,
    greedy,
    sampler,
)
from qkv.errors import OptionError, UserError
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder
from qkv.seq2seq import translate
from qkv.tokenization import FILE, Tokenizer
from test_generation import ScriptedDecoder as Scripted  # the mock Decoder with known log-probabilities

SMALL = {"d_model": 15, "n_heads": 3, "d_ff": 7, "dropout": 0.0}
RATE = 16000


# ----------------------------------------------------------------------------- mock decoders


def table(vocab: int, seed: int, scale: float = 2.0):
    """Fixed random logits for every history."""

    def logits_of(tokens: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed, *tokens)) % 2**31)
        return torch.randn(vocab, generator=g) * scale

    return logits_of


def every_output(logits_of, *, vocab: int, eos: int, cap: int) -> list[tuple[list[int], float]]:
    """Every output of at most ``cap`` tokens with its beam score (length penalty 1), best first."""
    found, frontier = [], [([], 0.0)]
    for step in range(1, cap + 1):
        grown = []
        for tokens, score in frontier:
            logp = logits_of(tokens).log_softmax(-1)
            for t in range(vocab):
                s = score + float(logp[t])
                if t == eos:
                    found.append((tokens, s / step))
                elif step == cap:
                    found.append(([*tokens, t], s / step))
                else:
                    grown.append(([*tokens, t], s))
        frontier = grown
    return sorted(found, key=lambda x: -x[1])


def contains(tokens: list[int], way: tuple[int, ...]) -> bool:
    if way[0] == AT_START:
        return tuple(tokens[: len(way) - 1]) == way[1:]
    return any(tuple(tokens[i : i + len(way)]) == way for i in range(len(tokens)))


# ----------------------------------------------------------------------------- bans


# Token texts of a tiny vocabulary that spells "cat" many ways (ids 0-2: padding, BEGIN, END).
TEXTS = ["", "", "", " ", "c", "at", " cat", "ca", "t", "(", "con"]


def writes_cat(tokens: list[int], after: str = "") -> bool:
    """Whether the text of ``tokens`` writes "cat" where a word starts (what a ban on it means)."""
    return re.search(r"(?<!\w)cat", after + "".join(TEXTS[t] for t in tokens)) is not None


@pytest.mark.parametrize("after", ["", "the c", "con"])
def test_a_banned_word_is_never_written_however_spelt_and_nothing_else_changes(after: str) -> None:
    """With a beam as wide as every prefix, beam search with BannedWords("cat") finds exactly the
    brute-force ranking of the outputs whose text does not write "cat" (" cat", "c" + "at",
    "ca" + "t", "(" + "c" + "at", and "at" right after the text "the c" before them), while
    "concat" stays allowed; the scores are the decoder's."""
    vocab, cap = len(TEXTS), 3
    logits_of = table(vocab, seed=len(after))
    decoder = Scripted(logits_of, vocab_size=vocab)
    ban = BannedWords(["cat"], TEXTS, after=after)
    found = beam_search(decoder, [[5]], beam_size=vocab ** (cap - 1), max_new_tokens=cap, nbest=40, scorers=[ban])[0]
    allowed = [(t, s) for t, s in every_output(logits_of, vocab=vocab, eos=2, cap=cap) if not writes_cat(t, after)]
    assert [h.tokens for h in found] == [t for t, _ in allowed[:40]]
    assert [h.score for h in found] == pytest.approx([s for _, s in allowed[:40]], abs=1e-5)
    everything = every_output(logits_of, vocab=vocab, eos=2, cap=cap)
    assert any(writes_cat(t, after) for t, _ in everything[:8]), "the ban changed nothing"
    assert any("concat" in after + "".join(TEXTS[t] for t in tokens) for tokens, _ in allowed)


def test_banned_words_hold_in_greedy_and_sampling_and_refuse_a_text_that_holds_one() -> None:
    vocab = len(TEXTS)

    def loves_cat(tokens: list[int]) -> torch.Tensor:  # spells "cat" as "c" + "at", then " cat"
        row = torch.zeros(vocab)
        row[[4, 5, 6][min(len(tokens), 2)]] = 6.0
        return row

    def loves_concat(tokens: list[int]) -> torch.Tensor:  # "con" + "c" + "at": no word starts with cat
        row = torch.zeros(vocab)
        row[[10, 4, 5, 2][min(len(tokens), 3)]] = 6.0
        return row

    assert greedy(
        Scripted(loves_concat, vocab_size=vocab), [[5]], max_new_tokens=4, scorers=[BannedWords(["cat"], TEXTS)]
    ) == [[10, 4, 5]]
    decoder = Scripted(loves_cat, vocab_size=vocab)
    assert greedy(decoder, [[5]], max_new_tokens=3) == [[4, 5, 6]]
    ban = BannedWords(["cat"], TEXTS)
    for out in greedy(decoder, [[5]] * 2, max_new_tokens=6, scorers=[ban]):
        assert len(out) == 6 and not writes_cat(out)
    for seed in range(5):
        choose = sampler(temperature=3.0, generator=torch.Generator().manual_seed(seed))
        for out in generate(decoder, [[5]] * 3, max_new_tokens=6, choose=choose, scorers=[ban]):
            assert not writes_cat(out)
    with pytest.raises(ValueError, match="already holds the banned word 'cat'"):
        BannedWords(["cat"], TEXTS, after="a (cat")
    with pytest.raises(ValueError, match="banned words"):
        BannedWords([" cat"], TEXTS)


def test_banned_sequences_are_hugging_faces_bad_words_ids() -> None:
    """A banned sequence never appears (its last token is banned right after the rest of it);
    one token alone is never written; everything else ranks as without the ban."""
    vocab, cap = 6, 4
    logits_of = table(vocab, seed=9)
    decoder = Scripted(logits_of, vocab_size=vocab)
    banned = [[4, 3], [5], [3, 3, 1]]
    scorer = BannedSequences(banned, after=[4])  # no output starts with 3

    def bad(tokens: list[int]) -> bool:
        seen = [4, *tokens]  # "after": the text before the output ends with token 4
        return any(contains(seen, tuple(b)) for b in banned)

    found = beam_search(decoder, [[1]], beam_size=vocab ** (cap - 1), max_new_tokens=cap, nbest=40, scorers=[scorer])
    allowed = [(t, s) for t, s in every_output(logits_of, vocab=vocab, eos=2, cap=cap) if not bad(t)]
    assert [h.tokens for h in found[0]] == [t for t, _ in allowed[:40]]
    assert [h.score for h in found[0]] == pytest.approx([s for _, s in allowed[:40]], abs=1e-5)
    assert sum(bad(t) for t, _ in every_output(logits_of, vocab=vocab, eos=2, cap=cap)[:40]) >= 5
    with pytest.raises(ValueError, match="banned sequences must hold ids"):
        greedy(decoder, [[1]], max_new_tokens=2, scorers=[BannedSequences([[vocab]])])


def test_token_texts_join_into_the_decoded_text() -> None:
    """Tokenizer.token_texts: the texts of a text's tokens, joined, are its decoded text (but
    for a leading space), for each kind of tokenizer qkv trains."""
    corpus = ["the cat sat on the mat (cat) category concat", "ein hund läuft. a dog runs, do re mi: 0123456789"]
    made = [
        Tokenizer.train_char_level(corpus),
        Tokenizer.train_word_level(corpus),
        Tokenizer.train_subword(corpus * 20, vocab_size=41),
    ]
    for tokenizer in made:
        texts = tokenizer.token_texts()
        assert len(texts) == tokenizer.vocab_size and texts[tokenizer.eos_id] == ""
        for line in corpus:
            ids = tokenizer.encode(line)
            assert "".join(texts[t] for t in ids).strip() == tokenizer.decode(ids).strip()


# ----------------------------------------------------------------------------- required terms


def test_bank_sizes_follow_post_and_vilar() -> None:
    assert bank_sizes(5, [9, 9, 9]) == [1, 1, 3]  # W // banks each, the rest to the top bank
    assert bank_sizes(5, [9, 9, 0]) == [1, 4, 0]  # an empty bank passes its places down
    assert bank_sizes(5, [0, 1, 0]) == [0, 1, 0]
    assert bank_sizes(4, [9, 0, 0, 0, 0, 1, 0]) == [3, 0, 0, 0, 0, 1, 0]  # more banks than places
    rng = random.Random(0)
    for _ in range(500):
        beam, counts = rng.randint(1, 8), [rng.randint(0, 4) for _ in range(rng.randint(1, 9))]
        sizes = bank_sizes(beam, counts)
        assert sum(sizes) == min(beam, sum(counts)) and all(0 <= s <= c for s, c in zip(sizes, counts, strict=True))
        if any(counts):  # the most advanced candidates always keep a place
            assert sizes[max(j for j, c in enumerate(counts) if c)] >= 1


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_without_terms_the_constrained_search_is_beam_search(length_penalty: float) -> None:
    """No terms (or only terms the prefix already writes): the same hypotheses and scores as
    beam_search, on mocks and on tiny random models of each decoding family, bans included."""
    decoder = Scripted(table(7, seed=1), vocab_size=7)
    for beam in (1, 2, 3, 5):
        plain = beam_search(decoder, [[1], [2], [3]], beam_size=beam, max_new_tokens=6, nbest=beam)
        assert (
            constrained_beam_search(
                decoder, [[1], [2], [3]], required=[[]] * 3, beam_size=beam, max_new_tokens=6, nbest=beam
            )
            == plain
        )
    written = [[Required(((4,),))]]  # the prefix writes it: nothing left to force
    forced = [1, 4, 3]
    assert constrained_beam_search(
        decoder, [[1]], required=written, beam_size=3, max_new_tokens=5, nbest=3, prefix=forced
    ) == beam_search(decoder, [[1]], beam_size=3, max_new_tokens=5, nbest=3, prefix=forced)
    torch.manual_seed(3)
    ed = EncoderDecoder(
        EncoderDecoderConfig(
            src_vocab_size=17, tgt_vocab_size=13, n_encoder_layers=1, n_decoder_layers=2, max_len=19, **SMALL
        )
    ).eval()
    lm = DecoderOnly(DecoderOnlyConfig(vocab_size=13, n_layers=2, max_len=19, pad_id=0, bos_id=1, eos_id=2, **SMALL))
    rows = [[5, 6, 7, 8], [9, 3], [4, 4, 4, 4, 11, 12]]
    ban = [BannedSequences([[5, 6], [7]])]
    for model in (ed, lm.eval()):
        for beam in (2, 4):
            plain = beam_search(model, rows, beam_size=beam, max_new_tokens=9, nbest=2, scorers=ban)
            same = constrained_beam_search(
                model, rows, required=[[]] * 3, beam_size=beam, max_new_tokens=9, nbest=2, scorers=ban
            )
            assert same == plain


def random_terms(rng: random.Random, tokens: list[int]) -> list[Required]:
    terms = []
    for _ in range(rng.randint(0, 3)):
        ways = {tuple(rng.choice(tokens) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 2))}
        if rng.random() < 0.3:
            ways.add((AT_START, rng.choice(tokens), rng.choice(tokens)))
        terms.append(Required(tuple(sorted(ways))))
    return terms


def test_every_required_term_is_written_when_the_cap_leaves_room() -> None:
    """On random mock decoders and random terms (shared tokens, several ways, ways that count
    only at the start, a forced prefix), every output holds every term as soon as the cap leaves
    room for all their tokens, whatever the beam; a batch decodes as its inputs one by one."""
    vocab, tokens = 9, [0, 3, 4, 5, 6, 7, 8]
    for seed in range(120):
        rng = random.Random(seed)
        decoder = Scripted(table(vocab, seed, scale=3.0), vocab_size=vocab)
        required = [random_terms(rng, tokens) for _ in range(rng.randint(1, 3))]
        caps = [max(1, sum(max(len(w) - (w[0] == AT_START) for w in t.ways) for t in r)) for r in required]
        caps = [c + rng.randint(0, 2) for c in caps]
        beam = rng.randint(1, 5)
        prefix = [1, *rng.choices([3, 4], k=rng.randint(0, 2))] if rng.random() < 0.5 else None
        found = constrained_beam_search(
            decoder, [[1]] * len(required), required=required, beam_size=beam, max_new_tokens=caps, prefix=prefix
        )
        for terms, cap, hyps in zip(required, caps, found, strict=True):
            alone = constrained_beam_search(
                decoder, [[1]], required=[terms], beam_size=beam, max_new_tokens=cap, prefix=prefix
            )
            assert alone[0] == hyps
            written = [*(prefix or [1])[1:], *hyps[0].tokens]  # a start-only way: where the prefix starts
            for term in terms:
                assert any(contains(written, w) for w in term.ways), (seed, terms, written)


def test_constrained_beam_finds_a_required_word_that_greedy_misses() -> None:
    """The mock likes 3 3 3 END and dislikes token 4; a required 4 is in every output of the
    constrained search (the best first, then those without it), never in greedy's or beam's."""

    def dislikes_4(tokens: list[int]) -> torch.Tensor:
        row = torch.tensor([0.0, 0.0, 0.0, 4.0, -3.0, 1.0])
        if len(tokens) >= 3:
            row[2] = 9.0
        return row

    decoder = Scripted(dislikes_4, vocab_size=6)
    assert greedy(decoder, [[1]], max_new_tokens=8) == [[3, 3, 3]]
    assert all(4 not in h.tokens for h in beam_search(decoder, [[1]], beam_size=4, max_new_tokens=8, nbest=4)[0])
    found = constrained_beam_search(
        decoder, [[1]], required=[[Required(((4,),))]], beam_size=4, max_new_tokens=8, nbest=4
    )
    assert len(found[0]) == 4 and all(4 in h.tokens and len(h.tokens) <= 8 for h in found[0])
    assert [h.score for h in found[0]] == sorted((h.score for h in found[0]), reverse=True)


def test_the_constrained_search_refuses_what_it_cannot_honour() -> None:
    decoder = Scripted(table(5, seed=0), vocab_size=5)
    with pytest.raises(ValueError, match="2 lists of required terms for 1 inputs"):
        constrained_beam_search(decoder, [[1]], required=[[], []], beam_size=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="partial scorer"):
        constrained_beam_search(
            decoder, [[1]], required=[[]], beam_size=2, max_new_tokens=3, scorers=[CTCPrefixScore(0.3)]
        )
    with pytest.raises(ValueError, match="non-empty token sequences"):
        Required(((),))
    with pytest.raises(ValueError, match="AT_START may only begin a way"):
        Required(((3, AT_START),))


# ----------------------------------------------------------------------------- the jobs


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random model directories of the three decoding kinds, with one character tokenizer."""
    root = tmp_path_factory.mktemp("constrained")
    tokenizer = Tokenizer.train_char_level(["ein hund läuft. a dog runs, do re mi: 0123456789"])
    tokenizer.save(root / FILE)
    files = {FILE: root / FILE}
    v = tokenizer.vocab_size
    ids = {"pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    torch.manual_seed(0)
    speech = {"vocab_size": v, "n_encoder_layers": 1, "n_decoder_layers": 1, "max_len": 13, **SMALL, **ids}
    made = {
        "de_en": EncoderDecoder(
            EncoderDecoderConfig(
                src_vocab_size=v, tgt_vocab_size=v, n_encoder_layers=1, n_decoder_layers=1, max_len=29, **SMALL, **ids
            )
        ),
        "lm": DecoderOnly(DecoderOnlyConfig(vocab_size=v, n_layers=1, max_len=17, **SMALL, **ids)),
        "asr": SpeechEncoderDecoder(SpeechConfig(features=FeatureConfig(n_mels=19), ctc=True, **speech)),
    }
    paths = {name: save_model(model.eval(), root / name, files=files) for name, model in made.items()}
    marian = {"hf": {"architecture": "MarianMTModel", "bad_words_ids": [[tokenizer.encode("u")[0]], [5, 10]]}}
    paths["imported"] = save_model(made["de_en"], root / "imported", files=files, extra=marian)
    return paths


def waves(n: int) -> list[np.ndarray]:
    t = np.arange(RATE // 2) / RATE
    return [(0.3 * np.sin(2 * np.pi * (200 + 90 * i + 400 * t) * t)).astype(np.float32) for i in range(n)]


TEXTS_IN = ["ein hund läuft.", "a dog", "do re mi", ""]


def test_no_constraints_change_nothing_bit_for_bit(models) -> None:
    """Empty constraints are no constraints: every job gives the same outputs, scores included."""
    ed, lm, asr = (qkv.load(models[k]) for k in ("de_en", "lm", "asr"))
    plain = translate(ed.model, ed.vocab, TEXTS_IN, beam_size=ed.decode.beam_size)
    assert bundles.translations(ed, TEXTS_IN, prefix=None, ban=[], require=[], terms=[]) == plain
    for m, beam in itertools.product((ed, lm), (1, 3)):
        assert bundles.generations(m, TEXTS_IN, beam_size=beam, ban=(), require=()) == bundles.generations(
            m, TEXTS_IN, beam_size=beam
        )
    audio = waves(2)
    assert asr.transcribe(audio, ban=[], require=[]) == asr.transcribe(audio)


def test_a_prefix_starts_every_output_of_every_family(models) -> None:
    ed, lm, asr = (qkv.load(models[k]) for k in ("de_en", "lm", "asr"))
    for text in ed.translate(TEXTS_IN[:3], prefix="a do"):
        assert text.startswith("a do")
    found = bundles.translations(ed, ["ein hund"], prefix="a do", nbest=2)[0]
    assert all(t.tokens[:4] == ed.vocab.target.encode("a do") for t in found)
    for m in (ed, lm):
        for beam in (1, 3):
            assert all(
                g[0].text.startswith(" mi") for g in bundles.generations(m, TEXTS_IN[:3], beam_size=beam, prefix=" mi")
            )
    drawn = lm.generate(["do", "re"], prefix=" mi", sampling=bundles.Sampling(seed=3))
    assert all(text.startswith(" mi") for text in drawn)
    assert lm.generate("do", prefix=" mi", max_new_tokens=5).startswith(" mi")  # not streamed: written whole
    assert all(text.startswith("do re") for text in asr.transcribe(waves(2), prefix="do re"))


def test_banned_words_never_appear_in_any_job(models) -> None:
    """Words the unconstrained outputs write are banned: no output of any search writes them
    where a word starts (the character tokenizer spells every word in several tokens)."""
    ed, lm, asr = (qkv.load(models[k]) for k in ("de_en", "lm", "asr"))
    for m in (ed, lm):
        before = [g[0].text for g in bundles.generations(m, TEXTS_IN, beam_size=3, max_new_tokens=12)]
        ban = sorted({w[:2] for text in before for w in re.findall(r"\w+", text)})[:2]
        assert ban, "nothing to ban"
        for beam, sampling in ((1, None), (3, None), (1, bundles.Sampling(seed=1))):
            outs = bundles.generations(m, TEXTS_IN, beam_size=beam, sampling=sampling, ban=ban, max_new_tokens=12)
            assert not any(re.search(r"(?<!\w)" + w, g[0].text) for g in outs for w in ban), (ban, outs)
    joint = bundles.OwnModelOptions(ctc_weight=0.3)
    heard = [t.text for t in bundles.transcriptions(asr, waves(3), bundles.TranscriptionOptions(own=joint))]
    ban = sorted({w[:2] for text in heard for w in re.findall(r"\w+", text)})[:1]
    banned = bundles.transcriptions(asr, waves(3), bundles.TranscriptionOptions(ban=ban, own=joint))  # with CTC
    assert ban and not any(re.search(r"(?<!\w)" + ban[0], t.text) for t in banned)
    texts = ed.translate(TEXTS_IN[:3], ban=["uu", "8"])
    assert texts != ed.translate(TEXTS_IN[:3]) and not any(re.search(r"(?<!\w)(uu|8)", t) for t in texts)


def test_required_words_and_terms_are_always_written(models) -> None:
    ed, lm, asr = (qkv.load(models[k]) for k in ("de_en", "lm", "asr"))
    assert not any("dog" in t for t in ed.translate(TEXTS_IN[:3]))
    for text in ed.translate(TEXTS_IN[:3], require=["dog", "mi"]):
        assert "dog" in text and "mi" in text
    found = bundles.translations(ed, TEXTS_IN[:3], terms=[("hund", "dog"), ("do", "mi: 0")], nbest=2)
    assert all("dog" in t.text and "mi: 0" not in t.text for t in found[0])  # "hund" is there, "do" is not
    assert all("dog" not in t.text for t in found[1])  # "a dog": neither source
    assert all("mi: 0" in t.text for t in found[2])
    assert ed.translate("a dog", prefix="a dog", require=["dog"]) == ed.translate("a dog", prefix="a dog")
    for m in (ed, lm):  # after a prefix, a required word starts a word: never glued to the prefix's end
        for g in bundles.generations(m, ["a dog", "do re"], beam_size=2, prefix="a", require=["dog"], max_new_tokens=9):
            assert re.search(r"(?<!\w)dog", g[0].text), g[0].text
    for m in (ed, lm):  # (the language model's window leaves room after short prompts)
        for g in bundles.generations(m, ["a dog", "do re"], beam_size=2, require=["hund"], max_new_tokens=9):
            assert "hund" in g[0].text
    required = bundles.TranscriptionOptions(require=["re"], own=bundles.OwnModelOptions(ctc_weight=0))
    assert all("re" in t.text for t in bundles.transcriptions(asr, waves(2), required))


def test_an_imported_checkpoints_bad_words_ids_are_applied(models) -> None:
    """The same weights with ``bad_words_ids`` in config.json's ``hf`` record: the banned token
    ("u", which the model otherwise writes) never appears; the two-token sequence neither."""
    plain, imported = qkv.load(models["de_en"]), qkv.load(models["imported"])
    u = plain.vocab.target.encode("u")[0]
    before = bundles.translations(plain, TEXTS_IN[:3])
    after = bundles.translations(imported, TEXTS_IN[:3])
    assert any(u in t[0].tokens for t in before)
    assert all(u not in t[0].tokens and not contains(t[0].tokens, (5, 10)) for t in after)
    assert all(u not in g[0].tokens for g in bundles.generations(imported, TEXTS_IN[:3], beam_size=2))


def test_what_cannot_be_honoured_is_refused_in_one_line(models, tmp_path, capsys) -> None:
    ed, lm, asr = (qkv.load(models[k]) for k in ("de_en", "lm", "asr"))
    with pytest.raises(OptionError, match="require needs beam search: beam_size 1 is greedy") as refused:
        lm.generate(["do"], require=["dog"])
    assert refused.value.said({"beam_size": "--beam"}) == "--require needs beam search: --beam 1 is greedy decoding"
    with pytest.raises(OptionError, match="require needs beam search: sampling draws each token"):
        lm.generate(["do"], require=["dog"], sampling=bundles.Sampling())
    with pytest.raises(OptionError, match="terms needs beam search"):
        ed.translate(["do"], beam_size=1, terms=[("do", "re")])
    joint, ctc_only = bundles.OwnModelOptions(ctc_weight=0.3), bundles.OwnModelOptions(ctc_only=True)
    with pytest.raises(OptionError, match="give ctc_weight 0"):
        bundles.transcriptions(asr, waves(1), bundles.TranscriptionOptions(require=["re"], own=joint))
    with pytest.raises(OptionError, match="ctc_only decodes with the CTC head alone: no prefix or ban"):
        bundles.transcriptions(asr, waves(1), bundles.TranscriptionOptions(prefix="do", ban=["re"], own=ctc_only))
    with pytest.raises(OptionError, match="prefix 'a dog' writes the banned word 'dog'"):
        ed.translate(["do"], prefix="a dog", ban=["dog"])
    with pytest.raises(OptionError, match="'dog' is both banned and required"):
        ed.translate(["do"], ban=["dog"], require=["dog"])
    with pytest.raises(OptionError, match="require 'Zürich': the model's vocabulary cannot write it"):
        ed.translate(["do"], require=["Zürich"])
    with pytest.raises(OptionError, match=r"prefix .* is 15 tokens; the model.s window takes at most 14"):
        ed.translate(["do"], prefix="a" * 15)
    with pytest.raises(OptionError, match="ban is a list of words"):
        ed.translate(["do"], ban="dog")
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("hund\tdog\n\nläuft runs\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"terms.tsv:3: expected SOURCE<TAB>TARGET"):
        bundles.read_terms(glossary)
    text = tmp_path / "in.txt"
    text.write_text("ein hund\n", encoding="utf-8")
    common = ["--model", str(models["de_en"]), "--input", str(text), "--quiet"]
    assert main(["translate", *common, "--terms", str(glossary)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv translate: error: ") and "terms.tsv:3:" in err and "\n" not in err
    assert main(["generate", "--model", str(models["lm"]), "--prompt", "do", "--require", "dog"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "qkv generate: error: --require needs beam search: --beam 1 is greedy decoding"
    glossary.write_text("hund\tdog\n", encoding="utf-8")
    assert (
        main(["translate", *common, "--terms", str(glossary), "--prefix", " ", "--ban", "mi", "--require", "re"]) == 0
    )
    written = capsys.readouterr().out
    assert written.startswith(" ") and "dog" in written and "re" in written
