"""Tests of qkv.recipes: loading and overriding recipes, their errors, cross-attention."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from qkv import runner
from qkv.checkpoint import read_meta
from qkv.cli.main import main
from qkv.errors import UserError
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.recipes import DecodeConfig, TrainConfig, override, upgrade_stored
from qkv.seq2seq import cross_attention
from qkv.tasks import TASKS, load_recipe
from qkv.tasks.lm import LM_MODEL, LmData
from qkv.tasks.numbers import NumbersTrain

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "numbers.yaml"


def _yaml(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_a_file():
    recipe = load_recipe(None)
    assert recipe.to_dict(TASKS["numbers"].decode) == TASKS["numbers"].defaults
    assert recipe.task == "numbers" and recipe.train.steps == 3000 and recipe.decode.beam_size == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.train.steps = 1  # sections are frozen: a run reads what was checked
    assert isinstance(recipe.train, NumbersTrain) and isinstance(recipe.train, TrainConfig)


def test_every_shipped_recipe_loads_typed():
    """Every recipe in recipes/ loads into its task's dataclasses, with no key left over."""
    for path in sorted(RECIPE.parent.glob("*.yaml")):
        recipe = load_recipe(path)
        task = TASKS[recipe.task]
        assert type(recipe.train) is task.train and type(recipe.data) is task.data, path
        assert isinstance(recipe.decode, DecodeConfig)


def test_the_shipped_recipe_loads():
    recipe = load_recipe(RECIPE)
    assert recipe.task == "numbers"
    assert recipe.model["d_model"] == 64 and recipe.decode.beam_size == 4


def test_yaml_file_overrides_defaults(tmp_path):
    path = _yaml(tmp_path, "model:\n  d_model: 32\n  positions: rope\ntrain:\n  steps: 9\n")
    recipe = load_recipe(path)
    assert recipe.model["d_model"] == 32
    assert recipe.model["positions"] == "rope"  # any model field, checked when the model is built
    assert recipe.model["n_heads"] == 4  # untouched keys keep their defaults
    assert recipe.train.steps == 9 and recipe.train.lr == NumbersTrain().lr


def test_set_overrides_are_yaml_typed_and_win_over_the_file(tmp_path):
    path = _yaml(tmp_path, "train:\n  steps: 9\n")
    recipe = load_recipe(
        path, ["train.steps=7", "model.dropout=0.1", "model.tie_output=false", "train.seconds=null", "task=numbers"]
    )
    assert recipe.train.steps == 7 and type(recipe.train.steps) is int
    assert recipe.model["dropout"] == 0.1 and type(recipe.model["dropout"]) is float
    assert recipe.model["tie_output"] is False
    assert recipe.train.seconds is None


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("data.beam_size=2", "data.beam_size has moved: it is decode.beam_size now"),
        ("train.ctc_weight=0.5", "train.ctc_weight has moved: it is train.ctc_loss_weight now"),
        ("data.ctc_weight=0.5", "data.ctc_weight has moved: it is decode.ctc_weight now"),
        ("data.stop_threshold=0.2", "data.stop_threshold has moved: it is decode.stop_threshold now"),
    ],
)
def test_a_key_that_moved_is_named_with_its_new_place(tmp_path, capsys, given, said):
    """A recipe (a file or --set) naming a key of before the decode section: one line naming
    the new key, exit 2 on the command line; the double meaning of ctc_weight is gone."""
    task = "tts" if "stop" in given else "asr" if "ctc" in given else "numbers"
    with pytest.raises(UserError, match=re.escape(said)):
        load_recipe(None, [f"task={task}", given])
    section, key = given.split("=")[0].split(".")
    path = _yaml(tmp_path, f"task: {task}\n{section}:\n  {key}: 1\n")
    code = main(["train", str(path), "--out", str(tmp_path / "out")])
    assert code == 2 and said in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_decode_key_of_another_task_is_refused():
    with pytest.raises(UserError, match=r"decode\.stop_threshold does not apply to this task"):
        load_recipe(None, ["decode.stop_threshold=0.3"])  # numbers: a beam search, no stop token


def test_a_stored_recipe_of_before_is_read_in_todays_layout():
    """A checkpoint's recipe of before the decode section (its decoding settings under data,
    the CTC loss weight as train.ctc_weight) reads as today's: what resume and qkv.load see."""
    old = {"task": "asr", "train": {"ctc_weight": 0.2}, "data": {"beam_size": 3, "ctc_weight": 0.4, "corpus": "x"}}
    new = upgrade_stored(old)
    assert new["decode"] == {"beam_size": 3, "ctc_weight": 0.4} and new["data"] == {"corpus": "x"}
    assert new["train"] == {"ctc_loss_weight": 0.2} and old["data"]["beam_size"] == 3  # a copy


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("optimizer:\n  lr: 1\n", ["recipe.yaml", "optimizer"]),
        ("train:\n  stepz: 1\n", ["recipe.yaml", "stepz"]),
        ("train: 5\n", ["recipe.yaml", "train"]),
        ("- a\n- b\n", ["recipe.yaml"]),
        ("model: {d_model: 3\n", ["recipe.yaml", "YAML"]),
        ("task: summarization\n", ["summarization", "task"]),
    ],
    ids=["unknown-section", "unknown-key", "section-not-mapping", "not-a-mapping", "invalid-yaml", "unknown-task"],
)
def test_bad_recipe_files(tmp_path, text, names):
    path = _yaml(tmp_path, text)
    with pytest.raises(UserError) as e:
        load_recipe(path)
    for name in names:
        assert name in str(e.value)
    assert "\n" not in str(e.value)


def test_invalid_utf8_recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(b"task: \xff\xfe\n")
    with pytest.raises(UserError, match=r"recipe\.yaml"):
        load_recipe(path)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match=r"missing\.yaml"):
        load_recipe(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("item", "name"),
    [
        ("train.steps", "train.steps"),  # no '='
        ("train.stepz=3", "stepz"),
        ("trian.steps=3", "trian"),
        ("train.steps.x=3", "train.steps"),
        ("task=summarization", "summarization"),
    ],
)
def test_bad_overrides(item, name):
    with pytest.raises(UserError) as e:
        load_recipe(None, [item])
    assert name in str(e.value)


@pytest.mark.parametrize("item", ["train=5", "model=3", "data=[1, 2]"])
def test_override_cannot_replace_a_whole_section(item):
    with pytest.raises(UserError):
        load_recipe(None, [item])


def test_cross_attention_shape_and_softmax_rows():
    torch.manual_seed(0)
    model = EncoderDecoder(
        EncoderDecoderConfig(
            src_vocab_size=11,
            tgt_vocab_size=11,
            d_model=12,
            n_heads=3,
            d_ff=16,
            n_encoder_layers=1,
            n_decoder_layers=2,
            dropout=0.0,
            max_len=16,
        )
    ).eval()
    src, out = [4, 5, 6, 7, 8], [9, 10, 4]
    weights = cross_attention(model, src=src, out=out)
    assert weights.shape == (3, len(out) + 1, len(src))  # (H, T, S)
    assert (weights >= 0).all()
    assert torch.allclose(weights.sum(-1), torch.ones(3, len(out) + 1), atol=1e-5)


def test_task_selects_its_defaults(tmp_path):
    """task: lm starts from the language-model defaults; --set task=lm does too."""
    path = tmp_path / "lm.yaml"
    path.write_text("task: lm\ntrain:\n  steps: 5\n")
    recipe = load_recipe(path)
    assert recipe.model["n_layers"] == LM_MODEL["n_layers"] and recipe.train.steps == 5
    assert load_recipe(None, ["task=lm"]).data == LmData()
    with pytest.raises(UserError, match="beam_size"):
        load_recipe(path, ["decode.beam_size=2"])  # a key of the numbers task


def test_rdrop_is_a_translation_option_and_must_not_be_negative():
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "multi30k_en_de_lc.yaml"
    assert load_recipe(recipe).train.rdrop == 0.0  # off unless asked for
    assert load_recipe(recipe, ["train.rdrop=5"]).train.rdrop == 5.0
    for bad in ("-1", "true", "x"):
        with pytest.raises(UserError, match=r"train\.rdrop must be a number >= 0"):
            load_recipe(recipe, [f"train.rdrop={bad}"])
    with pytest.raises(UserError, match="rdrop"):
        load_recipe(RECIPE, ["train.rdrop=1"])  # the numbers task has no R-Drop


def test_override_reads_a_key_as_load_recipe_does() -> None:
    """override() finds a --set key with spaces around it, the last one winning, and agrees
    with load_recipe on which task an override names."""
    items = ["train.steps=3", " train.seconds = 60 ", "train.seconds=90"]
    assert override(items, "train.seconds") == "90" and override(items, "train.steps") == "3"
    assert override(items, "train.lr") is None and override([], "task") is None
    assert override(["task = lm"], "task") == "lm" and load_recipe(None, ["task = lm"]).task == "lm"


def test_with_ema_the_average_is_what_is_saved_and_evaluated(tmp_path) -> None:
    """train.ema_decay on a task: the model directory holds the moving average (not the last
    weights: a run without it, the same otherwise, ends elsewhere), and the held-out score in
    config.json is the saved model's."""
    from qkv.checkpoint import load_model, read_meta
    from qkv.tasks import TASKS
    from qkv.tasks.numbers import evaluate_numbers

    tiny = ["model.d_model=16", "model.d_ff=32", "model.n_heads=2", "train.steps=13", "train.batch_size=7",
            "data.eval_examples=11", "train.warmup=2", "decode.beam_size=1"]  # fmt: skip
    plain = runner.train(TASKS["numbers"], load_recipe(None, tiny), tmp_path / "plain", progress=False)
    averaged = runner.train(
        TASKS["numbers"], load_recipe(None, [*tiny, "train.ema_decay=0.5"]), tmp_path / "ema", progress=False
    )
    assert averaged["losses"] == plain["losses"]  # the average does not change training
    saved, _ = load_model(tmp_path / "ema")
    ours, last = saved.state_dict(), plain["model"].state_dict()
    assert all(torch.equal(ours[k], v) for k, v in averaged["model"].state_dict().items())
    assert any(not torch.allclose(ours[k], last[k]) for k in ours)
    score, outputs = evaluate_numbers(saved, averaged["tokenizer"], pairs=averaged["held_out"], beam_size=1)
    assert (score, outputs) == (averaged["exact_match"], averaged["outputs"])
    assert read_meta(tmp_path / "ema")["exact_match"] == score


def _lm(tmp_path: Path, *extra: str) -> list[str]:
    """A tiny lm recipe's overrides on a small text written to ``tmp_path``."""
    import random

    rng = random.Random(5)
    words = "the a dog cat runs sleeps red big small house tree sees".split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 7))) for _ in range(97))
    (tmp_path / "text.txt").write_text(text + "\n")
    return ["task=lm", f"data.text={tmp_path / 'text.txt'}", "model.d_model=16", "model.d_ff=32", "model.n_heads=2",
            "model.n_layers=1", "model.max_len=13", "train.batch_size=5", "train.warmup=2", *extra]  # fmt: skip


def test_any_task_validates_keeps_the_best_averages_and_stops_early(tmp_path) -> None:
    """The validation hooks on a task that trains in steps (lm): a record every train.valid_every
    steps with the task's own metric (validation loss); the final model is the better of the best
    and the average of the last two, so its validation loss is no worse than any validated one;
    TensorBoard scalars stay in the model directory, the run's checkpoints do not. Patience
    stops a run that no longer improves (a learning rate too small to move a weight)."""

    out = tmp_path / "run"
    sets = ["train.steps=12", "train.valid_every=3", "train.average_last=2", "train.tensorboard=true"]
    summary = runner.train(TASKS["lm"], load_recipe(None, _lm(tmp_path, *sets)), out, progress=False)
    history = summary["history"]
    assert [h["step"] for h in history] == [3, 6, 9, 12]
    assert summary["val_loss"] <= min(h["valid_loss"] for h in history) + 1e-6
    meta = read_meta(out)  # the runner's record: which checkpoint, the best validation, the scores
    assert meta["final"] == summary["final"] and summary["final"] in ("best", "averaged")
    assert meta["validation"] == min(history, key=lambda h: h["valid_loss"])
    assert meta["val_loss"] == summary["val_loss"] and meta["wall_seconds"] > meta["train_seconds"] > 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert not [p.name for p in out.iterdir() if p.name in ("last", "best") or p.name.startswith("step-")]
    stuck = runner.train(
        TASKS["lm"],
        load_recipe(
            None,
            _lm(
                tmp_path,
                "train.steps=40",
                "train.valid_every=4",
                "train.patience=2",
                "train.lr=1e-12",
                "train.min_lr=0",
            ),
        ),
        tmp_path / "stuck",
        progress=False,
    )
    assert stuck["stopped_by"] == "patience" and stuck["steps"] == 12 and len(stuck["history"]) == 3


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (["train.patience=3"], r"train\.patience needs validation; set train\.valid_every"),
        (["train.average_last=2"], r"train\.average_last needs validation"),
        (["train.valid_every=epoch"], r"train\.valid_every=epoch needs a task that trains in epochs"),
        (["train.valid_every=0"], r"train\.valid_every must be a positive number of steps, epoch, or null"),
        (["train.ema_decay=1"], r"train\.ema_decay must be a number in \[0, 1\)"),
        (["train.accumulate=0"], r"train\.accumulate must be a positive integer"),
    ],
)
def test_training_hooks_refuse_what_cannot_work(sets, said) -> None:
    with pytest.raises(UserError, match=said):
        load_recipe(None, sets)


@pytest.mark.parametrize(("task", "metric"), [("asr", "valid_wer"), ("tts", "valid_loss")])
def test_speech_tasks_validate_on_a_validation_split(tmp_path, task, metric) -> None:
    """asr and tts validate too (WER; the teacher-forced loss), on the corpus's validation split:
    a manifest's (data.valid); the final model is chosen among the validated ones. A corpus
    without a validation split is refused in one line."""
    from speech_data import tiny_asr_overrides, tone_corpus
    from test_tts_task import TINY_TTS

    manifest = tone_corpus(tmp_path / "tones", utterances=6)
    base = (
        tiny_asr_overrides(manifest)
        if task == "asr"
        else [*TINY_TTS, f"data.train={manifest}", f"data.test={manifest}"]
    )
    sets = [*base, "train.steps=6", "train.valid_every=3", "train.average_last=2"]
    recipe = load_recipe(None, [*sets, f"data.valid={manifest}", "data.valid_limit=3"])
    summary = runner.train(TASKS[task], recipe, tmp_path / "model", progress=False)
    assert [h["step"] for h in summary["history"]] == [3, 6] and all(metric in h for h in summary["history"])
    assert summary["final"] in ("best", "averaged")
    with pytest.raises(UserError, match=r"the manifests corpus has no validation split; set data\.valid"):
        runner.train(TASKS[task], load_recipe(None, sets), tmp_path / "none", progress=False)
