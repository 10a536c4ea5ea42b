"""Full-size Qwen3.6-35B-A3B on lily's CPU backend: load time, memory, prefill and decode speed.

Run by benchmarks/fullsize/run.sh on the checkpoint scripts/make_fullsize.py wrote (random
weights, exact release layout). Each figure is appended to results.json / results.md as soon as
it is measured, so a run cut short by its time limit still reports what it got.

Memory is read from /proc/self/status: RssFile is the memory-mapped checkpoint pages touched so
far (shared, evictable page cache), RssAnon is what the engine itself allocated (scratch, KV
cache, recurrent state). A sampler thread records the peak of both during each prefill (the
engine releases the GIL while it computes), which is how "temporaries do not grow with the
prompt" is checked: peak RssAnon minus the KV cache must stay flat from 512 to 4K tokens.

Contexts are run smallest first; before each one the time it would take is extrapolated from
the last measured prefill rate, and contexts that would not finish before --deadline are
recorded as skipped, with the estimate.

    python benchmarks/fullsize/bench.py CHECKPOINT --threads 16 --out DIR [--contexts 512,4096,32768]
        [--decode 16] [--membw]

--membw brackets each timed decode with a quick membw at the same threads (benchmarks/
roofline.py, bandwidth_now) and reports decode against the better of the two: the roofline of
the decode's own seconds on a host whose bandwidth moves with its neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/
import roofline  # noqa: E402


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out


class PeakSampler:
    """Peak RssAnon / VmRSS while a block runs, sampled every 10 ms from a thread."""

    def __enter__(self):
        self.peak = proc_status()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.01):
            s = proc_status()
            for k, v in s.items():
                self.peak[k] = max(self.peak.get(k, 0), v)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        s = proc_status()
        for k, v in s.items():
            self.peak[k] = max(self.peak.get(k, 0), v)


def gb(x: int) -> float:
    return round(x / 1e9, 3)


def machine() -> dict:
    info = {"python": platform.python_version(), "cores": os.cpu_count()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                info["mem_gb"] = round(int(line.split()[1]) * 1024 / 1e9, 1)
    except OSError:
        pass
    return info


class Report:
    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data: dict = {"machine": machine(), "rows": [], "skipped": [], "notes": []}

    def save(self):
        (self.out / "results.json").write_text(json.dumps(self.data, indent=2))
        d = self.data
        lines = [f"machine: {d['machine']}", f"threads: {d.get('threads')}, cpu_matmul: {d.get('cpu_matmul')}", ""]
        if "load" in d:
            ld = d["load"]
            lines.append(
                f"load: {ld['seconds']:.2f} s; RSS after load {ld['rss_gb']} GB "
                f"(anon {ld['anon_gb']} GB, file-backed {ld['file_gb']} GB); checkpoint {ld['checkpoint_gb']} GB"
            )
        paired = any("bw_GBps" in r for r in d["rows"])
        extra = " decode % paired roofline (GB/s) |" if paired else ""
        lines += ["", "| context | prefill tok/s | prefill s | decode tok/s | peak RSS GB | peak anon GB | anon after GB |"
                  + extra, "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if paired else "")]
        for r in d["rows"]:
            cell = (f" {r['decode_pct_paired_roofline']:.0f} ({r['bw_GBps']:.1f}) |" if "bw_GBps" in r else " |"
                    ) if paired else ""
            lines.append(
                f"| {r['context']} | {r['prefill_tok_s']:.1f} | {r['prefill_s']:.1f} | "
                f"{r.get('decode_tok_s', float('nan')):.2f} | {r['peak_rss_gb']} | {r['peak_anon_gb']} | "
                f"{r.get('anon_after_gb', '')} |" + cell
            )
        for s in d["skipped"]:
            lines.append(f"skipped: {s}")
        for n in d["notes"]:
            lines.append(f"note: {n}")
        (self.out / "results.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines[-3:]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--decode", type=int, default=16, help="decode steps after each prefill")
    ap.add_argument("--chunk", type=int, default=512, help="prefill_chunk")
    ap.add_argument("--deadline", type=float, default=0, help="unix time by which to stop (0: none)")
    ap.add_argument("--cpu-matmul", default="auto", choices=("auto", "f32", "int8"),
                    help="Model.load(cpu_matmul=...): auto (the default: int8 where the CPU has the integer "
                         "kernels), f32, or int8 activations for quantized matmuls")
    ap.add_argument("--use-mmap", default="auto", choices=("auto", "true", "false"),
                    help="Model.load(use_mmap=...): auto (None), mapped (true) or read into memory (false)")
    ap.add_argument("--membw", action="store_true",
                    help="bracket each timed decode with membw at --threads (benchmarks/roofline.py's "
                         "bandwidth_now) and report decode as a percentage of that paired roofline")
    a = ap.parse_args()

    import lily

    rep = Report(a.out)
    rep.data["threads"] = a.threads
    rep.data["prefill_chunk"] = a.chunk
    rep.data["cpu_matmul"] = a.cpu_matmul
    use_mmap = {"auto": None, "true": True, "false": False}[a.use_mmap]
    rep.data["lily_version"] = getattr(lily, "__version__", "?")
    ck_bytes = sum(f.stat().st_size for f in a.checkpoint.glob("*.safetensors"))

    before = proc_status()
    t0 = time.perf_counter()
    model = lily.Model.load(a.checkpoint, backend="cpu", threads=a.threads, prefill_chunk=a.chunk,
                            cpu_matmul=a.cpu_matmul, use_mmap=use_mmap)
    rep.data["weights_resident"] = bool(model._weights.resident)
    rep.data["cpu_matmul"] = model._engine.cpu_matmul  # the mode that ran ("auto" resolved)
    rep.data["cpu_matmul_asked"] = a.cpu_matmul
    load_s = time.perf_counter() - t0
    s = proc_status()
    rep.data["load"] = {
        "seconds": load_s, "rss_gb": gb(s["VmRSS"]), "anon_gb": gb(s["RssAnon"]), "file_gb": gb(s["RssFile"]),
        "rss_before_gb": gb(before["VmRSS"]), "checkpoint_gb": gb(ck_bytes), "repr": repr(model),
    }
    rep.save()

    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    rate = None  # last prefill tokens/s
    deadline = a.deadline or float("inf")

    def prefill_decode(ctx: int, label: str) -> dict:
        ids = rng.integers(0, min(vocab, 248_044), size=ctx).astype(np.int32)
        sess = model.session(max_context=ctx + a.decode + 1)
        with PeakSampler() as peak:
            t = time.perf_counter()
            logits = sess.prefill(ids)
            pre_s = time.perf_counter() - t
        row = {
            "context": label, "tokens": ctx, "prefill_s": pre_s, "prefill_tok_s": ctx / pre_s,
            "peak_rss_gb": gb(peak.peak["VmRSS"]), "peak_anon_gb": gb(peak.peak["RssAnon"]),
            "finite": bool(np.isfinite(logits).all()),
        }
        if a.decode:
            tok = int(np.argmax(logits))
            sess.decode(tok)  # first step after prefill may grow the KV cache; not timed
            bw_before = roofline.bandwidth_now(a.threads) if a.membw else None
            t = time.perf_counter()
            for _ in range(a.decode):
                tok = int(np.argmax(sess.decode(tok)))
            row["decode_tok_s"] = a.decode / (time.perf_counter() - t)
            if a.membw:  # the decode's own roofline: the better of the two bandwidths around it
                row["bw_GBps"] = max(bw_before, roofline.bandwidth_now(a.threads))
                per_token = roofline.decode_bytes_mlx(a.checkpoint, ctx + 1 + a.decode / 2)["per_token"]
                row["decode_pct_paired_roofline"] = 100 * row["decode_tok_s"] * per_token / (row["bw_GBps"] * 1e9)
        st = proc_status()
        row["rss_after_gb"] = gb(st["VmRSS"])
        row["anon_after_gb"] = gb(st["RssAnon"])
        del sess
        return row

    # First contact: every expert's pages are faulted in from the page cache here.
    ctxs = [int(c) for c in a.contexts.split(",")]
    first = prefill_decode(ctxs[0], f"{ctxs[0]} (first, cold pages)")
    rep.data["rows"].append(first)
    rate = first["prefill_tok_s"]
    s = proc_status()
    rep.data["after_generation"] = {"rss_gb": gb(s["VmRSS"]), "anon_gb": gb(s["RssAnon"]), "file_gb": gb(s["RssFile"])}
    rep.save()

    for ctx in ctxs:
        # Attention work grows with the context: pad the estimate by the ratio for long prompts.
        est = ctx / rate * (1.0 + ctx / 131072) + a.decode * 2 + 5
        left = deadline - time.time()
        if est > left:
            rep.data["skipped"].append(f"context {ctx}: estimated {est:.0f} s at {rate:.1f} tok/s, {left:.0f} s left")
            rep.save()
            continue
        row = prefill_decode(ctx, str(ctx))
        rate = row["prefill_tok_s"]
        rep.data["rows"].append(row)
        rep.save()
    print("done", flush=True)


if __name__ == "__main__":
    main()
