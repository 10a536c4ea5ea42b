#!/usr/bin/env python3
"""The decode roofline: memory read bandwidth x bytes a decode step must read.

    python benchmarks/roofline.py MLX_DIR [--gguf FILE ...] [--threads 2] [--context 512]

Batch-1 decode of a MoE model does ~2 flops per weight byte-ish and reads each needed weight
once per token, so its ceiling is  tokens/s <= bandwidth / bytes_per_token.

bytes_per_token, from the checkpoint's own tensor sizes (safetensors / GGUF headers: the bytes
actually stored, scales and biases included) and the config:
    every dense tensor (attention and DeltaNet projections, norms, conv, router, shared expert,
    final norm, lm_head)                                   in full
  + the embedding table                                    one row (bytes / vocab)
  + the routed experts (switch_mlp.* / *_exps)             top_k / num_experts of their bytes
  + recurrent state read per step: DeltaNet S [Hv, Dv, Dk] fp32 and the conv window
    [K-1, C] fp32 per DeltaNet layer, and the KV cache of each attention layer at the mean
    context of the decode (prompt + n/2 tokens; lily keeps K/V in fp32, llama.cpp in f16).
State writes are not counted (the written state is the state just read, mostly still in
cache); counting fewer bytes makes the roofline higher, i.e. the percentage a harder target.

Bandwidth: benchmarks/membw.c (a streaming AVX-512 / vector-extension sum over 2 GiB or 8x the
L3, whichever is larger, best of 10 passes of plain loads and 10 with software prefetch, the better of the two), built here with
the system C compiler, run at 1 and N threads, on memory advised for 2 MiB pages (where lily's
loader puts resident weights). Since 2026-12-04: with plain loads on 4 KiB pages lily's int8
decode kernel read faster than the "roofline" (28.4 GB/s on two Zen 2 cores against 25.1).
Since 2026-12-04 (later): each reader thread times its own passes. Before, membw's main thread
read the clock around the barriers; run with as many readers as cores it was one thread too many,
and when it was scheduled late its pass looked short: two threads of the 2-core Zen 5 VM "read"
up to 137 GB/s, three times one thread's 41 (now 48-50 with busy neighbours, 80-83 without). A
best-of-N over such passes was the most inflated pass, so roofline percentages taken at N = the
machine's cores before that (the 2-core VM at 2 threads, the 16-core H200 host at 16) do not
hold (too low against the inflated pass; against the VM's true fast state, 80-85 GB/s, a run
whose best pass caught 55 read too high).

run.py also measures the bandwidth between engine runs (membw at the run's threads, 1 GiB, best
of 5; lily's worker takes its two right before and right after its decode steps, after the
prefill) and reports, next to the percentage of the session's best, the median over runs of
decode against the better of the two measurements taken just before and just after it: on a
shared host the read bandwidth moves by 1.6x from one minute to the next (the Zen 5 VM's two
threads: 48-50 or 80-83 GB/s), and a roofline measured minutes away says more about the
neighbours than about the engine. interleaved_roofline.py goes one step further (MembwServer):
single passes between lily's decode steps, the decode against their mean, not a best.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MEMBW_BIN = ROOT / "build" / "bench" / "membw"


def membw_binary() -> Path:
    """benchmarks/membw.c built for this machine (once; again when the source changes)."""
    src = HERE / "membw.c"
    if MEMBW_BIN.is_file() and MEMBW_BIN.stat().st_mtime > src.stat().st_mtime:
        return MEMBW_BIN
    MEMBW_BIN.parent.mkdir(parents=True, exist_ok=True)
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc/clang) to build benchmarks/membw.c")
    for arch in (["-march=native"], []):
        r = subprocess.run([cc, "-O3", *arch, "-pthread", str(src), "-o", str(MEMBW_BIN)],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return MEMBW_BIN
    raise RuntimeError(f"building membw failed: {r.stderr}")


def last_level_cache_mib() -> int:
    """The machine's L3, all instances together (Linux sysfs; 0 where unknown)."""
    seen, total = set(), 0
    for d in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index3"):
        try:
            key = (d / "shared_cpu_list").read_text().strip()
            size = (d / "size").read_text().strip()  # e.g. "32768K"
        except OSError:
            continue
        if key not in seen:
            seen.add(key)
            total += int(size[:-1]) >> 10 if size.endswith("K") else int(size.rstrip("M"))
    return total


def buffer_mib(at_least: int) -> int:
    """membw's buffer: at least `at_least` MiB and 8x the L3, so that little of it can be served
    from the cache. (On the H200 host, 300 MiB of L3, 1 GiB reads at 16 threads gave 139-155 GB/s
    against 104-108 over 2 GiB; over 2.4 GiB one such pass still came, 151 GB/s: not only cache.)"""
    return max(at_least, 8 * last_level_cache_mib())


def bandwidth_now(threads: int) -> float:
    """A quick read bandwidth (GB/s) at `threads`: membw over 1 GiB (or 8x the L3), best of 5
    passes (~0.3 s on the 2-core VM). What the benchmarks take just before and after a decode, as
    its paired roofline."""
    return bandwidth(threads, mib=buffer_mib(1024), passes=5)["best_GBps"]


def bandwidth(threads: int, mib: int | None = None, passes: int = 10, source: str = "huge") -> dict:
    """{'threads', 'best_GBps', 'median_GBps'} of a streaming read (membw's better mode) over `mib`
    MiB (default: 2 GiB, or 8x the L3)."""
    mib = mib or buffer_mib(2048)
    out = subprocess.run([str(membw_binary()), str(threads), str(mib), str(passes), source],
                         capture_output=True, text=True, check=True).stdout
    fields = dict(kv.split("=") for kv in out.split())
    return {"threads": threads, "best_GBps": float(fields["best_GBps"]),
            "median_GBps": float(fields["median_GBps"])}


class MembwServer:
    """membw kept running (its "serve" mode) to read its buffer once on request: passes taken
    between a decode's own steps sample the same minutes as the decode, so decode bytes/s over
    the mean of those passes is its share of the bandwidth the machine gave meanwhile. On a
    shared VM the best of a few short passes taken around the decode (bandwidth_now) is an upper
    envelope of a bandwidth that moves from pass to pass, and the decode's share of it reads low
    (docs/performance.md, "Decode against passes between its steps")."""

    MODES = ("plain", "prefetch")

    def __init__(self, threads: int, mib: int | None = None, source: str = "huge"):
        self.proc = subprocess.Popen([str(membw_binary()), str(threads), str(mib or buffer_mib(1024)), "serve",
                                      source], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("membw serve did not start")
        for mode in self.MODES:  # warm-up: the first pass of each mode faults pages in
            self.read(mode)

    def read(self, mode: str) -> tuple[float, int]:
        """One pass over the buffer, "plain" or "prefetch": (seconds, bytes)."""
        self.proc.stdin.write(mode + "\n")
        self.proc.stdin.flush()
        fields = dict(kv.split("=") for kv in self.proc.stdout.readline().split())
        if "seconds" not in fields:
            raise RuntimeError(f"membw serve: no answer to {mode!r}")
        return float(fields["seconds"]), int(fields["bytes"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait()

    def __enter__(self) -> MembwServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def interleaved_share(rounds: list[list], bytes_per_token: float) -> dict:
    """rounds: [steps, seconds, mode, pass seconds, pass bytes] of a decode whose steps alternate
    with membw passes (engines.LilyTimer.measure(interleave=...)). The roofline is the better
    read mode's mean over its passes (as membw's best takes the better mode); returns decode
    GB/s, that mean, the best single pass, and the decode as a percentage of each."""
    steps = sum(r[0] for r in rounds)
    decode_gbps = steps * bytes_per_token / sum(r[1] for r in rounds) / 1e9
    means = {}
    for mode in {r[2] for r in rounds}:
        mine = [r for r in rounds if r[2] == mode]
        means[mode] = sum(r[4] for r in mine) / sum(r[3] for r in mine) / 1e9
    best_pass = max(r[4] / r[3] for r in rounds) / 1e9
    mean = max(means.values())
    return {"decode_GBps": decode_gbps, "membw_mean_GBps": mean, "membw_best_pass_GBps": best_pass,
            "pct_of_mean": 100 * decode_gbps / mean, "pct_of_best_pass": 100 * decode_gbps / best_pass,
            "passes": len(rounds), "steps": steps}


# ---------------------------------------------------------------------------------------------
# Bytes per decode token
# ---------------------------------------------------------------------------------------------

def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def state_bytes(tc: dict, context: float, kv_elem_bytes: int) -> dict:
    """Recurrent state + KV cache read by one decode step at `context` tokens."""
    n = tc["num_hidden_layers"]
    types = tc.get("layer_types") or [
        "full_attention" if (i + 1) % tc["full_attention_interval"] == 0 else "linear_attention"
        for i in range(n)]
    n_attn = sum(t == "full_attention" for t in types)
    n_gdn = n - n_attn
    hv, dv, dk = tc["linear_num_value_heads"], tc["linear_value_head_dim"], tc["linear_key_head_dim"]
    conv_c = 2 * tc["linear_num_key_heads"] * dk + hv * dv
    gdn = n_gdn * (hv * dv * dk * 4 + (tc["linear_conv_kernel_dim"] - 1) * conv_c * 4)
    kv = n_attn * 2 * tc["num_key_value_heads"] * tc["head_dim"] * context * kv_elem_bytes
    return {"deltanet_state": gdn, "kv_cache": int(kv)}


def _safetensors_sizes(path: Path) -> dict[str, tuple[int, list[int]]]:
    """{name: (bytes, shape)} from the headers of every *.safetensors file in `path`."""
    sizes = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            for k, v in json.loads(fh.read(n)).items():
                if k != "__metadata__":
                    b, e = v["data_offsets"]
                    sizes[k] = (e - b, v["shape"])
    if not sizes:
        raise RuntimeError(f"no safetensors tensors in {path}")
    return sizes


def _weight_bytes(sizes: dict, is_embedding, is_expert, vocab: int, k: int, e: int) -> dict:
    out = {"embedding_row": 0.0, "experts_topk": 0.0, "lm_head": 0.0, "dense": 0.0,
           "all_weights": 0.0}
    for name, nbytes in sizes.items():
        out["all_weights"] += nbytes
        if is_embedding(name):
            out["embedding_row"] += nbytes / vocab
        elif is_expert(name):
            out["experts_topk"] += nbytes * k / e
        elif "lm_head" in name or name.startswith("output."):
            out["lm_head"] += nbytes
        else:
            out["dense"] += nbytes
    return out


def decode_bytes_mlx(path: Path, context: float, kv_elem_bytes: int = 4) -> dict:
    """Bytes one decode step reads, for lily / mlx-lm on an MLX checkpoint folder."""
    path = Path(path)
    tc = _text_config(json.loads((path / "config.json").read_text()))
    sizes = {k: v[0] for k, v in _safetensors_sizes(path).items()}
    w = _weight_bytes(sizes, lambda n: "embed_tokens" in n,
                      lambda n: ".switch_mlp." in n or ".experts." in n,
                      tc["vocab_size"], tc["num_experts_per_tok"], tc["num_experts"])
    w.update(state_bytes(tc, context, kv_elem_bytes))
    return _total(w)


def decode_bytes_gguf(path: Path, config_dir: Path, context: float, kv_elem_bytes: int = 2) -> dict:
    """Bytes one decode step reads, for llama.cpp on a GGUF file (types as stored)."""
    import llamacpp

    sys.path.insert(0, str(llamacpp.SRC / "gguf-py"))
    from gguf import GGUFReader

    tc = _text_config(json.loads((Path(config_dir) / "config.json").read_text()))
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    w = _weight_bytes(sizes, lambda n: n.startswith("token_embd"),
                      lambda n: re.search(r"_exps\b", n) is not None,
                      tc["vocab_size"], tc["num_experts_per_tok"], tc["num_experts"])
    w.update(state_bytes(tc, context, kv_elem_bytes))
    return _total(w)


def _total(w: dict) -> dict:
    w["per_token"] = (w["embedding_row"] + w["experts_topk"] + w["lm_head"] + w["dense"]
                      + w["deltanet_state"] + w["kv_cache"])
    return w


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mlx_dir", type=Path)
    ap.add_argument("--gguf", type=Path, nargs="*", default=[])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=float, default=512 + 64)
    a = ap.parse_args(argv)
    bw = {t: bandwidth(t) for t in sorted({1, a.threads})}
    for t, b in bw.items():
        print(f"bandwidth {t} thread(s): best {b['best_GBps']:.2f} GB/s, median {b['median_GBps']:.2f}")
    rows = [("lily (MLX 4-bit)", decode_bytes_mlx(a.mlx_dir, a.context))]
    rows += [(g.name, decode_bytes_gguf(g, a.mlx_dir, a.context)) for g in a.gguf]
    for name, w in rows:
        parts = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in w.items() if k != "all_weights")
        print(f"{name}: {parts}; roofline at {a.threads} threads "
              f"{bw[a.threads]['best_GBps'] * 1e9 / w['per_token']:.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
