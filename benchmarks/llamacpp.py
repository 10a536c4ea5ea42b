#!/usr/bin/env python3
"""llama.cpp as the CPU peer: fetch, build and convert, cached under build/llamacpp/.

    python benchmarks/llamacpp.py build
    python benchmarks/llamacpp.py build-server
    python benchmarks/llamacpp.py convert HF_DIR OUT_DIR [--types q4_0 q8_0] [--tokenizer DIR]

Design choices:
- No llama.cpp code is committed. The source is the copy vendored in the `llama-cpp-python`
  sdist from PyPI (the only package index reachable here), pinned to one version so every run
  measures the same peer. `pip download` is told to build nothing from source but this package
  and to prepare its metadata without an isolated build env (otherwise `--no-binary :all:`
  would compile cmake itself from source as a build dependency).
- The CPU flags are spelled out instead of -DGGML_NATIVE=ON: the native build enables AMX,
  and llama.cpp's AMX matmul segfaults on these machines (REFERENCE.md). AVX-512 with VNNI,
  BF16 and VBMI is what the host has besides AMX, so the peer still gets its best SIMD path.
  OpenMP threading and the Q4_0 runtime repacking stay at llama.cpp's defaults: we measure
  llama.cpp as its users build it.
- Only the two tools the harness runs are built (llama-bench, llama-quantize), at -j2 because
  the machine is shared. A stamp file records the version and flags; a changed flag rebuilds.
- llama-server (benchmarks/serve_load.py) is built on request only, in its own build dir
  (build/llamacpp/build-server) with the same source and flags but LLAMA_BUILD_SERVER=ON, so the
  peer benchmarks neither wait for it nor see their stamp change. It serves no web UI (the UI
  options stay off: nothing is downloaded).
- Conversion uses llama.cpp's own `convert_hf_to_gguf.py` with its bundled `gguf-py` first on
  PYTHONPATH, to a bf16 GGUF (the HF source dtype of the medium model), then
  `llama-quantize` to each requested type. `--no-mtp` is passed when the checkpoint has no MTP
  layer (the converter asserts otherwise). The converter needs a Qwen3.5 tokenizer in the HF
  folder; `--tokenizer DIR` copies one in (scripts/make_tokenizer.py builds it).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python; its vendor/llama.cpp knows the qwen35moe architecture
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "llamacpp"
SRC = CACHE / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
BUILD = CACHE / "build"
BUILD_SERVER = CACHE / "build-server"
TARGETS = ("llama-bench", "llama-quantize")
SERVER_TARGETS = ("llama-server",)

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    # Explicit x86-64 SIMD instead of GGML_NATIVE (which turns on AMX: segfaults here); the
    # extensions this CPU has are added by simd_flags() (VEX AVX-VNNI on an AMD EPYC that lacks
    # it was an illegal instruction, 2026-12-01).
    "-DGGML_NATIVE=OFF",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    # CPU only, nothing fetched, nothing we do not run.
    "-DGGML_METAL=OFF", "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
]
SERVER_FLAGS = [f.replace("SERVER=OFF", "SERVER=ON") for f in CMAKE_FLAGS]


def simd_flags() -> list[str]:
    """GGML's x86 SIMD options for the extensions /proc/cpuinfo lists (the same choice as
    benchmarks/fullsize/run_llamacpp.sh)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return []
    wanted = [("avx", "AVX"), ("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"), ("bmi2", "BMI2"),
              ("avx512f", "AVX512"), ("avx512_vnni", "AVX512_VNNI"), ("avx512_bf16", "AVX512_BF16"),
              ("avx512vbmi", "AVX512_VBMI"), ("avx_vnni", "AVX_VNNI")]
    return [f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for flag, name in wanted]


@dataclass(frozen=True)
class Tools:
    bench: Path      # llama-bench
    quantize: Path   # llama-quantize
    convert: Path    # convert_hf_to_gguf.py
    gguf_py: Path    # its gguf-py package dir (goes first on PYTHONPATH)


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def fetch_source() -> Path:
    """Download the sdist (once) and unpack it; returns the llama.cpp source dir."""
    if (SRC / "CMakeLists.txt").is_file():
        return SRC
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        _log(f"downloading llama-cpp-python=={VERSION} sdist from PyPI")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--no-binary", "llama-cpp-python", "--no-build-isolation",
                        f"llama-cpp-python=={VERSION}", "-d", str(CACHE)], check=True,
                       stdout=sys.stderr)  # stdout is the source path alone (prepare_llamacpp.sh reads it)
    if not sdist.is_file():
        raise RuntimeError(f"pip download did not produce {sdist}")
    _log(f"unpacking {sdist.name}")
    with tarfile.open(sdist) as tf:
        tf.extractall(CACHE, filter="data")
    if not (SRC / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp (expected {SRC})")
    return SRC


def build(jobs: int = 2) -> Tools:
    """Configure and build llama-bench + llama-quantize (cached; rebuilt if flags change)."""
    _build(BUILD, CMAKE_FLAGS, TARGETS, jobs)
    return tools()


def build_server(jobs: int = 2) -> Path:
    """Configure and build llama-server in its own dir (cached); returns the binary."""
    _build(BUILD_SERVER, SERVER_FLAGS, SERVER_TARGETS, jobs)
    return server_binary()


def server_binary() -> Path:
    p = BUILD_SERVER / "bin" / "llama-server"
    if not p.is_file():
        raise RuntimeError(f"llama-server missing: {p} (run: python {__file__} build-server)")
    return p


def _build(build_dir: Path, flags: list[str], targets: tuple[str, ...], jobs: int) -> None:
    src = fetch_source()
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as lock:  # one build at a time (two sessions may ask)
        fcntl.flock(lock, fcntl.LOCK_EX)
        _build_locked(src, build_dir, flags, targets, jobs)


def _build_locked(src: Path, build_dir: Path, flags: list[str], targets: tuple[str, ...],
                  jobs: int) -> None:
    stamp = build_dir / "lily-stamp.json"
    want = {"version": VERSION, "flags": flags + simd_flags()}
    bins = [build_dir / "bin" / t for t in targets]
    if (all(b.is_file() for b in bins) and stamp.is_file()
            and json.loads(stamp.read_text()) == want):
        return
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    _log(f"configuring llama.cpp in {build_dir}")
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *gen, *want["flags"]],
                   check=True, stdout=subprocess.DEVNULL)
    _log(f"building {' '.join(targets)} with -j{jobs} (a few minutes)")
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *targets],
                   check=True)
    stamp.write_text(json.dumps(want, indent=1))


def tools() -> Tools:
    t = Tools(BUILD / "bin" / "llama-bench", BUILD / "bin" / "llama-quantize",
              SRC / "convert_hf_to_gguf.py", SRC / "gguf-py")
    for p in (t.bench, t.quantize, t.convert):
        if not p.exists():
            raise RuntimeError(f"llama.cpp tool missing: {p} (run: python {__file__} build)")
    return t


def _has_mtp(hf_dir: Path) -> bool:
    cfg = json.loads((hf_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    if int(text.get("mtp_num_hidden_layers", 0) or 0) > 0:
        return True
    for idx in hf_dir.glob("*.safetensors.index.json"):
        if any(k.startswith("mtp.") for k in json.loads(idx.read_text())["weight_map"]):
            return True
    for f in hf_dir.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if any(k.startswith("mtp.") for k in json.loads(fh.read(n))):
                return True
    return False


def convert(hf_dir: Path, out_dir: Path, types=("q4_0", "q8_0"), tokenizer: Path | None = None,
            jobs: int = 2) -> dict[str, Path]:
    """HF checkpoint -> {type: gguf path}; bf16 GGUF first, then llama-quantize per type.

    Cached: an existing output newer than the checkpoint's weights is reused.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    src = fetch_source()  # the converter is Python: it need not wait for the build
    if tokenizer is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (hf_dir / name).is_file():
                shutil.copyfile(Path(tokenizer) / name, hf_dir / name)
    if not (hf_dir / "tokenizer.json").is_file():
        raise RuntimeError(f"{hf_dir} has no tokenizer.json; convert_hf_to_gguf needs one "
                           f"(pass --tokenizer, built by scripts/make_tokenizer.py)")
    out_dir.mkdir(parents=True, exist_ok=True)
    newest = max(f.stat().st_mtime for f in hf_dir.glob("*.safetensors"))

    def fresh(p: Path) -> bool:
        return p.is_file() and p.stat().st_mtime > newest

    base = out_dir / "model-bf16.gguf"
    outs = {ty: out_dir / f"model-{ty}.gguf" for ty in types}
    if all(fresh(p) for p in outs.values()):
        return outs
    if not fresh(base):
        cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "bf16",
               "--outfile", str(base)]
        if not _has_mtp(hf_dir):
            cmd.append("--no-mtp")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(src / "gguf-py")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        _log(" ".join(cmd))
        subprocess.run(cmd, check=True, env=env)
    t = build(jobs)
    for ty, p in outs.items():
        if not fresh(p):
            cmd = [str(t.quantize), str(base), str(p), ty.upper(), str(jobs)]
            _log(" ".join(cmd))
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="fetch the sdist and build llama-bench + llama-quantize")
    b.add_argument("-j", "--jobs", type=int, default=2)
    bs = sub.add_parser("build-server", help="build llama-server (its own build dir)")
    bs.add_argument("-j", "--jobs", type=int, default=2)
    c = sub.add_parser("convert", help="HF checkpoint -> GGUF (bf16, then quantized types)")
    c.add_argument("hf_dir", type=Path)
    c.add_argument("out_dir", type=Path)
    c.add_argument("--types", nargs="+", default=["q4_0", "q8_0"])
    c.add_argument("--tokenizer", type=Path, help="dir with a Qwen3.5 tokenizer.json to copy in")
    c.add_argument("-j", "--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    if a.cmd == "build":
        print(build(a.jobs))
    elif a.cmd == "build-server":
        print(build_server(a.jobs))
    else:
        for ty, p in convert(a.hf_dir, a.out_dir, a.types, a.tokenizer, a.jobs).items():
            print(ty, p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
