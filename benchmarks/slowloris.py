"""Which server stack drops slowloris clients? The test that chose lily serve's (docs/server.md).

    python benchmarks/slowloris.py [--timeout 2] [--stacks uvicorn,hypercorn,granian,lily]

Each stack serves a trivial ASGI app (reads the body, answers 200) on 127.0.0.1 with its
read/idle timeouts set to --timeout where it has such a setting, and a cap of 64 connections
where it has one. Then, against each:
- 32 connections send their request headers one line every 0.3 s (never finishing), and 16 send
  a body of a promised 1,000 bytes one byte every 0.3 s: both kinds keep the connection busy,
  so an idle timeout alone cannot drop them;
- after 3 x --timeout (+ 2 s), how many of the 48 the server has closed;
- a normal request then: its status and latency;
- 200 silent connections at once against a process limited to 160 open files: does the server
  log EMFILE ("Too many open files"), and does a request succeed 3 x --timeout later.
Stacks that are not installed are skipped (hypercorn and granian are not lily dependencies:
pip install hypercorn granian to compare).
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import os
import resource
import socket
import subprocess
import sys
import threading
import time

OPEN_FILES = 160


async def app(scope, receive, send):  # the trivial ASGI app every stack serves
    if scope["type"] != "http":
        return
    more = True
    while more:
        msg = await receive()
        more = msg.get("more_body", False) and msg["type"] == "http.request"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _serve_lily(port: int, timeout: float) -> None:
    import uvicorn

    from lily.server_limits import ServerLimits, limited_protocol

    limits = ServerLimits(header_timeout_s=timeout, body_timeout_s=timeout, max_connections=64)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", http=limited_protocol(limits),
                backlog=limits.backlog)


def _command(stack: str, port: int, timeout: float) -> list[str] | None:
    here = os.path.dirname(os.path.abspath(__file__))
    py = sys.executable
    if stack == "uvicorn":  # the default h11 protocol; its only knobs: keep-alive idle, concurrency
        return [py, "-m", "uvicorn", "slowloris:app", "--app-dir", here, "--port", str(port), "--log-level",
                "warning", "--timeout-keep-alive", str(int(timeout)), "--limit-concurrency", "64"]
    if stack == "hypercorn" and importlib.util.find_spec("hypercorn"):
        return [py, "-m", "hypercorn", "slowloris:app", "--bind", f"127.0.0.1:{port}", "--keep-alive",
                str(int(timeout)), "--read-timeout", str(int(timeout)), "--log-level", "warning"]
    if stack == "granian" and importlib.util.find_spec("granian"):
        return [py, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port),
                "--http1-header-read-timeout", str(int(timeout * 1000)), "--backpressure", "64",
                "--log-level", "warning", "--working-dir", here, "slowloris:app"]
    if stack == "lily":
        return [py, os.path.abspath(__file__), "--serve-lily", str(port), "--timeout", str(timeout)]
    return None


def _start(cmd: list[str], port: int, files: int | None):
    def limit():
        if files:
            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    # A session of its own: hypercorn serves from a child process, which the whole group's kill reaches.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limit,
                            start_new_session=True)
    deadline = time.time() + 30
    while time.time() < deadline:
        if _get(port, 1) is not None:
            return proc
        time.sleep(0.2)
    _stop(proc)
    raise RuntimeError(f"{cmd[:4]} did not come up")


def _stop(proc) -> str:
    """Stops the server's whole process group; returns what it logged."""
    import signal

    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.communicate(timeout=wait)[0]
        except subprocess.TimeoutExpired:
            continue
    return ""


def _get(port: int, timeout: float) -> tuple[int, float] | None:
    t = time.perf_counter()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("POST", "/", body=b"{}", headers={"Content-Type": "application/json"})
        status = c.getresponse().status
        c.close()
        return status, time.perf_counter() - t
    except OSError:
        return None


def closed_by_server(s: socket.socket) -> bool:
    """True once the server has closed the connection (EOF or reset); reads what it sent."""
    s.setblocking(False)
    try:
        while True:
            if not s.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def run_slow_clients(port: int, wait: float, early: float = 0.5, pace: float = 0.0) -> tuple[int, int, int]:
    """32 slow-header and 16 slow-body clients: (connections of the 48 open after `early`
    seconds, slow-header ones still open after `wait` seconds, slow-body ones still open).
    `pace`: seconds between two connects. 0 opens all 48 at once, a burst past a small listen
    backlog: the kernel's accept queue then overflows and some connections die before the server
    ever sees them (a test of the deadlines, not of bursts, paces them)."""
    heads, bodies = [], []
    for _ in range(32):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
        heads.append(s)
        time.sleep(pace)
    for _ in range(16):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        bodies.append(s)
        time.sleep(pace)
    stop = threading.Event()

    def trickle():
        i = 0
        while not stop.wait(0.3):
            i += 1
            for s in heads:
                try:
                    s.sendall(f"X-{i}: y\r\n".encode())
                except OSError:
                    pass
            for s in bodies:
                try:
                    s.sendall(b"x")
                except OSError:
                    pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    time.sleep(early)
    held_early = sum(not closed_by_server(s) for s in heads + bodies)
    time.sleep(max(wait - early, 0))
    held = (sum(not closed_by_server(s) for s in heads), sum(not closed_by_server(s) for s in bodies))
    stop.set()
    t.join()
    for s in heads + bodies:
        s.close()
    return held_early, *held


def run_flood(port: int, wait: float) -> tuple[int, tuple | None]:
    """200 silent connections at once; (connections the server closed within `wait` s, a request after)."""
    socks = []
    for _ in range(OPEN_FILES + 40):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            break
    time.sleep(wait)
    closed = sum(closed_by_server(s) for s in socks)
    for s in socks:
        s.close()
    time.sleep(1.0)
    return closed, _get(port, 10)


def _fmt(result: tuple | None) -> str:
    return "no answer" if result is None else f"{result[0]} in {result[1] * 1e3:.0f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--stacks", default="uvicorn,hypercorn,granian,lily")
    ap.add_argument("--serve-lily", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_lily:
        _serve_lily(a.serve_lily, a.timeout)
        return 0
    wait = 3 * a.timeout + 2
    print(f"| stack | slow headers held after {wait:g} s (of 32) | slow bodies held (of 16) | request after | "
          f"200 silent connections, {OPEN_FILES} files: closed after {wait:g} s | EMFILE logged | request after |")
    print("|---|---|---|---|---|---|---|")
    for stack in a.stacks.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = _command(stack, port, a.timeout)
        if cmd is None:
            print(f"| {stack} | not installed | | | | | |")
            continue
        proc = _start(cmd, port, None)
        try:
            _, held_h, held_b = run_slow_clients(port, wait)
            after = _get(port, 10)
        finally:
            _stop(proc)
        proc = _start(cmd, port, OPEN_FILES)
        try:
            closed, flood_after = run_flood(port, wait)
        finally:
            log = _stop(proc)
        print(f"| {stack} | {held_h} | {held_b} | {_fmt(after)} | {closed} | "
              f"{'yes' if 'Too many open files' in log else 'no'} | {_fmt(flood_after)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
