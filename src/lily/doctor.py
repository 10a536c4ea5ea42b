"""`lily doctor`: what lily finds on this machine and whether its GPU path works here.

One report, as text or JSON: the platform; the Metal device (name, Apple GPU family, Metal and
MSL versions) or why there is none ("no Metal: Linux"); what backend="auto" chooses and why; then
for the backend examined (auto's choice, or --backend) on the embedded demo model: the kernel
paths it chose and why, every kernel library's compile result on its device, the known-answer
check against the CPU backend (lily/backend_choice.py) and a short demo-model benchmark.

It runs on every backend: on Linux "cpu" (the default there), "msl-cpu" (the Metal backend's
host and kernels run by the MSL-on-CPU runtime) and "msl-cuda". The exit status is 1 when
backend="auto" passed over a Metal GPU it found, a kernel library the backend needs failed to
compile or the known-answer check failed (each listed under "problems").
"""

from __future__ import annotations

import json
import platform
import sys
import time
from typing import Any, TextIO

from lily import _core
from lily import backend_choice as bc

BENCH_PROMPT_TOKENS = 128
BENCH_DECODE_TOKENS = 32


def benchmark(model, seconds: float) -> dict:
    """Rounds of lily.bench (a fresh sequence prefills BENCH_PROMPT_TOKENS pseudo-random tokens,
    then decodes BENCH_DECODE_TOKENS greedily) until ``seconds`` have passed (at least one
    round); tokens per second over all rounds."""
    from lily.bench import bench

    rows: list[dict] = []
    t0 = time.perf_counter()
    while not rows or time.perf_counter() - t0 < seconds:
        rows += bench(model, [BENCH_PROMPT_TOKENS], decode_tokens=BENCH_DECODE_TOKENS, seed=len(rows))
    prefill_s = sum(r["prefill_s"] for r in rows)
    decode_s = sum(r["decode_s"] for r in rows)
    return {"seconds": round(time.perf_counter() - t0, 3), "rounds": len(rows),
            "prompt_tokens": BENCH_PROMPT_TOKENS, "decode_tokens": BENCH_DECODE_TOKENS,
            "prefill_tok_s": round(len(rows) * BENCH_PROMPT_TOKENS / prefill_s, 1),
            "decode_tok_s": round(len(rows) * BENCH_DECODE_TOKENS / decode_s, 1),
            "ttft_ms": round(min(r["ttft_ms"] for r in rows), 2)}


def _msl_versions(tensor_ops: bool) -> list[str]:
    """The MSL versions lily compiles libraries as on a device: 3.1 everywhere, 4.0 for the
    tensor-op libraries where the device has Metal 4."""
    return ["3.1", "4.0"] if tensor_ops else ["3.1"]


def _metal_section(facts: bc.MetalFacts) -> dict:
    if facts.device is None or facts.problem:
        return {"present": facts.device is not None, "usable": False, "device": facts.device, "reason": facts.problem}
    return {"present": True, "usable": True, "device": facts.device, "reason": "",
            "apple_gpu_family": f"Apple{facts.apple_gpu_family}",
            "metal": "Metal 4" if facts.metal4 else "Metal 3", "msl": _msl_versions(facts.metal4)}


def diagnose(backend: str = "auto", *, seconds: float = 5.0, recheck: bool = False) -> dict:
    """The report as a dict (what --json prints)."""
    from lily import __version__
    from lily.model import BACKENDS, Model

    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"[doctor] unknown backend {backend!r}; available: auto, {', '.join(BACKENDS)}")
    if seconds < 0:
        raise ValueError("[doctor] --seconds must not be negative")
    facts = bc.probe_metal()
    choice = bc.choose_backend(facts, cache=bc.CheckCache(), key=bc.check_key,
                               check=bc.known_answer_check, recheck=recheck)
    report: dict[str, Any] = {
        "lily": {"version": __version__, "extension": _core.__file__, "build": bc.build_hash(),
                 "kernels": bc.kernel_hash()},
        "platform": {"system": platform.system(), "machine": platform.machine(),
                     "release": platform.mac_ver()[0] or platform.release(), "python": platform.python_version()},
        "metal": _metal_section(facts),
        "auto": {"backend": choice.backend, "reason": choice.reason, "warning": choice.warning,
                 "check_cached": choice.cached, "cache": str(bc.CheckCache().path)},
    }
    name = choice.backend if backend == "auto" else backend
    model = Model.load(backend=name)
    engine = model._engine
    section: dict[str, Any] = {"name": name, "model": repr(model)}
    if name == "cpu":
        why = ("int8 activations, integer dot products: this CPU has the kernels" if engine.cpu_matmul == "int8"
               else "f32: this build has no integer kernels for this CPU")
        section.update(device=f"{platform.machine()} CPU", threads=engine.threads,
                       kernel_paths={"cpu_matmul": f"{why} (cpu_matmul='auto')"})
        report["kernels"] = []
        report["check"] = {"passed": None, "reason": "the CPU backend is the reference the check compares "
                                                     "against"}
    else:
        device = engine.gpu_device
        section.update(device=device.name, apple_gpu_family=f"Apple{device.apple_gpu_family}",
                       metal4=device.supports_tensor_ops, msl=_msl_versions(device.supports_tensor_ops),
                       working_set_bytes=device.recommended_max_working_set_size,
                       kernel_paths={"prefill_gemm": engine.gpu_gemm_path})
        report["kernels"] = bc.compile_kernels(device, tensor_ops=device.supports_tensor_ops)
        if name == "metal" and choice.check is not None:
            check = choice.check  # auto's check of this same device (cached, or run just now)
        else:
            check = bc.known_answer_check(name)
        report["check"] = check.to_json()
    report["backend"] = section
    report["benchmark"] = benchmark(model, seconds)
    # What makes the exit status 1: the Metal GPU found but not chosen, a library the backend
    # needs that did not compile, a failed check.
    problems = [choice.warning] if choice.warning else []
    problems += [f"{k['file']} did not compile: {k['detail']}"
                 for k in bc.required_failures(report["kernels"], section["kernel_paths"].get("prefill_gemm", ""))]
    if report["check"]["passed"] is False:
        problems.append(f"the known-answer check failed on {name}: {report['check']['reason']}")
    report["problems"] = problems
    report["ok"] = not problems
    return report


def print_report(report: dict, file: TextIO | None = None) -> None:
    out = file or sys.stdout

    def line(label: str, text: Any) -> None:
        print(f"{label:<26} {text}", file=out)

    lily_, plat, metal, auto, back = report["lily"], report["platform"], report["metal"], report["auto"], report["backend"]
    line("lily", f"{lily_['version']} (build {lily_['build'][:12]}, kernels {lily_['kernels'][:12]})")
    line("platform", f"{plat['system']} {plat['release']} {plat['machine']}, Python {plat['python']}")
    if metal["usable"]:
        line("metal", f"{metal['device']}: {metal['apple_gpu_family']}, {metal['metal']}, "
                      f"MSL {' / '.join(metal['msl'])}")
    else:
        line("metal", metal["reason"])
    line("auto backend", f"{auto['backend']}: {auto['reason']}" + (" (cached)" if auto["check_cached"] else ""))
    line("backend", f"{back['name']} on {back['device']}")
    if "apple_gpu_family" in back:
        line("gpu", f"{back['apple_gpu_family']}, Metal 4 tensor ops: {'yes' if back['metal4'] else 'no'}, "
                    f"MSL {' / '.join(back['msl'])}")
    for what, why in back.get("kernel_paths", {}).items():
        line(f"  {what}", why)
    for k in report["kernels"]:
        status = {"ok": f"ok ({k['seconds']:.2f} s)", "skipped": f"skipped: {k['detail']}",
                  "failed": f"FAILED: {k['detail']}"}[k["status"]]
        line(f"  {k['file'].removeprefix('metal/')}", f"MSL {k['language']}{', safe math' if k['safe_math'] else ''}: {status}")
    check = report["check"]
    verdict = "n/a" if check["passed"] is None else "passed" if check["passed"] else "FAILED"
    line("known-answer", f"{verdict}: {check['reason']}")
    b = report["benchmark"]
    line("benchmark", f"{b['rounds']} rounds in {b['seconds']:.1f} s: prefill {b['prefill_tok_s']:.1f} tok/s "
                      f"({b['prompt_tokens']}-token prompts), decode {b['decode_tok_s']:.1f} tok/s, "
                      f"ttft {b['ttft_ms']:.1f} ms")
    line("result", "ok" if report["ok"] else f"{len(report['problems'])} problem(s):")
    for problem in report["problems"]:
        print(f"  - {problem}", file=out)


def main(args) -> int:
    report = diagnose(args.backend, seconds=args.seconds, recheck=args.recheck)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["ok"] else 1
