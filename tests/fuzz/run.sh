#!/usr/bin/env bash
# Runs one fuzz target for N seconds from its committed seed corpus.
#   tests/fuzz/run.sh TARGET SECONDS [extra libFuzzer flags]
# TARGET: safetensors | json (libFuzzer, native) | config | tokenizer | template | server (atheris).
# The growing corpus lives in build/fuzz/corpus/TARGET (seeded from tests/fuzz/corpus/TARGET, so
# the committed seeds stay small); crashes are written to build/fuzz/artifacts/TARGET/. Prints
# libFuzzer's final stats (number_of_executed_units = executions). Exit status non-zero on a crash.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
target=$1 seconds=$2
shift 2
seeds="$root/tests/fuzz/corpus/$target"
work="$root/build/fuzz/corpus/$target"
art="$root/build/fuzz/artifacts/$target"
mkdir -p "$work" "$art"
flags=(-max_total_time="$seconds" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048
       -artifact_prefix="$art/" "$@" "$work" "$seeds")
case "$target" in
  safetensors|json)
    "$root/tests/fuzz/build.sh"
    exec "$root/build/fuzz/${target}_fuzz" "${flags[@]}" ;;
  config|tokenizer|template|server)
    # The lily under test is whatever python imports (installed, or src/ via PYTHONPATH in a
    # dev tree): prepending src/ here would shadow an installed build with one lacking _core.
    exec python "$root/tests/fuzz/py_targets.py" "$target" "${flags[@]}" ;;
  *) echo "unknown fuzz target '$target'" >&2; exit 2 ;;
esac
