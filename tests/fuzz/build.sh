#!/usr/bin/env bash
# Builds the libFuzzer targets (clang-19, -fsanitize=fuzzer,address,undefined) into build/fuzz/.
# Each links only the core sources it parses with; no Python, no nanobind.
#   tests/fuzz/build.sh            # all targets
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out="$root/build/fuzz"
mkdir -p "$out"
cxx=${CXX_FUZZ:-clang++-19}
flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=undefined -I"$root/csrc")
m="$root/csrc/model"
build() {  # name sources...
  local name=$1; shift
  if [ "$out/$name" -nt "$root/tests/fuzz/$name.cpp" ] && [ -z "$(find "$m" -newer "$out/$name" -name '*.[ch]*')" ]; then
    return
  fi
  "$cxx" "${flags[@]}" "$root/tests/fuzz/$name.cpp" "$@" -o "$out/$name"
}
build json_fuzz "$m/json.cpp" &
build safetensors_fuzz "$m/safetensors.cpp" "$m/pages.cpp" "$m/json.cpp" "$m/weights.cpp" "$m/config.cpp" "$m/file_watch.cpp"
wait
