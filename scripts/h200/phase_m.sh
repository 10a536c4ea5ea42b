#!/usr/bin/env bash
# Phase M: one device call (issue 16 §2, "several sequences per dispatch") on the H200 through
# msl-cuda, at the full Qwen3.6-35B-A3B shape (random weights, scripts/make_fullsize.py):
#   1. batched decode steps (benchmarks/batch_decode.py --check): each step of B = 1, 2, 4, 7
#      sequences of ~4K context checked bit for bit against the sequences decoded alone, and
#      timed: the mixers one dispatch per kernel for all B sequences (sequence tables, "tables"),
#      against the same build with backend_options per_sequence_mixers (one dispatch per
#      sequence, as before the tables: "each"), alternated tables / each / tables;
#   2. the device loop over the same B (--device-loop --check: its tokens against the host loop's);
#   3. one sequence against the CPU backend at a 512-token prompt (scripts/h200/fullsize.py
#      --check-max 512): the kernels reach the cache and state by address, through a one-entry
#      table.
# Prepared HERE first (needs clang-19): the backend kernels as PTX, archived (the call's carry
# limit is 64 MiB with the tree):
#   PYTHONPATH=src LILY_SOURCE_DIR=$PWD LILY_MSL_CUDA_CACHE=$PWD/.carry/ptx_new.build python -m lily.msl_cuda compile
#     (then the *.ptx into .carry/ptx_new);  tar -cJf .carry/phase_m.tar.xz -C .carry ptx_new
#   run(command="bash scripts/h200/phase_m.sh", carry=[".carry/phase_m.tar.xz"])
# `phase_m.sh sanitize` instead runs compute-sanitizer (memcheck, synccheck, racecheck) over
# batched steps of 3 and 7 sequences on a 4-layer model of the real per-layer shapes (the
# kernels read every cache and state through the tables' addresses), once with the contiguous
# cache and once with the fixed-block layout (block_threshold 16, block_len 8).
# H200 figures of kernels written for Apple GPUs (Apple figures unverified): they compare two
# dispatch plans of the same kernels on one real GPU.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
[ -f .carry/phase_m.tar.xz ] && tar -xJf .carry/phase_m.tar.xz -C .carry
source scripts/h200/msl_cuda_env.sh
res=/tmp/phase_m  # the results, one archive in $OUT whenever the call ends (a call returns at most 8 files)
mkdir -p "$res"
trap 'tar -czf "$OUT/phase_m.tar.gz" -C /tmp phase_m' EXIT
if [ "${1:-}" = sanitize ]; then
  python3 scripts/make_fullsize.py /tmp/ckpt_small --layers 4 --experts 8 --vocab 4096 --workers 16 | tail -1
  san() {  # san NAME TOOL BATCHES [batch_decode.py args...]
    local name=$1 tool=$2 batches=$3; shift 3
    timeout 150 compute-sanitizer --tool "$tool" --print-limit 20 python3 benchmarks/batch_decode.py \
      --model /tmp/ckpt_small --backend msl-cuda --batch "$batches" --context 40 --steps 2 --warmup 1 --check "$@" \
      > "$res/sanitize_$name.log" 2>&1
    say "$name rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|bit-identical|^\| [0-9]" "$res/sanitize_$name.log" | tail -4
  }
  san memcheck memcheck 3,7
  san memcheck_blocks memcheck 3,7 --backend-options '{"block_threshold": 16, "block_len": 8}'
  san synccheck synccheck 3,7
  san racecheck racecheck 3
  exit 0
fi
full_checkpoint
batch() {  # batch NAME [batch_decode.py args...]
  local name=$1; shift
  timeout 200 python3 benchmarks/batch_decode.py --model /tmp/ckpt_full --backend msl-cuda --batch 1,2,4,7 \
    --context 4096 --check --json "$res/batch_$name.json" "$@" > "$res/batch_$name.log" 2>&1
  say "batch $name rc=$?"; tail -7 "$res/batch_$name.log"
}
batch tables
batch each --backend-options '{"per_sequence_mixers": true}'
batch tables2
batch loop --device-loop
timeout 200 python3 scripts/h200/fullsize.py /tmp/ckpt_full --contexts 512 --check-max 512 --decode 8 \
  --threads 16 --timing-prefill 0 --out "$res/fullsize" > "$res/fullsize.log" 2>&1
say "fullsize rc=$?"; grep -E "^\|" "$res/fullsize/fullsize.md" | head -6
