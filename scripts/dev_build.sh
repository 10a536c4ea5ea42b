#!/usr/bin/env bash
# Developer build without pip: configure + build lily._core into build/dev and drop the
# extension next to the Python sources, so `PYTHONPATH=src python -m pytest` uses this tree.
#   scripts/dev_build.sh [extra cmake args, e.g. -DLILY_SANITIZE=ON]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build/dev"
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$build" -j "$(nproc)"
cp -f "$build"/_core*.so "$root/src/lily/"
cp -f "$build"/_core.pyi "$root/src/lily/" 2>/dev/null || true
