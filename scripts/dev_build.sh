#!/usr/bin/env bash
# Developer build without pip: configure + build lily._core and drop the extension (and its type
# stub) next to the Python sources, so `PYTHONPATH=src python -m pytest` uses this tree.
#   scripts/dev_build.sh [--configure-only] [extra cmake args, e.g. -DLILY_SANITIZE=ON]
#
# Prerequisites: a C++17 compiler (gcc or clang; Apple clang on macOS), and in the Python that
# `python` runs (the active virtual environment, or $PYTHON): nanobind, cmake and ninja. Those
# three are pip-installed into that Python when missing.
#
# The build folder is keyed on the interpreter: build/dev/<ABI tag>-<hash of sys.prefix>. After
# switching virtual environments (or Python versions) the next run configures a fresh folder for
# the new interpreter instead of reusing a CMake cache that names the old one; switching back
# reuses the old folder, incrementally. Extensions for other ABIs already in src/lily are left:
# each Python imports the one with its own tag. LILY_BUILD_ROOT moves build/dev elsewhere.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
configure_only=0
if [ "${1:-}" = --configure-only ]; then configure_only=1; shift; fi

py=${PYTHON:-python}
command -v "$py" >/dev/null || py=python3
exe=$("$py" -c 'import sys; print(sys.executable)')
bindir=$(dirname "$exe")

# Prerequisites, installed into this interpreter when missing.
missing=()
"$exe" -c 'import nanobind' 2>/dev/null || missing+=("nanobind>=2.4")
{ [ -x "$bindir/cmake" ] || command -v cmake >/dev/null; } || missing+=("cmake>=3.18")
{ [ -x "$bindir/ninja" ] || command -v ninja >/dev/null; } || missing+=(ninja)
if [ ${#missing[@]} -gt 0 ]; then
  echo "dev_build: installing ${missing[*]} into $exe" >&2
  "$exe" -m pip install -q "${missing[@]}"
fi
# The interpreter's own tools first (a venv's cmake/ninja), then PATH.
export PATH="$bindir:$PATH"

key=$("$exe" -c 'import hashlib, os, sys, sysconfig
tag = sysconfig.get_config_var("SOABI") or "py%d%d" % sys.version_info[:2]
print(tag + "-" + hashlib.sha1(os.path.abspath(sys.prefix).encode()).hexdigest()[:8])')
build="${LILY_BUILD_ROOT:-$root/build/dev}/$key"
echo "dev_build: $exe -> $build" >&2

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$exe" "$@" >/dev/null
[ "$configure_only" = 1 ] && exit 0
cmake --build "$build" -j "$(nproc 2>/dev/null || sysctl -n hw.ncpu)"
ext=$("$exe" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
cp -f "$build/_core$ext" "$root/src/lily/"
cp -f "$build/_core.pyi" "$root/src/lily/" 2>/dev/null || true
