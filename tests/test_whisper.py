"""Tests of qkv.hf.whisper and of decoding from forced start tokens (``generation``'s ``prefix``).

Small random Whisper models (D=22 with H=2, F=37, two layers a stack, 80 mel bins, a 1 s chunk:
max_source_positions=50, and a decoder window of 29; the weights moved off their initial
values) are built with ``transformers`` and saved with ``save_pretrained``, with a
byte-level BPE plus Whisper's special tokens, a generation config and a feature extractor
(``tests/whisper_fixtures.py``); nothing is downloaded. They are imported, compared with the original (features,
logits within 1e-4; greedy transcripts equal to ``generate`` from the same start tokens, for
an English-only and a multilingual model), exported back, loaded with ``from_pretrained`` and
compared again.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import WhisperForConditionalGeneration, WhisperTokenizer  # noqa: E402

from qkv.audio import FeatureConfig, features  # noqa: E402
from qkv.checkpoint import load_model, save_model  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.decoding import beam_search, greedy  # noqa: E402
from qkv.errors import UserError  # noqa: E402
from qkv.hf.convert import export_hf, import_hf  # noqa: E402
from qkv.hf.whisper import detect_language, start_tokens  # noqa: E402
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig  # noqa: E402
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig  # noqa: E402
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder  # noqa: E402
from qkv.tokenization import Tokenizer  # noqa: E402
from test_hf import assert_close, perturb  # noqa: E402
from whisper_fixtures import (  # noqa: E402
    CORPUS,
    SPECIALS,
    TIMESTAMPS,
    hf_features,
    hf_whisper,
    imported,
    new_tokens,
)

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

NEW = 12  # new tokens per transcript


def waves() -> list[np.ndarray]:
    """Two waveforms: 0.7 s (padded to the 1 s chunk) and 1.3 s (cut to it)."""
    g = np.random.default_rng(5)
    out = []
    for seconds, pitch in ((0.7, 0.05), (1.3, 0.11)):
        n = int(seconds * 16000)
        wave = 0.3 * np.sin(np.arange(n) * pitch) + g.normal(0, 0.05, n)
        out.append(wave.astype(np.float32))
    return out


def qkv_features(config: FeatureConfig) -> list[torch.Tensor]:
    return [features(torch.from_numpy(w), config) for w in waves()]  # each (T, M)


def hf_generate(
    model, feats: torch.Tensor, prefix: list[int], *, language: str | None = None, task: str | None = None
) -> list[list[int]]:
    """HF's greedy transcripts after ``prefix`` (checked to be what ``generate`` starts from), up to END."""
    with torch.no_grad():
        out = model.generate(
            feats,
            max_new_tokens=NEW,
            do_sample=False,
            num_beams=1,
            return_dict_in_generate=True,
            language=language,
            task=task,
        )
    return new_tokens(out.sequences.tolist(), prefix, model.config.eos_token_id)


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory) -> tuple[WhisperForConditionalGeneration, Path, Path]:
    """A multilingual HF Whisper, its directory and its qkv import."""
    return imported(tmp_path_factory.mktemp("whisper"), lambda d: hf_whisper(d, multilingual=True))


@pytest.fixture(scope="module")
def english(tmp_path_factory) -> tuple[WhisperForConditionalGeneration, Path, Path]:
    """An English-only HF Whisper (untied output), its directory and its qkv import."""
    return imported(tmp_path_factory.mktemp("whisper_en"), lambda d: hf_whisper(d, multilingual=False, tied=False))


# ------------------------------------------------------------------------ import


@pytest.mark.parametrize("which", ["multilingual", "english"])
def test_import_logits_equal(which: str, request) -> None:
    """Same features as WhisperFeatureExtractor; logits within 1e-4 of HF's for a batch of two."""
    hf, hf_dir, qkv_dir = request.getfixturevalue(which)
    model, meta = load_model(qkv_dir)
    assert meta["kind"] == "speech_encoder_decoder" and meta["hf"]["architecture"] == "WhisperForConditionalGeneration"
    assert model.config.features.chunk_seconds == 1.0 and model.config.features.n_mels == 80
    ours = torch.stack(qkv_features(model.config.features))  # (B, T, M)
    theirs = hf_features(hf_dir, waves())  # (B, M, T)
    assert ours.shape == (2, 100, 80)
    assert (ours - theirs.transpose(1, 2)).abs().max() <= 1e-5
    g = torch.Generator().manual_seed(7)
    tgt = torch.cat(
        [torch.full((2, 1), model.config.bos_id), torch.randint(0, model.config.vocab_size, (2, 28), generator=g)], 1
    )  # (B, 29): the whole window
    with torch.no_grad():
        logits = model(ours, None, tgt)  # (B, L, V)
        expected = hf(input_features=theirs, decoder_input_ids=tgt).logits
    assert_close(logits, expected)
    print(f"max |logit difference| ({which}): {(logits - expected).abs().max().item():.2e}")


def test_import_summary_settings_and_tokenizer(multilingual, english, tmp_path: Path, capsys) -> None:
    """qkv import-hf: the summary, the kept files, the start-token settings in config.json, and a
    tokenizer that encodes as WhisperTokenizer does and decodes as its decode(skip_special_tokens=True)."""
    _, hf_dir, _ = multilingual
    assert main(["import-hf", str(hf_dir), str(tmp_path / "qkv"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "speech_encoder_decoder" and summary["ignored"] == [] and summary["notes"] == []
    assert summary["tokenizer"].startswith("tokenizer.json (kept tokenizer_config.json")
    meta = json.loads((tmp_path / "qkv" / "config.json").read_text())
    for name in ("tokenizer_config.json", "generation_config.json", "preprocessor_config.json"):
        assert name in meta["files"]
    hf_tokenizer = WhisperTokenizer.from_pretrained(hf_dir)
    ids = dict(zip(SPECIALS, hf_tokenizer.convert_tokens_to_ids(SPECIALS), strict=True))
    assert meta["whisper"] == {
        "multilingual": True,
        "languages": {"en": ids["<|en|>"], "de": ids["<|de|>"]},
        "tasks": {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        "no_timestamps_id": ids["<|notimestamps|>"],
        "suppress_tokens": [],
        "begin_suppress_tokens": [],
        "max_initial_timestamp": None,
        "alignment_heads": [],  # none named: word timestamps read the upper half's heads
    }
    tokenizer = Tokenizer.load(tmp_path / "qkv" / "tokenizer.json")
    end = hf_tokenizer.eos_token_id
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (end, ids["<|startoftranscript|>"], end)
    for text in [*CORPUS, "Unseen wörds 東京 <|de|> too"]:
        encoded = tokenizer.encode(text)
        assert encoded == hf_tokenizer(text, add_special_tokens=False).input_ids, text
        with_specials = [ids["<|startoftranscript|>"], ids["<|de|>"], *encoded, end]
        assert tokenizer.decode(with_specials) == hf_tokenizer.decode(with_specials, skip_special_tokens=True)
    assert tokenizer.decode(hf_tokenizer.convert_tokens_to_ids(TIMESTAMPS)) == "".join(TIMESTAMPS)  # kept as text
    assert json.loads((english[2] / "config.json").read_text())["whisper"]["multilingual"] is False


# ------------------------------------------------------------------------ start tokens and transcripts


@pytest.mark.parametrize(("language", "task"), [("de", "translate"), ("en", "transcribe"), ("<|de|>", "transcribe")])
def test_multilingual_greedy_equals_generate(multilingual, language: str, task: str) -> None:
    """start_tokens gives the tokens generate starts from; greedy continues as generate does."""
    hf, hf_dir, qkv_dir = multilingual
    model, meta = load_model(qkv_dir)
    prefix = start_tokens(qkv_dir, language=language, task=task)
    code = language.strip("<|>")
    ids = meta["whisper"]
    assert prefix == [model.config.bos_id, ids["languages"][code], ids["tasks"][task], ids["no_timestamps_id"]]
    ours = greedy(model, qkv_features(model.config.features), max_new_tokens=NEW, prefix=prefix)
    assert ours == hf_generate(hf, hf_features(hf_dir, waves()), prefix, language=code, task=task)
    assert all(len(row) == NEW for row in ours)  # a random model rarely ends: the comparison is long
    assert start_tokens(qkv_dir, language=language, task=task, timestamps=True) == prefix[:-1]


def test_english_only_greedy_equals_generate(english) -> None:
    hf, hf_dir, qkv_dir = english
    model, meta = load_model(qkv_dir)
    prefix = start_tokens(qkv_dir)
    assert prefix == [model.config.bos_id, meta["whisper"]["no_timestamps_id"]]
    ours = greedy(model, qkv_features(model.config.features), max_new_tokens=NEW, prefix=prefix)
    assert ours == hf_generate(hf, hf_features(hf_dir, waves()), prefix)
    hypotheses = beam_search(model, qkv_features(model.config.features), beam_size=1, max_new_tokens=NEW, prefix=prefix)
    assert [h[0].tokens for h in hypotheses] == ours


def test_start_token_errors(multilingual, english) -> None:
    """A language or task the model does not know is one line naming it and the known ones."""
    qkv_dir, en_dir = multilingual[2], english[2]
    with pytest.raises(UserError, match=r"config\.json: unknown language 'fr'; the model knows en, de$"):
        start_tokens(qkv_dir, language="fr")
    with pytest.raises(UserError, match=r"unknown task 'summarize'; the model knows transcribe, translate$"):
        start_tokens(qkv_dir, language="de", task="summarize")
    with pytest.raises(UserError, match=r"multilingual: give a language \(en, de\)"):
        start_tokens(qkv_dir)
    with pytest.raises(UserError, match=r"English-only .* language 'de' is not possible"):
        start_tokens(en_dir, language="de")
    with pytest.raises(UserError, match=r"English-only .* task 'translate' is not possible"):
        start_tokens(en_dir, task="translate")
    model, _ = load_model(en_dir)
    with pytest.raises(UserError, match="English-only"):
        detect_language(model, qkv_features(model.config.features), en_dir)


def test_detect_language_equals_hf(multilingual) -> None:
    hf, hf_dir, qkv_dir = multilingual
    model, meta = load_model(qkv_dir)
    codes = detect_language(model, qkv_features(model.config.features), qkv_dir)
    languages = meta["whisper"]["languages"]
    assert [languages[c] for c in codes] == hf.detect_language(hf_features(hf_dir, waves())).tolist()


# ------------------------------------------------------------------------ export


@pytest.mark.parametrize("which", ["multilingual", "english"])
def test_export_round_trip(which: str, request, tmp_path: Path) -> None:
    """export-hf writes what from_pretrained loads whole: same logits, same transcripts, the
    feature extractor and tokenizer as they were."""
    hf, hf_dir, qkv_dir = request.getfixturevalue(which)
    out = tmp_path / "exported"
    summary = export_hf(qkv_dir, out)
    assert summary["architecture"] == "WhisperForConditionalGeneration"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert name in summary["files"]
    back, info = WhisperForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    back.eval()
    feats = hf_features(out, waves())
    assert torch.equal(feats, hf_features(hf_dir, waves()))
    tgt = torch.tensor([[hf.config.decoder_start_token_id, 5, 77, 290, 3]])
    with torch.no_grad():
        assert_close(
            back(input_features=feats, decoder_input_ids=tgt.expand(2, -1)).logits,
            hf(input_features=feats, decoder_input_ids=tgt.expand(2, -1)).logits,
        )
    language, task = ("de", "translate") if which == "multilingual" else (None, "transcribe")
    prefix = start_tokens(qkv_dir, language=language, task=task)
    hf_task = task if language else None  # HF refuses a task for an English-only model
    assert hf_generate(back, feats, prefix, language=language, task=hf_task) == hf_generate(
        hf, feats, prefix, language=language, task=hf_task
    )
    tokenizer, original = WhisperTokenizer.from_pretrained(out), WhisperTokenizer.from_pretrained(hf_dir)
    for text in CORPUS:
        assert tokenizer(text).input_ids == original(text).input_ids


def test_native_speech_model_exports_as_whisper(tmp_path: Path) -> None:
    """A qkv speech model of Whisper's layout (no import, no tokenizer) exports as a Whisper that
    computes the same logits and, from BEGIN alone, the same greedy transcripts."""
    config = SpeechConfig(
        d_model=22,
        n_heads=2,
        d_ff=37,
        activation="gelu",
        positions="learned",
        max_len=17,
        dropout=0.0,
        vocab_size=41,
        n_encoder_layers=1,
        n_decoder_layers=2,
        features=FeatureConfig(kind="whisper", chunk_seconds=1.0),
        frontend="whisper",
        encoder_positions="whisper",
        scale_embeddings=False,
        key_bias=False,
        ctc=False,
        pad_id=0,
        bos_id=1,
        eos_id=2,
    )
    torch.manual_seed(3)
    model = SpeechEncoderDecoder(config).eval()
    perturb(model, 4)
    save_model(model, tmp_path / "qkv")
    export_hf(tmp_path / "qkv", tmp_path / "hf")
    back, info = WhisperForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    back.eval()
    feats = hf_features(tmp_path / "hf", waves())  # the exported preprocessor_config.json: 1 s chunks
    ours = torch.stack(qkv_features(config.features))
    tgt = torch.tensor([[1, 7, 3, 40, 9]] * 2)
    with torch.no_grad():
        assert_close(model(ours, None, tgt), back(input_features=feats, decoder_input_ids=tgt).logits)
    expected = hf_generate(back, feats, [1])
    assert greedy(model, list(ours), max_new_tokens=NEW) == expected


def test_export_refuses_what_whisper_cannot_express(tmp_path: Path) -> None:
    config = SpeechConfig(d_model=22, n_heads=2, d_ff=37, vocab_size=41, n_encoder_layers=1, n_decoder_layers=1)
    save_model(SpeechEncoderDecoder(config), tmp_path / "qkv")  # ESPnet's front-end and a CTC head
    with pytest.raises(UserError, match=r"^cannot export as Whisper: it needs frontend='whisper'"):
        export_hf(tmp_path / "qkv", tmp_path / "hf")


# ------------------------------------------------------------------------ bad checkpoints


def edited_copy(src: Path, dst: Path, name: str, **changes) -> Path:
    """A copy of the checkpoint ``src`` whose JSON file ``name`` has ``changes``."""
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    fields = json.loads((dst / name).read_text())
    fields.update(changes)
    (dst / name).write_text(json.dumps(fields))
    return dst


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("config.json", {"decoder_attention_heads": 11}, r"config\.json: decoder_attention_heads=11 is not supported"),
        ("config.json", {"decoder_ffn_dim": 41}, r"config\.json: decoder_ffn_dim=41 is not supported"),
        ("config.json", {"activation_function": "mish"}, r"config\.json: activation_function='mish' is not supported"),
        ("preprocessor_config.json", {"chunk_length": 2}, r"preprocessor_config\.json: chunk_length=2 s gives 200"),
        ("preprocessor_config.json", {"feature_size": 128}, r"preprocessor_config\.json: field 'feature_size'"),
        ("generation_config.json", {"task_to_id": {"summarize": 3}}, r"generation_config\.json: field 'task_to_id'"),
    ],
)
def test_bad_fields_are_one_line(multilingual, tmp_path: Path, name: str, changes: dict, message: str) -> None:
    bad = edited_copy(multilingual[1], tmp_path / "bad", name, **changes)
    with pytest.raises(UserError, match=message) as caught:
        import_hf(bad, tmp_path / "qkv")
    assert "\n" not in str(caught.value) and str(bad / name) in str(caught.value)
    assert not (tmp_path / "qkv").exists()


def test_positions_that_are_not_sinusoids_are_refused(multilingual, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    bad = edited_copy(multilingual[1], tmp_path / "bad", "config.json")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.encoder.embed_positions.weight"] = tensors["model.encoder.embed_positions.weight"] + 0.1
    save_file(tensors, bad / "model.safetensors", {"format": "pt"})
    with pytest.raises(UserError, match=r"'model\.encoder\.embed_positions\.weight' is not Whisper's sinusoids"):
        import_hf(bad, tmp_path / "qkv")


# ------------------------------------------------------------------------ decoding from a prefix


def teacher_forced(model, source, prefix: list[int], new: int) -> list[int]:
    """Greedy decoding the slow way: the whole target through the model at every step."""
    tokens = list(prefix)
    for _ in range(new):
        with torch.no_grad():
            if isinstance(model, SpeechEncoderDecoder):
                logits = model(source[None], None, torch.tensor([tokens]))[0, -1]  # (V,)
            else:
                logits = model(torch.tensor([source]), torch.tensor([tokens]))[0, -1]  # (V,)
        token = int(logits.argmax())
        if token == model.config.eos_id:
            break
        tokens.append(token)
    return tokens[len(prefix) :]


def tiny_translator() -> EncoderDecoder:
    config = EncoderDecoderConfig(
        d_model=16,
        n_heads=2,
        d_ff=23,
        src_vocab_size=31,
        tgt_vocab_size=31,
        n_encoder_layers=1,
        n_decoder_layers=2,
        max_len=13,
        dropout=0.0,
    )
    torch.manual_seed(11)
    model = EncoderDecoder(config).eval()
    perturb(model, 12)
    return model


def test_prefix_of_begin_alone_is_the_default(multilingual) -> None:
    speech, _ = load_model(multilingual[2])
    translator = tiny_translator()
    for model, inputs in ((speech, qkv_features(speech.config.features)), (translator, [[5, 6, 7], [8, 9]])):
        bos = [model.config.bos_id]
        assert greedy(model, inputs, max_new_tokens=9, prefix=bos) == greedy(model, inputs, max_new_tokens=9)
        with_prefix = beam_search(model, inputs, beam_size=3, max_new_tokens=9, nbest=2, prefix=bos)
        assert with_prefix == beam_search(model, inputs, beam_size=3, max_new_tokens=9, nbest=2)


def test_longer_prefix_is_teacher_forced_then_continued(multilingual) -> None:
    speech, _ = load_model(multilingual[2])
    prefix = start_tokens(multilingual[2], language="de", task="transcribe")
    feats = qkv_features(speech.config.features)
    assert greedy(speech, feats, max_new_tokens=8, prefix=prefix) == [
        teacher_forced(speech, f, prefix, 8) for f in feats
    ]
    translator = tiny_translator()
    sources, prefix = [[5, 6, 7], [8, 9]], [translator.config.bos_id, 17, 4]
    expected = [teacher_forced(translator, s, prefix, 8) for s in sources]
    assert greedy(translator, sources, max_new_tokens=8, prefix=prefix) == expected
    beams = beam_search(translator, sources, beam_size=1, max_new_tokens=8, prefix=prefix)
    assert [h[0].tokens for h in beams] == expected


def test_prefix_counts_against_the_window(multilingual) -> None:
    """A prefix takes target positions: the new tokens stop where the window is full (no learned
    position past its table), and a prefix that cannot fit, or one given to a decoder-only
    model, is refused."""
    speech, _ = load_model(multilingual[2])
    prefix = start_tokens(multilingual[2], language="en")  # 4 of the 29 positions
    feats = qkv_features(speech.config.features)
    longest = speech.config.max_len - len(prefix) + 1
    assert max(len(row) for row in greedy(speech, feats, max_new_tokens=10**6, prefix=prefix)) <= longest
    beams = beam_search(speech, feats[:1], beam_size=2, max_new_tokens=10**6, prefix=prefix)
    assert len(beams[0][0].tokens) <= longest
    with pytest.raises(ValueError, match="does not fit the window max_len=29"):
        greedy(speech, feats, max_new_tokens=3, prefix=prefix * 8)
    with pytest.raises(ValueError, match="token ids in"):
        greedy(speech, feats, max_new_tokens=3, prefix=[speech.config.vocab_size])
    with pytest.raises(ValueError, match="must start with BEGIN"):
        greedy(speech, feats, max_new_tokens=3, prefix=prefix[1:])
    lm = DecoderOnly(DecoderOnlyConfig(d_model=16, n_heads=2, d_ff=23, vocab_size=31, n_layers=1, max_len=13))
    with pytest.raises(ValueError, match="decoder-only"):
        greedy(lm, [[1, 2]], max_new_tokens=3, prefix=[1])


# ------------------------------------------------------------------------ qkv transcribe


def test_transcribe_with_an_imported_whisper(multilingual, tmp_path: Path, capsys) -> None:
    """qkv transcribe on WAV files: the start tokens of --language/--task (or of each file's
    detected language), then greedy decoding, exactly as greedy() with that prefix."""
    import soundfile

    from qkv.audio import load_audio

    _, _, qkv_dir = multilingual
    model, _ = load_model(qkv_dir)
    tokenizer = Tokenizer.load(qkv_dir / "tokenizer.json")
    files = []
    for i, wave in enumerate(waves()):  # within the 1 s chunk: a longer file is refused, not cut
        files.append(tmp_path / f"w{i}.wav")
        wave = wave[:14_000]
        soundfile.write(files[-1], wave, 16000, subtype="FLOAT")
    feats = [features(load_audio(f), model.config.features) for f in files]

    def expected(prefix: list[int]) -> list[str]:
        rows = greedy(model, feats, max_new_tokens=model.config.max_len, prefix=prefix)
        return [tokenizer.decode([t for t in row if t != model.config.eos_id]).strip() for row in rows]

    argv = ["transcribe", "--model", str(qkv_dir), *map(str, files), "--beam", "1", "--quiet"]
    assert main([*argv, "--language", "de", "--task", "translate"]) == 0
    out = capsys.readouterr().out
    prefix = start_tokens(qkv_dir, language="de", task="translate")
    assert [line.split("\t", 1)[1] for line in out.splitlines()] == expected(prefix)
    assert main(argv) == 0  # no --language: each file's own, detected
    out, err = capsys.readouterr()
    detected = detect_language(model, feats, qkv_dir)
    assert f"detected language{'s' if len(set(detected)) > 1 else ''} " in err
    for line, code, f in zip(out.splitlines(), detected, feats, strict=True):
        rows = greedy(model, [f], max_new_tokens=model.config.max_len, prefix=start_tokens(qkv_dir, language=code))
        assert line.split("\t", 1)[1] == tokenizer.decode([t for t in rows[0] if t != model.config.eos_id]).strip()
    assert main([*argv, "--language", "xx"]) == 2
    assert "xx" in capsys.readouterr().err
    soundfile.write(tmp_path / "long.wav", waves()[1], 16000)  # 1.3 s: past the model's chunk, read in windows
    long = [*argv[:3], str(tmp_path / "long.wav"), "--quiet", "--no-fallback", "--language", "de"]
    assert main(long) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert main([*long, "--max-seconds", "1"]) == 2
    assert "long.wav: 1.3 s long, over the limit of 1 s" in capsys.readouterr().err
