#!/usr/bin/env bash
# The main job on a fresh machine: install lily, make a tiny random-weight checkpoint of the
# real Qwen3.6-MoE architecture, load it and generate. Pass a model folder to use it instead.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q .
model=${1:-}
if [ -z "$model" ]; then
  python -m pip install -q "torch==2.13.0" transformers
  model=$(mktemp -d)/tiny-qwen3_5_moe
  python scripts/make_checkpoint.py --model-type qwen3_5_moe --size tiny --out "$model"
fi
python examples/generate_tokens.py "$model"
