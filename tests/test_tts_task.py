"""The text-to-speech task (``tasks/tts.py``) and ``qkv speak``: a tiny model trained on tone
"words" in two voices saves itself with its spoken samples and pictures; the command writes WAV
files of the expected length, one per sentence, in the voice ``--speaker`` names, and refuses bad
text, a missing or unknown speaker and a bad output on one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from qkv import runner
from qkv.checkpoint import load_model, read_meta
from qkv.cli.main import main
from qkv.errors import UserError
from qkv.tasks import TASKS, load_recipe
from qkv.tasks.tts import normalize_text, speak, speaking_of
from qkv.tokenization import Tokenizer
from speech_data import tone_corpus

ROOT = Path(__file__).resolve().parents[1]
TINY_TTS = [
    "task=tts",
    "data.corpus=manifests",
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.n_encoder_layers=1",
    "model.n_decoder_layers=2",
    "model.prenet_dim=32",
    "model.postnet_channels=16",
    "model.postnet_layers=3",
    "model.max_len=40",
    "model.features.n_mels=23",
    "train.batch_frames=400",
    "train.warmup=5",
    "train.lr=3e-3",
    "train.steps=40",
    "data.test_sentences=3",
]


VOICES = {"tones": 1.0, "low": 0.5}  # speaker: its pitch (times the tone words'); "low" an octave down


def two_voices(tmp: Path) -> Path:
    """One manifest of 8 utterances by each of the two :data:`VOICES`."""
    lines = ["path\tseconds\tspeaker\ttext"]
    for seed, (name, pitch) in enumerate(VOICES.items()):
        manifest = tone_corpus(tmp / name, utterances=8, seed=seed, speaker=name, pitch=pitch)
        lines += [f"{name}/{line}" for line in manifest.read_text().splitlines()[1:]]
    (tmp / "voices.tsv").write_text("\n".join(lines) + "\n")
    return tmp / "voices.tsv"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("tts")
    manifest = two_voices(tmp)
    recipe = load_recipe(None, [*TINY_TTS, f"data.train={manifest}", f"data.test={manifest}", "data.speakers=true"])
    summary = runner.train(TASKS["tts"], recipe, tmp / "model", progress=False)
    return tmp / "model", summary


def test_training_saves_the_model_its_samples_and_pictures(trained) -> None:
    model, summary = trained
    assert summary["losses"][-1] < summary["losses"][0]
    meta = read_meta(model)
    assert meta["kind"] == "tts" and meta["task"] == "tts" and meta["speakers"] == ["low", "tones"]
    assert meta["config"]["mel_std"] > 0 and meta["train_seconds"] > 0
    lines = (model / "samples" / "samples.tsv").read_text().splitlines()
    assert lines[0] == "file\ttext\treference" and len(lines) == 4
    for line in lines[1:]:
        info = soundfile.info(str(model / "samples" / line.split("\t")[0]))
        assert info.samplerate == 16000 and info.frames > 0
    for picture in ("alignment.png", "spectrogram.png"):
        assert (model / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 0 <= summary["stopped"] <= 1 and summary["real_time_factor"] > 0


def test_speak_writes_one_wav_per_sentence(trained, capsys, tmp_path, monkeypatch) -> None:
    import io

    model, _ = trained
    rc = main(
        ["speak", "--model", str(model), "--speaker", "tones", "--text", "do mi", "--output", str(tmp_path / "a.wav")]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    path, seconds, text = out.strip().split("\t")
    info = soundfile.info(path)
    assert text == "do mi" and info.samplerate == 16000
    assert abs(info.frames / 16000 - float(seconds)) < 0.01
    assert "real-time factor" in err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"do\nso ti mi\n\nmi\n")))
    folder = tmp_path / "spoken"
    argv = [
        "speak",
        "--model",
        str(model),
        "--speaker",
        "tones",
        "--output-dir",
        str(folder),
        "--json",
        "--rate",
        "22050",
    ]
    rc = main(argv)
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rc == 0 and [r["text"] for r in records] == ["do", "so ti mi", "mi"]
    assert [Path(r["path"]).name for r in records] == ["0001.wav", "0002.wav", "0003.wav"]
    assert all(soundfile.info(r["path"]).samplerate == 22050 for r in records)


def test_the_stop_threshold_is_the_recipes_unless_given(trained, capsys, tmp_path) -> None:
    model, _ = trained
    assert speaking_of(read_meta(model))["stop_threshold"] == 0.5  # the recipe default
    assert speaking_of({"recipe": {"data": {"stop_threshold": 0.2}}})["stop_threshold"] == 0.2
    assert speaking_of({"recipe": {"data": {"stop_threshold": 0.2}}}, stop_threshold=0.7)["stop_threshold"] == 0.7
    seconds, errs = {}, {}
    for threshold in ("0.000001", "0.999999"):  # at once, and (almost) never: the --max-seconds cap
        argv = ["speak", "--model", str(model), "--speaker", "tones", "--text", "do mi so", "--max-seconds", "0.6"]
        assert main([*argv, "--stop-threshold", threshold, "--output", str(tmp_path / f"{threshold}.wav")]) == 0
        out, errs[threshold] = capsys.readouterr()
        seconds[threshold] = float(out.split("\t")[1])
    assert seconds["0.000001"] < 0.1 < 0.55 < seconds["0.999999"]
    # The attention window: the recipe's unless given, and a command's wins.
    assert speaking_of(read_meta(model))["attention_window"] is None
    windowed = {"recipe": {"data": {"attention_window": [1, 3]}}}
    assert speaking_of(windowed)["attention_window"] == (1, 3)
    assert speaking_of(windowed, attention_window=[0, 2])["attention_window"] == (0, 2)
    capped = f"{tmp_path / '0.999999.wav'}: 'do mi so' did not end within 0.6 s (--max-seconds)"
    assert capped in errs["0.999999"] and "did not end" not in errs["0.000001"]  # the cap hit is said, once


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--speaker", "tones", "--text", "do ça", "--output", "x.wav"], "cannot say"),
        (["--speaker", "tones", "--text", " ", "--output", "x.wav"], "nothing to say"),
        (["--text", "do", "--output", "x.wav"], "several voices: choose one with --speaker (low, tones)"),
        (["--speaker", "nobody", "--text", "do", "--output", "x.wav"], "'nobody': the model's speakers are low, tones"),
        (["--speaker", "tones", "--text", "do"], "--output"),
        (["--speaker", "tones", "--text", "do", "--output", "no/such/dir/x.wav"], "does not exist"),
        (["--speaker", "tones", "--text", "do", "--output", "x.wav", "--attention-window", "1", "0"], "AHEAD"),
    ],
)
def test_speak_refuses_bad_input_in_one_line(trained, capsys, tmp_path, monkeypatch, extra, message) -> None:
    model, _ = trained
    monkeypatch.chdir(tmp_path)
    assert main(["speak", "--model", str(model), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def _centroid(path: Path) -> float:
    """The spectral centroid of a WAV file in Hz: where its power is, on average."""
    wave, rate = soundfile.read(path)
    power = np.abs(np.fft.rfft(wave)) ** 2
    return float((power * np.fft.rfftfreq(len(wave), 1 / rate)).sum() / power.sum())


def test_the_speaker_chooses_the_voice(trained, capsys, tmp_path) -> None:
    """--speaker says the text in the voice it names: "low" (trained on the tone words an octave
    down) has its power well below "tones'" (at about half the frequency); the same speaker and seed
    again is the same file. The library refuses a speaker index the model does not have, by name."""
    model, _ = trained
    wav = {}
    for name, who in (("low", "low"), ("tones", "tones"), ("again", "low")):
        wav[name] = tmp_path / f"{name}.wav"
        argv = ["speak", "--model", str(model), "--speaker", who, "--text", "do mi so", "--output", str(wav[name])]
        assert main([*argv, "--max-seconds", "0.6", "--quiet"]) == 0
    capsys.readouterr()
    assert wav["low"].read_bytes() == wav["again"].read_bytes()
    assert _centroid(wav["low"]) < 0.75 * _centroid(wav["tones"]), (_centroid(wav["low"]), _centroid(wav["tones"]))
    tts, meta = load_model(model, kind="tts")
    tokenizer = Tokenizer.load(model / "tokenizer.json")
    for bad in (2, -1):
        with pytest.raises(ValueError, match=rf"speaker {bad} is not one of the model's 2 \(0 to 1\)"):
            speak(tts, tokenizer, ["do"], speakers=[bad], max_seconds=0.1, **speaking_of(meta))
    torch.manual_seed(0)
    low, _ = speak(tts, tokenizer, ["do"], speakers=[0], max_seconds=0.3, **speaking_of(meta))[0]
    torch.manual_seed(0)
    high, _ = speak(tts, tokenizer, ["do"], speakers=[1], max_seconds=0.3, **speaking_of(meta))[0]
    assert (low.mel - high.mel).abs().max() > 0.1  # the library's speaker index too changes the spectrogram


def test_text_normalisation_reads_numbers_and_symbols() -> None:
    assert normalize_text("Tom & Jerry ate 3 apples, 25% of 1,200!") == (
        "tom and jerry ate three apples, twenty five percent of one thousand two hundred!"
    )
    assert normalize_text("Call 5551234567") == "call " + " ".join(
        ["five", "five", "five", "one", "two", "three", "four", "five", "six", "seven"]
    )


def test_the_shipped_tts_recipe_loads_and_bad_values_are_named() -> None:
    recipe = load_recipe(ROOT / "recipes" / "tts_en.yaml")
    assert recipe.task == "tts" and recipe.data.corpus == "espeak"
    for item, named in [
        ("model.features.normalize=true", "normalize"),
        ("data.speakers=true", "data.speakers"),
        ("train.guided_weight=-1", "train.guided_weight"),
        ("model.reduction=0", "reduction"),
        ("decode.attention_window=[1]", "decode.attention_window"),
        ("decode.attention_window=[1, 0]", "decode.attention_window"),
    ]:
        with pytest.raises(UserError, match=named.replace(".", r"\.")):
            load_recipe(ROOT / "recipes" / "tts_en.yaml", [item])


def test_phoneme_input_reads_ipa_from_espeak(tmp_path) -> None:
    import shutil

    from qkv.tasks.tts import readings, symbol_ids
    from qkv.tokenization import Tokenizer

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (scripts/setup.sh installs it as root)")
    ipa = readings(["A dog runs.", "2 cats"], symbols="phonemes")
    assert ipa[0].startswith("ɐ dˈɑːɡ") and "kˈæts" in ipa[1]  # espeak-ng's en-us IPA; numbers as words first
    # A text with nothing to say keeps its place, empty; the others are still phonemes.
    assert readings(["A dog runs.", " ", "2 cats"], symbols="phonemes") == [ipa[0], "", ipa[1]]
    tokenizer = Tokenizer.train_char_level(ipa)
    ids = symbol_ids(tokenizer, ["a dog runs"], symbols="phonemes")
    assert tokenizer.decode(ids[0]) == readings(["a dog runs"], symbols="phonemes")[0]
    with pytest.raises(UserError, match="cannot say"):
        symbol_ids(tokenizer, ["zebra"], symbols="phonemes")


@pytest.mark.parametrize(
    "argv",
    [["generate", "--prompt", "hi"], ["translate", "--input", "-"], ["chat"], ["transcribe", "x.wav"]],
    ids=lambda a: a[0],
)
def test_other_commands_refuse_a_tts_model_in_one_line(trained, capsys, monkeypatch, tmp_path, argv) -> None:
    import io

    model, _ = trained
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"hi\n")))
    assert main([argv[0], "--model", str(model), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert "text-to-speech model" in err and len(err.strip().splitlines()) == 1
    assert main(["export-hf", str(model), str(tmp_path / "hf")]) == 2
    assert "text-to-speech" in capsys.readouterr().err
