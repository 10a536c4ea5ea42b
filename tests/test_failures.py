"""Failure tests: what happens when the world misbehaves under a loaded model.

- A checkpoint file truncated, replaced or deleted while it is memory-mapped is detected before
  the next read (the engine checks the files' identity before every prefill and decode), as a
  CheckpointError naming the file, never a SIGBUS; the process stays alive. A checkpoint read
  into memory (use_mmap=False, the CPU default when it fits) does not care: it keeps generating
  the same tokens after its file is truncated or deleted; a file that ends early while it is
  being read is a CheckpointError naming it.
- Running out of memory for the KV cache is a RequestError at the request, before any compute,
  and the state and model stay usable: under an address-space limit (ulimit -v) both a single
  over-large prefill and a context grown chunk by chunk are refused, in a child process.
- Ctrl-C (SIGINT) during download, load, prefill and decode raises KeyboardInterrupt and leaves
  the process usable: the next load and generation give the same tokens as before the interrupt.
  The download is from a local HTTP server speaking the Hugging Face Hub's protocol
  (HF_ENDPOINT), which trickles the weights; an interrupted download leaves no file in the
  snapshot (the offline load refuses it), and the next load resumes and generates.

Reference for "usable": greedy generation on the demo model before the fault; after the fault
the same call must return the same tokens (the engine and sampler are deterministic).
The server's burst-beyond-queue test (503, then recovery) lives in tests/test_server.py
(test_full_queue_gets_503_and_server_recovers).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

import lily

DEMO = Path(lily.__file__).resolve().parent / "demo"
PROMPT = "The standard library"


@pytest.fixture
def demo_copy(tmp_path) -> Path:
    d = tmp_path / "demo"
    shutil.copytree(DEMO, d)
    return d


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return lily.Model.load().generate(PROMPT, max_tokens=8, temperature=0).tokens


@pytest.fixture(scope="module")
def argmax_reference() -> list[int]:
    """Greedy without the demo's default repetition penalty (1.3): the plain argmax chain."""
    return lily.Model.load().generate(PROMPT, max_tokens=8, temperature=0, repetition_penalty=1).tokens


# -- checkpoint changed under the mapping --------------------------------------------------------


@pytest.mark.parametrize("how", ["truncate", "replace", "delete", "rewrite_same_size"])
def test_checkpoint_changed_while_mapped_is_detected(demo_copy, how, reference):
    model = lily.Model.load(demo_copy, use_mmap=True)
    assert model.generate(PROMPT, max_tokens=8, temperature=0).tokens == reference
    st = demo_copy / "model.safetensors"
    size = st.stat().st_size
    if how == "truncate":
        os.truncate(st, size // 2)  # the mapped pages past size/2 would SIGBUS on read
    elif how == "replace":
        tmp = demo_copy / "new.safetensors"
        shutil.copy(st, tmp)
        os.replace(tmp, st)  # new inode
    elif how == "delete":
        st.unlink()
    else:
        time.sleep(0.01)  # a distinct mtime even on coarse-timestamp filesystems
        data = st.read_bytes()
        st.write_bytes(data)  # same size and inode, new mtime: contents may differ
    with pytest.raises(lily.CheckpointError, match="model.safetensors"):
        model.generate(PROMPT, max_tokens=8, temperature=0)
    session = model.session()
    with pytest.raises(lily.CheckpointError, match="model.safetensors"):
        session.prefill([1, 2, 3])
    with pytest.raises(lily.CheckpointError, match="model.safetensors"):
        session.decode(1)
    assert session.position == 0
    with pytest.raises(lily.CheckpointError):
        model._weights.check_files_unchanged()


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_checkpoint_read_into_memory_survives_its_file_changing(demo_copy, how, reference):
    model = lily.Model.load(demo_copy, use_mmap=False)
    assert model._weights.resident and not model._weights.watching_files
    st = demo_copy / "model.safetensors"
    if how == "truncate":
        os.truncate(st, 1024)
    else:
        st.unlink()
    assert model.generate(PROMPT, max_tokens=8, temperature=0).tokens == reference
    model._weights.check_files_unchanged()  # nothing to check: no error


def test_cpu_default_reads_the_checkpoint_into_memory(demo_copy):
    """use_mmap=None on the CPU backend: a checkpoint this small is read into memory; the
    msl-cpu backend (a GPU backend) keeps it mapped; both give the same logits as a mapped load."""
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    mapped = lily.Model.load(demo_copy, use_mmap=True)
    auto = lily.Model.load(demo_copy)
    assert auto._weights.resident and not mapped._weights.resident
    np.testing.assert_array_equal(auto.logits(ids), mapped.logits(ids))
    assert not lily.Model.load(demo_copy, backend="msl-cpu")._weights.resident


def test_use_mmap_must_be_a_bool_or_none(demo_copy):
    with pytest.raises(lily.ConfigError, match="use_mmap"):
        lily.Model.load(demo_copy, use_mmap="yes")


def test_truncated_file_is_refused_in_both_residencies(demo_copy):
    """A header that promises more bytes than the file holds is refused before any weight is
    mapped or read. (The resident loader's check for a file that shrinks *while* it is read is
    not staged here: that needs the truncation to land between two reads.)"""
    st = demo_copy / "model.safetensors"
    os.truncate(st, st.stat().st_size - 100)
    for use_mmap in (True, False):
        with pytest.raises(lily.CheckpointError, match="model.safetensors.*(truncated|past the end|exceeds)"):
            lily.Model.load(demo_copy, use_mmap=use_mmap)


def test_decode_steps_stat_the_files_only_when_the_watch_saw_a_change(demo_copy, argmax_reference):
    """The per-token file check is one empty read() of an inotify queue, not a stat() per shard:
    decode steps of an untouched checkpoint make no stat; any event on the file or its folder
    (even an unrelated new file) makes the next step stat once; a truncation is still refused,
    on every later step too."""
    model = lily.Model.load(demo_copy, use_mmap=True)
    w = model._weights
    assert w.watching_files, "no inotify watch on Linux (out of inotify instances?)"
    s = model.session()
    logits = s.prefill(model.encode_prompt(PROMPT))
    tokens = []
    stats = w.stat_checks
    for _ in range(8):
        tokens.append(int(np.argmax(logits)))
        logits = s.decode(tokens[-1])
    assert w.stat_checks == stats, "decode steps stat'ed an untouched checkpoint"
    (demo_copy / "notes.txt").write_text("unrelated")  # an event in the folder
    s.decode(int(np.argmax(logits)))
    assert w.stat_checks == stats + 1
    s.decode(1)
    assert w.stat_checks == stats + 1  # the event was consumed
    os.truncate(demo_copy / "model.safetensors", 1024)
    for _ in range(2):
        with pytest.raises(lily.CheckpointError, match="modified or replaced"):
            s.decode(1)
    # The argmax tokens of those steps are the reference's (same prompt, same model).
    assert tokens == argmax_reference


def test_truncated_mid_generation_stops_with_an_error(demo_copy, reference):
    """A file truncated between two decode steps: the next step fails cleanly."""
    model = lily.Model.load(demo_copy, use_mmap=True)
    stream = model.generate(PROMPT, max_tokens=64, temperature=0, stream=True)
    next(iter(stream))
    os.truncate(demo_copy / "model.safetensors", 1024)
    with pytest.raises(lily.CheckpointError, match="modified or replaced"):
        for _ in stream:
            pass
    # A fresh load of a good copy works in the same process.
    assert lily.Model.load().generate(PROMPT, max_tokens=8, temperature=0).tokens == reference


# -- KV cache out of memory ----------------------------------------------------------------------

_OOM_CHILD = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    import lily

    model = lily.Model.load()
    ref = model.generate("The standard library", max_tokens=8, temperature=0).tokens
    kv_per_token = model._engine.kv_bytes(1)
    # Address space left for KV: 48 MiB over what the process maps now.
    vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    margin = 48 << 20
    resource.setrlimit(resource.RLIMIT_AS, (vm + margin, resource.RLIM_INFINITY))
    fits = margin // kv_per_token
    big = 4 * fits

    # (a) one prefill whose KV cache cannot fit: refused before any compute.
    s = model.session(max_context=1 << 30)
    try:
        s.prefill(np.ones(big, dtype=np.int32))
        print("FAIL: no error for", big, "tokens"); sys.exit(1)
    except lily.RequestError as e:
        assert "KV cache" in str(e) and "memory" in str(e), e
        print("refused:", e)
    assert s.position == 0
    # (b) the same context grown chunk by chunk: some chunk is refused, cleanly.
    chunk, grown = 2048, 0
    try:
        while grown < big:
            s.prefill(np.full(chunk, 7, dtype=np.int32))
            grown += chunk
        print("FAIL: grew to", grown); sys.exit(1)
    except lily.RequestError as e:
        assert "memory" in str(e), e
        print("refused at", grown, ":", e)
    assert s.position == grown, (s.position, grown)
    del s
    # The model still answers, with the same tokens.
    out = model.generate("The standard library", max_tokens=8, temperature=0).tokens
    assert out == ref, (out, ref)
    print("OK", fits, grown)
    """
)


def test_kv_cache_out_of_memory_is_a_request_error():
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", _OOM_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "refused:" in proc.stdout and "OK" in proc.stdout, proc.stdout


def test_kv_bytes_matches_the_state(reference):
    """The engine's KV estimate (used by the memory check) is what the CPU state holds."""
    model = lily.Model.load()
    s = model.session(max_context=256)
    s.prefill(np.arange(1, 257, dtype=np.int32) % 4000)
    gdn_only = model.session(max_context=256)  # nothing prefilled: DeltaNet state only
    kv_held = s._state.nbytes - gdn_only._state.nbytes
    assert kv_held == model._engine.kv_bytes(256)


# -- Ctrl-C -------------------------------------------------------------------------------------


def _interrupt_after(seconds: float) -> threading.Timer:
    t = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
    t.start()
    return t


def test_ctrl_c_during_load_leaves_the_process_usable(reference, sigint_raises):
    timer = _interrupt_after(0.05)
    interrupted = False
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lily.Model.load()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        timer.cancel()
    assert interrupted, "SIGINT never arrived during repeated loads"
    assert lily.Model.load().generate(PROMPT, max_tokens=8, temperature=0).tokens == reference


def test_ctrl_c_during_prefill_leaves_the_model_usable(reference, sigint_raises):
    model = lily.Model.load(prefill_chunk=32)
    ids = (np.arange(3000, dtype=np.int32) * 7) % 4000
    t0 = time.monotonic()
    model.logits(ids[:600])
    per_600 = time.monotonic() - t0  # the full 3000-token prefill takes ~5x this
    timer = _interrupt_after(per_600)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            model.generate(ids.tolist(), max_tokens=1, temperature=0)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 4 * per_600, "the interrupt did not stop the prefill early"
    assert model.generate(PROMPT, max_tokens=8, temperature=0).tokens == reference


def test_ctrl_c_during_decode_leaves_the_model_usable(reference, sigint_raises):
    model = lily.Model.load()
    # End-of-turn banned (logit_bias): the demo must still be decoding when the interrupt lands.
    no_eos = {int(t): -100.0 for t in model.eos_token_ids}
    stream = model.generate(PROMPT, max_tokens=100000, temperature=0, stream=True, logit_bias=no_eos)
    got = 0
    timer = None
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in stream:
                got += 1
                if got == 3:  # prefill is done: the interrupt lands in decode
                    timer = _interrupt_after(0.1)
    finally:
        if timer:
            timer.cancel()
    assert got >= 3
    assert model.generate(PROMPT, max_tokens=8, temperature=0).tokens == reference


# -- Ctrl-C during a download from the Hub ------------------------------------------------------


class _FakeHub(BaseHTTPRequestHandler):
    """The part of the Hugging Face Hub's HTTP API that `snapshot_download` uses (repo info, the
    file tree, HEAD and GET of /resolve/ with Range), serving the demo model as `org/demo`.
    `model.safetensors` is trickled (32 KiB per 50 ms, ~12 s) while `server.slow` is set; a
    trickling response is cut off (connection closed) once `server.stop` is set."""

    COMMIT = "0123456789abcdef0123456789abcdef01234567"
    FILES = {p.name: p.read_bytes() for p in DEMO.iterdir() if p.is_file()}

    def log_message(self, *args):
        pass

    def _head(self, code: int, length: int, extra=()) -> None:
        self.send_response(code)
        for k, v in extra:
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _json(self, obj) -> None:
        body = json.dumps(obj).encode()
        self._head(200, len(body), [("Content-Type", "application/json")])
        if self.command == "GET":
            self.wfile.write(body)

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = self.path.split("?")[0]
        if path.startswith("/api/models/org/demo/revision/"):
            return self._json({"id": "org/demo", "sha": self.COMMIT,
                               "siblings": [{"rfilename": n} for n in self.FILES]})
        if path.startswith("/api/models/org/demo/tree/"):
            return self._json([{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                               for n, d in self.FILES.items()])
        prefix = f"/org/demo/resolve/{self.COMMIT}/"
        name = path[len(prefix):] if path.startswith(prefix) else None
        if name not in self.FILES:
            self._head(404, 0)
            return
        data = self.FILES[name]
        begin = 0
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and rng.endswith("-"):
            begin = int(rng[6:-1])
        head = [("X-Repo-Commit", self.COMMIT), ("ETag", f'"{hashlib.sha256(data).hexdigest()}"')]
        if begin:
            head.append(("Content-Range", f"bytes {begin}-{len(data) - 1}/{len(data)}"))
        self._head(206 if begin else 200, len(data) - begin, head)
        if self.command != "GET":
            return
        slow = name == "model.safetensors" and self.server.slow.is_set()
        step = 32 << 10 if slow else len(data)
        for i in range(begin, len(data), step):
            if slow and self.server.stop.is_set():
                return  # cut off: the client sees a short body
            self.wfile.write(data[i : i + step])
            self.wfile.flush()
            self.server.sent[name] = self.server.sent.get(name, 0) + min(step, len(data) - i)
            if slow:
                time.sleep(0.05)


_DOWNLOAD_CHILD = textwrap.dedent(
    """
    import hashlib, json, os, signal, sys, time
    from pathlib import Path
    import lily

    caught = {}
    def on_sigint(signum, frame):
        caught["t"] = time.monotonic()
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_sigint)
    print("READY", flush=True)
    res = {}
    try:
        lily.Model.load("org/demo")
        res["interrupted"] = False
    except KeyboardInterrupt:
        res["interrupted"] = True
        res["latency_s"] = time.monotonic() - caught["t"]
        print("INTERRUPTED", flush=True)
    repo = Path(os.environ["HF_HOME"]) / "hub" / "models--org--demo"
    snap = repo / "snapshots" / sys.argv[1]
    res["snapshot_has_weights"] = (snap / "model.safetensors").exists()
    res["incomplete"] = [p.name for p in (repo / "blobs").glob("*.incomplete")]
    # Offline, the half-downloaded checkpoint is refused, not loaded.
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        lily.Model.load("org/demo")
        res["offline"] = "loaded"
    except Exception as e:
        res["offline"] = f"{type(e).__name__}: {e}"
    del os.environ["HF_HUB_OFFLINE"]
    # Online again (the server no longer trickles): the download completes, the model works.
    m = lily.Model.load("org/demo")
    res["sha256"] = hashlib.sha256((snap / "model.safetensors").read_bytes()).hexdigest()
    res["tokens"] = m.generate(sys.argv[2], max_tokens=8, temperature=0).tokens
    print("RESULT " + json.dumps(res), flush=True)
    """
)


def test_ctrl_c_during_hub_download_leaves_the_process_usable(tmp_path, reference):
    hub = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    hub.slow, hub.stop, hub.sent = threading.Event(), threading.Event(), {}
    hub.slow.set()
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{hub.server_address[1]}",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               PYTHONPATH=str(Path(lily.__file__).resolve().parent.parent))
    child = subprocess.Popen([sys.executable, "-c", _DOWNLOAD_CHILD, _FakeHub.COMMIT, PROMPT], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(ln) for ln in child.stdout], daemon=True)
    reader.start()
    try:
        assert lines.get(timeout=60).strip() == "READY"
        deadline = time.monotonic() + 60
        while hub.sent.get("model.safetensors", 0) < (256 << 10):  # well into the weights
            assert time.monotonic() < deadline and child.poll() is None, "the download never started"
            time.sleep(0.02)
        child.send_signal(signal.SIGINT)
        # The trickle goes on until the child reports the interrupt (a download that only ends
        # when its file is complete would show as a long latency, and a complete snapshot).
        assert lines.get(timeout=60).strip() == "INTERRUPTED"
        sent_at_interrupt = hub.sent["model.safetensors"]
        hub.slow.clear()  # later requests are served at once...
        hub.stop.set()  # ...and the trickle in flight is cut off, as a dropped connection would be
        child.wait(timeout=120)
        reader.join(10)
        out, err = "".join(lines.queue), child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
        hub.shutdown()
    assert child.returncode == 0, err[-3000:]
    res = json.loads(out.split("RESULT ", 1)[1])
    total = len(_FakeHub.FILES["model.safetensors"])
    print(f"\n[download] interrupted {res.get('latency_s', 0) * 1e3:.0f} ms after SIGINT, "
          f"{sent_at_interrupt >> 10} KiB of {total >> 10} KiB sent by then, left as {res['incomplete']}")
    assert res["interrupted"], "the load finished before the interrupt: the trickle was too fast"
    assert res["latency_s"] < 1.0, f"Ctrl-C took {res['latency_s']:.1f} s to interrupt the download"
    assert not res["snapshot_has_weights"], "a half-downloaded file was put in the snapshot"
    # huggingface_hub does not offer an incomplete snapshot offline (or lily finds no weights in it).
    assert res["offline"] != "loaded" and "org/demo" in res["offline"], res["offline"]
    assert res["sha256"] == hashlib.sha256(_FakeHub.FILES["model.safetensors"]).hexdigest()
    assert res["tokens"] == reference
