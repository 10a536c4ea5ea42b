"""Failure tests: what happens when the world misbehaves under a loaded model.

- A checkpoint file truncated, replaced or deleted while it is memory-mapped is detected before
  the next read (the engine checks the files' identity before every prefill and decode), as a
  CheckpointError naming the file, never a SIGBUS; the process stays alive.
- Running out of memory for the KV cache is a RequestError at the request, before any compute,
  and the state and model stay usable: under an address-space limit (ulimit -v) both a single
  over-large prefill and a context grown chunk by chunk are refused, in a child process.
- Ctrl-C (SIGINT) during load, prefill and decode raises KeyboardInterrupt and leaves the
  process usable: the next load and generation give the same tokens as before the interrupt.

Reference for "usable": greedy generation on the demo model before the fault; after the fault
the same call must return the same tokens (the engine and sampler are deterministic).
The server's burst-beyond-queue test (503, then recovery) lives in tests/test_server.py
(test_full_queue_gets_503_and_server_recovers).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
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


# -- checkpoint changed under the mapping --------------------------------------------------------


@pytest.mark.parametrize("how", ["truncate", "replace", "delete", "rewrite_same_size"])
def test_checkpoint_changed_while_mapped_is_detected(demo_copy, how, reference):
    model = lily.Model.load(demo_copy)
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


def test_truncated_mid_generation_stops_with_an_error(demo_copy, reference):
    """A file truncated between two decode steps: the next step fails cleanly."""
    model = lily.Model.load(demo_copy)
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


def test_ctrl_c_during_load_leaves_the_process_usable(reference):
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


def test_ctrl_c_during_prefill_leaves_the_model_usable(reference):
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


def test_ctrl_c_during_decode_leaves_the_model_usable(reference):
    model = lily.Model.load()
    stream = model.generate(PROMPT, max_tokens=100000, temperature=0, stream=True)
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
