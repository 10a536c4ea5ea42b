#!/usr/bin/env bash
# Phase E: the full-size server table (issue 19) on the H200 machine's 16 CPU cores: C concurrent
# streamed greedy chat clients against `lily serve` (CPU backend, default matmul mode,
# --max-batch 8) and llama.cpp's `llama-server` (-np C, continuous batching), both at 16 threads,
# on random weights of the Qwen3.6-35B-A3B shape (lily: scripts/make_fullsize.py, MLX 4-bit;
# llama.cpp: benchmarks/fullsize/make_gguf.py, Q4_0 -- independent random weights of the same
# shapes, as in phase D), through benchmarks/serve_load.py --size full. No GPU is used.
# Prepared HERE first (the device has no network):
#   - scripts/h200/prepare_llamacpp.sh    -> .carry/llama (llama.cpp source with the server, GGUF template)
#   - .carry/whl_srv: the server extra's wheels for Python 3.12 (starlette, uvicorn, sse-starlette,
#     jsonschema and its needs, anyio, typing_extensions; the device README's pip download line)
#   - .carry/tok: the real-vocabulary tokenizer (tokenizer.json.xz, tokenizer_config.json) of
#     benchmarks/checkpoints.py, the one the GGUF template carries too
# Calls (a machine is given back 30 s after a call ends, so they follow each other at once):
#   run(command="setsid bash scripts/h200/phase_e.sh > /tmp/phase_e.out 2>&1 < /dev/null & sleep 540; cat /tmp/phase_e/progress",
#       carry=[".carry/llama", ".carry/whl_srv", ".carry/tok"])
#   run(command="sleep 540; cat /tmp/phase_e/progress")      # until "done"
#   run(command="bash scripts/h200/phase_e.sh collect")      # results into $OUT
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
W=${W:-/tmp/phase_e}
CLIENTS=${CLIENTS:-1,2,4,8}
source scripts/h200/phase_cpu.sh
if [ "${1:-}" = collect ]; then
  phase_collect "$W"/serve_full.*
  exit 0
fi
phase_start
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_srv \
  .carry/whl_srv/*.whl > "$W/pip.log" 2>&1 || { say "pip failed: $(tail -2 "$W/pip.log")"; exit 1; }
export PYTHONPATH="$root/src:/tmp/site_srv" PYTHONUNBUFFERED=1

# 1. Both servers' builds at once, then both model files (the writers are I/O-bound).
bench=/tmp/bench/full
mkdir -p "$bench/hf" "$bench/gguf"
bash scripts/dev_build.sh > "$W/build.log" 2>&1 &
lily_pid=$!
OUT="$W/llama" SERVER=1 MODE=setup BUDGET_S=900 GGUF="$bench/gguf/model-q4_0.gguf" \
  bash benchmarks/fullsize/run_llamacpp.sh > "$W/llama_setup.log" 2>&1
say "llama.cpp setup rc=$?: $(grep -h build_s "$W"/llama/*build.log 2>/dev/null | tail -1)"
wait "$lily_pid" || { say "lily build failed"; tail -30 "$W/build.log" >> "$W/progress"; exit 1; }
say "lily built"
python3 scripts/make_fullsize.py "$bench/mlx4" --workers 12 > "$W/make_fullsize.log" 2>&1
say "checkpoint: $(tail -1 "$W/make_fullsize.log")"
xz -dc .carry/tok/tokenizer.json.xz > "$bench/hf/tokenizer.json" && cp .carry/tok/tokenizer_config.json "$bench/hf/"
python3 -c "import lily, starlette, uvicorn, sse_starlette, jsonschema; print(lily.__file__)" >> "$W/progress" 2>&1

# 2. The table.
timeout 1500 python3 benchmarks/serve_load.py --root /tmp/bench --size full --clients "$CLIENTS" --requests 2 \
  --threads 16 --llama-server /tmp/llamacpp/build/bin/llama-server --quiet-wait 5 --logs "$W/logs" \
  --json "$W/serve_full.json" --markdown "$W/serve_full.md" > "$W/serve_load.log" 2>&1
say "serve_load rc=$?"
cat "$W/serve_full.md" >> "$W/progress" 2>/dev/null || tail -20 "$W/serve_load.log" >> "$W/progress"
say "done"
