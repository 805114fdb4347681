"""A loaded model (``qkv.load`` / ``qkv.bundle``): one tiny random model of every kind, saved as
a model directory, does its jobs through the bundle's methods exactly as the library's decoding
does them; its config.json is read once; a job it cannot do and an option that does not apply
to it are refused in one line; ``import qkv`` stays cheap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

import qkv
from qkv import bundle as bundles
from qkv.audio import FeatureConfig, features, load_audio
from qkv.chat import reply
from qkv.checkpoint import save_model
from qkv.cli import transcribe as transcribe_command
from qkv.cli.main import main
from qkv.decoding import greedy
from qkv.embedding import sentence_embeddings
from qkv.errors import OptionError, UserError
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder
from qkv.models.tts import TransformerTTS, TTSConfig
from qkv.seq2seq import beam_translate
from qkv.streaming import continuation_text
from qkv.tasks.asr import transcribe
from qkv.tokenization import FILE, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"d_model": 15, "n_heads": 3, "d_ff": 7, "dropout": 0.0}
RATE = 16000


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random model directory of each kind, with one character tokenizer."""
    root = tmp_path_factory.mktemp("bundle")
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
        "bert": EncoderOnly(EncoderOnlyConfig(vocab_size=v, n_layers=1, max_len=23, pad_id=tokenizer.pad_id, **SMALL)),
        "asr": SpeechEncoderDecoder(SpeechConfig(features=FeatureConfig(n_mels=19), **speech)),
        "tts": TransformerTTS(
            TTSConfig(
                vocab_size=v, n_encoder_layers=1, n_decoder_layers=1, max_len=11, prenet_dim=11, postnet_channels=7,
                postnet_layers=2, reduction=3, features=FeatureConfig(n_mels=19), pad_id=tokenizer.pad_id,
                d_model=16, n_heads=2, d_ff=23, dropout=0.0,
            )
        ),
    }  # fmt: skip
    return {name: save_model(model, root / name, files=files) for name, model in made.items()}


@pytest.fixture(scope="module")
def sound(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """Half a second of a rising tone, as a WAV file and as the waveform the file holds."""
    t = np.arange(RATE // 2) / RATE
    wave = (0.3 * np.sin(2 * np.pi * (200 + 400 * t) * t)).astype(np.float32)
    path = tmp_path_factory.mktemp("sound") / "tone.wav"
    soundfile.write(path, wave, RATE, subtype="FLOAT")
    return path, wave


def test_translate_is_the_recipes_beam_search(models) -> None:
    m = qkv.load(models["de_en"])
    texts = ["ein hund läuft.", "", "a dog"]
    assert m.kind == "encoder_decoder" and m.jobs == ("translate", "generate", "chat")
    assert m.translate(texts) == beam_translate(m.model, m.vocab, texts, beam_size=m.decode.beam_size)
    assert m.translate(texts[0]) == m.translate(texts)[0]
    assert m.translate(texts, beam_size=2) == beam_translate(m.model, m.vocab, texts, beam_size=2)


def test_generate_is_greedy_decoding_and_a_prompt_streams(models) -> None:
    ed, lm = qkv.load(models["de_en"]), qkv.load(models["lm"])
    texts = ["ein hund", "do re"]
    expected = [
        ed.vocab.target.decode(ids) for ids in greedy(ed.model, ed.vocab.source.encode_batch(texts), max_new_tokens=7)
    ]
    assert ed.generate(texts, max_new_tokens=7) == expected
    pieces = continuation_text(
        lm.model, lm.vocab, lm.vocab.source.encode("do"), max_new_tokens=30, choose=greedy_choice
    )
    assert lm.generate("do", max_new_tokens=30) == "".join(pieces)  # 30 > the window of 17: it slid on
    assert "".join(bundles.continued(lm, "do", max_new_tokens=30)) == lm.generate("do", max_new_tokens=30)
    drawn = [lm.generate(["do", "re"], sampling=bundles.Sampling(top_k=3, seed=7)) for _ in range(2)]
    assert drawn[0] == drawn[1]  # a seed makes a call reproducible
    scored = bundles.generations(ed, ["ein", ""], beam_size=3, nbest=2, max_new_tokens=5)
    assert [len(outputs) for outputs in scored] == [2, 2] and scored[1][0].text == "" and scored[1][0].score is None
    assert scored[0][0].score >= scored[0][1].score


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def test_the_window_rule_keeps_a_sources_start_and_a_prompts_end(models) -> None:
    ed, lm = qkv.load(models["de_en"]), qkv.load(models["lm"])
    long = "ein hund läuft. " * 3  # 48 characters, past both windows
    ids = lm.vocab.source.encode(long)
    assert bundles.window_cut(lm, ids) == ids[-(17 // 2) :]
    assert bundles.window_cut(ed, ed.vocab.source.encode(long)) == ed.vocab.source.encode(long)[:29]
    fit = bundles.window_fit(lm, ["do", long])
    assert fit.cut == [1] and fit.kept == "their newest 8" and fit.room == 17 - 8 + 1
    assert bundles.window_fit(ed, [long, "do"]) == bundles.WindowFit([0], "their first 29", 29)


def test_chat_is_the_next_turn(models) -> None:
    for name in ("lm", "de_en"):
        m = qkv.load(models[name])
        turns = ["ein hund", "a dog"]
        assert m.chat(turns, max_new_tokens=5) == reply(
            m.model, m.vocab, turns, separator=" __eou__ ", max_new_tokens=5
        )


def test_embed_gives_one_row_per_text(models) -> None:
    m = qkv.load(models["bert"])
    texts = ["ein hund", "", "a dog runs"]
    vectors = m.embed(texts)
    expected, _ = sentence_embeddings(m.model, m.vocab.source, texts)
    assert vectors.shape == (3, 15) and torch.equal(vectors, expected) and not vectors[1].any()
    assert torch.allclose(m.embed("a dog runs"), vectors[2], atol=1e-6)
    found = bundles.embeddings(m, texts, pooling="cls", normalize=True)
    assert found.settings.pooling == "cls" and torch.allclose(found.vectors[0].norm(), torch.tensor(1.0))


def test_transcribe_reads_files_and_waveforms_alike(models, sound) -> None:
    m = qkv.load(models["asr"])
    path, wave = sound
    feats = features(load_audio(path, sample_rate=RATE), m.features)
    (expected,) = transcribe(m.model, m.vocab.target, [feats], beam_size=m.decode.beam_size)
    assert m.transcribe(path) == expected.text.strip()
    assert m.transcribe([str(path), wave, torch.from_numpy(wave)]) == [m.transcribe(path)] * 3
    found = bundles.transcriptions(m, [path], bundles.TranscriptionOptions(beam_size=1))
    assert found[0].language is None and found[0].decode_seconds > 0 and found[0].feature_seconds > 0
    good, bad = bundles.read_audio(m, [path, path.parent / "missing.wav"])
    assert [p for p, _ in good] == [path] and bad[0][0] == path.parent / "missing.wav"


def test_speak_gives_waveforms_and_leaves_the_global_generator_alone(models, tmp_path) -> None:
    m = qkv.load(models["tts"])
    before = torch.get_rng_state()
    wave = m.speak("do re mi")
    assert torch.equal(torch.get_rng_state(), before)
    assert wave.ndim == 1 and 0 < wave.numel() / m.sample_rate <= m.longest_speech + 0.05
    assert torch.equal(m.speak("do re mi"), wave) and not torch.equal(m.speak("do re mi", seed=1), wave)
    assert len(m.speak(["do re mi", "mi"])) == 2
    written = m.write_wav(tmp_path / "a.wav", wave)
    assert soundfile.info(written).samplerate == m.sample_rate


def test_the_metadata_is_read_once(models, monkeypatch, sound, capsys) -> None:
    from qkv import checkpoint
    from qkv.bundle import core  # where load looks read_meta up
    from qkv.hf import whisper

    real, reads = checkpoint.read_meta, []

    def counted(directory):
        reads.append(Path(directory))
        return real(directory)

    for module in (checkpoint, core, whisper):
        monkeypatch.setattr(module, "read_meta", counted)
    for name, job in [
        ("de_en", "translate"),
        ("lm", "chat"),
        ("bert", "embed"),
        ("asr", "transcribe"),
        ("tts", "speak"),
    ]:
        reads.clear()
        m = bundles.load(models[name], job=job)
        if job == "translate":
            m.translate("do")
        elif job == "chat":
            m.chat(["do"], max_new_tokens=3)
        elif job == "embed":
            m.embed("do")
        elif job == "transcribe":
            m.transcribe(sound[0])
        else:
            m.speak("do")
        assert reads == [models[name]], (name, reads)
    reads.clear()  # qkv transcribe too: the command reads the model's config.json once
    assert main(["transcribe", "--model", str(models["asr"]), str(sound[0]), "--beam", "1", "--quiet"]) == 0
    assert reads == [models["asr"]] and capsys.readouterr().out.startswith(f"{sound[0]}\t")


@pytest.mark.parametrize(
    ("name", "job"),
    [("de_en", "speak"), ("lm", "translate"), ("bert", "generate"), ("asr", "embed"), ("tts", "transcribe")],
)
def test_a_job_the_model_cannot_do_is_refused_in_one_line(models, name, job) -> None:
    with pytest.raises(UserError) as refused:
        bundles.load(models[name], job=job)
    said = str(refused.value)
    assert said.startswith(str(models[name])) and f"it cannot {job}" in said and "\n" not in said
    m = qkv.load(models[name])
    method = getattr(m, job)
    with pytest.raises(UserError, match=f"it cannot {job}"):
        method(["x"] if job != "transcribe" else np.zeros(RATE, dtype=np.float32))


def test_options_that_do_not_apply_are_refused_in_one_line(models, sound, capsys) -> None:
    with pytest.raises(OptionError, match=r"int8 does not apply .* encoder_only model"):
        qkv.load(models["bert"], int8=True)
    with pytest.raises(OptionError, match=r"bf16 does not apply .* text-to-speech"):
        qkv.load(models["tts"], bf16=True)
    asr, tts, ed = qkv.load(models["asr"]), qkv.load(models["tts"]), qkv.load(models["de_en"])
    with pytest.raises(OptionError, match="language and task apply to imported Whisper models only"):
        asr.transcribe(sound[0], language="de")
    with pytest.raises(OptionError, match="lm_weight weighs the language model of lm") as refused:
        bundles.transcriptions(asr, [sound[0]], bundles.TranscriptionOptions(lm_weight=0.5))
    assert refused.value.said({}) == "--lm-weight weighs the language model of --lm; name one"
    assert transcribe_command.LM_WEIGHT == bundles.LM_WEIGHT  # the default --help names is the library's
    with pytest.raises(OptionError, match="speaker 'anna': the model's speakers are none"):
        tts.speak("do", speaker="anna")
    with pytest.raises(OptionError, match="nbest 3 needs beam_size of at least 3"):
        bundles.translations(ed, ["do"], beam_size=2, nbest=3)
    with pytest.raises(OptionError, match="sampling draws one output per input"):
        ed.generate(["do"], beam_size=2, sampling=bundles.Sampling())
    with pytest.raises(OptionError, match="top_p 0"):
        bundles.Sampling(top_p=0)
    # The command line names its flags: qkv serve --int8 for an encoder is refused, not ignored.
    assert main(["serve", "--model", str(models["bert"]), "--int8", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkv serve: error: --int8 does not apply") and "encoder_only" in err and "\n" not in err


def test_an_option_error_names_flags_only_where_the_option_is_named() -> None:
    error = OptionError("lm runs/lm is fused; ctc_only decodes without one (lm_weight: a weight)", "lm", "ctc_only")
    assert error.said({}) == "--lm runs/lm is fused; --ctc-only decodes without one (lm_weight: a weight)"
    assert OptionError("nbest 3 needs beam_size 3", "nbest", "beam_size").said({"beam_size": "--beam"}) == (
        "--nbest 3 needs --beam 3"
    )


def test_importing_qkv_loads_nothing_else(models) -> None:
    code = (
        "import sys, qkv; assert not [m for m in sys.modules if m.startswith(('torch', 'qkv.'))], sys.modules.keys(); "
        f"m = qkv.load({str(models['de_en'])!r}); print(m.kind)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "encoder_decoder", done.stderr[-2000:]
