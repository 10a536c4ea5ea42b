#!/usr/bin/env bash
# Type-check the Objective-C++ Metal host (csrc/metal/*.mm) on Linux: clang -fsyntax-only
# (manual reference counting, as the CMake build compiles it) against GNUstep's Foundation headers (Debian: libgnustep-base-dev, which brings the GNU
# Objective-C runtime headers) and tests/metal_host/Metal/Metal.h, our declarations of Apple's
# Metal API. This catches wrong selectors, argument types, nullability and C++ errors; it does
# not run anything (that needs a Mac).
#   scripts/check_metal_host.sh [files.mm ...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
clang=${LILY_CLANG:-$(command -v clang-19 || command -v clang || true)}
[ -n "$clang" ] || { echo "check_metal_host: no clang (apt-get install clang-19)" >&2; exit 2; }
gnustep=/usr/include/GNUstep
[ -f "$gnustep/Foundation/Foundation.h" ] || {
  echo "check_metal_host: GNUstep Foundation headers missing (apt-get install libgnustep-base-dev)" >&2; exit 2; }
# The GNU runtime's <objc/objc.h> lives in gcc's private include directory.
objc_dir=$(dirname "$(dirname "$(find /usr/lib/gcc -path '*/include/objc/objc.h' 2>/dev/null | sort | tail -1)")")
[ -n "$objc_dir" ] && [ "$objc_dir" != "." ] || {
  echo "check_metal_host: GNU Objective-C runtime headers missing (apt-get install libobjc-12-dev)" >&2; exit 2; }

files=("$@")
[ ${#files[@]} -gt 0 ] || files=("$root"/csrc/metal/*.mm)
status=0
for f in "${files[@]}"; do
  # -fobjc-runtime=gcc: Debian's GNUstep is built on gcc's runtime, whose headers only parse
  # in that mode.
  if "$clang" -fsyntax-only -x objective-c++ -std=c++17 -fblocks \
      -fobjc-runtime=gcc -DGNUSTEP -DGNUSTEP_BASE_LIBRARY=1 -DGNU_RUNTIME=1 \
      -Wall -Wextra -Wno-unused-parameter -Werror=objc-method-access -Werror=incompatible-pointer-types \
      -Werror=nullability -Werror=objc-protocol-method-implementation \
      -I "$root/tests/metal_host" -I "$root/csrc" -I "$root" -isystem "$gnustep" -idirafter "$objc_dir" \
      "$f"; then
    echo "check_metal_host: $f OK"
  else
    status=1
  fi
done
exit $status
