"""The translation task on a tiny synthetic parallel corpus: recipe, training, BLEU, the model directory."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qkv import bundle as bundles
from qkv.checkpoint import load_model, model_dir, read_meta, sha256_file
from qkv.cli.main import main
from qkv.data import data_root, read_parallel
from qkv.ensemble import Ensemble
from qkv.errors import UserError
from qkv.seq2seq import beam_translate, source_ids, translate
from qkv.tasks import load_recipe
from qkv.tasks.translation import TRANSLATION_MODEL, _encode_pairs, _epoch_examples, train_translation
from qkv.tokenization import Tokenizer, Vocabularies

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "multi30k_de_en.yaml")
WORDS = {"ein": "a", "hund": "dog", "katze": "cat", "läuft": "runs", "schläft": "sleeps", "rot": "red", "groß": "big"}
TINY = {"d_model": 15, "n_heads": 3, "d_ff": 7, "n_encoder_layers": 1, "n_decoder_layers": 1, "max_len": 13}


def _corpus(root: Path, n: int, seed: int) -> tuple[str, str]:
    """Word-by-word 'German' -> 'English' pairs as two aligned files."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = [rng.choice(sorted(WORDS)) for _ in range(rng.randint(2, 5))]
        src.append(" ".join(words))
        tgt.append(" ".join(WORDS[w] for w in words))
    (root / f"{seed}.de").write_text("\n".join(src) + "\n")
    (root / f"{seed}.en").write_text("\n".join(tgt) + "\n")
    return str(root / f"{seed}.de"), str(root / f"{seed}.en")


def _overrides(tmp_path: Path, steps: int | None = None, *, epochs: int = 3, n_train: int = 300) -> list[str]:
    train = _corpus(tmp_path, n_train, seed=1)
    valid = _corpus(tmp_path, 20, seed=2)
    return [
        f"data.train={list(train)}",
        f"data.valid={list(valid)}",
        "data.vocab_size=40",
        "decode.beam_size=2",
        f"train.epochs={epochs}",
        f"train.steps={'null' if steps is None else steps}",
        "train.max_tokens=200",
        "train.warmup=10",
        "train.lr=0.01",
        "train.tensorboard=false",
        *(f"model.{k}={v}" for k, v in TINY.items()),
    ]


def test_translation_recipe_trains_and_scores(tmp_path) -> None:
    """Loss falls; the model learns the word-by-word task (BLEU far above an untrained model's,
    which is near 0) and the BLEU and chrF reported are sacreBLEU's own of its translations; every
    epoch is validated; the run keeps last/best/averaged and names the final one."""
    import sacrebleu

    overrides = [
        *_overrides(tmp_path, epochs=20),
        "model.dropout=0.0",
        "train.average_last=3",
        "train.tensorboard=true",
    ]
    recipe = load_recipe(RECIPE, overrides)
    run = tmp_path / "run"
    summary = train_translation(recipe, run, progress=False)
    losses = summary["losses"]
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10
    references = (tmp_path / "2.en").read_text().splitlines()
    assert len(summary["hypotheses"]) == len(references) == 20
    assert summary["bleu"] == round(sacrebleu.corpus_bleu(summary["hypotheses"], [references]).score, 2)
    assert summary["chrf"] == round(sacrebleu.corpus_chrf(summary["hypotheses"], [references]).score, 2)
    assert summary["bleu"] > 20, list(zip(summary["hypotheses"], references, strict=True))
    assert "nrefs:1" in summary["bleu_signature"]
    history = summary["history"]
    assert [h["epoch"] for h in history] == list(range(1, 21))
    assert history[-1]["valid_loss"] < history[0]["valid_loss"]
    meta = json.loads((run / "run.json").read_text())
    assert meta["final"] in ("best", "averaged") and meta["final"] == summary["final"]
    assert set(meta["final_scores"]) == {"best", "averaged"}
    assert meta["final_scores"][meta["final"]]["bleu"] == summary["bleu"]
    assert sorted(p.name for p in run.glob("epoch-*")) == ["epoch-018", "epoch-019", "epoch-020"]
    for name in ("last", "best", "averaged"):
        assert read_meta(run / name)["task"] == "translation"
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    # Commands taking --model accept the run directory: its final checkpoint.
    assert read_meta(run)["files"] == read_meta(run / meta["final"])["files"]


def test_a_run_stopped_mid_epoch_is_scored_without_dropout(tmp_path) -> None:
    """A run stopped by its step cap in the middle of an epoch (so in training mode) scores its
    final checkpoint as a freshly loaded copy translates (no dropout), and returns it for inference."""
    overrides = [*_overrides(tmp_path, steps=25, epochs=20), "model.dropout=0.5", "train.average_last=2"]
    run = tmp_path / "run"
    summary = train_translation(load_recipe(RECIPE, overrides), run, progress=False)
    assert summary["stopped_by"] == "steps" and summary["epochs"] >= 2
    assert not summary["model"].training
    final, _ = load_model(model_dir(run))
    valid = read_parallel(*json.loads((run / "run.json").read_text())["recipe"]["data"]["valid"])
    again = beam_translate(final, summary["tokenizer"], [a for a, _ in valid], beam_size=2)
    assert again == summary["hypotheses"]
    assert beam_translate(summary["model"], summary["tokenizer"], [a for a, _ in valid], beam_size=2) == again
    # The check can fail: with dropout on, this model translates differently.
    summary["model"].train()
    torch.manual_seed(0)
    assert beam_translate(summary["model"], summary["tokenizer"], [a for a, _ in valid], beam_size=2) != again


def _ending_tokenizer(tmp_path: Path) -> Path:
    """A tokenizer file whose post-processor ends every source with END (as a converted Marian
    one does), so it carries a special_tokens.json beside it."""
    from tokenizers import processors

    pairs = read_parallel(*_corpus(tmp_path, 50, seed=4))
    tokenizer = Tokenizer.train_subword((s for pair in pairs for s in pair), vocab_size=40)
    tokenizer.backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tokenizer.eos_id)]
    )
    tokenizer.add_special_tokens = True
    (tmp_path / "tok").mkdir()
    tokenizer.save(tmp_path / "tok" / "tokenizer.json")
    return tmp_path / "tok" / "tokenizer.json"


def test_a_tokenizer_that_ends_sources_keeps_its_settings_in_every_checkpoint(tmp_path) -> None:
    """special_tokens.json travels into the run's checkpoints (resume and translate load the same
    tokenizer); sources end with END, training targets do not (the batch appends it), and a cut
    source keeps its END."""
    path = _ending_tokenizer(tmp_path)
    run = tmp_path / "run"
    recipe = load_recipe(RECIPE, [*_overrides(tmp_path, epochs=1), f"data.tokenizer={path}"])
    summary = train_translation(recipe, run, progress=False)
    for checkpoint in ("last", "best", model_dir(run).name):
        loaded = Tokenizer.load(run / checkpoint / "tokenizer.json")
        assert loaded.add_special_tokens and (run / checkpoint / "special_tokens.json").is_file()
    tokenizer = summary["tokenizer"].source  # a joint vocabulary: source and target alike
    examples, _, _ = _encode_pairs(tokenizer, [("ein hund", "a dog")], window=13, long="drop")
    ((src, tgt),) = examples
    assert src[-1] == tokenizer.eos_id and tokenizer.eos_id not in tgt
    long = " ".join(["hund"] * 30)
    (cut,) = source_ids(tokenizer, [long], window=7)
    assert len(cut) == 7 and cut[-1] == tokenizer.eos_id and cut[:6] == tokenizer.encode(long)[:6]


def test_averaging_is_the_mean_of_the_epoch_checkpoints(tmp_path) -> None:
    recipe = load_recipe(RECIPE, [*_overrides(tmp_path, epochs=3), "train.average_last=2"])
    run = tmp_path / "run"
    train_translation(recipe, run, progress=False)
    a = load_file(run / "epoch-002" / "model.safetensors")
    b = load_file(run / "epoch-003" / "model.safetensors")
    mean = load_file(run / "averaged" / "model.safetensors")
    for name in mean:
        torch.testing.assert_close(mean[name], (a[name].double() + b[name].double()).div(2).float())


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def test_resume_gives_the_weights_of_an_uninterrupted_run(tmp_path) -> None:
    """Stopped mid-epoch (a step cap), then resumed: same weights, optimizer and position."""
    overrides = [*_overrides(tmp_path, epochs=2), "train.deterministic=true", "model.dropout=0.1"]
    whole = tmp_path / "whole"
    train_translation(load_recipe(RECIPE, overrides), whole, progress=False)
    parts = tmp_path / "parts"
    first = train_translation(load_recipe(RECIPE, [*overrides, "train.steps=4"]), parts, progress=False)
    assert first["stopped_by"] == "steps" and first["epochs"] == 0
    second = train_translation(load_recipe(RECIPE, overrides), parts, progress=False, resume=True)
    assert second["steps"] == json.loads((whole / "run.json").read_text())["history"][-1]["step"]
    a, b = _weights(whole / "last"), _weights(parts / "last")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(
        load_file(whole / "last" / "trainer.safetensors")["optimizer.0.exp_avg"],
        load_file(parts / "last" / "trainer.safetensors")["optimizer.0.exp_avg"],
    )


def test_subword_sampling_draws_per_epoch_and_resumes_exactly(tmp_path) -> None:
    """data.subword_nbest: every epoch its own segmentations of the same pairs in the same
    places (over-long ones dropped or truncated as without it), a function of seed and epoch,
    so a run stopped mid-epoch and resumed still ends with the uninterrupted weights; and
    training does see other pieces than without it."""
    sampling = ["data.subword_nbest=8", "data.subword_alpha=0.3"]
    overrides = [*_overrides(tmp_path, epochs=2), "train.deterministic=true", *sampling]
    recipe = load_recipe(RECIPE, overrides)
    pairs = read_parallel(*recipe.data.train)
    vocab = Vocabularies.of(Tokenizer.train_subword([x for pair in pairs for x in pair], vocab_size=40))
    for long, window in (("drop", 13), ("drop", 4), ("truncate", 4)):
        examples, over_long, rows = _encode_pairs(vocab, pairs, window=window, long=long)
        assert (len(over_long) > 0) == (window == 4)
        assert rows == [i for i in range(len(pairs)) if long == "truncate" or i not in over_long]
        kept = [pairs[i] for i in rows]
        draw = _epoch_examples(vocab, kept, examples, nbest=8, alpha=0.3, window=window, seed=-3)
        first = draw(0)
        assert first == draw(0) and first != draw(1) and first != examples and len(first) == len(examples)
        assert all(len(s) <= window and len(t) <= window - 1 for s, t in first)
        decode = vocab.target.decode  # the same pairs, spelt in other pieces
        assert [(decode(s), decode(t)) for s, t in first] == [(decode(s), decode(t)) for s, t in examples]
    with pytest.raises(UserError, match=r"data\.subword_nbest: the source tokenizer: subword sampling needs a unigram"):
        word_level = Tokenizer.train_word_level([x for pair in pairs for x in pair])
        _epoch_examples(word_level, pairs, examples, nbest=8, alpha=0.3, window=13, seed=0)
    with pytest.raises(UserError, match=r"data.subword_nbest must be an integer in 0..512"):
        load_recipe(RECIPE, ["data.subword_nbest=513"])
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train_translation(recipe, whole, progress=False)
    stopped = train_translation(load_recipe(RECIPE, [*overrides, "train.steps=4"]), parts, progress=False)
    assert stopped["stopped_by"] == "steps"
    train_translation(load_recipe(RECIPE, overrides), parts, progress=False, resume=True)
    a, b = _weights(whole / "last"), _weights(parts / "last")
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain = tmp_path / "plain"
    train_translation(load_recipe(RECIPE, [o for o in overrides if o not in sampling]), plain, progress=False)
    c = _weights(plain / "last")
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("stop", ["steps", "patience"])
def test_resuming_a_run_that_had_stopped_trains_no_more(tmp_path, stop: str) -> None:
    """--resume of a run that its step cap or patience had stopped (as a kill while the final
    models are compared leaves it) goes straight to the end: no step, no epoch, last/ unchanged."""
    overrides = [*_overrides(tmp_path, epochs=20, n_train=60), "train.deterministic=true"]
    if stop == "steps":
        overrides.append("train.steps=3")  # mid-epoch (2 steps an epoch)
    else:  # a learning rate too small to change a weight: no epoch after the first validates better
        overrides += ["train.patience=1", "train.lr=1e-12"]
    run = tmp_path / "run"
    first = train_translation(load_recipe(RECIPE, overrides), run, progress=False)
    assert first["stopped_by"] == stop
    before = _weights(run / "last")
    assert json.loads((run / "last" / "trainer.json").read_text())["progress"]["stopped_by"] == stop
    second = train_translation(load_recipe(RECIPE, overrides), run, progress=False, resume=True)
    assert second["stopped_by"] == stop
    assert (second["steps"], second["epochs"]) == (first["steps"], first["epochs"])
    assert second["history"] == first["history"] and second["final"] == first["final"]
    after = _weights(run / "last")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_fine_tuning_takes_the_pretrained_architecture(tmp_path) -> None:
    """A pretrained model whose config is not the recipe defaults (an imported Marian one's is not):
    the fine-tuned model has its config but for the recipe's dropout, starts from its weights, and
    resumes with that architecture; a recipe naming another architecture is refused."""
    overrides = _overrides(tmp_path, epochs=1, n_train=60)
    odd = ["norm_first=false", "activation=gelu", "positions=learned", "scale_embeddings=false", "output_bias=true"]
    base = tmp_path / "base"
    train_translation(load_recipe(RECIPE, [*overrides, *(f"model.{o}" for o in odd)]), base, progress=False)
    pretrained, _ = load_model(model_dir(base))
    # A learning rate too small to move a weight visibly: the fine-tuned model is where training
    # started (Adam's step is ~lr, so weights near zero may still move by ~1e-13).
    tuning = [*overrides, f"train.init={base}", "train.steps=1", "train.lr=1e-12", "model.dropout=0.3"]
    tuned = train_translation(load_recipe(RECIPE, tuning), tmp_path / "tuned", progress=False)
    assert tuned["model"].config == dataclasses.replace(pretrained.config, dropout=0.3)
    a, b = pretrained.state_dict(), tuned["model"].state_dict()
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-9) for k in a)
    valid = [x for x, _ in read_parallel(*load_recipe(RECIPE, overrides).data.valid)]
    assert beam_translate(tuned["model"], tuned["tokenizer"], valid, beam_size=2) == beam_translate(
        pretrained, tuned["tokenizer"], valid, beam_size=2
    )
    resumed = train_translation(load_recipe(RECIPE, tuning), tmp_path / "tuned", progress=False, resume=True)
    assert resumed["model"].config == tuned["model"].config
    # A recipe that names no model field (the task's defaults are d_model 256, ...): the
    # pretrained model's architecture, the task's dropout; and it resumes so.
    bare = [o for o in tuning if not o.startswith("model.")]
    plain = train_translation(load_recipe(None, ["task=translation", *bare]), tmp_path / "plain", progress=False)
    expected = dataclasses.replace(pretrained.config, dropout=TRANSLATION_MODEL["dropout"])
    assert plain["model"].config == expected
    again = train_translation(
        load_recipe(None, ["task=translation", *bare]), tmp_path / "plain", progress=False, resume=True
    )
    assert again["model"].config == expected
    # A field named alone is not checked against the defaults' other fields (d_model 256 with
    # n_heads 5), only against the checkpoint's; an unknown field is refused at once.
    with pytest.raises(UserError, match=r"has model n_heads=3; the recipe says n_heads=5"):
        train_translation(
            load_recipe(None, ["task=translation", *bare, "model.n_heads=5"]), tmp_path / "five", progress=False
        )
    with pytest.raises(UserError, match=r"unknown model field\(s\) heads"):
        load_recipe(None, ["task=translation", *bare, "model.heads=5"])
    # A tuning field's value is checked at once too, before any data is read, naming the recipe.
    with pytest.raises(UserError, match=r"^recipe: bad encoder_decoder config: dropout"):
        load_recipe(None, ["task=translation", *bare, "model.dropout=1.5"])
    with pytest.raises(UserError, match=r"has model norm_first=False; the recipe says norm_first=True"):
        train_translation(
            load_recipe(RECIPE, [*tuning, "model.norm_first=true"]), tmp_path / "conflict", progress=False
        )


def test_resume_after_a_crash_between_the_renames_of_a_save(tmp_path) -> None:
    """save_model moves the old checkpoint aside, then the new one in; killed in between, the
    run resumes from the old one."""
    overrides = [*_overrides(tmp_path, epochs=2), "train.deterministic=true"]
    run = tmp_path / "run"
    train_translation(load_recipe(RECIPE, [*overrides, "train.steps=4"]), run, progress=False)
    os.replace(run / "last", run / ".last.old")
    resumed = train_translation(load_recipe(RECIPE, overrides), run, progress=False, resume=True)
    assert resumed["epochs"] == 2


def test_resume_after_sigkill(tmp_path) -> None:
    """A run killed with SIGKILL after a mid-epoch checkpoint resumes to the uninterrupted weights."""
    overrides = [
        *_overrides(tmp_path, epochs=2, n_train=3000),
        "train.deterministic=true",
        "train.save_every=5",
        "model.dropout=0.1",
        "model.d_model=48",
        "model.d_ff=96",
        "model.n_heads=4",
    ]
    argv = ["train", RECIPE, "--quiet", "--json"]
    for item in overrides:
        argv += ["--set", item]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main([*argv, "--out", str(whole)]) == 0
    total = json.loads((whole / "run.json").read_text())["history"][-1]["step"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    process = subprocess.Popen([sys.executable, "-m", "qkv", *argv, "--out", str(killed)], env=env)
    state = killed / "last" / "trainer.json"
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        try:
            if json.loads(state.read_text())["trainer"]["steps"] >= 10:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    reached = json.loads(state.read_text())["trainer"]["steps"]
    assert 10 <= reached < total, "the run ended before it could be killed; make it longer"
    assert main([*argv, "--out", str(killed), "--resume"]) == 0
    a, b = _weights(whole / "last"), _weights(killed / "last")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_different_recipe_or_tokenizer(tmp_path) -> None:
    overrides = _overrides(tmp_path, epochs=1)
    run = tmp_path / "run"
    train_translation(load_recipe(RECIPE, overrides), run, progress=False)
    with pytest.raises(UserError, match=r"already holds a training run; pass --resume"):
        train_translation(load_recipe(RECIPE, overrides), run, progress=False)
    with pytest.raises(UserError, match=r"differs .* in model\.d_ff"):
        train_translation(load_recipe(RECIPE, [*overrides, "model.d_ff=11"]), run, progress=False, resume=True)
    other = Tokenizer.train_subword(["ein ganz anderer text", "a different text"], vocab_size=30)
    other.save(tmp_path / "other.json")
    with pytest.raises(UserError, match=r"is not the tokenizer .* was trained with"):
        train_translation(
            load_recipe(RECIPE, [*overrides, f"data.tokenizer={tmp_path / 'other.json'}"]),
            run,
            progress=False,
            resume=True,
        )
    # Fine-tuning from the run with another tokenizer is refused the same way.
    with pytest.raises(UserError, match=r"is not the tokenizer .* was trained with"):
        train_translation(
            load_recipe(RECIPE, [*overrides, f"data.tokenizer={tmp_path / 'other.json'}", f"train.init={run}"]),
            tmp_path / "tuned",
            progress=False,
        )
    # With its own tokenizer, fine-tuning starts from the run's weights.
    tuned = train_translation(
        load_recipe(RECIPE, [*overrides, f"train.init={run}"]), tmp_path / "tuned", progress=False
    )
    assert tuned["vocabulary"].startswith("the tokenizer of")


def test_translate_cli_keeps_order_empty_lines_nbest_and_alignments(tmp_path, capsys, monkeypatch) -> None:
    run = tmp_path / "run"
    train_translation(load_recipe(RECIPE, _overrides(tmp_path, epochs=20)), run, progress=False)
    lines = ["ein hund läuft", "", "katze", "   ", "ein großer roter hund schläft"]
    (tmp_path / "in.de").write_text("\n".join(lines) + "\n")
    assert main(["translate", "--model", str(run), "--input", str(tmp_path / "in.de"), "--beam", "3", "--quiet"]) == 0
    out = capsys.readouterr().out.split("\n")[:-1]
    assert len(out) == 5 and out[1] == "" and out[3] == ""
    assert all(out[i] for i in (0, 2, 4))
    argv = ["translate", "--model", str(run), "--input", str(tmp_path / "in.de"), "--beam", "3", "--quiet", "--bf16"]
    loaded = []
    real = bundles.load
    monkeypatch.setattr(bundles, "load", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    assert main(argv) == 0
    assert next(loaded[0].model.parameters()).dtype == torch.bfloat16
    half = capsys.readouterr().out.split("\n")[:-1]  # bfloat16 weights: same lines, order and empty lines
    assert len(half) == 5 and half[1] == half[3] == "" and all(half[i] for i in (0, 2, 4))
    assert main([*argv[:-1], "--int8"]) == 0
    assert not any(type(m) is torch.nn.Linear for m in loaded[1].model.modules())  # int8 linear layers
    small = capsys.readouterr().out.split("\n")[:-1]
    assert small == out  # int8 linear layers: the float32 translations (clear margins, as the library test)
    with pytest.raises(SystemExit) as exit_info:  # one precision at a time
        main([*argv, "--int8"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    # Batch composition does not change a sentence's translation.
    for i in (0, 2, 4):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO((lines[i] + "\n").encode())))
        assert main(["translate", "--model", str(run), "--beam", "3", "--quiet"]) == 0
        assert capsys.readouterr().out == out[i] + "\n"
    assert (
        main(
            [
                "translate",
                "--model",
                str(run),
                "--input",
                str(tmp_path / "in.de"),
                "--beam",
                "3",
                "--nbest",
                "2",
                "--output",
                str(tmp_path / "nbest.txt"),
                "--alignments",
                str(tmp_path / "align.txt"),
                "--quiet",
            ]
        )
        == 0
    )
    nbest = (tmp_path / "nbest.txt").read_text().splitlines()
    assert len(nbest) == 10 and nbest[0].split("\t")[0] == out[0]
    assert nbest[2:4] == nbest[6:8] == ["", ""]  # an empty input: --nbest empty lines
    scores = [float(line.split("\t")[1]) for line in nbest[:2]]
    assert scores[0] >= scores[1]
    align = (tmp_path / "align.txt").read_text().split("\n")[:-1]
    assert len(align) == 10 and align[2] == ""
    n_src = len(Tokenizer.load(run / "best" / "tokenizer.json").encode(lines[0]))
    assert all(0 <= int(pair.split("-")[0]) < n_src for pair in align[0].split())
    assert main(["translate", "--model", str(run), "--beam", "2", "--nbest", "3"]) == 2


def test_translate_cli_ensemble(tmp_path, capsys) -> None:
    """--ensemble: two runs of one recipe (two seeds, one vocabulary) translate as one, the
    output that of the mean distribution (generation's Ensemble, tested there); the same run
    twice translates as it does alone; a run with another vocabulary is refused by name."""
    overrides = _overrides(tmp_path, epochs=2)
    a, b, other = tmp_path / "a", tmp_path / "b", tmp_path / "other"
    train_translation(load_recipe(RECIPE, overrides), a, progress=False)
    train_translation(load_recipe(RECIPE, [*overrides, "train.seed=1"]), b, progress=False)
    train_translation(load_recipe(RECIPE, [*overrides, "data.vocab_size=35"]), other, progress=False)
    lines = ["ein hund läuft", "", "katze schläft", "ein großer roter hund"]
    (tmp_path / "in.de").write_text("\n".join(lines) + "\n")
    base = ["translate", "--input", str(tmp_path / "in.de"), "--beam", "3", "--quiet"]

    def run(*models: Path) -> list[str]:
        argv = [*base, "--model", str(models[0])]
        for m in models[1:]:
            argv += ["--ensemble", str(m)]
        assert main(argv) == 0
        return capsys.readouterr().out.split("\n")[:-1]

    alone, together = run(a), run(a, b)
    assert run(a, a) == alone and len(together) == 4 and together[1] == ""
    first, second = (load_model(model_dir(x))[0] for x in (a, b))
    vocab = Vocabularies.load(model_dir(a), files=read_meta(model_dir(a))["files"])
    expected = beam_translate(Ensemble((first, second)), vocab, lines, beam_size=3)
    assert together == expected
    assert main([*base, "--model", str(a), "--ensemble", str(other)]) == 2
    assert "its tokenizer, or how it reads sources (data.source_as_transcript), differs" in capsys.readouterr().err


SEPARATE = ["data.vocab=separate", "model.share_embeddings=false", "data.src_vocab_size=40", "data.tgt_vocab_size=30"]


def _separate_run(tmp_path: Path, *extra: str, epochs: int = 20) -> tuple[Path, dict]:
    run = tmp_path / "run"
    recipe = load_recipe(RECIPE, [*_overrides(tmp_path, epochs=epochs), *SEPARATE, *extra])
    return run, train_translation(recipe, run, progress=False)


def _pieces(tokenizer: Tokenizer) -> set[str]:
    return set(tokenizer.backend.get_vocab())


def test_separate_vocabularies_are_trained_per_side_and_stored_in_every_checkpoint(tmp_path, capsys) -> None:
    """data.vocab=separate: the source vocabulary holds only source text's pieces, the target one
    only target text's; the model's tables have their sizes; every checkpoint stores both files
    with their SHA-256; and every command reads sources with the source tokenizer and writes
    outputs with the target one."""
    run, summary = _separate_run(tmp_path)
    vocab = summary["tokenizer"]
    assert vocab.separate
    source, target = vocab.source, vocab.target
    assert any("ß" in p for p in _pieces(source)) and not any("ß" in p or "ä" in p for p in _pieces(target))
    assert any("b" in p for p in _pieces(target)) and not any("b" in p for p in _pieces(source))  # "big"
    config = summary["model"].config
    assert (config.src_vocab_size, config.tgt_vocab_size) == (source.vocab_size, target.vocab_size)
    assert config.src_vocab_size != config.tgt_vocab_size and not config.share_embeddings
    for name in ("last", "best", model_dir(run).name):
        files = read_meta(run / name)["files"]
        assert {"tokenizer.json", "target_tokenizer.json"} <= set(files)
        assert files["tokenizer.json"] != files["target_tokenizer.json"]
        assert files["target_tokenizer.json"] == sha256_file(run / name / "target_tokenizer.json")
        loaded = Vocabularies.load(run / name, files=files)
        assert loaded.source.encode("ein hund") == source.encode("ein hund")
        assert loaded.target.encode("a dog") == target.encode("a dog")

    lines = ["ein hund läuft", "", "katze schläft", "ein großer roter hund schläft"]
    (tmp_path / "in.de").write_text("\n".join(lines) + "\n")
    model, _ = load_model(model_dir(run))
    expected = translate(model, vocab, lines, beam_size=3, nbest=2)
    argv = ["translate", "--model", str(run), "--input", str(tmp_path / "in.de"), "--beam", "3", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out.split("\n")[:-1]
    assert out == [hyps[0].text for hyps in expected] and out[0]
    # The outputs are target ids: read with the source vocabulary they would be other text.
    assert all(h[0].text == target.decode(h[0].tokens) for h in expected)
    assert any(source.decode(h[0].tokens) != h[0].text for h in expected)
    assert main([*argv, "--nbest", "2", "--alignments", str(tmp_path / "align.txt")]) == 0
    nbest = capsys.readouterr().out.split("\n")[:-1]
    assert [line.split("\t")[0] for line in nbest] == [h.text for hyps in expected for h in hyps]
    align = (tmp_path / "align.txt").read_text().split("\n")[:-1]
    for line, pairs, hyps in zip(lines, align[::2], expected, strict=True):
        n_src, n_out = len(source.encode(line)), len(hyps[0].tokens)
        assert all(0 <= int(a) < n_src and 0 <= int(b) < n_out for a, b in (p.split("-") for p in pairs.split()))
    # generate (beam) and chat on an encoder-decoder decode with the target vocabulary too.
    assert main(["generate", "--model", str(run), "--input", str(tmp_path / "in.de"), "--beam", "3"]) == 0
    generated = capsys.readouterr().out.split("\n")[:-1]
    assert [g for g in generated if g] == [t for t in out if t]
    from qkv.chat import reply

    (tmp_path / "turns.txt").write_text("ein hund\n")
    with open(tmp_path / "turns.txt", "rb") as stdin:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("sys.stdin", io.TextIOWrapper(stdin))
            assert main(["chat", "--model", str(run), "--separator", " "]) == 0
    answer = capsys.readouterr().out.strip()
    assert answer == reply(model, vocab, ["ein hund"], separator=" ", max_new_tokens=64) and answer


def test_separate_vocabularies_resume_fine_tune_and_refuse_mismatched_files(tmp_path) -> None:
    """A separate-vocabulary run resumes (to the weights of an uninterrupted run) and fine-tunes
    with its own two tokenizers, named or not; a target tokenizer that is not the run's (named, or
    swapped into a checkpoint) is refused naming the file."""
    overrides = [*_overrides(tmp_path, epochs=2), *SEPARATE, "train.deterministic=true"]
    run = tmp_path / "run"
    first = train_translation(load_recipe(RECIPE, [*overrides, "train.steps=3"]), run, progress=False)
    assert first["stopped_by"] == "steps"
    (tmp_path / "given").mkdir()
    for name in ("tokenizer.json", "target_tokenizer.json"):
        (tmp_path / "given" / name).write_bytes((run / "last" / name).read_bytes())
    named = [f"data.tokenizer={tmp_path / 'given' / 'tokenizer.json'}"]
    named.append(f"data.target_tokenizer={tmp_path / 'given' / 'target_tokenizer.json'}")
    second = train_translation(load_recipe(RECIPE, [*overrides, *named]), run, progress=False, resume=True)
    assert second["epochs"] == 2 and second["vocabulary"].count("the tokenizer of") == 2
    whole = train_translation(load_recipe(RECIPE, overrides), tmp_path / "whole", progress=False)
    a, b = _weights(tmp_path / "whole" / "last"), _weights(run / "last")
    assert whole["steps"] == second["steps"] and all(torch.equal(a[k], b[k]) for k in a)
    # Resumed again (a checkpoint's tokenizers written anew), the same named files are still the run's.
    third = train_translation(
        load_recipe(RECIPE, [*overrides, *named, "train.epochs=3"]), run, progress=False, resume=True
    )
    assert third["epochs"] == 3
    for side in ("source", "target"):
        one, other = getattr(second["tokenizer"], side), getattr(third["tokenizer"], side)
        assert one.backend.to_str() == other.backend.to_str()

    other = Tokenizer.train_subword(["a different text", "another one"], vocab_size=20)
    other.save(tmp_path / "other.json")
    with pytest.raises(UserError, match=r"data\.target_tokenizer .*other\.json is not the tokenizer .* was trained"):
        train_translation(
            load_recipe(RECIPE, [*overrides, f"data.target_tokenizer={tmp_path / 'other.json'}"]),
            run,
            progress=False,
            resume=True,
        )
    tuned = train_translation(
        load_recipe(RECIPE, [*overrides, f"train.init={run}", "train.steps=1"]), tmp_path / "tuned", progress=False
    )
    assert tuned["vocabulary"].count("the tokenizer of") == 2 and tuned["tokenizer"].separate
    assert tuned["model"].config == second["model"].config
    with pytest.raises(UserError, match=r"has a separate vocabulary but the recipe says data\.vocab=joint"):
        train_translation(
            load_recipe(RECIPE, [*_overrides(tmp_path, epochs=1), f"train.init={run}", "model.share_embeddings=false"]),
            tmp_path / "joint",
            progress=False,
        )
    # The source tokenizer swapped in as the target's: loading, resuming, translating refuse it by name.
    (run / "last" / "target_tokenizer.json").write_bytes((run / "last" / "tokenizer.json").read_bytes())
    with pytest.raises(UserError, match=r"last/target_tokenizer\.json does not match the SHA-256"):
        train_translation(load_recipe(RECIPE, overrides), run, progress=False, resume=True)
    (run / "best" / "target_tokenizer.json").write_bytes((run / "best" / "tokenizer.json").read_bytes())
    with pytest.raises(UserError, match=r"best/target_tokenizer\.json does not match the SHA-256"):
        bundles.load(run / "best")


def test_separate_vocabularies_recipe_errors(tmp_path) -> None:
    with pytest.raises(UserError, match=r"model\.share_embeddings=true needs data\.vocab=joint"):
        load_recipe(RECIPE, ["data.vocab=separate"])  # the recipe shares embeddings
    with pytest.raises(UserError, match=r"data\.tgt_vocab_size needs data\.vocab=separate"):
        load_recipe(RECIPE, ["data.tgt_vocab_size=500"])
    with pytest.raises(UserError, match=r"data\.target_tokenizer needs data\.vocab=separate"):
        load_recipe(RECIPE, ["data.target_tokenizer=t.json"])
    with pytest.raises(UserError, match=r"data\.vocab must be joint or separate"):
        load_recipe(RECIPE, ["data.vocab=shared", "model.share_embeddings=false"])
    recipe = load_recipe(RECIPE, [*SEPARATE, "data.vocab_size=700", "data.src_vocab_size=null"])
    assert (recipe.data.vocab, recipe.data.tgt_vocab_size) == ("separate", 30)
    # A target tokenizer whose special tokens sit at other ids than the source's is refused.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    backend = HFTokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(
        ["a dog runs"], trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"])
    )
    backend.save(str(tmp_path / "shifted.json"))
    with pytest.raises(
        UserError, match=r"same special tokens at the same ids \(differ: pad <pad> \(id 0\) vs <pad> \(id 1\)"
    ):
        train_translation(
            load_recipe(
                RECIPE,
                [*_overrides(tmp_path, epochs=1), *SEPARATE, f"data.target_tokenizer={tmp_path / 'shifted.json'}"],
            ),
            tmp_path / "run",
            progress=False,
        )


def test_export_hf_refuses_separate_vocabularies(tmp_path) -> None:
    from qkv.hf.convert import export_hf

    run, _ = _separate_run(tmp_path, "train.steps=2", epochs=1)
    with pytest.raises(UserError, match=r"separate source and target vocabularies"):
        export_hf(run, tmp_path / "hf")


def test_a_run_begun_before_vocabulary_options_resumes(tmp_path) -> None:
    """run.json of a run started before data.vocab existed lacks its keys: they take their defaults."""
    overrides = [*_overrides(tmp_path, epochs=1), "train.deterministic=true"]
    run = tmp_path / "run"
    train_translation(load_recipe(RECIPE, [*overrides, "train.steps=2"]), run, progress=False)
    saved = json.loads((run / "run.json").read_text())
    for key in ("vocab", "target_tokenizer", "src_vocab_size", "tgt_vocab_size"):
        del saved["recipe"]["data"][key]
    (run / "run.json").write_text(json.dumps(saved))
    resumed = train_translation(load_recipe(RECIPE, overrides), run, progress=False, resume=True)
    assert resumed["epochs"] == 1 and not resumed["tokenizer"].separate


def test_translation_recipe_errors(tmp_path, capsys) -> None:
    with pytest.raises(UserError, match=r"data\.train"):
        load_recipe(RECIPE, ["data.train=[a, b, c]"])
    with pytest.raises(UserError, match=r"data\.long"):
        load_recipe(RECIPE, ["data.long=ignore"])
    with pytest.raises(UserError, match=r"train\.patience"):
        load_recipe(RECIPE, ["train.patience=0"])
    numbers = str(Path(RECIPE).with_name("numbers.yaml"))
    assert main(["train", numbers, "--out", str(tmp_path / "x"), "--resume"]) == 2
    assert "holds no unfinished run" in capsys.readouterr().err  # every task resumes now; x holds no run


@pytest.mark.slow  # ~40 s; bench/mt.py trains on the whole corpus
@pytest.mark.skipif(not (data_root() / "multi30k" / "train.de").is_file(), reason="Multi30k not found under QKV_DATA")
def test_multi30k_smoke(tmp_path) -> None:
    """~1 minute: 2,000 real Multi30k pairs, a small model; validation loss falls and BLEU > 0."""
    overrides = [
        "data.train_pairs=2000",
        "data.valid_pairs=60",
        "data.vocab_size=1000",
        "decode.beam_size=2",
        "train.epochs=12",
        "train.max_tokens=1024",
        "train.warmup=100",
        "train.lr=0.002",
        "train.average_last=2",
        "model.d_model=64",
        "model.d_ff=256",
        "model.n_encoder_layers=2",
        "model.n_decoder_layers=2",
        "model.dropout=0.1",
    ]
    summary = train_translation(load_recipe(RECIPE, overrides), tmp_path / "run", progress=False)
    losses = [h["valid_loss"] for h in summary["history"]]
    assert losses[-1] < 0.8 * losses[0]
    assert summary["bleu"] > 0.0


def test_over_long_pairs_are_named_by_line_before_training(tmp_path, capsys) -> None:
    """Pairs longer than the window are said on stderr before training (file and line numbers),
    counted in the summary and in run.json; dropped from training, truncated for validation."""
    overrides = [*_overrides(tmp_path, steps=2, epochs=1), "model.max_len=5", "data.long=drop"]
    run = tmp_path / "run"
    summary = train_translation(load_recipe(RECIPE, overrides), run, progress=False)
    err = capsys.readouterr().err
    train_note = next(line for line in err.splitlines() if "1.de + " in line)
    over_long = summary["over_long_pairs"]
    assert f"{over_long['train']} of 300 pairs are longer than the model's window (5 tokens)" in train_note
    assert "dropped (data.long: drop)" in train_note
    assert 0 < over_long["train"] < 300 and over_long["valid"] > 0
    # the first lines named are over-long, and no line before the first one named is
    named = [int(n) for n in train_note.split("lines ")[1].rstrip(", .").split(", ") if n.isdigit()]
    sources = Path(tmp_path / "1.de").read_text().splitlines()
    tokenizer = summary["tokenizer"].source
    targets = Path(tmp_path / "1.en").read_text().splitlines()

    def over(i: int) -> bool:
        return len(tokenizer.encode(sources[i - 1])) > 5 or len(tokenizer.encode(targets[i - 1])) > 4

    assert named and all(over(i) for i in named)
    assert not any(over(i) for i in range(1, named[0]))
    meta = json.loads((run / "run.json").read_text())
    assert meta["over_long_pairs"] == over_long


def test_resume_refuses_changed_data_files(tmp_path) -> None:
    """run.json records each data file's SHA-256; a resume after a file changed is refused
    (the saved position in the data order would point at other sentences), naming the file."""
    overrides = _overrides(tmp_path, steps=3, epochs=2)
    run = tmp_path / "run"
    train_translation(load_recipe(RECIPE, overrides), run, progress=False)
    meta = json.loads((run / "run.json").read_text())
    assert set(meta["data_sha256"]) == {str(tmp_path / f"{n}.{lang}") for n in (1, 2) for lang in ("de", "en")}
    train_file = tmp_path / "1.en"
    train_file.write_text(train_file.read_text().replace("dog", "hound"))
    grown = [*overrides[:5], "train.steps=4", *overrides[6:]]
    with pytest.raises(UserError, match=r"1\.en changed since .* began"):
        train_translation(load_recipe(RECIPE, grown), run, progress=False, resume=True)


def test_sources_as_transcripts_are_lowercase_without_punctuation(tmp_path, capsys) -> None:
    """data.source_as_transcript: sources are read as a speech recognizer writes them (the
    cascade's second half reads the first half's transcripts), so the source vocabulary holds
    no capital or comma; without it, it does. Targets are kept as they are."""
    overrides = _overrides(tmp_path, steps=2)
    for name in ("1.de", "2.de"):
        path = tmp_path / name
        path.write_text("".join(f"{line.capitalize()}, ja.\n" for line in path.read_text().splitlines()))
    (tmp_path / "1.en").write_text("".join(f"{line}.\n" for line in (tmp_path / "1.en").read_text().splitlines()))

    def pieces(*extra: str) -> tuple[set[str], set[str]]:
        recipe = load_recipe(RECIPE, [*overrides, *SEPARATE, *extra])
        run = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        vocab = train_translation(recipe, run, progress=False)["tokenizer"]
        return _pieces(vocab.source), _pieces(vocab.target)

    def marked(p: str) -> bool:
        return any(c.isupper() or c in ",." for c in p)

    plain_source, plain_target = pieces()
    source, target = pieces("data.source_as_transcript=true")
    assert any(marked(p) for p in plain_source) and not any(marked(p) for p in source)
    assert target == plain_target and any("." in p for p in target)
    # Loaded for use (qkv translate, qkv serve), such a model reads every source as it learnt:
    # typed text and a transcript of it are the same ids; the target side is untouched.
    plain, reads = bundles.load(tmp_path / "run0").vocab, bundles.load(tmp_path / "run1").vocab
    typed, spoken = "Ein Hund, ja.", "ein hund ja"
    assert reads.source.encode(typed) == reads.source.encode_batch([spoken])[0]
    assert reads.source.tokens(typed) == reads.source.tokens(spoken)
    assert plain.source.encode(typed) != plain.source.encode(spoken)
    assert reads.target.encode("A dog.") != reads.target.encode("a dog")
    assert not reads.source.same_as(reads.source.reading(str.lower))  # ensembles must read alike
    lines = (tmp_path / "1.de").read_text().splitlines()
    (tmp_path / "1.de").write_text("\n".join([*lines[:6], "...", *lines[7:]]) + "\n")
    pieces("data.source_as_transcript=true")  # Multi30k's train.de:16510 is "@@": left out, said
    assert "1.de: 1 sources without words left out" in capsys.readouterr().err
