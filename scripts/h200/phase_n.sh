#!/usr/bin/env bash
# Phase N (issue 18): the thread pool's contiguous shares (070d494) on the H200 host's Xeon, at
# the full 35B shape, against the pool of equal chunks before it: scripts/h200/cpu_ab.sh with the
# three files of 7384c4e as the old tree, and pool_bench. The caller prepares them:
#   mkdir -p phase_n_base/csrc/cpu && for f in thread_pool.cpp thread_pool.h linear_int8.cpp; do
#     git show 7384c4e:csrc/cpu/$f > phase_n_base/csrc/cpu/$f; done
#   run(command="bash scripts/h200/phase_n.sh")
BASE=phase_n_base POOL_BENCH=1 exec bash "$(dirname "$0")/cpu_ab.sh"
