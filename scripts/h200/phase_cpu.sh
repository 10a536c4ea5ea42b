# Sourced by the CPU-side phase scripts that run in the background on the H200 machine
# (phase_e.sh, phase_j.sh, phase_o.sh, phase_p.sh) from the repository root, with W (the
# phase's work folder) set.
# `bash phase_X.sh collect` calls phase_collect and exits; otherwise phase_start makes the work
# folder and records the host. say appends a timestamped line to $W/progress, what the polling
# calls print.
say() { echo "$(date +%T) $*" >> "$W/progress"; }

# phase_collect FILE...: the progress log, FILEs and a tarball of $W (model files left out) into
# $OUT, the folder a call brings back (8 files at most).
phase_collect() {
  OUT=${OUT:-$root/.carry/out}
  mkdir -p "$OUT"
  cp "$W"/progress "$@" "$OUT/" 2>/dev/null
  tar -czf "$OUT/$(basename "$W").tar.gz" -C "$W" --exclude='*.gguf' --exclude='*.safetensors' .
  ls -l "$OUT"
}

phase_start() {
  mkdir -p "$W"
  say "start"
  { lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L3"; free -g | head -2; } > "$W/env.txt" 2>&1
  export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)${LD_PRELOAD:+:$LD_PRELOAD}  # kernel_tests.sh says why
}
