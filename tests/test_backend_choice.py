"""backend="auto": Metal only after the known-answer check passed on the GPU, else the CPU.

The decision (lily.backend_choice.choose_backend) takes the machine's facts as an argument, so
each branch runs here on Linux: the facts of a Mac are given, and the check itself is the real
one run on backend="msl-cpu" (the Metal backend's host and dispatch sequence, its kernels run on
the CPU). Failures are real too: a dispatch that raises, a library that does not compile (the
runtime's fault injection) and a kernel that computes a wrong answer ($LILY_SOURCE_DIR).

References: the check compares with lily's CPU backend, so the passing case also holds the
check's logits and greedy tokens to mlx-lm on the same demo-model bytes.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

from fixtures.references import rel_err, top1_margins

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bc(lily):
    from lily import backend_choice

    return backend_choice


@pytest.fixture
def mac(bc):
    return bc.MetalFacts("Darwin", "Apple M2 (the test's facts)", apple_gpu_family=8)


@pytest.fixture
def cache(bc, tmp_path):
    return bc.CheckCache(tmp_path / "lily" / "metal_check.json")


def check_on_msl_cpu(bc, **backend_options):
    return functools.partial(bc.known_answer_check, "msl-cpu", backend_options=backend_options or None)


def never():
    raise AssertionError("the known-answer check ran")


def choose(bc, facts, cache, check, **kw):
    return bc.choose_backend(facts, cache=cache, key=bc.check_key, check=check, **kw)


def test_no_metal_device_is_the_cpu_silently(bc, cache):
    for facts in (bc.MetalFacts("Linux", None, "no Metal: Linux"),
                  bc.MetalFacts("Darwin", None, "no Metal: the system has no Metal device")):
        choice = choose(bc, facts, cache, never)
        assert (choice.backend, choice.reason, choice.warning) == ("cpu", facts.problem, None)
    assert not cache.path.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="the facts of a Linux machine")
def test_linux_auto_is_the_cpu(bc, lily):
    assert bc.probe_metal() == bc.MetalFacts("Linux", None, "no Metal: Linux")
    assert lily._core.has_metal is False and lily._core.metal_device() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lily.Model.load()._engine.backend == "cpu"


def test_unusable_gpu_warns_and_uses_the_cpu(bc, cache):
    facts = bc.MetalFacts("Darwin", "unsupported Metal device",
                          "[metal] the GPU 'AMD Radeon Pro 5500M' lacks Metal 3 / Apple7 (M1 or later)")
    choice = choose(bc, facts, cache, never)
    assert choice.backend == "cpu"
    assert "AMD Radeon Pro 5500M" in choice.warning and "Apple7" in choice.warning


def test_passing_check_chooses_metal_then_is_read_from_the_cache(bc, lily, mac, cache):
    choice = choose(bc, mac, cache, check_on_msl_cpu(bc))
    check = choice.check
    assert (choice.backend, choice.warning, choice.cached) == ("metal", None, False), choice.reason
    assert check.passed and check.backend == "msl-cpu" and check.steps == bc.DECODE_STEPS
    assert check.max_rel_err <= bc.TOLERANCE and len(check.tokens) == bc.DECODE_STEPS
    statuses = {k["file"]: k["status"] for k in check.kernels}
    assert statuses["metal/quant_tensor.metal"] == "skipped"  # msl-cpu reports no Metal 4 here
    assert all(status == "ok" for f, status in statuses.items() if not f.endswith("_tensor.metal")), statuses
    assert json.loads(cache.path.read_text())["key"] == bc.check_key(mac.device)

    again = choose(bc, mac, cache, never)  # a cache hit: the check does not run
    assert (again.backend, again.cached, again.check) == ("metal", True, check)

    # The reference the check trusts, against mlx-lm: the CPU backend's logits over the prompt and
    # the check's greedy tokens, and those tokens, on the same bytes in fp32.
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load

    cpu = lily.Model.load(backend="cpu", cpu_matmul="f32")
    prompt = cpu.tokenizer.encode(bc.PROMPT)
    seq = np.array(prompt + check.tokens, dtype=np.int32)
    ref, _ = load(str(cpu.path))
    ref.update(tree_map(lambda x: x.astype(mx.float32) if x.dtype == mx.bfloat16 else x, ref.parameters()))
    want = np.array(ref(mx.array(seq)[None])[0].astype(mx.float32))[len(prompt) - 1:]
    got = cpu.logits(seq)[len(prompt) - 1:]
    assert rel_err(got, want) <= 1e-4
    clear = top1_margins(want) >= 2 * 1e-4 * np.abs(want).max()
    assert np.array_equal(want.argmax(-1)[:-1][clear[:-1]], np.array(check.tokens)[clear[:-1]])


@pytest.mark.parametrize("fault, named", [
    (dict(fail_dispatch="add_rms_norm"), ["raised", "add_rms_norm"]),
    (dict(fail_library="norm.metal"), ["did not compile", "metal/norm.metal"]),
], ids=["dispatch-raises", "library-does-not-compile"])
def test_failing_check_warns_and_uses_the_cpu(bc, mac, cache, fault, named):
    choice = choose(bc, mac, cache, check_on_msl_cpu(bc, **fault))
    assert choice.backend == "cpu" and not choice.check.passed
    for text in named + [mac.device]:
        assert text in choice.warning, choice.warning
    # The failure is cached too: the next load warns again without rerunning the check.
    again = choose(bc, mac, cache, never)
    assert again.backend == "cpu" and again.cached and "cached result" in again.warning
    assert again.check.reason == choice.check.reason
    # --recheck runs it again (now without the fault, so it passes).
    assert choose(bc, mac, cache, check_on_msl_cpu(bc), recheck=True).backend == "metal"


def test_wrong_kernel_fails_the_check_and_a_kernel_edit_invalidates_the_cache(bc, lily, mac, cache, tmp_path,
                                                                               monkeypatch):
    cache.store(bc.check_key(mac.device), bc.CheckResult(passed=True, reason="checked before", backend="metal",
                                                         device=mac.device))
    assert choose(bc, mac, cache, never).cached
    # The RMSNorm kernel's scale off by 1%: it compiles, and its answer is wrong.
    src = tmp_path / "src"
    (src / "metal").mkdir(parents=True)
    text = (ROOT / "metal" / "norm.metal").read_text()
    wrong = text.replace("const float r = 1.0f / sqrt(", "const float r = 1.01f / sqrt(")
    assert wrong != text
    (src / "metal" / "norm.metal").write_text(wrong)
    before = bc.kernel_hash()
    monkeypatch.setenv("LILY_SOURCE_DIR", str(src))
    assert bc.kernel_hash() != before
    choice = choose(bc, mac, cache, check_on_msl_cpu(bc))  # a miss: the kernels changed
    assert choice.backend == "cpu" and not choice.cached
    assert "differ from the CPU backend's" in choice.warning and choice.check.max_rel_err > 1e-2
    assert json.loads(cache.path.read_text())["key"]["kernels"] == bc.kernel_hash()  # the new entry


def test_cache_is_per_version_build_and_device(bc, lily, mac, cache, monkeypatch):
    runs = []

    def check():
        runs.append(1)
        return bc.CheckResult(passed=True, reason=f"run {len(runs)}", backend="metal", device=mac.device)

    assert choose(bc, mac, cache, check).check.reason == "run 1"
    assert choose(bc, mac, cache, check).cached and len(runs) == 1
    monkeypatch.setattr(lily, "__version__", lily.__version__ + ".post1")
    assert choose(bc, mac, cache, check).check.reason == "run 2"
    monkeypatch.setattr(bc, "build_hash", lambda: "another build")
    assert choose(bc, mac, cache, check).check.reason == "run 3"
    other = bc.MetalFacts("Darwin", "Apple M4 Max", apple_gpu_family=9)
    assert choose(bc, other, cache, check).check.reason == "run 4"
    assert choose(bc, other, cache, check).cached and len(runs) == 4


def test_a_check_that_killed_its_process_is_a_failure(bc, lily, mac, cache):
    """A check that takes its process down (a GPU fault; a hang killed by the user) must not take
    every later load down too: the next load finds it abandoned and uses the CPU."""
    crash = textwrap.dedent(f"""
        import os
        from lily import backend_choice as bc
        def check():
            os._exit(139)  # the process ends mid-check, as on a GPU fault
        bc.choose_backend(bc.MetalFacts("Darwin", {mac.device!r}), cache=bc.CheckCache({str(cache.path)!r}),
                          key=bc.check_key, check=check)
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(lily.__file__).parent.parent))
    p = subprocess.run([sys.executable, "-c", crash], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 139, p.stderr
    choice = choose(bc, mac, cache, never)
    assert choice.backend == "cpu" and "never finished" in choice.warning
    assert choose(bc, mac, cache, never).cached  # recorded as a failure
    # A check still running in a live process (this one) is not abandoned: the load checks too.
    cache.begin(bc.check_key(mac.device))
    passed = bc.CheckResult(passed=True, reason="ran", backend="metal", device=mac.device)
    assert choose(bc, mac, cache, lambda: passed).backend == "metal"


def test_corrupt_cache_is_a_miss(bc, mac, cache):
    cache.path.parent.mkdir(parents=True)
    for junk in ("{not json", "[]", '{"key": 1, "result": 2}'):
        cache.path.write_text(junk)
        result = bc.CheckResult(passed=False, reason="ran", backend="metal", device=mac.device)
        assert choose(bc, mac, cache, lambda r=result: r).check.reason == "ran"
        assert json.loads(cache.path.read_text())["result"]["reason"] == "ran"


def test_model_load_auto_warns_where_the_check_fails(bc, lily, mac, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(bc, "probe_metal", lambda: mac)
    monkeypatch.setattr(bc, "known_answer_check", check_on_msl_cpu(bc, fail_dispatch="add_rms_norm"))
    with pytest.warns(bc.BackendWarning, match="add_rms_norm") as caught:
        model = lily.Model.load()
    assert model._engine.backend == "cpu"
    assert caught[0].filename == __file__  # the warning points at the caller's load
    assert (tmp_path / "lily" / "metal_check.json").exists()


def test_model_load_auto_takes_metal_where_the_check_passes(bc, lily, mac, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(bc, "probe_metal", lambda: mac)
    monkeypatch.setattr(bc, "known_answer_check", check_on_msl_cpu(bc))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bc.auto_backend().backend == "metal"
    if not lily._core.has_metal:  # Model.load then asks this build for Metal, which it lacks
        with pytest.raises(lily.ConfigError, match="backend 'metal' needs a build on macOS"):
            lily.Model.load()
