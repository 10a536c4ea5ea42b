#!/usr/bin/env bash
# Phase L (issue 18): why a decode thread of the int8 row kernels streams a half to a third of a
# membw thread on the H200 host's Xeon (phase J's thread sweep). The kernels' software prefetch
# was tuned on the CI-class AMD EPYC (csrc/cpu/linear_int8.cpp: prefetcht1, about 8 rows
# ahead); this sweeps it by build-time overrides (LILY_PREFETCH_LOCALITY: 0 = prefetchnta,
# 1 = t2, 2 = t1, 3 = t0; LILY_PREFETCH_ROWS: the distance in rows, 0 = the current line only, i.e.
# none ahead), each variant built in its own folder, at the full 35B shape: decode tok/s at 4 and
# 16 threads (scripts/h200/decode_steps.py: 32 timed steps after a 16-token prompt and 4 warm-up
# steps), the default built first and again last to show the host's drift; then the read
# roofline (benchmarks/roofline.py at 4 and 16 threads). Nothing carried.
#   run(command="bash scripts/h200/phase_l.sh")
source "$(dirname "$0")/cpu_env.sh"
python3 scripts/make_fullsize.py "$CKPT" --workers 16 > "$OUT/make_fullsize.log" 2>&1 &
ckpt=$!
variants=${VARIANTS:-"2:8 3:8 3:5 2:16 2:0 0:8 2:8"}  # locality:rows; the default first and last
first=1
for v in $variants; do
  loc=${v%%:*} rows=${v##*:}
  CXXFLAGS="-DLILY_PREFETCH_LOCALITY=$loc -DLILY_PREFETCH_ROWS=$rows" LILY_BUILD_ROOT=/tmp/build_l/$loc-$rows \
    bash scripts/dev_build.sh > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  if [ $first = 1 ]; then wait $ckpt || { cat "$OUT/make_fullsize.log"; exit 1; }; first=0; fi
  for t in 4 16; do
    r=$(PYTHONPATH="$root/src" python3 scripts/h200/decode_steps.py "$CKPT" --threads $t 2>&1 | tail -1)
    echo "locality $loc rows $rows: $r" | tee -a "$OUT/sweep.txt"
  done
done
for t in 4 16; do
  python3 benchmarks/roofline.py "$CKPT" --threads $t --context 52 > "$OUT/roofline_t$t.txt" 2>&1
  tail -3 "$OUT/roofline_t$t.txt"
done
