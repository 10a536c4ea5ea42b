#!/usr/bin/env bash
# Issue 17, phase B run 2. Run ON THE H200 MACHINE, after scripts/h200/prepare.sh here filled
# .carry/ptx: the whole Qwen3.6-35B-A3B shape through the Metal path on msl-cuda
# (scripts/h200/fullsize.py: 512 / 4K / 32K contexts against the CPU backend, per-kernel GPU
# times), then compute-sanitizer's memcheck, racecheck and synccheck over a 4-layer model with
# the real per-layer shapes (8 experts, vocab 4096). Each step has its own time limit.
#   run(command="bash scripts/h200/phase_b.sh", carry=[".carry"], timeout_s=600)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
OUT=${OUT:-$root/.carry/out}   # gets phase_b.tar.gz (everything) and fullsize.md
W=/tmp/phase_b                   # a device call returns a few files: the work stays here
CONTEXTS=${CONTEXTS:-512,4096,32768}
mkdir -p "$OUT" "$W"
trap 'tar -czf "$OUT/phase_b.tar.gz" -C "$W" . ; cp "$W/full/fullsize.md" "$OUT/" 2>/dev/null' EXIT
# One libstdc++ for the process (kernel_tests.sh says why).
export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)${LD_PRELOAD:+:$LD_PRELOAD}
t=$(date +%s)
bash scripts/dev_build.sh > "$W/build.log" 2>&1 || { tail -40 "$W/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t )) s"
export PYTHONPATH="$root/src" LILY_SOURCE_DIR="$root" LILY_MSL_CUDA_CACHE="$root/.carry/ptx" PYTHONUNBUFFERED=1
python3 scripts/make_fullsize.py /tmp/ckpt_full --workers 16 2>&1 | tail -1
timeout "${FULL_S:-300}" python3 scripts/h200/fullsize.py /tmp/ckpt_full --contexts "$CONTEXTS" --threads 16 \
  --out "$W/full" 2>&1 | tee "$W/fullsize.log" | tail -40
echo "fullsize rc=${PIPESTATUS[0]} at $(( $(date +%s) - t )) s"
python3 scripts/make_fullsize.py /tmp/ckpt_small --layers 4 --experts 8 --vocab 4096 --workers 16 2>&1 | tail -1
for tool in ${TOOLS:-memcheck racecheck synccheck}; do
  timeout "${SANITIZER_S:-60}" compute-sanitizer --tool "$tool" --print-limit 20 python3 scripts/h200/fullsize.py \
    /tmp/ckpt_small --contexts 40 --decode 3 --check-max 0 --timing-prefill 8 --out "$W/$tool" \
    > "$W/sanitizer_$tool.log" 2>&1
  echo "$tool rc=$? at $(( $(date +%s) - t )) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$W/sanitizer_$tool.log" | tail -1)"
done
