# Sourced by the CPU phases (phase_l.sh, phase_n.sh): the repository root as the working
# directory, the full-size checkpoint's path (CKPT), the output folder (OUT: the device's $OUT
# when run there), libstdc++ preloaded (kernel_tests.sh says why) and the host's CPU in env.txt.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
CKPT=/tmp/qwen36-35b-a3b-random
OUT=${OUT:-$root/.carry/out}
mkdir -p "$OUT"
export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)${LD_PRELOAD:+:$LD_PRELOAD}
{ lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L2|L3"; } > "$OUT/env.txt" 2>&1
