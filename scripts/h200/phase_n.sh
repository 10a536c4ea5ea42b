#!/usr/bin/env bash
# Phase N (issue 18): the thread pool's contiguous shares (070d494) on the H200 host's Xeon, at
# the full 35B shape, against the pool of equal chunks before it. The tree before the change is
# the working tree with the three files of 7384c4e put back, which the caller prepares:
#   mkdir -p phase_n_base/csrc/cpu && for f in thread_pool.cpp thread_pool.h linear_int8.cpp; do
#     git show 7384c4e:csrc/cpu/$f > phase_n_base/csrc/cpu/$f; done
# Each build in its own folder; decode tok/s (scripts/h200/decode_steps.py: 32 timed steps after
# a 16-token prompt and 4 warm-up steps) at 4 and 16 threads, new / old / new (the host drifts);
# then benchmarks/kernels/pool_bench.cpp (lm_head; 256 routed-expert matrices) at 16 threads on
# each build. Nothing carried.
#   run(command="bash scripts/h200/phase_n.sh")
source "$(dirname "$0")/cpu_env.sh"
[ -f phase_n_base/csrc/cpu/thread_pool.cpp ] || { echo "phase_n_base/ missing (see the header)"; exit 1; }
python3 scripts/make_fullsize.py "$CKPT" --workers 16 > "$OUT/make_fullsize.log" 2>&1 &
ckpt=$!
mkdir -p /tmp/pn_new
for f in thread_pool.cpp thread_pool.h linear_int8.cpp; do cp csrc/cpu/$f /tmp/pn_new/$f; done
use() {  # use new|old: put that tree's files in place
  local from=/tmp/pn_new; [ "$1" = old ] && from=phase_n_base/csrc/cpu
  for f in thread_pool.cpp thread_pool.h linear_int8.cpp; do cp "$from/$f" csrc/cpu/$f; done
}
first=1
for v in new old new; do
  use $v
  LILY_BUILD_ROOT=/tmp/build_n/$v bash scripts/dev_build.sh > "$OUT/build_$v.log" 2>&1 || { tail -30 "$OUT/build_$v.log"; exit 1; }
  if [ $first = 1 ]; then wait $ckpt || { cat "$OUT/make_fullsize.log"; exit 1; }; first=0; fi
  for t in 4 16; do
    r=$(PYTHONPATH="$root/src" python3 scripts/h200/decode_steps.py "$CKPT" --threads $t 2>&1 | tail -1)
    echo "$v: $r" | tee -a "$OUT/decode.txt"
  done
  lib=$(ls /tmp/build_n/$v/*/liblily_core.a)
  c++ -O3 -march=native -std=c++17 -ffp-contract=off -Icsrc benchmarks/kernels/pool_bench.cpp "$lib" -lpthread \
    -o /tmp/pool_bench_$v && for s in "2048 248320 16" "2048 512 16 256" "512 2048 16 256"; do
    echo "$v: $(/tmp/pool_bench_$v $s)" | tee -a "$OUT/pool_bench.txt"
  done
done
use new
