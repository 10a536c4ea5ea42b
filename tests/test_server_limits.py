"""What a slow or hostile client can hold of `lily serve`, over real sockets on 127.0.0.1.

One server process with small limits (header and body deadlines of 1.5 s, 56 connections, a
stream timeout of 1.5 s) under a low open-file limit (160) serves the module (the flood test has
its own, with a 6 s header deadline). Issue 22:
- item 5: slowloris connections (headers a byte at a time, a body slower than its
  Content-Length promised) are dropped after the deadline; connections past the cap get a 503
  at once instead of exhausting the descriptors (EMFILE); afterwards a new request succeeds;
- item 6: a streaming client that stops reading is dropped after the stream timeout, having
  held at most a bounded amount of generated output;
- item 4: a prompt of three million words is refused (context_length_exceeded) without stalling
  the server: /health keeps answering while it is handled.
Every wait is bounded; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import json
import random
import resource
import socket
import sys
import threading
import time

import pytest

from test_server import ROOT, _request, demo_no_eos_bias, start_server, stop_server

sys.path.insert(0, str(ROOT / "benchmarks"))
import slowloris  # noqa: E402  (the slow clients of the stack comparison)

HEADER_TIMEOUT = BODY_TIMEOUT = STREAM_TIMEOUT = 1.5
MAX_CONNECTIONS = 56
OPEN_FILES = 160  # the server's RLIMIT_NOFILE: fewer than the connections a test opens


def _limited_server(header_timeout: float):
    def low_file_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))

    proc, base, port = start_server(
        "--header-timeout", str(header_timeout), "--body-timeout", str(BODY_TIMEOUT),
        "--max-connections", str(MAX_CONNECTIONS), "--stream-timeout", str(STREAM_TIMEOUT),
        preexec_fn=low_file_limit)
    yield base, port
    log = stop_server(proc)
    assert "Too many open files" not in log, log[-3000:]


@pytest.fixture(scope="module")
def server():
    yield from _limited_server(HEADER_TIMEOUT)


# The flood test's server holds a silent connection for 6 s, not 1.5: its clients connect one
# after another through a listen queue of 24, so the cap is passed only if more than 56 connect
# within one header deadline, and with 1.5 s a busy machine sometimes let none past it (0 of 200
# refused, 2026-12-02, while other jobs' builds ran; 7 of 200 the next run).
FLOOD_HEADER_TIMEOUT = 6.0


@pytest.fixture
def flood_server():
    yield from _limited_server(FLOOD_HEADER_TIMEOUT)


def _health(base) -> dict:
    return _request(base, "GET", "/health", timeout=10).json()


def _ok_request(base) -> None:
    r = _request(base, "POST", "/v1/completions", json.dumps(
        {"model": "lily-demo", "prompt": "The json module", "max_tokens": 2, "temperature": 0}).encode(),
        {"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_slowloris_connections_are_dropped_after_the_deadline(server):
    """32 connections that trickle their headers (a header line every 0.3 s) and 16 that send a
    body slower than promised (benchmarks/slowloris.py's clients): all held before the
    deadline, all closed by the server after it (the old server held them for as long as the
    client liked), then a request succeeds."""
    base, port = server
    # Paced 10 ms apart: 48 connects at once overflow this server's listen backlog of 24 (its low
    # open-file limit, server_limits.accept_batch), and the kernel drops some before the server
    # sees them, which is not what this test is about (seen 2026-12-02 on a quiet VM: 22-48 of 48
    # held, run to run; 48 of 48 paced).
    early, heads, bodies = slowloris.run_slow_clients(port, wait=HEADER_TIMEOUT + BODY_TIMEOUT + 4, early=0.5,
                                                      pace=0.01)
    assert early == 48, f"the server dropped {48 - early} connections before their deadline"
    assert (heads, bodies) == (0, 0), f"still open after the deadlines: {heads} of 32 slow-header, {bodies} of 16 slow-body"
    _ok_request(base)


def test_connections_past_the_cap_get_503_not_emfile(flood_server):
    """More connections than the open-file limit allows, opened at once and left silent: those
    past the cap are answered 503 at once, those within it 408 at the header deadline; every one
    is closed, the server never runs out of descriptors (before, accept() failed with EMFILE,
    and new requests with it, for as long as the connections were held), and a request then
    succeeds."""
    base, port = flood_server
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(OPEN_FILES + 40)]
    answers: dict[int, bytes] = {}
    deadline = time.monotonic() + FLOOD_HEADER_TIMEOUT + 10
    for s in socks:
        s.setblocking(False)
    while len(answers) < len(socks) and time.monotonic() < deadline:
        for i, s in enumerate(socks):
            if i in answers:
                continue
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b"reset"
            answers[i] = data
        time.sleep(0.05)
    for s in socks:
        s.close()
    # (Plain ints in the asserts: pytest's diff of a 200-item list takes minutes.)
    statuses = [answers.get(i, b"open")[:12] for i in range(len(socks))]
    n, never = len(socks), statuses.count(b"open")
    refused, timed_out = statuses.count(b"HTTP/1.1 503"), statuses.count(b"HTTP/1.1 408")
    assert never == 0, f"{never} of {n} connections were never answered nor closed"
    # Past the cap a connection is refused (503) once accepted; those still waiting in the
    # kernel's queue while the cap is full are accepted later and time out (408) instead. How
    # many wait depends on timing and on the accept batch, which the server sizes from the
    # open-file limit (server_limits.accept_batch): some are refused, every one is answered, and
    # the teardown finds no EMFILE in the log.
    assert refused > 0, f"none of {n} refused at the cap"
    assert refused + timed_out == n, f"{n - refused - timed_out} of {n} got neither 503 nor 408: {set(statuses)}"
    _ok_request(base)
    assert _health(base)["connections"] <= 2


def test_stalled_stream_reader_is_dropped(server):
    """A streaming client that reads its first event and then stops reading: the engine stops
    generating once the stream's buffer is full and drops the job after the stream timeout (the
    old server generated to the end into memory)."""
    base, port = server
    before = _health(base)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    # A request that runs to its 3,000 tokens (its end-of-sequence tokens banned); top-20 logprobs
    # make each event ~1.5 KB, so the sockets' buffers fill within a few hundred tokens.
    body = json.dumps({"model": "lily-demo", "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "max_tokens": 3000,
                       "temperature": 0, "stream": True, "logprobs": 20, "logit_bias": demo_no_eos_bias()}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    first = s.recv(4096)
    assert first.startswith(b"HTTP/1.1 200"), first[:200]
    t0 = time.monotonic()
    try:
        while True:  # no more reading: wait for the server to give up on us
            h = _health(base)
            if h["cancelled"] > before["cancelled"]:
                break
            assert h["completed"] == before["completed"], "the stream ran to its end into memory"
            assert time.monotonic() - t0 < 120, "the stalled reader was never dropped"
            time.sleep(0.2)
    finally:
        s.close()
    assert h["last_cancel_reason"] == "slow_reader", h
    # What was generated for it: the stream buffer, plus what the sockets' buffers took.
    assert h["last_cancel_tokens"] < 1000, h
    print(f"\n[slow reader] dropped after {time.monotonic() - t0:.1f} s, {h['last_cancel_tokens']} tokens generated")
    _ok_request(base)


def test_huge_prompt_is_refused_without_stalling_the_server(server):
    """Three million words (~10 MiB): the old server tokenized them for seconds holding the GIL,
    and /health (every other client too) waited that long before the 400 came."""
    base, port = server
    rng = random.Random(5)
    words = ["list", "a", "of", "to", "the", "is", "set", "dict", "int"]
    prompt = " ".join(rng.choice(words) for _ in range(3_000_000))
    latencies, done = [], threading.Event()

    def poll():
        while not done.is_set():
            t = time.perf_counter()
            assert _request(base, "GET", "/health", timeout=60).status_code == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        for path, body, param in (("/v1/completions", {"prompt": prompt}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]},
                                   "messages")):
            r = _request(base, "POST", path, json.dumps({"model": "lily-demo", **body}).encode(),
                         {"Content-Type": "application/json"}, timeout=120)
            assert r.status_code == 400, r.text[:500]
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and err["param"] == param, err
    finally:
        done.set()
        poller.join(60)
    print(f"\n[huge prompt] /health latency max {max(latencies) * 1e3:.0f} ms over {len(latencies)} polls")
    # Parsing 15 MiB of JSON holds the event loop for a moment; tokenizing it did for seconds.
    assert max(latencies) < 2.0, f"/health stalled for {max(latencies):.1f} s"
