"""Tests of the ``qkv`` command line, run in-process through :func:`qkv.cli.main`.

One tiny numbers model is trained once per module (through ``qkv train``) and reused by the
generate and evaluate tests. User mistakes must end in exit status 2 and one line on
stderr that starts with "qkv" and names the problem.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.checkpoint import save_model
from qkv.cli.main import main
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.tokenization import Tokenizer

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "numbers.yaml")
TINY = [
    *("--set", "train.steps=20"),
    *("--set", "data.eval_examples=20"),
    *("--set", "decode.beam_size=2"),
    *("--set", "model.d_model=15"),
    *("--set", "model.n_heads=3"),
    *("--set", "model.d_ff=7"),
    *("--set", "model.n_encoder_layers=1"),
    *("--set", "model.n_decoder_layers=1"),
]
# Failing runs only need the data step to be quick.
FEW = ["--set", "data.eval_examples=5"]
SHORT = ["--max-new-tokens", "6"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``qkv argv``; argparse's SystemExit becomes a status."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(result: tuple[int, str, str], *names: str) -> str:
    rc, out, err = result
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qkv"), err
    for name in names:
        assert name in lines[0], (name, err)
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny numbers model trained by ``qkv train ... --json``: (model dir, stdout, status)."""
    model = tmp_path_factory.mktemp("cli") / "model"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["train", RECIPE, "--out", str(model), "--json", "--quiet", *TINY])
    return model, stdout.getvalue(), rc


@pytest.fixture
def stdin(monkeypatch):
    def feed(text: str) -> None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8")), encoding="utf-8"))

    return feed


# ------------------------------------------------------------------- help


@pytest.mark.parametrize(
    "command",
    [[], ["demo"], ["train"], ["generate"], ["chat"], ["evaluate"], ["transcribe"], ["speak"]],
    ids=lambda c: c or "qkv",
)
def test_help_has_an_example(capsys, command):
    rc, out, _ = run(capsys, *command, "--help")
    assert rc == 0
    assert "example" in out
    assert out.startswith("usage: qkv")


def test_version(capsys):
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and re.fullmatch(r"qkv \d+\.\d+\.\d+\S*\n", out)


def test_python_m_qkv_help():
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "usage: qkv" in result.stdout and "generate" in result.stdout


# ------------------------------------------------------------ user errors


def test_no_command(capsys):
    assert_user_error(run(capsys), "COMMAND")


def test_unknown_option(capsys):
    assert_user_error(run(capsys, "evaluate", "--bogus"), "--bogus")


def test_unknown_subcommand(capsys):
    assert_user_error(run(capsys, "frobnicate"), "frobnicate")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "m", "--beam", "0"],
        ["generate", "--model", "m", "--beam", "two"],
        ["demo", "--steps", "0"],
        ["evaluate", "--examples", "-3"],
    ],
    ids=["beam-0", "beam-word", "demo-steps-0", "examples-negative"],
)
def test_bad_option_value(capsys, argv):
    line = assert_user_error(run(capsys, *argv), argv[-2])
    assert "positive integer" in line


def test_generate_missing_model(capsys):
    assert_user_error(run(capsys, "generate", "--model", "/nonexistent/model", "--prompt", "1"), "/nonexistent/model")


def test_train_missing_recipe(capsys, tmp_path):
    assert_user_error(run(capsys, "train", "missing.yaml", "--out", str(tmp_path / "x")), "missing.yaml")
    assert not (tmp_path / "x").exists()


def test_train_bad_config_value(capsys, tmp_path):
    line = assert_user_error(
        run(capsys, "train", RECIPE, "--out", str(tmp_path / "x"), "--quiet", *FEW, "--set", "model.positions=foo"),
        "positions",
        "foo",
    )
    assert "train" in line
    assert not (tmp_path / "x").exists()


def test_train_unknown_model_field(capsys, tmp_path):
    assert_user_error(
        run(capsys, "train", RECIPE, "--out", str(tmp_path / "x"), "--quiet", *FEW, "--set", "model.widht=3"),
        "widht",
    )


@pytest.mark.parametrize(
    ("setting", "name"),
    [("train.steps=0", "steps"), ("train.steps=abc", "steps"), ("model=3", "model")],
    ids=["steps-0", "steps-not-a-number", "section-replaced"],
)
def test_train_bad_recipe_values_are_user_errors(capsys, tmp_path, setting, name):
    result = run(capsys, "train", RECIPE, "--out", str(tmp_path / "x"), "--quiet", *FEW, "--set", setting)
    assert_user_error(result, name)


def test_evaluate_line_count_mismatch(capsys, tmp_path):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("a\nb\n")
    ref.write_text("a\n")
    assert_user_error(run(capsys, "evaluate", "--hyp", str(hyp), "--ref", str(ref)), "hyp.txt", "ref.txt")


def test_evaluate_missing_file(capsys, tmp_path):
    ref = tmp_path / "ref.txt"
    ref.write_text("a\n")
    assert_user_error(run(capsys, "evaluate", "--hyp", str(tmp_path / "nohyp.txt"), "--ref", str(ref)), "nohyp.txt")


def test_evaluate_needs_files_or_model(capsys):
    assert_user_error(run(capsys, "evaluate"), "--hyp")


def test_model_without_tokenizer(capsys, tmp_path):
    torch.manual_seed(0)
    model = EncoderDecoder(
        EncoderDecoderConfig(
            src_vocab_size=11, tgt_vocab_size=11, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1
        )
    )
    save_model(model, tmp_path / "bare")
    assert_user_error(run(capsys, "generate", "--model", str(tmp_path / "bare"), "--prompt", "1"), "tokenizer.json")
    assert_user_error(run(capsys, "evaluate", "--model", str(tmp_path / "bare"), "--examples", "2"), "tokenizer.json")
    # With a tokenizer but no task (saved without a recipe, or imported): not scored as numbers.
    tokenizer = Tokenizer.train_char_level(["0123456"])  # 11 ids, as the model
    save_model(model, tmp_path / "untasked", files=tokenizer.save(tmp_path / "tokenizer.json"))
    assert_user_error(run(capsys, "evaluate", "--model", str(tmp_path / "untasked"), "--examples", "2"), "task None")


def test_generate_invalid_utf8_input_names_file_and_line(capsys, trained, tmp_path):
    model, _, _ = trained
    path = tmp_path / "in.txt"
    path.write_bytes(b"12\n3\xff4\n5\n")
    assert_user_error(run(capsys, "generate", "--model", str(model), "--input", str(path)), f"{path}:2", "UTF-8")


def test_generate_missing_input_file(capsys, trained, tmp_path):
    model, _, _ = trained
    assert_user_error(run(capsys, "generate", "--model", str(model), "--input", str(tmp_path / "no.txt")), "no.txt")


def test_generate_nbest_larger_than_beam(capsys, trained, stdin):
    model, _, _ = trained
    stdin("12\n")
    assert_user_error(run(capsys, "generate", "--model", str(model), "--nbest", "3", "--beam", "1"), "--nbest 3")


def test_generate_checks_options_before_reading_stdin(capsys, trained, monkeypatch):
    model, _, _ = trained

    class NoStdin(io.StringIO):
        def __iter__(self):
            raise AssertionError("stdin was read before the options were checked")

    monkeypatch.setattr(sys, "stdin", NoStdin())
    assert_user_error(run(capsys, "generate", "--model", str(model), "--nbest", "3", "--beam", "1"), "--nbest")


@pytest.mark.parametrize(
    "option", [["--temperature", "0"], ["--temperature", "-1"], ["--top-p", "0"]], ids=["t0", "t-1", "p0"]
)
def test_generate_bad_sampling_values(capsys, trained, option):
    model, _, _ = trained
    result = run(capsys, "generate", "--model", str(model), "--prompt", "12", "--sample", *SHORT, *option)
    assert_user_error(result, option[0])


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_generate_invalid_utf8_on_stdin(capsys, trained, monkeypatch, errors):
    model, _, _ = trained
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"12\n3\xff4\n"), encoding="utf-8", errors=errors))
    assert_user_error(run(capsys, "generate", "--model", str(model)), "UTF-8")


def test_generate_output_in_missing_directory(capsys, trained, tmp_path):
    model, _, _ = trained
    out = tmp_path / "no" / "such" / "dir" / "out.txt"
    assert_user_error(
        run(capsys, "generate", "--model", str(model), "--prompt", "12", "--output", str(out)), str(out.parent)
    )


# ------------------------------------------------------------- train, generate, evaluate


def test_train_json_and_model_directory(trained):
    model, stdout, rc = trained
    assert rc == 0
    lines = stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert {"task", "model", "steps", "final_loss", "exact_match"} <= result.keys()
    assert result["task"] == "numbers" and result["model"] == str(model) and result["steps"] == 20
    assert result["final_loss"] > 0 and 0.0 <= result["exact_match"] <= 1.0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in model.iterdir()}
    meta = json.loads((model / "config.json").read_text())
    assert meta["kind"] == "encoder_decoder" and meta["config"]["d_model"] == 15
    assert (model / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_generate_keeps_order_and_empty_lines(capsys, trained, stdin):
    model, _, _ = trained
    stdin("12\n\n305\n")
    rc, out, _ = run(capsys, "generate", "--model", str(model), *SHORT)
    assert rc == 0
    lines = out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # 3 lines, each ending in \n
    # Each output is what that input gives on its own.
    for i, prompt in ((0, "12"), (2, "305")):
        rc, single, _ = run(capsys, "generate", "--model", str(model), "--prompt", prompt, *SHORT)
        assert rc == 0 and single == lines[i] + "\n"


def test_generate_output_file(capsys, trained, stdin, tmp_path):
    model, _, _ = trained
    stdin("12\n\n305\n")
    rc, expected, _ = run(capsys, "generate", "--model", str(model), *SHORT)
    assert rc == 0
    inp, outp = tmp_path / "in.txt", tmp_path / "out.txt"
    inp.write_text("12\n\n305\n")
    rc, out, _ = run(capsys, "generate", "--model", str(model), *SHORT, "--input", str(inp), "--output", str(outp))
    assert rc == 0 and out == ""
    assert outp.read_text() == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]


def test_generate_nbest_with_scores(capsys, trained, stdin):
    model, _, _ = trained
    stdin("12\n305\n")
    rc, out, _ = run(capsys, "generate", "--model", str(model), "--beam", "2", "--nbest", "2", *SHORT)
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) == 4
    scores = []
    for line in lines:
        text, sep, score = line.rpartition("\t")
        assert sep == "\t" and "\t" not in text
        scores.append(float(score))
    assert all(s <= 0 for s in scores)
    assert scores[0] >= scores[1] and scores[2] >= scores[3]  # best first


def test_generate_nbest_gives_nbest_lines_for_empty_inputs_too(capsys, trained, stdin):
    model, _, _ = trained
    stdin("12\n\n305\n")
    rc, out, _ = run(capsys, "generate", "--model", str(model), "--beam", "2", "--nbest", "2", *SHORT)
    assert rc == 0
    assert len(out.splitlines()) == 6


def test_generate_sampling_with_a_seed_is_reproducible(capsys, trained, stdin):
    model, _, _ = trained
    outputs = []
    for _ in range(2):
        stdin("12\n4,317\n")
        rc, out, _ = run(capsys, "generate", "--model", str(model), "--sample", "--seed", "3", *SHORT)
        assert rc == 0 and len(out.splitlines()) == 2
        outputs.append(out)
    assert outputs[0] == outputs[1]


def test_evaluate_model_json(capsys, trained):
    model, _, _ = trained
    rc, out, _ = run(capsys, "evaluate", "--model", str(model), "--examples", "10", "--beam", "2", "--json")
    assert rc == 0
    result = json.loads(out)
    assert result["task"] == "numbers" and result["examples"] == 10
    assert 0.0 <= result["exact_match"] <= 1.0


def test_evaluate_files(capsys, tmp_path):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    ref.write_text("the cat sat on the mat today\nfour thousand three hundred seventeen\n")
    hyp.write_text("the cat sat on a mat today\nfour thousand three hundred seventeen\n")
    rc, out, _ = run(capsys, "evaluate", "--hyp", str(hyp), "--ref", str(ref))
    assert rc == 0 and "bleu=" in out and "chrf=" in out and "exact_match=0.5" in out
    rc, out, _ = run(capsys, "evaluate", "--hyp", str(ref), "--ref", str(ref), "--json")
    result = json.loads(out)
    assert rc == 0 and result["bleu"] == 100.0 and result["chrf"] == 100.0 and result["exact_match"] == 1.0
    assert "nrefs:1" in result["bleu_signature"]


def test_demo_end_to_end_tiny(capsys, tmp_path, stdin):
    """demo: progress, examples, one JSON line with the four keys, a PNG, a usable model dir."""
    out = tmp_path / "demo"
    rc, stdout, err = run(capsys, "demo", "--out", str(out), "--steps", "5", "--examples", "7", "--quiet")
    assert rc == 0, err
    lines = stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert set(result) == {"task", "exact_match", "train_seconds", "attention_png"}
    assert sum(line.startswith("{") for line in lines) == 1
    assert 0.0 <= result["exact_match"] <= 1.0
    assert Path(result["attention_png"]).read_bytes().startswith(b"\x89PNG")
    assert "held-out" in stdout
    stdin("4,317\n")
    rc, generated, err = run(capsys, "generate", "--model", str(out / "model"), *SHORT)
    assert rc == 0, err
    assert len(generated.splitlines()) == 1


def test_generate_refuses_an_encoder_only_model(capsys, tmp_path):
    from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig

    model = EncoderOnly(EncoderOnlyConfig(vocab_size=13, d_model=15, n_heads=3, d_ff=7, n_layers=1))
    save_model(model, tmp_path / "bert")
    assert_user_error(run(capsys, "generate", "--model", str(tmp_path / "bert"), "--prompt", "x"), "encoder_only")


def test_evaluate_refuses_a_model_of_another_task(capsys, tmp_path, trained):
    from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
    from qkv.tokenization import FILE, Tokenizer

    model_dir, _, _ = trained
    tok = Tokenizer.load(model_dir / FILE)
    gpt = DecoderOnly(DecoderOnlyConfig(vocab_size=tok.vocab_size, d_model=15, n_heads=3, d_ff=7, n_layers=1))
    save_model(gpt, tmp_path / "gpt", files={FILE: model_dir / FILE})
    assert_user_error(run(capsys, "evaluate", "--model", str(tmp_path / "gpt"), "--examples", "3"), "numbers")


def test_generate_sample_with_beam_is_a_user_error(capsys, trained):
    model, _, _ = trained
    assert_user_error(run(capsys, "generate", "--model", str(model), "--sample", "--beam", "2"), "--sample")


def test_generate_input_longer_than_the_window(capsys, trained, tmp_path):
    """The documented rule, not an error: a source keeps its first max_len tokens, with a note."""
    model, _, _ = trained
    text = tmp_path / "long.txt"
    text.write_text("12\n" + "1" * 200 + "\n")
    assert main(["generate", "--model", str(model), "--input", str(text)]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2
    assert "long.txt:2" in captured.err and "keep their first" in captured.err


def test_train_set_value_that_is_not_yaml(capsys, tmp_path):
    assert_user_error(
        run(capsys, "train", RECIPE, "--out", str(tmp_path / "x"), "--quiet", "--set", "train.steps=[1"), "train.steps"
    )


@pytest.mark.parametrize("setting", ["model.n_kv_heads=-3", "model.n_encoder_layers=0", "model.norm_first=maybe"])
def test_train_bad_model_field_is_a_user_error(capsys, tmp_path, setting):
    field = setting.split("=")[0].split(".")[1]
    assert_user_error(run(capsys, "train", RECIPE, "--out", str(tmp_path / "x"), "--quiet", "--set", setting), field)


def test_sampling_options_imply_sample(capsys, trained, stdin):
    """--top-k (as --temperature, --top-p, --seed) samples without --sample: with k = 1 the
    sample is the greedy output, with k = 3 and a seed it is the same as with --sample; with
    --beam it is a user error naming both."""
    model, _, _ = trained
    argv = ["generate", "--model", str(model), *SHORT]
    lines = "12\n4,317\n905\n77\n"

    def generate(*options: str) -> str:
        stdin(lines)
        rc, out, err = run(capsys, *argv, *options)
        assert rc == 0 and len(out.splitlines()) == 4, (rc, out, err)
        return out

    assert generate("--top-k", "1", "--seed", "4") == generate()  # greedy
    implied = generate("--top-k", "3", "--temperature", "2", "--seed", "4")
    assert implied.strip() and implied == generate("--sample", "--top-k", "3", "--temperature", "2", "--seed", "4")
    assert_user_error(run(capsys, *argv, "--top-p", "0.5", "--beam", "2"), "--top-p", "--beam")


def test_evaluate_empty_files(capsys, tmp_path):
    hyp, ref = tmp_path / "h.txt", tmp_path / "r.txt"
    hyp.write_text("")
    ref.write_text("")
    assert_user_error(run(capsys, "evaluate", "--hyp", str(hyp), "--ref", str(ref)), "empty")


def test_generate_output_is_a_directory(capsys, trained, tmp_path):
    model, _, _ = trained
    assert_user_error(
        run(capsys, "generate", "--model", str(model), "--prompt", "1", "--output", str(tmp_path)), "directory"
    )


def test_numbers_recipe_needs_a_window_for_its_longest_output(capsys, tmp_path):
    assert_user_error(
        run(capsys, "train", RECIPE, "--out", str(tmp_path / "x"), "--quiet", "--set", "model.max_len=8"), "max_len"
    )


def test_train_refuses_to_replace_a_directory_that_is_not_a_model(capsys, tmp_path):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    line = assert_user_error(run(capsys, "train", RECIPE, "--out", str(precious), "--quiet", *TINY), "notes")
    assert "not a qkv model directory" in line
    assert (precious / "thesis.txt").read_text() == "years of work"
