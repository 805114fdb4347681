"""Tests of qkv.checkpoint: round trips, the directory format, refusals and atomic saving."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qkv
from qkv.checkpoint import build_model, check_output, load_model, read_meta, save_model
from qkv.checks import PASS, bit_identical, probe_of
from qkv.errors import UserError
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig

BLOCK = {"d_model": 15, "n_heads": 3, "d_ff": 11, "dropout": 0.0, "max_len": 16}


def make(kind: str, **overrides):
    torch.manual_seed(0)
    if kind == "encoder_decoder":
        fields = {"src_vocab_size": 17, "tgt_vocab_size": 13, "n_encoder_layers": 1, "n_decoder_layers": 2}
        return EncoderDecoder(EncoderDecoderConfig(**{**BLOCK, **fields, **overrides})).eval()
    if kind == "encoder_only":
        fields = {"vocab_size": 13, "n_layers": 2, "n_classes": 3, "type_vocab_size": 2}
        return EncoderOnly(EncoderOnlyConfig(**{**BLOCK, **fields, **overrides})).eval()
    fields = {"vocab_size": 13, "n_layers": 2}
    return DecoderOnly(DecoderOnlyConfig(**{**BLOCK, **fields, **overrides})).eval()


def outputs(model) -> list[torch.Tensor]:
    """Every output head of a model on a fixed input."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(3, 13, (2, 7), generator=g)
    x[1, 5:] = 0
    with torch.no_grad():
        if isinstance(model, EncoderDecoder):
            return [model(x, torch.randint(3, 13, (2, 5), generator=g))]
        if isinstance(model, EncoderOnly):
            types = (torch.arange(7) > 3).long().expand(2, 7)
            return [model(x), model.classify(x), model(x, token_types=types)]
        return [model(x)]


def perturb(model) -> None:
    """Move every parameter off its initial value so that a load that skips a tensor shows."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


CASES = {
    "encoder_decoder": {},
    "encoder_decoder_shared_tied": {"src_vocab_size": 13, "share_embeddings": True, "tie_output": True},
    "encoder_decoder_untied_rope_gqa": {"tie_output": False, "positions": "rope", "d_model": 18, "n_kv_heads": 1},
    "encoder_decoder_marian_style": {"positions": "sinusoidal_halves", "output_bias": True, "activation": "silu"},
    "encoder_only": {},
    "encoder_only_untied_learned": {"tie_output": False, "positions": "learned", "pooling": "mean"},
    "encoder_only_bert_style": {"norm_first": False, "embedding_norm": True, "pooler": True, "activation": "gelu"},
    "decoder_only": {},
    "decoder_only_untied_swiglu_rmsnorm": {"tie_output": False, "activation": "swiglu", "norm": "rmsnorm"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_identical(case: str, tmp_path: Path) -> None:
    """save_model then load_model gives a model with bit-identical outputs (ties included)."""
    kind = next(k for k in ("encoder_decoder", "encoder_only", "decoder_only") if case.startswith(k))
    model = make(kind, **CASES[case])
    perturb(model)
    save_model(model, tmp_path / "m")
    loaded, meta = load_model(tmp_path / "m")
    assert type(loaded) is type(model)
    assert loaded.config == model.config
    assert not loaded.training
    assert meta["kind"] == kind
    for a, b in zip(outputs(model), outputs(loaded), strict=True):
        assert torch.equal(a, b)
    row = bit_identical(model, loaded, probe_of(model, None))  # qkv check's row: every tensor bit for bit
    assert row.status == PASS and row.measured == 0


def test_a_decoding_copy_is_not_saved(tmp_path: Path) -> None:
    """decoding_copies.for_decoding stacks the self-attention projections: that layout is refused,
    and nothing is written."""
    from qkv.decoding_copies import for_decoding

    model = make("decoder_only")
    with pytest.raises(ValueError, match="prepared for decoding"):
        save_model(for_decoding(model), tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_ties_survive_loading(tmp_path: Path) -> None:
    """A shared/tied model is stored with its shared tensor once and loads with the ties intact."""
    model = make("encoder_decoder", **CASES["encoder_decoder_shared_tied"])
    perturb(model)
    save_model(model, tmp_path / "m")
    stored = load_file(tmp_path / "m" / "model.safetensors")
    shared = [k for k in stored if k.endswith("embed.token.weight") or k == "output.weight"]
    assert len(shared) == 1  # one table serves source, target and output
    loaded, _ = load_model(tmp_path / "m")
    assert loaded.src_embed is loaded.tgt_embed
    assert loaded.output.weight.data_ptr() == loaded.tgt_embed.token.weight.data_ptr()


def test_directory_format(tmp_path: Path) -> None:
    """config.json holds kind, config and qkv_version (+ extra fields); weights are safetensors, no pickle."""
    model = make("decoder_only")
    returned = save_model(model, tmp_path / "m", extra={"task": "copy"})
    assert returned == tmp_path / "m"
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert names == {"config.json", "model.safetensors"}
    assert not any(n.endswith((".pt", ".pth", ".bin", ".pkl", ".pickle")) for n in names)
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert meta["kind"] == "decoder_only"
    assert meta["qkv_version"] == qkv.__version__
    assert meta["config"]["d_model"] == 15 and meta["config"]["vocab_size"] == 13
    assert meta["files"] == {}
    assert meta["task"] == "copy"
    assert read_meta(tmp_path / "m") == meta
    # a safetensors file: an 8-byte little-endian header length, then a JSON header
    raw = (tmp_path / "m" / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert "decoder.blocks.0.self_attn.w_q.weight" in header


def test_extra_files_are_copied_and_hashed(tmp_path: Path) -> None:
    """files= copies each file into the directory and records its SHA-256 in config.json."""
    source = tmp_path / "vocab.txt"
    source.write_text("a\nb\nc\n")
    save_model(make("encoder_only"), tmp_path / "m", files={"tokenizer.json": source})
    copied = tmp_path / "m" / "tokenizer.json"
    assert copied.read_text() == "a\nb\nc\n"
    meta = read_meta(tmp_path / "m")
    assert meta["files"] == {"tokenizer.json": hashlib.sha256(b"a\nb\nc\n").hexdigest()}


# ------------------------------------------------------------------- refusals


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A saved encoder-decoder directory with one extra listed file."""
    source = tmp_path / "tok.json"
    source.write_text('{"vocab": [1, 2, 3]}')
    return save_model(make("encoder_decoder"), tmp_path / "m", files={"tokenizer.json": source})


def _edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def test_missing_directory(tmp_path: Path) -> None:
    """A directory that does not exist is a UserError naming it."""
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_config_json(saved: Path) -> None:
    """A directory without config.json is not a model directory."""
    (saved / "config.json").unlink()
    with pytest.raises(UserError, match=r"config\.json"):
        load_model(saved)


def test_invalid_config_json(saved: Path) -> None:
    """A config.json that is not JSON is a UserError."""
    (saved / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_model(saved)


def test_missing_weights(saved: Path) -> None:
    """A directory without model.safetensors is a UserError naming the file."""
    (saved / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"model\.safetensors is missing"):
        load_model(saved)


def test_unreadable_weights(saved: Path) -> None:
    """Garbage in model.safetensors is a UserError, not a crash."""
    (saved / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(UserError, match="safetensors"):
        load_model(saved)


def test_unknown_config_field(saved: Path) -> None:
    """An unknown config field is a UserError naming the field."""
    _edit_config(saved, lambda m: m["config"].update(colour="blue"))
    with pytest.raises(UserError, match="colour"):
        load_model(saved)


def test_bad_config_value(saved: Path) -> None:
    """A config value the model refuses (ValueError) becomes a UserError."""
    _edit_config(saved, lambda m: m["config"].update(positions="spiral"))
    with pytest.raises(UserError, match="spiral"):
        load_model(saved)


def test_unknown_kind(saved: Path) -> None:
    """An unknown model kind in config.json is a UserError naming it."""
    _edit_config(saved, lambda m: m.update(kind="rnn"))
    with pytest.raises(UserError, match="rnn"):
        load_model(saved)
    with pytest.raises(UserError, match="rnn"):
        build_model("rnn", {})


def test_missing_kind_field(saved: Path) -> None:
    """config.json without a 'kind' field is a UserError."""
    _edit_config(saved, lambda m: m.pop("kind"))
    with pytest.raises(UserError, match="kind"):
        load_model(saved)


def test_shape_mismatch(saved: Path) -> None:
    """A config whose d_ff disagrees with the stored tensors is a UserError naming tensor and shapes."""
    _edit_config(saved, lambda m: m["config"].update(d_ff=7))
    with pytest.raises(UserError, match=r"shape.*\(11, 15\).*\(7, 15\)"):
        load_model(saved)


def test_missing_tensor(saved: Path) -> None:
    """A tensor absent from model.safetensors is a UserError naming it."""
    path = saved / "model.safetensors"
    tensors = load_file(path)
    del tensors["decoder.blocks.1.ffn.w_2.weight"]
    save_file(tensors, path)
    with pytest.raises(UserError, match=r"missing decoder\.blocks\.1\.ffn\.w_2\.weight"):
        load_model(saved)


def test_unexpected_tensor(saved: Path) -> None:
    """An extra tensor in model.safetensors is a UserError naming it."""
    path = saved / "model.safetensors"
    tensors = load_file(path)
    tensors["stowaway"] = torch.zeros(3)
    save_file(tensors, path)
    with pytest.raises(UserError, match="unexpected stowaway"):
        load_model(saved)


def test_changed_listed_file(saved: Path) -> None:
    """A listed file whose content changed fails its SHA-256 check: a UserError naming the file."""
    (saved / "tokenizer.json").write_text('{"vocab": [1, 2, 4]}')
    with pytest.raises(UserError, match=r"tokenizer\.json.*SHA-256"):
        load_model(saved)


def test_missing_listed_file(saved: Path) -> None:
    """A listed file that is gone is a UserError naming the file."""
    (saved / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=r"tokenizer\.json is missing"):
        read_meta(saved)


def test_wrong_kind(saved: Path) -> None:
    """load_model(kind=...) refuses a model of another kind, naming both."""
    with pytest.raises(UserError, match=r"encoder_decoder.*decoder_only"):
        load_model(saved, kind="decoder_only")
    model, _ = load_model(saved, kind="encoder_decoder")
    assert isinstance(model, EncoderDecoder)


# ------------------------------------------------------------------ atomicity


def test_save_replaces_existing_directory(tmp_path: Path) -> None:
    """Saving over a directory replaces it wholly (old files gone) and leaves no temporary siblings."""
    target = tmp_path / "m"
    save_model(make("encoder_decoder"), target)
    (target / "stale.txt").write_text("old")
    new = make("decoder_only")
    perturb(new)
    save_model(new, target)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert {p.name for p in target.iterdir()} == {"config.json", "model.safetensors"}
    loaded, meta = load_model(target)
    assert meta["kind"] == "decoder_only"
    assert torch.equal(outputs(loaded)[0], outputs(new)[0])


def test_the_debris_of_a_first_save_killed_midway_may_be_replaced(tmp_path: Path) -> None:
    """A run killed during its first checkpoint leaves only .last.* (an FSDP save's staged
    shards, atomic_directory's temporary): starting the run again may write there; anything
    else in the directory is still refused."""
    out = tmp_path / "run"
    (out / ".last.shards").mkdir(parents=True)
    (out / ".last.shards" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"half")
    check_output(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not a qkv model directory"):
        check_output(out)


def test_failed_save_keeps_old_directory(tmp_path: Path) -> None:
    """A save that fails half-way leaves the existing directory as it was, and no temporary siblings."""
    target = tmp_path / "m"
    old = make("decoder_only")
    save_model(old, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(FileNotFoundError):
        save_model(make("encoder_only"), target, files={"tokenizer.json": tmp_path / "absent.json"})
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_save_creates_parents(tmp_path: Path) -> None:
    """save_model creates missing parent directories."""
    target = tmp_path / "a" / "b" / "m"
    save_model(make("encoder_only"), target)
    assert (target / "model.safetensors").is_file()


def test_saved_directory_has_ordinary_permissions(tmp_path: Path) -> None:
    """The saved directory gets the permissions of an ordinary mkdir (umask), not mkdtemp's private 0700."""
    save_model(make("encoder_only"), tmp_path / "m")
    (tmp_path / "plain").mkdir()
    mode = (tmp_path / "m").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain").stat().st_mode & 0o777, f"saved with mode {mode:o}"
    assert os.access(tmp_path / "m", os.R_OK | os.X_OK)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_every_saved_file_has_the_permissions_the_umask_gives(tmp_path: Path, mask: int) -> None:
    """One rule for a model directory's files, the weights too (safetensors alone writes them
    0600): what the umask gives a new file, as config.json and an ordinary open() get."""
    extra = tmp_path / "notes.txt"
    extra.write_text("hello")
    before = os.umask(mask)
    try:
        save_model(make("encoder_only"), tmp_path / "m", files={"notes.txt": extra})
    finally:
        os.umask(before)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert {"model.safetensors", "config.json", "notes.txt"} <= set(modes)
    assert set(modes.values()) == {0o666 & ~mask}, {k: oct(v) for k, v in modes.items()}
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o777 & ~mask


def test_save_refuses_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    """A save never replaces the working directory or one above it, which it would move away."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for target in (".", ".."):
        with pytest.raises(UserError, match="current directory"):
            save_model(make("decoder_only"), target)
    assert work.is_dir() and not any(work.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["work"]


@pytest.fixture
def read_only(tmp_path: Path):
    """A directory (holding an empty directory) that this process may not write in; skipped
    where permissions do not bind (root with CAP_DAC_OVERRIDE writes anywhere)."""
    folder = tmp_path / "read-only"
    (folder / "empty").mkdir(parents=True)
    for path in (folder / "empty", folder):
        path.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("file permissions do not restrict this user (root)")
        yield folder
    finally:
        for path in (folder, folder / "empty"):
            path.chmod(0o755)  # so that pytest can remove them


def test_an_output_that_cannot_be_written_is_refused_up_front(read_only: Path, capsys) -> None:
    """Model directories (new, nested, or replacing an empty one) and training runs under a
    directory without write permission: a UserError naming the path, before any work."""
    from qkv.checkpoint import check_output
    from qkv.cli.main import main
    from qkv.runs import check_run_output

    for target in (read_only / "m", read_only / "a" / "b" / "m", read_only / "empty"):
        with pytest.raises(UserError, match=f"cannot write {target}: no permission to write in {read_only}"):
            check_output(target)
    with pytest.raises(UserError, match=f"cannot write {read_only / 'run'}: no permission"):
        check_run_output(read_only / "run", resume=False)
    with pytest.raises(UserError, match=f"cannot write {read_only / 'empty'}: no permission"):
        check_run_output(read_only / "empty", resume=False)  # itself not writable
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "shakespeare_char_cpu.yaml")
    assert main(["train", recipe, "--out", str(read_only / "m"), "--quiet", "--set", "data.text=absent.txt"]) == 2
    err = capsys.readouterr().err
    assert err == f"qkv train: error: cannot write {read_only / 'm'}: no permission to write in {read_only}; " + (
        "choose another output path\n"
    )
