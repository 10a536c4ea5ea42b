"""Session fixtures for lily's tests.

- `store`: builds tiny random-weight checkpoints on demand (transformers fp32; mlx_lm MLX
  conversions of the same weights) into one session tmp dir, and computes reference outputs
  from transformers / mlx-lm on the files as saved (see tests/fixtures/).
- `lily`: the package under test, imported once; an import failure is a test failure.
- LILY_TEST_OPAQUE_BUFFERS=1: every msl-cpu model loads with `opaque_buffers=True` (buffers
  without host storage, as msl-cuda's device memory), so a GPU-backend test run this way fails
  where the backend would read or write buffer contents directly (scripts/test.sh runs a subset
  of the Metal decode and prefill tests so).

Checkpoint building and the references need torch, transformers, mlx[cpu] and mlx-lm (the
`test` extra of pyproject.toml); they are imported lazily so a run of tests that need none of
them does not pay for them.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from fixtures.store import Store  # noqa: E402


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> Store:
    return Store(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def lily():
    import lily as _lily

    return _lily


@pytest.fixture(scope="session", autouse=True)
def opaque_gpu_buffers():
    """LILY_TEST_OPAQUE_BUFFERS=1: msl-cpu models get opaque buffers (see the top of this file)."""
    if os.environ.get("LILY_TEST_OPAQUE_BUFFERS") != "1":
        yield
        return
    import lily as _lily

    load = _lily.Model.load.__func__

    @functools.wraps(load)
    def opaque_load(cls, *args, **kwargs):
        if kwargs.get("backend") == "msl-cpu":
            kwargs["backend_options"] = {"opaque_buffers": True, **(kwargs.get("backend_options") or {})}
        return load(cls, *args, **kwargs)

    _lily.Model.load = classmethod(opaque_load)
    yield
    _lily.Model.load = classmethod(load)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in the main thread, as in an interactive Python, for tests
    that send themselves Ctrl-C. Needed when the runner inherited SIGINT as ignored: a shell
    starts background jobs that way, and Python then installs no handler of its own."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
