#!/usr/bin/env python3
"""The engines the harness times, behind one interface: measure(prompt_len, n_decode, seed).

Every engine is timed the same way, batch 1, greedy, from a fresh state:
    prefill = wall time of processing `prompt_len` prompt tokens (one call; the engine chunks
              internally as it would for a user)                    -> prompt_len / time
    decode  = wall time of `n_decode` single-token steps continuing that state  -> n_decode / time

Design choices:
- The Python engines (lily, mlx-lm, transformers) each run in their own worker process, started
  once per harness session and kept: the model is loaded once, the driver sends one JSON line
  per measurement and reads one back. Separate processes keep one engine's allocator, thread
  pool or page-cache warmth from colouring another's numbers, and let the driver alternate
  engines measurement by measurement.
- llama.cpp is timed by its own `llama-bench` (what its users quote), one process per
  measurement: `-p P -n 0` for prefill, `-p 0 -n N -d P` for decode after a P-token context.
  llama-bench's warmup run stays on (a fresh process per measurement warms its caches, as lily
  does in its own untimed warm-up); `-lm none` reads the weights into memory as lily does by
  default (both engines are slower from a page-cache mapping here); its random prompt tokens
  and unsampled decode steps are its defaults.
- Prompt tokens are uniform random ids drawn from a seed (the same ids for every Python
  engine); random-weight models make text meaningless anyway. Decode feeds back the argmax of
  the logits each step, the greedy loop a user runs (the argmax over 248K floats is ~0.1 ms).
- Threads: lily `threads=`, torch `set_num_threads`, llama.cpp `-t`. mlx's CPU backend does not
  thread its matmuls on Linux: it runs on one core whatever the setting (noted in the table).

Worker mode (used by the harness):  python benchmarks/engines.py --serve ENGINE PATH THREADS
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import roofline  # noqa: E402


def prompt_ids(n: int, vocab: int, seed: int) -> np.ndarray:
    # Ids below 248044 are ordinary BPE tokens in the real vocabulary; stay below it and below
    # the model's vocab (tiny: 503).
    hi = min(vocab, 248044)
    return np.random.default_rng(seed).integers(0, hi, size=n, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# In-process timers (run inside a worker)
# ---------------------------------------------------------------------------------------------

class LilyTimer:
    """lily as a user gets it: Model.load's default cpu_matmul ("auto": int8 where the CPU has
    the integer kernels, else f32; the info line, the model's repr, says which ran)."""

    cpu_matmul = "auto"

    def __init__(self, path: str, threads: int):
        sys.path.insert(0, str(ROOT / "src"))
        import lily

        self.model = lily.Model.load(path, threads=threads, cpu_matmul=self.cpu_matmul)
        self.vocab = self.model.config.vocab_size
        self.info = repr(self.model)

    # Decode steps between two bandwidth measurements (membw): a segment short enough that the
    # 2-core VM's bandwidth state (~50 or ~82 GB/s, switching within seconds) seldom changes
    # inside it, long enough to time (~0.2-0.3 s; a measurement takes ~0.3 s).
    SEGMENT = 32

    # Decode steps between two passes of an interleaved membw (~0.1 s of decode on the medium
    # model, about one pass over membw's buffer on the 2-core VM).
    INTERLEAVE = 5

    def measure(self, p: int, n: int, seed: int, membw: int | None = None,
                interleave: roofline.MembwServer | None = None) -> dict:
        """membw = threads: also measure the read bandwidth at that many threads before the
        decode steps and after every SEGMENT of them: bw_GBps, the best of them all (the run's
        roofline, as for the other engines' runs), and segments, [steps, seconds, bandwidth
        before, bandwidth after] each (run.py's steady roofline).
        interleave: a running membw server; one pass of it after every INTERLEAVE steps, the read
        modes alternating: rounds, [steps, seconds, mode, pass seconds, pass bytes] each
        (roofline.interleaved_share)."""
        if membw and interleave:
            raise ValueError("measure: membw brackets or interleaved passes, not both")
        ids = prompt_ids(p, self.vocab, seed)
        s = self.model.session(max_context=p + n + 1)
        t0 = time.perf_counter()
        logits = s.prefill(ids)
        prefill_s = time.perf_counter() - t0
        seg = self.INTERLEAVE if interleave else self.SEGMENT if membw else n
        bws = [roofline.bandwidth_now(membw)] if membw else []
        segments, rounds, decode_s, done = [], [], 0.0, 0
        while done < n:  # the measurements' time is neither prefill's nor decode's
            steps = min(seg, n - done)
            t1 = time.perf_counter()
            for _ in range(steps):
                logits = s.decode(int(np.argmax(logits)))
            dt_s = time.perf_counter() - t1
            decode_s += dt_s
            done += steps
            if interleave:
                mode = interleave.MODES[len(rounds) % 2]
                rounds.append([steps, dt_s, mode, *interleave.read(mode)])
            elif membw:
                bws.append(roofline.bandwidth_now(membw))
                segments.append([steps, dt_s, bws[-2], bws[-1]])
        res = {"prefill_s": prefill_s, "decode_s": decode_s}
        if membw:
            res["bw_GBps"] = max(bws)
            res["segments"] = segments
        if interleave:
            res["rounds"] = rounds
        return res


class MlxTimer:
    def __init__(self, path: str, threads: int):
        import mlx.core as mx
        from mlx_lm.utils import load_model

        self.mx = mx
        mx.set_default_device(mx.cpu)
        self.model, cfg = load_model(Path(path))
        self.vocab = cfg.get("text_config", cfg)["vocab_size"]
        self.info = f"mlx {mx.__version__} (CPU, single-threaded matmuls)"

    def measure(self, p: int, n: int, seed: int) -> dict:
        from mlx_lm.models.cache import make_prompt_cache

        mx = self.mx
        ids = mx.array(prompt_ids(p, self.vocab, seed)[None].astype(np.int32))
        cache = make_prompt_cache(self.model)
        t0 = time.perf_counter()
        logits = self.model(ids, cache=cache)[:, -1, :]
        tok = mx.argmax(logits, axis=-1)
        mx.eval(tok)
        t1 = time.perf_counter()
        for _ in range(n):
            logits = self.model(tok[:, None], cache=cache)[:, -1, :]
            tok = mx.argmax(logits, axis=-1)
            mx.eval(tok)
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1}


class TransformersTimer:
    def __init__(self, path: str, threads: int):
        import torch
        import transformers as tf

        torch.set_num_threads(threads)
        self.torch = torch
        cfg = json.loads((Path(path) / "config.json").read_text())
        cls = getattr(tf, cfg["architectures"][0])
        self.model = cls.from_pretrained(path, dtype=torch.bfloat16).eval()
        self.vocab = cfg.get("text_config", cfg)["vocab_size"]
        self.info = f"transformers {tf.__version__} bf16, torch {torch.__version__}"

    def measure(self, p: int, n: int, seed: int) -> dict:
        torch = self.torch
        ids = torch.from_numpy(prompt_ids(p, self.vocab, seed))[None]
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            t1 = time.perf_counter()
            for _ in range(n):
                out = self.model(input_ids=tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1}


class LilyInt8Timer(LilyTimer):
    """lily with int8 activations and integer dot products (`cpu_matmul="int8"`), the scheme of
    llama.cpp's Q4_0 x Q8_0 product."""

    cpu_matmul = "int8"


class LilyF32Timer(LilyTimer):
    """lily's f32 reference mode (`cpu_matmul="f32"`: mlx-lm's numerics to ~1e-6)."""

    cpu_matmul = "f32"


TIMERS = {"lily": LilyTimer, "lily int8": LilyInt8Timer, "lily f32": LilyF32Timer, "mlx-lm": MlxTimer,
          "transformers": TransformersTimer}


def serve(engine: str, path: str, threads: int) -> None:
    """Worker loop: one JSON request per stdin line -> one JSON reply per stdout line."""
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    timer = TIMERS[engine](path, threads)
    out.write(json.dumps({"ready": True, "info": timer.info}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            extra = {"membw": req["membw"]} if req.get("membw") else {}  # lily's timers only
            res = timer.measure(req["prompt"], req["decode"], req["seed"], **extra)
        except Exception as e:  # reported, not fatal: the driver records the failure
            res = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(res) + "\n")
        out.flush()


# ---------------------------------------------------------------------------------------------
# Driver-side handles
# ---------------------------------------------------------------------------------------------

class Worker:
    """A Python engine in its own process (see serve)."""

    def __init__(self, engine: str, path: Path, threads: int):
        self.name = engine
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + [
                       p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", engine, str(path), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        hello = self._read()
        self.info = hello.get("info", engine)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def measure(self, p: int, n: int, seed: int, membw: int | None = None) -> dict:
        req = {"prompt": p, "decode": n, "seed": seed}
        if membw:
            req["membw"] = membw
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class LlamaBench:
    """llama.cpp through llama-bench, one process per measurement."""

    def __init__(self, name: str, bench: Path, gguf: Path, threads: int):
        self.name, self.bench, self.gguf, self.threads = name, bench, gguf, threads
        self.info = f"llama-bench {gguf.name} ({gguf.stat().st_size / 1e9:.2f} GB)"

    def _run(self, args: list[str]) -> dict:
        # -lm none: the weights are read into memory, not mapped: lily's default on the CPU, and
        # llama.cpp's faster choice here (medium Q8_0 decode, 2 threads, this VM: 16.3 tok/s read
        # vs 8.7 mapped; Q4_0, which llama.cpp repacks into memory either way: 20.8 vs 20.3).
        cmd = [str(self.bench), "-m", str(self.gguf), "-t", str(self.threads), "-r", "1",
               "-lm", "none", "-o", "json", *args]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
        res = json.loads(r.stdout)
        if len(res) != 1:
            raise RuntimeError(f"llama-bench returned {len(res)} results, expected 1")
        return res[0]

    def measure(self, p: int, n: int, seed: int) -> dict:
        try:
            pp = self._run(["-p", str(p), "-n", "0"])
            tg = self._run(["-p", "0", "-n", str(n), "-d", str(p)])
        except RuntimeError as e:
            return {"error": str(e)}
        # samples_ns has one sample per repetition (-r 1): the time of the timed run only.
        return {"prefill_s": pp["samples_ns"][0] * 1e-9, "decode_s": tg["samples_ns"][0] * 1e-9}

    def close(self) -> None:
        pass


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit("usage: engines.py --serve ENGINE PATH THREADS  (the harness starts workers)")
