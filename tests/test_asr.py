"""The speech task (``tasks/asr.py``), ``qkv transcribe`` and ``qkv evaluate --wer``: a tiny model
trained on tone "words" learns them; batches cover every utterance within the budget; the
command line reads files, folders and lists, names bad files, and writes what it says."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import re
import shlex
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv import runner
from qkv.blocks import BlockConfig
from qkv.checkpoint import build_model, load_model, read_meta, save_model
from qkv.cli.main import main
from qkv.errors import UserError
from qkv.evaluation import error_rates, normalize_transcript
from qkv.recipes import batch_of_step, length_batches
from qkv.speech_corpora import read_manifest
from qkv.tasks import TASKS, load_recipe
from qkv.tasks.asr import cross_attention
from qkv.tasks.asr_init import DECODER_FIELDS, DECODER_PARTS, decoder_tokenizer, init_decoder, init_encoder
from qkv.tokenization import Tokenizer, Vocabularies
from speech_data import TONES, tiny_asr_overrides, tone_corpus

ROOT = Path(__file__).resolve().parents[1]
STEPS = 200


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A tiny speech model trained on 12 tone utterances (and scored on them)."""
    tmp = tmp_path_factory.mktemp("asr")
    manifest = tone_corpus(tmp / "tones")
    recipe = load_recipe(None, [*tiny_asr_overrides(manifest), f"train.steps={STEPS}"])
    summary = runner.train(TASKS["asr"], recipe, tmp / "model", progress=False)
    return tmp / "model", manifest, summary


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------- the task


def test_a_tiny_model_learns_the_tone_words(trained) -> None:
    model, _, summary = trained
    assert summary["losses"][-1] < 0.1 * summary["losses"][0]
    assert summary["wer"] <= 0.1, list(zip(summary["hypotheses"], summary["references"], strict=True))
    meta = read_meta(model)
    assert meta["kind"] == "speech_encoder_decoder" and meta["task"] == "asr"
    assert meta["wer"] == summary["wer"]  # the score is saved with the model
    assert (model / "cross_attention.png").stat().st_size > 5000
    assert summary["tokens_per_second"] > 0  # seconds of audio per second


def test_cross_attention_rows_are_distributions_over_the_frames(trained) -> None:
    from qkv.audio import features, load_audio
    from qkv.checkpoint import load_model

    path, manifest, _ = trained
    model, _ = load_model(path)
    utterance = read_manifest(manifest)[0]
    feats = features(load_audio(utterance.path), model.config.features)
    weights = cross_attention(model, feats, [5, 6, 7])
    frames = int(model.subsampled(torch.tensor(feats.shape[0])))
    assert weights.shape == (model.config.n_heads, 4, frames)
    assert torch.allclose(weights.sum(-1), torch.ones(model.config.n_heads, 4), atol=1e-5)


def test_the_model_is_saved_before_the_test_set_is_decoded(tmp_path, monkeypatch) -> None:
    """A failure (or Ctrl-C) while scoring does not lose the training: the model directory is
    already written, loadable, without scores."""
    import qkv.tasks.asr as asr

    def fails(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(asr, "score_model", fails)
    manifest = tone_corpus(tmp_path / "tones", utterances=4)
    recipe = load_recipe(None, [*tiny_asr_overrides(manifest), "train.steps=3"])
    with pytest.raises(KeyboardInterrupt):
        runner.train(TASKS["asr"], recipe, tmp_path / "model", progress=False)
    meta = read_meta(tmp_path / "model")
    assert meta["steps"] == 3 and "wer" not in meta
    assert not (tmp_path / "model" / "last").exists()
    load_model(tmp_path / "model")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=60), st.integers(1, 2000))
def test_length_batches_hold_every_utterance_once_within_the_budget(frames, budget) -> None:
    batches = length_batches(frames, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(frames)))
    for b in batches:
        assert len(b) == 1 or max(frames[i] for i in b) * len(b) <= budget


def test_every_epoch_takes_every_batch_once_in_its_own_order() -> None:
    epochs = [[batch_of_step(7, step, seed=3) for step in range(e * 7, e * 7 + 7)] for e in range(3)]
    assert all(sorted(e) == list(range(7)) for e in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    assert batch_of_step(7, 9, seed=3) == batch_of_step(7, 9, seed=3)


def test_the_shipped_speech_recipes_load() -> None:
    for name in ("fsdd_digits", "fsdd_digit_strings", "speech_en", "speech_de_en"):
        recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml")
        assert recipe.task == "asr"
        assert recipe.model["features"]["n_mels"] == 80


def test_the_cascade_translator_recipe_has_the_speech_translation_decoder_shape() -> None:
    """recipes/speech_de_en_mt.yaml exists to start speech_de_en's decoder: every decoder field
    init_decoder compares agrees, and it reads sources as the recognizer writes them."""
    mt, st = (load_recipe(ROOT / "recipes" / f"{name}.yaml") for name in ("speech_de_en_mt", "speech_de_en"))
    writer = build_model("encoder_decoder", {**mt.model, "src_vocab_size": 97, "tgt_vocab_size": 97}).config
    speech = build_model("speech_encoder_decoder", {**st.model, "vocab_size": 97}).config
    assert [getattr(writer, n) for n in DECODER_FIELDS] == [getattr(speech, n) for n in DECODER_FIELDS]
    assert mt.task == "translation" and mt.data.source_as_transcript is True


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ("data.corpus=librispeech", "data.corpus"),
        ("train.ctc_loss_weight=1.5", "train.ctc_loss_weight"),
        ("data.translate=true", "data.translate"),
        ("model.features.kind=mfcc", "kind"),
        ("model.frontend=lstm", "frontend"),
        ("data.speed_perturb=[]", "data.speed_perturb"),
        ("data.speed_perturb=[0.9, 3]", "data.speed_perturb"),
    ],
)
def test_bad_speech_recipe_values_are_named(item, named) -> None:
    with pytest.raises(UserError, match=named.replace(".", r"\.")):
        load_recipe(None, ["task=asr", item])


def test_a_translation_model_starts_from_a_recognizers_encoder(trained, tmp_path) -> None:
    source, manifest, _ = trained
    pretrained, _ = load_model(source)
    fields = {**dataclasses.asdict(pretrained.config), "vocab_size": 37, "ctc": False, "max_len": 11}
    model = build_model("speech_encoder_decoder", fields)  # another vocabulary and decoder window
    assert init_encoder(model, source) == source
    theirs, ours = pretrained.state_dict(), model.state_dict()
    encoder = [k for k in ours if k.startswith(("frontend.", "encoder."))]
    assert encoder and all(torch.equal(ours[k], theirs[k]) for k in encoder)
    assert not torch.equal(
        ours["decoder.blocks.0.cross_attn.w_q.weight"], theirs["decoder.blocks.0.cross_attn.w_q.weight"]
    )
    # An encoder that computes something else is refused, naming the field.
    wider = build_model("speech_encoder_decoder", {**fields, "d_ff": 71})
    with pytest.raises(UserError, match=r"train\.init_encoder: .* has model d_ff=64; the recipe says 71"):
        init_encoder(wider, source)
    # A source that is missing is named by its recipe key before any data is read; through a
    # recipe, the run says where its encoder came from.
    started_from(tmp_path, manifest, "init_encoder", tmp_path / "none", r"model directory .*none does not exist")
    started_from(tmp_path, manifest, "init_encoder", source)


def started_from(tmp_path: Path, manifest: Path, key: str, source: Path, refused: str | None = None) -> dict:
    """Train 2 steps of the tiny recipe with ``train.<key>=source`` and return the summary, after
    checking that the run and the saved model name the source; with ``refused``, check instead
    that the key and that message are the error raised before any data is read (the manifest
    given does not exist)."""
    if refused is not None:
        recipe = load_recipe(None, [*tiny_asr_overrides(tmp_path / "no.tsv"), f"train.{key}={source}"])
        with pytest.raises(UserError, match=rf"^train\.{key}: {refused}"):
            runner.train(TASKS["asr"], recipe, tmp_path / "never", progress=False)
        return {}
    recipe = load_recipe(None, [*tiny_asr_overrides(manifest), "train.steps=2", f"train.{key}={source}"])
    summary = runner.train(TASKS["asr"], recipe, tmp_path / "st", progress=False)
    assert summary[key] == str(source) and read_meta(tmp_path / "st")[key] == str(source)
    return summary


def translator(directory: Path, speech_config, *, separate: bool) -> Path:
    """A tiny translation model directory (random weights) whose decoder has the shape of
    ``speech_config``'s: one joint character vocabulary, or separate ones (a German-ish source,
    a target that holds the tone words and more), each the size of neither the other's nor
    the speech model's."""
    target = Tokenizer.train_char_level([" ".join(TONES) + " xq"])
    source = Tokenizer.train_char_level(["zwei hunde laufen"]) if separate else target
    block = {f.name: getattr(speech_config, f.name) for f in dataclasses.fields(BlockConfig)}
    fields = {
        **block,
        "src_vocab_size": source.vocab_size,
        "tgt_vocab_size": target.vocab_size,
        "n_encoder_layers": 1,
        "n_decoder_layers": speech_config.n_decoder_layers,
        "share_embeddings": not separate,
        **{name: getattr(target, name) for name in ("pad_id", "bos_id", "eos_id")},
    }
    torch.manual_seed(11)
    model = build_model("encoder_decoder", fields)
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, directory, files=Vocabularies(source, target).save(tmp), extra={"task": "translation"})
    return directory


@pytest.mark.parametrize("separate", [False, True], ids=["joint", "separate"])
def test_a_translation_model_starts_from_a_translators_decoder(trained, tmp_path, separate) -> None:
    source, manifest, _ = trained
    recognizer, _ = load_model(source)
    mt_dir = translator(tmp_path / "mt", recognizer.config, separate=separate)
    mt, _ = load_model(mt_dir)
    tokens = decoder_tokenizer(mt_dir)
    assert tokens.vocab_size == mt.config.tgt_vocab_size  # the target's vocabulary, not the source's
    assert (mt.config.src_vocab_size != mt.config.tgt_vocab_size) == separate
    fields = {**dataclasses.asdict(recognizer.config), "vocab_size": tokens.vocab_size, "ctc": False}
    model = build_model("speech_encoder_decoder", fields)
    encoder_before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("encoder.")}
    assert init_decoder(model, mt_dir) == mt_dir
    ours, theirs = model.state_dict(), mt.state_dict()
    copied = [(k, DECODER_PARTS[p] + k[len(p) :]) for k in theirs for p in DECODER_PARTS if k.startswith(p)]
    assert copied and all(torch.equal(ours[mine], theirs[k]) for k, mine in copied)
    assert {mine for _, mine in copied} >= {k for k in ours if k.startswith(("embed.", "decoder.", "output."))}
    assert torch.equal(ours["embed.token.weight"], mt.tgt_embed.token.weight)  # the target side's table
    assert all(torch.equal(ours[k], v) for k, v in encoder_before.items())  # the encoder is left alone
    # A decoder that computes something else, or writes other pieces, is refused by name.
    wider = build_model("speech_encoder_decoder", {**fields, "d_ff": 71})
    with pytest.raises(UserError, match=r"train\.init_decoder: .* has model d_ff=64; the recipe says 71"):
        init_decoder(wider, mt_dir)
    other = build_model("speech_encoder_decoder", {**fields, "vocab_size": tokens.vocab_size + 2})
    with pytest.raises(UserError, match=r"writes another vocabulary"):
        init_decoder(other, mt_dir)
    # A speech model is not a translator: named by the recipe key before any data is read.
    started_from(tmp_path, manifest, "init_decoder", source, r".* holds a speech_encoder_decoder model")
    # Through a recipe: the run writes the translator's target pieces and says where its decoder came from.
    summary = started_from(tmp_path, manifest, "init_decoder", mt_dir)
    assert summary["tokenizer"].same_as(tokens) and tokens.vocab_size != recognizer.config.vocab_size


# ------------------------------------------------------------------ qkv transcribe


def test_transcribe_files_folders_and_lists(trained, capsys, tmp_path, monkeypatch) -> None:
    import io

    model, manifest, summary = trained
    utterances = read_manifest(manifest)
    files = [str(u.path) for u in utterances[:3]]
    rc, out, err = run(capsys, "transcribe", "--model", str(model), *files, "--beam", "2")
    assert rc == 0
    lines = [line.split("\t") for line in out.splitlines()]
    assert [p for p, _ in lines] == files
    assert [t for _, t in lines] == summary["hypotheses"][:3]  # what training's scoring decoded
    assert "3 files" in err and "real time" in err
    # A folder: its audio files, sorted; stdin: a list of paths.
    rc, out, _ = run(capsys, "transcribe", "--model", str(model), str(manifest.parent), "--quiet")
    assert rc == 0 and len(out.splitlines()) == len(utterances)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("\n".join(files).encode())))
    rc, listed, _ = run(capsys, "transcribe", "--model", str(model), "--input", "-", "--beam", "2")
    assert rc == 0 and [line.split("\t")[0] for line in listed.splitlines()] == files
    # --json: one object per file, with timings; --output: written atomically.
    target = tmp_path / "out.jsonl"
    rc, out, _ = run(capsys, "transcribe", "--model", str(model), *files, "--json", "--output", str(target))
    assert rc == 0 and out == ""
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["path"] for r in records] == files
    assert all(r["audio_seconds"] > 0 and r["decode_seconds"] >= 0 for r in records)


def _best_path(model, feats: list[torch.Tensor], tokenizer: Tokenizer) -> list[str]:
    """CTC best-path decoding worked out here from the CTC head's frame scores: the likeliest
    token of every frame, repeats merged, blanks dropped (Graves et al., 2006, section 3.2)."""
    texts = []
    for f in feats:
        memory, _ = model.encode(f[None])  # (1, S, D)
        frames = model.ctc_logits(memory)[0].argmax(-1).tolist()  # (S,)
        ids = [t for i, t in enumerate(frames) if (i == 0 or t != frames[i - 1]) and t != model.config.blank]
        texts.append(tokenizer.decode(ids))
    return texts


@torch.no_grad()
def test_ctc_only_and_joint_decoding_read_the_ctc_head_by_its_weight(trained, capsys) -> None:
    """CTC-only decoding is the CTC head's best path (and, trained, the transcripts); attention-only
    decoding never reads the head; joint decoding reads it as much as its weight says: with the head
    scrambled, the transcripts drift further from the truth, towards the scrambled head's best path,
    as the weight grows. qkv transcribe --ctc-only and --ctc-weight write what the library does."""
    from qkv.audio import features, load_audio
    from qkv.loading import load_for_generation
    from qkv.tasks.asr import transcribe

    path, manifest, _ = trained
    utterances = read_manifest(manifest)
    model, vocab = load_for_generation(str(path), speech=True)
    tokenizer = vocab.target
    feats = [features(load_audio(u.path), model.config.features) for u in utterances]
    truth = [u.text for u in utterances]

    def decoded(m, **how) -> list[str]:
        return [t.text for t in transcribe(m, tokenizer, feats, **how)]

    ctc_only = decoded(model, ctc_only=True)
    assert ctc_only == _best_path(model, feats, tokenizer)
    assert error_rates(ctc_only, truth)["wer"] <= 0.1, list(zip(ctc_only, truth, strict=True))
    other = copy.deepcopy(model)  # the same model, its CTC head drawn afresh
    other.ctc.weight.copy_(torch.randn(other.ctc.weight.shape, generator=torch.Generator().manual_seed(0)))
    other.ctc.bias.zero_()
    wrong = _best_path(other, feats, tokenizer)
    assert decoded(other, ctc_only=True) == wrong and error_rates(wrong, truth)["cer"] > 0.5
    attention = decoded(model, ctc_weight=0.0)
    assert decoded(other, ctc_weight=0.0) == attention  # attention alone: the head unread
    to_truth, to_wrong = [], []
    for texts in (attention, decoded(other, ctc_weight=0.3), decoded(other, ctc_weight=0.9)):
        to_truth.append(error_rates(texts, truth)["cer"])
        to_wrong.append(error_rates(texts, wrong, normalize=False)["cer"])
    assert to_truth[0] < to_truth[1] < to_truth[2] and to_wrong[0] > to_wrong[1] > to_wrong[2], (to_truth, to_wrong)
    files = [str(u.path) for u in utterances]
    for extra, expected in (
        (["--ctc-only"], ctc_only),
        (["--ctc-weight", "0.5"], decoded(model, ctc_weight=0.5, beam_size=4)),
    ):
        rc, out, _ = run(capsys, "transcribe", "--model", str(path), *files, *extra)
        assert rc == 0 and out.splitlines() == [f"{f}\t{t}" for f, t in zip(files, expected, strict=True)]


def test_a_language_model_of_the_recognizers_tokens_is_fused(trained, capsys, tmp_path) -> None:
    """The lm task trains on the speech model's own tokenizer (data.tokenizer: its directory)
    and lines written as its transcripts (data.transcripts: capitals and commas gone), and
    qkv transcribe --lm fuses it: weight 0 writes what no LM writes. An LM of other tokens,
    --lm-weight without --lm, and --lm with --ctc-only are refused (exit 2)."""
    from qkv.tokenization import Tokenizer

    model, manifest, _ = trained
    text = tmp_path / "lines.txt"
    words = sorted(TONES)
    text.write_text("".join(f"{a.capitalize()} {b}, {a}!\n" for a in words for b in words))

    def lm(out: str, *extra: str) -> Path:
        shape = ["model.d_model=16", "model.n_heads=2", "model.d_ff=32", "model.n_layers=1", "model.max_len=16"]
        data = [f"data.text={text}", f"data.valid_text={text}", "data.documents=lines", *extra]
        recipe = load_recipe(None, ["task=lm", *shape, *data, "train.steps=30", "train.batch_size=4", "train.warmup=3"])
        runner.train(TASKS["lm"], recipe, tmp_path / out, progress=False)
        return tmp_path / out

    ours = lm("lm", f"data.tokenizer={model}", "data.transcripts=true")
    assert Tokenizer.load(ours / "tokenizer.json").same_as(Tokenizer.load(model / "tokenizer.json"))
    rc, out, _ = run(capsys, "evaluate", "--model", str(ours), "--text", str(text), "--json")  # read as trained
    assert rc == 0 and json.loads(out)["loss"] == pytest.approx(read_meta(ours)["val_loss"], abs=1e-4)
    files = [str(u.path) for u in read_manifest(manifest)[:5]]
    plain = run(capsys, "transcribe", "--model", str(model), *files)[:2]  # exit status, stdout
    assert run(capsys, "transcribe", "--model", str(model), *files, "--lm", str(ours), "--lm-weight", "0")[:2] == plain
    rc, fused, _ = run(capsys, "transcribe", "--model", str(model), *files, "--lm", str(ours))
    assert rc == 0 and [line.split("\t")[0] for line in fused.splitlines()] == files
    theirs = lm("other", "data.tokenizer=char")  # a vocabulary of its own: capitals, commas
    with pytest.raises(UserError, match=r"data\.transcripts=true needs data\.documents=lines"):
        load_recipe(None, ["task=lm", f"data.text={text}", "data.transcripts=true"])
    not_a_model = re.escape(f"data.tokenizer: {tmp_path} is not char, subword or a model directory")
    with pytest.raises(UserError, match=not_a_model):
        lm("none", f"data.tokenizer={tmp_path}")
    stream = lm("stream", f"data.tokenizer={model}", "data.documents=text")  # never saw END
    short = lm("short", f"data.tokenizer={model}", "model.max_len=13")
    for extra, said in [
        (["--lm", str(theirs)], "its tokens are not the speech model's"),
        (["--lm", str(stream)], "never learnt where a text ends"),
        (["--lm", str(short)], "its window (13) is shorter than the speech model's (16)"),
        (["--lm-weight", "0.5"], "--lm-weight weighs the language model of --lm"),
        (["--lm", str(ours), "--ctc-only"], "--ctc-only decodes without one"),
    ]:
        rc, out, err = run(capsys, "transcribe", "--model", str(model), files[0], *extra)
        assert rc == 2 and out == "" and said in err and len(err.strip().splitlines()) == 1


def test_bad_audio_files_are_all_named_and_skipped_only_when_asked(trained, capsys, tmp_path) -> None:
    model, manifest, _ = trained
    good = str(read_manifest(manifest)[0].path)
    empty, text = tmp_path / "empty.wav", tmp_path / "notes.wav"
    empty.write_bytes(b"")
    text.write_text("not audio")
    missing = tmp_path / "missing.flac"
    short = tmp_path / "click.wav"  # 40 ms: shorter than the conv2d front-end's first window (70 ms)
    soundfile.write(short, 0.3 * np.sin(np.arange(640) * 0.2), 16000)
    more = [tmp_path / f"empty{i}.wav" for i in range(3)]  # seven bad files: every one is named
    for path in more:
        path.write_bytes(b"")
    bad = [empty, text, missing, short, *more]
    argv = [good, *map(str, bad)]
    rc, out, err = run(capsys, "transcribe", "--model", str(model), *argv)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == len(bad) + 1  # a line per bad file, then the refusal
    for path in bad:
        assert sum(line.startswith(f"qkv transcribe: {path}: ") for line in lines[:-1]) == 1
    assert any(str(short) in line and "40 ms is too short for this model" in line for line in lines)
    assert "7 of 8 files" in lines[-1] and "--skip-bad" in lines[-1]
    rc, out, err = run(capsys, "transcribe", "--model", str(model), good, str(empty), "--skip-bad")
    assert rc == 0 and out.splitlines()[0].startswith(good + "\t")
    assert f"skipped {empty}" in err


def test_transcribe_refuses_a_text_model_and_whisper_options_elsewhere(trained, capsys, tmp_path) -> None:
    model, manifest, _ = trained
    file = str(read_manifest(manifest)[0].path)
    rc, _, err = run(capsys, "transcribe", "--model", str(model), file, "--language", "de")
    assert rc == 2 and "Whisper" in err
    rc, _, err = run(capsys, "transcribe", "--model", str(model))
    assert rc == 2 and "no audio files" in err


# ------------------------------------------------------------------ qkv evaluate --wer


def test_error_rates_count_substitutions_deletions_insertions(capsys, tmp_path) -> None:
    # ref "the cat sat on the mat" (6 words); hyp: cat->bat (S), "on" deleted (D), "down" inserted (I).
    rates = error_rates(["The bat sat the mat down."], ["the cat sat on the mat"])
    assert (rates["substitutions"], rates["deletions"], rates["insertions"], rates["words"]) == (1, 1, 1, 6)
    assert rates["wer"] == pytest.approx(3 / 6)
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("The bat sat the mat down.\nyes\n")
    ref.write_text("the cat sat on the mat\nyes\n")
    rc, out, _ = run(capsys, "evaluate", "--hyp", str(hyp), "--ref", str(ref), "--wer", "--json")
    result = json.loads(out)
    assert rc == 0 and result["wer"] == pytest.approx(3 / 7, abs=1e-4) and result["sentence_accuracy"] == 0.5
    rc, out, _ = run(capsys, "evaluate", "--hyp", str(hyp), "--ref", str(ref), "--wer", "--no-normalize", "--json")
    assert json.loads(out)["wer"] > result["wer"]  # "The" and "down." count as errors as written


def _tsv(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(f"{a}\t{b}\n" for a, b in rows))
    return path


def test_evaluate_matches_path_text_lines_by_path(capsys, tmp_path) -> None:
    """PATH<TAB>TEXT hypotheses (qkv transcribe's) are scored on their text: against PATH<TAB>TEXT
    references by path, in any order, or against plain lines in order; a file on one side only, or
    twice, is refused in one line."""
    hyp = _tsv(tmp_path / "hyp.tsv", [("talks/a.wav", "The bat sat the mat down."), ("talks/b.wav", "yes")])
    scored = {
        "by path": _tsv(tmp_path / "ref.tsv", [("./talks/b.wav", "yes"), ("talks/a.wav", "the cat sat on the mat")]),
        "in order": tmp_path / "ref.txt",
    }
    scored["in order"].write_text("the cat sat on the mat\nyes\n")
    for how, ref in scored.items():
        rc, out, err = run(capsys, "evaluate", "--hyp", str(hyp), "--ref", str(ref), "--wer", "--json")
        assert rc == 0, err
        result = json.loads(out)  # 3 errors in 7 words, as plain lines score them (the paths are not words)
        assert (result["wer"], result["words"], result["sentence_accuracy"]) == (round(3 / 7, 4), 7, 0.5), how
    refused = {
        "missing": ([("talks/a.wav", "the cat sat on the mat"), ("talks/b.wav", "yes"), ("talks/c.wav", "no")],
                    "1 of the 3 files of {ref} have no line in {hyp}, the first talks/c.wav"),
        "extra": ([("talks/a.wav", "the cat sat on the mat")], "{hyp}: talks/b.wav has no reference in {ref}"),
        "twice": ([("talks/a.wav", "the cat"), ("talks/b.wav", "yes"), ("talks/a.wav", "the cat")],
                  "{ref}:3: talks/a.wav appears twice"),
    }  # fmt: skip
    for how, (rows, said) in refused.items():
        ref = _tsv(tmp_path / f"{how}.tsv", rows)
        rc, out, err = run(capsys, "evaluate", "--hyp", str(hyp), "--ref", str(ref), "--wer")
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, how
        assert said.format(hyp=hyp, ref=ref) in err, err


def _readme_pipeline() -> tuple[list[str], list[str]]:
    """The README's `qkv transcribe ... --output FILE` and the `qkv evaluate --hyp FILE ... --wer`
    that scores it, as argument lists (without "qkv")."""
    readme = (ROOT / "README.md").read_text().splitlines()
    lines = [shlex.split(line, comments=True) for line in readme if line.startswith("qkv ")]
    score = next(argv for argv in lines if argv[:2] == ["qkv", "evaluate"] and "--wer" in argv)
    written = score[score.index("--hyp") + 1]
    transcribe = next(argv for argv in lines if argv[:2] == ["qkv", "transcribe"] and written in argv)
    assert transcribe[transcribe.index("--output") + 1] == written
    return transcribe[1:], score[1:]


def test_the_readmes_transcribe_then_evaluate_pipeline_scores_each_file_against_its_reference(
    trained, capsys, tmp_path, monkeypatch
) -> None:
    """The README's two commands as written, the tiny model in the place of its model and tone
    recordings in its folder: the WER is that of each file's transcript against its own reference,
    worked out here with jiwer (the reference's lines shuffled: matched by path, not by line)."""
    import jiwer

    path, manifest, _ = trained
    transcribe, score = _readme_pipeline()
    transcribe[transcribe.index("--model") + 1] = str(path)
    folder = next(a for a in transcribe[1:] if a.endswith("/") and not a.startswith("-"))
    monkeypatch.chdir(tmp_path)
    Path(folder).mkdir(parents=True)
    truth = {}
    for u in read_manifest(manifest):
        shutil.copy(u.path, Path(folder) / u.path.name)
        truth[str(Path(folder) / u.path.name)] = u.text
    assert run(capsys, *transcribe, "--quiet")[0] == 0
    written = score[score.index("--hyp") + 1]
    said = dict(line.split("\t", 1) for line in Path(written).read_text().splitlines())
    assert sorted(said) == sorted(truth)
    rows = list(truth.items())
    random.Random(0).shuffle(rows)
    _tsv(Path(score[score.index("--ref") + 1]), rows)
    rc, out, err = run(capsys, *score, "--json")
    assert rc == 0, err
    paths = sorted(truth)
    expected = jiwer.wer(
        [normalize_transcript(truth[p]) for p in paths], [normalize_transcript(said[p]) for p in paths]
    )
    assert json.loads(out)["wer"] == round(expected, 4)
    # The model knows the tone words (attention alone errs on 2 or 3 of the 29): paths counted as
    # words, or transcripts scored against other files' references, would be far above.
    assert expected <= 0.2


def test_normalize_transcript() -> None:
    assert normalize_transcript("  A man's  BLUE shirt, (torn)! ") == "a man's blue shirt torn"
    assert normalize_transcript("Ｆｕｌｌ width") == "full width"


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi"],
        ["translate", "--input", "-"],
        ["chat"],
        ["embed", "--input", "-", "--output", "v.npy"],
    ],
    ids=lambda a: a[0],
)
def test_text_commands_refuse_a_speech_model_in_one_line(trained, capsys, monkeypatch, tmp_path, argv) -> None:
    import io

    model, _, _ = trained
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"hi\n")))
    rc, _, err = run(capsys, argv[0], "--model", str(model), *argv[1:])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
