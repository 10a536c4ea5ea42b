#!/usr/bin/env bash
# A/B of the CPU backend on the H200 host's Xeon at the full 35B shape: the working tree ("new")
# against the same tree with the files under $BASE put back ("old"). The caller prepares $BASE
# with a commit's versions of the files the change touched, at their repository paths:
#   mkdir -p ab_base && for f in csrc/cpu/linear.cpp csrc/cpu/moe.cpp; do
#     mkdir -p ab_base/$(dirname $f) && git show COMMIT:$f > ab_base/$f; done
# Each build in its own folder; decode tok/s (scripts/h200/decode_steps.py: 32 timed steps after
# a 16-token prompt and 4 warm-up steps; STEPS and PROMPT change the 32 and the 16) at each of
# $THREADS (default "4 16"), the builds in the order $ORDER (default "new old new": the host
# drifts, so they alternate). With POOL_BENCH=1, also at 16 threads on each build:
# benchmarks/kernels/pool_bench.cpp (the lm_head; 256 routed-expert matrices, one a call and 18 a
# call as an MoE block calls them; in the interleaved layout where the build has it, as the
# engine reads them) and benchmarks/kernels/region_bench.cpp (a near-empty region: the pool
# alone). Nothing carried.
#   run(command="BASE=ab_base bash scripts/h200/cpu_ab.sh")
source "$(dirname "$0")/cpu_env.sh"
BASE=${BASE:-ab_base}
THREADS=${THREADS:-"4 16"}
ORDER=${ORDER:-"new old new"}
mapfile -t files < <(cd "$BASE" 2>/dev/null && find . -type f | sed 's|^\./||' | sort)
[ ${#files[@]} -gt 0 ] || { echo "$BASE/ is missing or empty (see the header)"; exit 1; }
echo "old = new with ${files[*]} from $BASE/" | tee "$OUT/ab.txt"
# The checkpoint once per machine (an earlier phase of the same call may have written it).
if [ -f "$CKPT/model.safetensors.index.json" ]; then true & else
  python3 scripts/make_fullsize.py "$CKPT" --workers 16 > "$OUT/make_fullsize.log" 2>&1 & fi
ckpt=$!
mkdir -p /tmp/ab_new
for f in "${files[@]}"; do mkdir -p "/tmp/ab_new/$(dirname "$f")" && cp "$f" "/tmp/ab_new/$f"; done
use() {  # use new|old: put that tree's versions of the files in place
  local from=/tmp/ab_new; [ "$1" = old ] && from=$BASE
  for f in "${files[@]}"; do cp "$from/$f" "$f"; done
}
first=1
for v in $ORDER; do
  use $v
  LILY_BUILD_ROOT=/tmp/build_ab/$v bash scripts/dev_build.sh > "$OUT/build_$v.log" 2>&1 || { use new; tail -30 "$OUT/build_$v.log"; exit 1; }
  if [ $first = 1 ]; then wait $ckpt || { use new; cat "$OUT/make_fullsize.log"; exit 1; }; first=0; fi
  for t in $THREADS; do
    r=$(PYTHONPATH="$root/src" python3 scripts/h200/decode_steps.py "$CKPT" --threads $t --steps "${STEPS:-32}" --prompt "${PROMPT:-16}" 2>&1 | tail -1)
    echo "$v: $r" | tee -a "$OUT/decode.txt"
  done
  [ "${POOL_BENCH:-0}" = 1 ] || continue
  lib=$(ls /tmp/build_ab/$v/*/liblily_core.a)
  c++ -O3 -march=native -std=c++17 -ffp-contract=off -Icsrc benchmarks/kernels/pool_bench.cpp "$lib" -lpthread \
    -o /tmp/pool_bench_$v && for s in "2048 248320 16 1 1" "2048 512 16 256 1" "512 2048 16 256 1" "2048 512 16 256 1 18"; do
    echo "$v: $(/tmp/pool_bench_$v $s)" | tee -a "$OUT/pool_bench.txt"
  done
  c++ -O3 -std=c++17 -pthread -Icsrc benchmarks/kernels/region_bench.cpp csrc/cpu/thread_pool.cpp \
    -o /tmp/region_bench_$v && /tmp/region_bench_$v 16 16,1024 | sed "s/^/$v: /" | tee -a "$OUT/pool_bench.txt"
done
use new
