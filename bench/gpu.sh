#!/usr/bin/env bash
# The prepared GPU check (issue 24, section 3), for a session that is lent a GPU machine; never
# required. Training throughput of the Multi30k recipe's encoder–decoder size ("base" and
# "small" in bench/mt_speed.py) and of the GPT recipe's model (bench/lm_speed.py) on the GPU, fp32
# and bf16 autocast, PyTorch's fused attention (scaled_dot_product_attention), beside Hugging
# Face's Marian and GPT-2 on the same GPU in the same run. About 5 minutes.
#   bash bench/gpu.sh                       # uses python3 and the torch already on the machine
#   PYTHON=.venv/bin/python bash bench/gpu.sh
# Records: bench/results/mt_speed.json and lm_speed.json, metrics named "... on cuda".
# Then the recipes themselves on the GPU (train.device=cuda): the numbers recipe whole (no data
# needed), and when the data is there ($QKV_DATA, else ../shared/data) one epoch of the Multi30k
# recipe and 500 steps of the GPT recipe, each printing its tokens/s in its --json summary.
# What it does not do: NCCL with several GPUs (one GPU is lent at most).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name() if ok else 'no CUDA device'); sys.exit(0 if ok else 2)"
"$PY" bench/mt_speed.py --only train --device cuda --sizes small base --steps 40 --batch 128
"$PY" bench/lm_speed.py --only train --device cuda --steps 40
OUT_DIR=$(mktemp -d)
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
