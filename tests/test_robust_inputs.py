"""Careless input on the newer surfaces (issue 48 §2, §3): each mistake ends in one line that
names the file, field, option or variable, with exit status 2 and nothing the user had lost;
work that cannot give an answer is refused before it is done.

- ``qkv speak --output`` naming a folder; ``qkv train --max-restarts -1``; torchrun's environment
  variables holding garbage; a manifest row of zero, negative or NaN seconds, or no rows; a
  config.json or weights file that is a link to ``/dev/zero``, a pipe or too large;
  ``qkv translate --max-len-a 0 --max-len-b 0``.
- Audio files: random bytes, no samples, a FLAC header alone, a truncated FLAC, NaN samples,
  each refused naming the file; audio is checked block by block as it is read, so a long
  silent file is refused holding a few blocks, not the whole file.
- Text to speech: a text longer than can be said within the cap is split at sentence ends
  before the model reads it; a word too long for the cap is refused with both numbers.
"""

from __future__ import annotations

import contextlib
import io
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv import audio, distributed, files
from qkv.audio import FeatureConfig, load_audio
from qkv.bundle import PIECE_PAUSE, speeches
from qkv.checkpoint import save_model
from qkv.cli.main import main
from qkv.errors import OptionError, UserError
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.tts import TransformerTTS, TTSConfig
from qkv.speakable import TooLong, most_characters, split_text
from qkv.speech_corpora import read_manifest
from qkv.tokenization import FILE, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
RATE = 16_000


def run(*argv: str) -> tuple[int, str]:
    """``qkv ARGV`` in-process: its exit status and stderr (SystemExit of argparse included)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(list(argv))
        except SystemExit as e:
            status = e.code
    return status, err.getvalue()


def refused(status: int, err: str, *names: str) -> str:
    """The one error line of a refusal (exit status 2) that names every one of ``names``."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, (status, err)
    assert all(name in lines[0] for name in names), (names, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny untrained model directories with a character tokenizer: a language model, a
    translation model and a text-to-speech model (13 mel bins, 64 steps of 3 frames)."""
    folder = tmp_path_factory.mktemp("models")
    tokenizer = Tokenizer.train_char_level(["abcdefghijklmnopqrstuvwxyz ,.!?"])
    saved = tokenizer.save(folder / FILE)
    v, block = tokenizer.vocab_size, {"d_model": 15, "n_heads": 3, "d_ff": 7, "max_len": 16, "dropout": 0.0}
    tts = TTSConfig(
        vocab_size=v,
        **{**block, "d_model": 16, "n_heads": 2, "max_len": 64},
        n_encoder_layers=1,
        n_decoder_layers=1,
        prenet_dim=11,
        postnet_channels=7,
        postnet_layers=3,
        reduction=3,
        features=FeatureConfig(n_mels=13),
    )
    torch.manual_seed(0)
    made = {
        "gpt": (DecoderOnly(DecoderOnlyConfig(vocab_size=v, n_layers=1, **block)), {}),
        "s2s": (
            EncoderDecoder(
                EncoderDecoderConfig(
                    src_vocab_size=v, tgt_vocab_size=v, n_encoder_layers=1, n_decoder_layers=1, **block
                )
            ),
            {"task": "translation"},
        ),
        "tts": (TransformerTTS(tts), {"task": "tts"}),
    }
    return {name: save_model(m, folder / name, files=saved, extra=extra) for name, (m, extra) in made.items()}


def _copy(model: Path, to: Path) -> Path:
    to.mkdir()
    for file in model.iterdir():
        (to / file.name).write_bytes(file.read_bytes())
    return to


# ----------------------------------------------------------------------------- outputs and options


def test_speak_refuses_a_folder_as_output_before_reading_the_model(tmp_path):
    folder = tmp_path / "existing"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    # The model does not exist: the output is refused first, before any work.
    line = refused(
        *run("speak", "--model", str(tmp_path / "none"), "--text", "hi", "--output", str(folder)), "--output"
    )
    assert "directory" in line and (folder / "keep.txt").read_text() == "mine"
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    refused(
        *run("speak", "--model", str(tmp_path / "none"), "--text", "hi", "--output-dir", str(a_file)), "--output-dir"
    )
    assert a_file.read_text() == "mine"


def test_an_atomic_write_to_a_folder_is_refused_and_leaves_it(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="is a directory"):
        files.write_atomic(tmp_path / "d", b"x")
    assert (tmp_path / "d").is_dir() and os.listdir(tmp_path) == ["d"]  # no temporary left


def test_max_restarts_must_not_be_negative(tmp_path):
    recipe = str(ROOT / "recipes" / "numbers.yaml")
    refused(
        *run("train", recipe, "--out", str(tmp_path / "o"), "--nproc", "2", "--max-restarts", "-1"), "--max-restarts"
    )


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "x"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "-1"}, "LOCAL_RANK"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "http"}, "MASTER_PORT"),
        ({"WORLD_SIZE": "2"}, "RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "29500"}, "MASTER_ADDR is not set"),
    ],
)
def test_garbage_in_torchruns_environment_is_named(environ, named):
    with pytest.raises(UserError) as e:
        distributed.start(environ, on="cpu")
    assert named in str(e.value) and "\n" not in str(e.value)
    assert not distributed.world().size > 1  # no group was joined


def test_a_garbage_restart_count_is_named():
    with pytest.raises(UserError, match="TORCHELASTIC_RESTART_COUNT"):
        distributed.restarted({"TORCHELASTIC_RESTART_COUNT": "twice"})
    assert not distributed.restarted({}) and distributed.restarted({"TORCHELASTIC_RESTART_COUNT": "1"})


def test_qkv_train_names_a_garbage_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    out = tmp_path / "out"
    recipe = str(ROOT / "recipes" / "numbers.yaml")
    refused(*run("train", recipe, "--out", str(out), "--set", "train.steps=1", "--quiet"), "WORLD_SIZE='two'")
    assert not out.exists()


def test_translate_refuses_a_length_rule_that_allows_no_token(models, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ab\n")))
    line = refused(*run("translate", "--model", str(models["s2s"]), "--max-len-a", "0", "--max-len-b", "0"))
    assert "--max-len-a" in line and "--max-len-b" in line


@pytest.mark.parametrize(
    "command", [["train", "{long}", "--out", "o"], ["generate", "--model", "{long}", "--prompt", "a"]]
)
def test_a_path_too_long_for_the_system_is_named(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    long = "y" * 5000  # past NAME_MAX: os.stat raises ENAMETOOLONG, which Path.exists passes on
    refused(*run(*[a.replace("{long}", long) for a in command]), long)


# ----------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("seconds", ["-1.5", "0", "nan", "inf", "-0"])
def test_a_manifest_row_of_no_positive_finite_length_is_named(tmp_path, seconds):
    manifest = tmp_path / "m.tsv"
    manifest.write_text(f"path\tseconds\tspeaker\ttext\na.wav\t1.0\ts\tdo\nb.wav\t{seconds}\ts\tmi\n")
    with pytest.raises(UserError, match=rf"m\.tsv:3: seconds .*{seconds}"):
        read_manifest(manifest)


def test_a_manifest_of_only_its_header_says_so(tmp_path):
    manifest = tmp_path / "m.tsv"
    manifest.write_text("path\tseconds\tspeaker\ttext\n")
    with pytest.raises(UserError, match=r"m\.tsv has no utterances"):
        read_manifest(manifest)


# ----------------------------------------------------------------------------- model directories


@pytest.mark.parametrize(("name", "target"), [("config.json", "/dev/zero"), ("model.safetensors", "/dev/zero")])
def test_a_model_file_linked_to_a_device_is_not_called_missing(models, tmp_path, name, target):
    directory = _copy(models["gpt"], tmp_path / "m")
    (directory / name).unlink()
    (directory / name).symlink_to(target)
    line = refused(*run("generate", "--model", str(directory), "--prompt", "ab"), name, "not a regular file")
    assert "missing" not in line


def test_a_config_json_that_is_a_pipe_or_too_large_is_refused_unread(models, tmp_path):
    directory = _copy(models["gpt"], tmp_path / "m")
    (directory / "config.json").unlink()
    os.mkfifo(directory / "config.json")  # reading it would wait forever
    refused(*run("generate", "--model", str(directory), "--prompt", "ab"), "config.json", "named pipe")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(files.JSON_LIMIT + 1)  # sparse: nothing written
    with pytest.raises(UserError, match="too large"):
        files.read_json_object(big)


# ----------------------------------------------------------------------------- audio files


def _wav(path: Path, samples: np.ndarray, rate: int = RATE, subtype: str = "PCM_16") -> Path:
    soundfile.write(path, samples, rate, subtype=subtype)
    return path


def _bad_audio(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Bad audio files, each with what its refusal says."""
    tone = (0.1 * np.sin(np.arange(RATE) * 0.1)).astype(np.float32)
    flac = tmp / "full.flac"
    soundfile.write(flac, tone, RATE)
    made = {
        "random.wav": (np.random.default_rng(0).bytes(5000), "not readable as audio"),
        "header.flac": (flac.read_bytes()[:100], "not readable as audio"),
        "truncated.flac": (flac.read_bytes()[: len(flac.read_bytes()) // 3], "not readable as audio"),
        "empty.wav": (b"", "empty file"),
    }
    out = {}
    for name, (data, said) in made.items():
        (tmp / name).write_bytes(data)
        out[name] = (tmp / name, said)
    out["no_samples.wav"] = (_wav(tmp / "no_samples.wav", np.zeros(0, np.float32)), "no audio")
    out["nan.wav"] = (_wav(tmp / "nan.wav", np.full(RATE, np.nan, np.float32), subtype="FLOAT"), "non-finite")
    out["silent.wav"] = (_wav(tmp / "silent.wav", np.zeros(RATE, np.float32)), "silent")
    return out


def test_bad_audio_files_are_each_named(tmp_path):
    for name, (path, said) in _bad_audio(tmp_path).items():
        with pytest.raises(UserError) as e:
            load_audio(path)
        message = str(e.value)
        assert message.startswith(f"{path}: ") and said in message and "\n" not in message, (name, message)


def test_audio_read_in_blocks_equals_audio_read_whole(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    stereo = _wav(tmp_path / "s.wav", (0.2 * rng.standard_normal((3 * RATE + 17, 2))).astype(np.float32), 22_050)
    expected = soundfile.read(stereo, dtype="float32", always_2d=True)[0].mean(axis=1)  # (Y,)
    kept = load_audio(stereo, sample_rate=22_050)
    monkeypatch.setattr(audio, "BLOCK_FRAMES", 1000)
    monkeypatch.setattr(audio, "KEEP_BYTES", 4000)  # past the first blocks: the second pass
    reread = load_audio(stereo, sample_rate=22_050)
    assert torch.equal(kept, reread) and np.allclose(kept.numpy(), expected, atol=1e-6)


def test_a_long_silent_file_is_refused_holding_a_few_blocks(tmp_path, monkeypatch):
    path = tmp_path / "silent.wav"
    with soundfile.SoundFile(path, "w", RATE, 1, "PCM_16") as f:
        for _ in range(8):
            f.write(np.zeros(RATE * 30, np.int16))  # 4 minutes: 15 MB of float32 samples
    monkeypatch.setattr(audio, "KEEP_BYTES", 2**20)
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match="silent"):
            load_audio(path, max_seconds=None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    whole = 4 * 8 * 30 * RATE
    assert peak < whole / 4, (peak, whole)


def test_a_file_longer_than_the_limit_is_refused_by_its_header(tmp_path):
    path = _wav(tmp_path / "long.wav", np.full(3 * RATE, 0.1, np.float32))
    with pytest.raises(UserError, match=r"3\.0 s long, over the limit of 2 s"):
        load_audio(path, max_seconds=2)


# ----------------------------------------------------------------------------- text to speech


@settings(max_examples=40, deadline=None)
@given(
    words=st.lists(st.text("abcxyz", min_size=1, max_size=6), min_size=1, max_size=40),
    marks=st.lists(st.sampled_from(["", "", ",", ".", "!", ";"]), min_size=40, max_size=40),
    limit=st.integers(7, 60),  # the longest word and its mark fit
)
def test_split_text_keeps_every_word_in_order_within_the_limit(words, marks, limit):
    text = " ".join(w + m for w, m in zip(words, marks, strict=False))
    pieces = split_text(text, limit)
    assert all(0 < len(p) <= limit for p in pieces)
    assert " ".join(pieces).split() == text.split()
    if len(text) <= limit:
        assert pieces == [text]


def test_split_text_prefers_sentence_ends_and_refuses_a_word_too_long():
    assert split_text("one two. three four, five six.", 16) == ["one two.", "three four,", "five six."]
    with pytest.raises(TooLong):
        split_text("a " + "x" * 50, 20)


def test_a_word_too_long_to_say_is_refused_with_both_numbers(models):
    bundle = qkv.load(models["tts"])
    limit = most_characters(1.0)
    with pytest.raises(OptionError) as e:
        speeches(bundle, ["x" * 100_000], max_seconds=1.0)
    message = e.value.said({})
    assert "100,000" in message and f"at most {limit:,}" in message and "--max-seconds" in message


def test_a_text_longer_than_the_cap_is_said_in_pieces(models):
    bundle = qkv.load(models["tts"])
    limit = most_characters(0.1)  # 3 characters
    (synthesis, wave), (_, short) = speeches(bundle, ["ab cd. ef", "gh"], max_seconds=0.1)
    pieces = len(split_text("ab cd. ef", limit))
    assert pieces == 3 and synthesis.alignment is None
    # Each piece is said within the cap (give or take a step of 3 frames), pauses between them.
    hop = bundle.model.config.features.hop_length
    most = 0.1 * RATE + 4 * hop
    pauses = (pieces - 1) * PIECE_PAUSE * RATE
    assert pauses < wave.numel() <= pieces * most + pauses and short.numel() <= most
