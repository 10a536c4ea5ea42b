"""Checks of the msl_cuda runtime over the stand-in driver (fake_libcuda.c), run by
tests/test_msl_cuda.py in a child process whose LILY_LIBCUDA is the stand-in (the driver, once
loaded, stays for the process). Each case prints "ok" or fails with an AssertionError.

The stand-in's "device" memory is this process's heap, so what a launch was handed (its
lily_msl_cuda_args, the staged set_bytes data, the permutation) is read back from the log's
addresses here.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys

import numpy as np

from lily._core import LilyError, msl_cuda
from msl_cpu_harness import library, msl_cpu, u32

ARGS = struct.Struct("<31QQ31I3I")  # lily_msl_cuda_args: buffers, threadgroup_order, offsets, grid
assert ARGS.size == 392


def log():
    with open(os.environ["FAKE_LIBCUDA_LOG"]) as f:
        return [json.loads(line) for line in f]


def launches():
    out = []
    for rec in log():
        if rec["call"] == "launch":
            a = ARGS.unpack(bytes.fromhex(rec["args"]))
            rec["buffers"], rec["order"], rec["offsets"], rec["tg_grid"] = a[:31], a[31], a[32:63], a[63:66]
            out.append(rec)
    return out


def alloc_of(nbytes):
    (ptr,) = [r["ptr"] for r in log() if r["call"] == "alloc" and r["bytes"] == nbytes]
    return ptr


def marshalling():
    dev = msl_cuda.device(timing=True)
    assert "Fake H200" in dev.name and "sm_90" in dev.name, dev.name
    # What the GPU backend asks a device: the baseline Apple family (no tensor ops here) and
    # the GPU's memory as the working set (cuDeviceTotalMem).
    assert dev.apple_gpu_family == 7 and not dev.supports_tensor_ops
    assert dev.recommended_max_working_set_size == 143771 << 20
    lib = library(dev, "reduce.metal")
    tree, simd = lib.pipeline("reduce_tree"), lib.pipeline("reduce_simd_float")
    # Both declare [[max_total_threads_per_threadgroup(1024)]] (read from the PTX metadata);
    # a kernel that declares none gets the 256 every Metal pipeline allows.
    assert tree.max_total_threads_per_threadgroup == 1024 and tree.thread_execution_width == 32
    assert simd.max_total_threads_per_threadgroup == 1024
    assert library(dev, "arithmetic.metal").pipeline("vector_semantics").max_total_threads_per_threadgroup == 256
    assert tree.buffers == {"in": 0, "partial": 1, "args": 2}, "bound by name as on msl_cpu"

    x = np.arange(1001, dtype=np.float32)  # 4004 bytes: found in the log by its size
    xb, out = dev.buffer(x), dev.buffer_empty(52)
    assert np.array_equal(np.frombuffer(xb.read(), np.float32), x)  # write then read back
    assert out.read() == bytes(52)  # zero-filled

    cb = dev.command_buffer()
    enc = cb.compute_encoder(concurrent=True)
    enc.set_pipeline(tree)
    enc.set_buffer(0, xb, 4)
    enc.set_buffer(1, out, 0)
    enc.set_bytes(2, u32(1000, 250))
    enc.set_threadgroup_memory_length(0, 1024)
    enc.dispatch_threadgroups((4,), (256,))
    enc.memory_barrier()
    enc.set_pipeline(simd)
    enc.set_bytes(2, u32(999, 7, 5))  # a second set_bytes: its own staged copy
    enc.dispatch_threadgroups((3, 2), (64, 2))
    enc.end_encoding()
    cb.commit()
    cb.wait_until_completed()

    xa, oa = alloc_of(4004), alloc_of(52)
    first, second = launches()
    assert first["kernel"] == "reduce_tree" and second["kernel"] == "reduce_simd_float"
    # One 1-D launch over the threadgroups; Metal's grid in the arguments.
    assert first["grid"] == [4, 1, 1] and first["block"] == [256, 1, 1] and first["tg_grid"] == (4, 1, 1)
    assert second["grid"] == [6, 1, 1] and second["block"] == [64, 2, 1] and second["tg_grid"] == (3, 2, 1)
    assert first["buffers"][0] == xa + 4 and first["buffers"][1] == oa
    assert second["buffers"][0] == xa + 4, "bindings persist across dispatches"
    assert ctypes.string_at(first["buffers"][2], 8) == u32(1000, 250)
    assert ctypes.string_at(second["buffers"][2], 12) == u32(999, 7, 5)
    assert first["buffers"][2] % 16 == 0 and second["buffers"][2] % 16 == 0
    assert first["shared"] == 1024 and first["offsets"][0] == 0
    assert second["shared"] == 1024, "threadgroup lengths persist too"
    assert first["order"] == 0 and second["order"] == 0, "launch order unless permuted"
    assert all(b == 0 for b in first["buffers"][3:]), "unbound buffers are null"
    # Order on the one stream: the staging upload, then the launches, then the completion event.
    calls = [r for r in log() if r["call"] in ("htod", "launch")]
    work = first["stream"]
    assert [c["call"] for c in calls if c.get("stream") == work] == ["htod", "launch", "launch"]
    assert second["stream"] == work
    times = msl_cuda.take_timings(dev)
    assert [(t[0], t[1], t[2]) for t in times] == [("reduce_tree", (4, 1, 1), (256, 1, 1)),
                                                   ("reduce_simd_float", (3, 2, 1), (64, 2, 1))]
    assert all(t[3] == 0.5 for t in times) and msl_cuda.take_timings(dev) == []


def permutation():
    dev = msl_cuda.device(permute_threadgroups=True, seed=11)
    lib = library(dev, "reduce.metal")
    out = dev.buffer_empty(4 * 64)
    cb = dev.command_buffer()
    enc = cb.compute_encoder()
    enc.set_pipeline(lib.pipeline("reduce_simd_float"))
    enc.set_buffer(0, dev.buffer(np.zeros(64, np.float32)), 0)
    enc.set_buffer(1, out, 0)
    enc.set_bytes(2, u32(64, 1))
    for grid in ((64,), (8, 4, 2)):
        enc.dispatch_threadgroups(grid, (32,))
    enc.end_encoding()
    cb.commit()
    cb.wait_until_completed()
    orders = []
    for rec, n in zip(launches(), (64, 64), strict=True):
        assert rec["order"] != 0
        order = np.frombuffer(ctypes.string_at(rec["order"], 4 * n), np.uint32)
        assert sorted(order) == list(range(n)) and not np.array_equal(order, np.arange(n))
        orders.append(order)
    assert not np.array_equal(orders[0], orders[1]), "each dispatch draws its own order"


def errors():
    dev = msl_cuda.device()
    lib = library(dev, "reduce.metal")
    tree = lib.pipeline("reduce_tree")

    def dispatch(setup, grid=(1,), threads=(32,)):
        cb = dev.command_buffer()
        enc = cb.compute_encoder()
        enc.set_pipeline(tree)
        setup(enc)
        enc.dispatch_threadgroups(grid, threads)
        enc.end_encoding()
        cb.commit()
        cb.wait_until_completed()

    buf = dev.buffer_empty(64)

    def expect(message, fn):
        try:
            fn()
        except LilyError as e:
            assert message in str(e), (message, str(e))
        else:
            raise AssertionError(f"no error: {message}")

    expect("buffer(1) (partial) is not bound", lambda: dispatch(lambda e: e.set_buffer(0, buf, 0)))

    def too_much(e):
        for i in (0, 1):
            e.set_buffer(i, buf, 0)
        e.set_bytes(2, u32(1, 1))
        e.set_threadgroup_memory_length(0, 32784)

    expect("32784 bytes of threadgroup memory (0 declared in the kernel + 32784 set_threadgroup_memory_length) "
           "exceed the 32768", lambda: dispatch(too_much))

    def big_bytes(e):
        e.set_bytes(2, bytes(4097))

    expect("set_bytes: 4097 bytes at index 2 are more than the 4096", lambda: dispatch(big_bytes))

    def wide(e):
        for i in (0, 1):
            e.set_buffer(i, buf, 0)
        e.set_bytes(2, u32(1, 1))

    vector_semantics = library(dev, "arithmetic.metal").pipeline("vector_semantics")

    def dispatch_wide():
        cb = dev.command_buffer()
        enc = cb.compute_encoder()
        enc.set_pipeline(vector_semantics)
        wide(enc)
        enc.dispatch_threadgroups((1,), (512,))

    expect("512 threads per threadgroup exceed the pipeline's maximum of 256 (a kernel dispatched with more "
           "than 256 threads declares [[max_total_threads_per_threadgroup(N)]]", dispatch_wide)
    expect("MSL 4.0 needs Metal 4 tensors, which msl_cuda does not provide",
           lambda: library(dev, "reduce.metal", language="4.0"))

    def cpu_buffer(e):
        e.set_buffer(0, msl_cpu.device().buffer_empty(64), 0)
        e.set_buffer(1, buf, 0)
        e.set_bytes(2, u32(1, 1))
        e.set_threadgroup_memory_length(0, 128)

    expect("buffer(0) is not a buffer of an msl_cuda device", lambda: dispatch(cpu_buffer))
    expect("function 'nope' is not in tests/msl/kernels/reduce.metal (it has: ", lambda: lib.pipeline("nope"))
    expect("do not fit in a buffer of 64", lambda: buf.write(np.zeros(17, np.float32), 0))
    expect("set_pipeline: not a pipeline of an msl_cuda device",
           lambda: dev.command_buffer().compute_encoder().set_pipeline(
               library(msl_cpu.device(), "reduce.metal").pipeline("reduce_tree")))


def static_shared_counts():
    # A kernel's own threadgroup arrays count against Apple's 32 KB with the dynamic lengths.
    dev = msl_cuda.device()
    tree = library(dev, "reduce.metal").pipeline("reduce_tree")
    cb = dev.command_buffer()
    enc = cb.compute_encoder()
    enc.set_pipeline(tree)
    buf = dev.buffer_empty(64)
    enc.set_buffer(0, buf, 0)
    enc.set_buffer(1, buf, 0)
    enc.set_bytes(2, u32(1, 1))
    enc.set_threadgroup_memory_length(0, 16)
    try:
        enc.dispatch_threadgroups((1,), (32,))
    except LilyError as e:
        assert "32784 bytes of threadgroup memory (32768 declared in the kernel + 16" in str(e), str(e)
    else:
        raise AssertionError("static shared memory was not counted")
    assert tree.max_total_threads_per_threadgroup == 256  # the driver's register-limited maximum


def fault():
    dev = msl_cuda.device()
    lib = library(dev, "reduce.metal")
    buf = dev.buffer_empty(64)
    cb = dev.command_buffer()
    enc = cb.compute_encoder(label="decode step")
    enc.set_pipeline(lib.pipeline("reduce_simd_float"))
    enc.set_buffer(0, buf, 0)
    enc.set_buffer(1, buf, 0)
    enc.set_bytes(2, u32(1, 1))
    enc.insert_debug_signpost("layer 3")
    enc.dispatch_threadgroups((1,), (32,))
    enc.end_encoding()
    cb.commit()
    try:
        cb.wait_until_completed()
    except LilyError as e:
        # Which encoder, as Metal's encoder execution status names it.
        assert "CUDA_ERROR_ILLEGAL_ADDRESS" in str(e), str(e)
        assert "'reduce_simd_float' [encoder 'decode step' after signpost 'layer 3']" in str(e), str(e)
    else:
        raise AssertionError("a fault was not raised by wait_until_completed")


def whole_model():
    """lily.Model.load(path, backend="msl-cuda") over the stand-in driver ($FAKE_MODEL: a tiny
    4-bit checkpoint). Kernels do not run here, so what is checked is what the host does: every
    weights file uploaded once, byte for byte; the dispatch sequence of prefill, decode and the
    device loop launched in encoding order and equal to the one msl-cpu runs (and tests
    against mlx-lm); tokens uploaded before their pass and logits read back after it; snapshots,
    restores, forks and the move of the KV cache into blocks as device copies."""
    import mmap
    from pathlib import Path

    import lily

    path = Path(os.environ["FAKE_MODEL"])
    opts = dict(split_threshold=9, split_len=4, block_threshold=8, block_len=4)
    gpu = lily.Model.load(path, backend="msl-cuda", backend_options=opts, max_context=64)
    assert gpu._engine.backend == "msl-cuda"
    assert "Fake H200" in lily._core.msl_cuda.device().name

    # The weights: one allocation per file and one upload of it: its mapping (whole pages), or,
    # where a tensor is misaligned (mlx's unpadded header), its data section (csrc/gpu/device_weights.h).
    page = mmap.PAGESIZE
    allocs = {r["ptr"]: r["bytes"] for r in log() if r["call"] == "alloc"}
    uploads = [r for r in log() if r["call"] == "htod"]
    files = sorted(path.glob("*.safetensors"))
    assert files
    for f in files:
        data = f.read_bytes()
        start = 8 + int.from_bytes(data[:8], "little")
        tensors = [t for k, t in json.loads(data[8:start]).items() if k != "__metadata__"]
        width = {"F32": 4, "U32": 4, "I32": 4, "F64": 8, "I64": 8, "U64": 8}
        if any((start + t["data_offsets"][0]) % width.get(t["dtype"], 4) for t in tensors):
            data = data[start:]
            size = len(data)
        else:
            size = -(-len(data) // page) * page
        (up,) = [u for u in uploads if u["bytes"] == size and allocs.get(u["dst"]) == size]
        assert ctypes.string_at(up["dst"], len(data)) == data, f"{f.name} uploaded wrongly"

    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    vocab = text["vocab_size"]
    kinds = text["layer_types"]
    n_attn, n_gdn = kinds.count("full_attention"), kinds.count("linear_attention")
    hkv, hd = text["num_key_value_heads"], text["head_dim"]

    def run(model, mark_log):
        """The dispatch sequence and host transfers of: prefill 6, decode 3 (crossing the block
        threshold), a snapshot / restore, a fork, 3 device-loop steps."""
        eng = model._engine
        eng.gpu_records(True)
        s = model.session()
        events = {}
        mark = len(log()) if mark_log else 0
        s.prefill([5, 7, 11, 13, 17, 19])
        events["prefill"] = mark_log and log()[mark:]
        for i, tok in enumerate((23, 29, 31)):
            mark = len(log()) if mark_log else 0
            s.decode(tok)
            events[f"decode{i}"] = mark_log and log()[mark:]
        mark = len(log()) if mark_log else 0
        snap = s._state.snapshot()
        events["snapshot"] = mark_log and log()[mark:]
        mark = len(log()) if mark_log else 0
        s._state.restore(snap)
        events["restore"] = mark_log and log()[mark:]
        mark = len(log()) if mark_log else 0
        twin = s.fork()
        events["fork"] = mark_log and log()[mark:]
        forked_bytes = twin._state.nbytes
        mark = len(log()) if mark_log else 0
        eng.generate_greedy(twin._state, 37, 3)
        events["loop"] = mark_log and log()[mark:]
        return [r[0] for r in eng.gpu_records(False)], events, forked_bytes

    kernels, ev, state_bytes = run(gpu, True)
    reference = lily.Model.load(path, backend="msl-cpu", backend_options=opts, max_context=64)
    assert kernels == run(reference, False)[0], "msl-cuda encodes another dispatch sequence than msl-cpu"
    launched = [r["kernel"] for k in ("prefill", "decode0", "decode1", "decode2", "loop") for r in ev[k]
                if r["call"] == "launch"]
    assert launched == kernels, "not every encoded dispatch was launched, in order"
    assert "sample" in launched and any(k.startswith("attn_decode_blocks") for k in launched)

    for name, T, tok in (("prefill", 6, None), ("decode0", 1, 23), ("decode2", 1, 31)):
        recs = ev[name]
        first = next(i for i, r in enumerate(recs) if r["call"] == "launch")
        launch = launches_in(recs)
        embed, head = launch[0], launch[-1]
        assert embed["kernel"].startswith("embed"), embed["kernel"]
        # The pass's tokens went up before its first launch, into a buffer embed reads ...
        (tokens,) = [r for r in recs[:first] if r["call"] == "htod" and r["bytes"] == 4 * T
                     and r["dst"] in embed["buffers"] and r["stream"] != embed["stream"]]
        assert bytes.fromhex(tokens["data"]) == struct.pack(f"<{T}i", *([5, 7, 11, 13, 17, 19] if tok is None else [tok]))
        # ... and its logits came back after the last one, from the buffer lm_head wrote.
        last = max(i for i, r in enumerate(recs) if r["call"] == "launch")
        (logits,) = [r for r in recs[last:] if r["call"] == "dtoh" and r["bytes"] == 4 * vocab]
        assert logits["src"] in head["buffers"], "logits read from another buffer than lm_head's output"
        assert tokens["stream"] == logits["stream"] != embed["stream"], "host copies go on the copy stream"
    # The second decode step takes the context to block_threshold 8: the 7 cached rows move into
    # blocks of 4 by device copies, one per (block, KV head) of K and V of every attention layer.
    moves = [r["bytes"] for r in ev["decode1"] if r["call"] == "dtod"]
    row = hd * (2 if gpu._engine.kv_dtype == "float16" else 4)  # (the default KV cache: float16)
    assert sorted(moves) == sorted([3 * row, 4 * row] * (n_attn * 2 * hkv)), moves
    # A snapshot reads, a restore writes, the recurrent state (conv window and S of every
    # DeltaNet layer); a fork copies the whole state on the device.
    snap_reads = [r["bytes"] for r in ev["snapshot"] if r["call"] == "dtoh"]
    restore_writes = [r["bytes"] for r in ev["restore"] if r["call"] == "htod"]
    assert len(snap_reads) == 2 * n_gdn and sorted(snap_reads) == sorted(restore_writes)
    block_table = 4 * -(-64 // opts["block_len"])  # max_context / block_len entries of uint32
    assert sum(r["bytes"] for r in ev["fork"] if r["call"] == "dtod") == state_bytes + block_table
    # The device loop (one sequence): each step's token and status read back from the ring
    # (4 bytes, and the status's 4 words).
    ring = [r["bytes"] for r in ev["loop"] if r["call"] == "dtoh"]
    assert ring.count(4) >= 3 and ring.count(16) >= 3, ring


def launches_in(records):
    out = []
    for rec in records:
        if rec["call"] == "launch":
            a = ARGS.unpack(bytes.fromhex(rec["args"]))
            out.append({**rec, "buffers": a[:31]})
    return out


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok")
