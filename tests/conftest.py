"""Session fixtures for lily's tests.

- `store`: builds tiny random-weight checkpoints on demand (transformers fp32; mlx_lm MLX
  conversions of the same weights) into one session tmp dir, and computes reference outputs
  from transformers / mlx-lm on the files as saved (see tests/fixtures/).
- `lily`: the package under test, imported once; an import failure is a test failure.
- LILY_TEST_OPAQUE_BUFFERS=1: every msl-cpu model loads with `opaque_buffers=True` (buffers
  without host storage, as msl-cuda's device memory), so a GPU-backend test run this way fails
  where the backend would read or write buffer contents directly (scripts/test.sh runs a subset
  of the Metal decode and prefill tests so).
- LILY_TEST_GPU_BACKEND=metal: every msl-cpu model loads on the real Metal backend instead, so the
  whole-model tests compare Metal with the CPU backend and mlx-lm on an Apple-silicon Mac
  (.github/workflows/macos.yml). A load that passes options of the MSL-on-CPU runtime alone
  (its checking modes, fault injection, the device it pretends to be) is skipped, naming them:
  real Metal has no such knobs. The `gpu_backend` fixture names the backend in use.

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


def pytest_configure(config):
    """Refuse a run whose native extension is not the one built next to the Python sources it
    imports. Why: an editable install (`pip install -e .`, scikit-build-core) maps `lily._core` to
    its own build in site-packages even under PYTHONPATH=src, so after `scripts/dev_build.sh`
    the tests would exercise the Python of the tree with the C++ of the install, silently."""
    import importlib.machinery

    import lily as _lily
    import lily._core as _core

    here = Path(_lily.__file__).resolve().parent
    local = [here / ("_core" + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    loaded = Path(_core.__file__).resolve()
    if any(p.exists() for p in local) and loaded.parent != here:
        raise pytest.UsageError(
            f"lily's Python files come from {here} but lily._core from {loaded}, not the build next to "
            f"them: an editable install shadows the dev build. `pip uninstall lily-llm` to test the dev "
            f"build (scripts/dev_build.sh), or reinstall to test the install.")


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> Store:
    return Store(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def lily():
    import lily as _lily

    return _lily


# backend_options only the MSL-on-CPU runtime has (csrc/python/model.cpp, BackendArgs).
MSL_CPU_ONLY_OPTIONS = ("check_dependencies", "interleavings", "asan", "metal4", "apple_gpu_family", "working_set",
                        "fail_dispatch", "fail_library", "opaque_buffers")


def _rewriting_msl_cpu_loads(rewrite):
    """Model.load with each backend="msl-cpu" call's keyword arguments passed through rewrite
    first, until the generator resumes (then the original load is put back)."""
    import lily as _lily

    load = _lily.Model.load.__func__

    @functools.wraps(load)
    def rewritten(cls, *args, **kwargs):
        if kwargs.get("backend") == "msl-cpu":
            kwargs = rewrite(dict(kwargs))
        return load(cls, *args, **kwargs)

    _lily.Model.load = classmethod(rewritten)
    yield
    _lily.Model.load = classmethod(load)


@pytest.fixture(scope="session")
def gpu_backend() -> str:
    """The backend the GPU-backend tests run: "msl-cpu", or "metal" with LILY_TEST_GPU_BACKEND."""
    return os.environ.get("LILY_TEST_GPU_BACKEND") or "msl-cpu"


@pytest.fixture(scope="session", autouse=True)
def opaque_gpu_buffers():
    """LILY_TEST_OPAQUE_BUFFERS=1: msl-cpu models get opaque buffers (see the top of this file)."""
    if os.environ.get("LILY_TEST_OPAQUE_BUFFERS") != "1":
        yield
        return

    def opaque(kwargs):
        kwargs["backend_options"] = {"opaque_buffers": True, **(kwargs.get("backend_options") or {})}
        return kwargs

    yield from _rewriting_msl_cpu_loads(opaque)


@pytest.fixture(scope="session", autouse=True)
def real_gpu_backend(gpu_backend):
    """LILY_TEST_GPU_BACKEND=metal: msl-cpu models load on Metal (see the top of this file)."""
    if gpu_backend == "msl-cpu":
        yield
        return
    if gpu_backend != "metal":
        raise pytest.UsageError(f"LILY_TEST_GPU_BACKEND must be 'metal' (or unset), not {gpu_backend!r}")

    def on_metal(kwargs):
        runtime_only = sorted(set(kwargs.get("backend_options") or {}) & set(MSL_CPU_ONLY_OPTIONS))
        if runtime_only:
            pytest.skip(f"backend_options {', '.join(runtime_only)} belong to the MSL-on-CPU runtime; Metal has none")
        kwargs["backend"] = gpu_backend
        return kwargs

    yield from _rewriting_msl_cpu_loads(on_metal)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in the main thread, as in an interactive Python, for tests
    that send themselves Ctrl-C. Needed when the runner inherited SIGINT as ignored: a shell
    starts background jobs that way, and Python then installs no handler of its own."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
