"""gpu::HazardTracker places a memory barrier in a concurrent encoder only at a real data edge
(read after write, write after write, write after read), and the msl_cpu dependency-check mode
confirms that every group of dispatches it leaves without a barrier is truly independent."""

import numpy as np
import pytest

from msl_cpu_harness import library, msl_cpu, read

N = 64  # floats per buffer; produce / consume run one thread per float


@pytest.fixture(scope="module")
def dev():
    return msl_cpu.device(check_dependencies=True)


@pytest.fixture(scope="module")
def kernels(dev):
    lib = library(dev, "bugs.metal")
    return lib.pipeline("produce"), lib.pipeline("consume")


def run(dev, steps):
    """steps: (pipeline, {index: (buffer, offset)}, threads, reads, writes). Returns barriers."""
    tracker = msl_cpu.HazardTracker()
    cb = dev.command_buffer()
    enc = cb.compute_encoder(concurrent=True)
    placed = []
    for pso, bindings, threads, reads, writes in steps:
        enc.set_pipeline(pso)
        for index, (buf, offset) in bindings.items():
            enc.set_buffer(index, buf, offset)
        placed.append(tracker.dispatch(enc, (1,), (threads,), reads, writes))
    enc.end_encoding()
    cb.commit()
    cb.wait_until_completed()  # raises if a group without barrier was not independent
    return placed


def whole(buf):
    return (buf, 0, 4 * N)


def test_read_after_write_gets_a_barrier(dev, kernels):
    produce, consume = kernels
    data, out = dev.buffer_empty(4 * N), dev.buffer_empty(4 * N)
    placed = run(
        dev,
        [
            (produce, {0: (data, 0)}, N, [], [whole(data)]),
            (consume, {0: (data, 0), 1: (out, 0)}, N, [whole(data)], [whole(out)]),
        ],
    )
    assert placed == [False, True]
    np.testing.assert_array_equal(read(out, np.float32), 2 * np.arange(N) + 1)


def test_independent_dispatches_share_a_group(dev, kernels):
    produce, _ = kernels
    a, b, c = dev.buffer_empty(4 * N), dev.buffer_empty(4 * N), dev.buffer_empty(4 * N)
    half = 4 * N // 2
    placed = run(
        dev,
        [
            (produce, {0: (a, 0)}, N, [], [whole(a)]),
            (produce, {0: (b, 0)}, N, [], [whole(b)]),
            # Two halves of one buffer: disjoint ranges are independent too.
            (produce, {0: (c, 0)}, N // 2, [], [(c, 0, half)]),
            (produce, {0: (c, half)}, N // 2, [], [(c, half, 4 * N)]),
        ],
    )
    assert placed == [False, False, False, False]
    np.testing.assert_array_equal(read(a, np.float32), 2 * np.arange(N))
    np.testing.assert_array_equal(read(c, np.float32), 2 * np.concatenate([np.arange(N // 2)] * 2))


def test_write_after_read_and_write_after_write(dev, kernels):
    produce, consume = kernels
    data, out = dev.buffer(np.full(N, 5, np.float32)), dev.buffer_empty(4 * N)
    placed = run(
        dev,
        [
            (consume, {0: (data, 0), 1: (out, 0)}, N, [whole(data)], [whole(out)]),
            (produce, {0: (data, 0)}, N, [], [whole(data)]),  # overwrites what consume reads
            (produce, {0: (out, 0)}, N, [], [whole(out)]),  # overwrites what consume wrote
        ],
    )
    assert placed == [False, True, False]  # the barrier before the 2nd also covers the 3rd
    np.testing.assert_array_equal(read(out, np.float32), 2 * np.arange(N))


def test_a_wrong_declaration_is_caught(dev, kernels):
    produce, consume = kernels
    data, out = dev.buffer_empty(4 * N), dev.buffer_empty(4 * N)
    with pytest.raises(ValueError, match=r"kernel 'produce'\) and 1 \(kernel 'consume'\)"):
        run(
            dev,
            [
                (produce, {0: (data, 0)}, N, [], [whole(data)]),
                # consume reads `data` but does not declare it: no barrier is placed.
                (consume, {0: (data, 0), 1: (out, 0)}, N, [], [whole(out)]),
            ],
        )
