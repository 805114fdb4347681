"""Tests of ``qkv check`` (qkv.checks and cli/check.py): every check passes on a correct tiny
model of each family, saved with the library; a model broken on purpose (attention that peeks
at the future, a KV cache that drops a step, an explicit path that is off, padding that leaks
into other rows) fails the check that should catch it, and the command then exits 1.

Sizes are tiny and mostly prime (D=15, H=3, F=11, vocabularies of 13 and 17). Every family is
of a layout its Hugging Face architecture expresses (Marian, GPT-2, BERT, Whisper), so the
export round trip is checked too; the text-to-speech model has none.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import qkv.attention
import qkv.blocks
from qkv.audio import FeatureConfig
from qkv.checkpoint import save_model
from qkv.checks import (
    FAIL,
    INFO,
    PASS,
    SKIP,
    batched_equals_alone,
    cached_equals_full,
    causality,
    checked,
    checks,
    explicit_equals_fused,
    fp32_tolerance,
    judged,
    max_difference,
    onnx_round_trip,
    padding_invariance,
    run_checks,
)
from qkv.cli.main import main
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder
from qkv.models.tts import TransformerTTS, TTSConfig
from qkv.tasks.tts import symbol_ids
from qkv.tokenization import FILE, Tokenizer
from qkv.vocoder import write_wav

BLOCK = {"d_model": 15, "n_heads": 3, "d_ff": 11, "dropout": 0.0, "max_len": 23}
HF_LAYOUT = {"norm_first": False, "positions": "learned", "scale_embeddings": False, "activation": "gelu"}
WHISPER = {
    "features": FeatureConfig(kind="whisper", chunk_seconds=1.0),
    "frontend": "whisper",
    "encoder_positions": "whisper",
    "positions": "learned",
    "activation": "gelu",
    "scale_embeddings": False,
    "key_bias": False,
    "ctc": False,
}


def family(name: str) -> torch.nn.Module:
    """A tiny model of ``name``'s family, of a layout its Hugging Face architecture can express."""
    torch.manual_seed(0)
    if name == "translation":  # Marian's layout
        marian = {"norm_first": False, "positions": "sinusoidal_halves", "output_bias": True, "activation": "silu"}
        fields = {"src_vocab_size": 17, "tgt_vocab_size": 17, "share_embeddings": True, "tie_output": True}
        return EncoderDecoder(EncoderDecoderConfig(**BLOCK, **fields, **marian, n_encoder_layers=2, n_decoder_layers=2))
    if name == "language_model":  # GPT-2's
        fields = {**BLOCK, "positions": "learned", "scale_embeddings": False, "activation": "gelu_tanh"}
        return DecoderOnly(DecoderOnlyConfig(**fields, vocab_size=13, n_layers=2, pad_id=0, bos_id=1, eos_id=2))
    if name == "encoder":  # BERT's
        fields = {**BLOCK, **HF_LAYOUT, "embedding_norm": True}  # BertForMaskedLM: no pooler
        return EncoderOnly(EncoderOnlyConfig(**fields, vocab_size=13, n_layers=2))
    if name == "speech":  # Whisper's
        fields = {**BLOCK, "d_model": 16, "n_heads": 2, "max_len": 13, **WHISPER}
        return SpeechEncoderDecoder(SpeechConfig(**fields, vocab_size=11, n_encoder_layers=2, n_decoder_layers=2))
    return TransformerTTS(
        TTSConfig(
            vocab_size=17,
            d_model=16,
            n_heads=2,
            d_ff=23,
            n_encoder_layers=2,
            n_decoder_layers=2,
            dropout=0.0,
            prenet_dim=11,
            postnet_channels=7,
            postnet_layers=3,
            reduction=3,
            max_len=64,
            features=FeatureConfig(n_mels=13),
        )
    )


FAMILIES = ("translation", "language_model", "encoder", "speech", "tts")
APPLIES = {  # the rows that are judged (not SKIP) for each family; bf16 and int8 drift are INFO
    "translation": 8,
    "language_model": 7,
    "encoder": 4,
    "speech": 8,
    "tts": 6,
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny model saved with the library, as a user's model directory is."""
    root = tmp_path_factory.mktemp("models")
    return {name: save_model(family(name).eval(), root / name) for name in FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_every_check_passes_on_a_correct_model_of_each_family(name: str, saved) -> None:
    """No row fails; every check that applies to the family is judged and passes (the export
    round trip included: every family here has a Hugging Face layout but text-to-speech)."""
    rows = list(run_checks(saved[name], grad=name == "speech"))
    assert [r.status for r in rows if r.status == FAIL] == []
    judged = [r for r in rows if r.status == PASS]
    assert len(judged) == APPLIES[name], [(r.name, r.status, r.detail) for r in rows]
    assert all(r.measured <= r.tolerance for r in judged)
    assert all(r.status == SKIP and r.detail for r in rows if r.measured is None)
    drift = [r for r in rows if r.status == INFO]
    assert all(r.tolerance is None and 0 <= r.measured < 1 and "agreement" in r.detail for r in drift)


@pytest.fixture()
def language_model(saved):
    return checked(saved["language_model"])


def test_the_onnx_row_exports_and_runs_the_model_in_onnxruntime(saved) -> None:
    """qkv check --onnx: the language model exported, run in onnxruntime and judged (one graph,
    greedy equal); without --onnx the row is skipped and says how to ask for it."""
    pytest.importorskip("onnxruntime")
    target = checked(saved["language_model"])
    row = onnx_round_trip(target.directory, target.model, target.probe, onnx=True)
    assert row.status == PASS and row.measured <= row.tolerance and "greedy equal: True" in row.detail
    assert "--onnx" in onnx_round_trip(target.directory, target.model, target.probe).detail


def test_attention_that_peeks_at_the_future_fails_causality_and_the_cache(monkeypatch, language_model) -> None:
    """A decoder whose causal mask lets every position see every other (an off-by-all mask)
    fails causality and KV cache == full pass: the checks can fail."""
    m, p = language_model.model, language_model.probe
    assert causality(m, p).status == PASS
    monkeypatch.setattr(qkv.blocks, "causal_mask", lambda t, s, **_: torch.ones(t, s, dtype=torch.bool))
    row = causality(m, p)
    assert row.status == FAIL and row.measured > row.tolerance
    assert cached_equals_full(m, p).status == FAIL


def test_a_cache_that_drops_a_step_fails(monkeypatch, language_model) -> None:
    """A KV cache that loses its oldest step (zeroed, once it holds two) fails the cache check
    alone; one that drops it (a cache one position short) fails it too, the row saying what
    the model raised instead of a traceback."""
    m, p = language_model.model, language_model.probe
    real = qkv.attention.extend_cache

    def forgetful(cache, k, v):
        if isinstance(cache, tuple) and cache[0].shape[2] >= 2:
            cache = tuple(c.index_fill(2, torch.tensor([0]), 0.0) for c in cache)
        return real(cache, k, v)

    monkeypatch.setattr(qkv.attention, "extend_cache", forgetful)
    assert cached_equals_full(m, p).status == FAIL
    assert causality(m, p).status == PASS  # a full pass keeps no cache

    def dropping(cache, k, v):
        if isinstance(cache, tuple) and cache[0].shape[2] >= 2:
            cache = (cache[0][:, :, 1:], cache[1][:, :, 1:])
        return real(cache, k, v)

    monkeypatch.setattr(qkv.attention, "extend_cache", dropping)
    row = next(check() for label, check in checks(language_model) if label == "KV cache")
    assert row.status == FAIL and row.measured is None and row.detail.startswith("raised RuntimeError")


def test_an_explicit_path_that_is_off_fails_explicit_equals_fused(monkeypatch, language_model) -> None:
    """The explicit path off by 1% fails the comparison of the two attention paths, forward and
    with gradients."""
    m, p = language_model.model, language_model.probe
    real = qkv.attention.attention_explicit

    def off(q, k, v, **options):
        out, weights = real(q, k, v, **options)
        return out * 1.01, weights

    monkeypatch.setattr(qkv.attention, "attention_explicit", off)
    assert explicit_equals_fused(m, p).status == FAIL
    assert explicit_equals_fused(m, p, grad=True).status == FAIL


def test_padding_that_leaks_fails_padding_and_batching(monkeypatch, saved) -> None:
    """A padding mask that lets every key through: the padded batch no longer gives each
    input its own encoder output, nor its own translation scores."""
    target = checked(saved["translation"])
    monkeypatch.setattr(qkv.blocks, "padding_mask", lambda valid: torch.ones_like(valid)[:, None, None, :])
    assert padding_invariance(target.model, target.probe).status == FAIL
    assert batched_equals_alone(target.model, target.probe).status == FAIL


def test_the_command_prints_the_table_and_exits_1_on_a_failure(monkeypatch, saved, capsys) -> None:
    """qkv check: a table with one row per check and exit 0; the same model broken: exit 1."""
    assert main(["check", "--model", str(saved["tts"])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["property", "measured", "tolerance", "result"]
    assert len(out) == 1 + len(checks(checked(saved["tts"]))) + 1
    assert sum(" PASS " in line for line in out) == APPLIES["tts"]
    monkeypatch.setattr(qkv.blocks, "causal_mask", lambda t, s, **_: torch.ones(t, s, dtype=torch.bool))
    assert main(["check", "--model", str(saved["tts"])]) == 1
    assert any("causality" in line and " FAIL " in line for line in capsys.readouterr().out.splitlines())


def test_json_output_and_given_inputs(tmp_path: Path, capsys) -> None:
    """--json prints one object whose rows are the table's; --input reads a text file through the
    model's tokenizer, and a speech model's audio file."""
    tokenizer = Tokenizer.train_word_level(["a dog runs", "the cat sleeps on a mat", "birds sing"])
    torch.manual_seed(1)
    v = tokenizer.vocab_size
    config = EncoderDecoderConfig(**BLOCK, src_vocab_size=v, tgt_vocab_size=v, n_encoder_layers=1, n_decoder_layers=1)
    model = save_model(EncoderDecoder(config).eval(), tmp_path / "m", files=tokenizer.save(tmp_path / FILE))
    (tmp_path / "in.txt").write_text("a dog sleeps\n\nthe cat runs on a mat\n", encoding="utf-8")
    assert main(["check", "--model", str(model), "--input", str(tmp_path / "in.txt"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["model"] == str(model)
    assert {r["status"] for r in report["rows"]} <= {PASS, INFO, SKIP}
    assert len(checked(model, given=tmp_path / "in.txt").probe.sources) == 2  # the blank line is left out
    speech = save_model(family("speech").eval(), tmp_path / "speech")
    write_wav(tmp_path / "a.wav", torch.sin(torch.arange(16000) / 5.0) * 0.3, 16000)
    sources = checked(speech, given=tmp_path / "a.wav").probe.sources
    assert [len(s) for s in sources] == [100, 70, 40]  # whole (one second), then cut so a batch pads


def test_given_text_is_read_as_the_models_own_job_reads_it(tmp_path: Path) -> None:
    """--input for a text-to-speech model: each line as qkv speak reads it (lowercase, numbers as
    words), not spelt through its tokenizer (capitals and digits it never saw would be UNK); a
    translation model trained on a recognizer's transcripts: each line read as a transcript."""
    text = "A dog ran 3 laps, Fast."
    tokenizer = Tokenizer.train_char_level(["abcdefghijklmnopqrstuvwxyz ,."])  # what normalize_text writes
    files = tokenizer.save(tmp_path / FILE)
    (tmp_path / "in.txt").write_text(text + "\n", encoding="utf-8")
    torch.manual_seed(0)
    tts = TransformerTTS(dataclasses.replace(family("tts").config, vocab_size=tokenizer.vocab_size))
    saved = save_model(tts.eval(), tmp_path / "tts", files=files)
    (read,) = checked(saved, given=tmp_path / "in.txt").probe.sources
    assert read == symbol_ids(tokenizer, [text])[0] and tokenizer.unk_id not in read  # "a dog ran three laps, fast."
    recipe = {"task": "translation", "data": {"source_as_transcript": True}}
    v = tokenizer.vocab_size
    config = EncoderDecoderConfig(**BLOCK, src_vocab_size=v, tgt_vocab_size=v, n_encoder_layers=1, n_decoder_layers=1)
    cascade = save_model(EncoderDecoder(config).eval(), tmp_path / "mt", files=files, extra={"recipe": recipe})
    (tmp_path / "said.txt").write_text("A dog, Fast.\n", encoding="utf-8")
    (read,) = checked(cascade, given=tmp_path / "said.txt").probe.sources
    assert read == tokenizer.encode("a dog fast")  # as a recognizer writes it: no capitals, no punctuation


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "does not exist"),
        ("no_tokenizer", "tokenizer"),
        ("no_input_file", "does not exist"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(case: str, message: str, saved, tmp_path: Path, capsys) -> None:
    args = {
        "missing": ["--model", str(tmp_path / "nothing")],
        "no_tokenizer": ["--model", str(saved["encoder"]), "--input", __file__],
        "no_input_file": ["--model", str(saved["encoder"]), "--input", str(tmp_path / "none.txt")],
    }[case]
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qkv check: error:") and message in err[0]


def test_a_row_that_measures_no_finite_number_fails_is_null_in_json_and_inf_in_the_table() -> None:
    """Outputs of other shapes, or a NaN, measure inf and fail: the table says inf, JSON (which
    has no inf) null."""
    from qkv.cli.check import table

    nan, inf = torch.tensor([math.nan, 1.0]), torch.tensor([-math.inf, 1.0])
    assert max_difference([nan], [nan]) == math.inf and max_difference([inf], [inf]) == 0
    assert max_difference([inf], [torch.zeros(3)]) == math.inf
    row = judged("x", max_difference([nan], [nan]), fp32_tolerance(nan), "a NaN")
    assert row.status == FAIL
    assert row.as_dict()["measured"] is None and json.dumps(row.as_dict())
    assert " inf " in table([row]) and " FAIL " in table([row])


def test_help_has_an_example(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["check", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "examples:" in out and "qkv check --model" in out
