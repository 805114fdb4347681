#!/usr/bin/env bash
# The prepared GPU check (issue 24, section 3; issue 49), for a session that is lent a GPU machine;
# never required. Training throughput of the Multi30k recipe's encoder–decoder size ("base" and
# "small" in bench/mt_speed.py) and of the GPT recipe's model (bench/lm_speed.py) on the GPU, fp32
# and bf16 autocast, PyTorch's fused attention (scaled_dot_product_attention), beside Hugging
# Face's Marian and GPT-2 on the same GPU in the same run. About 5 minutes.
#   bash bench/gpu.sh                       # uses python3 and the torch already on the machine
#   PYTHON=.venv/bin/python bash bench/gpu.sh
#   bash bench/gpu.sh --dry-run             # no GPU: the same steps checked on the CPU (a minute or two)
# Records: bench/results/mt_speed.json and lm_speed.json, metrics named "... on cuda".
# Then the recipes themselves on the GPU (train.device=cuda): the numbers recipe whole (no data
# needed), and when the data is there ($QKV_DATA, else ../shared/data) one epoch of the Multi30k
# recipe and 500 steps of the GPT recipe, each printing its tokens/s in its --json summary.
# --dry-run, on any machine: the benchmarks' arguments parsed by their own parsers (the GPU
# settings, not run), the encoder-decoder training benchmark run at its tiny size on the CPU and
# the numbers recipe for 2 steps on the CPU (8 examples evaluated); nothing is recorded, the big recipes are not trained.
# What it does not do: NCCL with several GPUs (one GPU is lent at most).
set -euo pipefail
case "${1:-}" in
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  --dry-run) DRY=1 ;;
  "") DRY= ;;
  *) echo "bench/gpu.sh: unknown argument '$1' (bash bench/gpu.sh --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT_DIR=$(mktemp -d)
# A bench script run up to its argument parsing (its own parser), then stopped: what tests/test_docs.py does.
parses() {
  "$PY" -c 'import argparse, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_only(self, *args, **kwargs):
    parse(self, *args, **kwargs)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_only
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")' "$@" && echo "bench/gpu.sh --dry-run: $* parses"
}
if [ -n "$DRY" ]; then
  trap 'rm -rf "$OUT_DIR"' EXIT
  "$PY" -c "import torch; print(torch.__version__, 'dry run on the CPU')"
  parses bench/mt_speed.py --only train --device cuda --sizes small base --steps 40 --batch 128
  parses bench/lm_speed.py --only train --device cuda --steps 40
  "$PY" bench/mt_speed.py --only train --device cpu --sizes tiny --steps 3 --batch 4 --no-record
  "$PY" -m qkv train recipes/numbers.yaml --out "$OUT_DIR/numbers" --set train.device=cpu --set train.steps=2 \
      --set data.eval_examples=8 --set decode.beam_size=1 --quiet --json
  echo "bench/gpu.sh --dry-run: done (nothing recorded; on a GPU machine run it without --dry-run)"
  exit 0
fi
"$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name() if ok else 'no CUDA device'); sys.exit(0 if ok else 2)"
"$PY" bench/mt_speed.py --only train --device cuda --sizes small base --steps 40 --batch 128
"$PY" bench/lm_speed.py --only train --device cuda --steps 40
"$PY" -m qkv train recipes/numbers.yaml --out "$OUT_DIR/numbers" --set train.device=cuda --quiet --json
DATA=${QKV_DATA:-../shared/data}
if [ -d "$DATA/multi30k" ]; then
  "$PY" -m qkv train recipes/multi30k_de_en.yaml --out "$OUT_DIR/de_en" --set train.device=cuda \
      --set train.epochs=1 --set train.bf16=true --quiet --json
  "$PY" -m qkv train recipes/shakespeare_char.yaml --out "$OUT_DIR/gpt" --set train.device=cuda \
      --set train.steps=500 --set train.bf16=true --quiet --json
else
  echo "bench/gpu.sh: no data at $DATA: the Multi30k and GPT recipes were not trained"
fi
echo "bench/gpu.sh: done"
