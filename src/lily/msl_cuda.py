"""MSL on CUDA: lily's Metal kernels compiled to PTX by clang and run on an NVIDIA GPU
(docs/msl-on-cuda.md). This module finds the CUDA tools of the ``nvidia-cuda-nvcc`` wheel
(libdevice for clang, ptxas for reports) and holds the commands:

    python -m lily.msl_cuda compile [--cache DIR] [--metal FILE ...]
        every kernel file of the extension to PTX in the kernel cache (DIR, else
        $LILY_MSL_CUDA_CACHE, else ~/.cache/lily/msl_cuda) as the GPU backend and the kernel
        tests make the library: local #includes inlined (the kernel templates of its headers
        with it), the backend's options (safe math for sampling; the Metal 4 *_tensor libraries
        are left out: msl_cuda has no tensor ops); --metal adds other .metal files (as tests
        load them: paths relative to the checkout).
    python -m lily.msl_cuda ptxas [--cache DIR] [--json OUT]
        assembles every PTX file of the cache for sm_90 with ``ptxas -v``: registers (and the
        threads per threadgroup they leave room for), spills and stack frame per kernel.

Carry DIR to a machine with the NVIDIA driver and no clang and point LILY_MSL_CUDA_CACHE at
it: the cache keys need no compiler to compute.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from lily._core import msl_cpu, msl_cuda

__all__ = ["compile_kernels", "cuda_kernel_files", "ptxas_path", "ptxas_report", "register_limited_threads",
           "use_wheel_toolchain"]


def _wheel_file(relative: str) -> Path | None:
    """A file of the nvidia-cuda-nvcc / nvidia-nvvm wheels (nvidia/cu13/...), if installed."""
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cuda in sorted(Path(root).glob("cu*"), reverse=True):
            if (cuda / relative).is_file():
                return cuda / relative
    return None


def use_wheel_toolchain() -> None:
    """Point the compiler at the wheel's libdevice unless LILY_LIBDEVICE is set."""
    if not os.environ.get("LILY_LIBDEVICE"):
        bc = _wheel_file("nvvm/libdevice/libdevice.10.bc")
        if bc is not None:
            os.environ["LILY_LIBDEVICE"] = str(bc)


def ptxas_path() -> str | None:
    """ptxas of the nvidia-cuda-nvcc wheel, else of PATH."""
    exe = _wheel_file("bin/ptxas")
    return str(exe) if exe is not None else shutil.which("ptxas")


def cuda_kernel_files() -> list[tuple[str, bool]]:
    """(name, safe_math) of every kernel file of the extension that msl_cuda compiles, with the
    GPU backend's options for it: all but the MSL 4.0 (Metal 4 tensor) libraries."""
    out = []
    for name in msl_cuda.kernel_files():
        language, safe_math = msl_cpu.library_options(name)
        if language != "4.0":
            out.append((name, safe_math))
    return out


def compile_kernels(metal: list[str] = (), constants: list[tuple[str, dict]] = ()) -> list[dict]:
    """Every kernel file of the extension as the backend compiles it, plus `metal` files (paths
    as tests name them, relative to the current directory) and (file, {index: (type, value)})
    function-constant specializations, into the kernel cache. Returns one record per PTX:
    {"file", "form", "path", "key", "entries"}."""
    use_wheel_toolchain()
    jobs = []
    for name, safe_math in cuda_kernel_files():
        jobs.append((f"metal/{name}", "backend", msl_cuda.kernel_source(name), {}, safe_math))
    for path in metal:
        jobs.append((path, "file", Path(path).read_text(), {}, False))
    for path, values in constants:
        jobs.append((path, f"constants {values}", Path(path).read_text(), values, False))
    out = []
    for file, form, source, values, safe_math in jobs:
        ptx, key, entries = msl_cuda.compile(source, file, constants=values, safe_math=safe_math)
        out.append({"file": file, "form": form, "path": ptx, "key": key, "entries": [e[0] for e in entries]})
    return out


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?(?:, (\d+) bytes cmem\[0\])?$")


def ptxas_report(path: str | Path, arch: str = "sm_90") -> list[dict]:
    """Assemble one PTX file with ``ptxas -v``; per kernel entry: registers, stack frame, spill
    stores and loads, static shared memory. Raises RuntimeError with ptxas's errors."""
    exe = ptxas_path()
    if exe is None:
        raise RuntimeError("no ptxas: pip install nvidia-cuda-nvcc")
    r = subprocess.run([exe, f"-arch={arch}", "-v", str(path), "-o", os.devnull],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed on {path}:\n{r.stderr[-4000:]}")
    kernels, current = [], None
    for line in r.stderr.splitlines():
        if m := _ENTRY.search(line):
            current = {"kernel": m.group(1)}
            kernels.append(current)
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _USED.search(line.strip())):
            current.update(registers=int(m.group(1)), smem=int(m.group(2) or 0))
    return kernels


def register_limited_threads(registers: int) -> int:
    """The most threads per threadgroup (CUDA block) an sm_90 SM holds at this many registers
    per thread: 64K registers, allocated per warp in units of 256 (8 per thread); at most 1024.
    On the GPU the driver's CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK is the authority."""
    per_warp = 32 * -(-max(registers, 1) // 8) * 8
    return min(1024, 32 * (65536 // per_warp))


def _source_of(ptx: Path) -> str:
    """The .metal file a cached PTX was compiled from (its second line)."""
    with open(ptx) as f:
        f.readline()
        line = f.readline()
    return line[len("// from "):].strip() if line.startswith("// from ") else "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lily.msl_cuda", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="compile every kernel to PTX into the kernel cache")
    c.add_argument("--cache", help="kernel cache folder (default: $LILY_MSL_CUDA_CACHE or ~/.cache/lily/msl_cuda)")
    c.add_argument("--metal", nargs="*", default=[], help="more .metal files, as tests name them")
    c.add_argument("--constants", nargs="*", default=[], metavar="FILE=JSON",
                   help='a specialization, e.g. tests/msl/kernels/matmul.metal=\'{"0": ["bool", true]}\'')
    r = sub.add_parser("ptxas", help="assemble every cached PTX for sm_90 and report registers, spills, stack")
    r.add_argument("--cache", help="kernel cache folder")
    r.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    if args.cache:
        os.environ["LILY_MSL_CUDA_CACHE"] = str(Path(args.cache).resolve())
    if args.command == "compile":
        specs = []
        for spec in args.constants:
            file, _, values = spec.partition("=")
            specs.append((file, {int(k): (t, float(v)) for k, (t, v) in json.loads(values).items()}))
        for rec in compile_kernels(args.metal, specs):
            print(f"{rec['path']}  {rec['file']} ({rec['form']}): {len(rec['entries'])} kernels")
        return 0
    rows = []
    for ptx in sorted(Path(msl_cuda.cache_dir()).glob("*.ptx")):
        for k in ptxas_report(ptx):
            rows.append({"file": _source_of(ptx), "ptx": ptx.name, **k})
    print(f"{'kernel':40} {'file':36} {'regs':>4} {'threads':>7} {'stack':>6} {'spill st/ld':>12} {'smem':>6}")
    for k in sorted({(r["kernel"], r["file"]): r for r in rows}.values(), key=lambda r: (r["file"], r["kernel"])):
        print(f"{k['kernel']:40} {k['file']:36} {k.get('registers', 0):4} "
              f"{register_limited_threads(k.get('registers', 0)):7} {k.get('stack', 0):6} "
              f"{k.get('spill_stores', 0):5}/{k.get('spill_loads', 0):<6} {k.get('smem', 0):6}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
