"""Fuzzing the newer surfaces (issue 48 §2) with the harness of ``test_fuzz.py``: audio files,
speech manifests, speech and text-to-speech model directories, checkpoints to import
(safetensors, GGUF) and the speech commands' option values and torchrun's environment.

Each category draws a valid input and mutates it (hypothesis, seeded: ``derandomize=True``);
every case must succeed or end in one line naming the culprit (the file, the option, the
variable) within ``test_fuzz.LIMIT_S``, with no traceback and no hang. The suite runs a few
inputs per category (:data:`EXAMPLES`) and the regressions found (``@example``);
``bench/fuzz.py`` runs these :data:`CATEGORIES` beside test_fuzz.py's with many more.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import soundfile
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import test_fuzz as harness
from qkv.audio import FeatureConfig
from qkv.checkpoint import save_model
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder
from qkv.models.tts import TransformerTTS, TTSConfig
from qkv.tokenization import FILE, Tokenizer

EXAMPLES = 6  # per category in the suite (a few seconds each); bench/fuzz.py runs many more
RATE = 16_000
SEEN = "(each named above)"  # transcribe's last line when the lines above it name the files


# ----------------------------------------------------------------------------- bases


@functools.cache
def speech_bases() -> dict[str, Path]:
    """Tiny untrained model directories: a speech recognizer ("asr") and a text-to-speech
    model ("tts"), with a character tokenizer; and valid audio files of several kinds."""
    folder = harness._WORK / "speech_bases"
    folder.mkdir()
    tokenizer = Tokenizer.train_char_level(["abcdefghijklmnopqrstuvwxyz ,.'"])
    files = tokenizer.save(folder / FILE)
    v, block = tokenizer.vocab_size, {"d_model": 16, "n_heads": 2, "d_ff": 7, "dropout": 0.0}
    features = FeatureConfig(n_mels=13)
    asr = SpeechConfig(vocab_size=v, n_encoder_layers=1, n_decoder_layers=1, max_len=8, features=features, **block)
    tts = TTSConfig(
        vocab_size=v,
        n_encoder_layers=1,
        n_decoder_layers=1,
        prenet_dim=11,
        postnet_channels=7,
        postnet_layers=3,
        reduction=3,
        max_len=16,
        features=features,
        **block,
    )
    torch.manual_seed(0)
    bases = {
        "asr": save_model(SpeechEncoderDecoder(asr), folder / "asr", files=files, extra={"task": "asr"}),
        "tts": save_model(TransformerTTS(tts), folder / "tts", files=files, extra={"task": "tts"}),
    }
    tone = (0.2 * np.sin(np.arange(RATE // 2) * 0.2)).astype(np.float32)  # (Y,) half a second
    for name, (samples, rate, fmt, subtype) in {
        "tone.wav": (tone, RATE, "WAV", "PCM_16"),
        "tone.flac": (tone, RATE, "FLAC", "PCM_16"),
        "tone.ogg": (tone, RATE, "OGG", "VORBIS"),
        "stereo8k.wav": (np.stack([tone, -tone], axis=1)[::2], 8000, "WAV", "PCM_24"),
        "float.wav": (tone, RATE, "WAV", "FLOAT"),
    }.items():
        soundfile.write(folder / name, samples, rate, format=fmt, subtype=subtype)
        bases[name] = folder / name
    return bases


AUDIO = ["tone.wav", "tone.flac", "tone.ogg", "stereo8k.wav", "float.wav"]


# ----------------------------------------------------------------------------- audio files

audio_edits = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.integers(0, 2**16), st.integers(1, 255)),
    st.tuples(st.just("replace"), st.binary(max_size=256)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("prefix"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("samples"), st.sampled_from(["nan", "inf", "zeros", "huge", "none", "one", "long"])),
)


def edit_audio(path: Path, edit: tuple) -> None:
    """Apply one mutation (a tuple of :data:`audio_edits`) to an audio file."""
    what, *args = edit
    raw = path.read_bytes()
    if what == "truncate":
        path.write_bytes(raw[: int(len(raw) * args[0])])
    elif what == "flip" and raw:
        changed = bytearray(raw)
        changed[args[0] % len(raw)] ^= args[1]
        path.write_bytes(bytes(changed))
    elif what == "replace":
        path.write_bytes(args[0])
    elif what == "append":
        path.write_bytes(raw + args[0])
    elif what == "prefix":
        path.write_bytes(args[0] + raw)
    elif what == "samples":
        n = {"none": 0, "one": 1, "long": 61 * RATE}.get(args[0], RATE // 4)
        value = {"nan": np.nan, "inf": np.inf, "zeros": 0.0, "huge": 1e30}.get(args[0], 0.1)
        soundfile.write(path, np.full(n, value, np.float32), RATE, format="WAV", subtype="FLOAT")


def check_audio_file(base: str, edits: list[tuple], skip_bad: bool) -> str | None:
    """The property: a mutated audio file is transcribed or refused, the refusal naming it."""
    case = Path(tempfile.mkdtemp(dir=harness._WORK))
    try:
        path = case / f"input{Path(base).suffix}"
        shutil.copy(speech_bases()[base], path)
        for edit in edits:
            edit_audio(path, edit)
        argv = ["transcribe", "--model", str(speech_bases()["asr"]), str(path), *(["--skip-bad"] if skip_bad else [])]
        return _named(harness._cli(*argv), [str(path), SEEN], str(path))
    finally:
        shutil.rmtree(case, ignore_errors=True)


def _named(call: Callable[[], object], names: list[str], culprit: str) -> str | None:
    """``test_fuzz``'s verdict (a slow refusal timed again: the machine is shared, and the first
    case pays for imports), and a refusal must name ``culprit`` somewhere in what it says."""
    for _ in range(2):
        outcome = harness._run(call)
        failure = harness._judge(outcome, names)
        if failure is None and outcome.status == 2 and culprit not in outcome.message:
            return f"refused without naming {culprit}: {outcome.message[-300:]!r}"
        if failure is None or not failure.startswith("slow:"):
            return failure
    return failure


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(base=st.sampled_from(AUDIO), edits=st.lists(audio_edits, min_size=1, max_size=3), skip_bad=st.booleans())
@example(base="tone.flac", edits=[("truncate", 0.02)], skip_bad=False)  # a FLAC header alone
@example(base="tone.wav", edits=[("samples", "none")], skip_bad=True)  # a WAV of 0 samples
@example(base="tone.wav", edits=[("replace", b"\x00\xff" * 100)], skip_bad=False)  # random bytes as WAV
@example(base="float.wav", edits=[("samples", "nan")], skip_bad=False)
def test_fuzz_audio_files(base, edits, skip_bad):
    assert check_audio_file(base, edits, skip_bad) is None


# ----------------------------------------------------------------------------- manifests

SECONDS = st.sampled_from(["1.5", "0", "-1", "-0", "nan", "inf", "-inf", "1e400", "1e-300", "", " ", "0x10", "1_0"])
MANIFEST_PATHS = st.sampled_from(["good.wav", "bad.wav", "missing.wav", "", ".", "..", "folder", "/dev/zero", "a\x00b"])
HEADERS = st.sampled_from(
    [
        "path\tseconds\tspeaker\ttext",
        "path\tseconds\tspeaker\ttext\ttarget",
        "path\tseconds\ttext",
        "",
        "\ufeffpath\tseconds\tspeaker\ttext",
    ]
)
manifest_rows = st.lists(
    st.tuples(MANIFEST_PATHS, SECONDS | st.text(max_size=6), st.text(max_size=4), st.text(max_size=8)), max_size=4
)


def check_manifest(header: str, rows: list[tuple[str, str, str, str]], extra: bytes | None) -> str | None:
    """The property: a manifest (header, rows, maybe bytes after them) is read and its audio
    loaded, or refused in one line naming the manifest or the audio file at fault."""
    from qkv.audio import load_many
    from qkv.speech_corpora import read_manifest

    case = Path(tempfile.mkdtemp(dir=harness._WORK))
    try:
        shutil.copy(speech_bases()["tone.wav"], case / "good.wav")
        (case / "bad.wav").write_bytes(b"RIFF\x00\x00junk")
        (case / "folder").mkdir()
        manifest = case / "m.tsv"
        lines = [header, *("\t".join(row) for row in rows)]
        manifest.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + b"\n" + (extra or b""))

        def read() -> None:
            load_many([u.path for u in read_manifest(manifest)])

        listed = [path for path, *_ in rows if len(path) > 1]  # a refusal may name the audio file at fault
        return harness._verdict(read, [str(manifest), str(case), *listed])
    finally:
        shutil.rmtree(case, ignore_errors=True)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(header=HEADERS, rows=manifest_rows, extra=st.none() | st.binary(max_size=16))
@example(header="path\tseconds\tspeaker\ttext", rows=[("good.wav", "-1", "s", "do")], extra=None)
@example(header="path\tseconds\tspeaker\ttext", rows=[], extra=None)
@example(header="path\tseconds\tspeaker\ttext", rows=[("/dev/zero", "1", "s", "do")], extra=None)
def test_fuzz_manifests(header, rows, extra):
    assert check_manifest(header, rows, extra) is None


# ----------------------------------------------------------------------------- model directories

SPEECH_FIELDS = sorted({*SpeechConfig.__dataclass_fields__, *TTSConfig.__dataclass_fields__})
FEATURE_FIELDS = sorted(FeatureConfig.__dataclass_fields__)
speech_config_edits = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(SPEECH_FIELDS), harness.VALUES),
    st.tuples(st.just("feature"), st.sampled_from(FEATURE_FIELDS), harness.VALUES),
    st.tuples(
        st.just("feature"),
        st.sampled_from(["sample_rate", "n_mels", "n_fft", "hop_length", "win_length"]),
        st.sampled_from([0, -1, 1, 2**31, 10**12]),
    ),
)


def edit_speech_config(directory: Path, edit: tuple) -> None:
    """One change to config.json's model config (``field``) or its feature settings (``feature``)."""
    path = directory / "config.json"
    try:
        meta = json.loads(path.read_text())
        config = meta["config"] if edit[0] == "field" else meta["config"]["features"]
        config[edit[1]] = edit[2]
    except Exception:
        return  # an earlier edit broke the file: this one has nothing to work on
    path.write_text(json.dumps(meta))


def check_speech_model(base: str, edits: list[tuple]) -> str | None:
    """The property: a mutated speech or TTS model directory transcribes a file or speaks a
    sentence, or is refused in one line naming it."""
    case = Path(tempfile.mkdtemp(dir=harness._WORK))
    try:
        directory = case / "model"
        shutil.copytree(speech_bases()[base], directory)
        for edit in edits:
            if edit[0] in ("field", "feature"):
                edit_speech_config(directory, edit)
            else:
                harness.edit_model_directory(directory, edit)
        if base == "asr":
            argv = ["transcribe", "--model", str(directory), str(speech_bases()["tone.wav"])]
        else:
            argv = ["speak", "--model", str(directory), "--text", "a cab", "--output", str(case / "x.wav")]
        failure = harness._verdict(harness._cli(*argv, "--max-seconds", "0.5"), [str(directory)])
        return failure if not (directory / "ran").exists() else "a pickle in the model directory was run"
    finally:
        shutil.rmtree(case, ignore_errors=True)


speech_model_edits = st.lists(harness.model_edits | speech_config_edits, min_size=1, max_size=3)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(base=st.sampled_from(["asr", "tts"]), edits=speech_model_edits)
@example(base="asr", edits=[("truncate", "model.safetensors", 0.5)])  # a corrupt safetensors
@example(base="tts", edits=[("feature", "hop_length", 0)])
def test_fuzz_speech_model_directories(base, edits):
    assert check_speech_model(base, edits) is None


# ----------------------------------------------------------------------------- checkpoints to import


@functools.cache
def import_bases() -> dict[str, Path]:
    """A tiny Hugging Face GPT-2 checkpoint ("hf") and, where the gguf package is installed, a
    tiny Llama GGUF file ("gguf"), written with the writers of test_hf.py and test_gguf.py."""
    folder = harness._WORK / "import_bases"
    folder.mkdir()
    from test_hf import gpt2_model

    gpt2_model(11, tied=True, eos=0).save_pretrained(folder / "hf")
    bases = {"hf": folder / "hf"}
    try:
        import test_gguf
    except BaseException:  # gguf, transformers' GGUF reader or accelerate absent (pytest's Skipped)
        return bases
    model, tokenizer = test_gguf.family("llama")
    test_gguf.write_gguf(folder / "tiny.gguf", model, "llama", tokenizer)
    bases["gguf"] = folder / "tiny.gguf"
    return bases


def check_import(base: str, edits: list[tuple]) -> str | None:
    """The property: a mutated checkpoint (its safetensors, config.json, or the GGUF file) is
    imported or refused in one line naming it; the destination appears only on success."""
    if base not in import_bases():
        return None  # this machine cannot write the file (no gguf package)
    case = Path(tempfile.mkdtemp(dir=harness._WORK))
    try:
        source = case / import_bases()[base].name
        (shutil.copytree if base == "hf" else shutil.copy)(import_bases()[base], source)
        for name, edit in edits:  # the byte mutations of audio files; "samples" writes a WAV in its place
            edit_audio(source / name if base == "hf" else source, edit)
        failure = _named(harness._cli("import-hf", str(source), str(case / "out")), [str(source)], str(source))
        if failure is None and (case / "out").exists() and not (case / "out" / "config.json").is_file():
            failure = "an import left a destination without config.json behind"
        return failure
    finally:
        shutil.rmtree(case, ignore_errors=True)


# (the file of a Hugging Face checkpoint it changes; a GGUF is one file), a mutation of its bytes
import_edits = st.lists(
    st.tuples(st.sampled_from(["model.safetensors", "config.json"]), audio_edits), min_size=1, max_size=2
)


@pytest.mark.slow  # writing the checkpoints imports transformers: some 10 s
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(base=st.sampled_from(["hf", "gguf"]), edits=import_edits)
@example(base="gguf", edits=[("config.json", ("truncate", 0.5))])  # a truncated GGUF
@example(base="hf", edits=[("model.safetensors", ("truncate", 0.3))])  # a corrupt safetensors
@example(base="hf", edits=[("model.safetensors", ("flip", 60, 255))])
@example(base="gguf", edits=[("config.json", ("flip", 299, 152))])  # found: a head count of 9,961,476
def test_fuzz_imports(base, edits):
    assert check_import(base, edits) is None


# ----------------------------------------------------------------------------- options and environment

SPEECH_COMMANDS = ["transcribe", "speak", "import-hf", "import-gguf", "train"]
SPEECH_VALUES = st.one_of(
    st.sampled_from(["asr", "tts", "tone.wav", "bad.wav", "folder", "m.tsv", "recipe.yaml", "out.wav", "-", ""]),
    st.sampled_from(["0", "1", "2", "-1", "0.5", "1e309", "inf", "nan", "5000000", "9" * 30, "16000", "22050"]),
    st.sampled_from(["hf", "tiny.gguf", "missing", "folder/x.wav", "missing/x.wav", "en", "translate", "x" * 5000]),
    st.text(max_size=12),
)
TORCHRUN = ["WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"]
environments = st.dictionaries(
    st.sampled_from(TORCHRUN), st.sampled_from(["", "1", "2", "-1", "abc", "65536", "9" * 30, " 1", "1.5"]), max_size=3
)


# What a command needs to get past its parser (most cases start so; the rest draw everything).
STARTS = {
    "transcribe": ["--model", "asr", "tone.wav"],
    "speak": ["--model", "tts", "--output", "out.wav"],
    "import-hf": ["asr", "o"],
    "import-gguf": ["tone.wav", "o"],
    "train": ["recipe.yaml", "--out", "o"],
}


@st.composite
def speech_command_lines(draw) -> list[str]:
    name = draw(st.sampled_from(SPEECH_COMMANDS))
    options, positionals = harness.subcommands()[name]
    if draw(st.integers(0, 4)):
        argv = [name, *STARTS[name]]
    else:
        argv = [name] + [draw(SPEECH_VALUES) for _ in range(positionals)]
    for spellings, takes_value in draw(st.lists(st.sampled_from(options), max_size=5)):
        argv.append(draw(st.sampled_from(spellings)))
        if takes_value:
            argv.append(draw(SPEECH_VALUES))
    return argv


def check_speech_command_line(argv: list[str], environ: dict[str, str]) -> str | None:
    """The property: a speech command line, in a folder of tiny models and files, with any of
    torchrun's variables set, succeeds or ends in one line naming an option, value or variable."""
    case = Path(tempfile.mkdtemp(dir=harness._WORK))
    try:
        for name in ("asr", "tts"):
            shutil.copytree(speech_bases()[name], case / name)
        shutil.copy(speech_bases()["tone.wav"], case / "tone.wav")
        (case / "bad.wav").write_bytes(b"RIFFjunk")
        (case / "folder").mkdir()
        (case / "m.tsv").write_text("path\tseconds\tspeaker\ttext\ntone.wav\t0.5\ts\ta cab\n")
        shutil.copy(harness.ROOT / "recipes" / "tts_fsdd.yaml", case / "recipe.yaml")
        names = [a for a in argv if len(a) >= 2] + [*TORCHRUN, "--", "<stdin>", "qkv", SEEN]
        # --nproc N would start N workers: getting that far is accepting the input.
        with mock.patch.dict("os.environ", environ), mock.patch("qkv.distributed.launch", _would_launch):
            return harness._verdict(harness._cli(*argv), names, stdin=b"a cab\n", cwd=case)
    finally:
        shutil.rmtree(case, ignore_errors=True)


def _would_launch(*args, **kwargs):
    raise harness.WouldTrain


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(argv=speech_command_lines(), environ=environments)
@example(argv=["speak", "--model", "tts", "--text", "a", "--output", "folder"], environ={})
@example(argv=["train", "recipe.yaml", "--out", "o", "--nproc", "2", "--max-restarts", "-1"], environ={})
@example(argv=["train", "recipe.yaml", "--out", "o"], environ={"WORLD_SIZE": "abc"})
@example(argv=["speak", "--model", "tts", "--text", "a" * 5000, "--output", "x.wav"], environ={})
@example(argv=["train", "x" * 5000, "--out", "o"], environ={})  # found: a name too long for the system
def test_fuzz_speech_command_lines(argv, environ):
    assert check_speech_command_line(argv, environ) is None


# What bench/fuzz.py runs beside test_fuzz.CATEGORIES: category -> (strategies, property).
CATEGORIES: dict[str, tuple[dict[str, st.SearchStrategy], Callable[..., str | None]]] = {
    "audio files": (
        {
            "base": st.sampled_from(AUDIO),
            "edits": st.lists(audio_edits, min_size=1, max_size=3),
            "skip_bad": st.booleans(),
        },
        check_audio_file,
    ),
    "speech manifests": (
        {"header": HEADERS, "rows": manifest_rows, "extra": st.none() | st.binary(max_size=16)},
        check_manifest,
    ),
    "speech model directories": (
        {"base": st.sampled_from(["asr", "tts"]), "edits": speech_model_edits},
        check_speech_model,
    ),
    "checkpoints to import": ({"base": st.sampled_from(["hf", "gguf"]), "edits": import_edits}, check_import),
    "speech command lines": ({"argv": speech_command_lines(), "environ": environments}, check_speech_command_line),
}
