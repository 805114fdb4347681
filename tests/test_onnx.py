"""ONNX export (qkv export-onnx): every family's graphs equal PyTorch in onnxruntime, and a greedy
decode driven entirely through onnxruntime equals qkv's, token for token (a text-to-speech
model's synthesis: the same stop decisions and frames).

Tiny random models of each exported family (text encoder-decoder, speech encoder-decoder with a
CTC head, decoder-only, encoder-only, Transformer-TTS) are exported once per module; the real Whisper tiny.en is
checked in a slow test when it has been fetched (bench/fetch_whisper_tiny.sh).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from qkv.audio import FeatureConfig, features
from qkv.checkpoint import save_model
from qkv.cli.main import main
from qkv.decoding import greedy
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder
from qkv.models.tts import TransformerTTS, TTSConfig
from qkv.onnx_export import export_onnx, read_source
from qkv.onnx_runtime import MANIFEST, OnnxModel
from qkv.onnx_verify import TOLERANCE, verify, voice_like
from qkv.tokenization import FILE, Tokenizer

SMALL = {"d_model": 15, "n_heads": 3, "d_ff": 7, "dropout": 0.0}
WHISPER = Path("/tmp/whisper-tiny.en")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random model directory of each family, with one character tokenizer: between them
    sinusoidal, learned and rotary positions, and grouped-query attention."""
    root = tmp_path_factory.mktemp("onnx_models")
    tokenizer = Tokenizer.train_char_level(["a man is riding a bicycle. two dogs play in the snow: 0123456789"])
    tokenizer.save(root / FILE)
    files = {FILE: root / FILE}
    v = tokenizer.vocab_size
    ids = {"pad_id": tokenizer.pad_id, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    torch.manual_seed(0)
    made = {
        "translation": EncoderDecoder(
            EncoderDecoderConfig(src_vocab_size=v, tgt_vocab_size=v, n_encoder_layers=1, n_decoder_layers=2,
                                 max_len=29, **SMALL, **ids)
        ),
        "lm": DecoderOnly(  # RoPE with grouped-query attention (3 query heads share one key/value head)
            DecoderOnlyConfig(vocab_size=v, n_layers=1, max_len=31, positions="rope", n_kv_heads=1, head_dim=6,
                              **SMALL, **ids)
        ),
        "asr": SpeechEncoderDecoder(
            SpeechConfig(vocab_size=v, n_encoder_layers=1, n_decoder_layers=1, max_len=13, conv_channels=5,
                         positions="learned", features=FeatureConfig(n_mels=19), **SMALL, **ids)
        ),
        "bert": EncoderOnly(EncoderOnlyConfig(vocab_size=v, n_layers=1, max_len=23, pad_id=tokenizer.pad_id, **SMALL)),
        "tts": TransformerTTS(
            TTSConfig(vocab_size=v, n_encoder_layers=1, n_decoder_layers=1, max_len=11, prenet_dim=11,
                      postnet_channels=7, postnet_layers=2, reduction=3, features=FeatureConfig(n_mels=19),
                      pad_id=tokenizer.pad_id, d_model=16, n_heads=2, d_ff=23, dropout=0.0)
        ),
    }  # fmt: skip
    with torch.no_grad():  # weights (found by trying) that stop one TTS sentence at frame 4, the other at the cap
        made["tts"].stop_head.weight.mul_(3.0)
        made["tts"].stop_head.bias.fill_(-2.0)
        made["tts"].decoder_positions.alpha.fill_(0.0)
    return {name: save_model(model, root / name, files=files) for name, model in made.items()}


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory) -> dict[str, Path]:
    """The decoding families exported once (the translation model with its int8 copies)."""
    root = tmp_path_factory.mktemp("onnx_out")
    out = {}
    for name in ("translation", "lm", "asr"):
        out[name] = root / name
        export_onnx(read_source(models[name]), out[name], int8=name == "translation")
    return out


@pytest.mark.parametrize("family", ["translation", "lm", "asr"])
def test_every_graph_equals_pytorch_and_greedy_through_onnxruntime_equals_qkv(models, exported, family) -> None:
    int8 = family == "translation"  # the one exported with int8 copies
    report = verify(read_source(models[family]), exported[family], int8=int8)
    for name, graph in report["graphs"].items():
        assert graph["max_abs_diff"] <= TOLERANCE, (name, graph)
        assert 0 < graph["fp32_vs_fp64"] < TOLERANCE  # rounding's scale, measured beside
    assert report["greedy"]["onnxruntime"] == report["greedy"]["qkv"]
    assert sum(len(row) for row in report["greedy"]["qkv"]) > 0  # something was decoded
    assert report["passed"]
    manifest = json.loads((exported[family] / MANIFEST).read_text())
    expected = ["decoder_step"] if family == "lm" else ["encoder", "decoder_step"]
    assert list(manifest["graphs"]) == expected
    assert {g["exporter"] for g in manifest["graphs"].values()} == {"dynamo"}
    assert (exported[family] / FILE).is_file()  # the tokenizer travels with the graphs
    if int8:  # the int8 copies' drift is reported, never failed
        assert set(report["int8"]["graphs"]) == set(expected)
        assert all(np.isfinite(d) and d > 0 for d in report["int8"]["graphs"].values())  # not the same numbers
        assert 0.0 <= report["int8"]["token_agreement"] <= 1.0
        assert all((exported[family] / g["int8"]).is_file() for g in manifest["graphs"].values())


def test_batch_and_lengths_are_dynamic_axes(exported) -> None:
    step = json.loads((exported["translation"] / MANIFEST).read_text())["graphs"]["decoder_step"]
    shapes = {i["name"]: i["shape"] for i in step["inputs"]}
    assert shapes["tokens"] == ["batch", "new"]
    assert shapes["past_keys"][1] == "batch" and shapes["past_keys"][3] == "past"
    assert shapes["cross_keys"][3] == "source"
    assert [o["name"] for o in step["outputs"]] == ["logits", "present_keys", "present_values"]


def test_onnxruntime_greedy_equals_qkv_on_batches_prefixes_and_empty_prompts(models, exported) -> None:
    source = read_source(models["translation"])
    bos = source.model.config.bos_id
    inputs = [[5, 9, 11, 13, 7], [8], [17, 19, 23]]  # three lengths: one padded batch
    for prefix in (None, [bos, 7, 5]):
        ours = greedy(source.model, inputs, max_new_tokens=40, prefix=prefix)
        assert OnnxModel(exported["translation"]).greedy(inputs, max_new_tokens=40, prefix=prefix) == ours
    lm = read_source(models["lm"])
    prompts = [[5, 9, 11, 13, 7], [], [17, 19]]  # left-padded, one starting from BEGIN
    ours = greedy(lm.model, prompts, max_new_tokens=40)  # up to the window: positions reach its end
    assert OnnxModel(exported["lm"]).greedy(prompts, max_new_tokens=40) == ours


def test_speech_greedy_through_onnxruntime_equals_qkv_on_a_padded_batch(models, exported) -> None:
    source = read_source(models["asr"])
    feats = [features(voice_like(s, 16000), source.model.config.features) for s in (0.9, 0.4, 0.6)]
    ours = greedy(source.model, feats, max_new_tokens=20)
    assert OnnxModel(exported["asr"]).greedy([f.numpy() for f in feats], max_new_tokens=20) == ours


def test_cli_exports_and_verifies_an_encoder_only_model(models, tmp_path, capsys) -> None:
    # TorchScript here: a dynamo export costs seconds, and its encoder stack is the translation
    # model's, which the dynamo exporter makes above.
    out = tmp_path / "bert_onnx"
    command = ["export-onnx", "--model", str(models["bert"]), str(out), "--exporter", "torchscript"]
    assert main([*command, "--verify", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert list(said["manifest"]["graphs"]) == ["encoder"]
    assert said["manifest"]["graphs"]["encoder"]["exporter"] == "torchscript"
    assert said["verify"]["graphs"]["encoder"]["max_abs_diff"] <= TOLERANCE
    assert "greedy" not in said["verify"]  # an encoder does not decode
    assert (out / "encoder.onnx").is_file()


def test_the_torchscript_exporter_is_verified_too_and_its_limit_named(models, tmp_path, capsys) -> None:
    source = read_source(models["translation"])
    manifest = export_onnx(source, tmp_path / "ts", exporter="torchscript")
    assert {g["exporter"] for g in manifest["graphs"].values()} == {"torchscript"}
    report = verify(source, tmp_path / "ts")
    assert report["passed"] and report["greedy"]["equal"]
    assert all(g["max_abs_diff"] <= TOLERANCE for g in report["graphs"].values())
    # The TorchScript exporter has no grouped-query attention: said in one line, nothing written.
    out = tmp_path / "ts_lm"
    assert main(["export-onnx", "--model", str(models["lm"]), str(out), "--exporter", "torchscript"]) == 2
    err = capsys.readouterr().err.strip()
    assert "decoder_step graph cannot be exported" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_missing_package_is_named_in_one_line(models, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if not installed: importing it fails
    assert main(["export-onnx", "--model", str(models["translation"]), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install onnxscript" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_bad_models_and_outputs_are_refused_in_one_line(models, exported, tmp_path, capsys) -> None:
    cases = [
        ([str(tmp_path / "nowhere"), str(tmp_path / "a")], "does not exist"),
        ([str(models["translation"]), str(models["lm"])], "neither empty nor an earlier ONNX export"),
    ]
    for (model, out), said in cases:
        assert main(["export-onnx", "--model", model, out]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err


# TorchScript by default: the dynamo exporter takes about a minute for the three graphs on a busy machine.
@pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)])
def test_tts_graphs_equal_pytorch_and_synthesis_through_onnxruntime_equals_qkv(models, tmp_path, exporter) -> None:
    source = read_source(models["tts"])
    manifest = export_onnx(source, tmp_path / "tts", exporter=exporter)
    assert {g["exporter"] for g in manifest["graphs"].values()} == {exporter}
    assert list(manifest["graphs"]) == ["encoder", "decoder_step", "postnet"]
    step = {i["name"]: i["shape"] for i in manifest["graphs"]["decoder_step"]["inputs"]}
    assert step["prenet_keep"][1:3] == ["batch", "new"] and step["past_keys"][1::2] == ["batch", "past"]
    report = verify(source, tmp_path / "tts")
    assert set(report["graphs"]) == {"encoder", "decoder_step", "postnet"}
    for name, graph in report["graphs"].items():
        assert graph["max_abs_diff"] <= TOLERANCE, (name, graph)
    said = report["synthesis"]
    assert said["equal"] and report["passed"], said
    assert said["frames"][0] == said["frames"][1] and said["hit_cap"][0] == said["hit_cap"][1]
    assert said["hit_cap"][0] == [False, True] and said["frames"][0][0] < said["frames"][0][1]  # one stopped early
    # The pre-net's dropout, drawn by the runtime: the same seed, the same frames; another, others.
    runtime, texts = OnnxModel(tmp_path / "tts"), [[5, 9, 11, 7], [8, 6]]
    first, again = (runtime.synthesize(texts, max_frames=12, seed=1) for _ in range(2))
    other = runtime.synthesize(texts, max_frames=12, seed=2)
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(first, again, strict=True))
    assert not all(a.shape == b.shape and np.allclose(a, b) for (a, _), (b, _) in zip(first, other, strict=True))


@pytest.mark.slow
def test_whisper_tiny_transcribes_the_same_through_onnxruntime(tmp_path) -> None:
    """The real Whisper tiny.en, imported and exported: greedy through onnxruntime equals qkv's on
    FSDD recordings (spoken digits). Needs `bash bench/fetch_whisper_tiny.sh` and the corpus."""
    recordings = sorted(_fsdd().glob("*.wav"))[:4]
    if not (WHISPER / "model.safetensors").is_file() or not recordings:
        pytest.skip("needs /tmp/whisper-tiny.en (bash bench/fetch_whisper_tiny.sh) and FSDD in $QKV_DATA/fsdd")
    from qkv.audio import load_audio
    from qkv.hf.convert import import_hf
    from qkv.hf.whisper import start_tokens

    import_hf(WHISPER, tmp_path / "whisper")
    source = read_source(tmp_path / "whisper")
    export_onnx(source, tmp_path / "onnx")
    config = source.model.config.features
    feats = [features(load_audio(str(r), sample_rate=config.sample_rate), config) for r in recordings]
    start = start_tokens(tmp_path / "whisper")
    ours = greedy(source.model, feats, max_new_tokens=20, prefix=start)
    theirs = OnnxModel(tmp_path / "onnx").greedy([f.numpy() for f in feats], max_new_tokens=20, prefix=start)
    assert theirs == ours
    assert all(row for row in ours)  # every recording gives words


def _fsdd() -> Path:
    return Path(os.environ.get("QKV_DATA", "/work/shared/data")) / "fsdd" / "recordings"
