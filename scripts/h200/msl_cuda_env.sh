# Sourced by the msl-cuda phase scripts (phase_f.sh, phase_g.sh, phase_h.sh) from the repository
# root: results folder ($OUT), a progress logger (say), the build, and the environment that runs
# the kernels as the PTX prepared here (.carry/ptx_new, carried with the call).
OUT=${OUT:-$root/.carry/out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "$(( $(date +%s) - t0 ))s $*" | tee -a "$OUT/progress"; }
export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)${LD_PRELOAD:+:$LD_PRELOAD}  # kernel_tests.sh says why
bash scripts/dev_build.sh > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH="$root/src:$root/scripts/h200" LILY_SOURCE_DIR="$root" \
  LILY_MSL_CUDA_CACHE="$root/.carry/ptx_new" PYTHONUNBUFFERED=1
say "built"
# The full Qwen3.6-35B-A3B shape with random weights, in /tmp/ckpt_full.
full_checkpoint() {
  python3 scripts/make_fullsize.py /tmp/ckpt_full --workers 16 | tail -1
  say "checkpoint"
}
