"""What ``backend="auto"`` runs on, and the known-answer check that lets it choose Metal.

On a Mac whose GPU the Metal backend supports, "auto" is Metal only once every kernel library
the backend needs has compiled on that GPU and a few greedy decode steps of the embedded demo
model agree with the CPU backend (the tested reference) within the Metal path's tolerance.
The check's result is cached per lily version, native build, kernel sources and device
(:func:`check_key`), so it runs once after an install, a kernel edit or a new GPU, not at every
load; a check that killed its process (a GPU fault) counts as failed at the next load. Everywhere else "auto" is the CPU: silently where there is no Metal device (Linux, or a
Mac build without Metal), with a :class:`BackendWarning` naming the reason where there is one
that lily cannot use or that failed the check.

The decision (:func:`choose_backend`) takes the machine's facts (:class:`MetalFacts`), the cache
and the check as arguments, so the tests cover each branch on Linux with the real check run on
``backend="msl-cpu"``: the same host and dispatch sequence as Metal, its kernels executed on
the CPU (docs/metal.md, "Choosing the backend").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lily import _core

__all__ = [
    "BackendChoice",
    "BackendWarning",
    "CheckCache",
    "CheckResult",
    "MetalFacts",
    "auto_backend",
    "check_key",
    "choose_backend",
    "compile_kernels",
    "known_answer_check",
    "probe_metal",
]

# The check's tolerance on rel_err = max|gpu - cpu| / max|cpu| of every step's logits. The
# msl-cpu tests hold the Metal dispatch sequence to 1e-4 against the CPU backend with a float32
# KV cache and to 1e-3 with a float16 one (tests/test_metal_decode.py, test_half_precision_kv_
# cache); measured on the demo model with float32 KV: ~1e-6. A real GPU adds fast-math exp /
# rsqrt / division (a few ulp, ~1e-6 relative) and other summation orders, far below the
# f16-KV bound, so 1e-3 passes any KV type the backend defaults to, while a kernel or format
# error (a wrong scale group, nibble order, head mapping) is >= 1e-2 (tests/fixtures/cases.py).
TOLERANCE = 1e-3
# Greedy tokens must agree wherever the reference's top-1 margin is at least MARGIN_FACTOR *
# TOLERANCE * max|logits|: logits each within that tolerance cannot flip such a top-1, so a
# disagreement there is an error, never a near-tie broken the other way (as tests/fixtures/cases.py).
MARGIN_FACTOR = 2.0
PROMPT = "The quick brown fox jumps over the lazy dog. Metal, meet the CPU:"
DECODE_STEPS = 8
# The Metal 4 tensor-op libraries: compiled only where the GPU has tensor ops, and needed only
# where the prefill GEMMs chose them (a failure otherwise falls back to simdgroup_matrix).
TENSOR_LIBRARY_SUFFIX = "_tensor.metal"


class BackendWarning(RuntimeWarning):
    """backend="auto" could not use the GPU it found and runs on the CPU; the message says why."""


@dataclasses.dataclass(frozen=True)
class MetalFacts:
    """What this machine offers the Metal backend (:func:`probe_metal`; tests build their own).

    device: the default Metal device's name, None where there is none at all (then ``problem``
    says why: "no Metal: Linux"). problem: why lily cannot use it ("" where it can).
    """

    system: str
    device: str | None
    problem: str = ""
    apple_gpu_family: int = 0
    metal4: bool = False  # Metal 4 tensor ops (MSL 4.0 libraries)


@dataclasses.dataclass
class CheckResult:
    """One known-answer check of a GPU backend against the CPU backend on the demo model."""

    passed: bool
    reason: str  # one line: what was compared and how close it came, or what failed
    backend: str
    device: str
    tolerance: float = TOLERANCE
    max_rel_err: float | None = None  # over the prefill and every decode step
    steps: int = 0  # decode steps compared
    tokens: list[int] = dataclasses.field(default_factory=list)  # the CPU's greedy tokens, fed to both
    kernels: list[dict] = dataclasses.field(default_factory=list)  # compile_kernels' rows
    gemm_path: str = ""
    seconds: float = 0.0
    checked_at: str = ""  # UTC, ISO 8601

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CheckResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """What "auto" resolved to, why, and the warning to show (None: say nothing)."""

    backend: str
    reason: str
    warning: str | None = None
    check: CheckResult | None = None
    cached: bool = False  # the check's result came from the cache


# -- the machine -------------------------------------------------------------------------------


def probe_metal() -> MetalFacts:
    """This machine's facts: whether the build has Metal and the GPU it would run on."""
    system = platform.system()
    if not _core.has_metal:
        why = f"no Metal: {system}" if system != "Darwin" else "no Metal: this build of lily has none (LILY_METAL=OFF)"
        return MetalFacts(system, None, why)
    try:
        device = _core.metal_device()
    except _core.LilyError as e:  # a Metal GPU older than lily's kernels need (before Apple7 / M1)
        return MetalFacts(system, "unsupported Metal device", str(e))
    if device is None:
        return MetalFacts(system, None, "no Metal: the system has no Metal device")
    return MetalFacts(system, device.name, "", device.apple_gpu_family, device.supports_tensor_ops)


def kernel_files() -> list[str]:
    """The kernel libraries (metal/<name>.metal), as the backend compiles them."""
    return sorted(p for p in _core.msl_cpu.embedded_files() if p.startswith("metal/") and p.endswith(".metal"))


def kernel_hash() -> str:
    """SHA-256 of every kernel source and prelude the backends compile, as they read them now
    ($LILY_SOURCE_DIR overrides included): an edited kernel is a different kernel set."""
    h = hashlib.sha256()
    for path in sorted(_core.msl_cpu.embedded_files()):
        h.update(path.encode() + b"\0")
        h.update(_core.msl_cpu.source_file(path).encode() + b"\0")
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def build_hash() -> str:
    """SHA-256 of the native extension: the host's dispatch code is compiled into it, so a
    rebuild that changes it needs a new check even where the version and kernels did not change."""
    h = hashlib.sha256()
    with open(_core.__file__, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:32]


def check_key(device: str) -> dict:
    """What a cached check result is valid for: this lily, this build, these kernels, this GPU."""
    from lily import __version__

    return {"lily": __version__, "build": build_hash(), "kernels": kernel_hash(), "device": device}


# -- the cache ---------------------------------------------------------------------------------


def default_cache_path() -> Path:
    """$XDG_CACHE_HOME/lily/metal_check.json (~/.cache/lily/... without it)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "lily" / "metal_check.json"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class CheckCache:
    """The latest known-answer check, and the key it was made under, in one JSON file: its
    result, or while it runs the process running it.

    A lookup under any other key misses (a new version, build, kernel set or device checks
    again). A corrupt or unreadable file is a miss too: the check reruns and rewrites it.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else default_cache_path()

    def _entry(self, key: dict) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                entry = json.load(f)
        except (OSError, ValueError):
            return None
        return entry if isinstance(entry, dict) and entry.get("key") == key else None

    def load(self, key: dict) -> CheckResult | None:
        entry = self._entry(key)
        if entry is None or not isinstance(entry.get("result"), dict):
            return None
        try:
            return CheckResult.from_json(entry["result"])
        except TypeError:  # a result of another shape: a miss
            return None

    def begin(self, key: dict) -> None:
        """Records that this process is running the check under ``key``."""
        self._write({"key": key, "running": {"pid": os.getpid(), "since": _utc_now()}})

    def abandoned(self, key: dict) -> dict | None:
        """The record of a check under ``key`` whose process ended before it had a result (a
        GPU fault or hang that killed it), else None. A check still running elsewhere is not
        abandoned: that process may yet store its result."""
        entry = self._entry(key)
        running = entry.get("running") if entry else None
        if not isinstance(running, dict) or not isinstance(running.get("pid"), int):
            return None
        return None if _process_alive(running["pid"]) else running

    def store(self, key: dict, result: CheckResult) -> None:
        self._write({"key": key, "result": result.to_json()})

    def _write(self, entry: dict) -> None:
        """Writes atomically (a private file renamed over the old one): a concurrent load never
        reads half an entry. A cache that cannot be written is not an error: the next load
        checks again."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".metal_check.", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entry, f, indent=2)
            os.replace(tmp, self.path)
        except OSError:
            pass


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# -- the check ---------------------------------------------------------------------------------


def compile_kernels(device, *, tensor_ops: bool) -> list[dict]:
    """Compiles every kernel library on ``device`` (a lily._core.msl_cpu.Device: the Metal or
    MSL-on-CPU device of a loaded GPU backend) with the options the backend uses for it.

    Rows: file, language (MSL version), safe_math, status ("ok", "failed", or "skipped" for the
    Metal 4 tensor libraries on a GPU without tensor ops), detail (the compiler's error), seconds.
    """
    rows = []
    for path in kernel_files():
        name = path.removeprefix("metal/")
        language, safe_math = _core.msl_cpu.library_options(name)
        row: dict[str, Any] = {"file": path, "language": language, "safe_math": safe_math,
                               "status": "ok", "detail": "", "seconds": 0.0}
        if name.endswith(TENSOR_LIBRARY_SUFFIX) and not tensor_ops:
            row.update(status="skipped", detail="the GPU has no Metal 4 tensor ops")
            rows.append(row)
            continue
        t0 = time.perf_counter()
        try:
            device.library(_core.msl_cpu.kernel_source(name), path, language, safe_math)
        except _core.LilyError as e:
            row.update(status="failed", detail=str(e))
        row["seconds"] = round(time.perf_counter() - t0, 4)
        rows.append(row)
    return rows


def required_failures(kernels: list[dict], gemm_path: str) -> list[dict]:
    """The failed libraries the backend cannot do without: every one but the tensor-op GEMMs,
    which it uses only where the prefill GEMM path chose them."""
    uses_tensor = gemm_path.startswith("tensor")
    return [k for k in kernels if k["status"] == "failed"
            and (uses_tensor or not k["file"].endswith(TENSOR_LIBRARY_SUFFIX))]


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want.astype(np.float64))))


def known_answer_check(backend: str = "metal", *, backend_options: dict | None = None,
                       steps: int = DECODE_STEPS) -> CheckResult:
    """Runs the demo model on ``backend`` and on the CPU backend (f32 products, the reference),
    and compares: every kernel library compiles on the backend's device, then the prompt's
    logits and ``steps`` greedy decode steps (the CPU's tokens fed to both) agree within
    TOLERANCE, and so do their top-1 tokens wherever the CPU's margin rules out a near-tie.

    Never raises for what it finds wrong: any error of the backend is a failed result naming it.
    """
    from lily.model import Model

    t0 = time.perf_counter()
    result = CheckResult(passed=False, reason="", backend=backend, device="", steps=0, checked_at=_utc_now())

    def done(passed: bool, reason: str) -> CheckResult:
        result.passed, result.reason = passed, reason
        result.seconds = round(time.perf_counter() - t0, 3)
        return result

    reference = Model.load(backend="cpu", cpu_matmul="f32")
    try:
        model = Model.load(backend=backend, backend_options=backend_options)
        device = model._engine.gpu_device
        result.device = device.name
        result.gemm_path = model._engine.gpu_gemm_path
        result.kernels = compile_kernels(device, tensor_ops=device.supports_tensor_ops)
        failed = required_failures(result.kernels, result.gemm_path)
        if failed:
            return done(False, "kernels did not compile: " + "; ".join(f"{k['file']}: {k['detail']}" for k in failed))
        prompt = reference._need_tokenizer("the known-answer check").encode(PROMPT)
        ref, got = reference.session(len(prompt) + steps + 1), model.session(len(prompt) + steps + 1)
        want, have = ref.prefill(prompt), got.prefill(prompt)
        errors = []
        for step in range(steps + 1):
            where = "the prompt" if step == 0 else f"decode step {step}"
            err = _rel_err(have, want)
            errors.append(err)
            result.max_rel_err = max(errors)
            if not err <= TOLERANCE:  # NaN fails too
                return done(False, f"logits of {where} differ from the CPU backend's: rel err {err:.2e} > {TOLERANCE:.0e}")
            top2 = np.sort(want)[-2:]
            if top2[1] - top2[0] >= MARGIN_FACTOR * TOLERANCE * np.max(np.abs(want)) and have.argmax() != want.argmax():
                return done(False, f"greedy token of {where} is {int(have.argmax())}, the CPU backend's {int(want.argmax())}")
            if step == steps:
                break
            token = int(want.argmax())
            result.tokens.append(token)
            want, have = ref.decode(token), got.decode(token)
            result.steps = step + 1
    except Exception as e:  # whatever the backend raised, it must not be chosen
        return done(False, f"the {backend} backend raised {type(e).__name__}: {e}")
    return done(True, f"{steps} greedy decode steps of the demo model match the CPU backend "
                      f"(max rel err {result.max_rel_err:.1e} <= {TOLERANCE:.0e})")


# -- the decision ------------------------------------------------------------------------------


def choose_backend(facts: MetalFacts, *, cache: CheckCache, key: Callable[[str], dict],
                   check: Callable[[], CheckResult], recheck: bool = False) -> BackendChoice:
    """Metal where ``facts`` show a usable device and the known-answer check (cached under
    ``key(device)``, run by ``check`` on a miss or with ``recheck``) passed; else the CPU, with
    a warning wherever a Metal device exists (it was expected to be used)."""
    if facts.device is None:
        return BackendChoice("cpu", facts.problem)
    if facts.problem:
        return BackendChoice("cpu", facts.problem,
                             f"[load] backend='auto' runs on the CPU: the Metal backend cannot use this GPU ({facts.problem})")
    k = key(facts.device)
    result = None if recheck else cache.load(k)
    cached = result is not None
    if result is None and not recheck and (died := cache.abandoned(k)):
        # The last check on this GPU ended its process (a fault or a hang that was killed):
        # running it again would take this load down too.
        result = CheckResult(passed=False, backend="metal", device=facts.device, checked_at=died.get("since", ""),
                             reason=f"the check started by process {died['pid']} never finished (its process "
                                    f"ended during it: a GPU fault or hang)")
        cache.store(k, result)
        cached = True
    if result is None:
        cache.begin(k)
        result = check()
        cache.store(k, result)
    if result.passed:
        return BackendChoice("metal", f"the known-answer check passed on {facts.device}: {result.reason}",
                             check=result, cached=cached)
    when = f" (cached result of {result.checked_at}; `lily doctor --recheck` runs it again)" if cached else ""
    return BackendChoice(
        "cpu", f"the known-answer check failed on {facts.device}: {result.reason}",
        f"[load] backend='auto' runs on the CPU: the Metal known-answer check failed on {facts.device}: "
        f"{result.reason}{when}. backend='metal' still runs it if asked for by name.",
        check=result, cached=cached)


def auto_backend(*, recheck: bool = False, stacklevel: int = 2) -> BackendChoice:
    """What ``backend="auto"`` resolves to on this machine (warning where it falls back)."""
    choice = choose_backend(probe_metal(), cache=CheckCache(), key=check_key,
                            check=known_answer_check, recheck=recheck)
    if choice.warning:
        warnings.warn(choice.warning, BackendWarning, stacklevel=stacklevel + 1)
    return choice
