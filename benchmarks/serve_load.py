#!/usr/bin/env python3
"""Concurrent clients against `lily serve` and llama.cpp's `llama-server`: throughput and latency.

    python benchmarks/serve_load.py                         # medium checkpoints, C = 1,2,4,8,16
    python benchmarks/serve_load.py --clients 1,2,4,8 --requests 2 --json out.json --markdown out.md
    python benchmarks/serve_load.py --engines lily --size tiny

For each client count C and each engine, this starts the server (lily: `python -m lily serve`;
llama.cpp: `llama-server -np C --cont-batching`, one slot per client), waits for /health, sends
one untimed warm-up request, then runs C clients at once. Each client sends `--requests` greedy
streamed chat requests one after another (a closed loop) to /v1/chat/completions: a prompt of
about `--prompt-tokens` tokens, distinct for every client and request (its unique part first,
so neither server's prompt cache can reuse more than the template's first tokens), and
`max_tokens` `--max-tokens`. Reported per engine and C: aggregate generated tokens/s (all
completion tokens / wall time from the first request sent to the last one done), p50 and p99
request latency, p50 time to first token (to the first chunk carrying generated text), and the
completion tokens the servers' `usage` reports; then lily / llama-server ratios.

Design choices:
- Same weights for both: the checkpoints of benchmarks/checkpoints.py (MLX 4-bit for lily,
  GGUF Q4_0 for llama.cpp, both from one set of random weights). They carry no chat template,
  so both servers get the same ChatML template from one file (lily: chat_template.jinja in a
  folder of links to the MLX checkpoint plus the HF tokenizer; llama-server:
  --chat-template-file): identical prompt tokens, which the table checks (prompt tokens).
- Every request runs to max_tokens: a random-weight model can emit an end token at any step,
  so the end-of-generation tokens (<|im_end|>, <|endoftext|>, and the FIM tokens llama.cpp
  also treats as ends) get a logit bias of -100 in both (OpenAI's logit_bias, which both
  take; lily has no ignore_eos). The completion tokens are then checked, not assumed: the
  table reports what the servers' usage says.
- Streaming with stream_options.include_usage, so one request gives TTFT, latency and usage.
  Clients are threads with http.client (standard library only). The engines alternate per C
  (the order rotating), so a drift of the shared machine's load falls on both.
- The machine is shared (2 cores, other jobs' tests come and go), and llama.cpp's threads wait
  for each other by spinning, so a third busy process slows it far more than lily (a first
  attempt, another job's tests on one core: llama-server at C = 1 gave 4.5 tok/s, lily 23).
  Before each measurement the script waits (up to `--quiet-wait` s) until the other processes
  use less than `--quiet-cpu` of the machine over 3 s in a row, and each row reports the share
  of the machine's CPU time other processes took during it (/proc/stat minus the server's and
  this script's own time): a row with a high share was disturbed.
- Percentiles by nearest rank over all requests of a run (with 2 requests per client at C = 1
  there are 2 samples: p99 is the slower one).
- lily runs one request at a time today (FIFO; docs/server.md "Scheduling"), so its aggregate
  throughput should stay flat in C while its latency grows; llama-server batches the slots'
  decode steps. This is the baseline of the continuous-batching work (issue 19).
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from run import loadavg, machine  # noqa: E402

ENGINES = ("lily", "llama-server")
MODEL_NAME = "bench"
# ChatML, as llama.cpp writes it when a model has no template; both servers render this file.
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}\n")
# Tokens that end a generation in lily (eos) or llama.cpp (its end-of-generation list): banned.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
WORDS = ("river stone apple window garden little yellow silver market engine paper winter "
         "morning quiet forest bridge candle letter planet orange pencil harbor music simple "
         "thunder island castle button copper meadow shadow violet anchor basket ladder mirror "
         "rocket saddle tunnel wagon blanket marble pepper velvet falcon lantern").split()


@dataclass
class Request:
    engine: str
    clients: int
    client: int
    index: int
    start_s: float  # since the run's start
    latency_s: float
    ttft_s: float | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None


def prompt_text(client: int, index: int, n_words: int, seed: int = 0) -> str:
    """A prompt unique to (client, index): its tag first, then seeded random words."""
    rng = random.Random(f"{seed}-{client}-{index}")
    return f"Request {client}.{index} ({rng.randrange(10**9)}): " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100] of a non-empty list."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def chat_stream(base: str, body: dict, timeout: float = 600) -> tuple[float, float | None, dict | None, str | None]:
    """One streamed chat request: (latency s, time to first generated text s, usage, finish)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.perf_counter()
    ttft = usage = finish = None
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True,
                     "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
        while line := resp.readline():
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                d = ch.get("delta") or {}
                if ttft is None and (d.get("content") or d.get("reasoning_content") or d.get("tool_calls")):
                    ttft = time.perf_counter() - t0
                finish = ch.get("finish_reason") or finish
        return time.perf_counter() - t0, ttft, usage, finish
    finally:
        conn.close()


def _machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (/proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]  # idle + iowait
    return sum(f) - idle, sum(f)


def _proc_jiffies(pid: int | str) -> int:
    """utime + stime of a process, all its threads (/proc/PID/stat), in clock ticks."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class OthersCPU:
    """The share of the machine's CPU time that processes other than ``pids`` (and this one)
    used between start() and share()."""

    def __init__(self, pids: list[int]):
        self.pids = pids

    def _now(self) -> tuple[int, int, int]:
        busy, total = _machine_jiffies()
        return busy, total, sum(_proc_jiffies(p) for p in [*self.pids, "self"])

    def start(self) -> OthersCPU:
        self._t0 = self._now()
        return self

    def share(self) -> float:
        b1, t1, o1 = self._now()
        b0, t0, o0 = self._t0
        return max(0.0, (b1 - b0) - (o1 - o0)) / max(1, t1 - t0)


def wait_quiet(pids: list[int], below: float, max_wait: float) -> float:
    """Waits until others use less than ``below`` of the machine for 3 one-second windows in a
    row, or ``max_wait`` s; returns the seconds waited."""
    t0 = time.monotonic()
    calm = 0
    while calm < 3 and time.monotonic() - t0 < max_wait:
        probe = OthersCPU(pids).start()
        time.sleep(1)
        calm = calm + 1 if probe.share() < below else 0
    return time.monotonic() - t0


def run_level(base: str, engine: str, clients: int, requests: int, *, max_tokens: int, prompt_words: int,
              ban: dict[str, float] | None = None, seed: int = 0,
              server_pid: int | None = None) -> tuple[dict, list[Request]]:
    """C clients at once against a running server, each sending `requests` requests in turn.
    Returns the summary row and every request."""
    others = OthersCPU([server_pid] if server_pid else [])
    out: list[Request] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    go = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        go.wait()
        for i in range(requests):
            body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": prompt_text(c, i, prompt_words, seed)}]}
            if ban:
                body["logit_bias"] = ban
            start = time.perf_counter() - t0
            try:
                lat, ttft, usage, finish = chat_stream(base, body)
            except BaseException as e:  # reported after the run, not lost in a thread
                with lock:
                    errors.append(e)
                return
            if usage is None:
                with lock:
                    errors.append(RuntimeError(f"{engine}: a stream without usage"))
                return
            with lock:
                out.append(Request(engine, clients, c, i, start, lat, ttft, int(usage["prompt_tokens"]),
                                   int(usage["completion_tokens"]), finish))

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    others.start()
    t0 = time.perf_counter()
    go.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    others_share = others.share()
    if errors:
        raise RuntimeError(f"{engine} C={clients}: {len(errors)} request(s) failed: {errors[0]!r}") from errors[0]
    row = summarize(engine, clients, requests, wall, out)
    row["others_cpu_pct"] = 100 * others_share
    return row, sorted(out, key=lambda r: (r.client, r.index))


def summarize(engine: str, clients: int, requests: int, wall: float, reqs: list[Request]) -> dict:
    lat = [r.latency_s for r in reqs]
    ttft = [r.ttft_s for r in reqs if r.ttft_s is not None]
    comp = [r.completion_tokens for r in reqs]
    prompt = [r.prompt_tokens for r in reqs]
    return {"engine": engine, "clients": clients, "requests": len(reqs), "requests_per_client": requests,
            "wall_s": wall, "completion_tokens": sum(comp), "completion_tokens_min": min(comp),
            "completion_tokens_max": max(comp), "prompt_tokens_mean": statistics.fmean(prompt),
            "tokens_per_s": sum(comp) / wall, "latency_p50_s": percentile(lat, 50),
            "latency_p99_s": percentile(lat, 99), "ttft_p50_s": percentile(ttft, 50) if ttft else None}


# -- servers -------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(base: str) -> bool:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=2)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        return r.status == 200
    except OSError:
        return False
    finally:
        conn.close()


class ServerProcess:
    """A server subprocess on a free port of 127.0.0.1, ready once /health answers 200."""

    def __init__(self, cmd: list[str], log: Path, port: int, env: dict | None = None, timeout: float = 300):
        self.base = f"http://127.0.0.1:{port}"
        self.cmd = cmd
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _ready(self.base):
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"{cmd[0]} exited with {self.proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{cmd[0]} not ready after {timeout:.0f} s; see {log}")
            time.sleep(0.25)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def lily_checkpoint(mlx_dir: Path, tokenizer_dir: Path, out: Path) -> Path:
    """A folder of links: the MLX weights and config, the HF tokenizer, and the ChatML template."""
    out.mkdir(parents=True, exist_ok=True)
    for src in [*mlx_dir.iterdir(), tokenizer_dir / "tokenizer.json", tokenizer_dir / "tokenizer_config.json"]:
        link = out / src.name
        if src.is_file() and not link.exists():
            link.symlink_to(src.resolve())
    (out / "chat_template.jinja").write_text(CHATML)
    return out


def end_token_bias(tokenizer_json: Path) -> dict[str, float]:
    """logit_bias entries banning END_TOKENS (those the vocabulary has)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = [tok.token_to_id(t) for t in END_TOKENS]
    return {str(i): -100.0 for i in ids if i is not None}


def start_lily(ckpt: Path | None, threads: int, log: Path, extra: list[str] = ()) -> ServerProcess:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "lily", "serve", "--port", str(port), "--served-model-name", MODEL_NAME,
           "--threads", str(threads), "--log-level", "warning", *extra]
    if ckpt is not None:
        cmd[4:4] = ["--model", str(ckpt)]
    return ServerProcess(cmd, log, port, env)


def start_llama(binary: Path, gguf: Path, template: Path, clients: int, threads: int, ctx_per_slot: int,
                log: Path) -> ServerProcess:
    port = _free_port()
    cmd = [str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "--alias", MODEL_NAME,
           "-np", str(clients), "-c", str(ctx_per_slot * clients), "--cont-batching", "-t", str(threads),
           "-tb", str(threads), "--jinja", "--chat-template-file", str(template), "--no-webui"]
    return ServerProcess(cmd, log, port)


# -- report --------------------------------------------------------------------------------------

def _f(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def markdown(rows: list[dict], info: dict) -> str:
    m = info["machine"]
    a = info["args"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores visible, {m['memory_GiB']} GiB; {m['os']}; lily "
        f"{m['lily_commit']}; {info['date']}.",
        f"Model: {a['size']} (random weights, qwen3_5_moe): lily MLX 4-bit, llama.cpp GGUF Q4_0. Threads: "
        f"{a['threads']} each. Each client sends {a['requests']} streamed greedy chat request(s) in turn, "
        f"~{a['prompt_tokens']}-token prompts (distinct), max_tokens {a['max_tokens']}, end tokens banned "
        f"(logit_bias -100).",
        f"Load average (1 min) before/after: {info['load_before']:.1f} / {info['load_after']:.1f}. Before each "
        f"row: waited until other processes used < {100 * a['quiet_cpu']:.0f}% of the CPUs for 3 s (at most "
        f"{a['quiet_wait']:.0f} s); others' CPU % = their share of the machine's CPU time during the row.",
        f"Servers (the last C's; llama-server's -np is C and -c C x {a['ctx_per_slot']}): "
        f"{'; '.join(f'{k}: `{v}`' for k, v in info['servers'].items())}.",
        f"Command: `{info['command']}`",
        "",
        "| C | engine | gen tok/s (all clients) | p50 latency s | p99 latency s | p50 TTFT s | requests | "
        "completion tokens (min-max per request) | prompt tokens (mean) | wall s | others' CPU % |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['engine']} | {r['tokens_per_s']:.1f} | {r['latency_p50_s']:.2f} | "
            f"{r['latency_p99_s']:.2f} | {_f(r['ttft_p50_s'], '.2f')} | {r['requests']} | "
            f"{r['completion_tokens']} ({r['completion_tokens_min']}-{r['completion_tokens_max']}) | "
            f"{r['prompt_tokens_mean']:.0f} | {r['wall_s']:.1f} | {_f(r.get('others_cpu_pct'), '.0f')} |")
    by = {(r["engine"], r["clients"]): r for r in rows}
    ratios = [(c, by["lily", c], by["llama-server", c]) for c in sorted({r["clients"] for r in rows})
              if ("lily", c) in by and ("llama-server", c) in by]
    if ratios:
        lines += ["", "lily / llama-server (throughput: above 1 is lily faster; latency and TTFT: below 1 is "
                  "lily faster):", "",
                  "| C | gen tok/s | p50 latency | p99 latency | p50 TTFT |", "|---:|---:|---:|---:|---:|"]
        for c, li, ll in ratios:
            ttft = (li["ttft_p50_s"] / ll["ttft_p50_s"]) if li["ttft_p50_s"] and ll["ttft_p50_s"] else None
            lines.append(f"| {c} | {li['tokens_per_s'] / ll['tokens_per_s']:.2f} | "
                         f"{li['latency_p50_s'] / ll['latency_p50_s']:.2f} | "
                         f"{li['latency_p99_s'] / ll['latency_p99_s']:.2f} | {_f(ttft, '.2f')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="medium", choices=("tiny", "medium", "full"),
                    help="benchmarks/checkpoints.py size (tiny has no GGUF: lily only); full: the "
                         "Qwen3.6-35B-A3B shape, laid out under ROOT/full by scripts/h200/phase_e.sh")
    ap.add_argument("--root", type=Path, default=ROOT / "build" / "bench",
                    help="where benchmarks/checkpoints.py made the checkpoints (SIZE/mlx4, SIZE/hf, SIZE/gguf)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of: lily, llama-server")
    ap.add_argument("--clients", default="1,2,4,8,16", help="comma-separated client counts C")
    ap.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    ap.add_argument("--prompt-tokens", type=int, default=200, help="about this many prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-per-slot", type=int, default=1024,
                    help="llama-server: context per slot (-c is this times C); lily: --max-context")
    ap.add_argument("--quiet-cpu", type=float, default=0.15,
                    help="before each measurement, wait until other processes use less than this share of the CPUs")
    ap.add_argument("--quiet-wait", type=float, default=240, help="... for at most this many seconds")
    ap.add_argument("--llama-server", type=Path, help="the binary (default: benchmarks/llamacpp.py build-server)")
    ap.add_argument("--logs", type=Path, default=ROOT / "build" / "serve-load", help="server logs and lily's folder")
    ap.add_argument("--json", type=Path, help="write every request and the summary rows here")
    ap.add_argument("--markdown", type=Path, help="write the tables here too")
    a = ap.parse_args(argv)
    a.clients = [int(c) for c in a.clients.split(",") if c]
    a.engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in a.engines if e not in ENGINES]
    if bad:
        ap.error(f"unknown engine(s) {bad}; choose from {', '.join(ENGINES)}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C, so the running server is stopped too (it has its own session).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = "python benchmarks/serve_load.py " + " ".join(sys.argv[1:] if argv is None else argv)
    size = a.root / a.size
    template = a.logs / "chatml.jinja"
    a.logs.mkdir(parents=True, exist_ok=True)
    template.write_text(CHATML)
    ckpt = lily_checkpoint(size / "mlx4", size / "hf", a.logs / f"{a.size}-lily")
    ban = end_token_bias(size / "hf" / "tokenizer.json")
    gguf = size / "gguf" / "model-q4_0.gguf"
    binary = None
    if "llama-server" in a.engines:
        import llamacpp

        binary = a.llama_server or llamacpp.build_server()
    # ~1.05 tokens per word of WORDS with the Qwen3.5 tokenizer, plus ~20 for the tag and template.
    prompt_words = max(1, round((a.prompt_tokens - 20) / 1.05))
    info = {"machine": machine(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command, "load_before": loadavg(), "servers": {},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "logit_bias": ban}
    rows: list[dict] = []
    requests: list[dict] = []
    for n, c in enumerate(a.clients):
        order = a.engines[n % len(a.engines):] + a.engines[:n % len(a.engines)]
        for engine in order:
            log = a.logs / f"{engine}-C{c}.log"
            if engine == "lily":
                srv = start_lily(ckpt, a.threads, log, ["--max-context", str(a.ctx_per_slot)])
            else:
                srv = start_llama(binary, gguf, template, c, a.threads, a.ctx_per_slot, log)
            command_line = " ".join(Path(srv.cmd[0]).name if i == 0 else x for i, x in enumerate(srv.cmd))
            info["servers"][engine] = command_line  # the last C's (llama-server: -np C, -c C x ctx-per-slot)
            try:
                chat_stream(srv.base, {"model": MODEL_NAME, "temperature": 0, "max_tokens": 8, "messages": [
                    {"role": "user", "content": "warm-up"}]})
                waited = wait_quiet([srv.proc.pid], a.quiet_cpu, a.quiet_wait)
                row, reqs = run_level(srv.base, engine, c, a.requests, max_tokens=a.max_tokens,
                                      prompt_words=prompt_words, ban=ban, server_pid=srv.proc.pid)
                row["waited_for_quiet_s"] = waited
            finally:
                srv.close()
            rows.append({**row, "server_command": command_line})
            if a.json:  # as we go: an interrupted run keeps the rows it measured
                with open(a.json.with_suffix(".rows.jsonl"), "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
            requests += [asdict(r) for r in reqs]
            print(f"[serve_load] {engine} C={c}: {row['tokens_per_s']:.1f} tok/s, p50 latency "
                  f"{row['latency_p50_s']:.2f} s, p50 TTFT {_f(row['ttft_p50_s'], '.2f')} s, completion tokens "
                  f"{row['completion_tokens_min']}-{row['completion_tokens_max']}, others' CPU {row['others_cpu_pct']:.0f}% "
                  f"(waited {row['waited_for_quiet_s']:.0f} s for quiet)", file=sys.stderr, flush=True)
    info["load_after"] = loadavg()
    rows.sort(key=lambda r: (r["clients"], r["engine"]))
    table = markdown(rows, info)
    print(table)
    if a.markdown:
        a.markdown.write_text(table)
    if a.json:
        a.json.write_text(json.dumps({"info": info, "rows": rows, "requests": requests}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
